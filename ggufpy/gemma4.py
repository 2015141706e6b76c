"""Gemma 4 (llama.cpp `src/models/gemma4.cpp`): what its block adds to Gemma 3's, as data and small functions.

- **Per-layer shapes**: sliding-window (local) and global layers differ in head size (`attention.key_length_swa`
  against `key_length`), KV head count and widths (`head_count_kv`, `feed_forward_length` may be one value per
  layer), rotated dims (`rope.dimension_count_swa`) and RoPE base (`rope.freq_base_swa`); which layer is which
  is `attention.sliding_window_pattern`, one bool per layer. The global layers' "proportional" RoPE is
  `rope_freqs` (factor 1e30 on the unrotated pairs), read on those layers only.
- **The attention** (`attention`): no KQ scale (Gemma4 `self.scaling = 1.0`), V RMS-normed without weight, V is
  K where a layer has no `attn_v`; the last `attention.shared_kv_layers` layers compute only Q and read the
  cache of the last local / global layer that has K and V (llama-model.cpp's `reuse` callback).
- **Per-layer embeddings** (`per_layer_inputs`, `layer_output`): each token gets, per layer, a vector of
  `embedding_length_per_layer_input` from `per_layer_token_embd` and a projection of its embedding; after the
  feed-forward, h += post_norm(proj(gelu(inp_gate(h)) * that vector)); then h *= `layer_output_scale`.
  They need the token ids, so a model with them runs its layers from layer 0 (no shard starting later).
- **Experts** (26B-A4B; `ggufpy.gemma4_moe`): a layer with `ffn_gate_inp` runs its dense MLP as a shared expert beside
  routed ones: post_ffw_norm_1(mlp(ffn_norm(h))) + post_ffw_norm_2(moe(pre_ffw_norm_2(h))), the router reading
  rms_norm(h) / sqrt(D) * `ffn_gate_inp.scale`; softmax gating, weights normalised, GEGLU experts (gate and up
  fused in `ffn_gate_up_exps` or not), each expert's output times `ffn_down_exps.scale`.

Shape letters as in `ops.py`, plus L (layers) and P (per-layer input width).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import schema
from .errors import GGUFMetadataError
from .gemma4_moe import Gemma4Experts, add_experts, load_experts
from .kvcache import ContextLengthError, KVCache
from .weights import LayerWeights, QuantTensor, Weights, tensor, vector

if TYPE_CHECKING:
    from .config import ModelConfig
    from .transformer import Model

__all__ = ["Gemma4Cache", "Gemma4Config", "Gemma4Experts", "add_experts", "attention", "gemma4_config"]

_COUNT = schema.Rule("an integer >= 0", lambda v: v >= 0)
# field -> key (llama.cpp `llama_model_gemma4::load_arch_hparams` and the generic loader's _swa keys)
KEYS: dict[str, schema.Key] = {
    "head_dim_swa": schema.Key("{arch}.attention.key_length_swa", "integer", schema.SIZE, required=True),
    "value_dim_swa": schema.Key("{arch}.attention.value_length_swa", "integer", schema.SIZE, required=True),
    "value_dim": schema.Key("{arch}.attention.value_length", "integer", schema.SIZE),
    "rope_dim_swa": schema.Key("{arch}.rope.dimension_count_swa", "integer", schema.EVEN_SIZE),
    "rope_theta_swa": schema.Key("{arch}.rope.freq_base_swa", "number", schema.ROPE_BASE, default=10000.0),
    "shared_kv_layers": schema.Key("{arch}.attention.shared_kv_layers", "integer", _COUNT, default=0),
    "per_layer_dim": schema.Key("{arch}.embedding_length_per_layer_input", "integer", _COUNT, required=True),
    "sliding_window": schema.Key("{arch}.attention.sliding_window", "integer", schema.SIZE, required=True),
    # the experts of the layers with a router (0 = none); llama.cpp keeps at most LLAMA_MAX_EXPERTS (1024)
    "n_experts": schema.Key("{arch}.expert_count", "integer", _COUNT, default=0),
    "n_experts_used": schema.Key("{arch}.expert_used_count", "integer", _COUNT, default=0),
    "expert_hidden_dim": schema.Key("{arch}.expert_feed_forward_length", "integer", _COUNT, default=0),
}

# one bool per layer, True for a sliding-window layer (llama.cpp `get_arr`, required)
PATTERN = "{arch}.attention.sliding_window_pattern"
# keys llama.cpp reads with `get_key_or_arr`: one value, or one per layer
PER_LAYER = {
    "n_heads": "{arch}.attention.head_count",
    "n_kv_heads": "{arch}.attention.head_count_kv",
    "hidden_dim": "{arch}.feed_forward_length",
}


@dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4's per-layer hyperparameters; indexed by global layer number."""

    local: tuple[bool, ...]  # sliding-window layer
    n_heads: tuple[int, ...]
    n_kv_heads: tuple[int, ...]
    head_dim: tuple[int, ...]  # key_length_swa on local layers, key_length on global ones
    rope_dim: tuple[int, ...]
    hidden_dim: tuple[int, ...]
    kv_layer: tuple[int, ...]  # whose K/V layer i attends to: itself, or the last KV layer of its kind
    per_layer_dim: int  # P; 0 = no per-layer embeddings
    rope_theta_swa: float  # the local layers' RoPE base
    n_experts: int = 0  # X: routed experts of the layers with a router
    n_experts_used: int = 0  # K
    expert_hidden_dim: int = 0  # Fe

    def has_kv(self, layer: int) -> bool:
        return self.kv_layer[layer] == layer


def scalar_metadata(md: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The metadata with the per-layer arrays of `PER_LAYER` replaced by layer 0's value (llama.cpp's
    hparams.n_head() and n_ff() without a layer), for the keys `ModelConfig` reads as one number."""
    out = dict(md)
    for key in PER_LAYER.values():
        name = key.replace("{arch}", arch)
        value = md.get(name)
        if isinstance(value, (list, np.ndarray)) and len(value):
            out[name] = value[0]
    return out


def _per_layer(md: Mapping[str, Any], arch: str, field: str, n_layers: int, default: int, source) -> tuple[int, ...]:
    name = PER_LAYER[field].replace("{arch}", arch)
    value = md.get(name, default)
    if not isinstance(value, (list, np.ndarray)):
        return (int(value),) * n_layers
    array = schema.read(md, schema.Key(PER_LAYER[field], "integer array"), arch=arch, source=source)
    if len(array) != n_layers or min(array) < 1 or max(array) > schema.I32_MAX:
        raise schema.fail(name, array, f"must be one integer in [1, {schema.I32_MAX}] per layer ({n_layers})", source)
    return tuple(int(x) for x in array)


def _pattern(md: Mapping[str, Any], arch: str, n_layers: int, source) -> tuple[bool, ...]:
    name = PATTERN.replace("{arch}", arch)
    if name not in md:
        raise GGUFMetadataError(f"{source or 'model'}: metadata key {name} is required but missing")
    value = md[name]
    if not isinstance(value, (list, np.ndarray)) or not all(isinstance(x, (bool, np.bool_)) for x in value):
        raise schema.fail(name, value, "must be an array of bools", source)
    if len(value) != n_layers:
        raise schema.fail(name, value, f"must have one entry per layer ({n_layers})", source)
    return tuple(bool(x) for x in value)


def gemma4_config(md: Mapping[str, Any], arch: str, v: dict[str, Any], source: str | None = None) -> Gemma4Config:
    """Gemma 4's per-layer tables from the metadata, checked against each other as llama.cpp's loader needs them
    (`v`: the common fields, head_dim and rope_dim already defaulted)."""
    g = schema.read_all(md, KEYS, arch=arch, source=source)
    L = v["n_layers"]

    def key(field: str) -> str:
        return KEYS[field].name.replace("{arch}", arch)

    local = _pattern(md, arch, L, source)
    if g["value_dim_swa"] != g["head_dim_swa"]:  # llama.cpp: "Gemma 4 requires n_embd_head_k_swa == ..._v_swa"
        raise schema.fail(key("value_dim_swa"), g["value_dim_swa"], f"must equal {key('head_dim_swa')}", source)
    if g["value_dim"] is not None and g["value_dim"] != v["head_dim"]:
        raise schema.fail(key("value_dim"), g["value_dim"], f"must equal the key length {v['head_dim']}", source)
    rope_swa = g["rope_dim_swa"] or v["rope_dim"]
    if rope_swa > g["head_dim_swa"]:
        raise schema.fail(
            key("rope_dim_swa"), rope_swa, f"must be <= {key('head_dim_swa')} = {g['head_dim_swa']}", source
        )
    n_heads = _per_layer(md, arch, "n_heads", L, v["n_heads"], source)
    n_kv = _per_layer(md, arch, "n_kv_heads", L, v["n_kv_heads"] or v["n_heads"], source)
    for i, (h, kv) in enumerate(zip(n_heads, n_kv, strict=True)):
        if h % kv:
            raise schema.fail(
                PER_LAYER["n_kv_heads"].replace("{arch}", arch), list(n_kv), f"layer {i}: must divide {h}", source
            )
    # the shared-KV layers read layer first - 2 (local) or first - 1 (global): those must be of that kind
    first = L - g["shared_kv_layers"]
    if g["shared_kv_layers"] and (first < 2 or not local[first - 2] or local[first - 1]):
        rule = f"must leave >= 2 KV layers, the last two local then global (block_count {L})"
        raise schema.fail(key("shared_kv_layers"), g["shared_kv_layers"], rule, source)
    kv_layer = tuple(i if i < first else first - (2 if local[i] else 1) for i in range(L))
    return Gemma4Config(
        local=local,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=tuple(g["head_dim_swa"] if s else v["head_dim"] for s in local),
        rope_dim=tuple(rope_swa if s else v["rope_dim"] for s in local),
        hidden_dim=_per_layer(md, arch, "hidden_dim", L, v["hidden_dim"], source),
        kv_layer=kv_layer,
        per_layer_dim=g["per_layer_dim"],
        rope_theta_swa=g["rope_theta_swa"],
        **_experts(g, key, source),
    )


def _experts(g: dict[str, Any], key, source) -> dict[str, int]:
    X, K, Fe = g["n_experts"], g["n_experts_used"], g["expert_hidden_dim"]
    if X <= 1:  # llama.cpp: n_expert <= 1 means none
        return {}
    if not 1 <= K <= X or X > 1024:
        raise schema.fail(key("n_experts_used"), K, f"must be in [1, {key('n_experts')} = {X}] (at most 1024)", source)
    if not Fe:
        raise GGUFMetadataError(f"{source or 'model'}: metadata key {key('expert_hidden_dim')} is required")
    return {"n_experts": X, "n_experts_used": K, "expert_hidden_dim": Fe}


# -- weights -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Gemma4LayerWeights(LayerWeights):
    """A Gemma 4 block: Gemma 3's tensors (attn_k/attn_v None on shared-KV layers, attn_v None where V is K)
    plus the per-layer embedding's, the output scale and, on 26B-A4B's layers with a router, the experts."""

    inp_gate: QuantTensor | None = None  # (P, D)
    proj: QuantTensor | None = None  # (D, P)
    post_norm: np.ndarray | None = None  # (D,)
    layer_output_scale: np.ndarray | None = None  # (1,)
    experts: Gemma4Experts | None = None  # 26B-A4B's layers with a router


@dataclass(frozen=True, eq=False)
class Gemma4Weights(Weights):
    per_layer_token_embd: QuantTensor | None = None  # (V, L*P)
    per_layer_model_proj: QuantTensor | None = None  # (L*P, D)
    per_layer_proj_norm: np.ndarray | None = None  # (P,)


def load_weights(f, cfg: ModelConfig, layers: range) -> Gemma4Weights:
    """Map the tensors of `layers` with each layer's own shapes (llama.cpp `llama_model_gemma4::load_arch_tensors`)."""
    g, D, V = cfg.gemma4, cfg.dim, cfg.vocab_size
    L, P = cfg.n_layers, g.per_layer_dim
    blocks = {}
    for i in layers:
        p, E, F = f"blk.{i}.", g.head_dim[i], g.hidden_dim[i]
        Q, K = g.n_heads[i] * E, g.n_kv_heads[i] * E
        kv = {"attn_k": None, "attn_v": None, "attn_k_norm": None}
        if g.has_kv(i):
            kv.update(attn_k=tensor(f, p + "attn_k.weight", (K, D)), attn_k_norm=vector(f, p + "attn_k_norm.weight", E))
            if p + "attn_v.weight" in f.tensors:  # else V is K (llama.cpp: "v_proj is optional")
                kv["attn_v"] = tensor(f, p + "attn_v.weight", (K, D))
        extra = {}
        if P:
            extra = dict(
                inp_gate=tensor(f, p + "inp_gate.weight", (P, D)),
                proj=tensor(f, p + "proj.weight", (D, P)),
                post_norm=vector(f, p + "post_norm.weight", D),
            )
        scale = p + "layer_output_scale.weight"
        if p + "ffn_gate_inp.weight" in f.tensors:
            extra["experts"] = load_experts(f, cfg, p)
        blocks[i] = Gemma4LayerWeights(
            attn_norm=vector(f, p + "attn_norm.weight", D),
            attn_q=tensor(f, p + "attn_q.weight", (Q, D)),
            attn_output=tensor(f, p + "attn_output.weight", (D, Q)),
            attn_q_norm=vector(f, p + "attn_q_norm.weight", E),
            post_attention_norm=vector(f, p + "post_attention_norm.weight", D),
            ffn_norm=vector(f, p + "ffn_norm.weight", D),
            ffn_gate=tensor(f, p + "ffn_gate.weight", (F, D)),
            ffn_up=tensor(f, p + "ffn_up.weight", (F, D)),
            ffn_down=tensor(f, p + "ffn_down.weight", (D, F)),
            post_ffw_norm=vector(f, p + "post_ffw_norm.weight", D),
            layer_output_scale=vector(f, scale, 1) if scale in f.tensors else None,
            **kv,
            **extra,
        )
    token_embd = tensor(f, "token_embd.weight", (V, D))
    global_layers = [i for i in range(L) if not g.local[i]]
    factors = "rope_freqs.weight"
    extra = {}
    if P:
        extra = dict(
            per_layer_token_embd=tensor(f, "per_layer_token_embd.weight", (V, L * P)),
            per_layer_model_proj=tensor(f, "per_layer_model_proj.weight", (L * P, D)),
            per_layer_proj_norm=vector(f, "per_layer_proj_norm.weight", P),
        )
    return Gemma4Weights(
        token_embd=token_embd,
        layers=blocks,
        output_norm=vector(f, "output_norm.weight", D),
        output=tensor(f, "output.weight", (V, D)) if "output.weight" in f.tensors else token_embd,
        # (E/2,) of the global layers, required when there is one (llama.cpp creates it on the first); RoPE reads
        # the first R/2 (ggml_rope_ext: freq_factors->ne[0] >= n_dims/2)
        rope_freqs=vector(f, factors, cfg.head_dim // 2)[: cfg.rope_dim // 2] if global_layers else None,
        **extra,
    )


# -- the sequence state ----------------------------------------------------------------------------------------


class Gemma4Cache(KVCache):
    """A KV cache whose layers have their own (G, E), and none for the shared-KV layers (they read
    `Gemma4Config.kv_layer`'s). `per_layer` holds the per-layer inputs (T, L, P) of the tokens being computed."""

    def __init__(self, cfg: ModelConfig, layers: range, capacity: int, dtype=np.float32):
        g = cfg.gemma4
        outside = [(i, g.kv_layer[i]) for i in layers if g.kv_layer[i] not in layers]
        if outside:
            i, src = outside[0]
            raise ValueError(f"gemma4 layer {i} reads the KV cache of layer {src}, outside the layers {layers}")
        self.cfg, self.layers, self.capacity, self.dtype = cfg, layers, capacity, np.dtype(dtype)
        own = [i for i in layers if g.has_kv(i)]
        self.k = {i: np.zeros((capacity, g.n_kv_heads[i], g.head_dim[i]), self.dtype) for i in own}
        self.v = {i: np.zeros((capacity, g.n_kv_heads[i], g.head_dim[i]), self.dtype) for i in own}
        self.length = 0
        self.per_layer: np.ndarray | None = None

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V (end, G, E) of positions 0..end-1 as layer `layer` sees them."""
        src = self.cfg.gemma4.kv_layer[layer]
        return self.k[src][:end], self.v[src][:end]

    def resized(self, capacity: int) -> Gemma4Cache:
        if capacity < self.length:
            raise ContextLengthError(f"capacity {capacity} cannot hold the {self.length} positions of this cache")
        grown = Gemma4Cache(self.cfg, self.layers, capacity, self.dtype)
        for i in self.k:
            grown.k[i][: self.length] = self.k[i][: self.length]
            grown.v[i][: self.length] = self.v[i][: self.length]
        grown.advance(self.length)
        return grown


# -- the forward pass --------------------------------------------------------------------------------------


def attention(model: Model, x, w: Gemma4LayerWeights, i: int, seqs, cos, sin, rows: bool, trace=None) -> np.ndarray:
    """Gemma 4's attention mixer: x (N, D) -> (N, D), in gemma4.cpp's order: Q normed then rotated; K normed
    (weight) then rotated, V RMS-normed without weight; scores unscaled; shared-KV layers only read."""
    cfg, g = model.config, model.config.gemma4
    N, H, G, E = x.shape[0], g.n_heads[i], g.n_kv_heads[i], g.head_dim[i]
    rope = model.compiled.get(model.numerics.rope, model.numerics.rope)
    (q,) = model._products(x, (w.attn_q,), rows)  # (N, H*E)
    q = model.rms_norm(q.reshape(N, H, E), w.attn_q_norm, cfg.norm_eps)  # (N, H, E)
    q = rope(q, cos, sin, cfg.arch.rope_style)
    k = v = None
    if g.has_kv(i):
        projections = (w.attn_k,) if w.attn_v is None else (w.attn_k, w.attn_v)
        k, *rest = model._products(x, projections, rows)  # (N, G*E) each
        v = (rest[0] if rest else k).reshape(N, G, E)  # (N, G, E)
        k = model.rms_norm(k.reshape(N, G, E), w.attn_k_norm, cfg.norm_eps)  # (N, G, E)
        v = model.rms_norm(v, np.ones(E, np.float32), cfg.norm_eps)  # ggml_rms_norm: x 1 is exact
        k = rope(k, cos, sin, cfg.arch.rope_style)
    if trace is not None:  # llama.cpp's names (its Qcur_pos / Kcur_pos / Vcur_normed)
        trace.update({f"{name}-{i}": t.copy() for name, t in (("Qcur", q), ("Kcur", k), ("Vcur", v)) if t is not None})
    attention = getattr(model.backend, "attention", None) or model.numerics.attention
    extra = {"window": cfg.window(i)} if cfg.window(i) is not None else {}
    n = N // len(seqs)
    out = np.empty((N, H * E), np.float32)  # (N, H*E)
    for s, (pos, cache) in enumerate(seqs):
        r = slice(s * n, (s + 1) * n)
        if k is not None:
            cache.update(i, pos, k[r], v[r])
        keys, values = cache.read(i, pos + n)  # (S, G, E) each
        out[r] = attention(q[r], keys, values, pos, 1.0, **extra)  # f_attention_scale = 1.0
    if trace is not None:
        trace[f"kqv_out-{i}"] = out.copy()
    (out,) = model._products(out, (w.attn_output,), rows)  # (N, D)
    return out


def set_per_layer_inputs(model: Model, ids: np.ndarray, h: np.ndarray, caches: list) -> None:
    """The per-layer inputs of tokens `ids` with embeddings h (N, D) (scaled), split between `caches` (each
    owning N / len(caches) consecutive rows): (get_rows(per_layer_token_embd) * sqrt(P) + rms_norm(proj(h) /
    sqrt(D))) / sqrt(2), as gemma4.cpp's build_inp_per_layer and project_per_layer_inputs."""
    cfg, w = model.config, model.weights
    L, P, f32 = cfg.n_layers, cfg.gemma4.per_layer_dim, np.float32
    if not P:
        return
    N = len(ids)
    selected = w.per_layer_token_embd.rows(ids).reshape(N, L, P) * (f32(np.sqrt(f32(P))))  # (N, L, P)
    rows = len(caches) > 1
    (proj,) = model._products(h, (w.per_layer_model_proj,), rows)  # (N, L*P)
    proj = (proj * (f32(1) / np.sqrt(f32(cfg.dim)))).reshape(N, L, P)  # (N, L, P)
    proj = model.rms_norm(proj, w.per_layer_proj_norm, cfg.norm_eps)
    inputs = (proj + selected) * (f32(1) / np.sqrt(f32(2)))  # (N, L, P)
    n = N // len(caches)
    for s, cache in enumerate(caches):
        cache.per_layer = inputs[s * n : (s + 1) * n]


def layer_output(model: Model, h: np.ndarray, w: Gemma4LayerWeights, i: int, seqs, rows: bool) -> np.ndarray:
    """The end of Gemma 4's block on h (N, D): the per-layer embedding's residual branch, then the output scale."""
    cfg = model.config
    if cfg.gemma4.per_layer_dim:
        if any(cache.per_layer is None for _, cache in seqs):
            raise ValueError("gemma4's per-layer embeddings need the token ids: run the layers from layer 0")
        inputs = np.concatenate([cache.per_layer[:, i] for _, cache in seqs])  # (N, P)
        (gate,) = model._products(h, (w.inp_gate,), rows)  # (N, P)
        act = model.numerics.activations["gelu_tanh"]  # ggml_gelu
        gate = np.concatenate([act(gate[b : b + 1]) for b in range(len(gate))]) if rows else act(gate)
        (out,) = model._products(gate * inputs, (w.proj,), rows)  # (N, D)
        h = h + model.rms_norm(out, w.post_norm, cfg.norm_eps)
    if w.layer_output_scale is not None:
        h = h * w.layer_output_scale[0]
    return h
