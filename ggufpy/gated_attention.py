"""Qwen3.5's (and Qwen3-Next's) gated attention: the full-attention layers between their DeltaNet layers.

It differs from qwen3's attention in three ways (llama.cpp `src/models/qwen35.cpp` `build_layer_attn`):
- attn_q (2*H*E, D) yields, per head, the query and an output gate side by side: (T, H, 2, E);
- the attention output is multiplied by sigmoid(gate) before attn_output;
- RoPE is IMROPE over the first rope.dimension_count dims of each head (partial rotary). For text, llama.cpp gives
  the t, h and w positions the token's position and the 4th (e) position 0, so IMROPE is NeoX RoPE except on the
  pairs whose section is e, which stay unrotated (angle 0). The real models' sections (11, 11, 10, 0) have none.
  qwen3next has no sections: NeoX RoPE (src/models/qwen3next.cpp `ggml_rope_ext`).
Shape letters as in ops.py (T, D, H, G, E, R, S).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import ops

if TYPE_CHECKING:
    from .backend import Backend
    from .kvcache import KVCache
    from .weights import QuantTensor


@dataclass(frozen=True, eq=False)
class GatedAttentionWeights:
    attn_q: QuantTensor  # (2*H*E, D): per head, E query rows then E gate rows
    attn_k: QuantTensor  # (G*E, D)
    attn_v: QuantTensor  # (G*E, D)
    attn_q_norm: np.ndarray  # (E,)
    attn_k_norm: np.ndarray  # (E,)
    attn_output: QuantTensor  # (D, H*E)


def load_gated_attention_weights(f, n_heads: int, n_kv_heads: int, head_dim: int, dim: int, layer: int):
    from .weights import tensor, vector

    p, Q, K = f"blk.{layer}.", n_heads * head_dim, n_kv_heads * head_dim
    return GatedAttentionWeights(
        attn_q=tensor(f, p + "attn_q.weight", (2 * Q, dim)),
        attn_k=tensor(f, p + "attn_k.weight", (K, dim)),
        attn_v=tensor(f, p + "attn_v.weight", (K, dim)),
        attn_q_norm=vector(f, p + "attn_q_norm.weight", head_dim),
        attn_k_norm=vector(f, p + "attn_k_norm.weight", head_dim),
        attn_output=tensor(f, p + "attn_output.weight", (dim, Q)),
    )


def imrope_unrotated(sections: tuple[int, ...], rope_dim: int) -> np.ndarray:
    """(R/2,) bool: the pairs IMROPE rotates by the e position, which is 0 for text tokens (ggml-cpu/ops.cpp
    `ggml_mrope_cache_init`, is_imrope: sector % 3 picks t, h, w within 3 * sections[.], else e)."""
    s0, s1, s2 = sections[0], sections[1], sections[2]
    total = sum(sections[:4])
    if total == 0:  # no sections: NeoX RoPE on every pair (qwen3next)
        return np.zeros(rope_dim // 2, bool)
    sector = np.arange(rope_dim // 2) % total
    t = (sector % 3 == 0) & (sector < 3 * s0)
    h = (sector % 3 == 1) & (sector < 3 * s1)
    w = (sector % 3 == 2) & (sector < 3 * s2)
    return ~(t | h | w)


def text_angles(cos: np.ndarray, sin: np.ndarray, unrotated: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NeoX angles (T, R/2) with the e-section pairs at angle 0 (cos 1, sin 0: rotate_pairs leaves them as they are)."""
    if not unrotated.any():
        return cos, sin
    return np.where(unrotated, np.float32(1), cos), np.where(unrotated, np.float32(0), sin)


def gated_attention(
    x: np.ndarray,
    w: GatedAttentionWeights,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    norm_eps: float,
    pos: int,
    cos: np.ndarray,
    sin: np.ndarray,
    cache: KVCache,
    layer: int,
    backend: Backend,
    rope: Callable,
    attention: Callable,
    sigmoid: Callable,
    rms_norm: Callable = ops.rms_norm,
    trace: dict | None = None,
) -> np.ndarray:
    """The attention mixer on x (T, D) = the normed residual stream at positions pos..pos+T-1: stores this call's
    K, V in `cache` (layer `layer`) and returns (T, D). `rope`, `attention` are the numerics mode's (or a
    backend's equivalent), `sigmoid` too (`DeltaNetMath.sigmoid`); cos, sin (T, R/2) as `text_angles` makes them."""
    from .backend import linears

    T, H, G, E = x.shape[0], n_heads, n_kv_heads, head_dim

    def record(name: str, value: np.ndarray) -> None:
        if trace is not None:
            trace[f"{name}-{layer}"] = value.copy()

    q_full, k, v = linears(backend, x, (w.attn_q, w.attn_k, w.attn_v))  # (T, 2*H*E), (T, G*E), (T, G*E)
    q_full = q_full.reshape(T, H, 2, E)  # per head: query, then gate
    q, gate = q_full[:, :, 0], q_full[:, :, 1].reshape(T, H * E)  # (T, H, E), (T, H*E)
    q = rms_norm(q, w.attn_q_norm, norm_eps)
    k = rms_norm(k.reshape(T, G, E), w.attn_k_norm, norm_eps)  # (T, G, E)
    v = v.reshape(T, G, E)
    q = rope(q, cos, sin, "neox")  # rotates the first R dims of each head
    k = rope(k, cos, sin, "neox")
    record("Qcur", q)
    record("Kcur", k)
    record("Vcur", v)
    keys, values = cache.update(layer, pos, k, v)  # (S, G, E) each
    scale = np.float32(1.0) / np.sqrt(np.float32(E))  # 1.0f / sqrtf(n_embd_head) (no f_attention_scale)
    attn = attention(q, keys, values, pos, scale)  # (T, H*E)
    record("attn_pregate", attn)
    attn = attn * sigmoid(gate)
    record("attn_gated", attn)
    out = backend.linear(attn, w.attn_output)  # (T, D)
    record("attn_output", out)
    return out
