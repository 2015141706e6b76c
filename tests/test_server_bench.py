"""`ggufpy bench --server`: the commands that start both servers and the table of results (the measurement
itself starts two servers and takes minutes: docs/server.md has a run)."""

from __future__ import annotations

import argparse

import pytest

from ggufpy.cli import bench as bench_cli
from ggufpy.server import bench


def test_commands_bind_loopback_with_the_same_threads():
    cmds = bench._commands("/models/a b.gguf", threads=3, parallel=8, ctx=256, port=9000)
    ours, theirs = cmds["ggufpy"], cmds["llama-cpp-python"]
    assert ours[1:4] == ["-m", "ggufpy", "serve"] and ours[ours.index("-m", 2) + 1] == "/models/a b.gguf"
    assert ours[ours.index("--parallel") + 1] == "8" and ours[ours.index("--port") + 1] == "9000"
    assert ours[ours.index("--numerics") + 1] == "exact"
    ours = bench._commands("m.gguf", threads=3, parallel=8, ctx=256, port=9000, numerics="llamacpp-avx2")["ggufpy"]
    assert ours[ours.index("--numerics") + 1] == "llamacpp-avx2"
    assert theirs[theirs.index("--model") + 1] == "/models/a b.gguf"
    assert theirs[theirs.index("--host") + 1] == "127.0.0.1"
    assert theirs[theirs.index("--n_threads") + 1] == "3"
    assert theirs[theirs.index("--interrupt_requests") + 1] == "False"  # a new request must not abort the others


def test_table_ratios():
    rows = lambda rates: [{"streams": b, "tok_s": r} for b, r in zip((1, 4, 8), rates, strict=True)]  # noqa: E731
    text = bench.table({"ggufpy": rows([10.0, 20.0, 40.0]), "llama-cpp-python": rows([50.0, 50.0, 20.0])})
    lines = text.splitlines()
    head = "| streams | ggufpy tok/s | llama-cpp-python tok/s | ggufpy vs 1 stream | ggufpy / llama-cpp-python |"
    assert lines[0] == head
    assert lines[2] == "| 1 | 10.0 | 50.0 | 1.00x | 0.20x |"
    assert lines[4] == "| 8 | 40.0 | 20.0 | 4.00x | 2.00x |"
    # llama-cpp-python serves one request at a time: its best row (50 tok/s) is its ceiling at any concurrency
    assert (
        "llama-cpp-python's best at any concurrency (50.0 tok/s): 1 streams 0.20x, 4 streams 0.40x, 8 streams 0.80x"
        in text
    )


def test_flags():
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--server", "--streams", "1", "2"])
    assert args.server and args.streams == [1, 2]
    assert parser.parse_args(["bench"]).streams == [1, 4, 8]


def test_table_reports_each_rounds_ratio():
    def rows(rounds):
        return [{"streams": b, "tok_s": max(r), "rounds_tok_s": r} for b, r in zip((1, 8), rounds, strict=True)]

    text = bench.table(
        {"ggufpy": rows([[10.0, 12.0], [40.0, 36.0]]), "llama-cpp-python": rows([[20.0, 10.0], [10.0, 12.0]])}
    )
    lines = text.splitlines()
    assert lines[3] == "| 8 | 40.0 | 12.0 | 3.33x | 3.33x |"  # each engine's best of its rounds
    # round by round, each engine's figure against the other's taken right after it
    assert lines[-1].endswith("1 streams 0.50x, 1.20x; 8 streams 4.00x, 3.00x")


def test_table_with_llamacpp_batched():
    rows = lambda rates: [{"streams": b, "tok_s": r} for b, r in zip((1, 8), rates, strict=True)]  # noqa: E731
    results = {
        "ggufpy": rows([10.0, 25.0]),
        "llama-cpp-python": rows([12.0, 8.0]),
        "llama.cpp batched": rows([11.0, 16.5]),
    }
    lines = bench.table(results).splitlines()
    assert lines[0] == (
        "| streams | ggufpy tok/s | llama-cpp-python tok/s | llama.cpp batched tok/s | ggufpy vs 1 stream "
        "| llama.cpp batched vs 1 stream | ggufpy / llama-cpp-python | ggufpy / llama.cpp batched |"
    )
    # llama.cpp's own batching gain (16.5 / 11 = 1.50x) beside ggufpy's (2.50x); ratios to each engine
    assert lines[3] == "| 8 | 25.0 | 8.0 | 16.5 | 2.50x | 1.50x | 3.12x | 1.52x |"
    assert "llama-cpp-python's best at any concurrency (12.0 tok/s): 1 streams 0.83x, 8 streams 2.08x" in lines[5]


def test_batched_engine_command():
    argv = bench._batched_command("/models/a b.gguf", streams=8, gen_tokens=16, threads=3, eog=[2, 7])
    assert argv[1:4] == ["-m", "ggufpy.server.bench_llamacpp", "/models/a b.gguf"]
    assert argv[argv.index("--threads") + 1] == "3" and argv[argv.index("--streams") + 1] == "8"
    assert argv[argv.index("--gen-tokens") + 1] == "16" and argv[argv.index("--eog") + 1 :] == ["2", "7"]


def test_engine_flag():
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["bench"]).engines == ["ggufpy", "llama-cpp-python", "llama.cpp batched"]
    assert parser.parse_args(["bench", "--engines", "llama.cpp batched"]).engines == ["llama.cpp batched"]


def test_batched_engine_is_llamacpps_own_greedy_decode():
    """Live (llama-cpp-python installed): one sequence through the batched driver is llama.cpp's own greedy
    completion of the same prompt; two sequences decoded together each make all their tokens, none of them banned."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from ggufpy.packaged import smollm2_path
    from ggufpy.server import bench_llamacpp

    path = smollm2_path()
    one = bench_llamacpp.measure(path, streams=1, gen_tokens=8, threads=2, eog=[2])
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=False)
    ref = llm.create_completion("Story number 0: once upon a time", max_tokens=8, temperature=0, logit_bias={2: -1e9})
    assert llm.detokenize(one["ids"][0]).decode() == ref["choices"][0]["text"]
    two = bench_llamacpp.measure(path, streams=2, gen_tokens=8, threads=2, eog=[2])
    assert two["tokens"] == 16 and [len(ids) for ids in two["ids"]] == [8, 8]
    assert 2 not in two["ids"][0] + two["ids"][1] and two["tok_s"] == 16 / two["seconds"]


def test_other_engines_need_llamacpp(monkeypatch, capsys, tmp_path):
    """Without llama-cpp-python, asking for its engines is a clear error that names them and the way out."""
    from ggufpy.kernels import bench as kernels_bench

    monkeypatch.setattr(kernels_bench, "llamacpp_available", lambda: False)
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--server", "--engines", "ggufpy", "llama.cpp batched"])
    assert bench_cli._servers(tmp_path / "m.gguf", args) == 2
    err = capsys.readouterr().err
    assert "llama.cpp batched need llama-cpp-python" in err and "--engines ggufpy" in err
