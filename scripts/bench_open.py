"""Time opening the packaged models with ggufpy's reader and with gguf-py's `GGUFReader`, in one run.

Each timed open parses the whole header and reads `tokenizer.ggml.tokens` in full through the reader's API
(ggufpy checks it while opening and `list()` decodes its `StringArray`; gguf-py's `ReaderField.contents()`
decodes it on request), so both have really parsed the metadata. Reports the best of N runs (page cache warm
after the first) as a markdown table, or as JSON with `--json`.

    python scripts/bench_open.py [--repeat 5] [--gguf-repeat 2] [--json] [--models smollm2 gemma3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib.metadata import version

import ggufpy
from ggufpy.packaged import PACKAGED_MODELS, ModelNotInstalledError

TOKENS = "tokenizer.ggml.tokens"


def open_ggufpy(path: str) -> list[str]:
    with ggufpy.open(path) as f:
        return list(f.metadata[TOKENS])


def open_gguf_py(path: str) -> list[str]:
    import gguf

    reader = gguf.GGUFReader(path, "r")  # the constructor parses every field and tensor info
    return reader.fields[TOKENS].contents()


def best_ms(fn: Callable[[str], list[str]], path: str, repeat: int) -> tuple[float, list[str]]:
    """The fastest of `repeat` calls, in milliseconds, and the tokens the last call read."""
    best, tokens = float("inf"), []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        tokens = fn(path)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, tokens


def bench(models: list[str], repeat: int, gguf_repeat: int) -> list[dict]:
    rows = []
    for name in models:
        try:
            path = str(PACKAGED_MODELS[name]())
        except ModelNotInstalledError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        ours, our_tokens = best_ms(open_ggufpy, path, repeat)
        row = {"model": name, "path": path, "file_size": os.path.getsize(path), "tokens": len(our_tokens)}
        row.update({"ggufpy_ms": round(ours, 1), "ggufpy_runs": repeat})
        if gguf_repeat:
            theirs, their_tokens = best_ms(open_gguf_py, path, gguf_repeat)
            if their_tokens != our_tokens:
                raise SystemExit(f"{path}: ggufpy and gguf-py read different {TOKENS}")
            row.update({"gguf_py_ms": round(theirs, 1), "gguf_py_runs": gguf_repeat, "ratio": round(theirs / ours, 1)})
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | ggufpy ms | gguf-py ms | ratio |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        theirs = f"{r['gguf_py_ms']:.0f}" if "gguf_py_ms" in r else "-"
        ratio = f"{r['ratio']:.0f}x" if "ratio" in r else "-"
        lines.append(f"| {r['model']} ({r['tokens']:,} tokens) | {r['ggufpy_ms']:.0f} | {theirs} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5, help="runs of ggufpy's reader per model (best is kept)")
    p.add_argument("--gguf-repeat", type=int, default=2, help="runs of gguf.GGUFReader per model (0 skips it)")
    p.add_argument("--models", nargs="+", default=list(PACKAGED_MODELS), choices=list(PACKAGED_MODELS))
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    rows = bench(args.models, args.repeat, args.gguf_repeat)
    if args.json:
        machine = {"python": platform.python_version(), "cpus": os.cpu_count(), "gguf": version("gguf")}
        print(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine, "results": rows}, indent=2))
    else:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
