"""`ggufpy imatrix [-m FILE] [-f TEXT] [-o imatrix.gguf]`: an importance matrix, as llama-imatrix computes it.

The text (default: the English text shipped with ggufpy) is cut into chunks of --ctx tokens as for perplexity;
for every matrix of the model's blocks the sum over all tokens of each input column's squared activation is
stored with the token count, in llama.cpp's imatrix GGUF format: `ggufpy quantize --imatrix` and
`llama-quantize --imatrix` read it.
"""

from __future__ import annotations

import argparse
import sys

from . import NUMERICS_MODES, note_numerics, resolve_numerics


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("imatrix", help="importance matrix for quantization (llama-imatrix)", description=__doc__)
    p.add_argument("-m", "--model", default=None, help="GGUF file or packaged model name (default: SmolLM2-135M)")
    p.add_argument("-f", "--file", default=None, help="text file (default: the text shipped with ggufpy)")
    p.add_argument("-o", "--output", default="imatrix.gguf", help="file to write (default imatrix.gguf)")
    p.add_argument("-c", "--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama.cpp)")
    p.add_argument("--chunks", type=int, default=None, help="use at most this many chunks")
    p.add_argument("--process-output", action="store_true", help="collect output.weight too (llama.cpp's flag)")
    p.add_argument("--backend", default=None, help="numpy or numba (default: numba when installed)")
    p.add_argument(
        "--numerics",
        default="exact",
        choices=(*NUMERICS_MODES, "host"),
        help="numerics mode (default exact; host: this CPU's llama.cpp build, whose matmul inputs llama-imatrix sums)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..imatrix import compute_imatrix
    from ..loading import load
    from ..perplexity import default_text, make_chunks

    numerics = resolve_numerics(args.numerics)
    note_numerics(numerics)
    model = load(args.model, backend=args.backend, numerics=numerics)
    if args.file:
        with open(args.file, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    else:
        text = default_text()
    chunks = make_chunks(model.tokenizer, text, args.ctx, args.chunks)
    print(f"imatrix: {chunks.n_chunk} chunks of {chunks.n_ctx} tokens", file=sys.stderr)
    im = compute_imatrix(
        model,
        chunks,
        process_output=args.process_output,
        dataset=args.file or "ggufpy/data/eval.txt",
        on_chunk=lambda i: print(f"[{i + 1}]", end="", flush=True, file=sys.stderr),
    )
    print(file=sys.stderr)
    im.save(args.output)
    print(f"wrote {len(im.entries)} entries over {chunks.n_chunk} chunks to {args.output}", file=sys.stderr)
    return 0
