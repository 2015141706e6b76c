"""Multi-head latent attention (deepseek2), as llama.cpp's src/models/deepseek2.cpp computes it: the maths only,
not yet a mixer of `Model` (issue 13: config, weights, the per-layer cache and the fixture are still to come).

The cache holds what llama.cpp's MLA cache holds, one row per position (a single "KV head", MQA):

    kv_cmpr_pe = x @ attn_kv_a_mqa.T                      (T, R + Dr)  R = kv_lora_rank, Dr = rope dims
    kv         = rms_norm(kv_cmpr_pe[:, :R], attn_kv_a_norm)  (T, R)   the latent: K's first R dims and V
    k_pe       = rope(kv_cmpr_pe[:, R:])                  (T, Dr)      the decoupled RoPE key, shared by all heads
    cached K   = concat(kv, k_pe)                          (S, R + Dr)

and each head's query is absorbed into the latent space instead of decompressing the keys:

    q          = x @ attn_q.T   (or attn_q_b(rms_norm(attn_q_a(x), attn_q_a_norm)))  (T, H, Dn + Dr)
    q_abs      = q_nope @ attn_k_b[h]                      (T, H, R)   attn_k_b: (H, R, Dn) as stored
    Q          = concat(q_abs, rope(q_pe))                 (T, H, R + Dr)
    o          = softmax(kq_scale * Q . K) @ kv            (T, H, R)   V is the latent itself
    out        = (o @ attn_v_b[h].T) @ attn_output.T       (T, D)      attn_v_b: (H, Dv, R) as stored

`attention_naive` is the same attention with the keys and values decompressed per head (llama.cpp's path for
files with one `attn_kv_b`): the two agree up to rounding (tests/test_llama4_mla.py). kq_scale is
1/sqrt(Dn + Dr) times YaRN's mscale squared (deepseek2.cpp). Shape letters as in `ops.py`, plus R, Dn, Dr, Dv.
"""

from __future__ import annotations

import numpy as np

from . import ops


def latent_cache_rows(kv_cmpr_pe: np.ndarray, kv_norm: np.ndarray, eps: float, cos, sin, rank: int) -> np.ndarray:
    """The cache rows (T, R + Dr) of kv_cmpr_pe (T, R + Dr): the normed latent, then the roped key part."""
    kv = ops.rms_norm(kv_cmpr_pe[:, :rank], kv_norm, eps)  # (T, R)
    k_pe = ops.rope(kv_cmpr_pe[:, None, rank:], cos, sin, "norm")[:, 0]  # (T, Dr)
    return np.concatenate([kv, k_pe], axis=1)


def attention_absorbed(q, cache, start: int, k_b: np.ndarray, v_b: np.ndarray, cos, sin, kq_scale: float):
    """q (T, H, Dn + Dr) at positions start..; cache (S, R + Dr); k_b (H, R, Dn); v_b (H, Dv, R) -> (T, H*Dv)."""
    T = q.shape[0]
    R, Dn = k_b.shape[1], k_b.shape[2]
    q_abs = np.einsum("thn,hrn->thr", q[..., :Dn], k_b)  # (T, H, R)
    q_pe = ops.rope(np.ascontiguousarray(q[..., Dn:]), cos, sin, "norm")  # (T, H, Dr)
    Q = np.concatenate([q_abs, q_pe], axis=-1)  # (T, H, R + Dr)
    o = _attend(Q, cache[:, None, :], cache[:, None, :R], start, kq_scale)  # (T, H, R): MQA over the latent
    return np.einsum("thr,hvr->thv", o, v_b).reshape(T, -1)  # (T, H*Dv)


def attention_naive(q, cache, start: int, k_b: np.ndarray, v_b: np.ndarray, cos, sin, kq_scale: float):
    """The same attention with per-head keys concat(kv @ k_b[h], k_pe) and values kv @ v_b[h].T."""
    R, Dn = k_b.shape[1], k_b.shape[2]
    kv, k_pe = cache[:, :R], cache[:, R:]  # (S, R), (S, Dr)
    k_nope = np.einsum("sr,hrn->shn", kv, k_b)  # (S, H, Dn)
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None, :], (*k_nope.shape[:2], k_pe.shape[1]))], axis=-1)
    v = np.einsum("sr,hvr->shv", kv, v_b)  # (S, H, Dv)
    q_pe = ops.rope(np.ascontiguousarray(q[..., Dn:]), cos, sin, "norm")
    Q = np.concatenate([q[..., :Dn], q_pe], axis=-1)  # (T, H, Dn + Dr)
    return _attend(Q, k, v, start, kq_scale).reshape(len(q), -1)  # (T, H*Dv)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float) -> np.ndarray:
    """Causal attention, q (T, H, E), k (S, H or 1, E), v (S, H or 1, Dv) -> (T, H, Dv): `ops.attention` with
    values of another width than the keys."""
    scores = np.einsum("the,she->hts", q, np.broadcast_to(k, (k.shape[0], q.shape[1], k.shape[2])))  # (H, T, S)
    scores = scores * np.float32(scale)
    np.copyto(scores, np.float32(-np.inf), where=ops.attention_mask(start, q.shape[0], k.shape[0]))
    probs = ops.softmax(scores)
    return np.einsum("hts,shv->thv", probs, np.broadcast_to(v, (v.shape[0], q.shape[1], v.shape[2])))


def kq_scale(head_k: int, attn_factor: float, freq_scale: float, log_mul: float) -> float:
    """deepseek2.cpp's KQ scale: the original attn_factor (YaRN's adjustment cancelled), its mscale squared over
    sqrt(Dn + Dr), in f32 as there."""
    f32 = np.float32
    log_inv = f32(np.log(f32(1) / f32(freq_scale)))
    org = f32(attn_factor) * (f32(1) + f32(0.1) * log_inv)
    mscale = org * (f32(1) + f32(0.1) * f32(log_mul) * log_inv)
    return float(f32(1) * mscale * mscale / np.sqrt(f32(head_k)))
