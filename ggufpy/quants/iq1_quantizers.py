"""IQ1_S and IQ1_M quantizers, byte-identical to ggml's `quantize_row_iq1_s_impl` / `quantize_row_iq1_m_impl`.

A sub-block (32 values for IQ1_S, 16 for IQ1_M) takes three values, scale * (-1, 0, 1) + delta with a shift
delta = +-1/8 (IQ1_M: one shift per 8 values). ggml (llama.cpp `ggml/src/ggml-quants.c`) solves the weighted
fit exactly: sort the values (glibc's qsort is a stable merge sort for these sizes), and for every split
(i1 <= i2) of the sorted order into the three levels and every shift compute the least-squares scale from
prefix sums, keeping the best in C's candidate order. Groups of 8 levels that are not on the 2048-row grid
take their nearest neighbour (`iqgrid_tables`), then the scale is refitted. IQ1_M refits its super-block
scale over all 256 values at the end.

Candidates are scored for all sub-blocks at once and scanned in order (`_scan`): "keep the better" compares
rounded f32 products, so only a scan in C's order is sure to keep the same one. Weights: qw * sqrtf(sigma2 +
x^2) with an importance matrix, else x^2 (IQ1_M only: IQ1_S requires one).
"""

from __future__ import annotations

import numpy as np

from .fields import as_bytes
from .iqgrid_tables import GridTables, best_neighbours, check_finite, grid_tables, require_imatrix
from .kquantizer_search import nearest_int, seqsum
from .kquantizers import fp16

__all__ = ["quantize_iq1_m", "quantize_iq1_s"]

F32 = np.float32
QK_K = 256
FLT_MAX = np.finfo(F32).max
DELTA = F32(0.125)  # IQ1S_DELTA = IQ1M_DELTA, ggml-common.h
X_P = np.array([-1 + DELTA, DELTA, 1 + DELTA], F32)  # the three values with shift +delta
X_M = np.array([-1 - DELTA, -DELTA, 1 - DELTA], F32)


def _weights(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """qw * sqrtf(sigma2 + x^2), sigma2 = 2 * sum(x^2) / QK_K per super-block, or x^2: f32[n, 256]."""
    if qw is None:
        return x * x
    sigma2 = F32(2) * seqsum(x * x) / F32(QK_K)
    return qw * np.sqrt(sigma2[:, None] + x * x)


def _splits(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(i1, i2) for i1 in 0..n, i2 in i1..n, in C's loop order."""
    i1, i2 = np.triu_indices(n + 1)
    return i1, i2


def _scan(qx: np.ndarray, q2: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`if (q2 > 0 && qx*qx > best*q2) { scale = qx/q2; best = scale*qx; }` over candidates f32[m, c] in
    order, from best = -FLT_MAX: (scale f32[m], index of the kept candidate i64[m], -1 if none)."""
    best = np.full(len(qx), -FLT_MAX, F32)
    kept = np.full(len(qx), -1, np.int64)
    qx, q2 = np.ascontiguousarray(qx.T), np.ascontiguousarray(q2.T)  # [c, m]: one contiguous row per candidate
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for c in range(len(qx)):
            a, b = qx[c], q2[c]
            take = (b > 0) & (a * a > best * b)
            if take.any():
                scale = np.where(take, a / b, scale).astype(F32)
                best = np.where(take, scale * a, best).astype(F32)
                kept = np.where(take, c, kept)
    return scale, kept


def _levels(order: np.ndarray, i1: np.ndarray, i2: np.ndarray) -> np.ndarray:
    """Level 0 for the i1 smallest values, 1 up to i2, 2 above: i8[m, n] in the original element order."""
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1]), axis=1)
    return ((rank >= i1[:, None]).astype(np.int8) + (rank >= i2[:, None])).astype(np.int8)


def _on_grid(t: GridTables, L, xb, w, scale, xx) -> tuple[np.ndarray, np.ndarray]:
    """Grid rows of each group of 8 levels, off-grid groups replaced by `iq1_find_best_neighbour2`'s pick
    (least sum w * (scale * xx[l] - x)^2): L i8[m, n], xx f32[m, groups, 3] -> (rows i64[m, groups], all on)."""
    m, n = L.shape
    G = L.reshape(m, n // 8, 8)
    codes = t.codes(G)
    rows = t.kmap[codes].astype(np.int64)
    off = rows < 0
    if off.any():
        r, _ = np.nonzero(off)
        with np.errstate(over="ignore", invalid="ignore"):
            rows[off] = best_neighbours(
                t, codes[off], xb.reshape(m, -1, 8)[off], w.reshape(m, -1, 8)[off], scale[r], xx[off]
            )
    return rows, ~off.any(axis=1)


def _refit(t: GridTables, rows, xb, w, xx, scale, redo) -> np.ndarray:
    """`sumqx += w*q*x; sumq2 += w*q*q` over the sub-block with q = xx[grid level]; scale = sumqx / sumq2
    where `redo` and both sums are positive."""
    m = len(rows)
    q = np.take_along_axis(xx, t.levels[rows].astype(np.int64), axis=2).reshape(m, 8 * rows.shape[1])
    wq = w * q
    sumqx, sumq2 = seqsum(wq * xb), seqsum(wq * q)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(redo & (sumqx > 0) & (sumq2 > 0), sumqx / sumq2, scale).astype(F32)


def _prefix(v: np.ndarray) -> np.ndarray:
    """sum[0] = 0, sum[j+1] = sum[j] + v[j], in f32 in order: f32[m, n] -> f32[m, n + 1]."""
    return np.concatenate([np.zeros((len(v), 1), F32), np.cumsum(v, axis=1, dtype=F32)], axis=1)


def quantize_iq1_s(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """`quantize_iq1_s`: f32[n, 256], qw f32[n, 256] (required) -> u8[n, 50]."""
    require_imatrix(qw, "IQ1_S")
    check_finite(x, "IQ1_S")
    t = grid_tables("IQ1_S")
    n = x.shape[0]
    m = n * 8
    w = _weights(x, qw).reshape(m, 32)
    xb = x.reshape(m, 32)
    peak = np.abs(xb).max(axis=1)
    a = np.flatnonzero(peak >= F32(1e-12))  # GROUP_MAX_EPS_IQ1_S
    scale = np.zeros(m, F32)
    shift = np.ones(m, np.int64)
    rows = np.zeros((m, 4), np.int64)
    done = np.zeros(m, bool)
    if a.size:
        xa, wa = xb[a], w[a]
        order = np.argsort(xa, axis=1, kind="stable")
        sumx = _prefix(np.take_along_axis(wa * xa, order, axis=1))
        sumw = _prefix(np.take_along_axis(wa, order, axis=1))
        i1, i2 = _splits(32)
        qx, q2 = [], []
        for v in (X_P, X_M):  # sumqx = (S[i1]-S[0])*v0 + (S[i2]-S[i1])*v1 + (S[32]-S[i2])*v2; sumq2 alike
            lo, mid, hi = sumx[:, i1] - sumx[:, :1], sumx[:, i2] - sumx[:, i1], sumx[:, 32:] - sumx[:, i2]
            qx.append(lo * v[0] + mid * v[1] + hi * v[2])
            lo, mid, hi = sumw[:, i1] - sumw[:, :1], sumw[:, i2] - sumw[:, i1], sumw[:, 32:] - sumw[:, i2]
            q2.append(lo * v[0] * v[0] + mid * v[1] * v[1] + hi * v[2] * v[2])
        # candidates in C's order: for each split, shift +delta then -delta
        sa, kept = _scan(np.stack(qx, 2).reshape(len(a), -1), np.stack(q2, 2).reshape(len(a), -1), peak[a])
        ok = kept >= 0
        a, sa, kept, xa, wa, order = a[ok], sa[ok], kept[ok], xa[ok], wa[ok], order[ok]
        L = _levels(order, i1[kept // 2], i2[kept // 2])
        sh = np.where(kept % 2 == 0, 1, -1)
        neg = sa < 0
        L = np.where(neg[:, None], 2 - L, L).astype(np.int8)
        sa, sh = np.where(neg, -sa, sa).astype(F32), np.where(neg, -sh, sh)
        xx = np.where((sh == 1)[:, None, None], X_P, X_M) * np.ones((1, 4, 1), F32)  # [m, group, 3]
        r, on = _on_grid(t, L, xa, wa, sa, xx)
        scale[a] = _refit(t, r, xa, wa, xx, sa, ~on)
        shift[a], rows[a], done[a] = sh, r, True
    scale = scale.reshape(n, 8)
    max_scale = scale.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = max_scale / F32(15)
        idl = F32(1) / d
        ls = np.clip(nearest_int(F32(0.5) * (idl[:, None] * scale - F32(1))), 0, 7)
    ls = ls | np.where(shift.reshape(n, 8) == -1, 8, 0)
    nz = max_scale > 0
    dh = np.where(nz, fp16(d * F32(1.125)), np.float16(0))
    rows = rows.reshape(n, 8, 4)
    qh = ((rows >> 8) << (3 * np.arange(4))).sum(axis=2) | np.where(nz[:, None], ls << 12, 0)
    return as_bytes(dh, (rows & 255).astype(np.uint8).reshape(n, 32), qh.astype("<u2"))


_MASKS = np.array([0x00, 0x80, 0x08, 0x88], np.int64)  # qh delta bits per best_k (bit 3: group 0, bit 7: 1)


def _iq1m_values(k: np.ndarray) -> np.ndarray:
    """The values each group of 8 uses for combination k (0: ++, 1: +-, 2: -+, 3: --): f32[m, 2, 3]."""
    first = np.where((k < 2)[:, None], X_P, X_M)
    second = np.where((k % 2 == 0)[:, None], X_P, X_M)
    return np.stack([first, second], axis=1)


def quantize_iq1_m(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """`quantize_iq1_m`: f32[n, 256], qw f32[n, 256] or None -> u8[n, 56]."""
    check_finite(x, "IQ1_M")
    t = grid_tables("IQ1_M")
    n = x.shape[0]
    m = n * 16
    w = _weights(x, qw).reshape(m, 16)
    xb = x.reshape(m, 16)
    peak = np.abs(xb).max(axis=1)
    a = np.flatnonzero(peak >= F32(1e-7))  # GROUP_MAX_EPS_IQ1_M
    scale = np.zeros(m, F32)
    shift = np.zeros(m, np.int64)
    rows = np.zeros((m, 2), np.int64)
    if a.size:
        xa, wa = xb[a], w[a]
        order = np.argsort(xa, axis=1, kind="stable")
        half = (order >= 8)[:, None, :] == np.array([False, True])[None, :, None]  # [m, h, j]
        wx = np.take_along_axis(wa * xa, order, axis=1)[:, None, :]
        ws = np.take_along_axis(wa, order, axis=1)[:, None, :]
        zero = np.zeros((len(a), 2, 1), F32)
        # prefix sums per half; adding +0.0 for the other half's elements leaves a sum unchanged
        px = np.concatenate([zero, np.cumsum(np.where(half, wx, F32(0)), axis=2, dtype=F32)], axis=2)
        pw = np.concatenate([zero, np.cumsum(np.where(half, ws, F32(0)), axis=2, dtype=F32)], axis=2)
        txs, tws = px[:, :, 16:], pw[:, :, 16:]  # [m, h, 1]
        p2, m2 = X_P[2], X_M[2]
        cp1, cp2 = X_P[0] * X_P[0] - X_P[1] * X_P[1], X_P[1] * X_P[1] - X_P[2] * X_P[2]
        cm1, cm2 = X_M[0] * X_M[0] - X_M[1] * X_M[1], X_M[1] * X_M[1] - X_M[2] * X_M[2]
        i1, i2 = _splits(16)
        sx = px[:, :, i1] + px[:, :, i2]  # [m, h, pair]
        qx_p, qx_m = txs * p2 - sx, txs * m2 - sx
        q2_p = tws * p2 * p2 + pw[:, :, i1] * cp1 + pw[:, :, i2] * cp2
        q2_m = tws * m2 * m2 + pw[:, :, i1] * cm1 + pw[:, :, i2] * cm2
        qx = np.stack(
            [qx_p[:, 0] + qx_p[:, 1], qx_p[:, 0] + qx_m[:, 1], qx_m[:, 0] + qx_p[:, 1], qx_m[:, 0] + qx_m[:, 1]], 2
        )
        q2 = np.stack(
            [q2_p[:, 0] + q2_p[:, 1], q2_p[:, 0] + q2_m[:, 1], q2_m[:, 0] + q2_p[:, 1], q2_m[:, 0] + q2_m[:, 1]], 2
        )
        sa, kept = _scan(qx.reshape(len(a), -1), q2.reshape(len(a), -1), peak[a])
        ok = kept >= 0
        a, sa, kept, xa, wa, order = a[ok], sa[ok], kept[ok], xa[ok], wa[ok], order[ok]
        L = _levels(order, i1[kept // 4], i2[kept // 4])
        k = kept % 4
        neg = sa < 0
        L = np.where(neg[:, None], 2 - L, L).astype(np.int8)
        sa, k = np.where(neg, -sa, sa).astype(F32), np.where(neg, 3 - k, k)
        xx = _iq1m_values(k)
        r, on = _on_grid(t, L, xa, wa, sa, xx)
        scale[a] = _refit(t, r, xa, wa, xx, sa, ~on)
        shift[a], rows[a] = k, r
    scale, shift, rows = scale.reshape(n, 16), shift.reshape(n, 16), rows.reshape(n, 16, 2)
    max_scale = scale.max(axis=1)
    nz = max_scale > 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = max_scale / F32(15)
        idl = F32(1) / d
        ls = np.clip(nearest_int(F32(0.5) * (idl[:, None] * scale - F32(1))), 0, 7)  # [n, 16]
        # the super-block scale refitted over all 256 values with the stored levels and sub-block scales
        xx = _iq1m_values(shift.reshape(-1)).reshape(n, 16, 2, 3)
        q = np.take_along_axis(xx, t.levels[rows].astype(np.int64), axis=3)  # [n, ib, k, 8]
        q = (q * (2 * ls.astype(F32) + F32(1))[:, :, None, None]).reshape(n, 256)
        wq = _weights(x, qw) * q
        sumqx, sumq2 = seqsum(wq * x), seqsum(wq * q)
        d = np.where(sumq2 > 0, sumqx / sumq2, d).astype(F32)
    dbits = fp16(d * F32(1.1125)).view(np.uint16).astype(np.int64)
    ls = np.where(nz[:, None], ls, 0)
    sc = (ls.reshape(n, 4, 4) << (3 * np.arange(4))).sum(axis=2)  # [n, 4]: scales of sub-blocks 4i..4i+3
    sc |= np.where(nz[:, None], ((dbits[:, None] >> (4 * np.arange(4))) & 0xF) << 12, 0)
    qh = (rows >> 8)[:, :, 0] | ((rows >> 8)[:, :, 1] << 4) | np.where(nz[:, None], _MASKS[shift], 0)
    return as_bytes((rows & 255).astype(np.uint8).reshape(n, 32), qh.astype(np.uint8), sc.astype("<u2"))
