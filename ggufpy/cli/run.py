"""`ggufpy run -p PROMPT`: stream a completion (or, with --chat, a chat reply) to stdout.

Load time and speeds go to stderr at the end, so stdout holds only the generated text.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `chat`: which model, which engine, how to sample."""
    p.add_argument("-m", "--model", default=None, help="GGUF file or packaged model name (default: SmolLM2-135M)")
    p.add_argument("--backend", default=None, help="numpy or numba (default: numba when installed)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temp", type=float, default=None, help="temperature; 0 = greedy (default 0.8, chat 0.2)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="random seed, for a reproducible run")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="generate text from a prompt", description=__doc__)
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    add_model_args(p)
    p.set_defaults(func=run)


def load_model(args: argparse.Namespace):
    from ..loading import load

    t0 = time.perf_counter()
    model = load(args.model, backend=args.backend)  # None: numba when it imports, else numpy
    return model, time.perf_counter() - t0


def sampling_params(args: argparse.Namespace, default_temp: float):
    from ..sampling import SamplingParams

    return SamplingParams(
        temperature=default_temp if args.temp is None else args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
    )


def stream(model, prompt_ids, args, sampling, out=None):
    """Generate, writing text as it comes; returns the `GenerationResult`."""
    from ..generation import generate

    out = out or sys.stdout
    gen = generate(model, model.tokenizer, prompt_ids, max_tokens=args.max_tokens, sampling=sampling, stop=args.stop)
    for chunk in gen:
        out.write(chunk.text)
        out.flush()
    return gen.result


def chat_prompt_ids(tok, messages) -> list[int]:
    """Render the conversation with the model's chat template and tokenize it, special tokens parsed."""
    from ..chat import ChatTemplate

    text = ChatTemplate.from_tokenizer(tok).render(messages, add_generation_prompt=True)
    # The template writes BOS itself when the model wants one (llama.cpp's chat path does the same check).
    add_bos = not (tok.bos_id is not None and text.startswith(tok.piece(tok.bos_id)))
    return tok.encode(text, add_special=add_bos, parse_special=True)


def report(result, load_seconds: float, backend: str) -> None:
    print(
        f"\n[{backend}] load {load_seconds:.2f} s | prompt {result.prompt_tokens} tokens, "
        f"{result.prefill_tokens_per_second:.1f} tok/s | generated {result.completion_tokens} tokens, "
        f"{result.decode_tokens_per_second:.1f} tok/s | finish: {result.finish_reason}",
        file=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    model, load_s = load_model(args)
    tok = model.tokenizer
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        ids = chat_prompt_ids(tok, messages)
    else:
        ids = tok.encode(args.prompt, add_special=True)
    result = stream(model, ids, args, sampling_params(args, 0.2 if args.chat else 0.8))
    if not result.text.endswith("\n"):
        print()
    report(result, load_s, model.backend.name)
    return 0
