"""`ggufpy quantize IN OUT TYPE`: llama-quantize's mixes, the same tensors byte for byte.

TYPE is one of llama.cpp's mixes (Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S, Q3_K_L/M/S, Q2_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, IQ4_NL, IQ4_XS, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M, IQ3_XXS, IQ3_XS, IQ3_S, IQ3_M, Q2_K_S (the IQ1,
IQ2 and IQ3_XXS ones and Q2_K_S need --imatrix), F16, BF16, F32; Q3_K/Q4_K/Q5_K mean the _M mix). Each tensor's
type is chosen as `llama_tensor_get_type` does (more bits for attn_v and some ffn_down layers, 32-block
fallbacks for rows that are not a multiple of 256), quantized tensors are requantized from their f32 values
(llama-quantize --allow-requantize), and the output is written to a temporary file renamed when complete.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="quantize a model with llama.cpp's mixes", description=__doc__)
    p.add_argument("input", help="GGUF file or packaged model name")
    p.add_argument("output", help="the quantized GGUF file to write")
    p.add_argument("type", help="the mix: Q4_K_M, Q8_0, IQ4_XS, ...")
    p.add_argument("--imatrix", metavar="FILE", help="importance matrix (llama.cpp's imatrix GGUF)")
    p.add_argument("--pure", action="store_true", help="every quantizable tensor gets the mix's default type")
    p.add_argument("--output-tensor-type", metavar="T", help="ggml type for output.weight")
    p.add_argument("--token-embedding-type", metavar="T", help="ggml type for token_embd.weight")
    p.add_argument(
        "--tensor-type",
        action="append",
        default=[],
        metavar="PATTERN=T",
        help="ggml type for tensors whose name matches the regex PATTERN (repeatable; the first match wins)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no per-tensor table")
    p.set_defaults(func=run)


def _options(args: argparse.Namespace):
    from ..workbench.mixes import MixOptions, parse_type
    from . import UsageError

    overrides = []
    for item in args.tensor_type:
        pattern, sep, type_name = item.rpartition("=")
        if not sep or not pattern:
            raise UsageError(f"--tensor-type {item!r}: expected PATTERN=TYPE, e.g. attn_v=q8_0")
        overrides.append((pattern, parse_type(type_name)))
    return MixOptions(
        pure=args.pure,
        output_tensor_type=parse_type(args.output_tensor_type) if args.output_tensor_type else None,
        token_embedding_type=parse_type(args.token_embedding_type) if args.token_embedding_type else None,
        tensor_types=tuple(overrides),
    )


def run(args: argparse.Namespace) -> int:
    from ..packaged import resolve
    from ..workbench.quantize import quantize_model

    src = resolve(args.input)
    report = quantize_model(
        src, args.output, args.type, imatrix=args.imatrix, options=_options(args), progress=not args.quiet
    )
    if not args.quiet:
        for t in report.tensors:
            if t.old_type != t.new_type:
                mark = " (imatrix)" if t.imatrix else ""
                print(f"{t.name:36s} {list(t.shape)!s:16s} {t.old_type.name:>7s} -> {t.new_type.name}{mark}")
    mib = 1024 * 1024
    print(
        f"{report.mix}: {report.bytes_in / mib:.2f} MiB -> {report.bytes_out / mib:.2f} MiB, "
        f"{report.n_fallback} fallback(s); wrote {args.output}",
        file=sys.stderr,
    )
    return 0
