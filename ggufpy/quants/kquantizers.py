"""The k-quant quantizers Q2_K..Q6_K, byte-identical to ggml, with and without an importance matrix.

`quantize_row_q*_K_ref(x f32[n, 256]) -> u8[n, type_size]` are llama.cpp's `quantize_row_q*_K_ref`
(`ggml/src/ggml-quants.c`), the registry's block quantizers. `quantize_q*_K_imatrix(x, qw)` are the
`quantize_row_q*_K_impl` that `quantize_q*_K` (hence `ggml_quantize_chunk`, hence llama-quantize) runs when it
is given an importance matrix; `qw` f32[n, 256] holds each block's slice of it. The scale searches are in
`kquantizer_search.py`; block layouts are drawn in `kquants.py`.

After the search every format stores a super-block scale in fp16 and small integer sub-block scales, then
requantizes each element against the scale as stored (`nearest_int((x + dmin*m) / (d*sc))`); a sub-block whose
stored scale is 0 keeps the codes the search chose (C's `if (!d) continue;`).
"""

from __future__ import annotations

import numpy as np

from .fields import as_bytes
from .kquantizer_search import (
    GROUP_MAX_EPS,
    first_absmax,
    make_q3_quants,
    make_qkx2_quants,
    make_qkx3_quants,
    make_qp_quants,
    make_qx_quants,
    nearest_int,
    seqsum,
)
from .kquants import k4_scales_mins

__all__ = [
    "quantize_q2_K_imatrix",
    "quantize_q3_K_imatrix",
    "quantize_q4_K_imatrix",
    "quantize_q5_K_imatrix",
    "quantize_q6_K_imatrix",
    "quantize_row_q2_K_ref",
    "quantize_row_q3_K_ref",
    "quantize_row_q4_K_ref",
    "quantize_row_q5_K_ref",
    "quantize_row_q6_K_ref",
]

F32 = np.float32
QK_K = 256


def fp16(v: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16: round to nearest even, inf on overflow: f16 array (same shape)."""
    with np.errstate(over="ignore"):
        return np.asarray(v, F32).astype("<f2")


def _u8(v: np.ndarray) -> np.ndarray:
    """C's store of an int into a uint8_t: keep the low 8 bits."""
    return (np.asarray(v) & 0xFF).astype(np.uint8)


def _requantize(x: np.ndarray, L: np.ndarray, d: np.ndarray, dm: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """L[j] = clamp(nearest_int((x + dm) / d)) where the stored sub-block scale d != 0, else L as searched.
    x f32[n, s, l], L u8/i[n, s, l], d and dm f32[n, s]; lo/hi the code range."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(nearest_int((x + dm[..., None]) / d[..., None]), lo, hi)
    return np.where((d != 0)[..., None], q, L)


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """u8[n, 256] (values < 4) -> qs u8[n, 64]: byte 32h + l holds elements 128h + 32j + l at bits 2j."""
    n = L.shape[0]
    q = L.reshape(n, 2, 4, 32).astype(np.uint8) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(q, axis=2).reshape(n, 64)


def _pack_nibble_pairs(L: np.ndarray) -> np.ndarray:
    """u8[n, 256] (values < 16) -> u8[n, 128]: byte 32c + l = element 64c + l | element 64c + 32 + l << 4."""
    n = L.shape[0]
    q = L.reshape(n, 4, 2, 32).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit (scale, min) pairs -> the 12 bytes `get_scale_min_k4` reads (see kquants.k4_scales_mins),
    written as C writes them, so an out-of-range code spills into the same bits: u8[n, 8] x2 -> u8[n, 12]."""
    s = np.zeros((ls.shape[0], 12), np.uint8)
    s[:, 0:4], s[:, 4:8] = ls[:, :4], lm[:, :4]
    s[:, 8:12] = (ls[:, 4:] & 0xF) | _u8((lm[:, 4:] & 0xF).astype(np.int32) << 4)
    s[:, 0:4] |= _u8((ls[:, 4:] >> 4).astype(np.int32) << 6)
    s[:, 4:8] |= _u8((lm[:, 4:] >> 4).astype(np.int32) << 6)
    return s


def _pack_q3_scales(l6: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit scales (0..63) -> 12 bytes: low nibbles of j and j+8 share byte j (j < 8); the top two
    bits of scale j go to bits 2(j/4) of byte 8 + j%4: u8[n, 16] -> u8[n, 12]."""
    low, high = l6 & 0xF, (l6 >> 4).reshape(-1, 4, 4)  # high [n, j/4, j%4]
    planes = high << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)
    return np.concatenate([low[:, :8] | (low[:, 8:] << 4), np.bitwise_or.reduce(planes, axis=1)], axis=1)


def _sub_blocks(x: np.ndarray, size: int) -> np.ndarray:
    return x.reshape(-1, size)  # [n * 256/size, size]


def _mean_abs_weights(x: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K without imatrix: av_x + |x|, av_x = sqrtf(sum x^2 / 32) per 32-element sub-block."""
    xs = x.reshape(-1, 8, 32)
    av = np.sqrt(seqsum(xs * xs) / F32(32))
    return av[..., None] + np.abs(xs)


def _imatrix_weights(x: np.ndarray, qw: np.ndarray, sigma_factor: int) -> np.ndarray:
    """qw * sqrtf(sigma2 + x^2) with sigma2 = factor * sum x^2 / 256 over the super-block: f32[n, 256]."""
    sigma2 = F32(sigma_factor) * seqsum(x * x) / F32(QK_K) if sigma_factor != 1 else seqsum(x * x) / F32(QK_K)
    return qw * np.sqrt(sigma2[:, None] + x * x)


# --- Q2_K: block_q2_K {scales u8[16], qs u8[64], d fp16, dmin fp16} -----------------------------------------


def _q2_K_finish(x, L, d16, dmin16, sc):
    n = x.shape[0]
    d = d16.astype(F32)[:, None] * (sc & 0xF).astype(F32)
    dm = dmin16.astype(F32)[:, None] * (sc >> 4).astype(F32)
    L = _requantize(x.reshape(n, 16, 16), L.reshape(n, 16, 16), d, dm, 0, 3)
    return as_bytes(sc, _pack_2bit(L.reshape(n, QK_K)), d16, dmin16)


def quantize_row_q2_K_ref(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    xs = _sub_blocks(x, 16)
    scales, mins, L = make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(n, 16), mins.reshape(n, 16)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = nearest_int((F32(15) / max_scale)[:, None] * scales)
        lm = nearest_int((F32(15) / max_min)[:, None] * mins)
    sc = np.where((max_scale > 0)[:, None], _u8(ls), 0).astype(np.uint8)
    sc |= np.where((max_min > 0)[:, None], _u8(lm << 4), 0).astype(np.uint8)
    d16 = fp16(np.where(max_scale > 0, max_scale / F32(15), F32(0)))
    dmin16 = fp16(np.where(max_min > 0, max_min / F32(15), F32(0)))
    return _q2_K_finish(x, L, d16, dmin16, sc)


def quantize_q2_K_imatrix(x: np.ndarray, qw: np.ndarray) -> np.ndarray:  # `quantize_row_q2_K_impl`
    n = x.shape[0]
    w = _sub_blocks(_imatrix_weights(x, qw, 1), 16)
    scales, mins, L = make_qkx3_quants(_sub_blocks(x, 16), w, 3, -0.9, 0.05, 36)
    sw = seqsum(w).reshape(n, 16)
    dm, ls = make_qp_quants(scales.reshape(n, 16), 15, sw)
    mm, lm = make_qp_quants(mins.reshape(n, 16), 15, sw)
    sc = ls | _u8(lm.astype(np.int32) << 4)
    return _q2_K_finish(x, L, fp16(dm), fp16(mm), sc)


# --- Q3_K: block_q3_K {hmask u8[32], qs u8[64], scales u8[12], d fp16} ---------------------------------------


def _q3_K_finish(x, L, d16, l6):
    """l6: the sixteen stored 6-bit scales (0..63, sc = l6 - 32); L u8[n, 256] codes 0..7."""
    n = x.shape[0]
    d = d16.astype(F32)[:, None] * (l6.astype(np.int32) - 32).astype(F32)
    L = _requantize(x.reshape(n, 16, 16), L.reshape(n, 16, 16).astype(np.int32) - 4, d, np.zeros_like(d), -4, 3)
    L = (L + 4).reshape(n, QK_K)
    hmask = np.packbits((L > 3).reshape(n, 8, 32), axis=1, bitorder="little").reshape(n, 32)  # bit k: 32k + m
    return as_bytes(hmask, _pack_2bit(L & 3), _pack_q3_scales(l6), d16)


def quantize_row_q3_K_ref(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    scales, L = make_q3_quants(_sub_blocks(x, 16), 4)
    scales = scales.reshape(n, 16)
    _, max_scale = first_absmax(scales)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-32) / max_scale
        l8 = nearest_int(iscale[:, None] * scales).astype(np.int8)  # `int8_t l = nearest_int(...)`
    l6 = (np.clip(l8, -32, 31).astype(np.int32) + 32).astype(np.uint8)
    nonzero = max_scale != 0
    l6 = np.where(nonzero[:, None], l6, 0).astype(np.uint8)  # memset(scales, 0, 12): sc reads back as -32
    with np.errstate(divide="ignore"):
        d16 = fp16(np.where(nonzero, F32(1) / iscale, F32(0)))
    return _q3_K_finish(x, L, d16, l6)


def quantize_q3_K_imatrix(x: np.ndarray, qw: np.ndarray) -> np.ndarray:  # `quantize_row_q3_K_impl`
    n = x.shape[0]
    w = _sub_blocks(_imatrix_weights(x, qw, 2), 16)
    scales, L = make_qx_quants(_sub_blocks(x, 16), 4, w)
    d_block, l6 = make_qx_quants(scales.reshape(n, 16), 32, seqsum(w).reshape(n, 16))
    return _q3_K_finish(x, L, fp16(d_block), l6)


# --- Q4_K / Q5_K: {d fp16, dmin fp16, scales u8[12], [qh u8[32]], qs u8[128]} -------------------------------


def _k4_codes_ref(scales, mins):
    """ref: ls = min(63, (uint8_t)nearest_int(63/max_scale * scale)), likewise lm; d = max_scale/63."""
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
    ls = np.minimum(_u8(nearest_int(inv_scale[:, None] * scales)), 63)
    lm = np.minimum(_u8(nearest_int(inv_min[:, None] * mins)), 63)
    return ls, lm, fp16(max_scale / F32(63)), fp16(max_min / F32(63))


def _k4_requantize(x, L, d16, dmin16, packed, nmax):
    n = x.shape[0]
    sc, m = k4_scales_mins(packed)
    d = d16.astype(F32)[:, None] * sc.astype(F32)
    dm = dmin16.astype(F32)[:, None] * m.astype(F32)
    return _requantize(x.reshape(n, 8, 32), L.reshape(n, 8, 32), d, dm, 0, nmax).reshape(n, QK_K)


def _q4_K_bytes(x, L, d16, dmin16, ls, lm):
    packed = _pack_k4_scales(ls, lm)
    L = _k4_requantize(x, L, d16, dmin16, packed, 15)
    return as_bytes(d16, dmin16, packed, _pack_nibble_pairs(L))


def _q5_K_bytes(x, L, d16, dmin16, ls, lm):
    n = x.shape[0]
    packed = _pack_k4_scales(ls, lm)
    L = _k4_requantize(x, L, d16, dmin16, packed, 31)
    qh = np.packbits((L > 15).reshape(n, 8, 32), axis=1, bitorder="little").reshape(n, 32)  # bit 2c+t
    return as_bytes(d16, dmin16, packed, qh, _pack_nibble_pairs(L & 0xF))


def _k4_search_ref(x, nmax, rmin, rdelta, nstep):
    n = x.shape[0]
    xs = _sub_blocks(x, 32)
    scales, mins, L = make_qkx2_quants(xs, _mean_abs_weights(x).reshape(-1, 32), nmax, rmin, rdelta, nstep, False)
    return (L, *_k4_codes_ref(scales.reshape(n, 8), mins.reshape(n, 8)))


def _k4_search_imatrix(x, qw, nmax):
    n = x.shape[0]
    w = _sub_blocks(_imatrix_weights(x, qw, 2), 32)
    scales, mins, L = make_qkx3_quants(_sub_blocks(x, 32), w, nmax, -0.9, 0.05, 36)
    sw = seqsum(w).reshape(n, 8)
    d_block, ls = make_qp_quants(scales.reshape(n, 8), 63, sw)
    m_block, lm = make_qp_quants(mins.reshape(n, 8), 63, sw)
    return L, ls, lm, fp16(d_block), fp16(m_block)


def quantize_row_q4_K_ref(x: np.ndarray) -> np.ndarray:
    L, ls, lm, d16, dmin16 = _k4_search_ref(x, 15, -1.0, 0.1, 20)
    return _q4_K_bytes(x, L, d16, dmin16, ls, lm)


def quantize_q4_K_imatrix(x: np.ndarray, qw: np.ndarray) -> np.ndarray:  # `quantize_row_q4_K_impl`
    L, ls, lm, d16, dmin16 = _k4_search_imatrix(x, qw, 15)
    return _q4_K_bytes(x, L, d16, dmin16, ls, lm)


def quantize_row_q5_K_ref(x: np.ndarray) -> np.ndarray:
    L, ls, lm, d16, dmin16 = _k4_search_ref(x, 31, -0.5, 0.1, 15)
    return _q5_K_bytes(x, L, d16, dmin16, ls, lm)


def quantize_q5_K_imatrix(x: np.ndarray, qw: np.ndarray) -> np.ndarray:  # `quantize_row_q5_K_impl`
    L, ls, lm, d16, dmin16 = _k4_search_imatrix(x, qw, 31)
    return _q5_K_bytes(x, L, d16, dmin16, np.minimum(ls, 63), np.minimum(lm, 63))  # Q5_K clamps, Q4_K not


# --- Q6_K: block_q6_K {ql u8[128], qh u8[64], scales i8[16], d fp16} -----------------------------------------


def _q6_K(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    n = x.shape[0]
    scales, L = make_qx_quants(_sub_blocks(x, 16), 32, None if qw is None else _sub_blocks(qw, 16))
    scales = scales.reshape(n, 16)
    amax, max_scale = first_absmax(scales)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-128) / max_scale
        d16 = fp16(F32(1) / iscale)
        sc = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)  # int8 store wraps
    d = d16.astype(F32)[:, None] * sc.astype(F32)
    L = _requantize(x.reshape(n, 16, 16), L.reshape(n, 16, 16).astype(np.int32) - 32, d, np.zeros_like(d), -32, 31)
    L = (L + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [h, k, l]: element 128h + 32k + l
    ql = np.stack([L[:, :, 0] & 0xF | (L[:, :, 2] & 0xF) << 4, L[:, :, 1] & 0xF | (L[:, :, 3] & 0xF) << 4], 2)
    high = L >> 4 << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    out = as_bytes(ql.reshape(n, 128), np.bitwise_or.reduce(high, axis=2).reshape(n, 64), sc, d16)
    out[amax < GROUP_MAX_EPS] = 0  # memset(&y[i], 0, sizeof(block_q6_K))
    return out


def quantize_row_q6_K_ref(x: np.ndarray) -> np.ndarray:
    return _q6_K(x, None)


def quantize_q6_K_imatrix(x: np.ndarray, qw: np.ndarray) -> np.ndarray:  # `quantize_row_q6_K_impl`
    return _q6_K(x, qw)
