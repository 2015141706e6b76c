"""Structured output in `ggufpy serve`: `response_format` (json_object, json_schema) and `grammar` (GBNF) through
llguidance, with SmolLM2 on 127.0.0.1. Every answer parses and validates against its schema, greedy and
sampled; a constrained request served among others equals the same request served alone; a bad schema or
grammar is a 400 that says what is wrong."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ggufpy.server.app import create_app  # noqa: E402
from ggufpy.server.constrain import Constraint, GrammarError, compile_grammar, token_table  # noqa: E402
from tests.server_live import LiveServer  # noqa: E402

MODEL_ID = "smollm2"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLORS = {  # an enum and a bounded array
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    },
    "required": ["color", "tags"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "city": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "country": {"enum": ["France", "Italy", "Spain"]},
            },
            "required": ["name", "country"],
            "additionalProperties": False,
        },
        "capital": {"type": "boolean"},
    },
    "required": ["city", "capital"],
    "additionalProperties": False,
}
CASES = [
    ("Describe a person as JSON.", PERSON),
    ("Pick a color and some tags, as JSON.", COLORS),
    ("Tell me about Paris as JSON.", NESTED),
]


@pytest.fixture(scope="module")
def server(smollm2):
    live = LiveServer(create_app(smollm2, parallel=4, ctx_size=256, model_id=MODEL_ID))
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


# -- the mask itself, without a server ----------------------------------------------------------------------
def test_mask_allows_exactly_the_grammar(smollm2):
    """Walk a valid sentence token by token: each of its tokens is allowed, some of the vocabulary never is,
    and the constraint is finished exactly at its end."""
    tok = smollm2.tokenizer
    table = token_table(tok)
    c = Constraint(table, compile_grammar("json_schema", COLORS, table))
    ids = tok.encode('{"color":"green","tags":["a","b"]}', add_special=False)
    for i, t in enumerate(ids):
        assert not c.finished
        masked = c.apply(np.zeros(smollm2.config.vocab_size, np.float32))
        allowed = np.isfinite(masked)
        assert allowed[t], f"token {i} ({tok.decode([t])!r}) was masked"
        assert allowed.sum() < (10 if i == 0 else smollm2.config.vocab_size)  # `{` first; never everything
        c.advance(t)
    assert c.finished
    with pytest.raises(ValueError, match="does not fit the grammar"):
        Constraint(table, compile_grammar("gbnf", 'root ::= "yes"', table)).advance(tok.encode("no")[0])


@pytest.mark.parametrize(
    ("kind", "source", "needle"),
    [
        ("json_schema", {"type": 3}, "type must be a string"),
        ("json_schema", {"$ref": "#/missing"}, "/missing"),
        ("json_schema", {"type": "string", "pattern": "(("}, "regex parse error"),
        ("json_schema", [1, 2], "must be an object"),
        ("gbnf", 'root ::= "open', "not valid GBNF"),
        ("gbnf", "root ::= undefined-rule", "not valid GBNF"),
        ("xml", "<a/>", "grammar kind 'xml'"),
    ],
)
def test_bad_grammars(smollm2, kind, source, needle):
    with pytest.raises(GrammarError, match=needle):
        compile_grammar(kind, source, token_table(smollm2.tokenizer))


# -- through the server -------------------------------------------------------------------------------------
def ask(client, text, max_tokens=48, **kw):
    messages = [{"role": "user", "content": text}]
    return client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=max_tokens, **kw)


@pytest.mark.slow  # six constrained answers of up to 48 tokens (about a minute on a loaded 2-core machine)
def test_json_schema_answers_validate(server):
    """Three schemas (flat with ranges, enum + array, nested), greedy and seeded-sampled, all at once on 4
    slots: every answer is complete JSON that validates; each greedy one equals the same request alone."""
    sampled = {"temperature": 1.0, "seed": 7}

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        try:
            calls = [
                c.chat.completions.create(
                    model=MODEL_ID,
                    messages=[{"role": "user", "content": text}],
                    max_tokens=48,
                    response_format=schema_format(schema),
                    **kw,
                )
                for text, schema in CASES
                for kw in ({"temperature": 0}, sampled)
            ]
            return await asyncio.gather(*calls)
        finally:
            await c.close()

    answers = asyncio.run(main())
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
    for n, r in enumerate(answers):
        text, schema = CASES[n // 2]
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
        if n % 2 == 0:  # greedy: the same request alone gives the same answer (batch invariance)
            alone = ask(sync, text, response_format=schema_format(schema), temperature=0)
            assert alone.choices[0].message.content == choice.message.content


def test_json_object_and_gbnf(client):
    r = ask(
        client, "Describe a cat in JSON with its name and age.", response_format={"type": "json_object"}, temperature=0
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    g = ask(client, "Is the sky blue?", extra_body={"grammar": 'root ::= ("yes" | "no") "."'}, temperature=0)
    assert g.choices[0].message.content in ("yes.", "no.") and g.choices[0].finish_reason == "stop"


def test_completions_take_a_grammar(client):
    r = client.completions.create(
        model=MODEL_ID, prompt="The answer is", max_tokens=8, temperature=0, extra_body={"grammar": "root ::= [0-9]{3}"}
    )
    assert r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()


def test_streamed_json_validates(client):
    fmt = schema_format(PERSON)
    chunks = ask(client, "Describe a person as JSON.", response_format=fmt, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    jsonschema.validate(json.loads("".join(parts)), PERSON)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}}, "type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema: required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"grammar": 'root ::= "open'}, "not valid GBNF"),
        ({"grammar": "root ::= x", "response_format": {"type": "json_object"}}, "send one of them"),
    ],
)
def test_bad_structure_is_a_400(server, extra, needle):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


# -- the scheduler: a constrained row among unconstrained ones, on the tiny synthetic model -------------------
def run_jobs(scheduler, jobs) -> list[tuple[str, str]]:
    """(text, finish_reason) of each job, submitted together."""
    import threading

    texts, ends, done = [[] for _ in jobs], [None] * len(jobs), threading.Semaphore(0)

    def emit(i, ev):
        if ev.kind == "text":
            texts[i].append(ev.text)
        else:
            ends[i] = ev.finish_reason if ev.kind == "done" else ev.message
            done.release()

    for i, job in enumerate(jobs):
        scheduler.submit(job, lambda ev, i=i: emit(i, ev))
    for _ in jobs:
        assert done.acquire(timeout=300)
    return [("".join(t), e) for t, e in zip(texts, ends, strict=True)]


def test_scheduler_masks_only_its_row(tiny_llama):
    """A constrained job follows its grammar, and neither it nor the free job beside it changes when they
    share decode steps (the mask applies to its own row)."""
    import re

    from ggufpy.sampling import Sampler, SamplingParams
    from ggufpy.server.scheduler import Job, Scheduler

    table = token_table(tiny_llama.tokenizer)
    grammar = compile_grammar("gbnf", 'root ::= [a-z]{3} "!"', table)

    def jobs():
        constrained = Job([1, 40, 41], 12, Sampler(SamplingParams(temperature=0)))
        constrained.constraint = Constraint(table, grammar)
        free = Job([1, 50, 51, 52], 8, Sampler(SamplingParams(temperature=0.9, seed=3)))
        return constrained, free

    scheduler = Scheduler(tiny_llama, parallel=2, ctx_size=64)
    scheduler.start()
    try:
        a, b = jobs()
        alone = run_jobs(scheduler, [a]) + run_jobs(scheduler, [b])
        together = run_jobs(scheduler, list(jobs()))
    finally:
        scheduler.stop()
    assert re.fullmatch(r"[a-z]{3}!", alone[0][0]) and alone[0][1] == "stop"
    assert together == alone
