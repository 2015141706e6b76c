"""`ggufpy chat`: an interactive multi-turn chat with the model's chat template.

Type a message and press Enter; an empty line is ignored, `/reset` starts over, `/exit` or Ctrl-D quits.
"""

from __future__ import annotations

import argparse
import sys

from .run import add_model_args, chat_prompt_ids, load_model, report, sampling_params, stream


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="interactive multi-turn chat", description=__doc__)
    p.add_argument("--system", default=None, help="a system message for the whole conversation")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..sampling import Sampler

    model, load_s = load_model(args)
    sampler = Sampler(sampling_params(args, 0.2))  # one random stream for the whole conversation
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    print(f"ggufpy chat ({model.config.arch.name}, {model.backend.name}); /reset, /exit or Ctrl-D", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": text})
        result = stream(model, chat_prompt_ids(model.tokenizer, messages), args, sampler)
        print()
        messages.append({"role": "assistant", "content": result.text})
        report(result, load_s, model.backend.name)
