"""Per-turn latency of a 10-turn chat, recomputing every turn (before) or keeping the KV cache (after).

    .venv/bin/python scripts/chat_latency.py [-m smollm2] [--max-tokens 64] [--rounds 1]

Both runs go through `ggufpy chat`'s own steps (`chat_prompt_ids`, `reuse_cache`, `generate` on one cache), greedy,
so they produce the same replies; prints a Markdown table for docs/chat.md.
"""

from __future__ import annotations

import argparse
import time

import ggufpy
from ggufpy.chat import ChatTemplate
from ggufpy.cli.run import chat_prompt_ids, prepare_kernels
from ggufpy.generation import generate_text, reuse_cache
from ggufpy.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "And of Italy?",
    "Which river flows through Rome?",
    "Name a famous painter from Italy.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "What colour is the sky on a clear day?",
    "How many days are in a week?",
    "What is the largest planet in the solar system?",
    "Thank you! Summarise our chat in one sentence.",
]


def chat(model, reuse: bool, max_tokens: int) -> list[tuple[int, int, float, str]]:
    """(prompt tokens, tokens computed, seconds, reply) per turn."""
    tok = model.tokenizer
    template = ChatTemplate.from_tokenizer(tok, model.file.metadata, warn=False)
    cache = model.new_cache(capacity=model.config.context_length)
    cache_ids: list[int] = []
    messages: list[dict] = []
    rows = []
    for question in QUESTIONS:
        t0 = time.perf_counter()
        turn = [*messages, {"role": "user", "content": question}]
        ids = chat_prompt_ids(tok, turn, template)
        kept = reuse_cache(cache, cache_ids, ids) if reuse else (cache.truncate(0) or 0)
        result = generate_text(model, tok, ids, max_tokens=max_tokens, sampling=SamplingParams.greedy(), cache=cache)
        seconds = time.perf_counter() - t0
        cache_ids = [*ids, *result.token_ids[:-1]]
        messages = [*turn, {"role": "assistant", "content": result.text}]
        rows.append((len(ids), len(ids) - kept, seconds, result.text))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-m", "--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    model = ggufpy.load(args.model)
    prepare_kernels(model)
    before = chat(model, reuse=False, max_tokens=args.max_tokens)
    after = chat(model, reuse=True, max_tokens=args.max_tokens)
    assert [r[3] for r in before] == [r[3] for r in after], "greedy replies must not depend on cache reuse"
    print("| turn | prompt tokens | computed before | before (s) | computed after | after (s) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, (b, a) in enumerate(zip(before, after, strict=True), 1):
        print(f"| {i} | {b[0]} | {b[1]} | {b[2]:.2f} | {a[1]} | {a[2]:.2f} |")
    print(
        f"| all | | {sum(r[1] for r in before)} | {sum(r[2] for r in before):.1f} | "
        f"{sum(r[1] for r in after)} | {sum(r[2] for r in after):.1f} |"
    )


if __name__ == "__main__":
    main()
