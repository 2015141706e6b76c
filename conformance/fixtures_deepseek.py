"""Tiny synthetic deepseek2 GGUF models, written with gguf.GGUFWriter in the layout llama.cpp's loader reads
(src/models/deepseek2.cpp `load_arch_tensors`): per layer the latent attention (`attn_q_a` / `attn_q_a_norm` /
`attn_q_b`, or one `attn_q`; `attn_kv_a_mqa`, `attn_kv_a_norm`, then `attn_k_b` and `attn_v_b`, or the older single
`attn_kv_b`), the first `leading_dense_block_count` layers a dense feed-forward, the others a router
`ffn_gate_inp` (F32), its selection bias `exp_probs_b`, stacked experts and the shared experts `ffn_*_shexp`
(expert_shared_count experts wide). The keys are those convert_hf_to_gguf.py's DeepseekV2Model writes: key_length
R + Dr and head_count_kv 1 for MLA (key_length_mla / value_length_mla the decompressed heads), or the per-head
sizes and head_count_kv = head_count for attn_kv_b files.

`DEEPSEEK_FIXTURES` joins the conformance catalogue: importing this module (conformance/__init__.py does) adds them
to `fixtures.FIXTURES`, and `fixtures.write_tiny_llama` hands a `TinyDeepSeek2` to `write_tiny_deepseek2`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from ggufpy.constants import GGMLType

from .fixtures import FIXTURES, FLOAT, WRITERS, _quantize, _tokens, add_vocab
from .fixtures_moe import TinyMoE


@dataclass(frozen=True)
class TinyDeepSeek2(TinyMoE):
    """A `TinyMoE` with deepseek2's attention and routing. `key_length` is each head's Dn + Dr, `rope_dim` Dr."""

    q_lora_rank: int = 16  # 0: one attn_q product (DeepSeek-V2-Lite)
    kv_lora_rank: int = 16
    rope_dim: int = 8  # qk_rope_head_dim
    value_dim: int = 8  # v_head_dim
    absorbed: bool = True  # attn_k_b / attn_v_b; False: attn_kv_b, as older conversions wrote
    leading_dense: int = 1  # first_k_dense_replace
    n_shared_experts: int = 2
    gating_func: int = 2  # 1 softmax, 2 sigmoid (DeepSeek-V3)
    weights_norm: bool = True
    weights_scale: float = 2.5  # routed_scaling_factor
    expert_groups: int = 4  # n_group
    expert_groups_used: int = 2  # topk_group
    probs_bias: bool = True  # e_score_correction_bias


def write_tiny_deepseek2(path: str | Path, spec: TinyDeepSeek2) -> Path:
    """Write the model to `path` and return it."""
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _tokens()
    V, D, F, H = len(tokens), spec.dim, spec.hidden_dim, spec.n_heads
    X, Fe, Fs = spec.n_experts, spec.expert_hidden_dim, spec.n_shared_experts * spec.expert_hidden_dim
    R, Dr, Dv, Dk, Rq = spec.kv_lora_rank, spec.rope_dim, spec.value_dim, spec.head_dim, spec.q_lora_rank
    Dn = Dk - Dr

    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_name("tiny-deepseek2-synthetic")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(F)
    w.add_leading_dense_block_count(spec.leading_dense)
    w.add_head_count(H)
    w.add_vocab_size(V)
    if Rq:
        w.add_q_lora_rank(Rq)
    w.add_kv_lora_rank(R)
    if spec.absorbed:
        w.add_head_count_kv(1)
        w.add_key_length(R + Dr)
        w.add_value_length(R)
        w.add_key_length_mla(Dk)
        w.add_value_length_mla(Dv)
    else:
        w.add_head_count_kv(H)
        w.add_key_length(Dk)
        w.add_value_length(Dv)
    w.add_expert_feed_forward_length(Fe)
    w.add_expert_count(X)
    w.add_expert_used_count(spec.n_experts_used)
    w.add_expert_shared_count(spec.n_shared_experts)
    w.add_expert_weights_scale(spec.weights_scale)
    w.add_expert_weights_norm(spec.weights_norm)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType(spec.gating_func))
    if spec.expert_groups:
        w.add_expert_group_count(spec.expert_groups)
        w.add_expert_group_used_count(spec.expert_groups_used)
    w.add_rope_dimension_count(Dr)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    for k, value in spec.extra_kv:  # RoPE scaling (YaRN and its log multiplier)
        add_kv = {float: w.add_float32, int: w.add_uint32, str: w.add_string}[type(value)]
        add_kv(f"deepseek2.{k}", value)
    add_vocab(w, tokens, token_types)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add(name: str, shape: tuple[int, ...], role: str | None, scale: float | None = None):
        if role is None:  # norm weights: around 1
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        if role == "bias":  # the selection bias: about the spread of the sigmoid scores, so it changes choices
            w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        data = (rng.standard_normal(shape) * (scale or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)
        qtype = GGMLType.F32 if role == "router" else spec.types[role]
        if qtype == GGMLType.F32:
            w.add_tensor(name, data)
        else:  # quantized row by row
            raw = _quantize(data.reshape(-1, shape[-1]), qtype).reshape(*shape[:-1], -1)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    head_scale = None if spec.logit_std is None else spec.logit_std / np.sqrt(D)
    add("token_embd.weight", (V, D), "embd", scale=(head_scale if spec.tied_output else None) or 1.0)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (D,), None)
        if Rq:
            add(p + "attn_q_a.weight", (Rq, D), "attn")
            add(p + "attn_q_a_norm.weight", (Rq,), None)
            add(p + "attn_q_b.weight", (H * Dk, Rq), "attn")
        else:
            add(p + "attn_q.weight", (H * Dk, D), "attn")
        add(p + "attn_kv_a_mqa.weight", (R + Dr, D), "attn")
        add(p + "attn_kv_a_norm.weight", (R,), None)
        # kv_b_proj (H, Dn + Dv, R) as in the HF checkpoint, split the way the converter splits it
        kv_b = (rng.standard_normal((H, Dn + Dv, R)) / np.sqrt(R)).astype(np.float32)
        if spec.absorbed:
            w.add_tensor(p + "attn_k_b.weight", np.ascontiguousarray(kv_b[:, :Dn].transpose(0, 2, 1)))  # (H, R, Dn)
            w.add_tensor(p + "attn_v_b.weight", np.ascontiguousarray(kv_b[:, Dn:]))  # (H, Dv, R)
        else:
            w.add_tensor(p + "attn_kv_b.weight", kv_b.reshape(H * (Dn + Dv), R))
        add(p + "attn_output.weight", (D, H * Dv), "attn")
        add(p + "ffn_norm.weight", (D,), None)
        if i < spec.leading_dense:
            add(p + "ffn_gate.weight", (F, D), "ffn")
            add(p + "ffn_up.weight", (F, D), "ffn")
            add(p + "ffn_down.weight", (D, F), "ffn")
            continue
        add(p + "ffn_gate_inp.weight", (X, D), "router")
        if spec.probs_bias:
            add(p + "exp_probs_b.bias", (X,), "bias")
        for stem, shape in (("ffn_gate_exps", (X, Fe, D)), ("ffn_up_exps", (X, Fe, D)), ("ffn_down_exps", (X, D, Fe))):
            add(p + stem + ".weight", shape, "ffn")
        add(p + "ffn_gate_shexp.weight", (Fs, D), "ffn")
        add(p + "ffn_up_shexp.weight", (Fs, D), "ffn")
        add(p + "ffn_down_shexp.weight", (D, Fs), "ffn")
    add("output_norm.weight", (D,), None)
    if not spec.tied_output:
        add("output.weight", (V, D), "output", scale=head_scale)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# DeepSeek-V3 in small, F32: 3 layers (the first dense), 4 heads with q_lora on (Rq 16), kv_lora_rank 16, heads of
# Dn 8 + Dr 8, values of 8; 8 routed experts in 4 groups of 2, the best 2 groups kept, 3 chosen, sigmoid gating
# with exp_probs_b, weights normed and scaled by 2.5, 2 shared experts; YaRN x4 over an original context of 64 with
# V2-Lite's yarn_log_multiplier 0.0707 (mscale_all_dim 0.707: the kq_scale's mscale, TAG_DEEPSEEK2_YARN_LOG_MUL_FIX).
# Seed 531: no token's routing sits within the exact mode's rounding of a tie (with 530 one token of 128 picks
# another expert in exact numerics: KL 0.19 there, over the exact mode's mean threshold).
DEEPSEEK2 = TinyDeepSeek2(
    **{
        **vars(replace(FLOAT, n_layers=3, hidden_dim=32)),
        "arch": "deepseek2",
        "seed": 531,
        "n_heads": 4,
        "key_length": 16,
        "n_experts": 8,
        "n_experts_used": 3,
        "expert_hidden_dim": 8,
        "extra_kv": (
            ("rope.scaling.type", "yarn"),
            ("rope.scaling.factor", 4.0),
            ("rope.scaling.original_context_length", 64),
            ("rope.scaling.yarn_log_multiplier", 0.0707),
        ),
    }
)
DEEPSEEK_FIXTURES: dict[str, TinyDeepSeek2] = {"deepseek2_f32": DEEPSEEK2}
# the same weights (same seed, same draws) in the older single-attn_kv_b layout: tests/test_deepseek2.py
DEEPSEEK2_KV_B = replace(DEEPSEEK2, absorbed=False)
WRITERS[TinyDeepSeek2] = write_tiny_deepseek2
FIXTURES.update(DEEPSEEK_FIXTURES)
