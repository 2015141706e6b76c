"""The staged one-row (decode, T = 1) kernels of IQ2_XS, IQ1_M, IQ1_S and IQ3_S (`ggufpy/kernels/int8grid_decode.py`,
`int8grid_iq2xs.py`, `int8grid_iq1.py`, `int8grid_iq3s.py`) equal the NumPy replays of ggml's x86 vec_dot bit for
bit: random blocks (every index, sign and scale bit pattern), single activation rows (assorted magnitudes, a zero
row, every quant +-127, outliers), row counts that are not multiples of 8 or 16, block counts across the 16-block
stage chunks, one to three threads; and the values of `int8ir_iqgrid.grid_dot`, what T = 1 ran before (T = 2..7
still run its per-row steps)."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot

pytest.importorskip("numba")
from ggufpy.kernels import _numba, int8dot

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

if int8dot.AVAILABLE:
    from ggufpy.kernels import int8grid, int8grid_decode, int8grid_iq1
    from tests.test_kernels_int8_lowbit import random_weight
    from tests.test_kernels_int8ir_fp4 import assert_bitwise

TYPES = [T.IQ2_XS, T.IQ1_M, T.IQ1_S, T.IQ3_S]
# (rows, cols): 1, 4, 11 (the bench model's 2816), 16, 17, 33 super-blocks; rows 3, 7, 9, 13, 21: not multiples of 8
SHAPES = [(40, 256), (13, 1024), (7, 2816), (9, 4096), (21, 4352), (3, 8448)]


def _rows(rng: np.random.Generator, n: int, cols: int) -> list[np.ndarray]:
    """Single activation rows: assorted magnitudes, a zero row (d = 0), one of equal values (every quant +-127:
    the largest integer sums), one with outliers."""
    rows = [rng.standard_normal(cols) * s for s in rng.choice([1e-3, 0.1, 1.0, 8.0], size=n)]
    rows[1] = np.zeros(cols)
    rows[2] = np.full(cols, rng.choice([-3.0, 3.0]))
    rows[3][:: max(1, cols // 7)] *= 300.0
    return [r.astype(np.float32)[None, :] for r in rows]


def _product(t, x, w, threads=1):
    a = int8dot.quantize(x, "Q8_K")
    raw = np.asarray(w.raw).view(np.uint8).reshape(w.shape[0], -1)
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    int8grid.KERNELS[t](threads, raw, a.q, a.d, a.bsums, out)
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_decode_equals_the_replay(t, rows, cols):
    rng = np.random.default_rng([int(t), rows, cols])
    w = random_weight(t, rows, cols, rng)
    for x in _rows(rng, 4, cols):
        got = _product(t, x, w)
        for isa in ("avx512", "avx2"):  # both x86 builds run the same vec_dot for these types at T = 1
            assert_bitwise(got, vecdot.linear_x86(x, w.raw, w.type, w.shape, isa=isa))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_decode_equals_the_previous_kernel(t):
    """The same values as `grid_dot` (what T = 1 ran before), whose per-row steps T = 2..7 still run: a two-row
    product gives each row's decode value."""
    rng = np.random.default_rng([int(t), 7])
    w = random_weight(t, 21, 2816, rng)
    x = np.concatenate(_rows(rng, 4, 2816)[2:])
    two = _product(t, x, w)
    for i in range(2):
        assert_bitwise(_product(t, x[i : i + 1], w), two[i : i + 1])


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_decode_threads(t):
    """1, 2 and 3 threads give the same values (each row is one task's)."""
    rng = np.random.default_rng([int(t), 3])
    w = random_weight(t, 45, 4352, rng)
    x = _rows(rng, 4, 4352)[0]
    one = _product(t, x, w, threads=1)
    assert not np.isnan(one).any()
    for threads in (2, 3):
        assert_bitwise(_product(t, x, w, threads=threads), one)


def test_iq1_m_delta_sums():
    """`delta_sums`: word 16k + 2L + j of block b = the sum of elements 256b + 32 (2k + j) + 4L .. + 3."""
    rng = np.random.default_rng(11)
    aq = rng.integers(-127, 128, (2, 512), dtype=np.int8)
    for t in range(2):
        q = int8grid_iq1.delta_sums(aq, t)
        quads = aq[t].astype(np.int64).reshape(2, 8, 8, 4).sum(axis=-1)  # (block, sub-block, lane)
        want = quads.reshape(2, 4, 2, 8).transpose(0, 1, 3, 2).reshape(1, -1)  # (block, k, L, j)
        assert q.dtype == np.int16 and np.array_equal(q, want)


def test_chunk_boundaries_are_covered():
    """The shapes above straddle the stage chunks (so the remainder chunk and several full ones run)."""
    blocks = {cols // 256 for _, cols in SHAPES}
    chunk = int8grid_decode.CHUNK
    assert any(b < chunk for b in blocks) and chunk in blocks
    assert any(b > chunk and b % chunk for b in blocks) and any(b > 2 * chunk for b in blocks)
