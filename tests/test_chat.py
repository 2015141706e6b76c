"""Chat templates render exactly as Hugging Face transformers' ``apply_chat_template(tokenize=False)``.

Golden strings in tests/data/chat/*.json were recorded with transformers by tests/data/chat/record.py (the
SmolLM2 template comes from its GGUF; the Gemma 3 GGUF carries none, see the file's template_source). When
transformers is importable the same cases, and random conversations, are also compared live.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from ggufpy.chat import ChatTemplate, normalize_messages, plain_data, render_chat

DATA = Path(__file__).parent / "data" / "chat"
GOLDENS = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(DATA.glob("*.json"))}
CASES = [(name, c) for name, g in GOLDENS.items() for c in g["cases"]]
CASE_IDS = [f"{name}-{c['name']}" for name, c in CASES]


def ours(golden: dict, case: dict) -> str:
    kwargs = dict(case["kwargs"])
    return render_chat(
        golden["chat_template"],
        case["messages"],
        add_generation_prompt=case["add_generation_prompt"],
        bos_token=golden["bos_token"],
        eos_token=golden["eos_token"],
        tools=kwargs.pop("tools", None),
        **kwargs,
    )


def test_goldens_are_present():
    assert {"smollm2", "gemma3", "features"} <= set(GOLDENS)
    assert "<|im_start|>" in GOLDENS["smollm2"]["chat_template"]
    assert "<start_of_turn>" in GOLDENS["gemma3"]["chat_template"]


@pytest.mark.parametrize("name, case", CASES, ids=CASE_IDS)
def test_matches_recorded_transformers_output(name, case):
    golden = GOLDENS[name]
    if "error" in case:
        with pytest.raises(TemplateError, match=re.escape(case["error"])):
            ours(golden, case)
    else:
        assert ours(golden, case) == case["expected"]


# --- live comparison with transformers -------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_render():
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("chat_record", DATA / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hf_render


@pytest.mark.parametrize("name, case", CASES, ids=CASE_IDS)
def test_matches_live_transformers(hf_render, name, case):
    golden = GOLDENS[name]
    args = (golden["chat_template"], golden["bos_token"], golden["eos_token"], case["messages"])
    if "error" in case:
        with pytest.raises(TemplateError) as theirs:
            hf_render(*args, case["add_generation_prompt"], **case["kwargs"])
        with pytest.raises(TemplateError, match=re.escape(str(theirs.value))):
            ours(golden, case)
    else:
        assert ours(golden, case) == hf_render(*args, case["add_generation_prompt"], **case["kwargs"])


content = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30) | st.sampled_from(
    ["", " ", "\n", "  padded  ", "{{ x }}", "{% if %}", "<|im_end|>", "<end_of_turn>", "a\r\nb"]
)


@st.composite
def conversations(draw):
    """Alternating user/assistant turns (what both real templates accept), optionally after a system turn."""
    n = draw(st.integers(1, 5))
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": draw(content)} for i in range(n)]
    if draw(st.booleans()):
        msgs.insert(0, {"role": "system", "content": draw(content)})
    return msgs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=conversations(), gen=st.booleans(), model=st.sampled_from(["smollm2", "gemma3"]))
def test_random_conversations_match_live_transformers(hf_render, msgs, gen, model):
    golden = GOLDENS[model]
    expected = hf_render(golden["chat_template"], golden["bos_token"], golden["eos_token"], msgs, gen)
    got = render_chat(
        golden["chat_template"],
        msgs,
        add_generation_prompt=gen,
        bos_token=golden["bos_token"],
        eos_token=golden["eos_token"],
    )
    assert got == expected


# --- the environment -------------------------------------------------------------------------------


def test_chat_template_class_binds_special_tokens():
    g = GOLDENS["gemma3"]
    tmpl = ChatTemplate(g["chat_template"], bos_token=g["bos_token"], eos_token=g["eos_token"])
    case = next(c for c in g["cases"] if c["name"] == "multi_turn")
    assert tmpl.render(case["messages"]) == case["expected"]
    assert tmpl.render(case["messages"], add_generation_prompt=False) == case["expected"].removesuffix(
        "<start_of_turn>model\n"
    )
    assert "bos_token='<bos>'" in repr(tmpl)


def test_malformed_template_fails_at_construction():
    with pytest.raises(TemplateSyntaxError):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"tokenizer\.chat_template"):
        ChatTemplate("")


def test_raise_exception_surfaces_as_template_error():
    with pytest.raises(TemplateError, match="no system role"):
        render_chat("{{ raise_exception('no system role') }}", [])


def test_sandbox_is_immutable_and_namespace_is_hardened():
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(SecurityError):
        render_chat("{{ messages.append(1) }}", msgs)
    with pytest.raises(SecurityError):
        render_chat("{% set ns = namespace(_x=1) %}", msgs)
    with pytest.raises(SecurityError):
        render_chat("{% set ns = namespace() %}{% set ns._y = 1 %}", msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


def test_strftime_now_and_generation_tag():
    before = datetime.now().strftime("%Y-%m-%d")
    out = render_chat("{{ strftime_now('%Y-%m-%d') }}|{% generation %}body{% endgeneration %}", [])
    after = datetime.now().strftime("%Y-%m-%d")
    date, body = out.split("|")
    assert body == "body"
    assert date in {before, after}  # both, in case the test straddles midnight


def test_tojson_does_not_escape_html_and_keeps_key_order():
    out = render_chat("{{ {'b': '<é>', 'a': 1} | tojson }}", [])
    assert out == '{"b": "<é>", "a": 1}'


def test_tools_must_be_schemas():
    with pytest.raises(TypeError, match="JSON-schema dicts"):
        render_chat("{{ tools }}", [], tools=[len])


def test_inputs_are_plain_data():
    @dataclasses.dataclass
    class Part:
        type: str
        text: str

    assert plain_data({"a": (np.int64(3), np.bool_(False), np.float32(0.5))}) == {"a": (3, False, 0.5)}
    assert plain_data([Part("text", "hi")]) == [{"type": "text", "text": "hi"}]
    assert plain_data(object()) == "<object>"
    assert plain_data(np.zeros(3)) == "<ndarray>"


def test_messages_drop_none_and_alias_reasoning():
    msgs = normalize_messages([{"role": "assistant", "content": "x", "tool_calls": None, "reasoning": "r"}])
    assert msgs == [{"thinking": "r", "role": "assistant", "content": "x", "reasoning": "r", "reasoning_content": "r"}]
    with pytest.raises(TypeError, match="chat message 0"):
        normalize_messages(["not a dict"])
