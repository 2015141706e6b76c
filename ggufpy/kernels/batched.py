"""Batched decode products: B activation rows of B independent sequences times one packed weight.

`matvec_rows(p, xv, terms)` gives, for each row t, bit for bit the result of `matvec` on that row alone
(T == 1), whatever the other rows are: each row's sums take the single-row kernels' operations in their order
(`_nib_row`; `_row` with the `*_dot1` inner products), with the loops turned inside out:

    _sub_sums                      # each row's sum over each sub-block of x, once (not once per group)
    for g in prange(groups):       # one task per group of 64 weight rows
        for s in sub-blocks:       # unpack sub-block s of the group to f32 (S, 64) once, its scales once
            row_sums               # every row's 64 lane sums over it, in registers (batched_ir.py)
            for t in range(B):     # row t's scale step, in the single-row kernels' own code

so each weight byte comes from memory once per step for all B rows, is unpacked to f32 once for all rows
(into an L1 scratch), and the multiply-adds of a pair of rows share each vector load of those values. The
sub-block sums of x (exact numerics' `_terms`: a chain of S dependent adds, which the single-row kernel repeats
for every group and which cost about as much as the multiply-adds) are summed once per call in the same order.
`attention_rows`: every row's attention of a decode step in one compiled call. The
scale step is the single-row kernels' code on purpose: their parallel body rounds it differently when it was
compiled in this process and when it came from numba's cache (same machine code for the kernel itself: the
body linked in from its own compile, or the copy in the cached object), and only the same numba code follows
them in both cases (tests/test_batch.py passes on a cold and on a warm cache). `matvec`'s own T > 1 path
takes rows two at a time with another summation (and the last row of an odd T alone), so its rows depend on
their neighbours: the batched decode of `Model.decode_batch` must not use it.

numba caveat: "bit-identical to `matvec`" holds when both kernels come from the same place (both compiled
now, as on a clean checkout, or both cached); right after this file changes, the first process compiles these
kernels while `matvec`'s come from the cache. The server decodes every token with these kernels, so its
responses do not depend on it.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from . import rawblocks
from ._numba import DISABLED, get_threads, jit, prange, use_threads
from .attention import _attention_rows as _attention_rows_kernel
from .attention import attention_rows as _attention_rows
from .backend import FLOAT_TYPES
from .batched_ir import row_sums
from .layout import GROUP, Packed
from .matvec import _nib6_values, _scale_at, matvec, plan

__all__ = ["attention_rows", "linears_rows", "matvec_rows", "row_kernel"]


# --- unpacking one sub-block of a group into f32 values (S, 64), once for all rows ---------------------------
@jit(inline=True)
def _unpack_nib(q, g, s, S, vals, quarter):
    for k in range(S):
        for r in range(32):
            v = q[g, s, k, r]
            vals[k, r] = np.float32(np.int32(v & 15))
            vals[k, 32 + r] = np.float32(np.int32(v >> 4))


@jit(inline=True)
def _unpack_nib6(q, g, s, S, vals, quarter):
    for k in range(S):
        for r in range(quarter):
            v0, v1, v2, v3 = _nib6_values(q, g, s, k, r)
            vals[k, r] = v0
            vals[k, 16 + r] = v1
            vals[k, 32 + r] = v2
            vals[k, 48 + r] = v3


@jit(inline=True)
def _unpack_i8(q, g, s, S, vals, quarter):
    for k in range(S):
        for r in range(64):
            vals[k, r] = np.float32(np.int32(q[g, s, k, r]))


@jit
def _sub_sums(xv, S, sums):
    """sums[t, s]: row t's sum over sub-block s, from 0 in column order: the `total` of `matvec._terms` (exact
    numerics), which the single-row kernel sums again for every group of 64 weight rows. Serial and without
    fastmath, so nothing reorders it."""
    for t in range(xv.shape[0]):
        for s in range(sums.shape[1]):
            total = np.float32(0.0)
            for k in range(s * S, s * S + S):
                total += xv[t, k]
            sums[t, s] = total


@jit(inline=True)
def _rows(unpack, q, a, b, sc, mn, per, zo, xv, sums, g, out, quarter):
    """Every row t of xv times group g, each row's operations those of the single-row kernels (`_nib_row`,
    `_row`): per lane r, the sum over the sub-block (`row_sums`, batched_ir.py), then the scale step in the
    expressions of `_accumulate_direct`, with the lane scales converted (exactly) once per sub-block for all
    rows. Scratch arrays are indexed, never sliced: a view in a parallel loop's body costs numba's `noalias`.
    Weights without sub-block scales sc, mn (Q4_0 .. Q8_0, IQ4_NL) only: `_rows_super` has their branches,
    which in the row loop, even untaken, made LLVM compile a slower scale step (1.15x the whole product at
    B = 8, 1.25x at B = 4 on SmolLM2's Q4_1)."""
    _, n, S, _ = q.shape
    B = xv.shape[0]
    vals = np.empty((S, 64), np.float32)
    blk = np.empty((B, 64), np.float32)
    acc = np.zeros((B, 64), np.float32)
    lane = np.empty((2, 64), np.float32)  # the sub-block's A and B per lane, as f32 (exact conversions)
    for s in range(n):
        unpack(q, g, s, S, vals, quarter)
        row_sums(vals, xv, s, blk)
        sb = s // per
        for r in range(64):
            lane[0, r] = _scale_at(a, g, sb, r)
        if b.shape[0] > 0:
            for r in range(64):
                lane[1, r] = _scale_at(b, g, sb, r)
        for t in range(B):
            sm = sums[t, s]  # `_terms` of exact numerics: (zo * sum, 1, sum)
            corr, sa = np.float32(zo) * sm, np.float32(1.0)
            for r in range(64):
                acc[t, r] += (lane[0, r] * sa) * (blk[t, r] + corr)
            if b.shape[0] > 0:
                for r in range(64):
                    acc[t, r] += lane[1, r] * sm
    for t in range(B):
        for r in range(64):
            out[t, g * 64 + r] = acc[t, r]


@jit(inline=True)
def _rows_super(unpack, q, a, b, sc, mn, per, zo, xv, sums, g, out, quarter):
    """`_rows` for weights with sub-block scales sc or mn (the super style: K-quants), whose scale step
    multiplies them in as `_accumulate_direct` does."""
    _, n, S, _ = q.shape
    B = xv.shape[0]
    vals = np.empty((S, 64), np.float32)
    blk = np.empty((B, 64), np.float32)
    acc = np.zeros((B, 64), np.float32)
    lane = np.empty((4, 64), np.float32)  # the sub-block's A, B, sc, mn per lane, as f32 (exact conversions)
    for s in range(n):
        unpack(q, g, s, S, vals, quarter)
        row_sums(vals, xv, s, blk)
        sb = s // per
        for r in range(64):
            lane[0, r] = _scale_at(a, g, sb, r)
        if b.shape[0] > 0:
            for r in range(64):
                lane[1, r] = _scale_at(b, g, sb, r)
        if sc.shape[0] > 0:
            for r in range(64):
                lane[2, r] = np.float32(np.int32(sc[g, s, r]))
        if mn.shape[0] > 0:
            for r in range(64):
                lane[3, r] = np.float32(np.int32(mn[g, s, r]))
        for t in range(B):
            sm = sums[t, s]  # `_terms` of exact numerics: (zo * sum, 1, sum)
            corr, sa = np.float32(zo) * sm, np.float32(1.0)
            if sc.shape[0] > 0:
                for r in range(64):
                    acc[t, r] += (lane[0, r] * lane[2, r] * sa) * (blk[t, r] + corr)
            else:
                for r in range(64):
                    acc[t, r] += (lane[0, r] * sa) * (blk[t, r] + corr)
            if b.shape[0] > 0:
                if mn.shape[0] > 0:
                    for r in range(64):
                        acc[t, r] += lane[1, r] * lane[3, r] * sm
                else:
                    for r in range(64):
                        acc[t, r] += lane[1, r] * sm
    for t in range(B):
        for r in range(64):
            out[t, g * 64 + r] = acc[t, r]


# Separate kernels per family and style, as in `matvec`: LLVM optimizes each loop nest on its own.
@jit(parallel=True, fast=True)
def _rows_nib_super(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _rows_super(_unpack_nib, q, a, b, sc, mn, per, zo, xv, sums, g, out, 0)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _rows_nib6_super(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _rows_super(_unpack_nib6, q, a, b, sc, mn, per, zo, xv, sums, g, out, q.shape[3] // 3)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _rows_i8_super(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _rows_super(_unpack_i8, q, a, b, sc, mn, per, zo, xv, sums, g, out, 0)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _rows_nib(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _rows(_unpack_nib, q, a, b, sc, mn, per, zo, xv, sums, g, out, 0)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _rows_nib6(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _rows(_unpack_nib6, q, a, b, sc, mn, per, zo, xv, sums, g, out, q.shape[3] // 3)
    use_threads(previous)


@jit(parallel=True, fast=True)
def _rows_i8(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    for g in prange(q.shape[0]):
        _rows(_unpack_i8, q, a, b, sc, mn, per, zo, xv, sums, g, out, 0)
    use_threads(previous)


# (storage family, sub-block scales?) -> batched row kernel; `row_kernel` picks one for a weight's arguments
_ROWS = {
    ("nib", True): _rows_nib_super,
    ("nib6", True): _rows_nib6_super,
    ("i8", True): _rows_i8_super,
    ("nib", False): _rows_nib,
    ("nib6", False): _rows_nib6,
    ("i8", False): _rows_i8,
}


def row_kernel(family: str, args: tuple):
    """The batched row kernel for a weight of storage `family` with `matvec.plan` arguments
    (q, a, b, sc, mn, per, zo), or None for a family without one."""
    sc, mn = args[3], args[4]
    return _ROWS.get((family, sc.shape[0] > 0 or mn.shape[0] > 0))


def matvec_rows(p: Packed, xv: np.ndarray, terms: np.ndarray | None, planned=None, threads: int = 0) -> np.ndarray:
    """y (B, G*64): each of the B rows of xv times the packed weight exactly as `matvec` computes a single row.

    `terms=None` means exact numerics (xv = x), as in `matvec`; otherwise `activations.prepare` made xv and terms
    row by row. Rows past `p.rows` (padding of the last group) are 0."""
    xv = np.ascontiguousarray(xv, dtype=np.float32)
    out = np.empty((xv.shape[0], p.groups * GROUP), np.float32)
    if p.family == "blocks":  # rawblocks computes every row with the same loop: bit-identical to one row alone
        return rawblocks.matvec(p.type, p.q, xv, terms, out, threads or get_threads())
    if terms is not None:  # quantized activations: each row through the single-row kernel itself
        for t in range(len(xv)):
            matvec(p, xv[t : t + 1], np.ascontiguousarray(terms[:, t : t + 1]), out[t : t + 1], planned, threads)
        return out
    _, args = planned or plan(p)
    q = args[0]  # (G, n, S, .): n sub-blocks of S columns
    sums = np.empty((xv.shape[0], q.shape[1]), np.float32)
    _sub_sums(xv, q.shape[2], sums)
    row_kernel(p.family, args)(threads or get_threads(), *args, xv, sums, out)
    return out


INT8_ROWS = 3  # rows per integer-kernel call in `linears_rows`: below ggml's repacked gemm (4) and tiled (8) forms


def linears_rows(backend, x: np.ndarray, ws: tuple) -> list[np.ndarray]:
    """`NumbaBackend.linears(x, ws)` for B rows of independent sequences: row b of each result is bit for bit
    `backend.linears(x[b:b+1], ws)`, whatever the other rows. Uses the same stacked weights as `linears` (a
    stack's groups are computed independently, so a stacked product equals the separate ones). Float weights
    go row by row through `linear`, quantized activations (`llamacpp` numerics) too, in chunks of `INT8_ROWS`
    rows where every weight has an integer kernel."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if backend.numerics.quantize_activations:
        # ggml's integer kernels switch to their gemm (repacked, from 4 rows) or tiled (from 8) forms by the row
        # count (`quants.x86.kernel_for`); up to INT8_ROWS rows each row takes the one-row kernel, bit for bit its
        # product alone, and a chunk reads each weight once instead of once per row
        step = INT8_ROWS if all(backend.int8_weight(w) is not None for w in ws) else 1
        return [
            np.concatenate(rows)
            for rows in zip(*(backend.linears(x[b : b + step], ws) for b in range(0, len(x), step)), strict=True)
        ]
    groups = backend._stacks.get(ws)
    if groups is None:
        groups = backend._stacks[ws] = backend._stack_groups(ws)
    out: list[np.ndarray | None] = [None] * len(ws)
    for members, stack in groups:
        w = ws[members[0]]
        if x.ndim != 2 or x.shape[1] != w.shape[-1]:
            raise ValueError(f"{w.name}: activations of shape {x.shape} do not fit a weight of shape {w.shape}")
        if stack is None:
            (i,) = members
            if w.type in FLOAT_TYPES:
                out[i] = np.concatenate([backend.linear(x[b : b + 1], w) for b in range(len(x))])
                continue
            p = backend.packed(w)
            planned = backend._plans.get(w)
            if planned is None:
                planned = backend._plans[w] = plan(p)
            out[i] = _product(backend, x, p, planned)[:, : p.rows]
            continue
        p, planned, spans = stack
        y = _product(backend, x, p, planned)  # (B, G*64) over the stacked groups
        for i, (lo, rows) in zip(members, spans, strict=True):
            out[i] = y[:, lo : lo + rows]
    return out


def _product(backend, x: np.ndarray, p: Packed, planned) -> np.ndarray:
    return matvec_rows(p, x, None, planned, threads=backend._threads_for(x.shape[0] * p.rows * p.cols))


def attention_rows(backend, q: np.ndarray, kv: list, scale: float, window=None, softcap=None) -> np.ndarray | None:
    """`NumbaBackend.attention` of B sequences' last rows (q (B, H, E), kv[b] their keys and values) in one
    compiled call: row b bit for bit `backend.attention(q[b:b+1], *kv[b], S_b - 1, scale, ...)`. None where
    that call would not run the numba kernel (the numerics' own attention, e.g. llamacpp's f16 roundings)."""
    if backend.numerics.attention is not ops.attention:
        return None
    macs = q.shape[1] * q.shape[2] * sum(len(k) for k, _ in kv)
    threads = backend._threads_for(macs)
    keys = values = [None]
    if not DISABLED:  # `attention.attention_rows`'s call, with the addresses read through numba
        keys, values = [_address(k) for k, _ in kv], [_address(v) for _, v in kv]
    if None in keys or None in values:
        return _attention_rows(q, kv, scale, window, softcap, threads=threads)
    B, H, E = q.shape
    out = np.empty((B, H, E), np.float32)
    lengths = np.array([len(k) for k, _ in kv], np.int64)
    q = np.ascontiguousarray(q, np.float32)
    rest = (kv[0][0].shape[1], np.float32(scale), int(window or 0), np.float32(softcap or 0.0), out)
    _attention_rows_kernel(threads, q, np.array(keys, np.int64), np.array(values, np.int64), lengths, *rest)
    return out.reshape(B, H * E)


@jit
def _data(a):
    return a.ctypes.data


def _address(view: np.ndarray) -> int | None:
    """The data address of `view`, a cache's first rows (`KVCache.update`'s k[layer][:end]), through numba: NumPy's
    `.ctypes.data` costs microseconds, and a step asks for two per row and layer. None for anything but a
    C-contiguous f32 array (the caller then takes `attention.attention_rows`, which copies what it must)."""
    if view.dtype != np.float32 or not view.flags.c_contiguous:
        return None
    return _data(view)
