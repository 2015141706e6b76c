"""`ggufpy serve`: an OpenAI-compatible HTTP server with continuous batching (docs/server.md).

Binds to loopback by default; every request goes through `--parallel` slots that decode as one batch.
"""

from __future__ import annotations

import argparse
import sys

from . import NUMERICS_MODES, note_numerics, resolve_numerics
from .run import add_ray_args, load_pipeline


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API", description=__doc__)
    p.add_argument("-m", "--model", default=None, help="GGUF file or packaged model name (default: SmolLM2-135M)")
    p.add_argument("--backend", default=None, help="numpy or numba (default: numba when installed)")
    p.add_argument(
        "--numerics",
        default="exact",
        choices=(*NUMERICS_MODES, "host"),
        help="exact (float32, the default) or llama.cpp's arithmetic (host = the build this CPU runs): each "
        "response is then llama.cpp's own token-by-token decode of the request, whatever else is in the batch",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    p.add_argument("--parallel", type=int, default=4, help="slots: requests decoded together (default 4)")
    p.add_argument("--ctx-size", type=int, default=2048, help="KV positions per slot (default 2048)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--alias", default=None, help="model id in /v1/models (default: the file's name)")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|FILE",
        help="a built-in chat template (chatml, llama3, ...) or a Jinja file, instead of the model's (docs/server.md)",
    )
    add_ray_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..server.app import create_app
    except ImportError as e:
        from . import error

        return error(f"ggufpy serve needs the server extra (pip install 'ggufpy[server]'): {e}")
    from ..loading import load, resolve_model_path

    if args.parallel < 1 or args.ctx_size < 1:
        from . import error

        return error(f"--parallel {args.parallel} and --ctx-size {args.ctx_size} must be at least 1")
    path = resolve_model_path(args.model)
    if args.ray:  # the layers as stages on a Ray cluster (docs/distributed.md); two sequences per slot in flight
        args.model = str(path)
        model = load_pipeline(args, max_sequences=2 * args.parallel)
    else:
        numerics = resolve_numerics(args.numerics)
        note_numerics(numerics)
        model = load(path, backend=args.backend, numerics=numerics)
    ctx = min(args.ctx_size, model.config.context_length)
    alias = args.alias or path.stem
    from jinja2 import TemplateError

    try:
        template = _template(args.chat_template, model.tokenizer)
    except (OSError, ValueError, TemplateError) as e:
        from . import error

        return error(f"--chat-template {args.chat_template}: {e}")
    app = create_app(
        model, parallel=args.parallel, ctx_size=ctx, api_key=args.api_key, model_id=alias, chat_template=template
    )
    print(f"ggufpy serve: {alias} on http://{args.host}:{args.port} ({args.parallel} slots x {ctx})", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        if args.ray:
            model.shutdown()
    return 0


def _template(name: str | None, tokenizer):
    """`--chat-template`: None (the model's own), a file holding a Jinja template, or a built-in's name."""
    from pathlib import Path

    from ..chat import ChatTemplate

    if name is None:
        return None
    if Path(name).is_file():
        bos = tokenizer.piece(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.piece(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        return ChatTemplate(Path(name).read_text(encoding="utf-8"), bos, eos, name=name)
    return ChatTemplate.by_name(name, tokenizer)
