"""Built-in chat templates render exactly what llama.cpp's C++ chat formats write, and `detect` picks the right one.

tests/data/chat_templates/llamacpp.json was recorded by conformance/record_chat_templates.py from llama.cpp's
``llama_chat_apply_template``; the golden part always runs, the live part (the same conversations and random
ones) when llama-cpp-python is importable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ggufpy
from ggufpy.chat import CHATML_TEMPLATE, ChatTemplate
from ggufpy.templates import RULES, TEMPLATES, BuiltinTemplate, by_name, detect
from tests.models import gemma3_path, smollm2_path

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "chat_templates" / "llamacpp.json").read_text(encoding="utf-8"))
CONVERSATIONS = GOLDEN["conversations"]
CASES = [(name, case) for name in TEMPLATES for case in CONVERSATIONS]

# Distinct from every string the formats write: llama.cpp's built-in formats never use the model's BOS/EOS
BOS, EOS = "<BOS?>", "<EOS?>"


def render(name: str, messages, add_generation_prompt: bool) -> str:
    return ChatTemplate(TEMPLATES[name].source, bos_token=BOS, eos_token=EOS).render(
        messages, add_generation_prompt=add_generation_prompt
    )


# --- against llama.cpp ----------------------------------------------------------------------------


def test_golden_covers_every_template_and_names_are_llamacpps():
    assert set(GOLDEN["expected"]) == set(TEMPLATES)
    assert set(TEMPLATES) <= set(GOLDEN["llamacpp_templates"])
    required = {"chatml", "llama2", "llama3", "gemma", "phi3", "phi4", "mistral-v7", "zephyr", "deepseek3"}
    assert required | {"command-r", "granite"} <= set(TEMPLATES)


@pytest.mark.parametrize("name, case", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_matches_recorded_llamacpp(name, case):
    assert render(name, **CONVERSATIONS[case]) == GOLDEN["expected"][name][case]


def test_golden_probes_what_differs():
    """The cases reach the places the formats differ: trimming, merged system text, ignored generation prompts."""
    expected = GOLDEN["expected"]
    # C's isspace: the no-break and ideographic spaces survive llama.cpp's trim (Python's strip would drop them)
    kept = "<start_of_turn>user\n\u00a0no-break spaces\u00a0 \u3000ideographic\u3000<end_of_turn>"
    assert kept in expected["gemma"]["whitespace"]
    assert expected["gemma"]["two_systems"].startswith(
        "<start_of_turn>user\nYou are a terse assistant.Answer in French.\n\nWhat is"
    )
    assert expected["llama2"]["user"] == expected["llama2"]["user_no_generation_prompt"]
    assert expected["chatml"]["user"] != expected["chatml"]["user_no_generation_prompt"]


@pytest.fixture(scope="module")
def llamacpp_render():
    pytest.importorskip("llama_cpp")
    from conformance.record_chat_templates import llamacpp_render

    return llamacpp_render


@pytest.mark.conformance
@pytest.mark.parametrize("name, case", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_golden_is_llamacpps_current_output(llamacpp_render, name, case):
    assert llamacpp_render(name, **CONVERSATIONS[case]) == GOLDEN["expected"][name][case]


_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
_spaced = st.tuples(st.sampled_from(["", " ", "\n", " \t\r\n\v\f", "\u00a0", "\u3000 "]), _text).map("".join)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "user", "assistant", "tool", "model"]), "content": _spaced}
)


@pytest.mark.conformance
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(TEMPLATES)), messages=st.lists(_message, max_size=6), gen=st.booleans())
def test_random_conversations_match_live_llamacpp(llamacpp_render, name, messages, gen):
    assert render(name, messages, gen) == llamacpp_render(name, messages, gen)


# --- against the families' own templates ----------------------------------------------------------


def test_gemma_matches_googles_template_after_bos():
    """Google's Gemma 3 template (tests/data/chat/gemma3.json, rendered by transformers) writes the same turns."""
    golden = json.loads((DATA / "chat" / "gemma3.json").read_text(encoding="utf-8"))
    cases = [
        c for c in golden["cases"] if "error" not in c and all(isinstance(m.get("content"), str) for m in c["messages"])
    ]
    assert len(cases) >= 8
    for case in cases:
        ours = render("gemma", case["messages"], case["add_generation_prompt"])
        assert golden["bos_token"] + ours == case["expected"], case["name"]


def test_chatml_matches_chat_fallback():
    for conversation in CONVERSATIONS.values():
        fallback = ChatTemplate(CHATML_TEMPLATE).render(
            conversation["messages"], add_generation_prompt=conversation["add_generation_prompt"]
        )
        assert fallback == render("chatml", **conversation)


# --- by name --------------------------------------------------------------------------------------


def test_by_name():
    template = by_name("gemma")
    assert template == BuiltinTemplate("gemma", TEMPLATES["gemma"].source)
    assert "<start_of_turn>" in template.source


def test_by_name_unknown_lists_the_names():
    with pytest.raises(ValueError, match=r"unknown chat template 'gemma4'; built-in templates: chatml, .*gemma"):
        by_name("gemma4")


# --- detect ---------------------------------------------------------------------------------------


def meta(arch: str = "llama", tokens=(), name: str = "", pre: str = "default") -> dict:
    tokens = ["<unk>", "<s>", "</s>", "hello", "<0x0A>", *tokens]
    return {
        "general.architecture": arch,
        "general.name": name,
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
    }


LLAMA3_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

DETECT = {
    "gemma3": (meta("gemma3", ["<start_of_turn>", "<end_of_turn>"]), "gemma", "architecture gemma3"),
    "gemma2": (meta("gemma2"), "gemma", "architecture gemma2"),
    "gemma-tokens-on-llama": (
        meta("llama", ["<start_of_turn>", "<end_of_turn>"]),
        "gemma",
        "tokens <start_of_turn> <end_of_turn>",
    ),
    "llama3": (meta("llama", LLAMA3_TOKENS), "llama3", "tokens <|start_header_id|> <|end_header_id|> <|eot_id|>"),
    "llama3-without-eot": (meta("llama", LLAMA3_TOKENS[:3]), None, ""),
    "llama4": (meta("llama4", ["<|header_start|>", "<|header_end|>", "<|eot|>"]), "llama4", "tokens <|header_start|>"),
    "phi3": (meta("phi3", ["<|user|>", "<|assistant|>", "<|end|>"]), "phi3", "architecture phi3"),
    "phi4-is-arch-phi3": (meta("phi3", ["<|im_start|>", "<|im_sep|>", "<|im_end|>"]), "phi4", "tokens <|im_start|>"),
    "mistral-v7-tekken": (
        meta("llama", ["[INST]", "[SYSTEM_PROMPT]"], pre="tekken"),
        "mistral-v7-tekken",
        "tokens [SYSTEM_PROMPT], tokenizer.ggml.pre tekken",
    ),
    "mistral-v7": (meta("llama", ["[INST]", "[SYSTEM_PROMPT]"]), "mistral-v7", "tokens [SYSTEM_PROMPT]"),
    "mistral-nemo": (meta("llama", ["[INST]", "[AVAILABLE_TOOLS]"], pre="tekken"), "mistral-v3-tekken", "tekken"),
    "mistral-v3": (meta("llama", ["[INST]", "[AVAILABLE_TOOLS]"]), "mistral-v3", "tokens [AVAILABLE_TOOLS]"),
    "mistral-v1-by-name": (meta("llama", name="Mistral 7B Instruct v0.1"), "mistral-v1", "contains 'mistral'"),
    "command-r": (
        meta("command-r", ["<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"]),
        "command-r",
        "tokens <|START_OF_TURN_TOKEN|>",
    ),
    "deepseek3": (
        meta("deepseek2", ["<｜User｜>", "<｜Assistant｜>"]),
        "deepseek3",
        "tokens <｜User｜> <｜Assistant｜>",
    ),
    "granite": (meta("granite", ["<|start_of_role|>", "<|end_of_role|>"]), "granite", "tokens <|start_of_role|>"),
    "gpt-oss": (meta("gpt-oss", ["<|start|>", "<|channel|>", "<|message|>"]), "gpt-oss", "tokens <|start|>"),
    "qwen2-chatml": (meta("qwen2", ["<|im_start|>", "<|im_end|>"]), "chatml", "tokens <|im_start|> <|im_end|>"),
    "zephyr-by-name": (meta("stablelm", name="StableLM Zephyr 3B"), "zephyr", "general.name 'StableLM Zephyr 3B'"),
    "llama2-by-name": (meta("llama", name="Llama 2 7b Chat Hf"), "llama2-sys-strip", "contains 'llama 2'"),
    "plain-llama": (meta("llama", name="TinyStories"), None, ""),
    "no-metadata": ({}, None, ""),
}


@pytest.mark.parametrize("metadata, expected, reason", DETECT.values(), ids=DETECT.keys())
def test_detect(metadata, expected, reason):
    found = detect(metadata)
    if expected is None:
        assert found is None
    else:
        assert (found.name, found.source) == (expected, TEMPLATES[expected].source)
        assert reason in found.reason


def test_every_rule_can_fire():
    """No rule is shadowed by the ones above it: the metadata made of exactly its conditions selects it."""
    for i, rule in enumerate(RULES):
        metadata = meta(
            next(iter(sorted(rule.architectures)), "unknown"),
            rule.tokens,
            name=rule.names[0] if rule.names else "",
            pre=rule.pre or "default",
        )
        found = detect(metadata)
        assert found is not None and found.name == rule.template, (i, rule, found)


CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: parsed as one token in a prompt, never as text


def test_detect_on_the_real_gemma3_file():
    with ggufpy.open(gemma3_path()) as f:
        metadata = f.metadata
        tokens, types = metadata["tokenizer.ggml.tokens"].tolist(), metadata["tokenizer.ggml.token_type"]
    assert "tokenizer.chat_template" not in metadata
    found = detect(metadata)
    assert found.name == "gemma"
    assert found.reason == "architecture gemma3"
    for marker in ("<start_of_turn>", "<end_of_turn>"):
        assert types[tokens.index(marker)] == CONTROL, marker


@pytest.mark.slow
def test_real_gemma3_prompt_tokenizes_to_its_turn_tokens():
    """The rendered turn markers are Gemma's own control tokens, one id each, not text."""
    tok = ggufpy.load_tokenizer(gemma3_path())
    prompt = render("gemma", [{"role": "user", "content": "What is the capital of France?"}], True)
    ids = tok.encode(prompt, add_special=True, parse_special=True)
    markers = [tok.piece(i) for i in ids if tok.piece(i) in ("<start_of_turn>", "<end_of_turn>")]
    assert ids[0] == tok.bos_id
    assert markers == ["<start_of_turn>", "<end_of_turn>", "<start_of_turn>"]
    assert tok.detokenize(ids, remove_special=True, unparse_special=True).decode() == prompt


def test_real_smollm2_has_its_own_template_and_it_is_chatml():
    """detect is only the fallback: SmolLM2 carries a template, which writes ChatML like the one detect picks."""
    with ggufpy.open(smollm2_path()) as f:
        metadata = f.metadata
    own = ChatTemplate(metadata["tokenizer.chat_template"])
    found = detect(metadata)
    assert found.name == "chatml"
    for case in ("system_user", "multi_turn", "two_systems", "unicode"):
        conversation = CONVERSATIONS[case]
        assert own.render(**conversation) == render("chatml", **conversation), case
