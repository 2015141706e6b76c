"""Record transformers' rendering of gpt-oss's chat template (harmony) as goldens for tests/test_server_harmony.py.

    python tests/data/harmony/record.py        # from the repository root; rewrites tests/data/harmony/renderings.json

The template, gpt_oss_chat_template.jinja, is openai/gpt-oss-20b's (and -120b's) chat_template.jinja, as
llama.cpp keeps it (`models/templates/openai-gpt-oss-120b.jinja` in llama-cpp-python 0.3.36's vendor tree).
It prints today's date: the goldens hold `Current date: DATE` instead (`undate`). Needs transformers, no torch.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TEMPLATE = (HERE / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")
BOS, EOS = "<|startoftext|>", "<|return|>"  # gpt-oss's tokenizer_config.json

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["city"],
        },
    },
}
# every branch of the template's TypeScript rendering: arrays of each kind, unions, oneOf, nullable, nested
# objects, defaults, and a function without parameters
KITCHEN = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search <docs> & notes",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "nullable": True},
                "tags": {"type": "array", "items": {"type": "string"}},
                "scores": {"type": "array", "items": {"type": "number"}, "nullable": True},
                "ids": {"type": "array", "items": {"type": "integer"}},
                "flags": {"type": "array", "items": {"type": "boolean"}},
                "rows": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                "anything": {"type": "array"},
                "mixed": {"type": ["string", "integer"]},
                "one": {"oneOf": [{"type": "string", "description": "a name"}, {"type": "integer", "default": 3}]},
                "objs": {"oneOf": [{"type": "object"}, {"type": "object"}]},
                "limit": {"type": "integer", "default": 10},
                "exact": {"type": "boolean", "description": "match exactly"},
                "filter": {
                    "type": "object",
                    "properties": {"lang": {"type": "string"}, "year": {"type": "number"}},
                    "required": ["lang"],
                },
                "free": {},
            },
            "required": ["query", "tags"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def case(name: str, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> dict:
    return {"name": name, "messages": messages, "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}


USER = {"role": "user", "content": "What is the weather in Paris?"}
CASES = [
    case("user_only", [{"role": "user", "content": "Hi"}]),
    case("system", [{"role": "system", "content": "Be brief."}, USER]),
    case("developer", [{"role": "developer", "content": "Answer in French."}, USER]),
    case(
        "multi_turn_reasoning_dropped",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "thinking": "Simple sum."},
            {"role": "user", "content": "And 3+3?"},
        ],
    ),
    case("tools", [USER], tools=[WEATHER, KITCHEN, NOW]),
    case("tools_and_developer", [{"role": "system", "content": "Be brief."}, USER], tools=[WEATHER]),
    case(
        "tool_call_and_result",
        [
            USER,
            {"role": "assistant", "thinking": "Need the weather tool.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "clear", "celsius": 21}'},
        ],
        tools=[WEATHER],
    ),
    case(
        "tool_call_content_as_analysis_then_final",
        [
            USER,
            {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny in Paris."},
            {"role": "user", "content": "Thanks"},
        ],
        tools=[WEATHER],
    ),
    case(
        "last_assistant_with_thinking_no_generation_prompt",
        [USER, {"role": "assistant", "content": "Sunny.", "thinking": "I know this."}],
        False,
    ),
    case(
        "effort_identity_builtin_tools",
        [USER],
        reasoning_effort="high",
        model_identity="You are a test model.",
        builtin_tools=["browser", "python"],
    ),
    case("unicode", [{"role": "user", "content": "  Héllo 中文 🙂\n\n<b>&</b>\t "}]),
    case("tool_without_call", [USER, {"role": "tool", "content": "orphan"}]),
    case(
        "channel_tags_in_content",
        [USER, {"role": "assistant", "content": "<|channel|>final<|message|>x"}, USER],
    ),
    case(
        "content_and_thinking_with_call",
        [USER, {"role": "assistant", "content": "a", "thinking": "b", "tool_calls": [CALL]}],
        tools=[WEATHER],
    ),
]


def undate(text: str) -> str:
    """The rendering with its `Current date:` line made independent of the day."""
    return re.sub(r"Current date: \d{4}-\d{2}-\d{2}", "Current date: DATE", text)


def hf_render(messages, add_generation_prompt: bool, **kwargs) -> str:
    """transformers' ``apply_chat_template(tokenize=False)`` with the gpt-oss template (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0, BOS: 1, EOS: 2}, unk_token="<unk>")),
        bos_token=BOS,
        eos_token=EOS,
        chat_template=TEMPLATE,
    )
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


def main() -> int:
    import transformers
    from jinja2.exceptions import TemplateError

    cases = []
    for c in CASES:
        entry = dict(c)
        try:
            entry["expected"] = undate(hf_render(c["messages"], c["add_generation_prompt"], **c["kwargs"]))
        except TemplateError as e:
            entry["error"] = str(e)
        cases.append(entry)
    out = {"recorded_with": f"transformers {transformers.__version__}", "bos_token": BOS, "eos_token": EOS}
    path = HERE / "renderings.json"
    path.write_text(json.dumps({**out, "cases": cases}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path} ({len(cases)} cases)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
