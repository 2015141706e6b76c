"""`ggufpy diff BASE QUANT [-f TEXT]`: which layer and which tensor a quantization hurts most.

Both models read the same chunks of text (default: the English text shipped with ggufpy). Every layer of QUANT,
and every base layer with one matrix taken from QUANT, runs on the base's own hidden states (teacher forcing), so
each error belongs to one layer or one tensor: the layers' and tensors' NMSE of the layer output, then for every
tensor the KL-divergence of the next-token distribution when only that tensor is quantized (a forward pass per
tensor; --no-kld skips it). `--plot out.png` draws the per-layer and per-tensor numbers (needs matplotlib).
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("diff", help="per-layer / per-tensor quantization error attribution", description=__doc__)
    p.add_argument("base", help="the reference GGUF (e.g. the F16 or Q8_0 model), or a packaged model name")
    p.add_argument("quant", help="the quantized GGUF of the same model")
    p.add_argument("-f", "--file", default=None, help="text file (default: the text shipped with ggufpy)")
    p.add_argument("-c", "--ctx", type=int, default=128, help="tokens per chunk (default 128)")
    p.add_argument("--chunks", type=int, default=1, help="chunks to use (default 1)")
    p.add_argument("--no-kld", action="store_true", help="only the teacher-forced NMSE (no forward pass per tensor)")
    p.add_argument(
        "--kld-top", type=int, metavar="N", help="KLD only for the N tensors of largest NMSE (+ embd/output)"
    )
    p.add_argument("--top", type=int, default=20, help="rows of the ranked table (default 20, 0: all)")
    p.add_argument("--plot", metavar="PNG", help="draw the attribution (matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..attribution import attribute
    from ..loading import load
    from ..perplexity import default_text, make_chunks

    base = load(args.base, backend="numpy")
    quant = load(args.quant, backend="numpy")
    if args.file:
        with open(args.file, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    else:
        text = default_text()
    chunks = make_chunks(base.tokenizer, text, args.ctx, args.chunks)
    print(f"diff: {chunks.n_chunk} chunk(s) of {chunks.n_ctx} tokens", file=sys.stderr)
    kld = False if args.no_kld else (args.kld_top if args.kld_top is not None else True)
    result = attribute(base, quant, chunks, kld=kld, on_step=lambda n: print(".", end="", flush=True, file=sys.stderr))
    print(file=sys.stderr)
    print(f"total KLD (QUANT vs BASE, {result.n_tokens} scored tokens): {result.total_kld:.6f}")
    print()
    print("layer  NMSE (teacher-forced)")
    for i, v in result.layer_nmse.items():
        print(f"{i:5d}  {v:.3e}")
    print()
    rows = result.ranked() if args.top == 0 else result.ranked()[: args.top]
    print(f"{'tensor':32s} {'base':>6s} {'quant':>6s} {'NMSE':>10s} {'KLD':>10s} {'KLD/total':>9s}")
    for t in rows:
        nmse = f"{t.nmse:.3e}" if t.nmse is not None else "-"
        kld = f"{t.kld:.6f}" if t.kld is not None else "-"
        share = f"{100 * t.kld / result.total_kld:8.1f}%" if t.kld is not None and result.total_kld > 0 else "-"
        print(f"{t.name:32s} {t.base_type:>6s} {t.quant_type:>6s} {nmse:>10s} {kld:>10s} {share:>9s}")
    if args.plot:
        _plot(result, args.plot)
    return 0


def _plot(result, path: str) -> None:
    from . import UsageError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8))
    layers = list(result.layer_nmse)
    ax1.bar(layers, [result.layer_nmse[i] for i in layers])
    ax1.set(xlabel="layer", ylabel="NMSE (teacher-forced)", yscale="log", title="per-layer error")
    ranked = result.ranked()[:30]
    values = [t.kld if t.kld is not None else (t.nmse or 0) for t in ranked]
    ax2.barh([t.name for t in ranked][::-1], values[::-1])
    ax2.set(xlabel="KLD with only this tensor quantized", title="per-tensor contribution")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}", file=sys.stderr)
