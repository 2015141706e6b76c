"""Batched decode products: B activation rows of B independent sequences times one packed weight.

`matvec_rows(p, xv, terms)` gives, for each row t, bit for bit the result of `matvec` on that row alone
(T == 1), whatever the other rows are: each row's sums take the single-row kernels' operations in their order
(`_nib_row`; `_row` with the `*_dot1` inner products and `_accumulate_direct`), with the loops turned inside out:

    _sub_sums                          # each row's sum over each sub-block of x, once (not once per group)
    for u in prange(groups * 4):       # one task per unit: a group of 64 weight rows, 16 of its lanes
        unit_rows                      # every row's lanes of the unit, sub-block by sub-block (batched_ir.py)

so each weight byte comes from memory once per step for all B rows and is widened to f32 in registers once per
tile of 4 rows (2 below 4 rows, over 32 lanes); the sums and the scale step stay in registers. The sub-block
sums of x (exact numerics' `_terms`: a chain of S dependent adds, which the single-row kernel repeats for every
group and which cost about as much as the multiply-adds) are summed once per call in the same order. Units of
16 lanes (not whole groups) let two threads share small matrices evenly: a row's operations do not depend on
the unit. `attention_rows`: every row's attention of a decode step in one compiled call. `matvec`'s own T > 1
path takes rows two at a time with another summation (and the last row of an odd T alone), so its rows depend on
their neighbours: the batched decode of `Model.decode_batch` must not use it.

The arithmetic is `unit_rows`'s IR with explicit flags (`contract` exactly where the single-row kernels fuse a
multiply-add), so it computes the same whether it was compiled in this process or loaded from numba's cache
(tests/test_server_batch_cache.py); the kernels here have no `fast` flag, which numba would add to that IR.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from . import rawblocks
from ._numba import DISABLED, get_threads, jit, prange, use_threads
from .attention import _attention_rows as _attention_rows_kernel
from .attention import attention_rows as _attention_rows
from .batched_ir import UNITS, WIDE_BELOW, unit_rows
from .layout import FLOAT_TYPES, GROUP, Packed
from .matvec import matvec, plan

__all__ = ["attention_rows", "linears_rows", "matvec_rows", "row_kernel"]


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


# One kernel per family and style (`batched_ir.unit_rows`); the parallel loop runs over units of 16 lanes
# (32 below WIDE_BELOW rows), so two threads split even small matrices evenly. No `fast` flag here: numba would
# add it to every float operation of the intrinsic's IR, which sets its own (see batched_ir.py).
_NIB, _NIB_SUPER = unit_rows["nib", False], unit_rows["nib", True]
_NIB6, _NIB6_SUPER = unit_rows["nib6", False], unit_rows["nib6", True]
_I8, _I8_SUPER = unit_rows["i8", False], unit_rows["i8", True]


@jit(inline=True)
def _units(xv):
    """(wide, units per group) for B = xv.shape[0] rows."""
    wide = np.int64(1) if xv.shape[0] < WIDE_BELOW else np.int64(0)
    return wide, UNITS // 2 if wide else UNITS


@jit(parallel=True)
def _rows_nib(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    wide, units = _units(xv)
    for u in prange(q.shape[0] * units):
        _NIB(q, a, b, sc, mn, per, np.float32(zo), xv, sums, u, wide, out)
    use_threads(previous)


@jit(parallel=True)
def _rows_nib_super(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    wide, units = _units(xv)
    for u in prange(q.shape[0] * units):
        _NIB_SUPER(q, a, b, sc, mn, per, np.float32(zo), xv, sums, u, wide, out)
    use_threads(previous)


@jit(parallel=True)
def _rows_nib6(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    wide, units = _units(xv)
    for u in prange(q.shape[0] * units):
        _NIB6(q, a, b, sc, mn, per, np.float32(zo), xv, sums, u, wide, out)
    use_threads(previous)


@jit(parallel=True)
def _rows_nib6_super(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    wide, units = _units(xv)
    for u in prange(q.shape[0] * units):
        _NIB6_SUPER(q, a, b, sc, mn, per, np.float32(zo), xv, sums, u, wide, out)
    use_threads(previous)


@jit(parallel=True)
def _rows_i8(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    wide, units = _units(xv)
    for u in prange(q.shape[0] * units):
        _I8(q, a, b, sc, mn, per, np.float32(zo), xv, sums, u, wide, out)
    use_threads(previous)


@jit(parallel=True)
def _rows_i8_super(nt, q, a, b, sc, mn, per, zo, xv, sums, out):
    previous = use_threads(nt)
    wide, units = _units(xv)
    for u in prange(q.shape[0] * units):
        _I8_SUPER(q, a, b, sc, mn, per, np.float32(zo), xv, sums, u, wide, out)
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


def _int8_rows(backend, x: np.ndarray, ws: tuple) -> list[np.ndarray]:
    """`linears_rows` over integer-kernel weights (llamacpp numerics): each activation format quantized once for
    all rows (a row's quantization is its own), then `int8rows.product_rows` (every row its one-row kernel's)."""
    from .int8dot import quantize
    from .int8rows import product_rows

    quantized: dict[str, object] = {}
    out = []
    for w in ws:
        iw = backend.int8_weight(w)
        if x.shape[1] != iw.cols:
            raise ValueError(f"{w.name}: activations of shape {x.shape} do not fit a weight of shape {w.shape}")
        a = quantized.get(iw.fmt)
        if a is None:
            a = quantized[iw.fmt] = quantize(x, iw.fmt)
        out.append(product_rows(a, iw, backend._threads_for(x.shape[0] * iw.rows * iw.cols)))
    return out


def linears_rows(backend, x: np.ndarray, ws: tuple) -> list[np.ndarray]:
    """`NumbaBackend.linears(x, ws)` for B rows of independent sequences: row b of each result is bit for bit
    `backend.linears(x[b:b+1], ws)`, whatever the other rows. Uses the same stacked weights as `linears` (a
    stack's groups are computed independently, so a stacked product equals the separate ones). Float weights
    go row by row through `linear`. Quantized activations (`llamacpp` numerics) take `int8rows.product_rows`
    where every weight has an integer kernel (each row its one-row kernel's steps), else go row by row."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if backend.numerics.quantize_activations:
        if all(backend.int8_weight(w) is not None for w in ws):  # each row through its one-row kernel's steps
            return _int8_rows(backend, x, ws)
        alone = (backend.linears(x[b : b + 1], ws) for b in range(len(x)))  # the f32 kernels' T > 1 paths pair rows
        return [np.concatenate(rows) for rows in zip(*alone, strict=True)]
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
