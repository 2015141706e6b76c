"""The decode (T = 1) kernels of TQ1_0, TQ2_0 and Q1_0 in the llamacpp numerics (`kernels/int8ir_ternary_rows.py`:
several weight rows per call, prefetched; TQ1_0's digits from flipped bytes) equal the one-row intrinsics of
`int8ir_ternary` and the NumPy replay of ggml's x86 kernels bit for bit: random blocks, row counts that leave a
remainder after the row groups, one to three threads."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot
from ggufpy.quants.lowbit import parts_tq1_0

int8ir_ternary = pytest.importorskip("ggufpy.kernels.int8ir_ternary")
from ggufpy.kernels import _numba, int8dot  # noqa: E402
from ggufpy.kernels._numba import jit  # noqa: E402
from tests.test_kernels_int8_lowbit import activations, assert_bitwise, random_weight  # noqa: E402

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

TYPES = [T.TQ1_0, T.TQ2_0, T.Q1_0]


def _raw(w) -> np.ndarray:
    _, size, block, _ = int8ir_ternary.KERNELS[w.type]
    rows, cols = w.shape
    return np.asarray(w.raw).view(np.uint8).reshape(rows, cols // block * size)


def _product(x: np.ndarray, raw: np.ndarray, t: T, threads: int) -> np.ndarray:
    fmt, _, _, kernel = int8ir_ternary.KERNELS[t]
    a = int8dot.quantize(x, fmt)
    out = np.full((x.shape[0], raw.shape[0]), np.nan, np.float32)
    if fmt == int8ir_ternary.Q8_K:
        kernel(threads, raw, a.q, a.d, a.bsums, out)
    else:
        kernel(threads, raw, a.q, a.d, a.s, a.asum, out)
    return out


@jit
def _one_row_q(w, aq, ad, out):
    for r in range(w.shape[0]):
        out[0, r] = int8ir_ternary.q1_0_dot(w, r, aq, 0, ad, aq.shape[1] // 128)


@jit
def _tq1_one(w, aq, ad, bsums, out):
    for r in range(w.shape[0]):
        out[0, r] = int8ir_ternary.tq1_0_dot(w, r, aq, 0, ad, bsums, aq.shape[1] // 256)


@jit
def _tq2_one(w, aq, ad, bsums, out):
    for r in range(w.shape[0]):
        out[0, r] = int8ir_ternary.tq2_0_dot(w, r, aq, 0, ad, bsums, aq.shape[1] // 256)


def _one_row(x: np.ndarray, raw: np.ndarray, t: T) -> np.ndarray:
    """The one-row intrinsics (the kernels before the row groups), row by row."""
    fmt = int8ir_ternary.KERNELS[t][0]
    a = int8dot.quantize(x, fmt)
    out = np.full((1, raw.shape[0]), np.nan, np.float32)
    if t == T.Q1_0:
        _one_row_q(raw, a.q, a.d, out)
    else:
        (_tq1_one if t == T.TQ1_0 else _tq2_one)(raw, a.q, a.d, a.bsums, out)
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("rows", "cols", "threads"),
    [(1, 256, 1), (3, 1024, 2), (5, 512, 3), (13, 2816, 1), (37, 1024, 2), (130, 768, 3), (64, 256, 2)],
)
def test_decode_equals_one_row_and_replay(t, rows, cols, threads):
    """Rows in groups of TQ2_0_ROWS / Q1_0_ROWS, the remainder one by one; prefetches past the weight's end (the
    last rows) are harmless."""
    rng = np.random.default_rng([int(t), rows, cols, threads])
    w = random_weight(t, rows, cols, rng)
    raw = _raw(w)
    x = activations(rng, 1, cols)
    got = _product(x, raw, t, threads)
    assert_bitwise(got, _one_row(x, raw, t))
    assert_bitwise(got, vecdot.linear_x86(x, w.raw, w.type, w.shape))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_decode_special_activations(t):
    """A zero activation row (every d = 0) and one with outliers, 7 rows (one group of 4 / three of 2, and a
    remainder)."""
    rng = np.random.default_rng([int(t), 7])
    w = random_weight(t, 7, 1024, rng)
    raw = _raw(w)
    for x in (np.zeros((1, 1024), np.float32), activations(rng, 3, 1024)[2:]):
        got = _product(x, raw, t, 2)
        assert_bitwise(got, _one_row(x, raw, t))
        assert_bitwise(got, vecdot.linear_x86(x, w.raw, w.type, w.shape))


@jit
def _unpack_tq1_0(w, out):
    for r in range(w.shape[0]):
        int8ir_ternary.tq1_0_unpack(w, r, out[r : r + 1], w.shape[1] // 54)


def _every_byte_blocks(size: int, n: int, rng) -> np.ndarray:
    """n blocks whose byte at each offset takes every value 0..255 (n >= 256), in random order per offset."""
    b = np.empty((n, size), np.uint8)
    for i in range(size):
        b[:, i] = rng.permutation(np.resize(np.arange(256, dtype=np.uint8), n))
    return b


def test_tq1_0_codes_every_byte():
    """`tq1_0_codes` (flipped bytes, signed compares, 256-bit powers of qs[32:48]) gives `lowbit.parts_tq1_0`'s
    q + 1 for every byte at every offset."""
    rng = np.random.default_rng(1)
    blocks = _every_byte_blocks(54, 512, rng)
    codes = np.zeros((512, 256), np.uint8)
    _unpack_tq1_0(blocks, codes)
    _, q = parts_tq1_0(blocks)
    assert np.array_equal(codes.astype(np.int16), q.reshape(512, 256).astype(np.int16) + 1)


def test_flipped_digit_identity():
    """`_digit` on m ^ 0x80: [m' > -43] + [m' > 42] (signed) = (3 m) >> 8 for every byte, and the powers of 3 of
    the flipped bytes are the flipped powers (x + 128) 3^k = x 3^k + 128 mod 256."""
    m = np.arange(256)
    flipped = (m ^ 0x80).astype(np.uint8).view(np.int8).astype(int)
    assert np.array_equal((3 * m) >> 8, (flipped > -43).astype(int) + (flipped > 42))
    for k in range(6):
        assert np.array_equal(((m + 128) * 3**k) % 256, ((m * 3**k) % 256) ^ 0x80)
