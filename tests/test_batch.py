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
        assert_batch_invariant(smollm2, sizes=(1, 2, 3, 5, 8))
    else:  # the NumPy backend decodes a batch row by row: fewer rows keep this test short
        assert_batch_invariant(smollm2, sizes=(1, 5), steps=1)


@needs_numba
def test_gemma3_batch_invariant():
    """Gemma 3: Q/K norms, post-norms, sliding-window layers, GELU, a scaled Q (the unfused block path)."""
    model = ggufpy.load(gemma3_path(), backend="numba", tokenizer=False)
    assert_batch_invariant(model, sizes=(1, 4, 8), steps=1)


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
