"""`ggufpy.kernels.layer_ggml_rows.decode_rows`: one compiled call per block of a batched pass in the llamacpp
numerics, bit-identical to `Model.block_rows` (so a batched row stays bit for bit its sequence decoded alone,
which is llama.cpp's token-by-token decode: tests/test_server_llamacpp_numerics.py).

As tests/test_kernels_layer_rows.py (whose passes these are): two loads of one model, the fused rows block off in
one, prompt chunks of different lengths in one pass then decode steps of B = 3 and 8 sequences; equal logits and
f16 KV caches, and every block of the second went through the fused call. Gemma-style blocks: the synthetic
layers of tests/test_kernels_layer_ggml.py (`gemma_like`) and Gemma 3 270M.
"""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from conformance.fixtures import fixture_path
from ggufpy.kernels import int8dot, int8rows, layer_ggml, layer_ggml_rows
from ggufpy.kernels._numba import DISABLED
from tests.models import gemma3_path, smollm2_path
from tests.test_kernels_layer_ggml import counted, gemma_like
from tests.test_kernels_layer_rows import PROMPTS, assert_same, load, passes

if DISABLED or not int8dot.AVAILABLE:
    pytest.skip("the integer kernels need numba and AVX2", allow_module_level=True)


@pytest.fixture(autouse=True)
def compile_in_foreground(monkeypatch):
    """The first call compiles the block before returning, so that every block goes through the fused call (and
    the one-token block's, which `assert_rows_equal_alone` counts too)."""
    monkeypatch.setattr(layer_ggml_rows, "BACKGROUND", False)
    monkeypatch.setattr(layer_ggml, "BACKGROUND", False)


# each product form: block-decoded-once rows kernels (Q4_1, Q5_0, Q6_K, Q5_K, Q4_0's and Q4_K's groups), all
# rows in one call (Q8_0's groups), chunks of 3 rows below the kernels' switches (TQ2_0, IQ2_XXS, Q1_0),
# and a layer of mixed types (smollm2_mix); the rest under `-m slow` (each kernel compiles on a cold cache)
FIXTURES = ["q4_0", "q4_1", "q8_0", "q4_k", "smollm2_mix"]
MORE = ["q4_k_m", "q5_0", "q6_k", "q5_k", "tq2_0", "iq2_xxs", "q1_0"]


@pytest.mark.parametrize("name", FIXTURES + [pytest.param(n, marks=pytest.mark.slow) for n in MORE])
def test_fixtures_bit_identical(name):
    assert_same(fixture_path(name), numerics="llamacpp")


@pytest.mark.parametrize("mode", ["llamacpp", "llamacpp-avx2"])
def test_smollm2_bit_identical(mode):
    assert_same(smollm2_path(), numerics=mode)


def test_one_thread():
    assert_same(fixture_path("q4_k_m"), numerics="llamacpp-avx2", threads=1)


def assert_rows_equal_alone(path, mode="llamacpp-avx2"):
    """A fused batched decode step equals each sequence decoded alone by the one-token pass (`layer_ggml`), and
    both went through their fused calls."""
    rows: list[int] = []
    model = load(path, True, rows, numerics=mode)
    vocab = model.config.vocab_size
    caches = [model.new_cache(capacity=24) for _ in PROMPTS]
    alone = [model.new_cache(capacity=24) for _ in PROMPTS]
    for prompt, a, b in zip(PROMPTS, caches, alone, strict=True):
        model.forward(np.asarray(prompt) % vocab, 0, a)
        model.forward(np.asarray(prompt) % vocab, 0, b)
    tokens = (np.arange(len(PROMPTS)) + 30) % vocab
    logits = model.decode_batch(tokens, [c.length for c in caches], caches)
    assert rows == list(range(model.config.n_layers))
    one: list[int] = []
    counted(model, one)
    for b, cache in enumerate(alone):
        expected = model.forward(tokens[b : b + 1], cache.length, cache)
        assert np.array_equal(logits[b], expected[0]), f"row {b}"
    assert one == list(range(model.config.n_layers)) * len(PROMPTS)


def test_smollm2_rows_equal_alone():
    assert_rows_equal_alone(smollm2_path())


# -- Gemma-style blocks (Q/K norms, Q scaling, GELU, post-norms, windows) ------------------------------------------


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layer_ggml_rows_gemma")


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "gemma", "qwen3"])
def test_gemma_steps_bit_identical(gemma_dir, arch):
    """`gemma_like`'s layers (windows of 4 shorter than the prompts) through the fused rows block."""
    assert_same(gemma_like(gemma_dir, arch), numerics="llamacpp-avx2")


def test_gemma3_steps_avx512_replay(gemma_dir):
    assert_same(gemma_like(gemma_dir, "gemma3"), numerics="llamacpp")


def test_gemma3_rows_equal_alone_synthetic(gemma_dir):
    assert_rows_equal_alone(gemma_like(gemma_dir, "gemma3"))


@pytest.mark.parametrize("threads", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_gemma3_bit_identical(threads):
    """Gemma 3 270M: every block of every pass through the fused rows block, bit for bit `block_rows`."""
    assert_same(gemma3_path(), numerics="llamacpp-avx2", threads=threads)


def test_gemma3_rows_equal_alone():
    assert_rows_equal_alone(gemma3_path())


def test_gemma2_attention_softcap_falls_back(gemma_dir):
    """gemma2's attention softcap: `Model.block_rows` (the compiled x86 attention has no softcap)."""
    calls: list[int] = []
    model = load(gemma_like(gemma_dir, "gemma2", attn_softcap=5.0), True, calls, numerics="llamacpp-avx2")
    caches = [model.new_cache(capacity=8) for _ in range(2)]
    model.prefill_batch([np.asarray([1, 2]), np.asarray([3])], [0, 0], caches)
    assert calls == []


def test_nope_layer_not_fused(tmp_path):
    """smollm3's NoPE layer (the 4th) goes through `Model.block_rows`, as `Model.forward` sends it to `Model.block`
    (`ModelConfig.fused_block`): the fused block would rotate its Q and K. The other layers are fused, and the
    passes equal the unfused ones."""
    from dataclasses import replace

    from conformance.fixtures import ARCH_FIXTURES, ROLES, write_tiny_llama
    from ggufpy.constants import GGMLType

    spec = replace(ARCH_FIXTURES["smollm3"], types=dict.fromkeys([*ROLES, "embd", "output"], GGMLType.Q8_0))
    path = write_tiny_llama(tmp_path / "smollm3.gguf", spec)
    calls: list[int] = []
    ref, fast = load(path, False, numerics="llamacpp-avx2"), load(path, True, calls, numerics="llamacpp-avx2")
    assert [ref.config.uses_rope(i) for i in range(4)] == [True, True, True, False]
    (la, _), (lb, _) = passes(ref, sizes=(3,), steps=1), passes(fast, sizes=(3,), steps=1)
    assert calls == [0, 1, 2] * 2
    for a, b in zip(la, lb, strict=True):
        assert np.array_equal(a, b)


def test_chunks_where_the_kernel_switches():
    """TQ2_0's kernel takes its rows three at a time in the block (no rows form), Q8_0's groups all at once,
    Q4_1, Q6_K, Q5_K and Q4_0's and Q4_K's groups their block-decoded-once kernels: the per-product plan the
    block reads."""
    chunks = {"tq2_0": int8rows.ONE_ROW_BELOW - 1, "q8_0": 0, "q4_1": 0, "q6_k": 0, "q5_k": 0, "q4_0": 0, "q4_k": 0}
    for name, chunk in chunks.items():
        model = ggufpy.load(fixture_path(name), backend="numba", numerics="llamacpp", tokenizer=False)
        layer = layer_ggml_rows.fused_rows(model.backend, model.config, model.weights.layers[0], 0)
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
    assert layer_ggml_rows.fused_rows(fp4.backend, fp4.config, fp4.weights.layers[0], 0) is None
