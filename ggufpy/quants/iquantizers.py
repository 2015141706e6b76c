"""IQ4_NL and IQ4_XS quantizers, byte-identical to ggml's `quantize_row_iq4_nl_impl`.

Both formats pick, per 32 elements, a scale d and for each element the nearest of the 16 non-linear values
`kvalues_iq4nl` (iquants.py). The search (llama.cpp `ggml/src/ggml-quants.c`): start from d = max/-127, refit
d by weighted least squares, then try iscale = (itry - 127)/max for itry in -ntry..ntry, keeping the best
fit. IQ4_XS then stores d as a 6-bit multiple of a super-block scale -max_scale/32 and re-picks the values.

ggml runs it with ntry = 7 from `quantize_iq4_nl` / `quantize_iq4_xs` (`ggml_quantize_chunk`, so
llama-quantize; `quantize_row_iq4_xs_ref` too) and with ntry = -1 (no candidates, no re-pick) from
`quantize_row_iq4_nl_ref`. Weights are x^2, or with an importance matrix qw * sqrtf(sigma2 + x^2),
sigma2 = 2 * mean(x^2) over the super-block.
"""

from __future__ import annotations

import numpy as np

from .fields import as_bytes
from .iquants import KVALUES_IQ4NL
from .kquantizer_search import GROUP_MAX_EPS, first_absmax, nearest_int, seqsum
from .kquantizers import fp16

__all__ = [
    "best_index_int8",
    "quantize_iq4_nl",
    "quantize_iq4_xs",
    "quantize_row_iq4_nl_ref",
    "quantize_row_iq4_xs_ref",
]

F32 = np.float32
_VALUES = KVALUES_IQ4NL.astype(F32)


def best_index_int8(x: np.ndarray, values: np.ndarray = _VALUES) -> np.ndarray:
    """ggml's `best_index_int8`: the index of the nearest table value (the upper one on ties), by binary
    search, so the comparison is C's `x - val[mu-1] < val[mu] - x` in f32: u8 of x's shape."""
    mu = np.clip(np.searchsorted(values, x, side="right"), 1, len(values) - 1)
    idx = np.where(x - values[mu - 1] < values[mu] - x, mu - 1, mu)
    idx = np.where(x <= values[0], 0, np.where(x >= values[-1], len(values) - 1, idx))
    return idx.astype(np.uint8)


def _weighted_fit(x, w, iscale):
    """Codes for id = iscale and the sums of `sumqx += w*q*x; sumq2 += w*q*q`: (L, sumqx, sumq2)."""
    L = best_index_int8(iscale[:, None] * x)
    wq = w * _VALUES[L]
    return L, seqsum(wq * x), seqsum(wq * _VALUES[L])


def _block_scales(x: np.ndarray, w: np.ndarray, ntry: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The per-32 search for f32[N, 32] groups: (scale f32[N], first-pass codes u8[N, 32], zero mask)."""
    amax, peak = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    v0 = _VALUES[0]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = (-peak if ntry > 0 else peak) / v0
        L, sumqx, sumq2 = _weighted_fit(x, w, F32(1) / d)
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0)).astype(F32)
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            _, sqx, sq2 = _weighted_fit(x, w, F32(itry + int(KVALUES_IQ4NL[0])) / peak)
            better = (sq2 > 0) & (sqx * sqx > best * sq2)
            d = np.where(better, sqx / sq2, d).astype(F32)
            best = np.where(better, d * sqx, best).astype(F32)
    return np.where(zero, F32(0), d).astype(F32), L, zero


def _weights(x: np.ndarray, qw: np.ndarray | None, super_block: int) -> np.ndarray:
    """x^2, or qw * sqrtf(sigma2 + x^2) with sigma2 = (sum x^2) * (2/super_block): x f32[n, super_block]."""
    if qw is None:
        return x * x
    sigma2 = seqsum(x * x) * (F32(2) / F32(super_block))
    return qw * np.sqrt(sigma2[:, None] + x * x)


def _pack_iq4(L: np.ndarray) -> np.ndarray:
    """Codes u8[n, m*32] -> u8[n, m*16]: byte 16i + j = code 32i + j | code 32i + 16 + j << 4."""
    n = L.shape[0]
    q = L.reshape(n, -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, -1)


def _iq4_nl(x: np.ndarray, qw: np.ndarray | None, ntry: int) -> np.ndarray:
    d, L, zero = _block_scales(x, _weights(x, qw, 32), ntry)
    if ntry > 0:
        with np.errstate(divide="ignore"):
            inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
        L = best_index_int8(inv[:, None] * x)
    elif zero.any():
        # C skips an all-zero block and packs the codes its buffer still holds from the block before
        # (stack garbage for the first block; 0 here). The values decode to 0 either way, as d = 0.
        prev = np.maximum.accumulate(np.where(zero, -1, np.arange(len(x))))
        L = np.where(zero[:, None], np.where((prev >= 0)[:, None], L[np.maximum(prev, 0)], 0), L)
    return as_bytes(fp16(d), _pack_iq4(L))


def quantize_row_iq4_nl_ref(x: np.ndarray) -> np.ndarray:
    """`quantize_row_iq4_nl_ref` (ntry = -1): f32[n, 32] -> u8[n, 18]."""
    return _iq4_nl(x, None, -1)


def quantize_iq4_nl(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """`quantize_iq4_nl` (ntry = 7), what ggml_quantize_chunk runs: f32[n, 32], qw f32[n, 32] or None."""
    return _iq4_nl(x, qw, 7)


def quantize_iq4_xs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """`quantize_iq4_xs` (ntry = 7): f32[n, 256], qw f32[n, 256] or None -> u8[n, 136]."""
    n = x.shape[0]
    w = _weights(x, qw, 256)
    scales, _, _ = _block_scales(x.reshape(-1, 32), w.reshape(-1, 32), 7)
    scales = scales.reshape(n, 8)
    amax, peak = first_absmax(scales)
    max_scale = np.where(amax > 0, peak, F32(0)).astype(F32)  # C keeps max_scale = 0 unless |d| > 0
    d = -max_scale / F32(32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
        ls = np.clip(nearest_int(inv[:, None] * scales), -32, 31)
        dl = d[:, None] * ls.astype(F32)
        idl = np.where(dl != 0, F32(1) / dl, F32(0)).astype(F32)
    L = best_index_int8(idl[:, :, None] * x.reshape(n, 8, 32)).reshape(n, 256)
    ls = (ls + 32).astype(np.uint16)
    scales_h = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    low = (ls & 0xF).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    return as_bytes(fp16(d), scales_h.astype("<u2"), scales_l, _pack_iq4(L))


def quantize_row_iq4_xs_ref(x: np.ndarray) -> np.ndarray:
    """`quantize_row_iq4_xs_ref` is `quantize_iq4_xs` without an importance matrix."""
    return quantize_iq4_xs(x)
