"""`python -m conformance.check FILE [--prompt TEXT] [--layers]`: compare ggufpy with llama.cpp on any GGUF file.

Runs llama.cpp live (needs `pip install 'ggufpy[conformance]'`) with the conformance settings, then ggufpy in
both numerics modes, and prints the report row of each: end to end (top-1, KL, logit NMSE, greedy tokens) and
teacher-forced per layer. With `--layers`, also the first layer and tensor where ggufpy and llama.cpp part
beyond a threshold (each layer fed llama.cpp's input, its tensors compared in computation order). Exits 1 when
a threshold of the issue fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .compare import MODES, Reference, compare, failures, first_divergence, layer_tensor_names
from .record import PROMPT
from .report import HEADER, format_row

# NMSE above which `--layers` calls a tensor divergent: the per-layer bounds
LAYER_THRESHOLD = {"exact": 1e-3, "llamacpp": 1e-4}
FULL_ROWS_UP_TO = 4096  # vocabularies up to this size keep full logit rows; larger ones the top 256


def check(
    path: Path,
    prompt: str,
    modes=MODES,
    layers: bool = False,
    max_tokens: int = 256,
    n_continue: int = 16,
    backend: str = "numpy",
):
    """Compare ggufpy (`backend`, default the NumPy reference) with llama.cpp on `path`; yields (mode, report
    row, divergence or None)."""
    import ggufpy

    from .llamacpp import LlamaCpp

    models = {
        mode: ggufpy.load(path, backend=backend, tokenizer=False, numerics=mode) for mode in modes
    }  # fails cleanly first
    cfg = next(iter(models.values())).config
    with LlamaCpp(path) as lc:
        tokens = lc.tokenize(prompt)
    tokens = tokens[: min(max_tokens, cfg.context_length - n_continue)]
    top_k = None if cfg.vocab_size <= FULL_ROWS_UP_TO else 256
    extra = layer_tensor_names(cfg.n_layers) if layers else None
    ref = Reference.from_llamacpp(path, tokens, n_continue, top_k=top_k, extra=extra, name=path.stem)
    types = sorted({w.type.name for lw in models[modes[0]].weights.layers.values() for w in _matrices(lw)})
    for mode, model in models.items():
        row = {"model": path.name, "types": types, "mode": mode, **compare(model, ref)}
        row["failures"] = failures(row)
        divergence = first_divergence(model, ref, LAYER_THRESHOLD[mode]) if layers else None
        yield mode, row, divergence


def _matrices(layer_weights):
    return [v for v in vars(layer_weights).values() if hasattr(v, "raw")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.check", description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, help="a GGUF model file")
    parser.add_argument("-p", "--prompt", default=PROMPT, help="text to run (tokenized by llama.cpp)")
    parser.add_argument("--layers", action="store_true", help="find the first layer and tensor that diverge")
    parser.add_argument("--mode", choices=MODES, action="append", help="numerics mode (repeatable; default both)")
    parser.add_argument("--max-tokens", type=int, default=256, help="truncate the prompt to this many tokens")
    parser.add_argument("--backend", default="numpy", help="ggufpy backend to check (default: the NumPy reference)")
    args = parser.parse_args(argv)
    from .llamacpp import available

    if not available():
        print("conformance.check needs llama-cpp-python: pip install 'ggufpy[conformance]'", file=sys.stderr)
        return 2
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    failed = False
    divergences = []
    modes = tuple(args.mode or MODES)
    for mode, row, divergence in check(
        args.file, args.prompt, modes, args.layers, args.max_tokens, backend=args.backend
    ):
        print(format_row(row), flush=True)
        failed |= bool(row["failures"])
        for f in row["failures"]:
            print(f"FAIL [{mode}] {f}", file=sys.stderr)
        if args.layers:
            divergences.append((mode, divergence))
    for mode, divergence in divergences:
        if divergence is None:
            print(f"[{mode}] no tensor above NMSE {LAYER_THRESHOLD[mode]:g} (teacher-forced, layer by layer)")
        else:
            name, err = divergence
            print(f"[{mode}] first divergence: {name} NMSE {err:.2e} > {LAYER_THRESHOLD[mode]:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
