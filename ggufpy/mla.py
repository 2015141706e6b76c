"""Multi-head latent attention (deepseek2), as llama.cpp's src/models/deepseek2.cpp computes it: the config, the
layer's tensors, and the mixer `Model` runs on a deepseek2 layer (`ArchSpec.mixer == "mla"`).

The cache holds what llama.cpp's MLA cache holds, one row per position (a single "KV head", MQA, keys only):

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

Files with one `attn_kv_b` (H*(Dn + Dv), R) instead (older conversions; no key_length_mla) take llama.cpp's other
path: keys and values decompressed per head, concat(kv @ k_b[h], k_pe) and kv @ v_b[h], in a per-head cache of
Dn + Dr wide keys and Dv wide values (`attention_naive` is the same attention from the latent). The two forms
agree up to rounding (tests/test_llama4_mla.py, tests/test_deepseek2.py). kq_scale is 1/sqrt(Dn + Dr) times
YaRN's mscale squared (deepseek2.cpp). Shape letters as in `ops.py`, plus R, Rq (q_lora_rank), Dn, Dr, Dv.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import ops, schema
from .errors import GGUFUnsupportedError
from .numerics import logf

if TYPE_CHECKING:
    from .config import RopeScaling
    from .numerics import Numerics
    from .transformer import Model
    from .weights import ExpertTensor, LayerWeights, QuantTensor

_f32 = np.float32


# -- the config --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int  # Rq: attn_q_a / attn_q_b around attn_q_a_norm; 0 = one attn_q product (V2-Lite)
    kv_lora_rank: int  # R: the latent's width
    key_dim: int  # Dn + Dr: each head's query and key before absorption (key_length_mla)
    value_dim: int  # Dv: each head's value after decompression (value_length_mla)
    rope_dim: int  # Dr: the rotated tail of each query head and of the shared key
    absorbed: bool  # attn_k_b / attn_v_b and the latent cache; False: attn_kv_b and a per-head cache
    kq_scale: float  # deepseek2.cpp's, with YaRN's mscale

    @property
    def nope_dim(self) -> int:
        return self.key_dim - self.rope_dim


_A = "{arch}.attention."
MLA_KEYS: dict[str, schema.Key] = {
    "q_lora_rank": schema.Key(_A + "q_lora_rank", "integer", schema.Rule("an integer >= 0", (0).__le__), default=0),
    "kv_lora_rank": schema.Key(_A + "kv_lora_rank", "integer", schema.SIZE, required=True),
    "key_dim": schema.Key(_A + "key_length_mla", "integer", schema.SIZE),
    "value_dim": schema.Key(_A + "value_length_mla", "integer", schema.SIZE),
    "value_length": schema.Key(_A + "value_length", "integer", schema.SIZE),
    "temperature": schema.Key(_A + "temperature_scale", "number", default=0.0),
}


def mla_config(
    md: Mapping[str, Any],
    arch: str,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    rope_dim: int,
    scaling: RopeScaling,
    source: str | None = None,
) -> MLAConfig:
    """The MLA hparams (llama_model_deepseek2::load_arch_hparams), checked against the head sizes the cache and
    the tensors take: `head_dim` is key_length, the cache's row (R + Dr with MLA)."""
    m = schema.read_all(md, MLA_KEYS, arch=arch, source=source)

    def key(field: str) -> str:
        return MLA_KEYS[field].name.replace("{arch}", arch)

    if (m["key_dim"] is None) != (m["value_dim"] is None):  # llama_hparams::is_mla asserts both or neither
        raise schema.fail(key("key_dim"), m["key_dim"], f"must be set together with {key('value_dim')}", source)
    if m["temperature"]:  # mistral-large's temperature tuning in deepseek2.cpp
        raise GGUFUnsupportedError(f"{source or 'model'}: {key('temperature')} is not supported for {arch}")
    R, absorbed = m["kv_lora_rank"], m["key_dim"] is not None
    key_dim = m["key_dim"] if absorbed else head_dim  # n_embd_head_k_mla(): key_length without the MLA keys
    value_dim = m["value_dim"] if absorbed else m["value_length"] or head_dim
    heads, length = f"{arch}.attention.head_count_kv", f"{arch}.attention.key_length"
    if key_dim <= rope_dim:  # deepseek2.cpp asserts n_embd_head_qk_nope >= 1
        raise schema.fail(
            key("key_dim") if absorbed else length, key_dim, f"must exceed the {rope_dim} rotated dims", source
        )
    if absorbed and head_dim != R + rope_dim:
        raise schema.fail(length, head_dim, f"must be kv_lora_rank + rope dims = {R + rope_dim}", source)
    if absorbed and n_kv_heads != 1:  # the latent cache is one row per position
        raise schema.fail(heads, n_kv_heads, "must be 1 with attention.key_length_mla (MLA's latent cache)", source)
    if not absorbed and n_kv_heads != n_heads:
        raise schema.fail(heads, n_kv_heads, f"must be head_count = {n_heads} without key_length_mla", source)
    kq = kq_scale(key_dim, scaling.attn_factor, scaling.freq_scale, scaling.log_mul)
    return MLAConfig(m["q_lora_rank"], R, key_dim, value_dim, rope_dim, absorbed, kq)


def kq_scale(head_k: int, attn_factor: float, freq_scale: float, log_mul: float) -> float:
    """deepseek2.cpp's KQ scale: the original attn_factor (YaRN's adjustment cancelled), its mscale squared over
    sqrt(Dn + Dr), in f32 as there (`log_mul` as the loader holds it, after its / 0.1f)."""
    log_inv = logf(_f32(1) / _f32(freq_scale))
    org = _f32(attn_factor) * (_f32(1) + _f32(0.1) * log_inv)
    mscale = org * (_f32(1) + _f32(0.1) * _f32(log_mul) * log_inv)
    return float(_f32(1) * mscale * mscale / np.sqrt(_f32(head_k)))


# -- the layer's tensors -----------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MLAWeights:
    """One layer's attention tensors (llama_model_deepseek2::load_arch_tensors), NumPy shapes."""

    attn_kv_a_mqa: QuantTensor  # (R + Dr, D)
    attn_kv_a_norm: np.ndarray  # (R,)
    attn_output: QuantTensor  # (D, H*Dv)
    attn_q: QuantTensor | None = None  # (H*(Dn + Dr), D) without q compression
    attn_q_a: QuantTensor | None = None  # (Rq, D)
    attn_q_a_norm: np.ndarray | None = None  # (Rq,)
    attn_q_b: QuantTensor | None = None  # (H*(Dn + Dr), Rq)
    attn_k_b: ExpertTensor | None = None  # (H, R, Dn): one matrix per head (a 3-D ggml_mul_mat)
    attn_v_b: ExpertTensor | None = None  # (H, Dv, R)
    attn_kv_b: QuantTensor | None = None  # (H*(Dn + Dv), R): both in one, the older files


def load_layer(f, cfg, i: int) -> LayerWeights:
    """Layer i of a deepseek2 file: the attention's tensors in `mixer`, then a dense feed-forward (the leading
    layers) or the routed and shared experts with the optional `exp_probs_b` selection bias."""
    from .weights import ExpertTensor, LayerWeights, expert_tensors, tensor, vector

    D, H, F, m, p = cfg.dim, cfg.n_heads, cfg.hidden_dim, cfg.mla, f"blk.{i}."
    R, Dn, Dr, Dv = m.kv_lora_rank, m.nope_dim, m.rope_dim, m.value_dim
    attn = dict(
        attn_kv_a_mqa=tensor(f, p + "attn_kv_a_mqa.weight", (R + Dr, D)),
        attn_kv_a_norm=vector(f, p + "attn_kv_a_norm.weight", R),
        attn_output=tensor(f, p + "attn_output.weight", (D, H * Dv)),
    )
    if m.q_lora_rank:
        attn.update(
            attn_q_a=tensor(f, p + "attn_q_a.weight", (m.q_lora_rank, D)),
            attn_q_a_norm=vector(f, p + "attn_q_a_norm.weight", m.q_lora_rank),
            attn_q_b=tensor(f, p + "attn_q_b.weight", (H * m.key_dim, m.q_lora_rank)),
        )
    else:
        attn["attn_q"] = tensor(f, p + "attn_q.weight", (H * m.key_dim, D))
    if m.absorbed:
        for name, shape in (("attn_k_b", (H, R, Dn)), ("attn_v_b", (H, Dv, R))):
            t = tensor(f, p + name + ".weight", shape)
            attn[name] = ExpertTensor.view(t.name, t.type, shape, t.raw)
    else:
        attn["attn_kv_b"] = tensor(f, p + "attn_kv_b.weight", (H * (Dn + Dv), R))
    if cfg.is_moe_layer(i):
        ffn = expert_tensors(f, cfg, p)
        if p + "exp_probs_b.bias" in f.tensors:  # DeepSeek V3 and later (TENSOR_NOT_REQUIRED)
            ffn["ffn_exp_probs_b"] = vector(f, p + "exp_probs_b.bias", cfg.n_experts)
    else:
        shapes = {"ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
        ffn = {name: tensor(f, p + name + ".weight", shape) for name, shape in shapes.items()}
    return LayerWeights(
        attn_norm=vector(f, p + "attn_norm.weight", D),
        attn_q=None,
        attn_k=None,
        attn_v=None,
        attn_output=None,
        ffn_norm=vector(f, p + "ffn_norm.weight", D),
        mixer=MLAWeights(**attn),
        **ffn,
    )


# -- the mixer ---------------------------------------------------------------------------------------------------


def mixer(model: Model, x: np.ndarray, w: LayerWeights, i: int, seqs, cos, sin, trace=None) -> np.ndarray:
    """The attention of deepseek2 layer i on x (N, D), for `seqs` = [(position, cache)] each owning N / len(seqs)
    consecutive rows (the transformer's `_block` contract): each sequence on its own rows, as a forward pass of
    it alone, so `decode_batch` rows equal single decodes bit for bit."""
    n = x.shape[0] // len(seqs)
    out = np.empty_like(x)
    for s, (pos, cache) in enumerate(seqs):
        r = slice(s * n, (s + 1) * n)
        out[r] = _attention(model, x[r], w.mixer, i, pos, cache, cos[r], sin[r], trace)
    return out


def _attention(model: Model, x, w: MLAWeights, i: int, pos: int, cache, cos, sin, trace) -> np.ndarray:
    """deepseek2.cpp's attention of one sequence's rows x (T, D) at positions pos..: the latent, absorbed form
    when the file has attn_k_b / attn_v_b, the decompressed one with attn_kv_b."""
    cfg, nm, be = model.config, model.numerics, model.backend
    m, T, H, eps = cfg.mla, x.shape[0], cfg.n_heads, cfg.norm_eps
    R, Dn = m.kv_lora_rank, m.nope_dim
    if w.attn_q is not None:
        q = be.linear(x, w.attn_q)
    else:
        q = be.linear(model.rms_norm(be.linear(x, w.attn_q_a), w.attn_q_a_norm, eps), w.attn_q_b)
    q = q.reshape(T, H, m.key_dim)  # (T, H, Dn + Dr)
    kv_pe = be.linear(x, w.attn_kv_a_mqa)  # (T, R + Dr)
    rope = model.compiled.get(nm.rope, nm.rope)
    style = cfg.arch.rope_style
    k_pe = rope(np.ascontiguousarray(kv_pe[:, None, R:]), cos, sin, style)  # (T, 1, Dr)
    kv = model.rms_norm(np.ascontiguousarray(kv_pe[:, :R]), w.attn_kv_a_norm, eps)  # (T, R)
    q_pe = rope(np.ascontiguousarray(q[..., Dn:]), cos, sin, style)  # (T, H, Dr)
    if m.absorbed:
        q_abs = per_head(be, nm, np.ascontiguousarray(q[..., :Dn]), w.attn_k_b, permuted=True)  # (T, H, R)
        Q = np.concatenate([q_abs, q_pe], axis=-1)  # (T, H, R + Dr)
        K = np.concatenate([kv[:, None], k_pe], axis=-1)  # (T, 1, R + Dr)
        keys, _ = cache.update(i, pos, K, K[..., :0])  # (S, 1, R + Dr): the K-only cache
        o = attend(Q, keys, keys[..., :R], pos, m.kq_scale, nm)  # (T, H, R)
        o = per_head(be, nm, o, w.attn_v_b, permuted=False)  # (T, H, Dv): ggml's kqv_mla
    else:
        kvb = be.linear(kv, w.attn_kv_b).reshape(T, H, Dn + m.value_dim)  # (T, H, Dn + Dv)
        Q = np.concatenate([q[..., :Dn], q_pe], axis=-1)  # RoPE on the trailing dims (ggml_rope_set_offset)
        K = np.concatenate([kvb[..., :Dn], np.broadcast_to(k_pe, (T, H, m.rope_dim))], axis=-1)  # (T, H, Dn + Dr)
        keys, values = cache.update(i, pos, K, kvb[..., Dn:])  # (S, H, Dn + Dr), (S, H, Dv)
        o = attend(Q, keys, values, pos, m.kq_scale, nm)  # (T, H, Dv)
    if trace is not None:
        trace[f"Qcur-{i}"], trace[f"Kcur-{i}"] = Q.copy(), K.copy()
        trace[f"kqv_out-{i}"] = o.reshape(T, -1).copy()
    return be.linear(o.reshape(T, -1), w.attn_output)  # (T, D)


def per_head(backend, numerics: Numerics, x: np.ndarray, heads: ExpertTensor, permuted: bool) -> np.ndarray:
    """x (T, H, n) times head h's matrix of `heads` (H, out, n): ggml_mul_mat over a 3-D weight, one 2-D product per
    head -> (T, H, out). `permuted`: x is a permuted view in ggml (q_nope), and an F32 weight then multiplies it by
    `ggml_vec_dot_f32` per row (ggml-cpu.c skips llamafile_sgemm for a non-contiguous src1 it does not convert);
    the other types convert it to their vec_dot type first, which makes it contiguous: the 2-D product."""
    from .constants import GGMLType

    one_row = permuted and numerics.x86_kernels and heads.type == GGMLType.F32
    out = np.empty((x.shape[0], x.shape[1], heads.shape[1]), _f32)
    for h in range(x.shape[1]):
        w = heads.expert(h)
        if one_row:
            out[:, h] = np.concatenate([backend.linear(x[t : t + 1, h], w) for t in range(len(x))])
        else:
            out[:, h] = backend.linear(np.ascontiguousarray(x[:, h]), w)
    return out


# -- attention with values narrower than the keys -----------------------------------------------------------------


def attend(q, k, v, start: int, scale: float, numerics: Numerics) -> np.ndarray:
    """Causal attention of q (T, H, Ek) at positions start.. over k (S, G, Ek) and v (S, G, Ev), Ev != Ek
    (MLA's values are the first R dims of its keys) -> (T, H, Ev): llama.cpp's kernels replayed where the
    numerics replay them (`_attend_x86`), f32 otherwise."""
    if numerics.x86_kernels:
        return _attend_x86(q, k, v, start, scale, numerics.x86_isa)
    return _attend(q, k, v, start, scale)


def _attend_x86(q, k, v, start: int, scale: float, isa: str) -> np.ndarray:
    """`quants.x86.attention` (build_attn_mha, flash attention off) with values of their own width: per head,
    kq = mul_mat(K f16, fp16(Q)) over the padded cache, soft_max_ext, kqv = mul_mat(V^T f16, fp16(p)). ggml's V
    here is a view of the K cache transposed by ggml_cont (MLA) or the v_trans cache: the same f16 rows."""
    from .quants.x86.attention import n_kv_cells, soft_max_ext
    from .quants.x86.floats import matmul_f16

    T, H, Ek = q.shape
    S, G, Ev = v.shape
    n_kv = n_kv_cells(S)
    distance = (start + np.arange(T))[:, None] - np.arange(n_kv)[None, :]
    mask = np.where((distance < 0) | (np.arange(n_kv) >= S)[None, :], _f32(-np.inf), _f32(0))  # (T, n_kv)
    with np.errstate(over="ignore"):
        q16 = np.asarray(q, _f32).astype(np.float16)  # mul_mat converts Q to F16's vec_dot type
    out = np.empty((T, H, Ev), _f32)
    for g in range(G):
        kc = np.zeros((n_kv, Ek), np.float16)  # the cache view: n_kv cells, zeros past S
        kc[:S] = k[:, g]
        vt = np.zeros((Ev, n_kv), np.float16)
        vt[:, :S] = v[:, g].T
        for h in range(g * (H // G), (g + 1) * (H // G)):
            probs = soft_max_ext(matmul_f16(kc, q16[:, h], isa), mask, scale, isa)  # (T, n_kv)
            out[:, h] = matmul_f16(vt, probs.astype(np.float16), isa)  # (T, Ev)
    return out


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float) -> np.ndarray:
    """Causal attention, q (T, H, E), k (S, H or 1, E), v (S, H or 1, Dv) -> (T, H, Dv): `ops.attention` with
    values of another width than the keys."""
    scores = np.einsum("the,she->hts", q, np.broadcast_to(k, (k.shape[0], q.shape[1], k.shape[2])))  # (H, T, S)
    scores = scores.astype(_f32) * _f32(scale)
    np.copyto(scores, _f32(-np.inf), where=ops.attention_mask(start, q.shape[0], k.shape[0]))
    probs = ops.softmax(scores)
    return np.einsum("hts,shv->thv", probs, np.broadcast_to(v, (v.shape[0], q.shape[1], v.shape[2])).astype(_f32))


# -- the maths on their own (tests/test_llama4_mla.py) ------------------------------------------------------------


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
