"""Decode and prefill speed of ggufpy (numba and NumPy backends) against llama.cpp, in one run.

For each model, the engines are timed in alternating rounds on the same prompt tokens and the best round of
each is kept; ratios are ggufpy / llama.cpp (llama-cpp-python, same thread count). Optional sections: matvec
micro-benchmarks per quant type, peak RSS of a fresh process running the numba backend, and kernel start-up
time with a cold and a warm numba cache.

    python scripts/bench_kernels.py                                  # SmolLM2 Q4_1, Q8_0 and Q4_K_M
    python scripts/bench_kernels.py --models smollm2 --rounds 5 --micro --rss --compile --json out.json

Q8_0 and Q4_K_M are SmolLM2 requantized by llama.cpp (cached in ~/.cache/ggufpy/bench); gemma3 is Gemma 3 270M
Q4_K_M. Machine load only ever slows a run down, so more rounds give steadier ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from ggufpy.constants import GGMLType
from ggufpy.kernels import bench
from ggufpy.packaged import ModelNotInstalledError, gemma3_path, smollm2_path
from ggufpy.quants import quant_type

VARIANTS = {"smollm2": None, "smollm2-q8_0": "Q8_0", "smollm2-q4_k_m": "Q4_K_M", "gemma3": None}
MICRO_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"]
MICRO_SHAPES = [(1536, 576), (576, 1536), (640, 2048), (49152, 576)]


def model_path(name: str):
    if name == "gemma3":
        return gemma3_path()
    base = smollm2_path()
    ftype = VARIANTS[name]
    return base if ftype is None else bench.requantized(base, ftype)


def compare(path, args) -> dict:
    numba_model = bench.load_model(path, "numba", threads=args.threads)
    numpy_model = bench.load_model(path, "numpy") if args.numpy else None
    prompt = bench.prompt_tokens(args.prompt, numba_model.config.vocab_size)
    bench.time_ggufpy(numba_model, prompt[:20], 2)  # compile / load every kernel first
    runs: dict[str, list] = {"numba": [], "llama.cpp": [], "numpy": []}
    for _ in range(args.rounds):
        runs["numba"].append(bench.time_ggufpy(numba_model, prompt, args.decode))
        if bench.llamacpp_available():
            runs["llama.cpp"].append(bench.time_llamacpp(path, prompt, args.decode, args.threads))
        if numpy_model is not None:
            runs["numpy"].append(bench.time_ggufpy(numpy_model, prompt, max(4, args.decode // 8)))
    best = {k: bench.best_of(v) for k, v in runs.items() if v}
    out = {"path": str(path), "file_bytes": os.path.getsize(path)}
    for engine, s in best.items():
        out[engine] = {"prefill": round(s.prefill, 1), "decode": round(s.decode, 2)}
        if "llama.cpp" in best and engine != "llama.cpp":
            ref = best["llama.cpp"]
            out[engine]["prefill_ratio"] = round(s.prefill / ref.prefill, 3)
            out[engine]["decode_ratio"] = round(s.decode / ref.decode, 3)
    out["packed_bytes"] = numba_model.backend.packed_bytes
    return out


def table(results: dict) -> str:
    lines = [
        "| model | engine | prefill tok/s | decode tok/s | prefill ratio | decode ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        for engine in ("numba", "numpy", "llama.cpp"):
            if engine in r:
                e = r[engine]
                ratios = [f"{e[k]:.2f}x" if k in e else "-" for k in ("prefill_ratio", "decode_ratio")]
                lines.append(f"| {name} | {engine} | {e['prefill']:.0f} | {e['decode']:.1f} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (prefill)")
    ap.add_argument("--decode", type=int, default=64, help="generated tokens (decode)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-numpy", dest="numpy", action="store_false", help="skip the (slow) NumPy backend")
    ap.add_argument("--micro", action="store_true", help="matvec GMAC/s per quant type")
    ap.add_argument("--rss", action="store_true", help="peak RSS of a fresh process on the numba backend")
    ap.add_argument("--compile", action="store_true", help="cold and warm numba start-up")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    report: dict = {"date": datetime.date.today().isoformat(), "threads": args.threads, "models": {}}
    if not bench.llamacpp_available():
        print("llama-cpp-python is not installed: no ratios", file=sys.stderr)
    for name in args.models:
        try:
            path = model_path(name)
        except (ModelNotInstalledError, ImportError, RuntimeError) as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        report["models"][name] = compare(path, args)
        if args.rss:
            child = bench.run_child(path, "numba", args.threads)
            report["models"][name]["peak_rss_bytes"] = child["peak_rss"]
            report["models"][name]["rss_over_file"] = round(child["peak_rss"] / os.path.getsize(path), 2)
    print(table(report["models"]))
    if args.rss:
        base = bench.runtime_rss()
        report["runtime_rss_bytes"] = base
        print("\n| model | file MiB | packed MiB | peak RSS MiB | RSS / file | (RSS - runtime) / file |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, r in report["models"].items():
            mib = [r["file_bytes"] >> 20, r["packed_bytes"] >> 20, r["peak_rss_bytes"] >> 20]
            model_part = (r["peak_rss_bytes"] - base) / r["file_bytes"]
            print(f"| {name} | {mib[0]} | {mib[1]} | {mib[2]} | {r['rss_over_file']:.2f}x | {model_part:.2f}x |")
        print(f"runtime alone (Python, NumPy, numba/LLVM, compiled kernels): {base >> 20} MiB")
    if args.compile:
        report["compile"] = bench.compile_times(model_path(args.models[0]), args.threads)
        c = report["compile"]
        print(f"\nstart-up: first forward {c['cold_first_call_s']:.1f} s with an empty numba cache, ")
        print(f"{c['warm_first_call_s']:.2f} s with a warm one (repacking at load: {c['warm_load_s']:.2f} s)")
    if args.micro:
        report["micro"] = []
        print("\n| type | rows x cols | GMAC/s | GB/s of file data |\n| --- | --- | ---: | ---: |")
        for t in MICRO_TYPES:
            for rows, cols in MICRO_SHAPES:
                if cols % quant_type(GGMLType[t]).block_size:
                    continue
                gmac, gbs = bench.matvec_speed(GGMLType[t], rows, cols, threads=args.threads)
                report["micro"].append({"type": t, "rows": rows, "cols": cols, "gmac_s": gmac, "gb_s": gbs})
                print(f"| {t} | {rows} x {cols} | {gmac:.1f} | {gbs:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
