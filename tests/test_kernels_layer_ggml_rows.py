"""`ggufpy.kernels.layer_ggml_rows.decode_rows`: one compiled call per block of a batched pass in the llamacpp
numerics, bit-identical to `Model.block_rows` (so a batched row stays bit for bit its sequence decoded alone,
which is llama.cpp's token-by-token decode: tests/test_server_llamacpp_numerics.py).

As tests/test_kernels_layer_rows.py (whose passes these are): two loads of one model, the fused rows block off in
one, prompt chunks of different lengths in one pass then decode steps of B = 3 and 8 sequences; equal logits and
f16 KV caches, and every block of the second went through the fused call.
"""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from conformance.fixtures import fixture_path
from ggufpy.kernels import int8dot, int8rows, layer_ggml_rows
from ggufpy.kernels._numba import DISABLED
from tests.models import smollm2_path
from tests.test_kernels_layer_rows import PROMPTS, assert_same, load

if DISABLED or not int8dot.AVAILABLE:
    pytest.skip("the integer kernels need numba and AVX2", allow_module_level=True)


@pytest.fixture(autouse=True)
def compile_in_foreground(monkeypatch):
    """The first call compiles the block before returning, so that every block goes through the fused call."""
    monkeypatch.setattr(layer_ggml_rows, "BACKGROUND", False)


# each product form: block-decoded-once rows kernels (Q4_1, Q5_0, Q6_K, Q5_K, Q4_0's and Q4_K's groups), all
# rows in one call (Q8_0's groups), chunks of 3 rows below the kernels' switches (TQ2_0, IQ2_XXS, Q1_0),
# and a layer of mixed types (smollm2_mix); the rest under `-m slow` (each kernel compiles on a cold cache)
FIXTURES = ["q4_0", "q4_1", "q8_0", "q4_k", "q4_k_m", "smollm2_mix"]
MORE = ["q5_0", "q6_k", "q5_k", "tq2_0", "iq2_xxs", "q1_0"]


@pytest.mark.parametrize("name", FIXTURES + [pytest.param(n, marks=pytest.mark.slow) for n in MORE])
def test_fixtures_bit_identical(name):
    assert_same(fixture_path(name), numerics="llamacpp")


@pytest.mark.parametrize("mode", ["llamacpp", "llamacpp-avx2"])
def test_smollm2_bit_identical(mode):
    assert_same(smollm2_path(), numerics=mode)


def test_one_thread():
    assert_same(fixture_path("q4_k_m"), numerics="llamacpp-avx2", threads=1)


def test_smollm2_rows_equal_alone():
    """A fused batched decode step equals each sequence decoded alone by the one-token pass (`layer_ggml`)."""
    model = load(smollm2_path(), True, numerics="llamacpp-avx2")
    caches = [model.new_cache(capacity=24) for _ in PROMPTS]
    alone = [model.new_cache(capacity=24) for _ in PROMPTS]
    for prompt, a, b in zip(PROMPTS, caches, alone, strict=True):
        model.forward(np.asarray(prompt), 0, a)
        model.forward(np.asarray(prompt), 0, b)
    tokens = np.arange(len(PROMPTS)) + 30
    logits = model.decode_batch(tokens, [c.length for c in caches], caches)
    for b, cache in enumerate(alone):
        expected = model.forward(tokens[b : b + 1], cache.length, cache)
        assert np.array_equal(logits[b], expected[0]), f"row {b}"


def test_chunks_where_the_kernel_switches():
    """TQ2_0's kernel takes its rows three at a time in the block (no rows form), Q8_0's groups all at once,
    Q4_1, Q6_K, Q5_K and Q4_0's and Q4_K's groups their block-decoded-once kernels: the per-product plan the
    block reads."""
    chunks = {"tq2_0": int8rows.ONE_ROW_BELOW - 1, "q8_0": 0, "q4_1": 0, "q6_k": 0, "q5_k": 0, "q4_0": 0, "q4_k": 0}
    for name, chunk in chunks.items():
        model = ggufpy.load(fixture_path(name), backend="numba", numerics="llamacpp", tokenizer=False)
        layer = layer_ggml_rows.fused_rows(model.backend, model.config, model.weights.layers[0])
        assert layer is not None and list(layer.kinds[:, 2]) == [chunk] * 7, name


def test_falls_back():
    """Outside the scope nothing is computed or written: the exact numerics (`layer_rows` then), the FP4
    wrappers, a Q8_0 KV cache."""
    path = fixture_path("q4_k")  # heads of 64: a Q8_0 cache takes them

    def fused(model, caches):
        cos, sin = model._angles({}, 0, [np.arange(0, 1)] * len(caches))
        h = np.ones((2, model.config.dim), np.float32)
        w = model.weights.layers[0]
        return layer_ggml_rows.decode_rows(model.backend, model.config, w, 0, h, [0, 0], cos, sin, caches)

    ggml = ggufpy.load(path, backend="numba", numerics="llamacpp", tokenizer=False)
    assert fused(ggml, [ggml.new_cache(capacity=4) for _ in range(2)]) is not None
    q8 = [ggml.new_cache(capacity=4, kv_type="q8_0") for _ in range(2)]
    assert fused(ggml, q8) is None and not any(c.k[0].any() for c in q8)
    exact = ggufpy.load(path, backend="numba", tokenizer=False)
    caches = [exact.new_cache(capacity=4) for _ in range(2)]
    assert fused(exact, caches) is None and not any(c.k[0].any() for c in caches)
    fp4 = ggufpy.load(fixture_path("mxfp4"), backend="numba", numerics="llamacpp", tokenizer=False)
    assert layer_ggml_rows.fused_rows(fp4.backend, fp4.config, fp4.weights.layers[0]) is None
