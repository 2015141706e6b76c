"""IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S quantizers, byte-identical to ggml's `quantize_row_iq*_impl`.

All five share one search (llama.cpp `ggml/src/ggml-quants.c`), per sub-block of 16 or 32 values with one
scale: take |x| (the signs are stored apart; with 7-bit signs an odd count of minus signs moves to the element
of least weight * x^2), then for each trial id = (2 kMaxQ - 1 + is * step) / max round every value to a level
l = nearest_int((id x - 1) / 2), look the group of 8 (IQ2) or 4 (IQ3) levels up on the grid and, off the grid,
take the neighbour (`iqgrid_tables`) nearest to x / id; keep the trial whose levels fit x best by weighted least
squares, re-pick the groups that fell off the grid at the fitted scale, refit. The block scale is
max(scale) / 31 and each sub-block stores a 4-bit multiple of it.

The search runs on all sub-blocks of all rows at once; every sum is accumulated in C's element order, in f32
(`seqsum`), so the choices round exactly as the compiled library's. Weights are x^2 or, with an importance
matrix, qw * sqrtf(sigma2 + x^2); IQ2_XXS and IQ2_XS have no path without one (ggml asserts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import GGMLType
from . import iq1_quantizers as iq1
from .fields import as_bytes
from .iqgrid_tables import GridTables, best_neighbours, check_finite, grid_tables, require_imatrix
from .kquantizer_search import make_qp_quants, nearest_int, seqsum
from .kquantizers import fp16

__all__ = [
    "IQGRID_ROW_QUANTIZERS",
    "REQUIRES_IMATRIX",
    "quantize_iq2_s",
    "quantize_iq2_xs",
    "quantize_iq2_xxs",
    "quantize_iq3_s",
    "quantize_iq3_xxs",
    "quantize_row_iq2_s_ref",
    "quantize_row_iq3_s_ref",
    "quantize_row_iq3_xxs_ref",
]

F32 = np.float32
QK_K = 256
_ODD = 2 * np.arange(8, dtype=F32) + 1  # the quantizer's value of level l: q = 2l + 1


@dataclass(frozen=True)
class SearchSpec:
    """What differs between the five `quantize_row_*_impl` searches."""

    name: str
    sub: int  # values per sub-block (one scale)
    kmaxq: int  # levels 0..kmaxq-1 from rounding (the grid may hold higher ones)
    steps: int  # trials is = -steps..steps
    step: float  # id = (2 kmaxq - 1 + is * step) / max
    sigma: int  # sigma2 = sigma * sum(x^2) / QK_K over the super-block
    eps: float  # a sub-block whose largest |x| is below this is all zero (0: exactly zero)
    parity: bool  # 7 sign bits per 8 values, the 8th implied by an even count
    refine: str  # after the trials re-pick: "all" groups, the "off"-grid ones, or "any": all if one is off
    fudge: float  # the stored d is max_scale / 31 * fudge
    imatrix_only: bool = False


IQ2_XXS = SearchSpec("IQ2_XXS", 32, 3, 6, 0.1, 1, 1e-15, True, "all", 1.0, imatrix_only=True)
IQ2_XS = SearchSpec("IQ2_XS", 16, 3, 9, 0.1, 1, 1e-15, True, "off", 1.0, imatrix_only=True)
IQ2_S = SearchSpec("IQ2_S", 16, 3, 9, 0.1, 2, 1e-8, False, "off", 0.9875)
IQ3_XXS = SearchSpec("IQ3_XXS", 32, 8, 15, 0.2, 2, 1e-8, True, "off", 1.0125)
IQ3_S = SearchSpec("IQ3_S", 32, 8, 9, 0.2, 2, 0.0, False, "any", 1.033)


def _weights(spec: SearchSpec, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """f32[n, 256] super-blocks -> the per-value weights ggml fits with."""
    sumx2 = seqsum(x * x)
    sigma2 = (F32(spec.sigma) * sumx2 / F32(QK_K))[:, None]  # 1 * s is s: one expression for both
    if qw is not None:
        return qw * np.sqrt(sigma2 + x * x)
    if spec.name == "IQ2_S":
        return F32(0.25) * sigma2 + x * x
    return x * x


def _signs(x: np.ndarray, w: np.ndarray, parity: bool) -> tuple[np.ndarray, np.ndarray]:
    """(xval f32[n, 8k], sign bytes u8[n, k]): |x| per group of 8 with bit i set for a negative x; with parity
    an odd count flips the value of least w * x^2 back (its xval negative, its bit cleared), 7 bits kept."""
    n = x.shape[0]
    neg = ~(x >= 0)
    xval = np.where(neg, -x, x)
    g = neg.reshape(n, -1, 8)
    if parity:
        odd = g.sum(axis=2) % 2 == 1
        imin = np.argmin((w * x * x).reshape(n, -1, 8), axis=2)  # first of the smallest (C's strict <)
        flip = odd[:, :, None] & (np.arange(8) == imin[:, :, None])
        g = g ^ flip
        xval = np.where(flip.reshape(n, -1), -xval, xval)
    s = np.packbits(g, axis=2, bitorder="little")[:, :, 0]
    return xval, (s & 127) if parity else s


def _pick(t: GridTables, xval, waux, idv, nscale, kmaxq: int) -> tuple[np.ndarray, np.ndarray]:
    """Levels for id `idv` f32[m]: rounded, groups off the grid replaced by their best neighbour at scale
    `nscale` f32[m] (`iq2_find_best_neighbour`). -> (levels i8[m, n], on the grid before that bool[m, groups])."""
    m, n = xval.shape
    w = t.width
    with np.errstate(invalid="ignore", over="ignore"):
        l = np.clip(nearest_int(F32(0.5) * (idv[:, None] * xval - F32(1))), 0, kmaxq - 1).astype(np.int8)
    L = l.reshape(m, n // w, w)
    codes = t.codes(L)
    rows = t.kmap[codes].astype(np.int64)
    off = rows < 0
    if off.any():
        r, _ = np.nonzero(off)
        with np.errstate(invalid="ignore", over="ignore"):
            rows[off] = best_neighbours(
                t, codes[off], xval.reshape(m, -1, w)[off], waux.reshape(m, -1, w)[off], nscale[r], _ODD
            )
        L[off] = t.levels[rows[off]]
    return l, ~off


def _fit(w, xval, L) -> tuple[np.ndarray, np.ndarray]:
    """`sumqx += w*xval[i]*q; sumq2 += w*q*q` with q = 2 L + 1."""
    q = 2 * L.astype(F32) + F32(1)
    return seqsum(w * xval * q), seqsum(w * q * q)


def _search(spec: SearchSpec, t: GridTables, xval, w, scale, id_base):
    """The trials and the re-pick for active sub-blocks f32[m, sub]: (scale f32[m], levels i8[m, sub])."""
    m = xval.shape[0]
    waux = np.sqrt(w)
    best = np.zeros(m, F32)
    L = np.zeros(xval.shape, np.int8)
    on = np.full((m, xval.shape[1] // t.width), spec.refine != "any")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for i in range(-spec.steps, spec.steps + 1):
            idv = (F32(2 * spec.kmaxq - 1) + F32(i) * F32(spec.step)) / id_base
            laux, on_aux = _pick(t, xval, waux, idv, F32(1) / idv, spec.kmaxq)
            sumqx, sumq2 = _fit(w, xval, laux)
            take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = np.where(take, sumqx / sumq2, scale).astype(F32)
            best = np.where(take, scale * sumqx, best).astype(F32)
            L = np.where(take[:, None], laux, L)
            on = np.where(take[:, None], on_aux, on)
        redo = scale > 0 if spec.refine == "all" else (~on).any(axis=1) & (scale > 0)
        r = np.flatnonzero(redo)
        if r.size:
            lr, _ = _pick(t, xval[r], waux[r], F32(1) / scale[r], scale[r], spec.kmaxq)
            if spec.refine == "off":  # on-grid groups keep the levels of the best trial
                keep = np.repeat(on[r], t.width, axis=1)
                lr = np.where(keep, L[r], lr)
            L[r] = lr
            sumqx, sumq2 = _fit(w[r], xval[r], lr)
            scale[r] = np.where(sumq2 > 0, sumqx / sumq2, scale[r])
    return scale, L


def _quantize(spec: SearchSpec, x: np.ndarray, qw: np.ndarray | None):
    """Super-blocks f32[n, 256] -> (d f16[n], scale nibbles u32[n, S], grid rows i64[n, S, groups],
    sign bytes u8[n, S, sub / 8], sub-block quantized bool[n, S], block not all zero bool[n]) for
    S = 256 / sub sub-blocks. Skipped sub-blocks keep rows and signs 0, as ggml leaves them."""
    if spec.imatrix_only:
        require_imatrix(qw, spec.name)
    check_finite(x, spec.name)
    t = grid_tables(spec.name)
    n = x.shape[0]
    S = QK_K // spec.sub
    w = _weights(spec, x, qw)
    xval, signs = _signs(x, w, spec.parity)
    xs, ws = xval.reshape(n * S, spec.sub), w.reshape(n * S, spec.sub)
    peak = xs.max(axis=1)
    active = peak >= F32(spec.eps) if spec.eps else peak != 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if spec.name == "IQ2_XXS":  # the trials start from make_qp_quants' scale, not max / 5
            qp, _ = make_qp_quants(xs, spec.kmaxq + 1, ws)
            id_base = qp * F32(spec.kmaxq)
            active &= id_base > 0
            scale0 = qp
        else:
            id_base = peak
            scale0 = peak / F32(2 * spec.kmaxq - 1)
    a = np.flatnonzero(active)
    scale = np.zeros(n * S, F32)
    L = np.zeros((n * S, spec.sub), np.int8)
    scale[a], L[a] = _search(spec, t, xs[a], ws[a], scale0[a], id_base[a])
    signs = signs.reshape(n * S, -1)
    flip = scale < 0  # "should never happen": ggml flips the scale and every sign of the sub-block
    scale = np.where(flip, -scale, scale).astype(F32)
    signs = np.where(flip[:, None], ~signs & (127 if spec.parity else 255), signs).astype(np.uint8)
    rows = t.kmap[t.codes(L.reshape(n * S, -1, t.width))].astype(np.int64)
    if (rows < 0).any():
        raise AssertionError(f"{spec.name}: levels off the grid after the search (ggml aborts here too)")
    rows = np.where(active[:, None], rows, 0)
    signs = np.where(active[:, None], signs, 0).astype(np.uint8)
    scale = scale.reshape(n, S)
    max_scale = scale.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = max_scale / F32(31)
        idl = F32(1) / d
        ls = np.clip(nearest_int(F32(0.5) * (idl[:, None] * scale - F32(1))), 0, 15)
    dh = np.where(max_scale > 0, fp16(d * F32(spec.fudge)), np.float16(0))
    ls = np.where((max_scale > 0)[:, None], ls, 0).astype(np.uint32)
    return dh, ls, rows.reshape(n, S, -1), signs.reshape(n, S, -1), active.reshape(n, S), max_scale > 0


def quantize_iq2_xxs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """`quantize_iq2_xxs`: f32[n, 256], qw f32[n, 256] (required) -> u8[n, 66]."""
    dh, ls, rows, signs, _, nz = _quantize(IQ2_XXS, x, qw)
    n = x.shape[0]
    grid = rows.astype(np.uint8)  # [n, 8, 4]: a0 of each sub-block is its four grid rows as bytes
    s = signs.astype(np.uint32)
    a1 = s[:, :, 0] | (s[:, :, 1] << 7) | (s[:, :, 2] << 14) | (s[:, :, 3] << 21) | (ls << 28)
    qs = np.concatenate([grid.view("<u4"), a1[:, :, None].astype("<u4")], axis=2)  # [n, ib, 2]
    qs = np.where(nz[:, None, None], qs, 0).astype("<u4")
    return as_bytes(dh, qs.reshape(n, 16))


def quantize_iq2_xs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """`quantize_iq2_xs`: f32[n, 256], qw f32[n, 256] (required) -> u8[n, 74]."""
    dh, ls, rows, signs, _, nz = _quantize(IQ2_XS, x, qw)
    qs = (rows | (signs.astype(np.int64) << 9)).reshape(x.shape[0], 32)
    qs = np.where(nz[:, None], qs, 0).astype("<u2")
    return as_bytes(dh, qs, (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8))


def quantize_iq2_s(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """`quantize_iq2_s` (`quantize_row_iq2_s_ref` without qw): f32[n, 256] -> u8[n, 82]."""
    dh, ls, rows, signs, _, _ = _quantize(IQ2_S, x, qw)
    n = x.shape[0]
    rows = rows.reshape(n, 32)  # group i8 = 2 ib + k
    high = (rows >> 8).reshape(n, 8, 4) << (2 * np.arange(4))
    qh = high.sum(axis=2).astype(np.uint8)
    scales = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    return as_bytes(dh, (rows & 255).astype(np.uint8), signs.reshape(n, 32), qh, scales)


def quantize_iq3_xxs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """`quantize_iq3_xxs` (`quantize_row_iq3_xxs_ref` without qw): f32[n, 256] -> u8[n, 98]."""
    dh, ls, rows, signs, _, nz = _quantize(IQ3_XXS, x, qw)
    n = x.shape[0]
    s = signs.astype(np.uint32)
    ss = s[:, :, 0] | (s[:, :, 1] << 7) | (s[:, :, 2] << 14) | (s[:, :, 3] << 21) | (ls << 28)
    q3 = np.where(nz[:, None], rows.reshape(n, 64), 0).astype(np.uint8)
    return as_bytes(dh, q3, np.where(nz[:, None], ss, 0).astype("<u4"))


def quantize_iq3_s(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """`quantize_iq3_s` (`quantize_row_iq3_s_ref` without qw): f32[n, 256] -> u8[n, 110].

    ggml advances its qs and signs pointers only past sub-blocks it quantized: after an all-zero sub-block
    the later ones are stored one slot early, and the last slots stay zero. Reproduced as stored."""
    dh, ls, rows, signs, active, _ = _quantize(IQ3_S, x, qw)
    n = x.shape[0]
    qh = ((rows >> 8) << np.arange(8)).sum(axis=2).astype(np.uint8)  # bit k of qh[ib]: group 8 ib + k
    qs = np.zeros((n, 8, 8), np.uint8)
    sg = np.zeros((n, 8, 4), np.uint8)
    b, ib = np.nonzero(active)
    slot = (np.cumsum(active, axis=1) - 1)[b, ib]
    qs[b, slot] = (rows[b, ib] & 255).astype(np.uint8)
    sg[b, slot] = signs[b, ib]
    scales = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    return as_bytes(dh, qs.reshape(n, 64), qh, sg.reshape(n, 32), scales)


def quantize_row_iq2_s_ref(x: np.ndarray) -> np.ndarray:
    """`quantize_row_iq2_s_ref`: `quantize_iq2_s` without an importance matrix."""
    return quantize_iq2_s(x)


def quantize_row_iq3_xxs_ref(x: np.ndarray) -> np.ndarray:
    """`quantize_row_iq3_xxs_ref`: `quantize_iq3_xxs` without an importance matrix."""
    return quantize_iq3_xxs(x)


def quantize_row_iq3_s_ref(x: np.ndarray) -> np.ndarray:
    """`quantize_row_iq3_s_ref`: `quantize_iq3_s` without an importance matrix."""
    return quantize_iq3_s(x)


def _rows(blocks_fn):
    """A `ggml_quantize_chunk` row quantizer: rows f32[r, n_per_row], imatrix f32[n_per_row] | None ->
    u8[r, row_bytes] (the imatrix weights every row's columns alike)."""

    def run(rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        r = rows.shape[0]
        blocks = rows.reshape(-1, QK_K)  # [r * nb, 256]
        qw = (
            None if imatrix is None else np.broadcast_to(imatrix.reshape(1, -1, QK_K), (r, rows.shape[1] // QK_K, QK_K))
        )
        return blocks_fn(blocks, None if qw is None else qw.reshape(-1, QK_K)).reshape(r, -1)

    return run


# ggml type -> row quantizer, for rowquantizers.ROW_QUANTIZERS (IQ2_XXS, IQ2_XS and IQ1_S raise without an imatrix)
IQGRID_ROW_QUANTIZERS = {
    GGMLType.IQ2_XXS: _rows(quantize_iq2_xxs),
    GGMLType.IQ2_XS: _rows(quantize_iq2_xs),
    GGMLType.IQ2_S: _rows(quantize_iq2_s),
    GGMLType.IQ3_XXS: _rows(quantize_iq3_xxs),
    GGMLType.IQ3_S: _rows(quantize_iq3_s),
    GGMLType.IQ1_S: _rows(iq1.quantize_iq1_s),
    GGMLType.IQ1_M: _rows(iq1.quantize_iq1_m),
}
REQUIRES_IMATRIX = frozenset({GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ1_S})  # ggml_quantize_requires_imatrix
