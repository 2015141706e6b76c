"""`ggufpy bench --server`: the commands that start both servers and the table of results (the measurement
itself starts two servers and takes minutes: docs/server.md has a run)."""

from __future__ import annotations

import argparse

from ggufpy.cli import bench as bench_cli
from ggufpy.server import bench


def test_commands_bind_loopback_with_the_same_threads():
    cmds = bench._commands("/models/a b.gguf", threads=3, parallel=8, ctx=256, port=9000)
    ours, theirs = cmds["ggufpy"], cmds["llama-cpp-python"]
    assert ours[1:4] == ["-m", "ggufpy", "serve"] and ours[ours.index("-m", 2) + 1] == "/models/a b.gguf"
    assert ours[ours.index("--parallel") + 1] == "8" and ours[ours.index("--port") + 1] == "9000"
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
