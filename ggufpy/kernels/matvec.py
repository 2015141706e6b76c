"""Fused kernels on repacked weights (`layout.Packed`): products with activation rows, and unpacking.

`matvec(p, xv, terms)` computes y (T, G*64) for activation terms made by `activations.prepare`. It runs in
parallel over groups of 64 rows; each task reads its group's bytes once from memory and then, for the T
activation rows, accumulates

    blk[r] += xv[k] * v[k, r]          over the S elements k of a sub-block (one SIMD lane per row r)
    acc[r] += (A[r] * ad) * (blk[r] + zo * xs) + B[r] * am      once per sub-block

so the weights are never expanded to f32 in memory and nothing needs a horizontal sum. Rows are taken two
at a time when there are several (prefill): each unpacked value then serves two multiply-adds, which is
worth 1.7x. Accumulators are f32; for the exact numerics the result differs from `x @ W.T` only by
summation order.

`unpack(p, g0, g1, out)` writes the dense rows of groups g0..g1-1, bit-identical to the reference
dequantizer (for the BLAS path).

Scales, for both layout styles (see `layout.py`): A = a[g, s // per, r] (times sc[g, s, r] in the super
style) and B = b[g, s // per, r] (times mn[g, s, r]); `per` is 1 in the block style.

Integer fields are narrowed back (`np.int32`, `np.uint8`) before each conversion to f32: numba computes in
int64, and LLVM only emits `vpmovzxbd` + `vcvtdq2ps` instead of slow 64-bit conversions when it can see that
the values are small.
"""

from __future__ import annotations

import numpy as np

from . import rawblocks
from ._numba import get_threads, half_to_float, jit, prange, use_threads
from .layout import GROUP, Packed

__all__ = ["matvec", "plan", "unpack"]

_EMPTY_F32 = np.zeros((0, 0, 0), np.float32)
_EMPTY_I8 = np.zeros((0, 0, 0), np.int8)
_NO_TERMS = np.zeros((3, 1, 1), np.float32)
_U2, _U3, _U4, _U12, _U15, _U48, _U192 = (np.uint8(v) for v in (2, 3, 4, 12, 15, 48, 192))


@jit(inline=True)
def _scale_at(arr, g, j, r):
    """arr[g, j, r] as f32: scale arrays hold fp16 bits (uint16), or f32 (Q8_K's d)."""
    if arr.itemsize == 2:
        return half_to_float(arr[g, j, r])
    return np.float32(arr[g, j, r])


# --- the inner products of one sub-block, per storage family --------------------------------------------------
# dot1 fills blk[0:64] for activation row t; dot2 fills blk and blk2 for rows t and t+1.
@jit(inline=True)
def _nib_row(q, a, b, sc, mn, per, zo, xv, terms, exact, t, g, out):
    """Row t of the product for group g (decode), with the two nibble halves in separate arrays: faster
    here than one array of 64 (LLVM keeps the two accumulators apart without run-time checks)."""
    _, n, S, _ = q.shape
    blo = np.empty(32, np.float32)
    bhi = np.empty(32, np.float32)
    alo = np.zeros(32, np.float32)
    ahi = np.zeros(32, np.float32)
    for s in range(n):
        blo[:] = 0.0
        bhi[:] = 0.0
        for k in range(S):
            xk = xv[t, s * S + k]
            for r in range(32):
                v = q[g, s, k, r]
                blo[r] += xk * np.float32(np.int32(v & 15))
                bhi[r] += xk * np.float32(np.int32(v >> 4))
        corr, sa, sm = _terms(xv, terms, exact, zo, t, s, S)
        sb = s // per
        if sc.shape[0] > 0:
            for r in range(32):
                alo[r] += (_scale_at(a, g, sb, r) * np.float32(np.int32(sc[g, s, r])) * sa) * (blo[r] + corr)
                ahi[r] += (_scale_at(a, g, sb, 32 + r) * np.float32(np.int32(sc[g, s, 32 + r])) * sa) * (bhi[r] + corr)
        else:
            for r in range(32):
                alo[r] += (_scale_at(a, g, sb, r) * sa) * (blo[r] + corr)
                ahi[r] += (_scale_at(a, g, sb, 32 + r) * sa) * (bhi[r] + corr)
        if b.shape[0] > 0:
            if mn.shape[0] > 0:
                for r in range(32):
                    alo[r] += _scale_at(b, g, sb, r) * np.float32(np.int32(mn[g, s, r])) * sm
                    ahi[r] += _scale_at(b, g, sb, 32 + r) * np.float32(np.int32(mn[g, s, 32 + r])) * sm
            else:
                for r in range(32):
                    alo[r] += _scale_at(b, g, sb, r) * sm
                    ahi[r] += _scale_at(b, g, sb, 32 + r) * sm
    out[t, g * 64 : g * 64 + 32] = alo
    out[t, g * 64 + 32 : g * 64 + 64] = ahi


@jit(inline=True)
def _nib_dot2(q, g, s, S, xv, t, blk, blk2, quarter):
    for r in range(64):
        blk[r] = 0.0
        blk2[r] = 0.0
    for k in range(S):
        x0 = xv[t, s * S + k]
        x1 = xv[t + 1, s * S + k]
        for r in range(32):
            v = q[g, s, k, r]
            lo = np.float32(np.int32(v & 15))
            hi = np.float32(np.int32(v >> 4))
            blk[r] += x0 * lo
            blk[32 + r] += x0 * hi
            blk2[r] += x1 * lo
            blk2[32 + r] += x1 * hi


@jit(inline=True)
def _nib6_values(q, g, s, k, r):
    """Rows r, 16+r, 32+r, 48+r (r < 16) from the nibble bytes r, 16+r and the 2-bit byte 32+r."""
    n0 = q[g, s, k, r]
    n1 = q[g, s, k, 16 + r]
    h = q[g, s, k, 32 + r]
    v0 = np.uint8(n0 & _U15) | np.uint8((h & _U3) << _U4)
    v1 = np.uint8(n1 & _U15) | np.uint8((h & _U12) << _U2)
    v2 = np.uint8(n0 >> _U4) | np.uint8(h & _U48)
    v3 = np.uint8(n1 >> _U4) | np.uint8((h & _U192) >> _U2)
    return (
        np.float32(np.uint8(v0)),
        np.float32(np.uint8(v1)),
        np.float32(np.uint8(v2)),
        np.float32(np.uint8(v3)),
    )


@jit(inline=True)
def _nib6_dot1(q, g, s, S, xv, t, blk, quarter):
    # `quarter` (16) comes in as a run-time value: LLVM then vectorizes the loop instead of unrolling it
    for r in range(64):
        blk[r] = 0.0
    for k in range(S):
        xk = xv[t, s * S + k]
        for r in range(quarter):
            v0, v1, v2, v3 = _nib6_values(q, g, s, k, r)
            blk[r] += xk * v0
            blk[16 + r] += xk * v1
            blk[32 + r] += xk * v2
            blk[48 + r] += xk * v3


@jit(inline=True)
def _nib6_dot2(q, g, s, S, xv, t, blk, blk2, quarter):
    for r in range(64):
        blk[r] = 0.0
        blk2[r] = 0.0
    for k in range(S):
        x0 = xv[t, s * S + k]
        x1 = xv[t + 1, s * S + k]
        for r in range(quarter):
            v0, v1, v2, v3 = _nib6_values(q, g, s, k, r)
            blk[r] += x0 * v0
            blk[16 + r] += x0 * v1
            blk[32 + r] += x0 * v2
            blk[48 + r] += x0 * v3
            blk2[r] += x1 * v0
            blk2[16 + r] += x1 * v1
            blk2[32 + r] += x1 * v2
            blk2[48 + r] += x1 * v3


@jit(inline=True)
def _i8_dot1(q, g, s, S, xv, t, blk, quarter):
    for r in range(64):
        blk[r] = 0.0
    for k in range(S):
        xk = xv[t, s * S + k]
        for r in range(64):
            blk[r] += xk * np.float32(np.int32(q[g, s, k, r]))


@jit(inline=True)
def _i8_dot2(q, g, s, S, xv, t, blk, blk2, quarter):
    for r in range(64):
        blk[r] = 0.0
        blk2[r] = 0.0
    for k in range(S):
        x0 = xv[t, s * S + k]
        x1 = xv[t + 1, s * S + k]
        for r in range(64):
            v = np.float32(np.int32(q[g, s, k, r]))
            blk[r] += x0 * v
            blk2[r] += x1 * v


# --- scaling a sub-block's inner products into the row sums ----------------------------------------------------
@jit(inline=True)
def _scales(a, b, sc, mn, per, g, s, scale, offset, j):
    """scale[j, r] = A, offset[j, r] = B of sub-block s (B = -0.0 when the type has no offsets).

    Row j of 2-D scratch arrays rather than 1-D views: numba compiles a parallel loop without its `noalias`
    promise as soon as the loop body takes a view of an array, and the products then lose vectorization."""
    sb = s // per
    for r in range(64):
        scale[j, r] = _scale_at(a, g, sb, r)
    if sc.shape[0] > 0:
        for r in range(64):
            scale[j, r] *= np.float32(np.int32(sc[g, s, r]))
    if b.shape[0] > 0:
        for r in range(64):
            offset[j, r] = _scale_at(b, g, sb, r)
        if mn.shape[0] > 0:
            for r in range(64):
                offset[j, r] *= np.float32(np.int32(mn[g, s, r]))
    else:  # -0.0, not 0.0: x + -0.0 is x for every x, while -0.0 + 0.0 would be +0.0
        for r in range(64):
            offset[j, r] = -0.0


@jit(inline=True)
def _accumulate(acc, blk, scale, offset, j, zo, terms, t, s):
    corr = np.float32(zo) * terms[0, t, s]  # zo * xs
    sa = terms[1, t, s]  # ad
    sm = terms[2, t, s]  # am
    for r in range(64):
        acc[r] += (scale[j, r] * sa) * (blk[r] + corr) + offset[j, r] * sm


@jit(inline=True)
def _terms(xv, terms, exact, zo, t, s, S):
    """(zo * xs, ad, am) of row t, sub-block s. With exact numerics they are (zo * sum x, 1, sum x), summed
    here rather than in a separate call: for decode, one dispatch less per product."""
    if exact:
        total = np.float32(0.0)
        for k in range(s * S, s * S + S):
            total += xv[t, k]
        return np.float32(zo) * total, np.float32(1.0), total
    return np.float32(zo) * terms[0, t, s], terms[1, t, s], terms[2, t, s]


@jit(inline=True)
def _accumulate_direct(acc, blk, a, b, sc, mn, per, g, s, zo, xv, terms, exact, t, S):
    """`_scales` and `_accumulate` in one pass, for a single activation row (decode): no scratch arrays."""
    corr, sa, sm = _terms(xv, terms, exact, zo, t, s, S)
    sb = s // per
    if sc.shape[0] > 0:
        for r in range(64):
            acc[r] += (_scale_at(a, g, sb, r) * np.float32(np.int32(sc[g, s, r])) * sa) * (blk[r] + corr)
    else:
        for r in range(64):
            acc[r] += (_scale_at(a, g, sb, r) * sa) * (blk[r] + corr)
    if b.shape[0] > 0:
        if mn.shape[0] > 0:
            for r in range(64):
                acc[r] += _scale_at(b, g, sb, r) * np.float32(np.int32(mn[g, s, r])) * sm
        else:
            for r in range(64):
                acc[r] += _scale_at(b, g, sb, r) * sm


# --- the kernels: per storage family, one for pairs of activation rows and one for a single row ------------------
# Separate functions, so that LLVM optimizes each loop on its own (and numba keeps each one's `noalias`).
@jit(inline=True)
def _pairs(dot, q, a, b, sc, mn, per, zo, xv, terms, out, g, quarter):
    """Rows 0..T-1 (T even) of group g, two at a time; the group's scales are computed once for all pairs."""
    _, n, S, _ = q.shape
    blk = np.empty(64, np.float32)  # separate allocations: LLVM can then tell that they do not overlap
    blk2 = np.empty(64, np.float32)
    acc = np.empty(64, np.float32)
    acc2 = np.empty(64, np.float32)
    scale = np.empty((n, 64), np.float32)
    offset = np.empty((n, 64), np.float32)
    for s in range(n):
        _scales(a, b, sc, mn, per, g, s, scale, offset, s)
    for t in range(0, xv.shape[0] - 1, 2):
        acc[:] = 0.0
        acc2[:] = 0.0
        for s in range(n):
            dot(q, g, s, S, xv, t, blk, blk2, quarter)
            _accumulate(acc, blk, scale, offset, s, zo, terms, t, s)
            _accumulate(acc2, blk2, scale, offset, s, zo, terms, t + 1, s)
        out[t, g * 64 : g * 64 + 64] = acc
        out[t + 1, g * 64 : g * 64 + 64] = acc2


@jit(inline=True)
def _row(dot, q, a, b, sc, mn, per, zo, xv, terms, exact, out, g, t, quarter):
    """Row t of group g: scales applied as they are read, no scratch arrays (decode)."""
    _, n, S, _ = q.shape
    blk = np.empty(64, np.float32)
    acc = np.zeros(64, np.float32)
    for s in range(n):
        dot(q, g, s, S, xv, t, blk, quarter)
        _accumulate_direct(acc, blk, a, b, sc, mn, per, g, s, zo, xv, terms, exact, t, S)
    out[t, g * 64 : g * 64 + 64] = acc


@jit(parallel=True, fast=True)
def _mv_nib_pairs(nt, q, a, b, sc, mn, per, zo, xv, terms, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _pairs(_nib_dot2, q, a, b, sc, mn, per, zo, xv, terms, out, g, 0)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _mv_nib_row(nt, q, a, b, sc, mn, per, zo, xv, terms, exact, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _nib_row(q, a, b, sc, mn, per, zo, xv, terms, exact, xv.shape[0] - 1, g, out)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _mv_nib6_pairs(nt, q, a, b, sc, mn, per, zo, xv, terms, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _pairs(_nib6_dot2, q, a, b, sc, mn, per, zo, xv, terms, out, g, q.shape[3] // 3)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _mv_nib6_row(nt, q, a, b, sc, mn, per, zo, xv, terms, exact, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _row(_nib6_dot1, q, a, b, sc, mn, per, zo, xv, terms, exact, out, g, xv.shape[0] - 1, q.shape[3] // 3)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _mv_i8_pairs(nt, q, a, b, sc, mn, per, zo, xv, terms, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _pairs(_i8_dot2, q, a, b, sc, mn, per, zo, xv, terms, out, g, 0)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _mv_i8_row(nt, q, a, b, sc, mn, per, zo, xv, terms, exact, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _row(_i8_dot1, q, a, b, sc, mn, per, zo, xv, terms, exact, out, g, xv.shape[0] - 1, 0)
    use_threads(previous)


# --- unpacking to dense rows (bit-identical to the reference dequantizers) --------------------------------------
@jit(parallel=True)
def _unpack_t(nt, q, family, a, b, sc, mn, per, zo, g0, out):
    """Groups g0.. of the weight, transposed: out (cols, 64 * groups) with out[k, r] = W[r, k]. Vectorized
    over the 64 rows of a group, like the products. The reference's operation order: A = d * sc (exact),
    then A * q, then + B (B = -(dmin * m), m, or -0.0, which leaves every value as it is)."""
    previous = use_threads(nt)
    _, n, S, width = q.shape
    quarter = width // 3
    z = np.float32(zo)
    for i in prange(out.shape[1] // 64):
        g = g0 + i
        scale = np.empty((1, 64), np.float32)
        offset = np.empty((1, 64), np.float32)
        sc0, of0 = scale[0], offset[0]
        c0 = 64 * i
        for s in range(n):
            _scales(a, b, sc, mn, per, g, s, scale, offset, 0)
            for k in range(S):
                row = out[s * S + k, c0 : c0 + 64]  # a view is fine here: no reduction to vectorize
                if family == 0:  # nib
                    for r in range(32):
                        v = q[g, s, k, r]
                        row[r] = sc0[r] * (np.float32(np.int32(v & 15)) + z) + of0[r]
                        row[32 + r] = sc0[32 + r] * (np.float32(np.int32(v >> 4)) + z) + of0[32 + r]
                elif family == 1:  # nib6
                    for r in range(quarter):
                        v0, v1, v2, v3 = _nib6_values(q, g, s, k, r)
                        row[r] = sc0[r] * (v0 + z) + of0[r]
                        row[16 + r] = sc0[16 + r] * (v1 + z) + of0[16 + r]
                        row[32 + r] = sc0[32 + r] * (v2 + z) + of0[32 + r]
                        row[48 + r] = sc0[48 + r] * (v3 + z) + of0[48 + r]
                else:  # i8
                    for r in range(64):
                        row[r] = sc0[r] * (np.float32(np.int32(q[g, s, k, r])) + z) + of0[r]
    use_threads(previous)


_FAMILY = {"nib": 0, "nib6": 1, "i8": 2}
_MATVEC = {  # family -> (kernel for one row, kernel for pairs of rows)
    "nib": (_mv_nib_row, _mv_nib_pairs),
    "nib6": (_mv_nib6_row, _mv_nib6_pairs),
    "i8": (_mv_i8_row, _mv_i8_pairs),
}


def _scale_args(p: Packed) -> tuple:
    """(a, b, sc, mn, per) with empty arrays for the fields a type does not have."""
    per = 1 if p.style == "block" else 256 // p.sub
    empty = (_EMPTY_F32, _EMPTY_F32, _EMPTY_I8, _EMPTY_I8)
    a, b, sc, mn = (e if x is None else x for x, e in zip((p.a, p.b, p.sc, p.mn), empty, strict=True))
    return a, b, sc, mn, per


def plan(p: Packed):
    """((row kernel, pairs kernel), weight arguments) for `p`, computed once per weight. The "blocks" family
    has its own kernels (`rawblocks.py`): (None, (q,))."""
    if p.family == "blocks":
        return None, (p.q,)
    return _MATVEC[p.family], (p.q, *_scale_args(p), p.zo)


def matvec(p: Packed, xv: np.ndarray, terms: np.ndarray | None, out=None, planned=None, threads: int = 0) -> np.ndarray:
    """y (T, G*64): T activation rows (`activations.prepare` gives xv and terms) times the packed weight, on
    `threads` threads (0: numba's current count). Rows past `p.rows` (padding of the last group) are 0.
    `terms=None` means exact numerics (xv = x): the kernels then sum the sub-blocks of x themselves."""
    T = xv.shape[0]
    if out is None:
        out = np.empty((T, p.groups * GROUP), np.float32)
    nt = threads or get_threads()
    if p.family == "blocks":
        return rawblocks.matvec(p.type, p.q, xv, terms, out, nt)
    (row, pairs), args = planned or plan(p)
    exact = terms is None
    if exact and T >= 2:
        from .activations import EXACT, prepare

        _, terms = prepare(xv, EXACT, p.sub)
    if T >= 2:
        pairs(nt, *args, xv, terms, out)  # rows 0..T-1 for even T, 0..T-2 for odd T
    if T % 2:
        row(nt, *args, xv, _NO_TERMS if exact else terms, exact, out)  # the last row
    return out


def unpack(p: Packed, g0: int, g1: int, out: np.ndarray | None = None, threads: int = 0) -> np.ndarray:
    """The dense f32 weight rows of groups g0..g1-1, transposed: (cols, 64*(g1-g0)), so that `x @ out` is the
    product with those rows. Bit-identical to the reference dequantizer."""
    if out is None:
        out = np.empty((p.cols, (g1 - g0) * GROUP), np.float32)
    if p.family == "blocks":
        return rawblocks.unpack(p.type, p.q, p.cols, g0, out, threads or get_threads())
    _unpack_t(threads or get_threads(), p.q, _FAMILY[p.family], *_scale_args(p), p.zo, g0, out)
    return out
