"""Causal grouped-query attention over the KV cache, one parallel task per (query, head).

Same contract as `ggufpy.ops.attention` (exact numerics): q (T, H, E) at positions start..start+T-1, k and v
(S, G, E) for positions 0..S-1, optional sliding `window` and logit `softcap`; returns (T, H*E). NumPy's
version goes through batched BLAS calls whose worker threads fight numba's for the cores during decode; this
one computes each head's scores, softmax and weighted sum of V in one pass over the visible keys only.
Results equal the NumPy ones up to f32 summation order.
"""

from __future__ import annotations

import numpy as np

from ._numba import DISABLED, get_threads, jit, prange, use_threads
from .batched_ir import carray, f32_pointer

__all__ = ["attention", "attention_rows", "exp_nonpositive"]

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split in two (Cody-Waite), so n * ln2_hi is exact
_LN2_LO = np.float32(-2.12194440e-4)


@jit(inline=True)
def exp_nonpositive(x):
    """exp(x) for f32 x <= 0 to a relative error below 3e-7 (a few ulp), as plain arithmetic that LLVM can
    vectorize (libm's expf is a call per element): x = n ln2 + r with |r| <= ln2/2, exp(r) by its degree-6
    Taylor polynomial, times 2^n built from the exponent bits. Results below 2^-126 flush to 0, which a
    softmax cannot tell apart."""
    x = max(x, np.float32(-104.0))  # also maps -inf to a value that flushes to 0
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    e = np.int32(n) + np.int32(127)
    scale = np.int32(max(e, np.int32(0)) << 23).view(np.float32)  # 2^n, or 0 below the normal range
    return p * scale


@jit(fast=True)  # not inlined: a serial function keeps `reassoc` (see `_numba.FAST`), which vectorizes the sum
def _dot(a, b, n):
    """sum(a[:n] * b[:n]) in f32."""
    total = np.float32(0.0)
    for i in range(n):
        total += a[i] * b[i]
    return total


@jit(fast=True)
def _sum(a, n):
    """sum(a[:n]) in f32."""
    total = np.float32(0.0)
    for i in range(n):
        total += a[i]
    return total


@jit(parallel=True, fast=True)
def _attention(nt, q, k, v, start, scale, window, softcap, out):
    previous = use_threads(nt)
    T, H, E = q.shape
    S, G, _ = k.shape
    per_group = H // G
    for i in prange(T * H):
        t = i // H
        h = i % H
        g = h // per_group
        pos = start + t
        lo = max(0, pos - window + 1) if window > 0 else 0  # keys lo..hi-1 are visible
        hi = min(S, pos + 1)
        scores = np.empty(max(hi - lo, 0), np.float32)
        qh = q[t, h]
        peak = np.float32(-np.inf)
        for s in range(lo, hi):
            acc = _dot(qh, k[s, g], E) * scale
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
            p = scores[s - lo] / total
            for e in range(E):
                out[t, h, e] += p * v[s, g, e]
    use_threads(previous)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    threads: int = 0,
) -> np.ndarray:
    """`ops.attention` as a numba kernel: (T, H, E) queries over (S, G, E) keys and values -> (T, H*E), on
    `threads` threads (0: numba's current count)."""
    T, H, E = q.shape
    out = np.empty((T, H, E), np.float32)
    _attention(
        threads or get_threads(),
        np.ascontiguousarray(q, np.float32),
        np.ascontiguousarray(k, np.float32),
        np.ascontiguousarray(v, np.float32),
        int(start),
        np.float32(scale),
        int(window or 0),
        np.float32(softcap or 0.0),
        out,
    )
    return out.reshape(T, H * E)


# -- batched decode: one token of each of B sequences, every (row, head) in one call --------------------------
@jit(parallel=True, fast=True)
def _attention_rows(nt, q, keys, values, lengths, G, scale, window, softcap, out):
    """Row b of q (B, H, E) at position lengths[b] - 1 over its own cache: keys[b], values[b] are the addresses
    of (lengths[b], G, E) f32 arrays. Each (row, head) is `_attention`'s task for T = 1 in its own code, so a
    row equals its call alone bit for bit (tests/test_batch.py)."""
    previous = use_threads(nt)
    B, H, E = q.shape
    per_group = H // G
    for i in prange(B * H):
        b = i // H
        h = i % H
        g = h // per_group
        S = lengths[b]
        k = carray(f32_pointer(keys[b]), (S, G, E))
        v = carray(f32_pointer(values[b]), (S, G, E))
        pos = S - 1
        lo = max(0, pos - window + 1) if window > 0 else 0  # keys lo..hi-1 are visible
        hi = min(S, pos + 1)
        scores = np.empty(max(hi - lo, 0), np.float32)
        qh = q[b, h]
        peak = np.float32(-np.inf)
        for s in range(lo, hi):
            acc = _dot(qh, k[s, g], E) * scale
            if softcap > 0:
                acc = softcap * np.tanh(acc / softcap)
            scores[s - lo] = acc
            peak = max(peak, acc)
        for j in range(hi - lo):
            scores[j] = exp_nonpositive(scores[j] - peak)
        total = _sum(scores, hi - lo)
        for e in range(E):
            out[b, h, e] = 0.0
        for s in range(lo, hi):
            p = scores[s - lo] / total
            for e in range(E):
                out[b, h, e] += p * v[s, g, e]
    use_threads(previous)


def attention_rows(
    q: np.ndarray,
    kv: list[tuple[np.ndarray, np.ndarray]],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    threads: int = 0,
) -> np.ndarray:
    """`attention` of B sequences at once: row b of q (B, H, E) is the last position of its own keys and values
    kv[b] = ((S_b, G, E), (S_b, G, E)), the views `KVCache.update` returns. -> (B, H*E), row b bit for bit
    `attention(q[b:b+1], *kv[b], S_b - 1, scale, ...)`, in one call instead of B."""
    B, H, E = q.shape
    if DISABLED:  # plain Python: no addresses to read arrays from
        return np.concatenate(
            [attention(q[b : b + 1], k, v, len(k) - 1, scale, window, softcap) for b, (k, v) in enumerate(kv)]
        )
    ks = [np.ascontiguousarray(k, np.float32) for k, _ in kv]  # (views of a cache's first S rows: contiguous already)
    vs = [np.ascontiguousarray(v, np.float32) for _, v in kv]
    out = np.empty((B, H, E), np.float32)
    _attention_rows(
        threads or get_threads(),
        np.ascontiguousarray(q, np.float32),
        np.array([k.ctypes.data for k in ks], np.int64),
        np.array([v.ctypes.data for v in vs], np.int64),
        np.array([len(k) for k in ks], np.int64),
        ks[0].shape[1],
        np.float32(scale),
        int(window or 0),
        np.float32(softcap or 0.0),
        out,
    )
    return out.reshape(B, H * E)
