"""`ggufpy serve --numerics llamacpp-avx2`: every response is llama.cpp's own decode of the request, token by
token, whatever else is in the batch.

The golden (conformance/goldens/served_smollm2.json, `python -m conformance.record_served`) holds llama.cpp's
greedy continuations of four SmolLM2 prompts, each token (the prompt's too) decoded alone on an AVX2 build.
The server takes the four requests at once beside two others (one streaming, one sampled), on 4 slots, so the
prompts are prefilled together and decoded in batches of up to four rows: each answer must still be the golden.
The exact numerics (the default) leave llama.cpp's path within a few tokens on every prompt: the test can fail.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import ggufpy
from ggufpy.cli import serve
from ggufpy.kernels import AVAILABLE, JIT_DISABLED
from tests.models import smollm2_path

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from ggufpy.server.app import create_app  # noqa: E402
from tests.server_live import LiveServer  # noqa: E402

GOLDEN = Path(__file__).resolve().parent.parent / "conformance" / "goldens" / "served_smollm2.json"
needs_numba = pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def greedy_alone(model, tokens, n, banned):
    """`n` greedy tokens of `model` after `tokens`, every token through `forward` alone."""
    cache = model.new_cache(capacity=len(tokens) + n)
    for pos, t in enumerate(tokens):
        logits = model.forward(np.asarray([t]), pos, cache)[-1]
    out = []
    for _ in range(n):
        row = logits.copy()
        row[banned] = -np.inf
        out.append(int(np.argmax(row)))
        logits = model.forward(np.asarray([out[-1]]), len(tokens) + len(out) - 1, cache)[-1]
    return out


def test_flag():
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve"]).numerics == "exact"
    assert parser.parse_args(["serve", "--numerics", "llamacpp-avx2"]).numerics == "llamacpp-avx2"
    assert parser.parse_args(["serve", "--numerics", "host"]).numerics == "host"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--numerics", "fast"])


@needs_numba
def test_served_answers_are_llamacpps_decode(golden):
    model = ggufpy.load(smollm2_path(), backend="numba", numerics="llamacpp-avx2")
    banned = {str(t): -100.0 for t in golden["banned"]}
    n = len(golden["prompts"][0]["completion"])
    live = LiveServer(create_app(model, parallel=4, ctx_size=128, model_id="smollm2"))

    def complete(body):
        r = httpx.post(live.url + "/v1/completions", json={"max_tokens": n, "logit_bias": banned, **body}, timeout=600)
        r.raise_for_status()
        return r.json() if not body.get("stream") else r.text

    try:
        bodies = [{"prompt": p["tokens"], "temperature": 0} for p in golden["prompts"]]
        others = [
            {"prompt": "Once more, with feeling:", "temperature": 0, "stream": True},
            {"prompt": "A list of fruits:", "temperature": 0.8, "seed": 7},
        ]
        with ThreadPoolExecutor(len(bodies) + len(others)) as pool:
            answers = list(pool.map(complete, others + bodies))[len(others) :]
    finally:
        live.stop()
    for p, answer in zip(golden["prompts"], answers, strict=True):
        choice = answer["choices"][0]
        assert answer["usage"]["completion_tokens"] == n and choice["finish_reason"] == "length"
        assert choice["text"] == model.tokenizer.decode(p["completion"]), p["text"]


@needs_numba
def test_exact_numerics_leave_llamacpps_path(golden):
    """The golden tells the numerics apart: the default `exact` decode differs from llama.cpp's on every prompt
    within its tokens (so the test above checks llama.cpp's arithmetic, not just any greedy decode)."""
    model = ggufpy.load(smollm2_path(), backend="numba", tokenizer=False)
    n = len(golden["prompts"][0]["completion"])
    for p in golden["prompts"]:
        assert greedy_alone(model, p["tokens"], n, golden["banned"]) != p["completion"], p["text"]


@pytest.mark.slow  # ~60 s: greedy decodes of every golden prompt
def test_golden_is_llamacpps_own(golden):
    """Live (llama-cpp-python installed, an AVX2 build): recording again gives the golden."""
    pytest.importorskip("llama_cpp")
    from conformance import record_served
    from conformance.llamacpp import host_isa

    if host_isa() != golden["isa"]:
        pytest.skip(f"the installed llama.cpp is a {host_isa()} build; the golden is {golden['isa']}'s")
    again = record_served.record()
    assert [p["completion"] for p in again["prompts"]] == [p["completion"] for p in golden["prompts"]]
    assert [p["tokens"] for p in again["prompts"]] == [p["tokens"] for p in golden["prompts"]]
