"""The exact numerics' register-decoding kernels for TQ1_0, TQ2_0, MXFP4, NVFP4 and Q1_0 (`exact_lowbit.py`):
the reference's products within f32 summation order, and each activation row bit for bit the row alone."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy import kernels
from ggufpy.constants import GGMLType
from ggufpy.numerics import NUMERICS
from ggufpy.weights import QuantTensor

if not kernels.AVAILABLE:
    pytest.skip("numba kernels unavailable", allow_module_level=True)

from ggufpy.kernels import exact_lowbit, layout, rawblocks
from ggufpy.kernels.backend import NumbaBackend
from tests.test_kernels import assert_close, random_weight, row_length

if not exact_lowbit.KERNELS:
    pytest.skip("no AVX2: these types stay on rawblocks._matvec", allow_module_level=True)

TYPES = [GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.MXFP4, GGMLType.NVFP4, GGMLType.Q1_0]


def _product(t, w, x):
    """x (T, cols) times w through the registered kernel, as `rawblocks.matvec` calls it: (T, rows)."""
    p = layout.pack(w, release=False)
    out = np.full((x.shape[0], p.groups * layout.GROUP), np.nan, np.float32)
    exact_lowbit.KERNELS[t](p.q, x, out, 2)
    return out[:, : w.shape[0]]


def test_every_type_is_registered():
    assert set(exact_lowbit.KERNELS) == set(TYPES)
    assert set(TYPES) <= set(rawblocks.BLOCK_TYPES)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("rows", "blocks"), [(64, 1), (70, 3), (130, 8), (200, 11)])
def test_products_match_the_reference_and_rows_are_batch_invariant(t, rows, blocks):
    """T = 1, 3, 8 against x @ dequantize(W).T; ragged row counts (the last group padded) and several block
    counts per row; every row of a T-row call bit-identical to the same row alone."""
    cols = row_length(t, blocks)
    w = random_weight(t, rows, cols, seed=rows + blocks)
    W = w.dequantize()
    assert np.isfinite(W).all()
    x = np.random.default_rng(blocks).standard_normal((8, cols)).astype(np.float32)
    alone = np.concatenate([_product(t, w, x[i : i + 1]) for i in range(8)])
    assert_close(alone, x @ W.T, np.abs(x) @ np.abs(W).T)
    for T in (2, 3, 4, 8):  # tiles of 3 activation rows, then 2 or 1
        np.testing.assert_array_equal(_product(t, w, x[:T]), alone[:T])
        np.testing.assert_array_equal(_product(t, w, x[8 - T :]), alone[8 - T :])


@pytest.mark.parametrize("t", [GGMLType.MXFP4, GGMLType.NVFP4], ids=lambda t: t.name)
def test_fp4_extreme_scales(t):
    """Scales far from 1 (`exact_fp4_ir` sums kvalue 2^24 and scales each sum by d 2^-24): MXFP4 exponents
    2^-125..2^-98 and 2^72..2^112 mixed within rows, NVFP4 every scale byte (0x7F: 0; bit 7 ignored)."""
    rows, cols = 70, row_length(t, 9)
    blocks = random_weight(t, rows, cols, seed=12).raw.reshape(rows * cols // (32 if t == GGMLType.MXFP4 else 64), -1)
    rng = np.random.default_rng(13)
    if t == GGMLType.MXFP4:  # (e = 0, 1, 2: d 2^-24 underflows; the reference's weights are subnormal there)
        blocks[:, 0] = rng.choice(np.r_[3:30, 200:240], len(blocks))
    else:
        blocks[:, 0:4] = rng.integers(0, 256, (len(blocks), 4))
    w = QuantTensor("w", t, (rows, cols), blocks.reshape(-1))
    W = w.dequantize()
    assert np.isfinite(W).all()
    x = np.random.default_rng(14).standard_normal((5, cols)).astype(np.float32)
    alone = np.concatenate([_product(t, w, x[i : i + 1]) for i in range(5)])
    assert np.isfinite(alone).all()
    assert_close(alone, x @ W.T, np.abs(x) @ np.abs(W).T)
    np.testing.assert_array_equal(_product(t, w, x), alone)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_rawblocks_dispatches_to_the_kernel(t):
    w = random_weight(t, 64, row_length(t, 4), seed=7)
    p = layout.pack(w, release=False)
    x = np.random.default_rng(8).standard_normal((5, w.shape[1])).astype(np.float32)
    out = np.empty((5, 64), np.float32)
    rawblocks.matvec(t, p.q, x, None, out, 1)
    np.testing.assert_array_equal(out, _product(t, w, x))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_backend_linear_and_linears_rows(t):
    """Through `NumbaBackend` in the exact numerics: `linear` is the kernel's product, and each row of a batched
    decode (`linears_rows`, two weights sharing the input) is bit for bit that row's `linear`."""
    cols = row_length(t, 4)
    w1, w2 = random_weight(t, 100, cols, seed=9), random_weight(t, 36, cols, seed=10)
    x = np.random.default_rng(11).standard_normal((6, cols)).astype(np.float32)
    be = NumbaBackend(NUMERICS["exact"], threads=2, release_pages=False, adaptive=False)
    y = be.linear(x, w1)
    np.testing.assert_array_equal(y, _product(t, w1, x))
    W = w1.dequantize()
    assert_close(y, x @ W.T, np.abs(x) @ np.abs(W).T)
    ys = be.linears_rows(x, (w1, w2))
    for r in range(6):
        np.testing.assert_array_equal(ys[0][r], be.linear(x[r : r + 1], w1)[0])
        np.testing.assert_array_equal(ys[1][r], be.linear(x[r : r + 1], w2)[0])


def test_strided_activation_order():
    """TQ2_0's chunks hold elements 4i + s of each 32: `strided` puts element 4i + s at 8s + i."""
    x = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
    xp = exact_lowbit.strided(x)
    g, s, i = np.meshgrid(np.arange(2), np.arange(4), np.arange(8), indexing="ij")
    np.testing.assert_array_equal(xp[:, (32 * g + 8 * s + i).ravel()], x[:, (32 * g + 4 * i + s).ravel()])
