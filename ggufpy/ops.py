"""The transformer's math as pure functions on float32 arrays.

Dimension alphabet used in the shape comments:
    T  tokens in this call          S  positions attended to (cache length after this call)
    D  dim                          F  hidden_dim (feed-forward)
    H  n_heads                      G  n_kv_heads (H / G query heads share a K/V head)
    E  head_dim                     R  rope_dim (rotated dims per head, <= E)
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis. Like ggml (ops.cpp `ggml_compute_forward_rms_norm_f32`), the mean of
    squares is accumulated in float64 and the scale is applied in float32."""
    mean = np.mean(np.square(x).astype(np.float64), axis=-1, keepdims=True).astype(np.float32)
    scale = (1.0 / np.sqrt(mean + np.float32(eps))).astype(np.float32)
    return (x * scale) * weight


def rope_angles(
    positions: np.ndarray, rope_dim: int, theta: float, freq_scale: float = 1.0, freq_factors: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotation angles, each (T, R/2).

    Pair i rotates by pos * freq_scale * theta^(-2i/R) / freq_factors[i]  (ggml `rope_yarn` without ext).
    """
    inv_freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)  # (R/2,)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    angles = np.outer(positions.astype(np.float64) * freq_scale, inv_freq)  # (T, R/2)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


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


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """Causal grouped-query attention of T new queries over S cached positions.

    q: (T, H, E) for positions start..start+T-1; k, v: (S, G, E) for positions 0..S-1. Returns (T, H*E).
    `window`: a query at position p sees only keys at p-window < position <= p (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD). `softcap`: scores become softcap * tanh(scores / softcap) (gemma2).
    """
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
    probs = softmax(scores, out=scores)
    out = probs @ v.transpose(1, 0, 2)[:, None]  # (G, H/G, T, E)
    return out.transpose(2, 0, 1, 3).reshape(T, H * E)


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
