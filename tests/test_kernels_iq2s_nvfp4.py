"""The decode kernels of IQ2_S (`ggufpy/kernels/int8grid_iq2s.py`) and NVFP4 (`int8ir_nvfp4.py`, the rows after
the groups of four in `int8ir_fp4`) equal the NumPy replays of ggml's x86 vec_dot bit for bit: random blocks, one
activation row at a time (the decode case) and T = 2, 3, 5, 6 for NVFP4's remainder rows, row counts that are
not multiples of 8, block counts across IQ2_S's 16-block chunks and odd NVFP4 block counts, every UE4M3 scale
byte. Both x86 builds (`llamacpp`, `llamacpp-avx2`) run the same vec_dot for these types at these T; both are
checked."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot

pytest.importorskip("numba")
from ggufpy.kernels import _numba, int8dot

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

if int8dot.AVAILABLE:
    from ggufpy.kernels import int8grid, int8ir_fp4, int8ir_nvfp4
    from tests.test_kernels_int8_lowbit import random_weight
    from tests.test_kernels_int8ir_fp4 import assert_bitwise

ISAS = ("avx512", "avx2")


def _rows(rng: np.random.Generator, n: int, cols: int) -> list[np.ndarray]:
    """Single activation rows: assorted magnitudes, a zero row (d = 0), one of equal values (every quant +-127:
    the largest integer sums), one with outliers."""
    rows = [rng.standard_normal(cols) * s for s in rng.choice([1e-3, 0.1, 1.0, 8.0], size=n)]
    rows[min(1, n - 1)] = np.zeros(cols)
    if n > 2:
        rows[2] = np.full(cols, rng.choice([-3.0, 3.0]))
    if n > 3:
        rows[3][:: max(1, cols // 7)] *= 300.0
    return [r.astype(np.float32)[None, :] for r in rows]


def _product(kernel, x, w, fmt):
    a = int8dot.quantize(x, fmt)
    raw = np.asarray(w.raw).view(np.uint8).reshape(w.shape[0], -1)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    if fmt == "Q8_K":
        kernel(1, raw, a.q, a.d, a.bsums, out)
    else:
        kernel(1, raw, a.q, a.d, a.s, a.asum, out)
    return out


# (rows, cols): 1, 4, 11 (the bench model's 2816), 16, 17, 33 super-blocks; rows not multiples of 8 among them
IQ2_S_SHAPES = [(40, 256), (13, 1024), (7, 2816), (9, 4096), (24, 4352), (3, 8448)]


@pytest.mark.parametrize(("rows", "cols"), IQ2_S_SHAPES)
def test_iq2_s_decode_equals_the_replay(rows, cols):
    rng = np.random.default_rng([rows, cols])
    w = random_weight(T.IQ2_S, rows, cols, rng)
    for x in _rows(rng, 4, cols):
        got = _product(int8grid.KERNELS[T.IQ2_S], x, w, "Q8_K")
        for isa in ISAS:
            assert_bitwise(got, vecdot.linear_x86(x, w.raw, w.type, w.shape, isa=isa))


def test_iq2_s_decode_equals_the_previous_kernel():
    """The same values as `int8ir_iqgrid.grid_dot("IQ2_S")` (what T = 1 ran before), which T = 2..7 still use:
    a two-row product gives each row's decode value."""
    rng = np.random.default_rng(7)
    w = random_weight(T.IQ2_S, 21, 2816, rng)
    x = np.concatenate(_rows(rng, 2, 2816))
    two = _product(int8grid.KERNELS[T.IQ2_S], x, w, "Q8_K")  # `grid_dot_rows`: the previous per-row steps
    for t in range(2):
        assert_bitwise(_product(int8grid.KERNELS[T.IQ2_S], x[t : t + 1], w, "Q8_K"), two[t : t + 1])


# (T, rows, cols): NVFP4 blocks per row 1 (odd), 3, 16, 44 (2816), 45; T = 1 (decode), 2, 3, 5, 6 (remainders)
NVFP4_SHAPES = [(1, 40, 64), (1, 13, 192), (1, 24, 1024), (1, 7, 2816), (1, 9, 2880), (2, 11, 320)]
NVFP4_SHAPES += [(3, 8, 192), (5, 17, 1024), (6, 5, 2880)]


@pytest.mark.parametrize(("n_rows", "rows", "cols"), NVFP4_SHAPES)
def test_nvfp4_equals_the_replay(n_rows, rows, cols):
    rng = np.random.default_rng([n_rows, rows, cols])
    w = random_weight(T.NVFP4, rows, cols, rng)
    xs = _rows(rng, 4, cols) if n_rows == 1 else [np.concatenate(_rows(rng, n_rows, cols))]
    for x in xs:
        got = _product(int8ir_fp4.nvfp4_kernel, x, w, "Q8_0")
        for isa in ISAS:
            assert_bitwise(got, vecdot.linear_x86(x, w.raw, w.type, w.shape, isa=isa))


@pytest.mark.parametrize("rows", [16, 13])
def test_nvfp4_every_scale_byte(rows):
    """All 256 UE4M3 bytes (exponent 0: the man 2^-10 branch; 0x7F: 0; 0xFF and 0x80: bit 7 ignored) as
    sub-block scales, with ordinary activations and tiny ones (fp16-subnormal Q8_0 d)."""
    rng = np.random.default_rng(rows)
    w = random_weight(T.NVFP4, rows, 20 * 64, rng)
    blocks = np.asarray(w.raw).reshape(-1, 36)
    blocks[:64, :4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
    for scale in (1.0, 1e-4):
        for x in _rows(rng, 3, w.shape[1]):
            x = x * np.float32(scale)
            with np.errstate(all="ignore"):
                want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
            assert_bitwise(_product(int8ir_fp4.nvfp4_kernel, x, w, "Q8_0"), want)


def test_nvfp4_permuted_activations():
    """`permuted`: position p of each 32-block holds element _ELEM[p]; the four quants of our lane L sum to ggml's
    lane _PERM[L] (the c12 correction, times 12); the Q8_0 d of the four sub-blocks of each NVFP4 block, twice."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 320)).astype(np.float32)
    a = int8dot.quantize(x, "Q8_0")
    ap, c12, da = int8ir_nvfp4.permuted(a.q, a.d, a.asum, 1)
    q = a.q[1:].reshape(2, 10, 32)  # (row, Q8_0 block, element)
    np.testing.assert_array_equal(
        ap.reshape(2, 10, 32), q[:, :, [*range(8), *range(16, 24), *range(8, 16), *range(24, 32)]]
    )
    lanes = ap.reshape(2, 10, 8, 4).astype(np.int32).sum(axis=-1)  # (row, block, our lane)
    ggml = a.asum[1:].reshape(2, 10, 8)
    np.testing.assert_array_equal(lanes, ggml[:, :, [0, 1, 4, 5, 2, 3, 6, 7]])
    np.testing.assert_array_equal(c12.reshape(2, 10, 8), 12 * lanes)
    d = a.d[1:].reshape(2, 5, 2)  # (row, NVFP4 block, its two Q8_0 blocks)
    np.testing.assert_array_equal(da.reshape(2, 5, 2, 4), np.repeat(d, 2, axis=-1)[:, :, None, :].repeat(2, axis=2))
