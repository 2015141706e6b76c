"""The grid types' prefill kernel with lanes = weight rows (`ggufpy/kernels/int8grid_gemm.py`, run by
`int8grid_tiles.grid_tiles` for matrices of 8 rows or more) equals the tiled kernel's replay bit for bit
(`ggufpy.quants.x86.tiled`): random blocks, T = 8..130 activation rows (the last tile of four overlaps), weight
rows below, at and off the groups of eight and the 16-row chunks (the last group overlaps), 1 to 11 super-blocks,
one to three threads; and the bounds that make the 16-bit sums of `CHAIN` products exact."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot
from ggufpy.quants.grids import IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID
from ggufpy.quants.x86 import tiled

int8grid = pytest.importorskip("ggufpy.kernels.int8grid")
from ggufpy.kernels import _numba, int8dot, int8grid_gemm, int8grid_tiles, int8lowbit  # noqa: E402
from tests.test_kernels_int8_lowbit import activations, assert_bitwise, random_weight  # noqa: E402

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

TYPES = list(int8grid.KERNELS)
THREADS = min(3, numba.config.NUMBA_NUM_THREADS)  # the pool's size bounds a kernel's thread count


def _raw(w) -> np.ndarray:
    return np.asarray(w.raw).view(np.uint8).reshape(w.shape[0], -1)


def _run(t, x, w, threads):
    a = int8dot.quantize(x, int8lowbit.Q8_K)
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)  # every element must be written
    int8grid.KERNELS[t](threads, _raw(w), a.q, a.d, a.bsums, out)
    return out


# (T, weight rows, cols): rows 8 (one group), 9 and 23 (the last group overlaps the one before), 16, 40 and 64
# (whole groups and chunks), 7 (under a group: the row-at-a-time tiles); T from 8 to 130, with T % 4 = 0..3
SHAPES = [(8, 8, 256), (9, 9, 512), (10, 23, 768), (11, 16, 256), (33, 40, 1024), (64, 7, 512), (130, 64, 2816)]


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n_rows", "rows", "cols"), SHAPES)
def test_groups_equal_the_tiled_replay(t, n_rows, rows, cols):
    rng = np.random.default_rng([int(t), n_rows, rows, cols])
    w = random_weight(t, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    x[-1] = np.float32(-3.0)  # every quant -127: the largest integer sums
    want = tiled.KERNELS[t](_raw(w), vecdot.quantize_activations(x, T.Q8_K))
    for threads in sorted({1, min(2, THREADS), THREADS}):
        assert_bitwise(_run(t, x, w, threads), want)


@pytest.mark.parametrize("t", [T.IQ3_XXS, T.IQ3_S, T.IQ1_M, T.IQ2_XS], ids=lambda t: t.name)
def test_every_activation_quant_at_its_extremes(t):
    """Activation rows of +-127 and 0 quants (biased bytes 255, 1, 128) against random blocks: the 16-bit sums of
    `CHAIN` products and the halved IQ3_XXS values stay exact."""
    rng = np.random.default_rng(int(t))
    w = random_weight(t, 24, 512, rng)
    x = np.where(rng.random((12, 512)) < 0.5, 3.0, -3.0).astype(np.float32)
    x[:, :5] = 1e-30  # quantized to 0 next to +-127 in the same blocks
    x[3] = 3.0
    want = tiled.KERNELS[t](_raw(w), vecdot.quantize_activations(x, T.Q8_K))
    assert_bitwise(_run(t, x, w, 2), want)


_VALUES = {  # type -> the largest |signed weight value| the tiles multiply (IQ1: 8 grid + delta)
    "IQ2_XXS": np.abs(IQ2XXS_GRID).max(),
    "IQ2_XS": np.abs(IQ2XS_GRID).max(),
    "IQ2_S": np.abs(IQ2S_GRID).max(),
    "IQ3_XXS": np.abs(IQ3XXS_GRID).max() // 2,  # halved: all grid values are even
    "IQ3_S": np.abs(IQ3S_GRID).max(),
    "IQ1_S": 8 * np.abs(IQ1S_GRID).max() + 1,
    "IQ1_M": 8 * np.abs(IQ1S_GRID).max() + 1,
}


def test_sixteen_bit_sums_cannot_overflow():
    """CHAIN products of (q + 128 <= 255) x |v| pairs summed in 16 bits stay below 2^15; halving is exact."""
    assert not (np.asarray(IQ3XXS_GRID) % 2).any()
    for name, chain in int8grid_gemm.CHAIN.items():
        assert chain * 2 * 255 * int(_VALUES[name]) < 2**15, name
        assert 8 % chain == 0 and (name not in int8grid_gemm.SCALES16 or chain <= 4), name


def test_scratch_holds_a_group():
    assert int8grid_tiles.SCRATCH_PER_BLOCK >= int8grid_gemm.SCRATCH_PER_BLOCK
    assert int8grid_gemm.ROWS == 8 and int8grid_gemm.TILE <= 8  # T >= 8 holds a whole tile
