"""`ggufpy perplexity [-m FILE] [-f TEXT]`: perplexity by llama.cpp's protocol, and KL-divergence to a base.

The text (default: the English text shipped with ggufpy) is cut into chunks of --ctx tokens; the second half of
each chunk is scored (llama-perplexity's protocol, see ggufpy/perplexity.py). `--save-logits FILE` stores the
base model's log-probabilities in llama.cpp's `--kl-divergence-base` format; `--kl-base FILE` compares this
model with such a file (written by ggufpy or by llama-perplexity) and prints llama.cpp's KL-divergence
statistics. Use `--numerics llamacpp --backend numpy` for the values llama.cpp computes, bit for bit.
"""

from __future__ import annotations

import argparse
import sys

from . import NUMERICS_MODES, note_numerics


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "perplexity", help="perplexity and KL-divergence (llama.cpp's protocol)", description=__doc__
    )
    p.add_argument("-m", "--model", default=None, help="GGUF file or packaged model name (default: SmolLM2-135M)")
    p.add_argument("-f", "--file", default=None, help="text file to score (default: the text shipped with ggufpy)")
    p.add_argument("-c", "--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama.cpp)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    p.add_argument("--backend", default=None, help="numpy or numba (default: numba when installed)")
    p.add_argument("--numerics", default="exact", choices=NUMERICS_MODES, help="numerics mode (default exact)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--save-logits", metavar="FILE", help="save log-probabilities (llama.cpp's KL base format)")
    group.add_argument("--kl-base", metavar="FILE", help="KL-divergence against a saved base")
    p.set_defaults(func=run)


def _print_chunk(i: int, value: float) -> None:
    print(f"[{i + 1}]{value:.4f},", end="", flush=True)


def run(args: argparse.Namespace) -> int:
    from ..loading import load
    from ..perplexity import LogitsFile, default_text, kl_divergence, make_chunks, perplexity

    note_numerics(args.numerics)
    model = load(args.model, backend=args.backend, numerics=args.numerics)
    if args.kl_base:
        base = LogitsFile.open(args.kl_base)
        print(f"KL-divergence against {args.kl_base}: {base.n_chunk} chunks of {base.n_ctx} tokens", file=sys.stderr)
        result = kl_divergence(model, base, on_chunk=lambda i, k: _print_chunk(i, _ppl(k)))
        print()
        print_kld(result.statistics())
        return 0
    if args.file:
        with open(args.file, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    else:
        text = default_text()
    chunks = make_chunks(model.tokenizer, text, args.ctx, args.chunks)
    print(f"perplexity: {chunks.n_chunk} chunks of {chunks.n_ctx} tokens", file=sys.stderr)
    if args.save_logits:
        with open(args.save_logits, "wb") as out:
            ppl = perplexity(model, chunks, save_logits=out, on_chunk=lambda i, p: _print_chunk(i, p.value))
    else:
        ppl = perplexity(model, chunks, on_chunk=lambda i, p: _print_chunk(i, p.value))
    print()
    print(f"Final estimate: PPL = {ppl.value:.4f} +/- {ppl.error:.5f}")
    return 0


def _ppl(kld) -> float:
    import math

    return math.exp(kld.sum_nll / kld.count)


def print_kld(s: dict) -> None:
    """llama.cpp's closing statistics, in its wording and order."""
    print("====== Perplexity statistics ======")
    print(f"Mean PPL(Q)                   : {s['ppl'][0]:10.6f} ± {s['ppl'][1]:10.6f}")
    print(f"Mean PPL(base)                : {s['ppl_base'][0]:10.6f} ± {s['ppl_base'][1]:10.6f}")
    print(f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio'][0]:10.6f} ± {s['ln_ppl_ratio'][1]:10.6f}")
    print()
    print("====== KL divergence statistics ======")
    print(f"Mean    KLD: {s['kld_mean'][0]:10.6f} ± {s['kld_mean'][1]:10.6f}")
    print(f"Maximum KLD: {s['kld_max']:10.6f}")
    for f in ("99.9", "99", "95", "90"):
        print(f"{f + '%':<8}KLD: {s[f'kld_{f}%']:10.6f}")
    print(f"Median  KLD: {s['kld_median']:10.6f}")
    for f in ("10", "5", "1", "0.1"):
        print(f"{f + '%':>5}   KLD: {s[f'kld_{f}%']:10.6f}")
    print(f"Minimum KLD: {s['kld_min']:10.6f}")
    print()
    print("====== Token probability statistics ======")
    print(f"Mean    Δp: {100 * s['p_diff_mean'][0]:6.3f} ± {100 * s['p_diff_mean'][1]:5.3f} %")
    print(f"RMS Δp    : {100 * s['p_diff_rms'][0]:6.3f} ± {100 * s['p_diff_rms'][1]:5.3f} %")
    print(f"Same top p: {100 * s['same_top'][0]:6.3f} ± {100 * s['same_top'][1]:5.3f} %")
