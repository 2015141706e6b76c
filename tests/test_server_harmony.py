"""gpt-oss's harmony format (issues 13 and 14): its chat template renders as transformers renders it, and the
server reads a harmony reply into `content`, `reasoning_content` and `tool_calls`, whole and streamed.

The template is openai/gpt-oss-20b's chat_template.jinja (tests/data/harmony/, recorded with transformers by
tests/data/harmony/record.py). The end-to-end tests run a tiny gpt-oss (conformance's `GPT_OSS` fixture with
harmony's special tokens in its vocabulary and the real template) through the openai client; its random weights
write no harmony of their own, so its replies are forced: token by token (`Scripted`), or by the grammars the
server builds (`tool_choice`, `response_format`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import TemplateError

from ggufpy.chat import ChatTemplate, render_chat
from ggufpy.server import tools as toolcalls
from ggufpy.server.harmony import CallDelta, HarmonyReader, Reasoning, merge
from ggufpy.templates import by_name

DATA = Path(__file__).parent / "data" / "harmony"
TEMPLATE = (DATA / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")
GOLDEN = json.loads((DATA / "renderings.json").read_text(encoding="utf-8"))
CASES = {c["name"]: c for c in GOLDEN["cases"]}


def _recorder():
    spec = importlib.util.spec_from_file_location("harmony_record", DATA / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECORD = _recorder()


def ours(messages, add_generation_prompt=True, **kwargs):
    tools = kwargs.pop("tools", None)
    special = {"bos_token": GOLDEN["bos_token"], "eos_token": GOLDEN["eos_token"]}
    return render_chat(
        TEMPLATE, messages, add_generation_prompt=add_generation_prompt, tools=tools, **special, **kwargs
    )


# -- the chat template ---------------------------------------------------------------------------------------
def test_template_is_openais():
    assert len(CASES) >= 14 and "<|channel|>" in TEMPLATE and "render_typescript_type" in TEMPLATE


@pytest.mark.parametrize("name", list(CASES))
def test_renders_as_recorded_transformers(name):
    case = CASES[name]
    if "error" in case:
        with pytest.raises(TemplateError, match=re.escape(case["error"])):
            ours(case["messages"], case["add_generation_prompt"], **case["kwargs"])
    else:
        assert (
            RECORD.undate(ours(case["messages"], case["add_generation_prompt"], **case["kwargs"])) == case["expected"]
        )


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "error" not in c])
def test_renders_as_live_transformers(name):
    pytest.importorskip("transformers")
    case = CASES[name]
    theirs = RECORD.hf_render(case["messages"], case["add_generation_prompt"], **case["kwargs"])
    assert ours(case["messages"], case["add_generation_prompt"], **case["kwargs"]) == theirs


text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20) | st.sampled_from(
    ["", " ", "\n", "<|end|>", "<|start|>user", "{{ x }}", "a\r\nb"]
)


@st.composite
def conversations(draw):
    """Alternating user / assistant turns (assistant ones with or without reasoning), after an optional system or
    developer message."""
    n = draw(st.integers(1, 5))
    msgs = []
    for i in range(n):
        m = {"role": "user" if i % 2 == 0 else "assistant", "content": draw(text)}
        if m["role"] == "assistant" and draw(st.booleans()):
            m["thinking"] = draw(text)
        msgs.append(m)
    if draw(st.booleans()):
        msgs.insert(0, {"role": draw(st.sampled_from(["system", "developer"])), "content": draw(text)})
    return msgs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=conversations(), gen=st.booleans(), effort=st.sampled_from([None, "low", "high"]))
def test_random_conversations_render_as_live_transformers(msgs, gen, effort):
    pytest.importorskip("transformers")
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    assert ours(msgs, gen, **kwargs) == RECORD.hf_render(msgs, gen, **kwargs)


def test_openai_messages_render_as_the_template_expects():
    """What a client sends (arguments as a JSON string, `reasoning_content`, content beside a call's
    reasoning) goes through the server's plan to the prompt transformers renders from the template's own form."""
    args = '{"city": "Paris"}'
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",  # dropped, as llama.cpp does: the template refuses content and thinking here
            "reasoning_content": "Need the weather tool.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "clear", "celsius": 21}'},
    ]
    case = CASES["tool_call_and_result"]
    plan = toolcalls.plan(TEMPLATE, history, case["kwargs"]["tools"], "auto", False)
    assert plan.format.name == "harmony" and plan.format.calls and plan.grammar is None
    text = ChatTemplate(TEMPLATE).render(plan.messages, tools=plan.tools)
    assert RECORD.undate(text) == case["expected"]


# -- reading replies -----------------------------------------------------------------------------------------
def read(text, step=None, calls=True):
    """(content, reasoning, [(name, arguments)]) of `text` fed whole or `step` characters at a time."""
    reader = HarmonyReader(calls)
    step = step or len(text) or 1
    pieces = [p for i in range(0, len(text), step) for p in reader.feed(text[i : i + step])] + reader.close()
    content, reasoning, out = merge(pieces)
    return content, reasoning, [(c["function"]["name"], c["function"]["arguments"]) for c in out]


WEATHER_ARGS = '{"location":"Tokyo"}'
REPLIES = [
    # the cookbook's examples (articles/openai-harmony.md), after the prompt's <|start|>assistant; <|return|> and
    # <|call|> end the generation, so they are not in the text
    (
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
        ("2 + 2 = 4.", 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', []),
    ),
    (
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant"
        f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER_ARGS}",
        ("", "Need to use function get_weather.", [("get_weather", WEATHER_ARGS)]),
    ),
    (  # the recipient in the role header, as the template writes past calls
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Oslo"}',
        ("", "", [("get_weather", '{"location": "Oslo"}')]),
    ),
    (  # a preamble on the commentary channel is content
        "<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "**Action plan**: look it up.<|end|><|start|>assistant<|channel|>commentary to=functions.lookup"
        ' <|constrain|>json<|message|>{"q":"a<b"}',
        ("**Action plan**: look it up.", "Plan.", [("lookup", '{"q":"a<b"}')]),
    ),
    (  # gpt-oss-20b's stray commentary before the analysis channel (llama.cpp skips it too)
        "<|channel|>commentary to=assistant<|channel|>analysis<|message|>Hm.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.",
        ("Done.", "Hm.", []),
    ),
    (  # a built-in tool's message is not a function call: dropped, as llama.cpp's parser does
        "<|channel|>analysis<|message|>Search.<|end|><|start|>assistant to=browser.search<|channel|>analysis"
        ' <|constrain|>json<|message|>{"query":"x"}',
        ("", "Search.", []),
    ),
    ('{"answer": 42}', ('{"answer": 42}', "", [])),  # not harmony (a GBNF grammar forced plain JSON): content
    ("Hello <|end|> world", ("Hello <|end|> world", "", [])),
    ("<|channel|>analysis<|message|>cut off mid <|e", ("", "cut off mid <|e", [])),  # max_tokens in the body
    ("<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|chan", ("", "ok", [])),  # ... in a header
    ("<|channel|>final<|message|>multi\nline <|return|> ignored", ("multi\nline ", "", [])),
]


@pytest.mark.parametrize("step", [None, 1, 2, 5])
@pytest.mark.parametrize(("text", "want"), REPLIES, ids=range(len(REPLIES)))
def test_reader(text, want, step):
    assert read(text, step) == want


def test_reader_without_tools_drops_calls():
    assert read(REPLIES[1][0], calls=False) == ("", "Need to use function get_weather.", [])


def test_reader_streams_as_it_goes():
    """Each piece comes out as soon as it cannot be a tag: reasoning, then the call's name, then its arguments
    piece by piece, holding back only what may still become <|end|>."""
    reader = HarmonyReader()
    assert reader.feed("<|channel|>analys") == []
    assert reader.feed("is<|message|>Think") == [Reasoning("Think")]
    assert reader.feed("ing <|en") == [Reasoning("ing ")]
    assert reader.feed("d|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json") == []
    (head,) = reader.feed("<|message|>")
    assert (head.index, head.name, head.arguments) == (0, "f", "") and head.id.startswith("call_")
    assert reader.feed('{"a":') == [CallDelta(0, None, None, '{"a":')]
    assert reader.feed(" 1}") == [CallDelta(0, None, None, " 1}")]
    assert reader.close() == [] and reader.calls == 1
    deltas = [toolcalls.delta(p) for p in (Reasoning("x"), head, CallDelta(0, None, None, "{}"))]
    assert deltas[0] == {"reasoning_content": "x"}
    named = {"index": 0, "id": head.id, "type": "function", "function": {"name": "f", "arguments": ""}}
    assert deltas[1] == {"tool_calls": [named]}
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}


def test_reply_message():
    fmt = toolcalls.FORMATS["harmony"]
    message, finish = toolcalls.reply(fmt, REPLIES[1][0], "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == "Need to use function get_weather."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": WEATHER_ARGS} and call["type"] == "function"
    message, finish = toolcalls.reply(fmt, REPLIES[0][0], "stop")
    assert finish == "stop" and message["content"] == "2 + 2 = 4." and "tool_calls" not in message
    assert toolcalls.reply(fmt, REPLIES[1][0], "length")[1] == "length"


# -- detection, plan, forcing --------------------------------------------------------------------------------
def test_detect():
    assert toolcalls.detect(TEMPLATE) == (toolcalls.FORMATS["harmony"], True)
    # llama.cpp's built-in gpt-oss format (files without a template) renders no tools; the model speaks harmony
    assert toolcalls.detect(by_name("gpt-oss").source) == (toolcalls.FORMATS["harmony"], False)
    assert toolcalls.detect(by_name("chatml").source)[0].name == "hermes"


def test_plan_reads_every_reply():
    """Without tools a harmony reply is still read (its channels are never content); calls only when offered."""
    messages = [{"role": "user", "content": "Hi"}]
    plan = toolcalls.plan(TEMPLATE, messages, None, None, False)
    assert plan.format.name == "harmony" and not plan.format.calls and plan.messages == messages
    plan = toolcalls.plan(TEMPLATE, messages, [WEATHER], "none", False)
    assert not plan.format.calls and plan.tools is None
    plan = toolcalls.plan(TEMPLATE, messages, [WEATHER], "auto", False)
    assert plan.format.calls and plan.tools == [WEATHER] and plan.grammar is None


def test_tool_without_description():
    """OpenAI's `description` is optional; gpt-oss's template concatenates it, so the plan gives it one."""
    with pytest.raises(TemplateError, match="description"):
        ChatTemplate(TEMPLATE).render([{"role": "user", "content": "Hi"}], tools=[TIME])
    plan = toolcalls.plan(TEMPLATE, [{"role": "user", "content": "Hi"}], [TIME], "auto", False)
    assert "// \ntype get_time = () => any;" in ChatTemplate(TEMPLATE).render(plan.messages, tools=plan.tools)


def test_plan_without_template_tools():
    """llama.cpp's built-in template renders no tools: they go in a system message as harmony declares them."""
    plan = toolcalls.plan(by_name("gpt-oss").source, [{"role": "user", "content": "Hi"}], [WEATHER], "auto", False)
    assert plan.tools is None and plan.messages[0]["role"] == "system"
    assert plan.messages[0]["content"].startswith("# Tools\n\n## functions\n\nnamespace functions {\n\n")
    assert "type get_weather = (_: {" in plan.messages[0]["content"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


def test_forcing_grammar_sentences_read_back():
    """The grammar forcing a call accepts exactly harmony's call message, its tags as tokens (never spelled out
    in text), and the reader reads the message back."""
    llguidance = pytest.importorskip("llguidance")
    grammar = toolcalls.forcing_grammar(toolcalls.FORMATS["harmony"], [WEATHER, TIME], None, parallel=True)
    lark = llguidance.LLMatcher.grammar_from_lark(grammar)
    good = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo","unit":"celsius"}'
    bad = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
    tokenizer = _tag_tokenizer(llguidance)
    assert _accepts(llguidance, tokenizer, lark, good) and not _accepts(llguidance, tokenizer, lark, bad)
    assert _accepts(llguidance, tokenizer, lark, good.replace("get_weather", "get_time").split("{")[0] + "{}")
    assert not _accepts(llguidance, tokenizer, lark, good, spell_tags=True)
    assert read(good) == ("", "", [("get_weather", '{"city":"Oslo","unit":"celsius"}')])


def test_structured_output_goes_in_a_final_message():
    """response_format on a harmony model: the JSON in a final message (tags as tokens), read back as content;
    other formats and grammars pass unchanged."""
    llguidance = pytest.importorskip("llguidance")
    spec = ("json_schema", SKY)
    assert toolcalls.structured(toolcalls.FORMATS["hermes"], spec) == spec
    assert toolcalls.structured(toolcalls.FORMATS["harmony"], ("gbnf", 'root ::= "x"')) == ("gbnf", 'root ::= "x"')
    kind, source = toolcalls.structured(toolcalls.FORMATS["harmony"], spec)
    assert kind == "lark"
    lark = llguidance.LLMatcher.grammar_from_lark(source)
    tokenizer = _tag_tokenizer(llguidance)
    for text in (
        '<|channel|>final<|message|>{"sky":"clear"}',
        '<|channel|>final <|constrain|>json<|message|>{"sky":"rain"}',
    ):
        assert _accepts(llguidance, tokenizer, lark, text) and read(text)[0] == text.split("<|message|>")[1]
    assert not _accepts(llguidance, tokenizer, lark, '<|channel|>final<|message|>{"sky":"snow"}')
    assert not _accepts(llguidance, tokenizer, lark, '{"sky":"clear"}')


SKY = {
    "type": "object",
    "properties": {"sky": {"enum": ["clear", "rain"]}},
    "required": ["sky"],
    "additionalProperties": False,
}
TAGS = ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"]


def _tag_tokenizer(llguidance):
    class Vocabulary:  # one token per byte, then harmony's tags as special tokens (the last one EOS)
        tokens = [bytes([i]) for i in range(256)] + [b"\xff" + t.encode() for t in TAGS]
        eos_token_id, bos_token_id, special_token_ids = len(tokens) - 1, None, tuple(range(256, len(tokens)))

        def __call__(self, text):
            return list(text.encode() if isinstance(text, str) else text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()))


def _accepts(llguidance, tokenizer, grammar, text, spell_tags=False) -> bool:
    """Whether `grammar` takes `text`: its tags as their tokens (or spelled out in bytes), the rest as bytes."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    ids = []
    for part in re.split(r"(<\|\w+\|>)", text):
        ids += [256 + TAGS.index(part)] if part in TAGS and not spell_tags else list(part.encode())
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


# -- end to end: a tiny gpt-oss through the openai client ----------------------------------------------------
HARMONY_TOKENS = ["<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>"]
HARMONY_TOKENS += ["<|message|>", "<|call|>"]  # gpt-oss's o200k_harmony specials (ids 199998-200012 there)


class Scripted:
    """A model whose replies follow `script` (token ids): the k-th token of a reply gets +1e4 on its logit.
    Random weights write no harmony; this makes the tiny model write the real thing, token by token."""

    def __init__(self, model):
        self.model, self.script, self.steps = model, [], {}

    def __getattr__(self, name):
        return getattr(self.model, name)

    def _push(self, row, cache):
        k = self.steps.get(id(cache), 0)
        self.steps[id(cache)] = k + 1
        if k < len(self.script):
            row = row.copy()
            row[self.script[k]] += 1e4
        return row

    def forward(self, x, pos, cache, **kw):
        logits = self.model.forward(x, pos, cache, **kw)
        self.steps[id(cache)] = 0  # a prompt's chunk: the reply starts after it
        return np.concatenate([logits[:-1], self._push(logits[-1], cache)[None]])

    def decode_batch(self, tokens, positions, caches):
        rows = self.model.decode_batch(tokens, positions, caches)
        return np.stack([self._push(row, c) for row, c in zip(rows, caches, strict=True)])


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """The GPT_OSS fixture with harmony's special tokens and gpt-oss's template, loaded and scripted."""
    import ggufpy
    from conformance import fixtures as fx
    from conformance import fixtures_moe

    def tokens():
        base, types = fx._tokens()
        n = len(fx.SPECIALS)
        control = [int(gguf.TokenType.CONTROL)] * len(HARMONY_TOKENS)
        return base[:n] + HARMONY_TOKENS + base[n:], types[:n] + control + types[n:]

    path = tmp_path_factory.mktemp("harmony") / "gpt-oss-harmony.gguf"
    with pytest.MonkeyPatch.context() as mp:  # the fixture writer's vocabulary and template, for this file only
        mp.setattr(fixtures_moe, "_tokens", tokens)
        mp.setattr(fx, "CHAT_TEMPLATE", TEMPLATE)  # add_vocab writes fixtures.CHAT_TEMPLATE
        fixtures_moe.write_tiny_moe(path, replace(fixtures_moe.GPT_OSS, context_length=1024))
    return Scripted(ggufpy.load(path))


@pytest.fixture(scope="module")
def server(gpt_oss):
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    from ggufpy.server.app import create_app
    from tests.server_live import LiveServer

    live = LiveServer(create_app(gpt_oss, parallel=1, ctx_size=1024, model_id="gpt-oss-tiny"))
    yield live
    live.stop()


def test_fixture_speaks_harmony(gpt_oss):
    tok = gpt_oss.tokenizer
    ids = {t: tok.encode(t, add_special=False, parse_special=True) for t in HARMONY_TOKENS}
    assert all(len(v) == 1 for v in ids.values())
    assert tok.eog_ids >= {ids["<|return|>"][0], ids["<|call|>"][0]} and ids["<|end|>"][0] not in tok.eog_ids
    assert tok.decode([ids["<|channel|>"][0], ids["<|end|>"][0]]) == "<|channel|><|end|>"


def chat(server, **kw):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
    kw = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "temperature": 0, **kw}
    return client.chat.completions.create(model="gpt-oss-tiny", max_tokens=160, **kw)


def script(model, text):
    """Make the model's next replies `text` (harmony, its tags as tokens; <|return|>/<|call|> end it)."""
    model.script = model.tokenizer.encode(text, add_special=False, parse_special=True)


ANSWER = (
    "<|channel|>analysis<|message|>Sky check.<|end|><|start|>assistant<|channel|>final<|message|>Sunny, 21 C.<|return|>"
)
ARGS = '{"city":"Paris","unit":"celsius"}'
CALL = (
    "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary"
    f" to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"
)


def streamed(chunks):
    """(content, reasoning, [(name, arguments)], finish reason, tool-call deltas) of a stream."""
    chunks = [c for c in chunks if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    calls = {}
    for d in deltas:
        name, args = calls.get(d.index, ("", ""))
        calls[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    return content, reasoning, [calls[i] for i in sorted(calls)], chunks[-1].choices[0].finish_reason, deltas


def test_reasoning_and_content(server, gpt_oss):
    """A reply in two channels: the analysis is `reasoning_content`, the final message `content`."""
    script(gpt_oss, ANSWER)
    choice = chat(server).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "Sunny, 21 C." and choice.message.reasoning_content == "Sky check."
    content, reasoning, calls, finish, _ = streamed(chat(server, stream=True))
    assert (content, reasoning, calls, finish) == ("Sunny, 21 C.", "Sky check.", [], "stop")


def test_response_format(server, gpt_oss):
    """A structured reply of a harmony model is its final message: content that validates, no reasoning."""
    jsonschema = pytest.importorskip("jsonschema")
    script(gpt_oss, "")
    response_format = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SKY}}
    message = chat(server, response_format=response_format).choices[0].message
    jsonschema.validate(json.loads(message.content), SKY)
    assert getattr(message, "reasoning_content", None) is None


def test_template_variables(server, gpt_oss):
    """reasoning_effort and chat_template_kwargs reach the template (the prompt is the one rendered with them);
    the variables the server sets itself are refused."""
    from ggufpy.chat import encode_chat

    httpx = pytest.importorskip("httpx")
    script(gpt_oss, "<|channel|>final<|message|>ok<|return|>")
    messages = [{"role": "user", "content": "Hi"}]
    template = ChatTemplate.from_tokenizer(gpt_oss.tokenizer, warn=False)
    variables = {"reasoning_effort": "high", "model_identity": "You are tiny."}
    r = chat(server, messages=messages, reasoning_effort="high", extra_body={"chat_template_kwargs": variables})
    assert r.choices[0].message.content == "ok"
    assert r.usage.prompt_tokens == len(encode_chat(gpt_oss.tokenizer, messages, template, **variables))
    assert r.usage.prompt_tokens != len(encode_chat(gpt_oss.tokenizer, messages, template))
    body = {"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"bos_token": "<|start|>system"}}
    bad = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert bad.status_code == 400 and "bos_token" in bad.json()["error"]["message"]


def test_call_when_free(server, gpt_oss):
    """tool_choice "auto": the model's own call message is a tool call, <|call|> ends the reply; streamed, the
    call's name comes first and its arguments in pieces."""
    script(gpt_oss, CALL)
    choice = chat(server, tools=[WEATHER, TIME]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "Use the tool."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and (call.function.name, call.function.arguments) == ("get_weather", ARGS)
    content, reasoning, calls, finish, deltas = streamed(chat(server, tools=[WEATHER, TIME], stream=True))
    assert (content, reasoning, calls, finish) == ("", "Use the tool.", [("get_weather", ARGS)], "tool_calls")
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2
    # no tools offered: the same reply carries no call (llama.cpp drops it too)
    choice = chat(server).choices[0]
    assert choice.message.tool_calls is None and choice.message.reasoning_content == "Use the tool."


def test_forced_call_whole_and_streamed(server, gpt_oss):
    """tool_choice "required": the grammar makes the model write harmony's call message, read into tool_calls."""
    jsonschema = pytest.importorskip("jsonschema")
    script(gpt_oss, "")
    kw = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    choice = chat(server, **kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    content, reasoning, calls, finish, _ = streamed(chat(server, stream=True, **kw))
    assert (content, reasoning, finish) == ("", "", "tool_calls")
    assert calls == [(call.function.name, call.function.arguments)]


def test_named_call_after_a_tool_result(server, gpt_oss):
    """A conversation carrying a call (reasoning beside it) and its result renders; a named call is forced."""
    script(gpt_oss, "")
    args = '{"city": "Paris", "unit": "celsius"}'
    messages = [
        {"role": "user", "content": "Weather in Paris, then the time?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Weather first.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = chat(server, messages=messages, tools=[WEATHER, TIME], tool_choice=named).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}


def test_lazy_grammar_reads_what_gpt_oss_writes_after_the_recipient():
    """tool_choice "auto": after `to=functions.` the lazy grammar takes a tool's name, each header gpt-oss
    writes (`<|constrain|>json`, plain `json`, or none; the channel after a recipient in the role header) and
    arguments valid for that tool; not another name, not arguments of the wrong schema."""
    llguidance = pytest.importorskip("llguidance")
    from ggufpy.server.constrain import lazy_grammar

    plan = toolcalls.plan(TEMPLATE, [{"role": "user", "content": "x"}], [WEATHER, TIME], "auto", False)
    lazy = plan.lazy
    assert lazy.triggers == toolcalls.HARMONY_TRIGGERS and not lazy.repeat and lazy.close == ""

    class Tok:  # lazy_grammar looks up the closing tag's token: harmony has none
        vocab = type("V", (), {"token_to_id": {}})()

    tokenizer, grammar = _tag_tokenizer(llguidance), lazy_grammar(lazy, Tok())
    weather = '{"city": "Paris","unit":"celsius"}'
    for text in (
        f"get_weather <|constrain|>json<|message|>{weather}",
        f"get_weather json<|message|>{weather}",
        f"get_weather<|message|>{weather}",
        f"get_weather<|channel|>commentary json<|message|>{weather}",
        "get_time <|constrain|>json<|message|>{}",
    ):
        assert _accepts(llguidance, tokenizer, grammar, text), text
    for text in (
        f"get_wetter <|constrain|>json<|message|>{weather}",
        "get_weather <|constrain|>json<|message|>{}",
        'get_time <|constrain|>json<|message|>{"city": "Paris"}',
        f"get_weather <|constrain|>json<|message|>{weather}<|end|>",
        f"get_weather <|constrain|>json<|message|>{weather}".replace("<|message|>", "&lt;message&gt;"),
    ):
        assert not _accepts(llguidance, tokenizer, grammar, text), text
    assert not _accepts(llguidance, tokenizer, grammar, f"get_weather <|constrain|>json<|message|>{weather}", True)


def test_call_begun_with_garbage_arguments_is_made_valid(server, gpt_oss):
    """tool_choice "auto": the model writes a call's header and then anything: from `to=functions.` on the lazy
    grammar holds, so the arguments are valid for the tool named; the analysis before it is free."""
    jsonschema = pytest.importorskip("jsonschema")
    begun = (
        "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary"
        " to=functions.get_weather <|constrain|>json<|message|>{ this is ] not JSON"
    )
    script(gpt_oss, begun)
    choice = chat(server).choices[0]  # no tools: the call is dropped, its text was garbage
    assert choice.message.tool_calls is None
    choice = chat(server, tools=[WEATHER, TIME]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Use the tool."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_call_whose_recipient_opens_the_reply_is_made_valid(server, gpt_oss):
    """tool_choice "auto": gpt-oss may put the recipient in the role header the prompt began
    (`<|start|>assistant` + ` to=functions.f<|channel|>commentary json<|message|>`): the trigger spans the
    prompt's end and the reply's first tokens, and the arguments after it are made valid."""
    jsonschema = pytest.importorskip("jsonschema")
    begun = " to=functions.get_weather<|channel|>commentary json<|message|>{ this is ] not JSON"
    script(gpt_oss, begun)
    choice = chat(server).choices[0]  # no tools: free, and the garbage call is dropped
    assert choice.message.tool_calls is None
    choice = chat(server, tools=[WEATHER, TIME]).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_final_message_mentioning_the_namespace_stays_free(server, gpt_oss):
    """Only a recipient triggers the grammar: a final message whose text says `to=functions.` is content."""
    text = "Say to=functions.get_weather if you like."
    script(gpt_oss, f"<|channel|>final<|message|>{text}<|return|>")
    choice = chat(server, tools=[WEATHER, TIME]).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == text
