"""Does the memory that holds the weights change decode speed? The same integer kernels on the same bytes in
the file's memory map (`file`), in an anonymous copy on 4 KiB pages (`anon4k`), in an anonymous copy on
transparent huge pages (`thp`), and Q4_0 / Q4_K in eight-row groups (`x8`, `int8dot.interleaved`).

    python scripts/bench_bandwidth.py -m FILE [--rounds 5] [--threads 1] [--cpu-time] [--modes file anon4k thp x8]
    python scripts/bench_bandwidth.py --micro      # per weight: Q4_0 / Q4_K GGUF rows vs eight-row groups

One "token" is every 2-D weight of the file that has an integer kernel (`kernels/int8dot.py`) multiplied by
one activation row, in file order: the products of one decode step, GBs of weights streamed past the L3.
Next to it, `stream`: a plain read of the same bytes (64-bit xor, vectorized), the bandwidth the memory gives
without any arithmetic. Each mode's copy is made once; rounds alternate the modes and the best round is kept
(other processes only slow a round down). `AnonHugePages` of /proc/self/smaps_rollup says whether the THP copy
really got huge pages.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from pathlib import Path

import numpy as np

import ggufpy
from ggufpy.kernels import int8dot
from ggufpy.kernels._numba import jit, prange, use_threads
from ggufpy.weights import QuantTensor

MODES = ("file", "anon4k", "thp", "x8")
HUGE = 2 << 20


@jit(parallel=True)
def _stream(nt, words):
    """xor of every u64 word: one streaming read, no arithmetic to speak of."""
    previous = use_threads(nt)
    n = words.shape[0] // 64
    acc = np.zeros(64, np.uint64)
    for c in prange(64):
        x = np.uint64(0)
        for i in range(c * n, (c + 1) * n):
            x ^= words[i]
        acc[c] = x
    use_threads(previous)
    return acc


def anon_copy(raws: list[np.ndarray], huge: bool) -> list[np.ndarray]:
    """The arrays copied into one anonymous mapping, 2 MiB aligned, advised MADV_HUGEPAGE or MADV_NOHUGEPAGE."""
    offsets, total = [], 0
    for r in raws:
        offsets.append(total)
        total += -(-r.nbytes // 64) * 64
    m = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem
    base = np.frombuffer(m, np.uint8)
    skip = -base.__array_interface__["data"][0] % HUGE
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, skip // mmap.PAGESIZE * mmap.PAGESIZE, total)
    out = []
    for r, o in zip(raws, offsets, strict=True):
        a = base[skip + o : skip + o + r.nbytes]
        a[:] = r.reshape(-1)
        out.append(a)
    return out


def smaps(field: str) -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def micro(rounds: int = 7) -> None:
    """Per weight, one thread, CPU ms per decode product: Q4_0 and Q4_K from the GGUF rows vs in eight-row
    groups, at Llama-3.2-1B's shapes (2.4-9.4 MB: on this machine each stays in the 32 MB L3, so this is the
    L3 -> core path; `-m FILE` streams a whole token from DRAM)."""
    from ggufpy.constants import GGMLType

    rng = np.random.default_rng(0)
    print("| type | shape | GGUF rows ms | groups ms | speed-up | groups GB/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for t in (GGMLType.Q4_0, GGMLType.Q4_K):
        fmt, size, block = int8dot.INT8_TYPES[t]
        for rows, cols in ((2048, 2048), (8192, 2048), (2048, 8192)):
            blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
            blocks[:, 0:4] = 0x20  # small finite fp16 scales
            w = QuantTensor("w", t, (rows, cols), blocks.reshape(-1))
            pair = {"rows": int8dot.weight(w, interleave=False), "groups": int8dot.weight(w)}
            a = int8dot.quantize(rng.standard_normal((1, cols)).astype(np.float32), fmt)
            best = dict.fromkeys(pair, np.inf)
            for _ in range(rounds):
                for name, iw in pair.items():
                    int8dot.product(a, iw, 1)
                    t0 = time.process_time()
                    for _ in range(10):
                        int8dot.product(a, iw, 1)
                    best[name] = min(best[name], (time.process_time() - t0) / 10)
            r, g = best["rows"], best["groups"]
            print(f"| {t.name} | {rows} x {cols} | {r * 1e3:.3f} | {g * 1e3:.3f} | {r / g:.2f}x | "
                  f"{w.raw.nbytes / g / 1e9:.1f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model")
    p.add_argument("--micro", action="store_true", help="per weight: GGUF rows vs eight-row groups instead")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu-time", action="store_true", help="process CPU seconds (per thread) instead of wall")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = p.parse_args(argv)
    print(f"load average before: {' / '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.micro or args.model is None:
        micro()
        print(f"load average after: {' / '.join(f'{v:.2f}' for v in os.getloadavg())}")
        return 0
    f = ggufpy.open(args.model)
    tensors = [
        QuantTensor(i.name, i.type, tuple(i.shape), f.raw(i.name))
        for i in f.tensors.values()
        if len(i.shape) == 2 and i.type in int8dot.INT8_TYPES
    ]
    tensors = [
        t for t in tensors if int8dot.weight(t, interleave=False) is not None and not t.name.startswith("token_embd")
    ]
    nbytes = sum(t.raw.nbytes for t in tensors)
    print(f"{len(tensors)} weights, {nbytes / 1e9:.3f} GB; threads {args.threads}")
    rng = np.random.default_rng(0)
    raws = {"file": [t.raw for t in tensors]}
    for mode in args.modes:
        if mode in ("anon4k", "thp"):
            raws[mode] = anon_copy(raws["file"], huge=mode == "thp")
            print(f"{mode}: AnonHugePages {smaps('AnonHugePages') / 1024:.0f} MiB after the copy")
    weights = {
        m: [
            int8dot.weight(QuantTensor(t.name, t.type, t.shape, r), interleave=False)
            for t, r in zip(tensors, raws[m], strict=True)
        ]
        for m in args.modes
        if m != "x8"
    }
    if "x8" in args.modes:  # the same kernels on the file, except Q4_0: eight rows interleaved, in one stream
        file = [int8dot.weight(t, interleave=False) for t in tensors]
        weights["x8"] = [int8dot.interleaved(w) or w for w in file]
        raws["x8"] = [w.raw for w in weights["x8"]]
    acts = {}
    for t in tensors:
        fmt = int8dot.INT8_TYPES[t.type][0]
        key = (fmt, t.shape[1])
        if key not in acts:
            acts[key] = int8dot.quantize(rng.standard_normal((1, t.shape[1])).astype(np.float32), fmt)
    clock = time.process_time if args.cpu_time else time.perf_counter
    per = args.threads if args.cpu_time else 1

    def token(ws):
        for w in ws:
            int8dot.product(acts[(w.fmt, w.cols)], w, args.threads)

    def stream(rs):
        for r in rs:
            flat = r.reshape(-1)
            _stream(args.threads, flat[: flat.nbytes // 512 * 512].view(np.uint64))

    results = {(m, k): [] for m in args.modes for k in ("kernels", "stream")}
    for m in args.modes:  # warm up: compile, fault every page in
        token(weights[m])
        stream(raws[m])
    for _ in range(args.rounds):
        for m in args.modes:
            for kind, fn, arg in (("kernels", token, weights[m]), ("stream", stream, raws[m])):
                t0 = clock()
                fn(arg)
                results[(m, kind)].append((clock() - t0) / per)
    unit = "CPU s per thread" if args.cpu_time else "wall s"
    print(f"\nbest of {args.rounds} alternating rounds ({unit}); load average "
          f"{' / '.join(f'{v:.2f}' for v in os.getloadavg())}")  # fmt: skip
    print("| memory | kernels ms/token | kernels GB/s | stream ms | stream GB/s | kernels / stream |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for m in args.modes:
        k, s = min(results[(m, "kernels")]), min(results[(m, "stream")])
        print(
            f"| {m} | {k * 1e3:.1f} | {nbytes / k / 1e9:.1f} | {s * 1e3:.1f} | {nbytes / s / 1e9:.1f} | {s / k:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
