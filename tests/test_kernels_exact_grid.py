"""The exact numerics' grid-type kernels (`ggufpy/kernels/exact_grid.py`): IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
IQ1_S and IQ1_M blocks decoded in registers, times f32 activations. Products are the reference's
`x @ dequantize(W).T` within f32 summation, and every activation row is bit for bit the same row alone."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy import kernels
from ggufpy.constants import GGMLType
from ggufpy.numerics import NUMERICS

if not kernels.AVAILABLE:
    pytest.skip("numba kernels unavailable", allow_module_level=True)

from ggufpy.kernels import exact_grid, layout, rawblocks
from ggufpy.kernels._numba import DISABLED
from ggufpy.kernels.backend import NumbaBackend
from tests.test_kernels import assert_close, random_weight

TYPES = [GGMLType[n] for n in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")]


def _product(t: GGMLType, w, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """x times w through `rawblocks.matvec` (the exact numerics' dispatch), the padding rows cut off."""
    p = layout.pack(w, release=False)
    out = np.full((x.shape[0], p.groups * 64), np.nan, np.float32)
    rawblocks.matvec(t, p.q, x, None, out, threads)
    assert np.all(out[:, p.rows :] == 0)  # padding rows: zero blocks
    return out[:, : p.rows]


@pytest.mark.skipif(DISABLED, reason="intrinsics need the JIT: rawblocks computes the types then")
def test_every_grid_type_is_registered():
    assert set(exact_grid.KERNELS) == set(TYPES)
    assert all(rawblocks._exact_kernels()[t] is exact_grid.KERNELS[t] for t in TYPES)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_products_match_the_reference(t, T):
    """Ragged rows (not a multiple of 64) and 1 or 3 super-blocks per row, against `x @ dequantize(W).T`."""
    for blocks, seed in ((1, 10), (3, 11)):
        cols = 256 * blocks
        w = random_weight(t, 70 + 31 * blocks, cols, seed=seed + T)
        x = np.random.default_rng(seed).standard_normal((T, cols)).astype(np.float32)
        got = _product(t, w, x)
        W = w.dequantize()
        assert np.all(np.isfinite(got)) and np.all(np.isfinite(W))
        assert_close(got, x @ W.T, np.abs(x) @ np.abs(W).T)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_a_row_of_a_batch_is_the_row_alone(t):
    """Batch invariance: rows of 4-row passes, of the remainder pass (T = 11: 4 + 4 + 3) and alone give the same
    bits; so do 2 threads."""
    w = random_weight(t, 100, 512, seed=20)
    x = np.random.default_rng(21).standard_normal((11, 512)).astype(np.float32)
    batch = _product(t, w, x)
    for b in range(11):
        np.testing.assert_array_equal(_product(t, w, x[b : b + 1])[0], batch[b])
    np.testing.assert_array_equal(_product(t, w, x[:5], threads=2), batch[:5])


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_through_the_backend(t):
    """`NumbaBackend.linear` in the exact numerics (fused kernel: no BLAS tiles) and `linears_rows`, whose rows
    are bit for bit `linear` of each row alone."""
    be = NumbaBackend(NUMERICS["exact"], threads=1, blas_rows=None, release_pages=False)
    w, w2 = random_weight(t, 90, 768, seed=30), random_weight(t, 64, 768, seed=31)
    x = np.random.default_rng(32).standard_normal((3, 768)).astype(np.float32)
    y = be.linear(x, w)
    W = w.dequantize()
    assert_close(y, x @ W.T, np.abs(x) @ np.abs(W).T)
    rows = be.linears_rows(x, (w, w2))
    for b in range(3):
        np.testing.assert_array_equal(rows[0][b], be.linear(x[b : b + 1], w)[0])
        np.testing.assert_array_equal(rows[1][b], be.linear(x[b : b + 1], w2)[0])
