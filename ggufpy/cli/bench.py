"""`ggufpy bench`: prefill and decode speed of ggufpy's backends and of llama.cpp, side by side in one run.

Every engine runs in a fresh process on the same prompt tokens with the same thread count, so load time and
peak RSS are its own; ratios are ggufpy / llama.cpp. Machines are noisy: compare ratios within a run, not
absolute numbers across runs, and use --rounds to keep the best of several.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from ..server.bench import ENGINES as SERVER_ENGINES
from . import NUMERICS_MODES, note_numerics

# llama.cpp in a child process, mirroring `ggufpy.kernels.bench.run_child` for ggufpy
_LLAMACPP_CHILD = """
import json, sys, time
from ggufpy.kernels import bench
path, threads, n_prompt, n_decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import llama_cpp
import numpy as np
n_ctx = int(2 ** np.ceil(np.log2(n_prompt + n_decode + 8)))  # as bench.time_llamacpp sizes it
t0 = time.perf_counter()
llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=max(512, n_prompt), n_threads=threads,
                      n_threads_batch=threads, verbose=False)
load_s = time.perf_counter() - t0
prompt = bench.prompt_tokens(n_prompt, llm.n_vocab())
bench._LLAMAS[(path, threads, n_ctx)] = llm  # time_llamacpp reuses the instance timed above
speed = bench.time_llamacpp(path, prompt, n_decode, threads)
print(json.dumps({"load_s": load_s, "prefill": speed.prefill, "decode": speed.decode, "peak_rss": bench.peak_rss()}))
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="prefill/decode speed against llama.cpp", description=__doc__)
    p.add_argument("-m", "--model", default=None, help="GGUF file or packaged model name (default: SmolLM2-135M)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--backend", nargs="+", default=["numba", "numpy"], help="ggufpy backends to time")
    p.add_argument("--against-llamacpp", action="store_true", help="also time llama.cpp (llama-cpp-python)")
    p.add_argument("--rounds", type=int, default=1, help="runs per engine; the best is kept")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--numerics",
        default="exact",
        choices=NUMERICS_MODES,
        help="the ggufpy engines' numerics, `ggufpy serve`'s with --server (default exact)",
    )
    p.add_argument(
        "--server",
        action="store_true",
        help="aggregate decode throughput of `ggufpy serve`, llama-cpp-python's server and llama.cpp's batched "
        "decode with --streams concurrent streams",
    )
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8], help="concurrent clients (--server)")
    p.add_argument(
        "--engines",
        nargs="+",
        default=list(SERVER_ENGINES),
        choices=SERVER_ENGINES,
        help="--server: the engines to measure, ggufpy's ratios taken to each other one (default: all three)",
    )
    p.set_defaults(func=run)


def llamacpp_child(path, threads: int, n_prompt: int, n_decode: int) -> dict:
    """llama.cpp (llama-cpp-python) loaded and timed in a fresh process, as `bench.run_child` does ggufpy."""
    args = [str(path), str(threads), str(n_prompt), str(n_decode)]
    done = subprocess.run([sys.executable, "-c", _LLAMACPP_CHILD, *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp benchmark failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _best(runs: list[dict]) -> dict:
    best = dict(runs[0])
    for r in runs[1:]:
        best["prefill"], best["decode"] = max(best["prefill"], r["prefill"]), max(best["decode"], r["decode"])
        best["load_s"], best["peak_rss"] = min(best["load_s"], r["load_s"]), min(best["peak_rss"], r["peak_rss"])
    return best


def run(args: argparse.Namespace) -> int:
    from ..kernels import bench
    from ..loading import resolve_model_path

    path = resolve_model_path(args.model)
    if args.server:
        return _servers(path, args)
    n_prompt, n_decode = args.prompt_tokens, args.gen_tokens
    note_numerics(args.numerics)
    results: dict[str, dict] = {}
    engines = list(args.backend)
    if args.against_llamacpp:
        if not bench.llamacpp_available():
            print("ggufpy: error: --against-llamacpp needs llama-cpp-python (pip install 'ggufpy[conformance]')",
                  file=sys.stderr)  # fmt: skip
            return 2
        engines.append("llama.cpp")
    for _ in range(args.rounds):
        for engine in engines:
            if engine == "llama.cpp":
                r = llamacpp_child(path, args.threads, n_prompt, n_decode)
            else:
                r = bench.run_child(path, engine, args.threads, n_prompt, n_decode, numerics=args.numerics)
            results.setdefault(engine, []).append(r)
    best = {engine: _best(runs) for engine, runs in results.items()}
    ref = best.get("llama.cpp")
    for engine, r in best.items():
        if ref and engine != "llama.cpp":
            r["prefill_ratio"] = r["prefill"] / ref["prefill"]
            r["decode_ratio"] = r["decode"] / ref["decode"]
        r["rss_over_file"] = r["peak_rss"] / os.path.getsize(path)

    if args.json:
        report = {"model": str(path), "threads": args.threads, "prompt_tokens": n_prompt, "gen_tokens": n_decode}
        print(json.dumps({**report, "engines": best}, indent=1))
        return 0
    print(f"{path.name}: {n_prompt}-token prompt, {n_decode} generated tokens, {args.threads} threads")
    print("| engine | load s | prefill tok/s | decode tok/s | peak RSS MiB | RSS/file | prefill ratio | decode ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for engine, r in best.items():
        ratios = [f"{r[k]:.2f}x" if k in r else "-" for k in ("prefill_ratio", "decode_ratio")]
        print(
            f"| {engine} | {r['load_s']:.2f} | {r['prefill']:.1f} | {r['decode']:.1f} | {r['peak_rss'] / 2**20:.0f} "
            f"| {r['rss_over_file']:.2f} | {' | '.join(ratios)} |"
        )
    return 0


def _servers(path, args: argparse.Namespace) -> int:
    """`--server`: the engines on the same model and threads, one run, ratios printed (docs/server.md)."""
    from ..kernels import bench
    from ..server import bench as server_bench

    engines = ["ggufpy", *(e for e in args.engines if e != "ggufpy")]  # ggufpy first: the ratios are its
    others = [e for e in engines if e != "ggufpy"]
    if others and not bench.llamacpp_available():
        print(f"ggufpy: error: --server's engines {', '.join(others)} need llama-cpp-python "
              "(pip install 'llama-cpp-python[server]'), or measure ggufpy alone with --engines ggufpy",
              file=sys.stderr)  # fmt: skip
        return 2
    results = server_bench.run(
        path, args.streams, args.gen_tokens, args.threads, engines, rounds=args.rounds, numerics=args.numerics
    )
    if args.json:
        report = {"model": str(path), "threads": args.threads, "gen_tokens": args.gen_tokens}
        print(json.dumps({**report, "numerics": args.numerics, **results}))
        return 0
    print(f"{path.name}: {args.gen_tokens} tokens per request, {args.threads} threads, concurrent clients, "
          f"ggufpy in the {args.numerics} numerics")  # fmt: skip
    print(server_bench.table(results))
    return 0
