"""llama.cpp's flash attention over a Q8_0 KV cache (`-ctk q8_0 -ctv q8_0 -fa on`) on x86, bit for bit.

A quantized V cache needs flash attention (llama-context.cpp refuses it otherwise), and with K and V not
F16/F32 every query row takes ggml-cpu/ops.cpp `ggml_compute_forward_flash_attn_ext_f16_one_chunk` over all
cells (the split-KV decode path and the tiled path take F16/F32 caches only). Per query row (head h, KV group
g = h // (H/G)), the cells in order, masked ones skipped (`mv == -INFINITY: continue`):

    Q_q  = quantize_row_q8_0(q)                 the x86 `from_float` of Q8_0, K's vec_dot type
    s    = ggml_vec_dot_q8_0_q8_0(K[ic], Q_q)   8 lanes acc = fma(d_k * d_q, lane, acc), then hsum_float_8
    s    = s * scale                            with a softcap: scale / cap first, then cap * tanhf(s)
    s > M:  ms = expf(M - s); M = s; VKQ *= ms; vs = 1            the C library's expf
    else:   vs = expf(s - M)
    VKQ  = fma(dequantize_row_q8_0(V[ic]), vs, VKQ)               ggml_vec_mad_f32 (d * q is exact in f32)
    S    = fma(S, ms, vs)                                         `S = S*ms + vs`, contracted (-mfma)
    out  = VKQ * (1.0f / S)                                       ggml_vec_scale_f32

K and V rows are written into the cache by `ggml_set_rows` with the same x86 `quantize_row_q8_0`
(`kvcache.Q8Cache`). The cache here is u8 (S, G, E/32*34): Q8_0 blocks, d fp16 then 32 int8 quants.

With a quantized cache llama.cpp (since PR 21038; `LLAMA_ATTN_ROT_DISABLE=1` turns it off) also rotates Q, K
and V by the orthonormal 64 x 64 Hadamard matrix before the cache (each 64 values of a head: `ggml_mul_mat`
of f32 rows) and the attention output back: scores are unchanged in exact arithmetic and outliers spread
over the block before quantization. `rotate` does that. Checked against llama-cpp-python 0.3.36 (AVX2):
this attention is bit-identical on llama.cpp's own rotated Q/K/V; the rotation products, replayed here as
tinyBLAS f32 (`floats.matmul_f32`), differ from llama.cpp's in the last bit of ~40% of the values (the
kernel llama.cpp runs for them is not identified yet).
"""

from __future__ import annotations

import functools

import numpy as np

from ...ops import ATTENTION_BUDGET, query_blocks, query_rows
from ..quantizers import quantize_q8_0_x86
from .floats import matmul_f32
from .llamafile import matmul_q8_0
from .simd import fma
from .unary import _libm_expf, tanhf_glibc

__all__ = ["Q8_0_BLOCK", "ROTATION", "dequantize_q8_0_rows", "flash_attention_q8_0", "quantize_q8_0_rows", "rotate"]

Q8_0_BLOCK = (32, 34)  # elements, bytes of one Q8_0 block

_f32 = np.float32

ROTATION = 64  # values per Hadamard rotation (llama-kv-cache.cpp: heads whose size is a multiple of 64)


@functools.cache
def hadamard(n: int = ROTATION) -> np.ndarray:
    """The Sylvester Hadamard matrix of order n (a power of 2) over sqrt(n): f32 (n, n), symmetric and its own
    inverse; every entry is +-1/sqrt(n) (exact for n = 64: 1/8)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(_f32)


def rotate(x: np.ndarray, isa: str | None = None) -> np.ndarray:
    """x (..., E), E a multiple of 64, with each run of 64 values times the Hadamard matrix: in plain f32 (NumPy)
    with `isa` None, else as ggml's f32 `mul_mat` of that x86 build (`floats.matmul_f32`, see the module note)."""
    x = np.asarray(x, _f32)
    rows = x.reshape(-1, ROTATION)
    y = rows @ hadamard() if isa is None else matmul_f32(hadamard(), rows, isa)
    return y.reshape(x.shape)


def quantize_q8_0_rows(x: np.ndarray) -> np.ndarray:
    """f32 (..., E) -> Q8_0 blocks u8 (..., E/32*34), ggml's x86 `quantize_row_q8_0` (ties to even)."""
    x = np.ascontiguousarray(x, _f32)
    blocks = quantize_q8_0_x86(x.reshape(-1, Q8_0_BLOCK[0]))
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // Q8_0_BLOCK[0] * Q8_0_BLOCK[1])


def dequantize_q8_0_rows(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 blocks u8 (..., nb*34) -> f32 (..., nb*32): d * q, exact in f32 (`dequantize_row_q8_0`)."""
    b = np.ascontiguousarray(blocks, np.uint8)
    lead = b.shape[:-1]
    b = b.reshape(-1, Q8_0_BLOCK[1])
    d = b[:, :2].copy().view(np.float16).astype(_f32)  # (n, 1)
    q = b[:, 2:].view(np.int8).astype(_f32)  # (n, 32)
    return (d * q).reshape(*lead, -1)


def _expf(x: np.ndarray) -> np.ndarray:
    """The C library's expf, element by element (ggml's scalar code calls it); correctly rounded without one."""
    f = _libm_expf()
    x = np.asarray(x, _f32)
    if f is None:
        return np.exp(x.astype(np.float64)).astype(_f32)
    return np.array([f(v) for v in x.reshape(-1).tolist()], _f32).reshape(x.shape)


def flash_attention_q8_0(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
    budget: int = ATTENTION_BUDGET,
) -> np.ndarray:
    """q (T, H, E) f32 at positions start..start+T-1 over the Q8_0 cache rows k, v u8 (S, G, E/32*34) of
    positions 0..S-1 -> (T, H*E) f32, as `ggml_compute_forward_flash_attn_ext_f16_one_chunk` computes it.
    `window`, `softcap`, `sinks` as `ops.attention`. Query rows go in blocks of `budget` bytes of scores."""
    T, H, E = q.shape
    S, G, row_bytes = k.shape
    if v.shape != k.shape or H % G or row_bytes != E // Q8_0_BLOCK[0] * Q8_0_BLOCK[1]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: need Q8_0 rows of {E} values and G dividing H")
    if S < start + T:
        raise ValueError(f"{S} cached positions cannot hold queries at positions {start}..{start + T - 1}")
    r = H // G
    q_q = quantize_q8_0_rows(q)  # (T, H, row_bytes): each query row as the K dot product reads it
    if softcap:
        scale = _f32(scale) / _f32(softcap)  # `scale /= logit_softcap`
    out = np.empty((T, H, E), _f32)
    for g in range(G):
        values = dequantize_q8_0_rows(v[:, g])  # (S, E)
        for rows in query_blocks(T, query_rows(T, S, r, 4, budget)):
            t = rows.stop - rows.start
            qg = q_q[rows, g * r : (g + 1) * r].reshape(t * r, row_bytes)  # (t*r, row_bytes), row = (t, head)
            kq = matmul_q8_0(k[:, g], qg)  # (t*r, S): vec_dot per (query row, cell), one rounding sequence
            kq = kq * _f32(scale)
            if softcap:
                kq = _f32(softcap) * tanhf_glibc(kq)
            pos = np.repeat(start + np.arange(rows.start, rows.stop), r)  # (t*r,) each row's position
            lo = np.zeros_like(pos) if window is None else np.maximum(pos - window + 1, 0)
            sink = None if sinks is None else np.tile(np.asarray(sinks, _f32)[g * r : (g + 1) * r], t)
            y = _online_softmax(kq, values, lo, pos, sink)  # (t*r, E)
            out[rows, g * r : (g + 1) * r] = y.reshape(t, r, E)
    return out.reshape(T, H * E)


def _online_softmax(kq, values, lo, hi, sink) -> np.ndarray:
    """The one_chunk loop over cells for every row at once: rows (R,) see cells lo..hi (inclusive)."""
    R, E = kq.shape[0], values.shape[1]
    M = np.full(R, -np.inf, _f32)
    S = np.zeros(R, _f32)
    vkq = np.zeros((R, E), _f32)
    for ic in range(int(lo.min()), int(hi.max()) + 1):
        seen = (lo <= ic) & (ic <= hi)  # the others are masked: skipped, not added as zeros
        s = kq[:, ic]
        new = seen & (s > M)
        old = seen & ~new
        ms = np.ones(R, _f32)
        vs = np.ones(R, _f32)
        ms[new] = _expf(M[new] - s[new])
        vs[old] = _expf(s[old] - M[old])
        M[new] = s[new]
        vkq[new] *= ms[new, None]  # ggml_vec_scale_f32
        vkq[seen] = fma(values[ic], vs[seen, None], vkq[seen])  # ggml_vec_mad_f32
        S[seen] = fma(S[seen], ms[seen], vs[seen])
    if sink is not None:  # after the cells: the sink joins the max and the sum, with no value
        new = sink > M
        ms = np.where(new, _expf(np.where(new, M - sink, 0)), _f32(1))
        vs = np.where(new, _f32(1), _expf(np.where(new, 0, sink - M)))
        vkq *= ms[:, None]
        S = fma(S, ms, vs)
    with np.errstate(divide="ignore"):
        inv = np.where(S == 0, _f32(0), _f32(1) / S)  # `S_inv = S == 0.0f ? 0.0f : 1.0f/S`
    return vkq * inv[:, None]
