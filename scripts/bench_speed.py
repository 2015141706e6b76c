"""Issue 16's speed tables from one run: cold start, prefill/decode against llama.cpp at 1B/3B/8B in both
numerics, weights GB/s against the machine's bandwidth, batched decode, the NumPy reference and long context.

    python scripts/bench_speed.py [--sizes 1B 3B 8B] [--types Q4_0 Q4_K_M Q8_0] [--threads 2] [--rounds 1]
                                  [--parts cold sizes batch context] [--dry-run]

Writes the section between `<!-- speed:start -->` and `<!-- speed:end -->` of docs/performance.md (or prints it
with --dry-run). Models: scripts/size_models.py (synthetic llamas at the published dims, random weights,
llama.cpp's requantizations), written on first use into ~/.cache/ggufpy/bench. Each engine runs in its own
process (`ggufpy bench`'s children), so load time and peak RSS are its own. Needs llama-cpp-python and an idle
machine: the load average before and after each part is printed with it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
DOCS = ROOT / "docs" / "performance.md"
START, END = "<!-- speed:start -->", "<!-- speed:end -->"
PARTS = ("cold", "sizes", "batch", "context")


def replace_section(docs: Path, start: str, end: str, section: str) -> None:
    """Write `section` (its markers included) over the text from `start` to `end` in `docs`."""
    text = docs.read_text()
    if start not in text:
        raise SystemExit(f"{docs} has no {start} ... {end} section")
    head, rest = text.split(start, 1)
    docs.write_text(head + section + rest.split(end, 1)[1])


def load_average() -> str:
    return " / ".join(f"{v:.2f}" for v in os.getloadavg())


def weight_bytes(path: Path) -> int:
    """Bytes a decoded token reads: every tensor but the embeddings (one row of those)."""
    from ggufpy import reader

    f = reader.open(path)
    return sum(t.nbytes for t in f.values() if not t.name.startswith("token_embd"))


def machine_bandwidth(threads: int, gb: float = 2.0, rounds: int = 5) -> float:
    """GB/s of a plain streaming read (64-bit xor, `bench_bandwidth._stream`) over `gb` GB, best of `rounds`."""
    from bench_bandwidth import _stream

    words = np.ones(int(gb * 1e9) // 8, np.uint64)
    _stream(threads, words[: 1 << 20])  # compile
    best = np.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        _stream(threads, words)
        best = min(best, time.perf_counter() - t0)
    return words.nbytes / best / 1e9


# -- parts ----------------------------------------------------------------------------------------------------------
def cold(args) -> str:
    """scripts/cold_start.py: the README command's first token, cold and warm."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "cold_start.py")], capture_output=True, text=True)
    return "### 1. Cold start (`scripts/cold_start.py`)\n\n" + done.stdout.strip()


def sizes(args) -> str:
    """Targets 2-4 and 7: `ggufpy bench`'s children for llama.cpp and ggufpy (numba, both numerics; the NumPy
    reference on the 1B Q8_0), ratios, load, RSS and the weights' GB/s."""
    from size_models import model

    from ggufpy.cli.bench import llamacpp_child
    from ggufpy.kernels import bench

    bw = machine_bandwidth(args.threads)
    n_prompt, n_decode = args.prompt_tokens, args.gen_tokens
    rows = []
    for size in args.sizes:
        for ftype in args.types:
            path = model(size, ftype)
            gb, wb = path.stat().st_size / 1e9, weight_bytes(path) / 1e9
            ref = llamacpp_child(path, args.threads, n_prompt, n_decode)
            engines = [("numba", "exact"), ("numba", "llamacpp")]
            if size == "1B" and ftype == "Q8_0":
                engines.append(("numpy", "exact"))
            row = [f"{size} {ftype}", f"{gb:.2f}", _engine_cells(ref, None, gb, wb)]
            for backend, numerics in engines:
                n = n_decode if backend == "numba" else 4
                r = bench.run_child(path, backend, args.threads, n_prompt, n, numerics=numerics)
                row.append(f"{backend} {numerics}: " + _engine_cells(r, ref, gb, wb))
            rows.append(row)
            print(" | ".join(row), f"(load average {load_average()})", flush=True)
    head = (
        f"### 2-4, 7. Prefill and decode at 1B-8B against llama.cpp\n\n{n_prompt}-token prompt, {n_decode} decoded "
        f"tokens (the NumPy reference: 4), {args.threads} threads, one run per engine. This machine streams "
        f"**{bw:.1f} GB/s** (a plain {args.threads}-thread read of 2 GB); `GB/s` is the weights' bytes (all tensors "
        "but the embeddings) times decode tok/s. Each cell: prefill tok/s / decode tok/s (ratio to llama.cpp), "
        "GB/s, load s, peak RSS / file.\n\n"
        "| model | file GB | llama.cpp | ggufpy |\n| --- | ---: | --- | --- |\n"
    )
    return head + "\n".join(f"| {r[0]} | {r[1]} | {r[2]} | {'<br>'.join(r[3:])} |" for r in rows)


def _engine_cells(r: dict, ref: dict | None, gb: float, wb: float) -> str:
    ratio = (lambda k: f" ({r[k] / ref[k]:.2f}x)") if ref else (lambda k: "")
    return (
        f"{r['prefill']:.1f}{ratio('prefill')} / {r['decode']:.2f}{ratio('decode')} tok/s, "
        f"{r['decode'] * wb:.1f} GB/s, load {r['load_s']:.2f} s, RSS {r['peak_rss'] / (gb * 1e9):.2f}x"
    )


_BATCH_CHILD = r"""
import json, sys, time
import numpy as np
import ggufpy
path, numerics, threads, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from ggufpy.kernels._numba import set_threads
set_threads(threads)
m = ggufpy.load(path, backend="numba", numerics=numerics)
rng = np.random.default_rng(0)
out = {}
for B in [int(b) for b in sys.argv[5].split(",")]:
    caches = [m.new_cache(capacity=64) for _ in range(B)]
    for c in caches:  # 8-token prompts, each sequence its own
        m.forward(rng.integers(0, m.config.vocab_size, 8), 0, c, last_only=True)
    tokens, positions = rng.integers(0, m.config.vocab_size, B), [8] * B
    m.decode_batch(tokens, positions, caches)  # warm-up (compiles the batched kernels once)
    positions = [9] * B
    t0 = time.perf_counter()
    for s in range(steps):
        m.decode_batch(tokens, [p + s for p in positions], caches)
    out[B] = B * steps / (time.perf_counter() - t0)
print(json.dumps(out))
"""


def batch(args) -> str:
    """Target 6: `Model.decode_batch` with B sequences per step on the 1B models, aggregate tok/s."""
    import json

    from size_models import model

    bs = [1, 4, 8, 16]
    lines = []
    for ftype in ("Q4_0", "Q8_0"):
        for numerics in ("exact", "llamacpp"):
            argv = [str(model("1B", ftype)), numerics, str(args.threads), "8", ",".join(map(str, bs))]
            done = subprocess.run([sys.executable, "-c", _BATCH_CHILD, *argv], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(done.stderr[-3000:])
            r = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
            cells = " | ".join(f"{r[b]:.1f} ({r[b] / r[1]:.2f}x)" for b in bs)
            lines.append(f"| 1B {ftype} | {numerics} | {cells} |")
            print(lines[-1], f"(load average {load_average()})", flush=True)
    head = (
        "### 6. Batched decode (`Model.decode_batch`, numba)\n\n"
        f"Aggregate tok/s of B sequences per step (8 steps after one warm-up, {args.threads} threads), and the "
        "ratio to B = 1.\n\n| model | numerics | " + " | ".join(f"B = {b}" for b in bs) + " |\n"
        "| --- | --- |" + " ---: |" * len(bs) + "\n"
    )
    return head + "\n".join(lines)


def context(args) -> str:
    """Target 5: scripts/bench_context.py on the 1B Q4_0."""
    from size_models import model

    cmd = [sys.executable, str(ROOT / "scripts" / "bench_context.py"), "--model", str(model("1B", "Q4_0"))]
    cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return "### 5. Long context (`scripts/bench_context.py`, 1B Q4_0)\n\n" + done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["1B", "3B", "8B"])
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M", "Q8_0"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--dry-run", action="store_true", help="print the section instead of writing the docs")
    args = ap.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sections = []
    for part in args.parts:
        before = load_average()
        text = globals()[part](args)
        sections.append(f"{text}\n\nLoad average before / after: {before} | {load_average()}.")
        print(sections[-1], "\n", flush=True)
    cmd = " ".join(["python scripts/bench_speed.py", *(argv if argv is not None else sys.argv[1:])])
    section = f"{START}\n`{cmd}`, {stamp}.\n\n" + "\n\n".join(sections) + f"\n{END}"
    if args.dry_run:
        return 0
    replace_section(DOCS, START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
