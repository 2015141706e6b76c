"""`ggufpy chat`: an interactive multi-turn chat with the model's chat template.

Type a message and press Enter; an empty line is ignored, `/reset` starts over, `/exit` or Ctrl-D quits.
The KV cache is kept across turns: each turn computes only the tokens that are new since the last one.
Replies are greedy unless --temp is given (docs/chat.md).
"""

from __future__ import annotations

import argparse
import sys

from . import UsageError
from .channels import reply_view
from .run import (
    CHAT_TEMP,
    add_model_args,
    chat_prompt_ids,
    chat_template,
    clean_text,
    context_size,
    load_model,
    prepare_kernels,
    report,
    sampling_params,
    stream,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="interactive multi-turn chat", description=__doc__)
    p.add_argument("--system", default=None, help="a system message for the whole conversation")
    p.add_argument(
        "--no-cache-reuse",
        action="store_true",
        help="recompute the whole conversation every turn (for comparison; llama.cpp's cache_prompt off)",
    )
    add_model_args(p)
    p.set_defaults(func=run)


def read_line(stream) -> str | None:
    """One line of input as text (invalid UTF-8 replaced, with a note), or None at the end of input."""
    raw = stream.buffer.readline() if hasattr(stream, "buffer") else stream.readline()
    if not raw:
        return None
    if isinstance(raw, bytes):
        return clean_text(raw.decode("utf-8", "surrogateescape"), "the input line")
    return clean_text(raw, "the input line")


def run(args: argparse.Namespace) -> int:
    from ..generation import reuse_cache
    from ..sampling import Sampler

    system = clean_text(args.system, "--system") if args.system else None
    args.stop = [clean_text(s, "--stop") for s in args.stop]
    model, load_s = load_model(args)
    setup_s = prepare_kernels(model)
    template = chat_template(model, args)
    sampler = Sampler(sampling_params(args, CHAT_TEMP))  # one random stream for the whole conversation
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    cache = model.new_cache(capacity=context_size(model, args))
    cache_ids: list[int] = []  # the tokens whose keys and values `cache` holds
    interactive = sys.stdin.isatty()
    print(f"ggufpy chat ({model.config.arch.name}, {model.backend.name}); /reset, /exit or Ctrl-D", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = read_line(sys.stdin)
        if line is None or line.strip() == "/exit":
            return 0
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if text.strip() == "/reset":
            messages, cache_ids = list(start), []
            cache.truncate(0)
            continue
        turn = [*messages, {"role": "user", "content": text}]
        try:
            ids = chat_prompt_ids(model.tokenizer, turn, template, args.special_in_content)
            if args.no_cache_reuse:
                cache.truncate(0)
            else:
                reuse_cache(cache, cache_ids, ids)
            view = reply_view(template)  # gpt-oss: the reply printed by channel
            gen = stream(model, ids, args, sampler, cache, view)
        except UsageError as e:  # a template error or a full context: this turn is dropped, the chat goes on
            print(f"ggufpy: error: {e} (the message was not added; /reset starts over)", file=sys.stderr)
            continue
        result = gen.result
        cache_ids = gen.cache_ids
        # the template takes back the answer alone (gpt-oss's refuses harmony tags in content; it drops reasoning)
        answer = view.close()[0] if view is not None else result.text
        print()
        if result.finish_reason == "length":
            # A cut reply would teach the model to stop mid-sentence and costs context: the turn is dropped.
            print(
                f"ggufpy: the reply was cut at {result.completion_tokens} tokens (--max-tokens or --ctx-size); "
                "it and its question are not kept in the conversation",
                file=sys.stderr,
            )
        else:
            messages = [*turn, {"role": "assistant", "content": answer}]
        report(result, load_s, setup_s, model.backend.name)
        setup_s = 0.0  # kernel setup happened once, before the first turn
