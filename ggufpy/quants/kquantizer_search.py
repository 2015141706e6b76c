"""The scale searches behind ggml's k-quant and IQ4 quantizers, vectorized across groups.

Each function transcribes a static helper of llama.cpp `ggml/src/ggml-quants.c` (`make_qx_quants`,
`make_q3_quants`, `make_qkx2_quants`, `make_qkx3_quants`, `make_qp_quants`) for a batch of groups at once:
`x` is f32[N, n] (N groups of n values) and every loop over a group's elements runs in C's order, in f32,
one column at a time, so sums round exactly as the compiled library's (libggml-base has no FMA contraction:
tests/test_quantize_kquants.py checks byte equality against it). The candidate-scale loops stay loops; a
group's "keep the better one" becomes a masked update. A C loop that stops early when a pass changes nothing
is run to the end: a pass that changes nothing leaves the state as it was, so further passes are no-ops.

Degenerate inputs (all-zero groups, division by zero) follow C too; `np.errstate` silences the warnings of
the lanes whose results the masks then discard.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "GROUP_MAX_EPS",
    "first_absmax",
    "make_q3_quants",
    "make_qkx2_quants",
    "make_qkx3_quants",
    "make_qp_quants",
    "make_qx_quants",
    "nearest_int",
    "seqsum",
]

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)  # ggml-quants.c: below this a group is "all zero"


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's `nearest_int`: add 1.5 * 2^23 in f32 and read the low mantissa bits (ties to even): int32."""
    with np.errstate(invalid="ignore", over="ignore"):
        biased = np.asarray(v, F32) + F32(12582912.0)
    return (biased.view(np.int32) & 0x007FFFFF) - 0x00400000


def seqsum(a: np.ndarray) -> np.ndarray:
    """`float s = 0; for (i = 0; i < n; ++i) s += a[i];` along the last axis: f32[..., n] -> f32[...].

    Not `np.sum` (pairwise, so rounded differently): the columns are added in order, as whole vectors
    (faster than `np.cumsum`, whose accumulate loop runs row by row)."""
    cols = np.ascontiguousarray(np.moveaxis(a, -1, 0))  # [n, ...]
    s = cols[0] + F32(0)  # C starts at +0.0: a first term of -0.0 becomes +0.0
    for c in cols[1:]:
        s += c
    return s


def seqsum_from_first(a: np.ndarray) -> np.ndarray:
    """`float s = a[0]; for (i = 1; i < n; ++i) s += a[i];`: as `seqsum`, keeping a -0.0 total."""
    cols = np.ascontiguousarray(np.moveaxis(a, -1, 0))
    s = cols[0].copy()
    for c in cols[1:]:
        s += c
    return s


def first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(amax, max): the largest |x| of each group and its signed value, the first one on ties (C's strict `>`)."""
    idx = np.argmax(np.abs(x), axis=-1)[..., None]
    peak = np.take_along_axis(x, idx, axis=-1)[..., 0]
    return np.abs(peak), peak


def _first_min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`min = max = x[0]; if (x[i] < min) min = x[i]; ...`: the first extreme, so -0.0 vs 0.0 follows C."""
    lo = np.take_along_axis(x, np.argmin(x, axis=-1)[..., None], axis=-1)[..., 0]
    hi = np.take_along_axis(x, np.argmax(x, axis=-1)[..., None], axis=-1)[..., 0]
    return lo, hi


def _f(v: np.ndarray) -> np.ndarray:
    return v.astype(F32)


def make_qx_quants(x: np.ndarray, nmax: int, qw: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`: symmetric codes 0..2nmax-1 and the weighted
    least-squares scale, trying iscale = -(nmax + 0.1 is)/max for is in -9..9. Weights are qw, else x^2.
    Returns (scale f32[N], L u8[N, n])."""
    amax, peak = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x if qw is None else qw
    wx = w * x

    def codes(iscale):
        return np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)

    def sums(lf):
        return seqsum(wx * lf), seqsum(w * lf * lf)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lcur = codes(F32(-nmax) / peak)
        sumlx, suml2 = sums(_f(lcur))
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = scale * sumlx
        for step in [s for s in range(-9, 10) if s != 0]:
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / peak
            lt = codes(iscale)
            slx, sl2 = sums(_f(lt))
            better = (sl2 > 0) & (slx * slx > best * sl2)
            lcur = np.where(better[:, None], lt, lcur)
            scale = np.where(better, slx / sl2, scale).astype(F32)
            best = np.where(better, scale * slx, best).astype(F32)
    L = np.where(zero[:, None], 0, lcur + nmax).astype(np.uint8)
    return np.where(zero, F32(0), scale).astype(F32), L


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """`make_q3_quants(n, nmax, x, L, do_rmse=true)`: codes from -nmax/max, then up to five passes of
    coordinate descent on the x^2-weighted fit. Returns (scale f32[N], L u8[N, n] in 0..2nmax-1)."""
    amax, peak = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        L = np.clip(nearest_int((F32(-nmax) / peak)[:, None] * x), -nmax, nmax - 1)
        lf = _f(L)
        sumlx = seqsum(w * x * lf)
        suml2 = seqsum(w * lf * lf)
        for _ in range(5):
            for i in range(x.shape[1]):
                wi, xi, li = w[:, i], x[:, i], _f(L[:, i])
                slx = sumlx - wi * xi * li
                sl2 = suml2 - wi * li * li
                new_l = np.clip(nearest_int(xi * sl2 / slx), -nmax, nmax - 1)
                nf = _f(new_l)
                take = (slx > 0) & (new_l != L[:, i])
                slx = slx + wi * xi * nf
                sl2 = sl2 + wi * nf * nf
                take &= (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
                L[:, i] = np.where(take, new_l, L[:, i])
                sumlx = np.where(take, slx, sumlx)
                suml2 = np.where(take, sl2, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    L = np.where(zero[:, None], 0, L + nmax).astype(np.uint8)
    return np.where(zero, F32(0), scale).astype(F32), L


def _qkx_search(x, w, nmax, rmin, rdelta, nstep, use_mad, degenerate):
    """The common body of make_qkx2_quants / make_qkx3_quants (they differ in defaults and the
    degenerate test): affine codes 0..nmax from the range, then nstep + 1 candidate iscales
    (rmin + rdelta*is + nmax)/(max - min) each refit by weighted least squares, keeping the lowest error."""
    lo, hi = _first_min_max(x)
    lo = np.where(lo > 0, F32(0), lo).astype(F32)
    flat = degenerate(hi, lo)
    sum_w = seqsum_from_first(w)
    sum_x = seqsum_from_first(w * x)

    def error(scale, mn, lf):
        diff = (scale[:, None] * lf + mn[:, None]) - x
        return seqsum(w * (np.abs(diff) if use_mad else diff * diff))

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / (hi - lo)
        scale = F32(1) / iscale
        L = np.clip(nearest_int(iscale[:, None] * (x - lo[:, None])), 0, nmax)
        best = error(scale, lo, _f(L))
        mn = lo
        for step in range(nstep + 1) if nstep >= 1 else ():
            # C updates `min` when a candidate wins, so later candidates use that min in both places
            iscale = ((F32(rmin) + F32(rdelta) * F32(step)) + F32(nmax)) / (hi - mn)
            lt = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
            lf = _f(lt)
            wl = w * lf
            sum_l, sum_l2, sum_xl = seqsum(wl), seqsum(wl * lf), seqsum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            clamp = this_min > 0
            this_min = np.where(clamp, F32(0), this_min).astype(F32)
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale).astype(F32)
            cur = error(this_scale, this_min, lf)
            better = (D > 0) & (cur < best)
            L = np.where(better[:, None], lt, L)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale).astype(F32)
            mn = np.where(better, this_min, mn).astype(F32)
    L = np.where(flat[:, None], 0, L).astype(np.uint8)
    scale = np.where(flat, F32(0), scale).astype(F32)
    the_min = -np.where(flat, lo, mn).astype(F32)
    return scale, the_min, L


def make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    """`make_qkx2_quants`: returns (scale f32[N], the_min f32[N] (= -min >= 0), L u8[N, n] in 0..nmax)."""
    return _qkx_search(x, weights, nmax, rmin, rdelta, nstep, use_mad, lambda hi, lo: hi == lo)


def make_qkx3_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad=False):
    """`make_qkx3_quants`: as make_qkx2_quants, with weights x^2 when None and `max <= min` as degenerate."""
    w = x * x if weights is None else weights
    return _qkx_search(x, w, nmax, rmin, rdelta, nstep, use_mad, lambda hi, lo: hi <= lo)


def make_qp_quants(x: np.ndarray, nmax: int, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`make_qp_quants`: unsigned codes 0..nmax for non-negative values (the sub-block scales and mins of the
    imatrix k-quants), best of iscale = (nmax + 0.1 is)/max for is in -4..4 by weighted MSE, then up to five
    passes of coordinate descent. Returns (scale f32[N], L u8[N, n]). L is stored as uint8 (C's wrap)."""
    peak = np.maximum(x.max(axis=-1), F32(0))
    zero = peak < GROUP_MAX_EPS
    wx = qw * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / peak
        L8 = (nearest_int(iscale[:, None] * x) & 0xFF).astype(np.uint8)
        scale = F32(1) / iscale
        diff = x - scale[:, None] * _f(L8)
        best = seqsum(qw * diff * diff)
        for step in (-4, -3, -2, -1, 1, 2, 3, 4):
            iscale_is = (F32(0.1) * F32(step) + F32(nmax)) / peak
            scale_is = F32(1) / iscale_is
            lt = np.minimum(nearest_int(iscale_is[:, None] * x), nmax)
            diff = x - scale_is[:, None] * _f(lt)
            mse = seqsum(qw * diff * diff)
            better = mse < best
            best = np.where(better, mse, best)
            iscale = np.where(better, iscale_is, iscale).astype(F32)
        lt = np.minimum(nearest_int(iscale[:, None] * x), nmax)
        L8 = (lt & 0xFF).astype(np.uint8)
        lf = _f(lt)  # the sums use the int, before the uint8 store
        sumlx = seqsum(wx * lf)
        suml2 = seqsum(qw * lf * lf)
        for _ in range(5):
            for i in range(x.shape[1]):
                wi, xi, li = qw[:, i], x[:, i], _f(L8[:, i])
                slx = sumlx - wi * xi * li
                sl2 = suml2 - wi * li * li
                new_l = np.minimum(nearest_int(xi * sl2 / slx), nmax)
                nf = _f(new_l)
                take = (slx > 0) & (sl2 > 0) & (new_l != L8[:, i])
                slx = slx + wi * xi * nf
                sl2 = sl2 + wi * nf * nf
                take &= slx * slx * suml2 > sumlx * sumlx * sl2
                L8[:, i] = np.where(take, (new_l & 0xFF).astype(np.uint8), L8[:, i])
                sumlx = np.where(take, slx, sumlx)
                suml2 = np.where(take, sl2, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    return np.where(zero, F32(0), scale).astype(F32), np.where(zero[:, None], 0, L8).astype(np.uint8)
