"""The prefill products of issue 12's types in the llamacpp numerics: MXFP4's eight-row groups from
`GEMM_MIN_ROWS` activation rows (`int8ir_fp4_x8.mxfp4x8_gemm`: each block decoded once for all rows, lanes =
weight rows) equal the replay of llama.cpp's repacked gemm / gemv (`quants.x86.mxfp4`, through
`vecdot.linear_x86`) and the four-row kernel before it, bit for bit: random blocks, T from 4 to 128 (multiples of
4 and of 8 and not), group counts on and off the parallel chunks, every E8M0 exponent, quants at +-127, one and
two threads; row counts that are not a multiple of 8 (ggml's vec_dot, no groups) through `int8dot.linear`."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot

pytest.importorskip("numba")
from ggufpy.kernels import _numba, int8dot

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

if int8dot.AVAILABLE:
    from ggufpy.kernels import int8ir_fp4_x8 as x8
    from tests.test_kernels_int8_lowbit import activations, assert_bitwise
    from tests.test_kernels_int8ir_fp4 import random_weight


def _grouped(w) -> np.ndarray:
    return x8.interleave_mxfp4(np.asarray(w.raw).reshape(w.shape[0], -1))


def _gemm(x, w, threads: int) -> np.ndarray:
    a = int8dot.quantize(x, "Q8_0")
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)  # every element must be written
    x8._mm_mxfp4x8(threads, _grouped(w), a.q, a.d, a.asum, out)
    return out


def _four_rows(x, w) -> np.ndarray:
    """The kernel before: four activation rows per decode of a block (`mxfp4x8_dot(4)`)."""
    a = int8dot.quantize(x, "Q8_0")
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    x8._mv_mxfp4x8(1, _grouped(w), a.q, a.d, a.asum, out)
    return out


# (T, weight rows, cols): T = 4 (the threshold), 5, 8, 17, 64, 128; 1, 8, 9, 17 groups (GEMM_CHUNK = 8);
# 1 to 90 blocks per row, odd and even
SHAPES = [(4, 8, 32), (5, 64, 96), (8, 72, 1024), (17, 136, 2880), (64, 24, 288), (128, 40, 1024)]


@pytest.mark.parametrize(("n_rows", "rows", "cols"), SHAPES)
def test_mxfp4_gemm_equals_the_repacked_replay(n_rows, rows, cols):
    rng = np.random.default_rng([n_rows, rows, cols, 12])
    w = random_weight(T.MXFP4, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    x[-1] = np.float32(3.0)  # every quant 127: the largest integer sums
    x[0, : cols // 2] = np.float32(-3.0)
    want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
    assert np.isfinite(want).all()
    assert_bitwise(_gemm(x, w, 1), want)
    assert_bitwise(_gemm(x, w, 2), want)
    assert_bitwise(_four_rows(x, w), want)


@pytest.mark.parametrize("n_rows", [4, 9])
def test_mxfp4_gemm_extreme_exponents(n_rows):
    """Every E8M0 byte: subnormal scales, f32 products below 2^-126, inf and nan, as the replay gives them."""
    rng = np.random.default_rng(n_rows)
    w = random_weight(T.MXFP4, 16, 21 * 32, rng, e_range=(0, 256))
    np.asarray(w.raw).reshape(-1, 17)[:256, 0] = np.arange(256)
    x = activations(rng, n_rows, w.shape[1])
    with np.errstate(all="ignore"):
        want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
    assert_bitwise(_gemm(x, w, 1), want)


def test_mxfp4_rows_are_independent():
    """Each output row depends only on its activation row: rows 3..10 of an 11-row product equal the 8-row one."""
    rng = np.random.default_rng(5)
    w = random_weight(T.MXFP4, 32, 512, rng)
    x = activations(rng, 11, 512)
    assert_bitwise(_gemm(x, w, 2)[3:], _gemm(x[3:], w, 1))


def test_gemm_operands():
    """Block-major quants (row b * T + t = block b of row t), d transposed, 12 x each block's quant sum."""
    rng = np.random.default_rng(3)
    x = activations(rng, 6, 96)
    a = int8dot.quantize(x, "Q8_0")
    ab, adt, corr = x8.gemm_operands(a.q, a.d, a.asum)
    blocks = a.q.reshape(6, 3, 32)  # (T, block, 32)
    assert np.array_equal(ab, blocks.transpose(1, 0, 2).reshape(18, 32))
    assert np.array_equal(adt, a.d.T)
    assert np.array_equal(corr, 12 * blocks.astype(np.int32).sum(axis=2).T)


@pytest.mark.parametrize(("n_rows", "rows"), [(1, 24), (3, 24), (4, 24), (16, 13), (128, 21), (8, 7)])
def test_mxfp4_linear_dispatch(n_rows, rows):
    """`int8dot.linear` on MXFP4: eight-row groups for rows % 8 == 0 (the gemm from `GEMM_MIN_ROWS`, the
    one- / four-row kernels below), ggml's vec_dot otherwise; each the replay's values."""
    rng = np.random.default_rng([n_rows, rows])
    w = random_weight(T.MXFP4, rows, 320, rng)
    x = activations(rng, n_rows, 320)
    iw = int8dot.weight(w)
    assert (iw.raw.shape[0] == rows // 8) == (rows % 8 == 0)  # grouped only for whole groups
    assert_bitwise(int8dot.linear(x, iw, 1), vecdot.linear_x86(x, w.raw, w.type, w.shape))
