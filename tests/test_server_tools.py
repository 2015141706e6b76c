"""Tool calling in `ggufpy serve`: tools rendered through the chat template, calls read back into
`message.tool_calls` (Hermes `<tool_call>` and Llama 3 JSON formats), streamed as OpenAI's tool-call deltas,
and forced (`tool_choice` "required" or a named function) with structured output.

SmolLM2's own template renders no tools, so it gets the Hermes system prompt written by the server; two small
templates here stand in for Qwen 2.5's (Hermes, tools rendered by the template) and Llama 3.1's (JSON calls).
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ggufpy.chat import ChatTemplate  # noqa: E402
from ggufpy.server import tools as toolcalls  # noqa: E402
from ggufpy.server.app import create_app  # noqa: E402
from ggufpy.server.harmony import merge  # noqa: E402
from tests.server_live import LiveServer  # noqa: E402

MODEL_ID = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# Qwen 2.5's template, cut down: tools in the system turn, calls as <tool_call> JSON, results as <tool_response>
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json "
    'object within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3.1's convention in SmolLM2's turn tokens: tools listed in the user turn, a call is a bare JSON object
LLAMA3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if tools and loop.last and m.role == 'user' %}"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    'that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": '
    "dictionary of argument name and its value}. Do not use variables.\n\n{% for t in tools %}"
    "{{ t | tojson }}\n\n{% endfor %}{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# -- reading calls, no model ---------------------------------------------------------------------------------
HERMES = toolcalls.FORMATS["hermes"]
LLAMA3 = toolcalls.FORMATS["llama3"]


def read(fmt, text, step=None):
    """Pieces of `text` fed whole, or `step` characters at a time (as a stream would)."""
    reader = toolcalls.ToolCallReader(fmt)
    step = step or len(text) or 1
    pieces = [p for i in range(0, len(text), step) for p in reader.feed(text[i : i + step])] + reader.close()
    content, _, calls = merge(pieces)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("step", [None, 1, 3])
@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (HERMES, "Sure.", "Sure.", []),
        (
            HERMES,
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Let me check.\n",
            [("get_weather", {"city": "Paris"})],
        ),
        (  # two calls; the second one unclosed at the end of the reply (the model stopped after its JSON)
            HERMES,
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}',
            "\n",
            [("a", {}), ("b", {"x": 1})],
        ),
        (HERMES, "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        (HERMES, "a < b and <tool_ca", "a < b and <tool_ca", []),
        (LLAMA3, '{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [("get_time", {"zone": "UTC"})]),
        (
            LLAMA3,
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
            "",
            [("f", {}), ("g", {})],
        ),
        (
            LLAMA3,
            '{"name": "f", "parameters": {"s": "a;b"}};{"name": "g", "parameters": {}}',
            "",
            [("f", {"s": "a;b"}), ("g", {})],
        ),
        # a call is sent as soon as its name and arguments begin (streamed): text after it is content
        (LLAMA3, '{"name": "f", "parameters": {}} and then', " and then", [("f", {})]),
        (LLAMA3, "It is sunny {really}.", "It is sunny {really}.", []),
        (LLAMA3, '{"not": "a call"}', '{"not": "a call"}', []),
    ],
)
def test_reader(fmt, text, content, calls, step):
    assert read(fmt, text, step) == (content, calls)


def test_detect_and_render(smollm2):
    own = ChatTemplate.from_tokenizer(smollm2.tokenizer, warn=False).template
    assert toolcalls.detect(own) == (HERMES, False)
    assert toolcalls.detect(QWEN_LIKE) == (HERMES, True)
    assert toolcalls.detect(LLAMA3_LIKE)[0] is LLAMA3
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    messages, passed = toolcalls.render_tools(HERMES, False, history, TOOLS)
    assert passed is None and messages[0]["role"] == "system" and '"get_time"' in messages[0]["content"]
    assert (
        messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    messages, passed = toolcalls.render_tools(HERMES, True, history, TOOLS)
    assert passed == TOOLS and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = ChatTemplate(QWEN_LIKE).render(messages, tools=passed)
    assert '"arguments": {"city": "Paris"}' in text and "<tool_response>\nsunny" in text


@pytest.mark.parametrize(
    ("tools", "choice", "needle"),
    [
        ([{"type": "function", "function": {"description": "no name"}}], "auto", "tools[0]"),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "auto", "parameters"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope'"),
    ],
)
def test_check_tools(tools, choice, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        toolcalls.check_tools(tools, choice)


# -- through the server --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(smollm2):
    """One server per template: SmolLM2's own, the Qwen-like one, the Llama-3-like one."""
    live = {}
    try:
        for name, source in (("own", None), ("qwen", QWEN_LIKE), ("llama3", LLAMA3_LIKE)):
            template = None if source is None else ChatTemplate(source, name=name)
            app = create_app(smollm2, parallel=2, ctx_size=512, model_id=MODEL_ID, chat_template=template)
            live[name] = LiveServer(app)
        yield live
    finally:
        for s in live.values():
            s.stop()


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)


def ask(server, text, **kw):
    kw = {"temperature": 0, "max_tokens": 48, "tools": TOOLS, **kw}
    messages = [{"role": "user", "content": text}]
    return client_of(server).chat.completions.create(model=MODEL_ID, messages=messages, **kw)


def assert_valid_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize(
    "template", ["own", pytest.param("qwen", marks=pytest.mark.slow), pytest.param("llama3", marks=pytest.mark.slow)]
)  # each prefills its own ~250-token tool prompt: 15-25 s on a loaded 2-core machine
def test_forced_call(servers, template):
    """tool_choice "required": the reply is a valid call of one of the tools, in every format."""
    r = ask(servers[template], "What is the weather in Paris?", tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert_valid_call(call)


def test_named_function(servers):
    r = ask(
        servers["own"],
        "What is the weather in Paris?",
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    (call,) = r.choices[0].message.tool_calls
    assert_valid_call(call, "get_time")


@pytest.mark.slow  # two forced calls on the Qwen-like template (~20 s)
def test_streamed_call_equals_unstreamed(servers):
    """Streaming sends the call as OpenAI's tool-call deltas; put together they are the unstreamed call."""
    kw = {"tool_choice": "required"}
    whole = ask(servers["qwen"], "What is the weather in Rome?", **kw).choices[0].message.tool_calls[0]
    chunks = list(ask(servers["qwen"], "What is the weather in Rome?", stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and {d.index for d in deltas} == {0}
    assert "".join(d.function.name or "" for d in deltas) == whole.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


@pytest.mark.slow  # four answers after a 300-token history (~35 s)
def test_tool_result_turn_and_none(servers):
    """A conversation that carries a call and its result renders and answers; tool_choice "none" and "auto"
    give a well-formed reply (content, or calls that validate)."""
    args = '{"city": "Paris", "unit": "celsius"}'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    for name in ("own", "qwen"):
        for choice in ("none", "auto"):
            r = client_of(servers[name]).chat.completions.create(
                model=MODEL_ID, messages=history, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=16
            )
            message = r.choices[0].message
            assert message.content or message.tool_calls
            for call in message.tool_calls or []:
                assert_valid_call(call)
            if choice == "none":
                assert message.tool_calls is None


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_tool_errors(servers, extra, needle):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    r = httpx.post(servers["own"].url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
