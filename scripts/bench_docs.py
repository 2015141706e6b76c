"""Regenerate the measured section of docs/performance.md: `ggufpy bench --against-llamacpp` on SmolLM2 Q4_1
and its Q4_0 / Q8_0 / Q4_K_M / Q6_K requantizations (llama.cpp's quantizer, cached in ~/.cache/ggufpy/bench)
and on Gemma 3 270M, each engine in a fresh process, in one run per model; then the numba backend against
llama.cpp on a synthetic 0.77 GB llama (random Q8_0 weights, written once into the same cache), where peak
RSS is mostly the model rather than the Python runtime.

    python scripts/bench_docs.py [--rounds 2] [--threads 2] [--no-large] [--dry-run]

Needs llama-cpp-python (`pip install -e ".[conformance]"`) and an idle machine: a second process on a 2-core
machine makes both engines' thread pools wait for time slices and the ratios meaningless.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

from ggufpy.constants import GGMLType
from ggufpy.kernels import bench
from ggufpy.packaged import gemma3_path, smollm2_path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "performance.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
VARIANTS = [None, "Q4_0", "Q8_0", "Q4_K_M", "Q6_K"]  # SmolLM2 requantizations (None: the packaged Q4_1)


def models() -> list[Path]:
    base = smollm2_path()
    return [base if v is None else bench.requantized(base, v) for v in VARIANTS] + [gemma3_path()]


def large_model() -> Path:
    """A synthetic llama of 722M parameters in Q8_0 (0.77 GB; dim 2048, 16 layers, 32/8 heads, ffn 5632),
    written once with `conformance.fixtures` (the weights are random: for speed and memory, not text)."""
    sys.path.insert(0, str(ROOT))
    from conformance.fixtures import ROLES, TinyLlama, write_tiny_llama

    path = Path.home() / ".cache" / "ggufpy" / "bench" / "synthetic-llama-722M.Q8_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        spec = TinyLlama(
            dim=2048, hidden_dim=5632, n_layers=16, n_heads=32, n_kv_heads=8, context_length=512,
            types=dict.fromkeys(ROLES, GGMLType.Q8_0),
        )  # fmt: skip
        write_tiny_llama(path.with_suffix(".tmp"), spec).replace(path)
    return path


def load_average() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-large", action="store_true", help="skip the synthetic 0.77 GB model")
    parser.add_argument("--dry-run", action="store_true", help="print the section instead of writing the docs")
    args = parser.parse_args(argv)
    before = load_average()
    tables = []
    runs = [(path, []) for path in models()]
    if not args.no_large:  # the NumPy backend would take minutes per token-batch here: numba and llama.cpp only
        runs.append((large_model(), ["--backend", "numba"]))
    for path, extra in runs:
        cmd = [sys.executable, "-m", "ggufpy", "bench", "-m", str(path), "--against-llamacpp", *extra]
        cmd += ["--rounds", str(args.rounds), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        tables.append(done.stdout.strip())
        print(tables[-1], flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"{START}\n`python scripts/bench_docs.py --rounds {args.rounds} --threads {args.threads}`, {stamp}; "
        f"load average before / after: {before} | {load_average()}.\n\n```\n" + "\n".join(tables) + f"\n```\n{END}"
    )
    if args.dry_run:
        print(section)
        return 0
    from bench_speed import replace_section  # scripts/ is on sys.path when this script runs

    replace_section(DOCS, START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
