"""`ggufpy trace FILE -p TEXT [--against-llamacpp]`: every intermediate tensor of one forward pass.

Tensors carry llama.cpp's names (`attn_norm-N`, `Qcur-N`, `kqv_out-N`, `ffn_out-N`, `l_out-N`, `result_norm`,
`result_output`), so a row can be matched with llama.cpp's graph node of the same name. Each row shows the
shape and summary statistics; `--against-llamacpp` runs llama.cpp on the same token ids (captured with its
`cb_eval` callback, settings of conformance/llamacpp.py) and adds each tensor's NMSE against it. This is a
free-running comparison: errors accumulate along the layers. For teacher-forced, layer-by-layer comparisons
use `python -m conformance.check FILE --layers`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from . import NUMERICS_MODES, note_numerics


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trace", help="print every intermediate tensor of a forward pass (optionally vs llama.cpp)", description=__doc__
    )
    p.add_argument("file", metavar="FILE", help="a GGUF file, or a packaged model's short name: smollm2, gemma3")
    p.add_argument("-p", "--prompt", required=True, help="the text to run")
    p.add_argument(
        "--numerics",
        default="exact",
        choices=NUMERICS_MODES,
        help="numerics mode (default exact; with --against-llamacpp, llamacpp means the build compared with)",
    )
    p.add_argument("--backend", default="numpy", choices=["numpy", "numba"], help="backend (default: the reference)")
    p.add_argument("--against-llamacpp", action="store_true", help="add each tensor's NMSE against llama.cpp")
    p.add_argument("--grep", default=None, help="show only tensors whose name contains this text")
    p.set_defaults(func=run)


def _llamacpp_module():
    """conformance/llamacpp.py, importable from a source checkout: the repo root on sys.path, or the checkout
    an editable install points at (the conformance harness is not part of the installed package)."""
    try:
        from conformance import llamacpp
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if not (root / "conformance" / "llamacpp.py").exists():
            raise OSError("--against-llamacpp needs conformance/llamacpp.py from a ggufpy source checkout") from None
        sys.path.insert(0, str(root))
        from conformance import llamacpp
    if not llamacpp.available():
        raise OSError("--against-llamacpp needs llama-cpp-python: pip install 'ggufpy[conformance]'")
    return llamacpp


def nmse(ours: np.ndarray, ref: np.ndarray) -> float:
    ref = np.asarray(ref, np.float64)
    return float(np.sum((np.asarray(ours, np.float64) - ref) ** 2) / max(np.sum(ref**2), 1e-300))


def run(args: argparse.Namespace) -> int:
    from ..loading import load, resolve_model_path

    path = resolve_model_path(args.file)
    llamacpp = _llamacpp_module() if args.against_llamacpp else None
    if llamacpp is not None and args.numerics.startswith("llamacpp"):  # replay the build it is compared with
        from conformance.llamacpp import versions

        from ..numerics import llamacpp_mode

        args.numerics = llamacpp_mode(versions()["system_info"])
    else:
        note_numerics(args.numerics)
    model = load(path, backend=args.backend, numerics=args.numerics, tokenizer=llamacpp is None)
    if llamacpp is not None:  # llama.cpp's own token ids, so both runs see the same input
        with llamacpp.LlamaCpp(path) as lc:
            ids = lc.tokenize(args.prompt)
    else:
        ids = model.tokenizer.encode(args.prompt, add_special=True)
    ids = np.asarray(ids, np.int64)
    trace: dict[str, np.ndarray] = {}
    model.forward(ids, 0, model.new_cache(capacity=max(len(ids), 1)), trace=trace)
    names = [n for n in trace if args.grep is None or args.grep in n]

    theirs: dict[str, np.ndarray] = {}
    if llamacpp is not None:
        with llamacpp.LlamaCpp(path) as lc:
            _, theirs = lc.run(ids, capture=set(names))

    print(f"{path.name}: {len(ids)} tokens, numerics {args.numerics}", file=sys.stderr)
    header = f"{'tensor':<16} {'shape':<18} {'mean':>11} {'std':>11} {'min':>11} {'max':>11}"
    print(header + (f" {'NMSE vs llama.cpp':>18}" if llamacpp is not None else ""))
    for name in names:
        t = trace[name]
        row = (
            f"{name:<16} {'x'.join(map(str, t.shape)):<18} {t.mean():>11.4g} {t.std():>11.4g} "
            f"{t.min():>11.4g} {t.max():>11.4g}"
        )
        if llamacpp is not None:
            ref = theirs.get(name)
            row += f" {nmse(t, ref):>18.3e}" if ref is not None and ref.shape == t.shape else f" {'-':>18}"
        print(row)
    return 0
