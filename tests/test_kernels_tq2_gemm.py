"""TQ2_0's prefill product with lanes = weight rows (`ggufpy/kernels/int8ir_tq2_gemm.py`) equals ggml's vec_dot
(`int8ir_ternary.tq2_0_dot`, itself the replay `quants.x86.ternary` bit for bit) for every (activation row,
weight row): random blocks (TQ2_0's unused code 3 included), T = 2..128 (tiles of four and the rows left over),
weight rows under, at and off the groups of eight (the last group overlaps), 1 to 11 blocks, activation quants
at +-127 and 0 (the largest 16-bit sums), one to three threads; and against the replay itself."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot

int8ir_tq2_gemm = pytest.importorskip("ggufpy.kernels.int8ir_tq2_gemm")
from ggufpy.kernels import _numba, int8dot  # noqa: E402
from ggufpy.kernels.int8ir_ternary import tq2_0_dot  # noqa: E402
from tests.test_kernels_int8_lowbit import activations, assert_bitwise, random_weight  # noqa: E402

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

THREADS = min(3, numba.config.NUMBA_NUM_THREADS)  # the pool's size bounds a kernel's thread count


@numba.njit
def _pairs(w, aq, ad, bsums, out):
    """The reference: `tq2_0_dot` for every (weight row, activation row), as `_mv_tq2_0` ran T >= 2."""
    nb = aq.shape[1] // 256
    for r in range(w.shape[0]):
        for t in range(aq.shape[0]):
            out[t, r] = tq2_0_dot(w, r, aq, t, ad, bsums, nb)


def _raw(w) -> np.ndarray:
    return np.asarray(w.raw).view(np.uint8).reshape(w.shape[0], -1)


def _extreme_activations(rng: np.random.Generator, n: int, cols: int):
    """Q8_K rows of quants -127, 127 and 0 among random ones (row k % 5: all -127, all 127, all 0, random in
    {-127, 0, 127}, random in -127..127), random positive d (and a d = 0 block), bsums the sums of 16."""
    aq = rng.integers(-127, 128, (n, cols)).astype(np.int8)
    for k in range(n):
        kind = k % 5
        if kind < 3:
            aq[k] = (-127, 127, 0)[kind]
        elif kind == 3:
            aq[k] = rng.choice(np.array([-127, 0, 127], np.int8), cols)
    ad = (rng.random((n, cols // 256)) * 2.0 ** rng.integers(-12, 4, (n, cols // 256))).astype(np.float32)
    ad[0, 0] = 0.0
    bsums = aq.reshape(n, -1, 16).sum(axis=-1, dtype=np.int32).astype(np.int16)
    return aq, ad, bsums


def _both(raw, aq, ad, bsums, threads):
    want = np.empty((aq.shape[0], raw.shape[0]), np.float32)
    _pairs(raw, aq, ad, bsums, want)
    got = np.full_like(want, np.nan)  # every element must be written
    int8ir_tq2_gemm.mv_tq2_0_rows(threads, raw, aq, ad, bsums, got)
    return got, want


@pytest.mark.parametrize("n_rows", [2, 3, 4, 7, 8, 9, 33, 128])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 23, 64])
def test_every_pair_equals_the_vec_dot(n_rows, rows):
    """Random blocks and activation quants at their extremes, nb = 1..11 blocks, 1-3 threads."""
    rng = np.random.default_rng([n_rows, rows])
    for nb in range(1, 12):
        w = random_weight(T.TQ2_0, rows, 256 * nb, rng)
        aq, ad, bsums = _extreme_activations(rng, n_rows, 256 * nb)
        got, want = _both(_raw(w), aq, ad, bsums, 1 + nb % THREADS)
        assert_bitwise(got, want)


def test_largest_sums():
    """Every code 3 (which no quantizer writes) against quants of +-127: the 16-bit sums at their bound."""
    rng = np.random.default_rng(3)
    w = random_weight(T.TQ2_0, 16, 2816, rng)
    raw = _raw(w).copy()
    raw.reshape(16, 11, 66)[:, :, :64] = 0xFF
    aq, ad, bsums = _extreme_activations(rng, 10, 2816)
    got, want = _both(raw, aq, ad, bsums, THREADS)
    assert_bitwise(got, want)
    assert np.isfinite(want).all() and (want != 0).any()


@pytest.mark.parametrize(("n_rows", "rows", "cols"), [(2, 9, 256), (5, 24, 1024), (17, 40, 2816)])
def test_equals_the_replay(n_rows, rows, cols):
    """Quantized activations (`int8dot.quantize`) against the NumPy replay of ggml's kernel."""
    rng = np.random.default_rng([n_rows, rows, cols])
    w = random_weight(T.TQ2_0, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    a = int8dot.quantize(x, "Q8_K")
    got = np.full((n_rows, rows), np.nan, np.float32)
    int8ir_tq2_gemm.mv_tq2_0_rows(THREADS, _raw(w), a.q, a.d, a.bsums, got)
    assert_bitwise(got, vecdot.linear_x86(x, w.raw, w.type, w.shape))
