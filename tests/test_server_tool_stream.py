"""Hermes / Llama 3 tool calls streamed in pieces (name first, then the arguments as they are written), and
`tool_choice: "auto"` calls constrained once the model writes `<tool_call>` (llama.cpp's lazy grammars).

The readers are checked on text (whole, a character at a time, random pieces; random JSON); the lazy constraint
on SmolLM2's tokenizer; end to end, a tiny llama with a Qwen-style template and `<tool_call>` / `</tool_call>` as
user-defined tokens (Qwen's vocabulary has them), made to write chosen tokens (`Scripted`, as the harmony tests
do), through the openai client against a real server; and SmolLM2 itself, made to begin a call.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from ggufpy.chat import ChatTemplate  # noqa: E402
from ggufpy.server import tools as toolcalls  # noqa: E402
from ggufpy.server.constrain import LazyConstraint, compile_grammar, lazy_grammar, token_table  # noqa: E402
from ggufpy.server.harmony import CallDelta, merge  # noqa: E402
from ggufpy.server.tool_stream import JsonValue  # noqa: E402
from tests.test_server_tools import PARAMS, QWEN_LIKE, TOOLS  # noqa: E402

HERMES = toolcalls.FORMATS["hermes"]
LLAMA3 = toolcalls.FORMATS["llama3"]
ARGS = {"city": "Paris", "unit": "celsius"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def stream(fmt, text, cuts):
    """The reader's pieces, `text` fed in the pieces `cuts` (positions) make, then closed."""
    r = toolcalls.ToolCallReader(fmt)
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [p for a, b in itertools.pairwise(bounds) for p in r.feed(text[a:b])] + r.close()


def by_index(pieces):
    """Tool-call deltas summed per index, as the openai client accumulates them: [(id, name, arguments)]."""
    calls = {}
    for p in pieces:
        if isinstance(p, CallDelta):
            old = calls.get(p.index, (None, "", ""))
            calls[p.index] = (old[0] or p.id, old[1] + (p.name or ""), old[2] + p.arguments)
    return [calls[i] for i in sorted(calls)]


# -- the readers, on text ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (HERMES, "Sure.\n" + CALL, "Sure.\n", [("get_weather", ARGS)]),
        (HERMES, CALL.replace('{"name": "get_weather", ', '{ "name" :"get_weather" ,\n'), "", [("get_weather", ARGS)]),
        (  # arguments before the name: sent when the name comes, whole
            HERMES,
            '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>',
            "",
            [("get_time", {"zone": "UTC"})],
        ),
        (HERMES, "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        (
            HERMES,
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            [],
        ),
        (
            LLAMA3,
            ' <|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
            "",
            [("get_time", {"zone": "UTC"})],
        ),
        (
            LLAMA3,
            '{"name": "f", "parameters": {"s": "}{;"}};\n{"name": "g", "parameters": {}}',
            "",
            [("f", {"s": "}{;"}), ("g", {})],
        ),
        (LLAMA3, '{"name": "f", "parameters": "x"}', '{"name": "f", "parameters": "x"}', []),
    ],
)
def test_pieces_add_up_to_the_whole_reply(fmt, text, content, calls):
    """Fed whole, a character at a time or in random pieces, the reply reads the same; each call's first delta
    names it (id, name, arguments ""), the others add arguments; the arguments are `json.dumps` of what was
    written; and `tools.reply` (the non-streamed message) is the same."""
    rng = np.random.default_rng(0)
    whole = stream(fmt, text, [])
    for cuts in ([], range(len(text)), *(rng.integers(0, len(text), 6) for _ in range(5))):
        pieces = stream(fmt, text, list(cuts))
        got, _, merged = merge(pieces)
        assert got == content
        assert [(n, json.loads(a)) for _, n, a in by_index(pieces)] == calls
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in merged] == [
            (n, a) for _, n, a in by_index(whole)
        ]
        for i, _ in enumerate(calls):
            deltas = [p for p in pieces if isinstance(p, CallDelta) and p.index == i]
            assert deltas[0].id.startswith("call_") and deltas[0].name and deltas[0].arguments in ("", "{")
            assert all(d.id is None and d.name is None for d in deltas[1:])
    for (_, _, args), (_, want) in zip(by_index(whole), calls, strict=True):
        assert args == json.dumps(want, ensure_ascii=False)
    message, finish = toolcalls.reply(fmt, text, "stop")
    assert finish == ("tool_calls" if calls else "stop")
    assert [json.loads(c["function"]["arguments"]) for c in message.get("tool_calls", [])] == [a for _, a in calls]


def test_arguments_stream_as_written():
    """A long call fed token by token sends its name first, then many argument pieces, each as soon as it is
    certain: a number when it ends, a string's text before an unfinished escape or a possible closing tag."""
    r = toolcalls.ToolCallReader(HERMES)
    head = r.feed('<tool_call>\n{"name": "get_weather", "argu')
    assert head == []  # the arguments have not begun: the call may still be none
    first = r.feed('ments": {"city": "Par')
    assert [(p.name, p.arguments) for p in first] == [("get_weather", ""), (None, '{"city": "Par')]
    assert [p.arguments for p in r.feed("is \\u00")] == ["is "]  # the escape is unfinished
    assert [p.arguments for p in r.feed("e9 </tool")] == ["é "]  # "</tool" may be the closing tag: held
    assert [p.arguments for p in r.feed('>", "n": 12')] == ['</tool>", "n": ']  # it was not; 12 may go on
    assert [p.arguments for p in r.feed(".5e1}}\n</tool_call>")] == ["125.0}"]  # the call's own } is structure
    assert r.close() == [] and r.calls == 1


def test_a_closing_tag_inside_the_arguments_ends_the_call():
    """The first `</tool_call>` ends the call (as the whole-reply reader always read it): the held `</tool`
    was never sent, and the arguments stop where the model left them."""
    text = '<tool_call>{"name": "f", "arguments": {"s": "a</tool_call> after'
    for cuts in ([], range(len(text))):
        pieces = stream(HERMES, text, list(cuts))
        assert by_index(pieces)[0][1:] == ("f", '{"s": "a') and merge(pieces)[0] == " after"


@st.composite
def written_json(draw):
    """A JSON object and a way a model might write it (spacing, indentation, escapes)."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(10**20), 10**20)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12)
    )
    values = st.recursive(
        scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=12
    )
    obj = draw(st.dictionaries(st.text(max_size=6), values, max_size=4))
    indent = draw(st.sampled_from([None, 0, 2]))
    seps = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    return obj, json.dumps(obj, indent=indent, separators=seps, ensure_ascii=draw(st.booleans()))


@settings(max_examples=150, deadline=None)
@given(written_json(), st.lists(st.integers(0, 400), max_size=12), st.sampled_from([HERMES, LLAMA3]))
def test_streamed_arguments_are_json_dumps(case, cuts, fmt):
    """Whatever JSON the arguments are and however they are cut, their pieces add up to `json.dumps` of them
    (what the non-streamed reply has always sent)."""
    _obj, written = case
    call = f'{{"name": "f", "{fmt.arguments_key}": {written}}}'
    text = f"<tool_call>{call}</tool_call>" if fmt.open else call
    pieces = stream(fmt, text, [c % (len(text) + 1) for c in cuts])
    ((_, name, args),) = by_index(pieces)
    assert (name, args) == ("f", json.dumps(json.loads(written), ensure_ascii=False))
    assert merge(pieces)[0] == ""


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 01}',
        '{"a": tru}',
        '{"a": "x\\q"}',
        '{"a": "x\ny"}',
        '{"a": 1,}',
        "[1 2]",
        '{"a" 1}',
        '{"a": -}',
        "{1: 2}",
    ],
)
def test_json_value_refuses_what_json_loads_refuses(text):
    with pytest.raises(ValueError):
        json.loads(text)
    value = JsonValue()
    value.feed(text)
    assert value.failed and not value.done


# -- the lazy constraint, on SmolLM2's tokenizer -----------------------------------------------------------
def lazy_constraint(tokenizer, parallel=False):
    plan = toolcalls.plan(QWEN_LIKE, [{"role": "user", "content": "x"}], TOOLS, "auto", parallel)
    table = token_table(tokenizer)
    grammar = compile_grammar("lark", lazy_grammar(plan.lazy, tokenizer), table)
    return LazyConstraint(table, tokenizer, grammar, plan.lazy)


def test_plan_is_lazy_for_auto_hermes_and_llama3():
    messages = [{"role": "user", "content": "x"}]
    hermes = toolcalls.plan(QWEN_LIKE, messages, TOOLS, "auto", False).lazy
    assert hermes.triggers == ("<tool_call>",) and not hermes.at_start
    assert toolcalls.plan(QWEN_LIKE, messages, TOOLS, None, True).lazy.repeat
    assert toolcalls.plan(QWEN_LIKE, messages, TOOLS, "required", False).lazy is None
    assert toolcalls.plan(QWEN_LIKE, messages, TOOLS, "none", False).lazy is None
    assert toolcalls.plan(QWEN_LIKE, messages, None, "auto", False).lazy is None
    from tests.test_server_tools import LLAMA3_LIKE

    llama3 = toolcalls.plan(LLAMA3_LIKE, messages, TOOLS, "auto", True).lazy  # a Llama 3 reply is one call
    assert (llama3.triggers, llama3.close, llama3.at_start, llama3.repeat) == (("{",), "", True, False)
    assert toolcalls.plan(LLAMA3_LIKE, messages, TOOLS, "required", False).lazy is None


@pytest.mark.parametrize("seed", range(4))
def test_lazy_constraint_frees_then_forces_a_valid_call(smollm2, seed):
    """No mask before `<tool_call>` (the logits pass untouched), then only tokens of a valid call: random
    tokens among the allowed ones make a call of a given tool with valid arguments, and the reply is over."""
    tokenizer = smollm2.tokenizer
    c = lazy_constraint(tokenizer)
    logits = np.random.default_rng(seed).standard_normal(smollm2.config.vocab_size).astype(np.float32)
    ids = tokenizer.encode("I will look.\n<tool_call>", add_special=False)
    for t in ids:
        assert c.apply(logits) is logits and not c.finished
        c.advance(t)
    rng = np.random.default_rng(seed)
    for _ in range(300):
        allowed = np.flatnonzero(np.isfinite(c.apply(logits)))
        assert 0 < len(allowed) < len(logits)
        token = int(rng.choice(allowed))
        ids.append(token)
        c.advance(token)
        if c.finished:
            break
    assert c.finished
    message, finish = toolcalls.reply(HERMES, tokenizer.decode(ids), "stop")
    (call,) = message["tool_calls"]
    assert finish == "tool_calls" and message["content"] == "I will look."
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


def llama3_constraint(tokenizer):
    from tests.test_server_tools import LLAMA3_LIKE

    plan = toolcalls.plan(LLAMA3_LIKE, [{"role": "user", "content": "x"}], TOOLS, "auto", False)
    table = token_table(tokenizer)
    grammar = compile_grammar("lark", lazy_grammar(plan.lazy, tokenizer), table)
    return LazyConstraint(table, tokenizer, grammar, plan.lazy)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("opening", ["{", '\n {"', '{"name'])
def test_llama3_reply_opening_a_json_object_is_forced_into_a_call(smollm2, seed, opening):
    """Llama 3 (llama.cpp's pattern trigger): a reply whose first text is `{` is a call; the `{` and what came
    with it go to the grammar, then only tokens of a valid call, and the reply ends with the call."""
    tokenizer = smollm2.tokenizer
    c = llama3_constraint(tokenizer)
    logits = np.random.default_rng(seed).standard_normal(smollm2.config.vocab_size).astype(np.float32)
    ids = tokenizer.encode(opening, add_special=False)
    assert c.apply(logits) is logits  # nothing is masked before the reply opens
    for t in ids:
        assert np.isfinite(c.apply(logits)[t]) and not c.finished
        c.advance(t)
    assert c.active
    rng = np.random.default_rng(seed)
    for _ in range(300):
        allowed = np.flatnonzero(np.isfinite(c.apply(logits)))
        assert 0 < len(allowed) < len(logits)
        token = int(rng.choice(allowed))
        ids.append(token)
        c.advance(token)
        if c.finished:
            break
    assert c.finished
    message, finish = toolcalls.reply(toolcalls.FORMATS["llama3"], tokenizer.decode(ids), "stop")
    (call,) = message["tool_calls"]
    assert finish == "tool_calls" and not message["content"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


@pytest.mark.parametrize("text", ['Sure: {"name": "get_time"}', ' The answer is {"a": 1}', "x{"])
def test_llama3_reply_opening_with_text_stays_free(smollm2, text):
    """Only the reply's first text can trigger: a `{` later (after words) leaves every token allowed."""
    tokenizer = smollm2.tokenizer
    c = llama3_constraint(tokenizer)
    logits = np.zeros(smollm2.config.vocab_size, np.float32)
    for t in tokenizer.encode(text + ' {"name": "', add_special=False):
        assert c.apply(logits) is logits and not c.finished
        c.advance(t)
    assert c.apply(logits) is logits and not c.active and not c.finished


def test_lazy_constraint_again_after_a_call_when_parallel(smollm2):
    tokenizer = smollm2.tokenizer
    c = lazy_constraint(tokenizer, parallel=True)
    logits = np.zeros(smollm2.config.vocab_size, np.float32)
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\nand '
    for t in tokenizer.encode(text + "<tool_call>", add_special=False):
        c.advance(t)
    assert not c.finished and c.active and not np.isfinite(c.apply(logits)).all()
    c = lazy_constraint(tokenizer, parallel=True)
    for t in tokenizer.encode(text, add_special=False):
        c.advance(t)
    assert not c.finished and not c.active and c.apply(logits) is logits


# -- end to end: a tiny Qwen-style llama, scripted ---------------------------------------------------------
QWEN_TAGS = ["<tool_call>", "</tool_call>"]
LEFTOVER = ['>Ċ{"', ">!!"]  # byte-level texts of ">\n{\"" and ">!!": tokens that end a trigger and go on


class Scripted:
    """A model whose k-th generated token gets +1e4 on `script[k]` (test_server_harmony.py's device): the tiny
    model's random weights write no calls of their own."""

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
def qwen_tiny(tmp_path_factory):
    import ggufpy
    from conformance import fixtures as fx

    original = fx._tokens

    def tokens():
        base, types = original()
        extra = QWEN_TAGS + LEFTOVER
        kinds = [int(gguf.TokenType.USER_DEFINED)] * len(QWEN_TAGS) + [int(gguf.TokenType.NORMAL)] * len(LEFTOVER)
        return base + extra, types + kinds

    path = tmp_path_factory.mktemp("qwen-tools") / "tiny-qwen-tools.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fx, "_tokens", tokens)
        mp.setattr(fx, "CHAT_TEMPLATE", QWEN_LIKE)
        fx.write_tiny_llama(path, replace(fx.TinyLlama(), context_length=4096))
    return Scripted(ggufpy.load(path))


@pytest.fixture(scope="module")
def server(qwen_tiny):
    from ggufpy.server.app import create_app
    from tests.server_live import LiveServer

    live = LiveServer(create_app(qwen_tiny, parallel=2, ctx_size=2048, model_id="qwen-tiny"))
    yield live
    live.stop()


def chat(server, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
    kw = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0, "max_tokens": 200, **kw}
    return client, client.chat.completions.create(model="qwen-tiny", **kw)


def script(model, text, ids=()):
    model.script = model.tokenizer.encode(text, add_special=False, parse_special=True) + list(ids)


def streamed_calls(chunks):
    """(content, [(id, name, arguments)] summed by index, finish reason, tool-call deltas) of a stream."""
    chunks = [c for c in chunks if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    calls = {}
    for d in deltas:
        old = calls.get(d.index, (None, "", ""))
        calls[d.index] = (old[0] or d.id, old[1] + (d.function.name or ""), old[2] + (d.function.arguments or ""))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return content, [calls[i] for i in sorted(calls)], chunks[-1].choices[0].finish_reason, deltas


def test_fixture_has_qwens_tags(qwen_tiny):
    tok = qwen_tiny.tokenizer
    assert [len(tok.encode(t, add_special=False)) for t in QWEN_TAGS] == [1, 1]
    assert tok.decode(tok.encode(CALL, add_special=False)) == CALL


def test_a_call_streams_in_pieces(server, qwen_tiny):
    """tool_choice "auto", a call the model writes (its tags as Qwen's single tokens): streamed, the first delta
    names it and the arguments come in many pieces that add up to the non-streamed call; the openai client's
    stream helper puts together the same message."""
    script(qwen_tiny, "Let me see.\n" + CALL + "<|endoftext|>")
    _, r = chat(server, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me see."
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", json.dumps(ARGS))
    _, chunks = chat(server, tools=TOOLS, stream=True)
    content, calls, finish, deltas = streamed_calls(chunks)
    assert (content, finish) == ("Let me see.\n", "tool_calls")
    assert [c[1:] for c in calls] == [(call.function.name, call.function.arguments)]
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function" and deltas[0].function.name
    assert deltas[0].function.arguments == "" and len(deltas) > 10  # one piece per token or so
    client, _ = chat(server, max_tokens=1)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with client.chat.completions.stream(
        model="qwen-tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=200
    ) as s:
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_garbage_after_the_trigger_becomes_a_valid_call(server, qwen_tiny, stream):
    """A model that writes `<tool_call>` and then anything: without tools the garbage is what it writes; with
    tools (auto) the rest of the call is constrained, so it is a valid call of one of the tools."""
    garbage = "<tool_call>\nhello, this is not JSON at all } ] ) and more of it"
    script(qwen_tiny, garbage)
    _, r = chat(server, max_tokens=len(qwen_tiny.script) + 4)
    assert r.choices[0].message.content.startswith(garbage)
    _, r = chat(server, tools=TOOLS, stream=stream)
    if stream:
        content, calls, finish, _ = streamed_calls(r)
        ((_, name, arguments),) = calls
    else:
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        ((name, arguments),) = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls" and not content
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_trigger_ending_inside_a_token(server, qwen_tiny):
    """`<tool_call` then one token `>\\n{"`: the trigger ends inside it and its rest is the call's beginning,
    fed to the grammar, which then holds; `>!!` goes on with what no call can be: that call stays free (its
    text is content, as the model wrote it)."""
    tok = qwen_tiny.tokenizer
    good, bad = (tok.vocab.token_to_id[t] for t in LEFTOVER)
    script(qwen_tiny, "<tool_call", [good, *tok.encode("nonsense", add_special=False)])
    _, r = chat(server, tools=TOOLS)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    script(qwen_tiny, "<tool_call", [bad, 0])
    _, r = chat(server, tools=TOOLS)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == "<tool_call>!!"


def test_parallel_calls_and_free_text_between(server, qwen_tiny):
    """parallel_tool_calls: free text again after a call, and a second call constrained in turn."""
    second = CALL.replace(
        '"get_weather", "arguments": {"city": "Paris", "unit": "celsius"}', '"get_time", "arguments": {"zone": "UTC"}'
    )
    script(qwen_tiny, CALL + "\nthen\n" + second + "<|endoftext|>")
    _, r = chat(server, tools=TOOLS, parallel_tool_calls=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "then"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
    _, chunks = chat(server, tools=TOOLS, parallel_tool_calls=True, stream=True)
    content, calls, finish, _ = streamed_calls(chunks)
    assert [c[1:] for c in calls] == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert (content.strip(), finish) == ("then", "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_reply_opening_with_a_brace_becomes_a_valid_call(qwen_tiny, stream):
    """A Llama-3-style template, tool_choice "auto": a reply that opens with `{` and goes on with garbage is
    made a valid call (without tools the garbage is what it writes); one that opens with words is left free."""
    from ggufpy.server.app import create_app
    from tests.server_live import LiveServer
    from tests.test_server_tools import LLAMA3_LIKE

    template = ChatTemplate(LLAMA3_LIKE, name="llama3")
    live = LiveServer(create_app(qwen_tiny, parallel=1, ctx_size=2048, model_id="qwen-tiny", chat_template=template))
    try:
        garbage = " { this is not a call ] ) at all"
        script(qwen_tiny, garbage)
        _, r = chat(live, max_tokens=len(qwen_tiny.script) + 4)
        assert r.choices[0].message.content.startswith(garbage)
        _, r = chat(live, tools=TOOLS, stream=stream)
        if stream:
            content, calls, finish, _ = streamed_calls(r)
            ((_, name, arguments),) = calls
        else:
            content, finish = r.choices[0].message.content, r.choices[0].finish_reason
            ((name, arguments),) = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert finish == "tool_calls" and not content
        jsonschema.validate(json.loads(arguments), PARAMS[name])
        script(qwen_tiny, "Well { this is not a call" + "<|endoftext|>")
        _, r = chat(live, tools=TOOLS)
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content == "Well { this is not a call"
    finally:
        live.stop()


# -- SmolLM2, made to begin a call -------------------------------------------------------------------------
@pytest.mark.slow  # SmolLM2's ~300-token Qwen-style tool prompt, twice (~20-40 s on a loaded 2-core machine)
def test_smollm2_call_begun_is_valid_and_streams_the_same(smollm2):
    """SmolLM2 (Qwen-like template) made to write `<tool_call>\\n` and then left alone under tool_choice "auto":
    a valid call; streamed, its pieces add up to the non-streamed one."""
    from ggufpy.server.app import create_app
    from tests.server_live import LiveServer

    model = Scripted(smollm2)
    model.script = smollm2.tokenizer.encode("<tool_call>\n", add_special=False)
    template = ChatTemplate(QWEN_LIKE, name="qwen")
    live = LiveServer(create_app(model, parallel=1, ctx_size=1024, model_id="qwen-tiny", chat_template=template))
    try:
        kw = {
            "tools": TOOLS,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "What is the weather in Rome?"}],
        }
        _, r = chat(live, **kw)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        _, chunks = chat(live, stream=True, **kw)
        _content, calls, finish, deltas = streamed_calls(chunks)
        assert [c[1:] for c in calls] == [(call.function.name, call.function.arguments)] and finish == "tool_calls"
        assert sum(1 for d in deltas if d.function.arguments) > 1
    finally:
        live.stop()


def test_parameters_llguidance_refuses_leave_auto_calls_free(server, qwen_tiny):
    """A tool whose parameters do not compile (a 400 when the call is forced) leaves "auto" as it was: the
    model's call is not constrained, and is read back."""
    odd = {
        "type": "function",
        "function": {"name": "odd", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}},
    }
    script(qwen_tiny, '<tool_call>\n{"name": "odd", "arguments": {"a": 1}}\n</tool_call><|endoftext|>')
    _, r = chat(server, tools=[odd])
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("odd", '{"a": 1}')
    with pytest.raises(openai.BadRequestError, match="tools"):
        chat(server, tools=[odd], tool_choice="required")
