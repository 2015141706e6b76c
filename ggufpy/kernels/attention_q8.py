"""Attention over a Q8_0 KV cache (`kvcache.Q8Cache`: K and V rows as Q8_0 blocks, u8 (S, G, E/32*34)),
compiled: one parallel task per (query, head), reading the blocks as stored.

`ggml=True` (the llamacpp numerics): llama.cpp's flash attention over a q8_0 cache
(`ggufpy.quants.x86.flash_attention.flash_attention_q8_0`, bit for bit): the query quantized to Q8_0 (x86
rounding), each score ggml's Q8_0 x Q8_0 block dot (8 lanes of integer sums, an FMA per block, `hsum_float_8`),
the online softmax with the C library's expf and FMAs, V dequantized (exact) and accumulated by FMAs.
`ggml=False` (the exact numerics): `kernels.attention`'s f32 loop over the dequantized rows.
"""

from __future__ import annotations

import numpy as np

from ._numba import fma_f32, get_threads, jit, prange, use_threads
from .activations import _f16, f16_bits_to_f32
from .attention import _dot, _sum, exp_nonpositive
from .glue_ggml import _libm_expf

__all__ = ["attention"]

_BLOCK_BYTES = 34  # Q8_0: d (fp16) then 32 int8 quants


@jit(inline=True)
def _scale(row, o):
    """The fp16 d of the block at byte o of a Q8_0 row (u8), as f32."""
    return f16_bits_to_f32(np.uint16(row[o]) | (np.uint16(row[o + 1]) << np.uint16(8)))


@jit(inline=True)
def _dequantize_row(row, quants, out, nb):
    """A Q8_0 row (u8 `row` and the same bytes as int8 `quants`, nb*34) into out f32 (nb*32): d * q, exact."""
    for b in range(nb):
        o = b * _BLOCK_BYTES
        d = _scale(row, o)
        for j in range(32):
            out[b * 32 + j] = d * np.float32(quants[o + 2 + j])


@jit(inline=True)
def _quantize_row(x, qq, qd, nb):
    """x f32 (nb*32) -> quants qq i32 (nb*32) and fp16 scales qd f32 (nb): ggml's x86 `quantize_row_q8_0`
    (id = 127/amax, round half to even, d = amax/127 stored as fp16)."""
    for b in range(nb):
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(x[b * 32 + j]))
        d = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
        for j in range(32):
            qq[b * 32 + j] = np.int32(np.rint(x[b * 32 + j] * inv))
        qd[b] = _f16(d)


@jit(inline=True)
def _dot_q8_0(row, quants, qq, qd, nb, acc):
    """ggml_vec_dot_q8_0_q8_0 (AVX2; tinyBLAS_Q0_AVX alike): per block, 8 lanes each the integer sum of 4
    products, acc[lane] = fma(d_k * d_q, lane, acc[lane]); then hsum_float_8."""
    for j in range(8):
        acc[j] = np.float32(0.0)
    for b in range(nb):
        o = b * _BLOCK_BYTES
        d = _scale(row, o) * qd[b]  # a product of two fp16 values: exact
        for j in range(8):
            lane = np.int32(0)
            for u in range(4):
                lane += np.int32(quants[o + 2 + 4 * j + u]) * qq[b * 32 + 4 * j + u]
            acc[j] = fma_f32(d, np.float32(lane), acc[j])
    r0, r1, r2, r3 = acc[4] + acc[0], acc[5] + acc[1], acc[6] + acc[2], acc[7] + acc[3]
    return (r0 + r2) + (r1 + r3)


@jit(parallel=True)
def _attention_ggml(nt, q, k, v, k8, v8, start, scale, window, out):
    previous = use_threads(nt)
    T, H, E = q.shape
    S, G, _ = k.shape
    nb = E // 32
    per_group = H // G
    for i in prange(T * H):
        t = i // H
        h = i % H
        g = h // per_group
        pos = start + t
        lo = max(0, pos - window + 1) if window > 0 else 0  # cells lo..hi-1 are visible, the rest skipped
        hi = min(S, pos + 1)
        qq = np.empty(E, np.int32)
        qd = np.empty(nb, np.float32)
        acc = np.empty(8, np.float32)
        vrow = np.empty(E, np.float32)
        vkq = np.zeros(E, np.float32)
        _quantize_row(q[t, h], qq, qd, nb)
        M = np.float32(-np.inf)
        total = np.float32(0.0)
        for s in range(lo, hi):
            sc = _dot_q8_0(k[s, g], k8[s, g], qq, qd, nb, acc) * scale
            ms = np.float32(1.0)
            vs = np.float32(1.0)
            if sc > M:
                ms = _libm_expf(M - sc)
                M = sc
                for e in range(E):
                    vkq[e] *= ms
            else:
                vs = _libm_expf(sc - M)
            _dequantize_row(v[s, g], v8[s, g], vrow, nb)
            for e in range(E):
                vkq[e] = fma_f32(vrow[e], vs, vkq[e])
            total = fma_f32(total, ms, vs)
        inv = np.float32(0.0) if total == 0 else np.float32(1.0) / total
        for e in range(E):
            out[t, h, e] = vkq[e] * inv
    use_threads(previous)


@jit(parallel=True, fast=True)
def _attention_f32(nt, q, k, v, k8, v8, start, scale, window, softcap, out):
    """`kernels.attention._attention` over rows dequantized on the way."""
    previous = use_threads(nt)
    T, H, E = q.shape
    S, G, _ = k.shape
    nb = E // 32
    per_group = H // G
    for i in prange(T * H):
        t = i // H
        h = i % H
        g = h // per_group
        pos = start + t
        lo = max(0, pos - window + 1) if window > 0 else 0
        hi = min(S, pos + 1)
        scores = np.empty(max(hi - lo, 0), np.float32)
        row = np.empty(E, np.float32)
        qh = q[t, h]
        peak = np.float32(-np.inf)
        for s in range(lo, hi):
            _dequantize_row(k[s, g], k8[s, g], row, nb)
            acc = _dot(qh, row, E) * scale
            if softcap > 0:
                acc = softcap * np.tanh(acc / softcap)
            scores[s - lo] = acc
            peak = max(peak, acc)
        for j in range(hi - lo):
            scores[j] = exp_nonpositive(scores[j] - peak)
        total = _sum(scores, hi - lo)
        for e in range(E):
            out[t, h, e] = 0.0
        for s in range(lo, hi):
            _dequantize_row(v[s, g], v8[s, g], row, nb)
            p = scores[s - lo] / total
            for e in range(E):
                out[t, h, e] += p * row[e]
    use_threads(previous)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    ggml: bool = True,
    threads: int = 0,
) -> np.ndarray:
    """q (T, H, E) f32 over the Q8_0 rows k, v u8 (S, G, E/32*34) -> (T, H*E), on `threads` threads (0: numba's
    current count). `ggml`: llama.cpp's flash attention bit for bit (a softcap goes to the NumPy replay), else
    the f32 attention over the dequantized rows."""
    T, H, E = q.shape
    if ggml and softcap:  # glibc's tanhf is replayed in NumPy only
        from ..quants.x86.flash_attention import flash_attention_q8_0

        return flash_attention_q8_0(q, k, v, start, scale, window=window, softcap=softcap)
    out = np.empty((T, H, E), np.float32)
    k, v = np.ascontiguousarray(k, np.uint8), np.ascontiguousarray(v, np.uint8)
    args = (np.ascontiguousarray(q, np.float32), k, v, k.view(np.int8), v.view(np.int8), int(start))
    if ggml:
        _attention_ggml(threads or get_threads(), *args, np.float32(scale), int(window or 0), out)
    else:
        _attention_f32(
            threads or get_threads(), *args, np.float32(scale), int(window or 0), np.float32(softcap or 0), out
        )
    return out.reshape(T, H * E)
