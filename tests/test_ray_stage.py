"""`ggufpy.distributed.stage` without Ray: a chain of `Stage`s equals the whole model bit for bit (prefill and
batched decode over layer ranges), the last stage samples as `generation` does, and a stage refuses positions
it does not hold (what a restarted stage answers, instead of computing on an empty cache)."""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from ggufpy.distributed.stage import Stage, StageStateError, decode_rows
from ggufpy.sampling import Sampler, SamplingParams

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12, 13], [14]]
NEXT = [21, 22, 23, 24]
SPLITS = [[(0, 1), (1, 3)], [(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]]


def whole_reference(model, prompts=PROMPTS, nxt=NEXT):
    """Prompt logits (every position) and the next token's logits, each sequence alone."""
    out = []
    for prompt, token in zip(prompts, nxt, strict=True):
        cache = model.new_cache(capacity=32)
        first = model.forward(np.asarray(prompt), 0, cache)
        out.append((first, model.forward(np.asarray([token]), len(prompt), cache)))
    return out


@pytest.fixture(scope="module")
def quantized(tiny_llama_path):
    """The 3-layer tiny llama: enough layers for 2- and 3-way splits."""
    return str(tiny_llama_path)


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "+".join(f"{a}-{b - 1}" for a, b in s))
def test_stages_equal_the_whole_model(quantized, split):
    whole = ggufpy.load(quantized, backend="numpy", tokenizer=False)
    want = whole_reference(whole)
    stages = [Stage(quantized, a, b) for a, b in split]
    for k, prompt in enumerate(PROMPTS):
        x = np.asarray(prompt)
        for st in stages:
            x = st.prefill(f"r{k}", x, 0, 32, last_only=False)
        assert np.array_equal(x, want[k][0])
    x, positions = np.asarray(NEXT), [len(p) for p in PROMPTS]
    rids = [f"r{k}" for k in (2, 0, 3, 1)]  # another order than the prefills: rows are independent
    order = [2, 0, 3, 1]
    x = x[order]
    for st in stages:
        x = st.decode(rids, x, [positions[k] for k in order])
    for row, k in zip(x, order, strict=True):
        assert np.array_equal(row, want[k][1][0])


def test_decode_rows_matches_decode_batch_on_the_whole_range(quantized):
    model = ggufpy.load(quantized, backend="numpy", tokenizer=False)
    caches = [model.new_cache(capacity=32) for _ in PROMPTS]
    twins = [model.new_cache(capacity=32) for _ in PROMPTS]
    for prompt, a, b in zip(PROMPTS, caches, twins, strict=True):
        model.forward(np.asarray(prompt), 0, a)
        model.forward(np.asarray(prompt), 0, b)
    positions = [len(p) for p in PROMPTS]
    want = model.decode_batch(np.asarray(NEXT), positions, caches)
    assert np.array_equal(decode_rows(model, np.asarray(NEXT), positions, twins), want)


def test_last_stage_samples_like_generation(quantized):
    whole = ggufpy.load(quantized, backend="numpy", tokenizer=False)
    params = SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.3)
    prompt = PROMPTS[2]
    logits = whole_reference(whole, [prompt], [0])[0][0][-1]
    history = list(prompt)
    want = Sampler(params)(logits, history)

    first, last = Stage(quantized, 0, 2), Stage(quantized, 2, 3)
    h = first.prefill("s", np.asarray(prompt), 0, 32)
    token = last.prefill("s", h, 0, 32, sampler=Sampler(params), history=prompt)
    assert token.tolist() == [want]
    assert last.requests["s"].history == [*prompt, want]  # the penalties see the sampled token next time


def test_a_stage_refuses_positions_it_does_not_hold(quantized):
    """A restarted stage has no caches: a continuing request is refused by position, never computed."""
    first, fresh = Stage(quantized, 0, 2), Stage(quantized, 2, 3)
    h = first.prefill("r", np.asarray([1, 2, 3]), 0, 32)
    with pytest.raises(StageStateError, match=r"continues at position 3 but stage layers 2\.\.2 .* holds no positions"):
        fresh.decode(["r"], h[-1:], [3])
    fresh.prefill("r", h, 0, 32)
    with pytest.raises(StageStateError, match="position 5 is past the 3 held"):
        fresh.decode(["r"], h[-1:], [5])
    fresh.release(["r"])
    assert fresh.info()["requests"] == 0


def test_float16_wire(quantized):
    a, b = Stage(quantized, 0, 2, hidden_dtype="float16"), Stage(quantized, 2, 3)
    h = a.prefill("r", np.asarray([1, 2, 3]), 0, 32, last_only=False)
    assert h.dtype == np.float16
    out = b.prefill("r", h, 0, 32, last_only=False)
    assert out.dtype == np.float32 and np.isfinite(out).all()
