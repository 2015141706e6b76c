"""`ggufpy serve` under load, on 127.0.0.1: 32 concurrent clients x 3 requests each on 8 slots, streaming and
not, greedy and seeded, chat and text completions, some clients going away mid-stream.

Every request that was not cancelled returns exactly what the same request returns served alone (batch
invariance end to end), every request is accounted for in /metrics (no slot or queue entry leaks), and the
process's memory comes back near where it was before the load.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ggufpy.kernels._numba import wait_for_compiles  # noqa: E402
from ggufpy.server.app import create_app  # noqa: E402
from tests.server_live import LiveServer  # noqa: E402

MODEL_ID = "smollm2"
CLIENTS, PER_CLIENT, SLOTS = 32, 3, 8
MAX_TOKENS = 4
RSS_SLACK = 96 << 20  # bytes the load may leave behind (allocator caches), far below one leaked cache per request
# (kind, prompt, sampling): the distinct requests the clients pick from
REQUESTS = [
    ("text", "1, 2, 3,", {"temperature": 0}),
    ("text", "The capital of France is", {"temperature": 0}),
    ("text", "Once upon a time", {"temperature": 0.9, "seed": 11}),
    ("text", "def add(a, b):", {"temperature": 0}),
    ("chat", "Name a fruit.", {"temperature": 0}),
    ("chat", "Say hi.", {"temperature": 0.8, "seed": 5}),
    ("text", "Water boils at", {"temperature": 0.7, "extra_body": {"top_k": 20}, "seed": 3}),
    ("chat", "Count to three.", {"temperature": 0}),
]


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def call(client, k: int, stream: bool, cancel: bool) -> tuple[str | None, str | None]:
    """(text, finish_reason) of request k; (None, None) when this client went away mid-stream."""
    kind, prompt, sampling = REQUESTS[k]
    kw = {"model": MODEL_ID, "max_tokens": MAX_TOKENS, **sampling}
    if kind == "chat":
        create, kw = client.chat.completions.create, {**kw, "messages": [{"role": "user", "content": prompt}]}
    else:
        create, kw = client.completions.create, {**kw, "prompt": prompt}
    if not stream:
        r = await create(**kw)
        c = r.choices[0]
        return (c.message.content if kind == "chat" else c.text), c.finish_reason
    parts, finish = [], None
    s = await create(**kw, stream=True)
    async for chunk in s:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        parts.append((c.delta.content if kind == "chat" else c.text) or "")
        finish = c.finish_reason or finish
        if cancel and len(parts) == 2:  # the role chunk / first token: then the client goes away
            await s.close()
            return None, None
    return "".join(parts), finish


@pytest.fixture(scope="module")
def server(smollm2):
    live = LiveServer(create_app(smollm2, parallel=SLOTS, ctx_size=128, model_id=MODEL_ID))
    try:
        yield live
    finally:
        live.stop()


@pytest.mark.slow  # ~100 requests of 4 tokens: a minute or two on a loaded 2-core machine
def test_load_equals_alone(server):
    async def alone():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        try:
            return [await call(c, k, stream=False, cancel=False) for k in range(len(REQUESTS))]
        finally:
            await c.close()

    expected = asyncio.run(alone())

    async def warm_up():  # a batched step's code (the fused batched block, loaded in the background) is
        # loaded once, not leaked: have it in memory before the baseline
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        try:
            await asyncio.gather(*(call(c, k % len(REQUESTS), stream=False, cancel=False) for k in range(SLOTS)))
        finally:
            await c.close()

    asyncio.run(warm_up())
    assert wait_for_compiles(300), "background compiles still running after 300 s"
    asyncio.run(warm_up())  # now on the compiled batched block
    gc.collect()
    baseline = rss()

    async def client_session(i: int):
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        try:
            out = []
            for j in range(PER_CLIENT):
                k, stream = (i * PER_CLIENT + j) % len(REQUESTS), (i + j) % 2 == 1
                cancel = stream and (i + 2 * j) % 5 == 0
                out.append((k, cancel, await call(c, k, stream, cancel)))
            return out
        finally:
            await c.close()

    async def load():
        return await asyncio.wait_for(asyncio.gather(*(client_session(i) for i in range(CLIENTS))), 900)

    results = [r for session in asyncio.run(load()) for r in session]
    cancelled = sum(cancel for _, cancel, _ in results)
    assert len(results) == CLIENTS * PER_CLIENT and 0 < cancelled < len(results)
    for k, cancel, got in results:
        if not cancel:
            assert got == expected[k], f"request {k} {REQUESTS[k]}: {got!r} under load, {expected[k]!r} alone"

    deadline = time.monotonic() + 60
    while True:  # every request finished one way or another, and nothing holds a slot or waits
        m = metrics(server.url)
        finished = sum(v for name, v in m.items() if name.startswith("ggufpy_requests_finished_total"))
        if finished == m["ggufpy_requests_total"] and not m["ggufpy_requests_processing"]:
            break
        assert time.monotonic() < deadline, f"60 s after the load: {m}"
        time.sleep(0.2)
    assert m["ggufpy_requests_waiting"] == 0
    assert m["ggufpy_requests_total"] == len(REQUESTS) + 2 * SLOTS + CLIENTS * PER_CLIENT  # alone, warm-ups, load
    assert 1 <= m.get('ggufpy_requests_finished_total{reason="cancelled"}', 0) <= cancelled
    assert m.get('ggufpy_requests_finished_total{reason="error"}', 0) == 0
    assert httpx.get(server.url + "/health").json()["slots_idle"] == SLOTS
    gc.collect()
    assert rss() - baseline < RSS_SLACK, f"RSS grew by {(rss() - baseline) >> 20} MiB under load"
