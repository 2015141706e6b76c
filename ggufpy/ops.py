"""The transformer's math as pure functions on float32 arrays.

Dimension alphabet used in the shape comments:
    T  tokens in this call          S  positions attended to (cache length after this call)
    D  dim                          F  hidden_dim (feed-forward)
    H  n_heads                      G  n_kv_heads (H / G query heads share a K/V head)
    E  head_dim                     R  rope_dim (rotated dims per head, <= E)
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis. Like ggml (ops.cpp `ggml_compute_forward_rms_norm_f32`), the mean of
    squares is accumulated in float64 and the scale is applied in float32."""
    mean = np.mean(np.square(x).astype(np.float64), axis=-1, keepdims=True).astype(np.float32)
    scale = (1.0 / np.sqrt(mean + np.float32(eps))).astype(np.float32)
    return (x * scale) * weight


def layer_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis without a bias (cohere2): (x - mean) / sqrt(variance + eps) * weight, the
    mean and variance accumulated in float64, the centring and scaling in float32 (ggml `ggml_norm`)."""
    mean = np.mean(x.astype(np.float64), axis=-1, keepdims=True).astype(np.float32)
    y = x - mean
    var = np.mean(np.square(y.astype(np.float64)), axis=-1, keepdims=True).astype(np.float32)
    return (y * (np.float32(1.0) / np.sqrt(var + np.float32(eps)))) * weight


class RopeExt(NamedTuple):
    """ggml_rope_ext's arguments beyond plain RoPE (ggml-cpu/ops.cpp `rope_yarn`): YaRN mixes, per pair i, the
    interpolated angle (times freq_scale) with the extrapolated one by ramp(i) * ext_factor, the ramp going
    from 1 below pair `corr_low` to 0 above `corr_high`, and then multiplies cos and sin by attn_factor
    (times 1 + 0.1 ln(1/freq_scale) when ext_factor != 0)."""

    ext_factor: float
    attn_factor: float
    corr_low: float
    corr_high: float


def yarn_corr_dims(rope_dim: int, orig_ctx: int, theta: float, beta_fast: float, beta_slow: float) -> tuple:
    """YaRN's correction range (ggml.c `ggml_rope_yarn_corr_dims`): the pairs whose wavelength turns
    beta_fast and beta_slow times in the original context, floored / ceiled, in float32 as ggml computes it."""
    f32 = np.float32

    def dim(n_rot: float) -> np.float32:  # n_dims * logf(n_ctx_orig / (n_rot * 2 * pi)) / (2 * logf(base))
        ratio = f32(orig_ctx) / (f32(n_rot) * f32(2) * f32(np.pi))
        return f32(rope_dim) * f32(np.log(ratio)) / (f32(2) * f32(np.log(f32(theta))))

    low, high = np.floor(dim(beta_fast)), np.ceil(dim(beta_slow))
    return float(max(0.0, low)), float(min(rope_dim - 1.0, high))


def yarn_ramp(ext: RopeExt, pairs: int) -> np.ndarray:
    """ramp_mix per pair (R/2,): (1 - clamp((i - low) / max(0.001, high - low), 0, 1)) * ext_factor."""
    y = (np.arange(pairs, dtype=np.float32) - np.float32(ext.corr_low)) / max(
        np.float32(0.001), np.float32(ext.corr_high) - np.float32(ext.corr_low)
    )
    return (np.float32(1) - np.minimum(np.float32(1), np.maximum(np.float32(0), y))) * np.float32(ext.ext_factor)


def rope_angles(
    positions: np.ndarray,
    rope_dim: int,
    theta: float,
    freq_scale: float = 1.0,
    freq_factors: np.ndarray | None = None,
    ext: RopeExt | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotation angles, each (T, R/2).

    Pair i rotates by pos * freq_scale * theta^(-2i/R) / freq_factors[i]  (ggml `rope_yarn`), with YaRN's
    mix and magnitude scaling when `ext` is given.
    """
    inv_freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)  # (R/2,)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    extrap = np.outer(positions.astype(np.float64), inv_freq)  # (T, R/2)
    angles = extrap * freq_scale
    mscale = 1.0
    if ext is not None:
        mscale = ext.attn_factor
        if ext.ext_factor != 0:
            mix = yarn_ramp(ext, rope_dim // 2).astype(np.float64)
            angles = angles * (1 - mix) + extrap * mix
            mscale *= 1.0 + 0.1 * np.log(1.0 / freq_scale)
    return (np.cos(angles) * mscale).astype(np.float32), (np.sin(angles) * mscale).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate the first R dims of every head. x: (T, heads, E); cos, sin: (T, R/2).

    "norm" pairs adjacent dims (2i, 2i+1); "neox" pairs dim i with i + R/2 (ggml ops.cpp `rope_f32`).
    """
    r = 2 * cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, R/2)
    out = x.copy()
    if style == "norm":
        x0, x1 = x[..., 0:r:2], x[..., 1:r:2]  # (T, heads, R/2) each
        out[..., 0:r:2] = x0 * c - x1 * s
        out[..., 1:r:2] = x0 * s + x1 * c
    else:
        x0, x1 = x[..., : r // 2], x[..., r // 2 : r]
        out[..., : r // 2] = x0 * c - x1 * s
        out[..., r // 2 : r] = x0 * s + x1 * c
    return out


def softmax(x: np.ndarray, axis: int = -1, out: np.ndarray | None = None) -> np.ndarray:
    """exp(x - max) / sum, along `axis`; into `out` when given (which may be x itself)."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.subtract(x, m, out=out)
    np.exp(e, out=e)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


# Bytes of scores one block of a prefill's queries may hold: a block's scores are (H, rows, S) f32, so memory
# grows with the cache length S, not with the square of the prompt (16k tokens x 32 heads at once: 32 GB)
ATTENTION_BUDGET = 64 << 20


def query_rows(T: int, S: int, heads: int, itemsize: int = 4, budget: int = ATTENTION_BUDGET) -> int:
    """How many of T queries one block of attention takes so that its (heads, rows, S) scores of `itemsize`
    bytes fit in `budget`: at least 2 (a 1-row block would take BLAS's matrix-vector path, which sums in
    another order than the matrix product the other rows go through), at most T."""
    return min(T, max(2, budget // max(1, heads * S * itemsize)))


def query_blocks(T: int, rows: int) -> list[slice]:
    """T queries in blocks of `rows`, none of 1 row where T >= 2 (see `query_rows`): a last single row joins
    the block before."""
    bounds = [*range(0, T, rows), T]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def attention(
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
    """Causal grouped-query attention of T new queries over S cached positions.

    q: (T, H, E) for positions start..start+T-1; k, v: (S, G, E) for positions 0..S-1. Returns (T, H*E).
    `window`: a query at position p sees only keys at p-window < position <= p (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD). `softcap`: scores become softcap * tanh(scores / softcap) (gemma2).
    `sinks` (H,): one extra logit per head that joins each softmax's denominator but has no value (gpt-oss's
    attn_sinks; ggml `ggml_soft_max_add_sinks`): the probabilities sum to less than 1.
    The queries go in blocks whose scores fit in `budget` bytes (`query_rows`); every row is computed over all
    S keys (masked ones too) whatever the block, so the result does not depend on the budget.
    """
    T, H, E = q.shape
    S = k.shape[0]
    out = np.empty((T, H * E), np.float32)
    for rows in query_blocks(T, query_rows(T, S, H, 4, budget)):
        p = start + rows.start
        out[rows] = _attention_block(q[rows], k, v, p, scale, window, softcap, sinks)
    return out


def _attention_block(q, k, v, start, scale, window, softcap, sinks) -> np.ndarray:
    """`attention` of one block of queries at positions start..start+T-1, all its scores at once."""
    T, H, E = q.shape
    S, G, _ = k.shape
    qg = q.reshape(T, G, H // G, E).transpose(1, 2, 0, 3)  # (G, H/G, T, E)
    kt = k.transpose(1, 2, 0)[:, None]  # (G, 1, E, S)
    scores = qg @ kt  # (G, H/G, T, S)
    # in place from here: a prefill's scores are MBs, and fresh temporaries that size fault their pages in
    scores *= np.float32(scale)
    if softcap:
        scores = apply_softcap(scores, softcap)
    np.copyto(scores, np.float32(-np.inf), where=attention_mask(start, T, S, window))
    if sinks is None:
        probs = softmax(scores, out=scores)
    else:
        probs = softmax_with_sinks(scores, np.asarray(sinks, np.float32).reshape(G, H // G, 1, 1))
    out = probs @ v.transpose(1, 0, 2)[:, None]  # (G, H/G, T, E)
    return out.transpose(2, 0, 1, 3).reshape(T, H * E)


def softmax_with_sinks(scores: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with one more logit per row, `sinks` (broadcast to scores[..., :1]), counted in
    the max and the sum only (ggml-cpu ops.cpp soft_max: max = MAX(max, sink), sum += expf(sink - max))."""
    m = np.maximum(np.max(scores, axis=-1, keepdims=True), sinks)
    e = np.exp(scores - m)
    return e / (np.sum(e, axis=-1, keepdims=True) + np.exp(sinks - m))


def attention_mask(start: int, T: int, S: int, window: int | None = None) -> np.ndarray:
    """True where query t (at position start+t) must not see key position s: (T, S)."""
    distance = (start + np.arange(T))[:, None] - np.arange(S)[None, :]  # query position - key position
    masked = distance < 0
    if window is not None:
        masked |= distance >= window
    return masked


def apply_softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap): squashes logits smoothly into (-cap, cap) (gemma2's attention and final logits)."""
    return np.float32(cap) * np.tanh(x / np.float32(cap))


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x < -88: the result is the correct -0
        return x / (np.float32(1.0) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x**3)))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}
