"""The grid types' tiled kernel (`ggufpy/kernels/int8grid_tiles.py`: a decoded weight row against eight
activation rows at a time, biased activations, a per-block correction) and the block-at-once decodes
(`int8grid_blocks.py`: IQ1_M, IQ2_S) equal the llamacpp numerics' replay bit for bit (`ggufpy.quants.x86.tiled`
from 8 rows, `ggufpy.quants.x86.iqgrid` below): T a multiple of 8 and not (the last group overlaps), weight rows a
multiple of the 16-row chunks and not, 1 to 11 super-blocks per row, extreme activations (every quant +-127), one
and two threads."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot
from ggufpy.quants.x86 import iqgrid, tiled

int8grid = pytest.importorskip("ggufpy.kernels.int8grid")
from ggufpy.kernels import _numba, int8dot, int8grid_tiles, int8lowbit  # noqa: E402
from tests.test_kernels_int8_lowbit import activations, assert_bitwise, random_weight  # noqa: E402

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

TYPES = list(int8grid.KERNELS)


def _raw(w) -> np.ndarray:
    return np.asarray(w.raw).view(np.uint8).reshape(w.shape[0], -1)


def _run(t, x, w, threads):
    a = int8dot.quantize(x, int8lowbit.Q8_K)
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)  # every element must be written
    int8grid.KERNELS[t](threads, _raw(w), a.q, a.d, a.bsums, out)
    return out


def _case(t, n_rows, rows, cols, extreme=True):
    rng = np.random.default_rng([int(t), n_rows, rows, cols])
    w = random_weight(t, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    if extreme:  # rows of equal values: every quant -127 or 127, the largest integer sums
        x[0] = np.float32(3.0)
        x[-1] = np.float32(-3.0)
    return w, x


# (T, weight rows, cols): T = 8 (one group), 9 (the last group starts at 1), 64, 128, 15, 17, 40; rows below,
# at and off the 16-row chunks; 1, 4, 11 super-blocks
SHAPES = [(8, 16, 256), (9, 13, 768), (15, 33, 512), (17, 5, 1024), (64, 37, 1024), (128, 20, 2816), (40, 1, 256)]


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n_rows", "rows", "cols"), SHAPES)
def test_tiles_equal_the_tiled_replay(t, n_rows, rows, cols):
    w, x = _case(t, n_rows, rows, cols)
    want = tiled.KERNELS[t](_raw(w), vecdot.quantize_activations(x, T.Q8_K))
    assert_bitwise(_run(t, x, w, 1), want)
    assert_bitwise(_run(t, x, w, 2), want)
    assert_bitwise(want, vecdot.linear_x86(x, w.raw, w.type, w.shape))  # the replay llama.cpp's dispatch picks


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_tiles_rows_are_independent(t):
    """Each output row depends only on its activation row: the first 8 rows of a 9-row product (two overlapping
    groups) equal the 8-row product, and row 8 alone in a group of 8 equals its value."""
    w, x = _case(t, 9, 24, 512)
    nine = _run(t, x, w, 2)
    assert_bitwise(nine[:8], _run(t, x[:8], w, 1))
    assert_bitwise(nine[1:], _run(t, x[1:], w, 1))


@pytest.mark.parametrize("t", [T.IQ1_M, T.IQ2_S], ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 2, 7])
@pytest.mark.parametrize("cols", [256, 2816])
def test_block_decode_equals_the_vec_dot_replay(t, n_rows, cols):
    """IQ1_M's and IQ2_S's decode of a whole block at once (indices, signs, scales in vector registers), in the
    vec_dot paths (T = 1: `grid_dot`, 2..7: `grid_dot_rows`)."""
    w, x = _case(t, n_rows, 19, cols, extreme=n_rows > 1)
    want = iqgrid.KERNELS[t](_raw(w), vecdot.quantize_activations(x, T.Q8_K))
    assert_bitwise(_run(t, x, w, 1), want)
    assert_bitwise(_run(t, x, w, 2), want)


def test_activation_tiles():
    """The biased activations are q + 128 as bytes and the scales are transposed."""
    rng = np.random.default_rng(1)
    aq = rng.integers(-127, 128, (9, 512)).astype(np.int8)
    ad = rng.standard_normal((9, 2)).astype(np.float32)
    ab, adt = int8grid_tiles.activation_tiles(aq, ad)
    assert ab.dtype == np.uint8 and np.array_equal(ab.astype(np.int16), aq.astype(np.int16) + 128)
    assert adt.flags.c_contiguous and np.array_equal(adt, ad.T)
