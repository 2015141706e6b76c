"""`python -m conformance.report`: compare ggufpy with the committed llama.cpp goldens, in both numerics modes.

Prints one row per (model, numerics mode): end to end (top-1 agreement, mean and max KL, logit NMSE, identical
greedy tokens) and teacher-forced per layer (median and max NMSE over the layers and the output head). Exits
with 1 when a threshold of `conformance.compare.THRESHOLDS` fails. `--write-docs` regenerates the table in
docs/conformance.md. No llama.cpp needed: the goldens are committed.

    python -m conformance.report                      # everything
    python -m conformance.report q4_k smollm2 --mode llamacpp
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from .compare import GOLDEN_DIR, MODES, Reference, compare, failures, golden_names

DOCS = Path(__file__).resolve().parent.parent / "docs" / "conformance.md"
TABLE_START, TABLE_END = "<!-- conformance-table:start -->", "<!-- conformance-table:end -->"


class GoldenMismatch(RuntimeError):
    """The model file is not the one the golden was recorded from."""


def model_path(ref: Reference) -> Path:
    """The model a golden was recorded from, checked against its sha256."""
    from .fixtures import sha256

    where = ref.meta["model"]
    if where.startswith("packaged:"):
        from ggufpy.packaged import PACKAGED_MODELS

        path = PACKAGED_MODELS[where.removeprefix("packaged:")]()
    else:
        path = Path(__file__).parent / where
    if sha256(path) != ref.meta["sha256"]:
        raise GoldenMismatch(f"{path} is not the file golden {ref.name!r} was recorded from (sha256 differs)")
    return path


def evaluate(name: str, modes=MODES, continuation: bool = True, backend: str = "numpy") -> list[dict]:
    """Report rows for one golden: one per numerics mode, computed by `backend` (default: the NumPy
    reference; "numba" checks the kernels against the same goldens)."""
    import ggufpy
    from ggufpy.numerics import llamacpp_mode

    ref = Reference.load(name)
    path = model_path(ref)
    rows = []
    for mode in modes:
        if mode == "llamacpp":  # the replay of the build the golden was recorded on (AVX-512 or AVX2)
            mode = llamacpp_mode(ref.meta["llama_cpp"]["system_info"])
        t0 = time.perf_counter()
        model = ggufpy.load(path, backend=backend, tokenizer=False, numerics=mode)
        row = {"model": name, "types": ref.meta["types"], "mode": mode, **compare(model, ref, continuation)}
        row["seconds"] = time.perf_counter() - t0
        row["failures"] = failures(row)
        rows.append(row)
    return rows


def uncovered_types(rows: list[dict]) -> list[str]:
    from ggufpy.quants import QUANT_TYPES

    covered = {t for r in rows for t in r["types"]}
    return [t.name for t in QUANT_TYPES if t.name not in covered]


HEADER = (
    "| model | weight types | numerics | top-1 | KL mean | KL max | logit NMSE | greedy same | "
    "layer NMSE median | layer NMSE max (where) | thresholds |"
)


def format_row(r: dict) -> str:
    greedy = f"{r['greedy_match']}/{r['greedy_len']}" if "greedy_len" in r else "-"
    status = "pass" if not r["failures"] else "**FAIL**"
    return (
        f"| {r['model']} | {'+'.join(r['types'])} | {r['mode']} | {r['top1']:.1%} | {r['kl_mean']:.1e} | "
        f"{r['kl_max']:.1e} | {r['nmse']:.1e} | {greedy} | {r['layer_median']:.1e} | "
        f"{r['layer_max']:.1e} ({r['layer_worst']}) | {status} |"
    )


def format_table(rows: list[dict]) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [format_row(r) for r in rows]
    missing = uncovered_types(rows)
    if missing:
        lines.append("")
        lines.append(
            f"Registered types without a row: {', '.join(missing)}. Q8_1 and Q8_K are activation formats: llama.cpp "
            "has no vec_dot with them as weights (and aborts on get_rows of Q8_K), so no model can hold them; "
            "they are exercised by every Q4_1/Q5_1 (Q8_1) and k-quant/IQ4_XS (Q8_K) matmul in llamacpp mode, "
            "byte-identical to ggml's `from_float` (tests/test_numerics.py)."
        )
    return "\n".join(lines)


def write_docs(table: str, path: Path = DOCS) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {TABLE_START} ... {TABLE_END} section to replace")
    path.write_text(pattern.sub(lambda _: f"{TABLE_START}\n{table}\n{TABLE_END}", text))


def ordered(names: list[str]) -> list[str]:
    """Catalogue order: the fixtures as `FIXTURES` lists them, then the real models, then anything else."""
    from .fixtures import FIXTURES
    from .record import REAL_MODELS

    rank = {n: i for i, n in enumerate([*FIXTURES, *REAL_MODELS])}
    return sorted(names, key=lambda n: rank.get(n, len(rank)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.report", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"goldens (default: all in {GOLDEN_DIR})")
    parser.add_argument("--mode", choices=MODES, action="append", help="numerics mode (repeatable; default both)")
    parser.add_argument("--backend", default="numpy", help="ggufpy backend to check (default: the NumPy reference)")
    parser.add_argument("--no-greedy", action="store_true", help="skip the greedy continuations (faster)")
    parser.add_argument("--write-docs", action="store_true", help=f"replace the table in {DOCS}")
    args = parser.parse_args(argv)
    names = args.names or ordered(golden_names())
    unknown = sorted(set(names) - set(golden_names()))
    if unknown:
        parser.error(f"no golden for {unknown}; recorded: {', '.join(golden_names())}")
    rows = []
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for name in names:
        for row in evaluate(name, args.mode or MODES, continuation=not args.no_greedy, backend=args.backend):
            rows.append(row)
            print(format_row(row), flush=True)
    failed = [(r["model"], r["mode"], f) for r in rows for f in r["failures"]]
    for model, mode, f in failed:
        print(f"FAIL {model} [{mode}] {f}", file=sys.stderr)
    if args.write_docs:
        write_docs(format_table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
