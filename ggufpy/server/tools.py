"""Tool calling: `tools` rendered into the prompt, the model's calls parsed back into OpenAI's `tool_calls`.

A model writes its calls in its family's format (`FORMATS`): Hermes / Qwen `<tool_call>{json}</tool_call>`,
Llama 3's bare JSON object, gpt-oss's harmony messages (`harmony.py`: every reply of such a model is read, tools
or not, into content, `reasoning_content` and calls). The chat template says which (`detect`): a template that
renders `tools` itself gets them as `tools=`; one that does not (SmolLM2's) gets them as a system message
written here (Qwen 2.5's Hermes tool prompt; harmony's `functions` namespace), and its replies are read as such.

`tool_choice` "required" or a named function forces a valid call with a grammar (`forcing_grammar`, through
structured output); "auto" leaves the model free until it writes the format's trigger (Hermes' `<tool_call>`
anywhere, Llama 3's `{` opening the reply, harmony's `to=functions.` recipient), then constrains the rest of
that call (`LazyCall`, constrain.py's `LazyConstraint`: llama.cpp's lazy grammars); "none" renders no tools.
Hermes and Llama 3 replies are read as they stream (`tool_stream.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..chat_encode import REASONING_FIELDS
from .harmony import CallDelta, HarmonyReader, Reasoning, merge
from .tool_stream import ToolCallReader

# Qwen 2.5's tool system prompt (its tokenizer_config.json chat template), for templates that render no tools
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
# harmony's tool declarations (the gpt-oss template's developer message), parameters as JSON schemas
HARMONY_SYSTEM = "# Tools\n\n## functions\n\nnamespace functions {{\n\n{tools}}} // namespace functions"
HARMONY_TOOL = "// {description}\ntype {name} = (_: {parameters}) => any;\n\n"
# how gpt-oss writes a call (openai-harmony's rendering of a recipient and a constrained body), in Lark: its
# <|...|> are tokens (llguidance's special-token syntax), which no text spelling them may stand for
HARMONY_CALL = '<|channel|> "commentary to=functions.{name} " <|constrain|> "json" <|message|>'
# where a harmony call the model begins is recognised (llama.cpp's gpt-oss triggers, common/chat.cpp): the
# recipient after the channel, or before it in the role header; then the rest of a header any gpt-oss writes
HARMONY_TRIGGERS = ("commentary to=functions.", "assistant to=functions.")
HARMONY_HEADER_REST = (
    'harmony_header: " "? (<|channel|> ("commentary" | "analysis") " "?)? (<|constrain|>? "json")? <|message|>\n'
)
NO_WHITESPACE = {"x-guidance": {"whitespace_flexible": False}}  # forced calls as compact JSON (constrain.py says why)
# a call the model began itself: its own spacing (Qwen writes `{"name": "f", "arguments": {...}}`), at most one
# space between JSON tokens, so it cannot pad forever
ONE_SPACE = {"x-guidance": {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}}


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes a call: between `open` and `close` (Hermes), or as the whole reply, a JSON
    object after an optional `prefix` (Llama 3: `open` is None, and a reply opening with `starts_with` is a
    call). `arguments_key` names the arguments' field."""

    name: str
    open: str | None
    close: str | None
    arguments_key: str
    prefix: str = ""
    template_marks: tuple[str, ...] = ()  # text in a chat template that says it renders this format
    always: bool = False  # every reply is in this format, tools or not (harmony's channels)
    calls: bool = True  # calls are read (False: no tools were offered, a call is dropped)
    specials: bool = False  # its tags are special tokens: the reader takes (text, is special) pieces
    starts_with: str | None = None  # a reply opening with this (after whitespace) is a call
    triggers: tuple[str, ...] = ()  # text that begins a call within a reply (`LazyCall`)


FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        # gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}`; its templates
        # (the real one, llama.cpp's built-in) are the only ones writing <|message|>
        ToolFormat(
            "harmony",
            None,
            None,
            "arguments",
            template_marks=("<|message|>",),
            always=True,
            specials=True,
            triggers=HARMONY_TRIGGERS,
        ),
        ToolFormat(
            "hermes",
            "<tool_call>",
            "</tool_call>",
            "arguments",
            template_marks=("<tool_call>",),
            triggers=("<tool_call>",),
        ),
        # Llama 3.1-3.3: `{"name": ..., "parameters": {...}}`, after <|python_tag|> in some replies
        # llama.cpp's lazy grammar for them triggers on a reply opening with `{` and `"name"` (common/chat.cpp,
        # Llama 3.x: a PATTERN_FULL trigger); here on the `{`, the grammar then admits only a call
        ToolFormat(
            "llama3", None, None, "parameters", "<|python_tag|>", ("<|python_tag|>", '"parameters"'), starts_with="{"
        ),
    )
}


def detect(template_source: str) -> tuple[ToolFormat, bool]:
    """(the format a chat template's model writes calls in, whether the template renders `tools` itself)."""
    native = "tools" in template_source
    for fmt in FORMATS.values():
        if (native or fmt.always) and any(mark in template_source for mark in fmt.template_marks):
            return fmt, native
    return FORMATS["hermes"], False


def check_tools(tools: Sequence[Mapping[str, Any]], choice: Any) -> str | None:
    """The function name `choice` forces (None: any), after checking the tools and the choice; ValueError if bad."""
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        if not isinstance(fn.get("parameters", {}), Mapping):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
        names.append(fn["name"])
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}; the tools are {names}")
        return name
    return None


@dataclass(frozen=True)
class LazyCall:
    """A call the model may begin (tool_choice "auto"): free text until one of `triggers`, then `body` (Lark:
    the rest of one call, with its `rules`) and `close`; free again after it when `repeat` (parallel_tool_calls),
    else the reply ends there. With `at_start` the trigger counts only as the reply's first text (after
    whitespace), and is the call's own first character (Llama 3's `{`), so it goes to the grammar too."""

    triggers: tuple[str, ...]
    body: str
    close: str
    repeat: bool
    at_start: bool = False
    rules: str = ""


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of it: the messages and `tools=` for the template, the format its
    reply is read in (None: plain content), the grammar forcing a call (None: the model is free) and the lazy
    grammar of a call the model begins (`tool_choice` "auto", formats with a trigger)."""

    messages: list[dict]
    tools: list[dict] | None
    format: ToolFormat | None
    grammar: str | None
    lazy: LazyCall | None = None


def plan(template_source: str, messages: list[dict], tools, choice, parallel: bool) -> ToolPlan:
    """The `ToolPlan` of a request (ValueError for bad tools or choice). Without tools and without earlier
    calls the messages pass as they are."""
    offered = tools if tools and choice != "none" else None
    fmt, native = detect(template_source)
    read_as = fmt if offered else replace(fmt, calls=False) if fmt.always else None
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return ToolPlan(messages, None, read_as, None)
    forced = check_tools(tools or [], choice)
    messages, passed = render_tools(fmt, native, messages, offered)
    grammar = lazy = None
    if offered and (forced is not None or choice == "required"):
        grammar = forcing_grammar(fmt, offered, forced, parallel)
    elif offered and fmt.name == "harmony":  # the recipient's name, the header's rest, the arguments; <|call|>
        # then ends the generation: one call
        lazy = LazyCall(fmt.triggers, _harmony_lazy_body(offered), "", False, rules=HARMONY_HEADER_REST)
    elif offered and fmt.triggers:  # Hermes: `<tool_call>` anywhere, its call's JSON, `</tool_call>`
        body = "%json " + json.dumps({**call_schema(fmt, offered), **ONE_SPACE})
        lazy = LazyCall(fmt.triggers, body, fmt.close, parallel)
    elif offered and fmt.starts_with:  # Llama 3: the whole reply is the call: one
        body = "%json " + json.dumps({**call_schema(fmt, offered), **ONE_SPACE})
        lazy = LazyCall((fmt.starts_with,), body, "", False, at_start=True)
    return ToolPlan(messages, passed, read_as, grammar, lazy)


def render_tools(
    fmt: ToolFormat, native: bool, messages: list[dict], tools: list[dict] | None
) -> tuple[list[dict], Any]:
    """(messages, the `tools=` value) for the template: native templates get tools as they are; the others a
    system message declaring them in `fmt`'s words (none when `tools` is None) and earlier calls / results
    written as Hermes text."""
    messages = [_arguments_as_objects(m) for m in messages]
    if fmt.name == "harmony":
        messages = [_harmony_turn(m) for m in messages]
        # gpt-oss's template writes "// " + description: a tool without one (OpenAI's is optional) would fail it
        tools = tools and [{**t, "function": {"description": "", **t["function"]}} for t in tools]
    if native:
        return messages, tools
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                f"<tool_call>\n{json.dumps(_call_object(c, 'arguments'), ensure_ascii=False)}\n</tool_call>"
                for c in m["tool_calls"]
            )
            m = {"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if not tools:
        return out, None
    system = _system_prompt(fmt, tools)
    if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _system_prompt(fmt: ToolFormat, tools: list[dict]) -> str:
    """The tool declarations a template that renders no tools gets in its system message."""
    if fmt.name != "harmony":
        return HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    declared = "".join(
        HARMONY_TOOL.format(
            description=t["function"].get("description", ""),
            name=t["function"]["name"],
            parameters=json.dumps(t["function"].get("parameters") or {"type": "object"}, ensure_ascii=False),
        )
        for t in tools
    )
    return HARMONY_SYSTEM.format(tools=declared)


def _harmony_turn(message: dict) -> dict:
    """An earlier gpt-oss turn as its template takes it: a call's reasoning goes in `thinking` and its content
    is dropped (the template refuses both; llama.cpp's `common_chat_params_init_gpt_oss` does the same)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if isinstance(message.get(k), str)), None)
    if message.get("role") != "assistant" or reasoning is None or not message.get("tool_calls"):
        return message
    return {k: v for k, v in message.items() if k != "content"}


def _arguments_as_objects(message: dict) -> dict:
    """Templates read `tool_calls[i].function.arguments` as an object; OpenAI sends a JSON string."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # left as the string the client sent
        fixed.append({**c, "function": fn})
    return {**message, "tool_calls": fixed}


def _call_object(call: Mapping[str, Any], key: str) -> dict:
    fn = call.get("function") or {}
    return {"name": fn.get("name"), key: fn.get("arguments", {})}


def forcing_grammar(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], name: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance) whose sentences are calls of `name` (or of any tool) in `fmt`, arguments
    valid against the tool's parameters; one call, or one or more when `parallel`. A harmony call ends the
    reply (its <|call|> ends the generation): always one."""
    if fmt.name == "harmony":
        return _harmony_grammar(tools, name)
    body = "%json " + json.dumps({**call_schema(fmt, tools, name), **NO_WHITESPACE})
    if fmt.open is not None:
        body = f"{json.dumps(fmt.open + chr(10))} {body} {json.dumps(chr(10) + fmt.close)}"
    sep = '"\\n"' if fmt.open is not None else '";"'
    return f"start: call ({sep} call)*\ncall: {body}\n" if parallel else f"start: call\ncall: {body}\n"


def call_schema(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], name: str | None = None) -> dict:
    """The JSON schema of a call object in `fmt`: `{"name": <a tool's name>, <arguments key>: <its parameters>}`,
    of `name` or of any tool."""
    schemas = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = dict(fn.get("parameters") or {"type": "object"})
        props = {"name": {"const": fn["name"]}, fmt.arguments_key: params}
        required = ["name", fmt.arguments_key]
        schemas.append({"type": "object", "properties": props, "required": required, "additionalProperties": False})
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _harmony_grammar(tools: Sequence[Mapping[str, Any]], name: str | None) -> str:
    """The reply is one call message (`HARMONY_CALL`) of `name` (or any tool), arguments valid JSON of its schema."""
    alternatives = []
    for tool in tools:
        fn = tool["function"]
        if name is None or fn["name"] == name:
            params = dict(fn.get("parameters") or {"type": "object"})
            head = HARMONY_CALL.format(name=json.dumps(fn["name"])[1:-1])
            alternatives.append(f"{head} %json {json.dumps({**params, **NO_WHITESPACE})}")
    return "start: call\ncall: " + "\n    | ".join(alternatives) + "\n"


def _harmony_lazy_body(tools: Sequence[Mapping[str, Any]]) -> str:
    """What follows `functions.` in a call the model began: one tool's name, the header's rest, its arguments."""
    alternatives = []
    for tool in tools:
        fn = tool["function"]
        params = dict(fn.get("parameters") or {"type": "object"})
        alternatives.append(f"{json.dumps(fn['name'])} harmony_header %json {json.dumps({**params, **ONE_SPACE})}")
    return "(" + " | ".join(alternatives) + ")"


def structured(fmt: ToolFormat | None, spec: tuple[str, Any] | None) -> tuple[str, Any] | None:
    """A `response_format` grammar (constrain.GRAMMARS' (kind, source)) for a model speaking `fmt`: harmony's
    JSON goes in a final message (as llama.cpp's gpt-oss grammar puts it), read back as content; others as given."""
    if fmt is None or fmt.name != "harmony" or spec is None or spec[0] not in ("json_object", "json_schema"):
        return spec
    schema = {"type": "object"} if spec[0] == "json_object" else spec[1]
    if not isinstance(schema, dict):
        return spec  # compile_grammar names the error
    body = json.dumps({**schema, **NO_WHITESPACE})
    return "lark", f'start: <|channel|> "final" (" "? <|constrain|> "json")? <|message|> %json {body}\n'


def reader(fmt: ToolFormat) -> ToolCallReader | HarmonyReader:
    """A fresh reader of one reply in `fmt`."""
    return HarmonyReader(fmt.calls) if fmt.name == "harmony" else ToolCallReader(fmt)


def reply(fmt: ToolFormat, text: str | list[tuple[str, bool]], finish: str) -> tuple[dict, str]:
    """(the assistant message of a whole reply read in `fmt`, its finish reason: "tool_calls" when it calls).
    `text`: the reply, or its (text, is a special token's) pieces as the scheduler reported them. The reader is
    the streaming one, so a streamed reply's deltas add up to this message."""
    r = reader(fmt)
    if isinstance(text, str):
        pieces = [*r.feed(text), *r.close()]
    else:
        pieces = [p for t, special in text for p in r.feed(t, special if fmt.specials else None)] + r.close()
    content, reasoning, calls = merge(pieces)
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message.update(content=content.strip() or None, tool_calls=calls)
        finish = "tool_calls" if finish == "stop" else finish
    return message, finish


def delta(piece: str | Reasoning | CallDelta) -> dict:
    """A streamed piece as OpenAI's chunk delta: content, reasoning, or a piece of a tool call (the first of a
    call names it, the others add argument text; each carries its call's index)."""
    if isinstance(piece, str):
        return {"content": piece}
    if isinstance(piece, Reasoning):
        return {"reasoning_content": piece.text}
    return {"tool_calls": [piece.as_openai()]}
