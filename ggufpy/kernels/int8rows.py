"""Integer products of a batched pass in the llamacpp numerics: B activation rows of B sequences, each row
bit for bit its product alone (`int8dot.product` of that one row).

    y = int8rows.product_rows(int8dot.quantize(x, iw.fmt), iw, threads)     # x (B, in) -> (B, out)

ggml picks a weight's kernel by the number of activation rows (`quants.x86.kernel_for`): Q4_K's repacked gemm
from 4 rows, Q6_K's / Q5_K's / Q3_K's tiled kernel from 8, whose f32 steps differ from the one-row kernel's.
A row decoded alone takes the one-row kernel, so a batched pass must too, for every row:
- the 32-element types in GGUF rows (Q4_1, Q5_0, Q5_1; Q4_0 and Q8_0 with out % 8 != 0), Q6_K, Q5_K and Q3_K
  (whose tiled kernels start at 8 rows), Q4_0's and Q4_K's eight-row groups: `int8ir_rows`, `int8ir_rows_k`,
  each weight block decoded once for up to eight rows, each row with the one-row kernel's steps (at 8 rows,
  one thread, 8192 x 2048: Q4_1 1.58x, Q4_K 1.71x, Q4_0 1.54x, Q6_K 1.64x, Q5_K 1.76x the multiply-adds per second of
  the one-row kernel run row by row, which re-decoded every block per row);
- kernels whose steps per row do not depend on the row count (Q8_0's groups, Q4_0 repacked in GGUF rows): all
  rows in one call;
- the rest (the low-bit types): `int8dot.product` on at most `ONE_ROW_BELOW` - 1 rows at a time, below every
  switch (each chunk reads the weight again).
"""

from __future__ import annotations

import numpy as np

from ._numba import get_threads, jit, prange, use_threads
from .int8dot import _NONE_F32, _NONE_I16, _NONE_I32, AVAILABLE, Activations, Int8Weight, product

__all__ = ["ONE_ROW_BELOW", "product_rows"]

ONE_ROW_BELOW = 4  # rows: below this count every integer kernel is its one-row kernel (Q4_K's gemm starts at 4)

_ROWS: dict = {}  # a one-row kernel -> the kernel that runs it on up to eight rows per weight block
_ANY_ROWS: set = set()  # kernels whose per-row steps do not depend on the row count

if AVAILABLE:
    from . import int8dot, int8ir_k5, int8ir_q8_0_x8, int8ir_rows, int8ir_rows_k

    _Q4_0, _Q5_0, _Q8_0 = (int8ir_rows.q0_dot_rows(k) for k in ("q4_0", "q5_0", "q8_0"))
    _Q4_1, _Q5_1 = (int8ir_rows.q0_dot_rows(k) for k in ("q4_1", "q5_1"))
    _MAX = int8ir_rows.MAX_ROWS

    @jit
    def _by_block(x):
        """x (T, nb) transposed to (nb, T + MAX_ROWS), zero-padded: a block's values of eight rows t.. as one
        vector (the intrinsics load eight lanes from any t < T)."""
        out = np.zeros((x.shape[1], x.shape[0] + _MAX), np.float32)
        for t in range(x.shape[0]):
            for b in range(x.shape[1]):
                out[b, t] = x[t, b]
        return out

    # One kernel per type (numba compiles only those a model's types call): weight rows in parallel, each
    # against every activation row, eight at a time.
    @jit(parallel=True)
    def _rows_q4_0(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 32
        adT, sT = _by_block(ad), _by_block(s)
        for r in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q4_0(w, r, aq, t, min(_MAX, T - t), adT, sT, asum, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _rows_q5_0(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 32
        adT, sT = _by_block(ad), _by_block(s)
        for r in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q5_0(w, r, aq, t, min(_MAX, T - t), adT, sT, asum, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _rows_q8_0(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 32
        adT, sT = _by_block(ad), _by_block(s)
        for r in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q8_0(w, r, aq, t, min(_MAX, T - t), adT, sT, asum, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _rows_q4_1(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 32
        adT, sT = _by_block(ad), _by_block(s)
        for r in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q4_1(w, r, aq, t, min(_MAX, T - t), adT, sT, asum, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _rows_q5_1(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 32
        adT, sT = _by_block(ad), _by_block(s)
        for r in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q5_1(w, r, aq, t, min(_MAX, T - t), adT, sT, asum, nb, out)
        use_threads(previous)

    _Q4_KX8 = int8ir_rows_k.q4_kx8_rows()

    @jit(parallel=True)
    def _rows_q4_kx8(nt, w, aq, ad, bsums, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 256
        for g in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q4_KX8(w, g, aq, t, min(_MAX, T - t), ad, bsums, nb, out)
        use_threads(previous)

    _Q4_0X8 = int8ir_rows.q4_0x8_rows()

    @jit
    def _zero_sums(asum, nb):
        """(T, nb) int32: 8 * the sum of each row's quants in each block (asum holds sums of 4 quants)."""
        out = np.empty((asum.shape[0], nb), np.int32)
        for t in range(asum.shape[0]):
            for b in range(nb):
                total = 0
                for k in range(8):
                    total += asum[t, 8 * b + k]
                out[t, b] = 8 * total
        return out

    @jit(parallel=True)
    def _rows_q4_0x8(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 32
        zsum = _zero_sums(asum, nb)
        for g in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q4_0X8(w, g, aq, t, min(_MAX, T - t), ad, zsum, nb, out)
        use_threads(previous)

    _Q6_K = int8ir_rows_k.q6_k_rows()
    _Q5_K, _Q3_K = int8ir_rows_k.k5_rows("q5_k"), int8ir_rows_k.k5_rows("q3_k")

    @jit(parallel=True)
    def _rows_q6_k(nt, w, aq, ad, bsums, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 256
        for r in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q6_K(w, r, aq, t, min(_MAX, T - t), ad, bsums, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _rows_q5_k(nt, w, aq, ad, bsums, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 256
        for r in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q5_K(w, r, aq, t, min(_MAX, T - t), ad, bsums, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _rows_q3_k(nt, w, aq, ad, bsums, out):
        previous = use_threads(nt)
        T, nb = aq.shape[0], aq.shape[1] // 256
        for r in prange(w.shape[0]):
            for t in range(0, T, _MAX):
                _Q3_K(w, r, aq, t, min(_MAX, T - t), ad, bsums, nb, out)
        use_threads(previous)

    _ROWS.update(
        {
            int8ir_k5._mv_q5_k: _rows_q5_k,
            int8ir_k5._mv_q3_k: _rows_q3_k,
            int8dot._mv_q6_k: _rows_q6_k,
            int8dot._mv_q4_0x8: _rows_q4_0x8,
            int8dot._mv_q4_kx8: _rows_q4_kx8,
            int8dot._mv_q4_0_lanes: _rows_q4_0,
            int8dot._mv_q5_0: _rows_q5_0,
            int8dot._mv_q8_0: _rows_q8_0,
            int8dot._mv_q4_1: _rows_q4_1,
            int8dot._mv_q5_1: _rows_q5_1,
        }
    )
    _ANY_ROWS.update({int8dot._mv_q4_0_block, int8ir_q8_0_x8.q8_0x8_kernel})


def product_rows(a: Activations, iw: Int8Weight, threads: int = 0) -> np.ndarray:
    """Quantized activation rows of independent sequences times the weight: f32 (T, rows), row t bit for bit
    `product` of row t alone."""
    T = a.q.shape[0]
    rows = _ROWS.get(iw.kernel)
    if rows is not None and T > 1:  # (one row: the one-row kernel itself, 1.4x faster than Q4_K's rows form)
        out = np.empty((T, iw.rows), np.float32)
        if iw.k_type:
            rows(threads or get_threads(), iw.raw, a.q, a.d, a.bsums, out)
        else:
            rows(threads or get_threads(), iw.raw, a.q, a.d, a.s, a.asum, out)
        return out
    if T < ONE_ROW_BELOW or iw.kernel in _ANY_ROWS:
        return product(a, iw, threads)
    out = np.empty((T, iw.rows), np.float32)
    step = ONE_ROW_BELOW - 1
    for t in range(0, T, step):
        product(_slice(a, t, t + step), iw, threads, out[t : t + step])
    return out


def _slice(a: Activations, lo: int, hi: int) -> Activations:
    """Rows lo..hi-1 of `a` (the placeholders of the fields its format does not use stay as they are)."""

    def part(x):
        return x if x is _NONE_F32 or x is _NONE_I32 or x is _NONE_I16 else x[lo:hi]

    return Activations(a.fmt, a.q[lo:hi], part(a.d), part(a.s), part(a.asum), part(a.bsums))
