"""`ggufpy serve`: the OpenAI-compatible API, driven by the official `openai` client and raw httpx against a
server started here on 127.0.0.1 (a free port, shut down after the module), with SmolLM2 and 4 slots.

The load test checks batch invariance end to end: every response at temperature 0 served among concurrent
ones (some streaming, some cancelled mid-stream) equals the same request served alone.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import ggufpy  # noqa: E402
from ggufpy.server.app import create_app  # noqa: E402
from ggufpy.server.http import MAX_BODY_BYTES  # noqa: E402
from tests.models import smollm2_path  # noqa: E402
from tests.server_live import LiveServer  # noqa: E402

MODEL_ID = "smollm2"
CTX = 256


@pytest.fixture(scope="module")
def model():
    return ggufpy.load(smollm2_path())


@pytest.fixture(scope="module")
def server(model):
    live = LiveServer(create_app(model, parallel=4, ctx_size=CTX, model_id=MODEL_ID))
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)


def chat(client, text, **kw):
    kw = {"temperature": 0, "max_tokens": 8, **kw}
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": text}], **kw)


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [MODEL_ID]


def test_chat_sync(client, model):
    from ggufpy.chat import ChatTemplate, encode_chat

    r = chat(client, "What is the capital of France?")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt = encode_chat(
        model.tokenizer,
        [{"role": "user", "content": "What is the capital of France?"}],
        ChatTemplate.from_tokenizer(model.tokenizer, warn=False),
    )
    assert r.usage.prompt_tokens == len(prompt)
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert chat(client, "What is the capital of France?").choices[0].message.content == choice.message.content


def test_chat_stream_equals_sync(client):
    sync = chat(client, "Name three colors.")
    chunks = list(chat(client, "Name three colors.", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == sync.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == sync.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sync.usage.completion_tokens


def test_completion_max_tokens_and_stop(client):
    r = client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0)
    assert r.usage.completion_tokens <= 6
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 6
    text = r.choices[0].text
    assert text.strip()
    stop = text.strip()[:1]  # the first character the model writes: the answer must end just before it
    s = client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].text == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible(client):
    kw = {"temperature": 1.0, "seed": 1234, "max_tokens": 6}
    a, b = chat(client, "Tell me a story.", **kw), chat(client, "Tell me a story.", **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_logprobs(client):
    r = chat(client, "Hi", logprobs=True, top_logprobs=3, max_tokens=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy takes the most probable token


def test_async_client(server):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        rs = await asyncio.gather(
            *(c.completions.create(model=MODEL_ID, prompt=p, max_tokens=5, temperature=0) for p in ("a", "b"))
        )
        await c.close()
        return rs

    rs = asyncio.run(main())
    assert all(r.choices[0].text is not None and r.usage.completion_tokens >= 1 for r in rs)


def test_embeddings_and_tokenize(server, client, model):
    e = client.embeddings.create(model=MODEL_ID, input=["hello world", "goodbye"])
    vecs = [d.embedding for d in e.data]
    assert len(vecs) == 2 and len(vecs[0]) == model.config.dim
    assert abs(sum(v * v for v in vecs[0]) - 1.0) < 1e-6 and vecs[0] != vecs[1]
    toks = httpx.post(server.url + "/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert toks == model.tokenizer.encode("hello world", add_special=False, parse_special=True)
    assert httpx.post(server.url + "/detokenize", json={"tokens": toks}).json() == {"content": "hello world"}


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "JSON"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, 400, "temperature"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-9"),
        ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, f"context holds {CTX}"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ],
)
def test_errors(server, body, status, needle):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_errors_transport(server):
    big = httpx.post(server.url + "/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1), timeout=30)
    assert big.status_code == 413 and "exceeds the limit" in big.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_api_key(model):
    from fastapi.testclient import TestClient

    with TestClient(create_app(model, parallel=1, ctx_size=64, api_key="sekrit", model_id=MODEL_ID)) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_chat_second_turn_reuses_the_first_turns_cache(client):
    """The chat page sends the whole conversation each turn: the second turn's prompt starts with the first
    turn's prompt and answer, and reuses the cache of both (more cached tokens than the first prompt had)."""
    kw = {"model": MODEL_ID, "max_tokens": 8, "temperature": 0}
    turn = [{"role": "user", "content": "Name a colour of the sky."}]
    a = client.chat.completions.create(messages=turn, **kw)
    turn += [{"role": "assistant", "content": a.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    b = client.chat.completions.create(messages=turn, **kw)
    c = client.chat.completions.create(messages=turn, extra_body={"cache_prompt": False}, **kw)
    assert b.usage.prompt_tokens_details.cached_tokens > a.usage.prompt_tokens
    assert b.choices[0].message.content == c.choices[0].message.content


@pytest.mark.slow  # three prefills of 150+ tokens
def test_prompt_cache_reuses_the_shared_prefix(client, model):
    """A request that starts with an earlier prompt reuses its KV cache for every shared token, reports them as
    cached_tokens, and answers exactly as without the cache."""
    words = "the quick brown fox jumps over the lazy dog and keeps running far away " * 12
    first = model.tokenizer.encode(words, add_special=True)[:150]
    second = first + model.tokenizer.encode(" Then the fox", add_special=False)
    kw = {"model": MODEL_ID, "max_tokens": 4, "temperature": 0}
    a = client.completions.create(prompt=first, **kw)
    assert a.usage.prompt_tokens_details is None or a.usage.prompt_tokens_details.cached_tokens == 0
    b = client.completions.create(prompt=second, **kw)
    c = client.completions.create(prompt=second, extra_body={"cache_prompt": False}, **kw)
    assert b.usage.prompt_tokens_details.cached_tokens == 150  # every shared token (no chunk rounding)
    assert c.usage.prompt_tokens_details.cached_tokens == 0
    assert b.choices[0].text == c.choices[0].text


def metric(server, name):
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def cancelled_count(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith('ggufpy_requests_finished_total{reason="cancelled"}'):
            return float(line.split()[1])
    return 0.0


def test_disconnected_non_streaming_client_frees_its_slot(model):
    # Its own server with room for 4000 tokens: the client must leave long before the answer could be done
    # (200 tokens at CTX = 256 took under 3 s on a fast machine, and the test then saw no disconnect).
    server = LiveServer(create_app(model, parallel=1, ctx_size=4096, model_id=MODEL_ID))
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "logit_bias": {"0": -100}}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, timeout=3)
        deadline = time.monotonic() + 60
        while cancelled_count(server) == 0 or metric(server, "ggufpy_requests_processing"):
            assert time.monotonic() < deadline, "the abandoned request still holds its slot after 60 s"
            time.sleep(0.25)
    finally:
        server.stop()


PROMPTS = ["What is 2+2?", "List the planets.", "Say hello in French.", "Name a fruit."]
N_CLIENTS = 8


@pytest.mark.slow  # ~100 generated tokens; minutes on a loaded 2-core machine
def test_concurrent_requests_equal_alone(server):
    """8 clients at once on 4 slots: non-streaming, streaming, and two cancelled mid-stream. Each finished
    response equals the same request served alone (temperature 0), and every slot is free afterwards."""
    alone = {}
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
    for p in PROMPTS:
        alone[p] = chat(sync, p, max_tokens=8).choices[0].message.content

    async def one(c, i):
        p = PROMPTS[i % len(PROMPTS)]
        kw = {"model": MODEL_ID, "messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": 8}
        if i % 3 == 0:
            r = await c.chat.completions.create(**kw)
            return p, r.choices[0].message.content
        stream = await c.chat.completions.create(**kw, stream=True)
        parts = []
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "")
            if i in (1, 5) and len(parts) == 3:  # a client that goes away mid-stream
                await stream.close()
                return p, None
        return p, "".join(parts)

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(N_CLIENTS))), 600)
        finally:
            await c.close()

    results = asyncio.run(main())
    assert sum(r is None for _, r in results) == 2
    for p, r in results:
        if r is not None:
            assert r == alone[p], p
    deadline = time.monotonic() + 30
    while metric(server, "ggufpy_requests_processing") or metric(server, "ggufpy_requests_waiting"):
        assert time.monotonic() < deadline, "slots still busy 30 s after every client finished"
        time.sleep(0.2)
    finished = httpx.get(server.url + "/metrics").text
    assert 'ggufpy_requests_finished_total{reason="cancelled"}' in finished


ARTIFACT = Path(__file__).parent / "artifacts" / "server_page.png"


@pytest.mark.slow  # the page asks for no max_tokens: a few hundred tokens until the 256-position context is full
def test_chat_page_in_a_browser(server):
    """The page at / in a real browser (Debian's Chromium, headless, driven by Playwright with
    `executable_path`: Playwright's own browser download is not reachable here): send a message, read the
    streamed answer from the page, keep a screenshot as an artifact."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            sync_api.expect(page.locator("#model")).to_have_text(MODEL_ID, timeout=30_000)
            page.fill("#input", "What is the capital of France?")
            page.click("#send")
            sync_api.expect(page.locator(".msg.assistant").first).not_to_be_empty(timeout=120_000)
            sync_api.expect(page.locator("#send")).to_be_enabled(timeout=300_000)  # the stream has ended
            assert "tok/s" in page.locator("#status").inner_text()
            assert page.locator(".msg.user").first.inner_text() == "What is the capital of France?"
            ARTIFACT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACT))
        finally:
            browser.close()


def test_chat_template_stop_strings_end_chat_replies(model):
    """A template's stop strings (plain-text formats have no end-of-turn token) end chat replies as a request's
    own `stop` would, and leave text completions alone."""
    from fastapi.testclient import TestClient

    from ggufpy.chat import ChatTemplate

    own = ChatTemplate.from_tokenizer(model.tokenizer, warn=False)
    body = {
        "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    with TestClient(create_app(model, parallel=1, ctx_size=CTX, model_id=MODEL_ID)) as c:
        full = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    words = full["message"]["content"].split()
    assert full["finish_reason"] == "length" and len(words) >= 3
    stop = " " + words[2]  # a piece the greedy reply contains after its first words
    template = ChatTemplate(own.template, own.bos_token, own.eos_token, name="test", stop=(stop,))
    with TestClient(create_app(model, parallel=1, ctx_size=CTX, model_id=MODEL_ID, chat_template=template)) as c:
        cut = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        text = c.post("/v1/completions", json={"prompt": full["message"]["content"], "max_tokens": 4}).json()
    assert cut["finish_reason"] == "stop"
    assert cut["message"]["content"] == full["message"]["content"][: full["message"]["content"].index(stop)]
    assert text["choices"][0]["finish_reason"] == "length"  # not a chat: the template's stops do not apply
