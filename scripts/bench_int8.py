"""The numerics side by side with llama.cpp, in one process, alternating rounds: numba in the exact numerics
(f32 kernels), numba in the llamacpp numerics with the integer dot products (`kernels/int8dot.py`; `-rows`: Q4_0
and Q4_K read as the GGUF rows, not in eight-row groups) and without them (the f32-lane kernels on int8
activations), and llama.cpp (llama-cpp-python, `Llama.eval`).

    python scripts/bench_int8.py [-m FILE ...] [--rounds 3] [--prompt-tokens 128] [--gen-tokens 32] [--threads 2]
                                 [--engines exact llamacpp llamacpp-rows llamacpp-f32 llama.cpp] [--micro]

Default models: SmolLM2 Q4_1 (packaged) and Gemma 3 270M. Each engine is loaded once (weights prepared up front)
and warmed up; then every round times each engine in turn (prefill of the prompt, then single-token decode
steps) and the best round per engine is kept: other processes only ever slow a round down. Prints the load
average before and after, since 2 cores shared with other work make every figure noisy. `--micro`: per-kernel
decode matvec times (one process, alternating, best of N) of the f32-lane and integer kernels.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

import numpy as np

from ggufpy.kernels import bench

ENGINES = ("exact", "llamacpp", "llamacpp-rows", "llamacpp-f32", "llama.cpp")


def load_average() -> str:
    return " / ".join(f"{v:.2f}" for v in os.getloadavg())


def _ggufpy(path: Path, engine: str, threads: int):
    from ggufpy.kernels import int8dot

    numerics = "exact" if engine == "exact" else "llamacpp"
    weight = int8dot.weight
    if engine == "llamacpp-rows":  # the integer kernels on the GGUF rows as stored: no eight-row groups
        int8dot.weight = functools.partial(weight, interleave=False)
    try:  # every weight is prepared here (`bench.load_model`), so the patch covers them all
        model = bench.load_model(path, "numba", threads=threads, numerics=numerics, int8=engine != "llamacpp-f32")
    finally:
        int8dot.weight = weight
    return lambda prompt, n: bench.time_ggufpy(model, prompt, n)


def _cpu_seconds(timer):
    """`timer` (prompt, n) -> Speed, with the process's CPU seconds instead of the wall clock: on a machine
    shared with other work, one thread's CPU time is its work, not its wait for a time slice."""

    def timed(prompt, n):
        clock = time.perf_counter
        time.perf_counter = time.process_time
        try:
            return timer(prompt, n)
        finally:
            time.perf_counter = clock

    return timed


def run_model(path: Path, engines, rounds: int, n_prompt: int, n_decode: int, threads: int, cpu: bool) -> dict:
    timers, load_s = {}, {}
    for engine in engines:
        t0 = time.perf_counter()
        if engine == "llama.cpp":
            timers[engine] = lambda prompt, n, p=path: bench.time_llamacpp(p, prompt, n, threads)
        else:
            timers[engine] = _ggufpy(path, engine, threads)
        if cpu:
            timers[engine] = _cpu_seconds(timers[engine])
        load_s[engine] = time.perf_counter() - t0
    import ggufpy

    vocab = ggufpy.open(path).metadata.get("tokenizer.ggml.tokens")
    prompt = bench.prompt_tokens(n_prompt, len(vocab) if vocab is not None else 256)
    for engine in engines:  # compile / warm up
        timers[engine](prompt[:20], 2)
    best = {e: [] for e in engines}
    for _ in range(rounds):
        for engine in engines:
            best[engine].append(timers[engine](prompt, n_decode))
    return {e: bench.best_of(s) for e, s in best.items()} | {"_load": load_s}


def micro(threads: int, rounds: int = 7, n_rows: int = 1) -> None:
    """Decode matvec (one activation row; `n_rows` > 1: a prefill of that many) at Llama-3.2-1B's shapes:
    f32-lane vs integer kernels, llamacpp numerics. Timed in CPU seconds of this process (`time.process_time`):
    on a shared machine the wall clock of a fork-join kernel mostly measures waiting for a time slice; on one
    thread CPU time is the work."""
    from ggufpy.constants import GGMLType
    from ggufpy.kernels import int8dot
    from ggufpy.kernels.backend import NumbaBackend
    from ggufpy.numerics import NUMERICS
    from ggufpy.weights import QuantTensor

    f32 = NumbaBackend(NUMERICS["llamacpp"], threads=threads, adaptive=False, int8=False)
    rng = np.random.default_rng(0)
    print(f"{threads} thread(s), {n_rows} activation row(s); CPU ms per product; GB/s of file data per thread")
    print("| type | shape | f32-lane kernels | integer kernels | speed-up | integer GB/s | integer GMAC/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K):
        _, size, block = int8dot.INT8_TYPES[t]
        for rows, cols in ((2048, 2048), (8192, 2048), (2048, 8192)):
            n = rows * cols // block
            blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
            blocks[:, 0:4] = 0x20  # small finite fp16 scales (Q6_K's d is at the end: random but finite)
            if t == GGMLType.Q6_K:
                blocks[:, 208:210] = 0x20
            w = QuantTensor("w", t, (rows, cols), blocks.reshape(-1))
            iw = int8dot.weight(w)
            x = rng.standard_normal((n_rows, cols)).astype(np.float32)
            f32.linear(x, w)
            int8dot.linear(x, iw, threads)
            times = {"f32": [], "int8": []}
            for _ in range(rounds):
                fns = (
                    ("f32", lambda x=x, w=w: f32.linear(x, w)),
                    ("int8", lambda x=x, iw=iw: int8dot.linear(x, iw, threads)),
                )
                for name, fn in fns:
                    t0 = time.process_time()
                    for _ in range(10):
                        fn()
                    times[name].append((time.process_time() - t0) / 10 / threads)
            a, b = min(times["f32"]), min(times["int8"])
            gbs, gmacs = w.raw.nbytes / b / 1e9, rows * cols * n_rows / b / 1e9
            cells = f"{a * 1e3:.3f} | {b * 1e3:.3f} | {a / b:.2f}x | {gbs:.1f} | {gmacs:.1f}"
            print(f"| {t.name} | {rows} x {cols} | {cells} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", nargs="*", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--micro", action="store_true", help="per-kernel decode matvec times instead of models")
    p.add_argument("--micro-threads", type=int, default=1)
    p.add_argument("--micro-rows", type=int, default=1, help="activation rows per product (prefill: e.g. 32)")
    p.add_argument("--cpu-time", action="store_true", help="time in process CPU seconds (use with --threads 1)")
    args = p.parse_args(argv)
    print(f"load average before: {load_average()}")
    if args.micro:
        micro(args.micro_threads, n_rows=args.micro_rows)
        print(f"load average after: {load_average()}")
        return 0
    if args.model is None:
        from ggufpy.packaged import gemma3_path, smollm2_path

        args.model = [smollm2_path(), gemma3_path()]
    engines = [e for e in args.engines if e != "llama.cpp" or bench.llamacpp_available()]
    for path in map(Path, args.model):
        res = run_model(path, engines, args.rounds, args.prompt_tokens, args.gen_tokens, args.threads, args.cpu_time)
        ref = res.get("llama.cpp")
        print(f"\n{path.name}: {args.prompt_tokens}-token prompt, {args.gen_tokens} generated tokens, {args.threads} "
              f"threads, best of {args.rounds} alternating rounds{', CPU seconds' if args.cpu_time else ''}; "
              f"load average {load_average()}")  # fmt: skip
        print("| engine | load s | prefill tok/s | decode tok/s | prefill ratio | decode ratio |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for e in engines:
            s = res[e]
            ratios = ("-", "-") if ref is None or e == "llama.cpp" else (
                f"{s.prefill / ref.prefill:.2f}x", f"{s.decode / ref.decode:.2f}x")  # fmt: skip
            name = "numba " + e if e != "llama.cpp" else e
            print(f"| {name} | {res['_load'][e]:.2f} | {s.prefill:.1f} | {s.decode:.1f} | {ratios[0]} | {ratios[1]} |")
    print(f"\nload average after: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
