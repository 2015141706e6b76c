"""Built-in chat templates: llama.cpp's hard-coded chat formats as Jinja, and which one a GGUF file wants.

A GGUF file normally carries its chat template (``tokenizer.chat_template``); some do not (the Gemma 3 270M
file ggufpy ships is one). llama.cpp keeps a table of chat formats written in C++ (``src/llama-chat.cpp``:
``LLM_CHAT_TEMPLATES`` names them, ``llm_chat_apply_template`` writes them). Each `BuiltinTemplate` here is one
of those formats as a Hugging Face style Jinja template (variables ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``) rendering byte for byte what llama.cpp writes, so it plugs into
`ggufpy.chat.ChatTemplate`. Recorded against llama.cpp 0c1e570 (llama-cpp-python 0.3.36) by
conformance/record_chat_templates.py; tests/test_templates.py compares.

What that means, where it differs from the families' published templates:
- no BOS at the start: llama.cpp's tokenizer adds it (``tokenizer.ggml.add_bos_token``), and so does ggufpy's CLI;
- special strings written literally (``<s>``, ``</s>``, ...) as llama.cpp does, whatever ``bos_token`` is;
- ``| trim`` strips C's ``isspace`` set only, like llama.cpp's ``trim()`` (Python's strip would also eat
  no-break and ideographic spaces);
- llama2 and mistral formats ignore ``add_generation_prompt`` (the prompt already ends in ``[/INST]``).

`detect` picks a template for a file without one, from its metadata. llama.cpp itself falls back to ChatML
(``common_chat_templates_init``) except for one case (``llama_model_chat_template``: a tekken vocabulary and 40
layers is Mistral Small 2503, ``mistral-v7-tekken``); ggufpy goes further and reads the architecture, the
special tokens of the vocabulary and ``general.name``, through `RULES`.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from collections.abc import Callable, Mapping
from string import Template
from typing import Any


@dataclasses.dataclass(frozen=True)
class BuiltinTemplate:
    """One chat format: its llama.cpp name, its Jinja source, and why `detect` chose it (empty otherwise)."""

    name: str
    source: str
    reason: str = ""


# C isspace(): the characters llama.cpp's trim() removes
_C_SPACE = r"' \t\n\v\f\r'"


def _jinja(source: str, **params: str) -> str:
    """A template from readable source: dedented, ``$name`` parameters filled, ``| trim`` made C's trim.

    Every tag strips the whitespace around it (``{%-``, ``-%}``), so the layout of the source never reaches
    the prompt: only the string literals do.
    """
    source = Template(textwrap.dedent(source).strip()).substitute(params)
    return source.replace("| trim", f"| trim({_C_SPACE})")


# Roles without a format of their own (tool, ...) are written like the others, as llama.cpp does.
_SIMPLE = """
    {%- for message in messages -%}
      {{- $turn -}}
    {%- endfor -%}
    {%- if add_generation_prompt -%}
      {{- $prompt -}}
    {%- endif -%}
"""


def _simple(turn: str, prompt: str) -> str:
    """A format writing each message as ``turn`` (a Jinja expression) and ``prompt`` to start the reply."""
    return _jinja(_SIMPLE, turn=turn, prompt=_literal(prompt))


def _literal(text: str) -> str:
    """``text`` as a Jinja string literal (single-quoted, newlines escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    """llama2 and its variants: <<SYS>> blocks, ``<s>`` before later turns, stripped messages."""
    system_part = r"'<<SYS>>\n' + content + '\n<</SYS>>\n\n'" if system else r"content + '\n'"
    return _jinja(
        """
        {%- set ns = namespace(inside=true) -%}
        {{- '[INST] ' -}}
        {%- for message in messages -%}
          {%- set content = message['content']$strip -%}
          {%- if not ns.inside -%}
            {{- $open -}}
            {%- set ns.inside = true -%}
          {%- endif -%}
          {%- if message['role'] == 'system' -%}
            {{- $system -}}
          {%- elif message['role'] == 'user' -%}
            {{- content + ' [/INST]' -}}
          {%- else -%}
            {{- content + '</s>' -}}
            {%- set ns.inside = false -%}
          {%- endif -%}
        {%- endfor -%}
        """,
        strip=" | trim" if strip else "",
        open="'<s>[INST] '" if bos_inside else "'[INST] '",
        system=system_part,
    )


def _mistral(lead: str, trail: str, trim_reply: bool) -> str:
    """mistral-v1 / v3 / v3-tekken: an ``[INST]`` opens after every reply, system text joins the user turn."""
    return _jinja(
        """
        {%- set ns = namespace(inside=false) -%}
        {%- for message in messages -%}
          {%- if not ns.inside -%}
            {{- $lead + '[INST]' + $trail -}}
            {%- set ns.inside = true -%}
          {%- endif -%}
          {%- if message['role'] == 'system' -%}
            {{- message['content'] + '\\n\\n' -}}
          {%- elif message['role'] == 'user' -%}
            {{- message['content'] + $lead + '[/INST]' -}}
          {%- else -%}
            {{- $trail + message['content']$trim + '</s>' -}}
            {%- set ns.inside = false -%}
          {%- endif -%}
        {%- endfor -%}
        """,
        lead=_literal(lead),
        trail=_literal(trail),
        trim=" | trim" if trim_reply else "",
    )


def _mistral_v7(space: str) -> str:
    """mistral-v7 (space after each opening tag) and v7-tekken (none)."""
    return _jinja(
        """
        {%- for message in messages -%}
          {%- if message['role'] == 'system' -%}
            {{- '[SYSTEM_PROMPT]' + $sp + message['content'] + '[/SYSTEM_PROMPT]' -}}
          {%- elif message['role'] == 'user' -%}
            {{- '[INST]' + $sp + message['content'] + '[/INST]' -}}
          {%- else -%}
            {{- $sp + message['content'] + '</s>' -}}
          {%- endif -%}
        {%- endfor -%}
        """,
        sp=_literal(space),
    )


def _by_role(formats: Mapping[str, str], prompt: str) -> str:
    """A format with one Jinja expression per role (``content`` is the message text); other roles are dropped."""
    branches = "\n  ".join(
        f"{{%- {'if' if i == 0 else 'elif'} message['role'] == {_literal(role)} -%}}{{{{- {expr} -}}}}"
        for i, (role, expr) in enumerate(formats.items())
    )
    return _jinja(
        """
        {%- for message in messages -%}
          {%- set content = message['content'] -%}
          $branches
          {%- endif -%}
        {%- endfor -%}
        {%- if add_generation_prompt -%}
          {{- $prompt -}}
        {%- endif -%}
        """,
        branches=branches,
        prompt=_literal(prompt),
    )


# google/gemma-7b-it has no system role: llama.cpp appends system text (trimmed, no separator) and writes it
# at the top of the next non-model turn; "assistant" is called "model".
_GEMMA = _jinja(
    """
    {%- set ns = namespace(system='') -%}
    {%- for message in messages -%}
      {%- if message['role'] == 'system' -%}
        {%- set ns.system = ns.system + message['content'] | trim -%}
      {%- else -%}
        {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
        {{- '<start_of_turn>' + role + '\\n' -}}
        {%- if ns.system and role != 'model' -%}
          {{- ns.system + '\\n\\n' -}}
          {%- set ns.system = '' -%}
        {%- endif -%}
        {{- message['content'] | trim + '<end_of_turn>\\n' -}}
      {%- endif -%}
    {%- endfor -%}
    {%- if add_generation_prompt -%}
      {{- '<start_of_turn>model\\n' -}}
    {%- endif -%}
    """
)

# Granite 3.x writes a tool call as the role "assistant_tool_call"; 4.x names the role "assistant".
_GRANITE_3 = (
    r"'<|start_of_role|>' + message['role'] + '<|end_of_role|>'"
    r" + ('<|tool_call|>' if message['role'] == 'assistant_tool_call' else '')"
    r" + message['content'] + '<|end_of_text|>\n'"
)
_GRANITE_4 = (
    r"('<|start_of_role|>assistant<|end_of_role|><|tool_call|>' if message['role'] == 'assistant_tool_call'"
    r" else '<|start_of_role|>' + message['role'] + '<|end_of_role|>') + message['content'] + '<|end_of_text|>\n'"
)

_EOS_DEEPSEEK = "'<｜end▁of▁sentence｜>'"

_SOURCES: dict[str, str] = {
    "chatml": _simple(
        r"'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'", "<|im_start|>assistant\n"
    ),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(lead=" ", trail=" ", trim_reply=False),
    "mistral-v3": _mistral(lead="", trail=" ", trim_reply=True),
    "mistral-v3-tekken": _mistral(lead="", trail="", trim_reply=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _simple(r"'<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n'", "<|assistant|>\n"),
    "phi4": _simple(
        r"'<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] + '<|im_end|>'",
        "<|im_start|>assistant<|im_sep|>",
    ),
    "falcon3": _simple(r"'<|' + message['role'] + '|>\n' + message['content'] + '\n'", "<|assistant|>\n"),
    "zephyr": _simple(r"'<|' + message['role'] + '|>\n' + message['content'] + '<|endoftext|>\n'", "<|assistant|>\n"),
    "gemma": _GEMMA,
    "llama3": _simple(
        r"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        r" + '<|eot_id|>'",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "llama4": _simple(
        r"'<|header_start|>' + message['role'] + '<|header_end|>\n\n' + message['content'] | trim + '<|eot|>'",
        "<|header_start|>assistant<|header_end|>\n\n",
    ),
    "deepseek2": _by_role(
        {
            "system": r"content + '\n\n'",
            "user": r"'User: ' + content + '\n\n'",
            "assistant": "'Assistant: ' + content + " + _EOS_DEEPSEEK,
        },
        "Assistant:",
    ),
    "deepseek3": _by_role(
        {
            "system": r"content + '\n\n'",
            "user": "'<｜User｜>' + content",
            "assistant": "'<｜Assistant｜>' + content + " + _EOS_DEEPSEEK,
        },
        "<｜Assistant｜>",
    ),
    "command-r": _by_role(
        {
            role: f"'<|START_OF_TURN_TOKEN|>{token}' + content | trim + '<|END_OF_TURN_TOKEN|>'"
            for role, token in [
                ("system", "<|SYSTEM_TOKEN|>"),
                ("user", "<|USER_TOKEN|>"),
                ("assistant", "<|CHATBOT_TOKEN|>"),
            ]
        },
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    ),
    "granite": _simple(_GRANITE_3, "<|start_of_role|>assistant<|end_of_role|>"),
    "granite-4.0": _simple(_GRANITE_4, "<|start_of_role|>assistant<|end_of_role|>"),
    "gpt-oss": _simple(
        "'<|start|>' + message['role'] + '<|message|>' + message['content']"
        " + ('<|return|>' if message['role'] == 'assistant' else '<|end|>')",
        "<|start|>assistant",
    ),
}

TEMPLATES: dict[str, BuiltinTemplate] = {name: BuiltinTemplate(name, source) for name, source in _SOURCES.items()}


def by_name(name: str) -> BuiltinTemplate:
    """The built-in template called ``name`` (llama.cpp's names: ``chatml``, ``gemma``, ``llama3``, ...)."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; built-in templates: {', '.join(TEMPLATES)}") from None


# --- which template a file without one wants --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """``template`` fits a file when every condition given holds.

    ``architectures``: ``general.architecture`` is one of them; ``tokens``: the vocabulary
    (``tokenizer.ggml.tokens``) has all of them; ``pre``: ``tokenizer.ggml.pre`` equals it; ``names``:
    ``general.name``, lowercased, contains one of them.
    """

    template: str
    architectures: frozenset[str] = frozenset()
    tokens: tuple[str, ...] = ()
    pre: str = ""
    names: tuple[str, ...] = ()

    def reason(self, metadata: Mapping[str, Any], vocab: Callable[[], frozenset[str]]) -> str | None:
        """Why the rule fits (``"architecture gemma3"``, ...), or None when it does not.

        ``vocab()`` gives the vocabulary as a set, built only if a rule asks (262144 strings for Gemma).
        """
        arch = metadata.get("general.architecture")
        name = str(metadata.get("general.name", ""))
        found = next((n for n in self.names if n in name.lower()), None)
        checks = [  # (condition given, does it hold, why)
            (self.architectures, lambda: arch in self.architectures, f"architecture {arch}"),
            (self.tokens, lambda: set(self.tokens) <= vocab(), f"tokens {' '.join(self.tokens)}"),
            (self.pre, lambda: metadata.get("tokenizer.ggml.pre") == self.pre, f"tokenizer.ggml.pre {self.pre}"),
            (self.names, lambda: found is not None, f"general.name {name!r} contains {found!r}"),
        ]
        checks = [(holds, why) for given, holds, why in checks if given]
        if not all(holds() for holds, _ in checks):
            return None
        return ", ".join(why for _, why in checks)


# First match wins: special tokens a format needs are the surest sign (they exist only for it), the
# architecture decides where one architecture has one format, and names come last (a fine-tune keeps them).
RULES: tuple[Rule, ...] = (
    Rule("gemma", architectures=frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})),
    Rule("gemma", tokens=("<start_of_turn>", "<end_of_turn>")),
    Rule("llama4", tokens=("<|header_start|>", "<|header_end|>", "<|eot|>")),
    Rule("llama3", tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    # Mistral's control tokens tell the format version, the pre-tokenizer its spacing (tekken writes no spaces)
    Rule("mistral-v7-tekken", tokens=("[SYSTEM_PROMPT]",), pre="tekken"),
    Rule("mistral-v7", tokens=("[SYSTEM_PROMPT]",)),
    Rule("mistral-v3-tekken", tokens=("[AVAILABLE_TOOLS]",), pre="tekken"),
    Rule("mistral-v3", tokens=("[AVAILABLE_TOOLS]",)),
    # Phi-4 has architecture phi3 too, with ChatML-like turns
    Rule("phi4", tokens=("<|im_start|>", "<|im_sep|>")),
    Rule("phi3", architectures=frozenset({"phi3", "phimoe"})),
    Rule("phi3", tokens=("<|user|>", "<|assistant|>", "<|end|>")),
    Rule("command-r", tokens=("<|START_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>")),
    Rule("deepseek3", tokens=("<｜User｜>", "<｜Assistant｜>")),
    Rule("granite", tokens=("<|start_of_role|>", "<|end_of_role|>")),
    Rule("gpt-oss", tokens=("<|start|>", "<|channel|>", "<|message|>")),
    Rule("chatml", tokens=("<|im_start|>", "<|im_end|>")),
    # formats written in plain text, known only by name
    Rule("zephyr", names=("zephyr",)),
    Rule("falcon3", names=("falcon3", "falcon 3", "falcon-3")),
    Rule("llama2-sys-strip", names=("llama-2", "llama 2", "llama2")),
    Rule("mistral-v1", names=("mistral", "mixtral")),
)

for _rule in RULES:  # a misspelt template name fails at import, not when a file happens to match
    if _rule.template not in TEMPLATES:
        raise ValueError(f"rule for unknown template {_rule.template!r}; built-in templates: {', '.join(TEMPLATES)}")


def detect(metadata: Mapping[str, Any]) -> BuiltinTemplate | None:
    """The built-in template for a GGUF file without ``tokenizer.chat_template``, with the reason, or None.

    ``metadata`` is a GGUF file's metadata (``ggufpy.open(path).metadata``). The file's own template, if it
    has one, is not looked at: it always takes precedence, and the caller decides that.
    """
    vocab = functools.cache(lambda: frozenset(metadata.get("tokenizer.ggml.tokens", ())))
    for rule in RULES:
        reason = rule.reason(metadata, vocab)
        if reason is not None:
            return dataclasses.replace(TEMPLATES[rule.template], reason=reason)
    return None
