"""`python -m conformance.record_chat_templates`: llama.cpp's built-in chat formats, rendered, as a golden.

llama.cpp writes its built-in formats in C++ (``llm_chat_apply_template``, src/llama-chat.cpp), reached through
``llama_chat_apply_template`` with a template *name* and no model. This renders every conversation of
`CONVERSATIONS` with every template of `ggufpy.templates.TEMPLATES` that way and stores the prompts in
tests/data/chat_templates/llamacpp.json, which tests/test_templates.py compares ggufpy's Jinja versions against
(and, when llama-cpp-python is importable, `llamacpp_render` live). Needs ``pip install 'ggufpy[conformance]'``.
"""

from __future__ import annotations

import ctypes
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "data" / "chat_templates" / "llamacpp.json"


def _conversation(*turns: tuple[str, str], add_generation_prompt: bool = True) -> dict:
    return {
        "messages": [{"role": role, "content": content} for role, content in turns],
        "add_generation_prompt": add_generation_prompt,
    }


SYSTEM = ("system", "You are a terse assistant.")
USER = ("user", "What is the capital of France?")
REPLY = ("assistant", "Paris.")

# Each conversation probes something a format does differently: where system text goes, what follows a
# reply, which whitespace trim() removes (C's isspace: not U+00A0 or U+3000), roles it has no format for.
CONVERSATIONS: dict[str, dict] = {
    "user": _conversation(USER),
    "user_no_generation_prompt": _conversation(USER, add_generation_prompt=False),
    "system_user": _conversation(SYSTEM, USER),
    "system_user_no_generation_prompt": _conversation(SYSTEM, USER, add_generation_prompt=False),
    "multi_turn": _conversation(SYSTEM, USER, REPLY, ("user", "And of Italy?")),
    "multi_turn_ends_with_reply": _conversation(
        USER, REPLY, ("user", "And of Italy?"), ("assistant", "Rome."), add_generation_prompt=False
    ),
    "two_systems": _conversation(SYSTEM, ("system", "Answer in French."), USER),
    "system_after_reply": _conversation(USER, REPLY, ("system", "  Now answer in German. "), ("user", "Danke?")),
    "whitespace": _conversation(
        ("system", " \t spaced system \n"),
        ("user", "\n\n  question with\tinner  spaces \r\n\v\f"),
        ("assistant", "  reply  \n"),
        ("user", "\u00a0no-break spaces\u00a0 \u3000ideographic\u3000"),
    ),
    "unicode": _conversation(
        ("system", "Réponds en français, s'il te plaît."),
        ("user", "東京は日本の首都ですか？ 🙂 — naïve façade, Ωμέγα ✓"),
        ("assistant", "はい。🗼"),
        ("user", "Quotes ' \" and backslashes \\ and {{ not_jinja }} {% raw %} stay text."),
    ),
    "other_roles": _conversation(
        USER,
        ("assistant_tool_call", '{"name": "capital", "arguments": {"country": "France"}}'),
        ("tool", '{"capital": "Paris"}'),
        REPLY,
    ),
    "empty_contents": _conversation(("system", ""), ("user", ""), ("assistant", ""), ("user", " ")),
    "no_messages": _conversation(),
}


def llamacpp_builtin_names() -> list[str]:
    """The names llama.cpp knows (``llama_chat_builtin_templates``)."""
    import llama_cpp

    count = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * count)()
    llama_cpp.llama_chat_builtin_templates(names, count)
    return [name.decode() for name in names]


def llamacpp_render(name: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
    """What llama.cpp's ``llama_chat_apply_template`` writes for the built-in template ``name``."""
    import llama_cpp

    # keep the encoded strings alive while C reads them
    encoded = [(m["role"].encode(), m["content"].encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * max(len(encoded), 1))(*[llama_cpp.llama_chat_message(*m) for m in encoded])
    size = 256 + 2 * sum(len(r) + len(c) for r, c in encoded)
    for _ in range(2):  # the second call only when the first buffer was too small
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(encoded), add_generation_prompt, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp does not know the chat template {name!r} (returned {n})")
        if n <= size:
            return buf.raw[:n].decode("utf-8")
        size = n
    raise RuntimeError(f"llama.cpp rendered {name!r} to {n} bytes, more than the {size} it asked for")


def record() -> dict:
    """Every template of ggufpy.templates rendered by llama.cpp on every conversation."""
    import llama_cpp

    from ggufpy.templates import TEMPLATES

    return {
        "recorded_with": f"llama-cpp-python {llama_cpp.__version__}",
        "llamacpp_templates": llamacpp_builtin_names(),
        "conversations": CONVERSATIONS,
        "expected": {
            name: {case: llamacpp_render(name, **conversation) for case, conversation in CONVERSATIONS.items()}
            for name in TEMPLATES
        },
    }


def main() -> int:
    golden = record()
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{GOLDEN}: {len(golden['expected'])} templates x {len(CONVERSATIONS)} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
