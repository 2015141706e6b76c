"""`Model.decode_batch`: one decode step for B sequences at different positions, each row bit-identical to
the same sequence decoded alone (batch invariance), on both backends.

Each sequence is prefilled alone into its own cache; the reference is the next token decoded alone
(`forward` of one token, the path generation takes); the batch decodes copies of the same caches in a
shuffled order, with sequences of other lengths beside them.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import ggufpy
from ggufpy.constants import GGMLType
from ggufpy.kernels import AVAILABLE, JIT_DISABLED
from tests.models import gemma3_path, smollm2_path

PROMPTS = [[1, 2, 3], [7], [100, 200, 300, 400, 500, 600, 700], [42, 43], [9, 8, 7, 6, 5], [11] * 11, [5, 4], [600]]
NEXT = [17, 19, 23, 29, 31, 37, 41, 43]  # the token each sequence decodes next
needs_numba = pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")


@pytest.fixture(scope="module", params=["numba", "numpy"])
def smollm2(request):
    if request.param == "numba" and (not AVAILABLE or JIT_DISABLED):
        pytest.skip("the numba kernels are not compiled here")
    return ggufpy.load(smollm2_path(), backend=request.param, tokenizer=False)


def prefilled(model, prompts=PROMPTS) -> list:
    caches = []
    for prompt in prompts:
        cache = model.new_cache(capacity=32)
        model.forward(np.asarray(prompt) % model.config.vocab_size, 0, cache, last_only=True)
        caches.append(cache)
    return caches


def alone(model, caches, tokens) -> tuple[list[np.ndarray], list]:
    """Logits (V,) of each sequence's next token decoded on its own, and the caches after it."""
    after = [copy.deepcopy(c) for c in caches]
    return [model.forward(np.asarray([t]), c.length, c)[0] for t, c in zip(tokens, after, strict=True)], after


def assert_batch_invariant(model, sizes, seed=0, steps=2):
    caches = prefilled(model)
    rng = np.random.default_rng(seed)
    for B in sizes:
        order = rng.permutation(len(PROMPTS))[:B]  # which sequences, in which rows
        batch = [copy.deepcopy(caches[j]) for j in order]
        ref_caches = [caches[j] for j in order]
        tokens = [NEXT[j] % model.config.vocab_size for j in order]
        for step in range(steps):
            expected, ref_caches = alone(model, ref_caches, tokens)
            positions = [c.length for c in batch]
            logits = model.decode_batch(np.asarray(tokens), positions, batch)
            assert logits.shape == (B, model.config.vocab_size)
            for row, j in enumerate(order):
                assert np.array_equal(logits[row], expected[row]), f"B={B} step {step}: row {row} (sequence {j})"
            for c, r in zip(batch, ref_caches, strict=True):
                assert c.length == r.length
                assert all(np.array_equal(c.k[i][: c.length], r.k[i][: r.length]) for i in c.layers)
            tokens = [int(np.argmax(e)) for e in expected]


def test_smollm2_batch_invariant(smollm2):
    if smollm2.backend.name == "numba":
        assert_batch_invariant(smollm2, sizes=range(1, 9))
    else:  # the NumPy backend decodes a batch row by row: fewer rows keep this test short
        assert_batch_invariant(smollm2, sizes=(1, 5), steps=1)


@needs_numba
def test_gemma3_batch_invariant():
    """Gemma 3: Q/K norms, post-norms, sliding-window layers, GELU, a scaled Q (the unfused block path)."""
    model = ggufpy.load(gemma3_path(), backend="numba", tokenizer=False)
    assert_batch_invariant(model, sizes=(1, 2, 3, 4, 7, 8), steps=1)


@needs_numba
def test_tiny_llama_batch_invariant(tiny_llama_path):
    model = ggufpy.load(tiny_llama_path, backend="numba", tokenizer=False)
    assert_batch_invariant(model, sizes=(1, 2, 7), steps=3)


@needs_numba
def test_stacked_rows_are_not_invariant(smollm2):
    """Why `decode_batch` needs its own kernels: the backend's products over several rows (pairs of rows,
    the last row of an odd count alone) round some rows differently from the same row alone."""
    if smollm2.backend.name != "numba":
        pytest.skip("the numba kernels' multi-row path")
    w = smollm2.weights.layers[0].attn_q
    x = np.random.default_rng(1).standard_normal((4, w.shape[1])).astype(np.float32)
    together = smollm2.backend.linear(x, w)
    single = np.concatenate([smollm2.backend.linear(x[b : b + 1], w) for b in range(4)])
    assert not np.array_equal(together, single)
    (rows,) = smollm2.backend.linears_rows(x, (w,))
    assert np.array_equal(rows, single)


def test_errors(smollm2):
    caches = prefilled(smollm2, PROMPTS[:2])
    with pytest.raises(ValueError, match="B token ids"):
        smollm2.decode_batch(np.asarray([1, 2]), [3], caches)
    with pytest.raises(ValueError, match="appears twice"):
        smollm2.decode_batch(np.asarray([1, 2]), [3, 3], [caches[0], caches[0]])
    with pytest.raises(ValueError, match=r"position 5 is not in 0\.\.3"):
        smollm2.decode_batch(np.asarray([1, 2]), [5, 1], caches)
    assert [c.length for c in caches] == [3, 1]  # nothing was written


# the weight types of the two test models: SmolLM2 (Q4_1, its head Q8_0), Gemma 3 (Q4_K, Q5_0, Q6_K, Q8_0)
MODEL_TYPES = [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q6_K]


@needs_numba
@pytest.mark.parametrize("t", MODEL_TYPES, ids=lambda t: t.name)
def test_rows_kernel_equals_the_single_row_kernel(t):
    """`matvec_rows` (the products of `decode_batch`): each of B = 1..8 rows bit for bit `matvec` of that row
    alone, whatever its neighbours and its place in the row tiles (pairs, then an odd last row); 130 weight
    rows leave a partial last group, a row of zeros and a sub-block of zeros give sums of exactly 0."""
    from ggufpy.kernels.batched import matvec_rows
    from ggufpy.kernels.layout import pack
    from ggufpy.kernels.matvec import matvec, plan
    from tests.test_kernels import random_weight

    p = pack(random_weight(t, 130, 512, seed=3))
    planned = plan(p)
    x = np.random.default_rng(4).standard_normal((8, 512)).astype(np.float32)
    x[2] = 0.0
    x[5, 256:288] = 0.0
    alone = np.concatenate([matvec(p, x[b : b + 1], None, planned=planned) for b in range(8)])
    for B in range(1, 9):
        rows = matvec_rows(p, x[8 - B :], None, planned)  # row b of x in every position from 0 to 7
        assert rows.shape == (B, p.groups * 64)
        assert np.array_equal(rows, alone[8 - B :]), f"{t.name}, B={B}"


@needs_numba
def test_rows_kernel_with_activation_terms_is_the_single_row_kernel():
    """Quantized activations (llamacpp numerics' terms) take the single-row kernel row by row."""
    from ggufpy.kernels import activations as act
    from ggufpy.kernels.batched import matvec_rows
    from ggufpy.kernels.layout import pack
    from ggufpy.kernels.matvec import matvec
    from tests.test_kernels import random_weight

    p = pack(random_weight(GGMLType.Q4_0, 64, 256, seed=5))
    x = np.random.default_rng(6).standard_normal((3, 256)).astype(np.float32)
    xv, terms = act.prepare(x, act.Q8_0, p.sub)
    alone = [matvec(p, *act.prepare(x[b : b + 1], act.Q8_0, p.sub)) for b in range(3)]
    assert np.array_equal(matvec_rows(p, xv, terms), np.concatenate(alone))


@needs_numba
def test_row_invariant_activations_equal_row_by_row():
    """What lets `Model.feed_forward` call the backend's activations once on a whole (B, F) batch: each row
    bit for bit the call on that row alone, with rows of lengths that leave scalar tails after the SIMD body."""
    from ggufpy.kernels.backend import NumbaBackend

    rng = np.random.default_rng(7)
    assert NumbaBackend.row_invariant
    for act in NumbaBackend.row_invariant:
        for F in (1, 7, 33, 64, 1536):
            x = (rng.standard_normal((8, F)) * rng.choice([0.01, 1, 10, 100], (8, F))).astype(np.float32)
            alone = np.concatenate([act(x[b : b + 1]) for b in range(8)])
            assert np.array_equal(act(x).view(np.uint32), alone.view(np.uint32)), f"{act}, F={F}"


@needs_numba
@pytest.mark.slow  # ~4 min on 2 cores; test_kernels_layer_ggml_rows checks rows against each row alone by default
@pytest.mark.parametrize("ffn_down", [GGMLType.Q6_K, GGMLType.Q2_K], ids=["integer", "mixed"])
def test_llamacpp_numerics_batch_invariant(tmp_path, ffn_down):
    """The llamacpp numerics: integer kernels run each row as its one-row kernel (`int8rows.product_rows`: ggml's
    gemm forms start at 4 rows, the tiled ones at 8, and both round differently from the one-row kernel), so every
    row of a batch is still its decode alone; a weight without an integer kernel (Q2_K) sends its layer's
    products row by row."""
    from conformance.fixtures import TinyLlama, write_tiny_llama
    from ggufpy.kernels import int8rows

    assert int8rows.ONE_ROW_BELOW == 4
    types = {"embd": GGMLType.Q8_0, "output": GGMLType.Q6_K, "attn": GGMLType.Q4_K, "ffn": GGMLType.Q4_0}
    spec = TinyLlama(
        dim=256, hidden_dim=512, n_layers=2, types={**types, "attn_v": GGMLType.Q8_0, "ffn_down": ffn_down}
    )
    path = write_tiny_llama(tmp_path / "mix.gguf", spec)
    model = ggufpy.load(path, backend="numba", numerics="llamacpp-avx2", tokenizer=False)
    assert_batch_invariant(model, sizes=(1, 3, 4, 8), steps=2)
