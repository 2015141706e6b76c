"""`ggufpy perplexity [-m FILE] [-f TEXT]`: perplexity by llama.cpp's protocol, and KL-divergence to a base.

The text (default: the English text shipped with ggufpy) is cut into chunks of --ctx tokens; the second half of
each chunk is scored (llama-perplexity's protocol, see ggufpy/perplexity.py). `--save-logits FILE` stores the
base model's log-probabilities in llama.cpp's `--kl-divergence-base` format; `--kl-base FILE` compares this
model with such a file (written by ggufpy or by llama-perplexity) and prints llama.cpp's KL-divergence
statistics.

The default numerics, `host`, are the llamacpp numerics of the llama.cpp build this CPU runs (llamacpp-avx2, or
llamacpp with AVX-512): the logits, hence PPL and every KLD statistic, are llama.cpp's on x86 (up to the order of
double sums), so the numbers compare with llama-perplexity's. `--numerics exact` scores the float32 model instead:
~2x faster at 512-token chunks, and ~0.6-0.8 % away from llama.cpp's PPL, because llama.cpp rounds every matmul
input to 8 bits (docs/quantization.md, "Perplexity").
"""

from __future__ import annotations

import argparse
import sys

from . import NUMERICS_MODES, note_numerics, resolve_numerics


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "perplexity", help="perplexity and KL-divergence (llama.cpp's protocol)", description=__doc__
    )
    p.add_argument("-m", "--model", default=None, help="GGUF file or packaged model name (default: SmolLM2-135M)")
    p.add_argument("-f", "--file", default=None, help="text file to score (default: the text shipped with ggufpy)")
    p.add_argument("-c", "--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama.cpp)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    p.add_argument("--backend", default=None, help="numpy or numba (default: numba when installed)")
    p.add_argument(
        "--numerics",
        default="host",
        choices=(*NUMERICS_MODES, "host"),
        help="numerics mode (default host: this CPU's llama.cpp build, for llama.cpp's own numbers; exact: float32)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--save-logits", metavar="FILE", help="save log-probabilities (llama.cpp's KL base format)")
    group.add_argument("--kl-base", metavar="FILE", help="KL-divergence against a saved base")
    p.set_defaults(func=run)


def _print_chunk(i: int, value: float) -> None:
    print(f"[{i + 1}]{value:.4f},", end="", flush=True)


def run(args: argparse.Namespace) -> int:
    from ..kld import MIN_COUNT, kl_divergence
    from ..loading import load
    from ..perplexity import LogitsFile, default_text, make_chunks, perplexity

    numerics = resolve_numerics(args.numerics)
    note_numerics(numerics)
    model = load(args.model, backend=args.backend, numerics=numerics)
    if args.kl_base:
        base = LogitsFile.open(args.kl_base)
        print(f"KL-divergence against {args.kl_base}: {base.n_chunk} chunks of {base.n_ctx} tokens", file=sys.stderr)
        result = kl_divergence(model, base, on_chunk=_print_kld_chunk)
        print()
        if result.count < MIN_COUNT:  # as llama.cpp: no summary statistics over so few tokens
            print(f"{result.count} scored tokens: the summary needs at least {MIN_COUNT}", file=sys.stderr)
            return 0
        print_kld(result.statistics())
        return 0
    if args.file:
        with open(args.file, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    else:
        text = default_text()
    chunks = make_chunks(model.tokenizer, text, args.ctx, args.chunks)
    print(f"perplexity: {chunks.n_chunk} chunks of {chunks.n_ctx} tokens, {numerics} numerics", file=sys.stderr)
    if args.save_logits:
        with open(args.save_logits, "wb") as out:
            ppl = perplexity(model, chunks, save_logits=out, on_chunk=lambda i, p: _print_chunk(i, p.value))
    else:
        ppl = perplexity(model, chunks, on_chunk=lambda i, p: _print_chunk(i, p.value))
    print()
    print(f"Final estimate: PPL = {ppl.value:.4f} +/- {ppl.error:.5f}")
    return 0


def _print_kld_chunk(i: int, kld) -> None:
    """llama.cpp's line per chunk: running PPL(Q), ln(PPL(Q)/PPL(base)), KLD, RMS Δp and same-top, with errors."""
    if i == 0:
        print(
            "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS"
            "            Same top p"
        )
    s = kld.chunk_line()
    print(
        f"{i + 1:4d}    {s['ppl'][0]:9.4f} ± {s['ppl'][1]:9.4f}    {s['ln_ppl_ratio'][0]:10.5f} ± "
        f"{s['ln_ppl_ratio'][1]:10.5f}    {s['kld_mean'][0]:10.5f} ± {s['kld_mean'][1]:10.5f}    "
        f"{100 * s['p_diff_rms'][0]:6.3f} ± {100 * s['p_diff_rms'][1]:6.3f} %    "
        f"{100 * s['same_top'][0]:6.3f} ± {100 * s['same_top'][1]:6.3f} %"
    )


def print_kld(s: dict) -> None:
    """llama.cpp's closing statistics, in its wording, order and formats (perplexity.cpp `kl_divergence`)."""
    print("====== Perplexity statistics ======")
    print(f"Mean PPL(Q)                   : {s['ppl'][0]:10.6f} ± {s['ppl'][1]:10.6f}")
    print(f"Mean PPL(base)                : {s['ppl_base'][0]:10.6f} ± {s['ppl_base'][1]:10.6f}")
    print(f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor'][0]:6.2f}%")
    print(f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio'][0]:10.6f} ± {s['ln_ppl_ratio'][1]:10.6f}")
    print(f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio'][0]:10.6f} ± {s['ppl_ratio'][1]:10.6f}")
    print(f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff'][0]:10.6f} ± {s['ppl_diff'][1]:10.6f}")
    print()
    print("====== KL divergence statistics ======")
    print(f"Mean    KLD: {s['kld_mean'][0]:10.6f} ± {s['kld_mean'][1]:10.6f}")
    print(f"Maximum KLD: {s['kld_max']:10.6f}")
    for f in ("99.9", "99", "95", "90"):
        print(f"{_pct(f):<8}KLD: {s[f'kld_{f}%']:10.6f}")
    print(f"Median  KLD: {s['kld_median']:10.6f}")
    for f in ("10", "5", "1", "0.1"):
        print(f"{_pct(f):>5}   KLD: {s[f'kld_{f}%']:10.6f}")
    print(f"Minimum KLD: {s['kld_min']:10.6f}")
    print()
    print("====== Token probability statistics ======")
    print(f"Mean    Δp: {100 * s['p_diff_mean'][0]:6.3f} ± {100 * s['p_diff_mean'][1]:5.3f} %")
    print(f"Maximum Δp: {100 * s['p_diff_max']:6.3f}%")
    for f in ("99.9", "99", "95", "90", "75"):
        print(f"{_pct(f):<8}Δp: {100 * s[f'p_diff_{f}%']:6.3f}%")
    print(f"Median  Δp: {100 * s['p_diff_median']:6.3f}%")
    for f in ("25", "10", "5", "1", "0.1"):
        print(f"{_pct(f):>5}   Δp: {100 * s[f'p_diff_{f}%']:6.3f}%")
    print(f"Minimum Δp: {100 * s['p_diff_min']:6.3f}%")
    print(f"RMS Δp    : {100 * s['p_diff_rms'][0]:6.3f} ± {100 * s['p_diff_rms'][1]:5.3f} %")
    print(f"Same top p: {100 * s['same_top'][0]:6.3f} ± {100 * s['same_top'][1]:5.3f} %")


def _pct(f: str) -> str:
    return f"{float(f):.1f}%"  # llama.cpp labels "99.0%", " 5.0%"
