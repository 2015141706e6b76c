"""Regenerate the measured section of docs/performance.md: `ggufpy bench --against-llamacpp` on SmolLM2 Q4_1
and its Q4_0 / Q8_0 / Q4_K_M / Q6_K requantizations (llama.cpp's quantizer, cached in ~/.cache/ggufpy/bench)
and on Gemma 3 270M, each engine in a fresh process, in one run per model.

    python scripts/bench_docs.py [--rounds 2] [--threads 2] [--dry-run]

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

from ggufpy.kernels import bench
from ggufpy.packaged import gemma3_path, smollm2_path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
VARIANTS = [None, "Q4_0", "Q8_0", "Q4_K_M", "Q6_K"]  # SmolLM2 requantizations (None: the packaged Q4_1)


def models() -> list[Path]:
    base = smollm2_path()
    return [base if v is None else bench.requantized(base, v) for v in VARIANTS] + [gemma3_path()]


def load_average() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="print the section instead of writing the docs")
    args = parser.parse_args(argv)
    before = load_average()
    tables = []
    for path in models():
        cmd = [sys.executable, "-m", "ggufpy", "bench", "-m", str(path), "--against-llamacpp"]
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
    text = DOCS.read_text()
    if START not in text:
        raise SystemExit(f"{DOCS} has no {START} ... {END} section")
    head, rest = text.split(START, 1)
    DOCS.write_text(head + section + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
