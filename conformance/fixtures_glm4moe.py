"""Tiny synthetic glm4moe GGUF models, written with gguf.GGUFWriter in the layout llama.cpp's loader reads
(src/models/glm4-moe.cpp `load_arch_tensors`): per block `attn_norm`, `attn_{q,k,v}` with their biases, the optional
per-head `attn_{q,k}_norm`, `attn_output`, `post_attention_norm` (the FFN's pre-norm), then for the first
`leading_dense_block_count` blocks a dense `ffn_{gate,up,down}`, for the others a router `ffn_gate_inp` (F32), its
selection bias `exp_probs_b`, stacked experts and the shared experts `ffn_*_shexp` (expert_shared_count experts
wide). The last `nextn_predict_layers` blocks are GLM-4.5's multi-token-prediction heads: a whole MoE block plus
`nextn.{eh_proj,enorm,hnorm,shared_head_norm}`, which llama.cpp loads (TENSOR_SKIP) and never runs.

The keys are those convert_hf_to_gguf.py's Glm4MoeModel writes; `expert_gating_func` is left out by default, so
the loader's fallback (sigmoid for glm4moe, softmax for deepseek2) is what the golden checks.

`GLM4MOE_FIXTURES` joins the conformance catalogue: importing this module (conformance/__init__.py does) adds them
to `fixtures.FIXTURES`, and `fixtures.write_tiny_llama` hands a `TinyGLM4MoE` to `write_tiny_glm4moe`.
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
class TinyGLM4MoE(TinyMoE):
    """A `TinyMoE` with glm4moe's block. `n_layers` counts the blocks run; `nextn_layers` more follow in the file."""

    rope_dim: int = 8  # rope.dimension_count: half of each head (partial_rotary_factor 0.5)
    qk_norm: bool = True  # GLM-4.5 (355B) has attn_q_norm / attn_k_norm, 4.5-Air not
    leading_dense: int = 1  # first_k_dense_replace
    n_shared_experts: int = 1
    gating_func: int | None = None  # None: key absent (the loader's sigmoid); 1 softmax, 2 sigmoid
    weights_norm: bool = True  # norm_topk_prob
    weights_scale: float = 2.5  # routed_scaling_factor
    nextn_layers: int = 1  # num_nextn_predict_layers
    nextn_scale: float = 1.0  # the MTP block's weights times this (the tests' "is it skipped" probe)


def write_tiny_glm4moe(path: str | Path, spec: TinyGLM4MoE) -> Path:
    """Write the model to `path` and return it."""
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _tokens()
    V, D, F, E = len(tokens), spec.dim, spec.hidden_dim, spec.head_dim
    X, Fe, Fs = spec.n_experts, spec.expert_hidden_dim, spec.n_shared_experts * spec.expert_hidden_dim
    Q, K = spec.n_heads * E, spec.n_kv_heads * E
    blocks = spec.n_layers + spec.nextn_layers

    w = gguf.GGUFWriter(str(path), "glm4moe")
    w.add_name("tiny-glm4moe-synthetic")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_block_count(blocks)
    w.add_feed_forward_length(F)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    if spec.key_length is not None:
        w.add_key_length(spec.key_length)
        w.add_value_length(spec.key_length)
    w.add_rope_dimension_count(spec.rope_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_leading_dense_block_count(spec.leading_dense)
    w.add_expert_feed_forward_length(Fe)
    w.add_expert_count(X)
    w.add_expert_used_count(spec.n_experts_used)
    w.add_expert_shared_count(spec.n_shared_experts)
    w.add_expert_weights_scale(spec.weights_scale)
    w.add_expert_weights_norm(spec.weights_norm)
    if spec.gating_func is not None:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType(spec.gating_func))
    if spec.nextn_layers:
        w.add_nextn_predict_layers(spec.nextn_layers)
    for k, value in spec.extra_kv:
        add_kv = {float: w.add_float32, int: w.add_uint32, str: w.add_string}[type(value)]
        add_kv(f"glm4moe.{k}", value)
    w.add_vocab_size(V)
    add_vocab(w, tokens, token_types)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add(name: str, shape: tuple[int, ...], role: str | None, scale: float | None = None, times: float = 1.0):
        if role is None:  # norm weights: around 1
            w.add_tensor(name, (times * (1.0 + 0.1 * rng.standard_normal(shape))).astype(np.float32))
            return
        if role in ("bias", "probs_bias"):  # the selection bias about the spread of the sigmoid scores
            std = 0.1 if role == "probs_bias" else 0.5
            w.add_tensor(name, (times * std * rng.standard_normal(shape)).astype(np.float32))
            return
        data = (times * rng.standard_normal(shape) * (scale or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)
        qtype = GGMLType.F32 if role == "router" else spec.types[role]
        if qtype == GGMLType.F32:
            w.add_tensor(name, data)
        else:  # quantized row by row: the experts' rows are rows like any other
            raw = _quantize(data.reshape(-1, shape[-1]), qtype).reshape(*shape[:-1], -1)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    head_scale = None if spec.logit_std is None else spec.logit_std / np.sqrt(D)
    add("token_embd.weight", (V, D), "embd", scale=(head_scale if spec.tied_output else None) or 1.0)
    for i in range(blocks):
        p, t = f"blk.{i}.", spec.nextn_scale if i >= spec.n_layers else 1.0
        add(p + "attn_norm.weight", (D,), None, times=t)
        for proj, rows in (("q", Q), ("k", K), ("v", K)):
            add(p + f"attn_{proj}.weight", (rows, D), "attn", times=t)
            add(p + f"attn_{proj}.bias", (rows,), "bias", times=t)
        if spec.qk_norm:
            add(p + "attn_q_norm.weight", (E,), None, times=t)
            add(p + "attn_k_norm.weight", (E,), None, times=t)
        add(p + "attn_output.weight", (D, Q), "attn", times=t)
        add(p + "post_attention_norm.weight", (D,), None, times=t)
        if i < spec.leading_dense:
            add(p + "ffn_gate.weight", (F, D), "ffn", times=t)
            add(p + "ffn_up.weight", (F, D), "ffn", times=t)
            add(p + "ffn_down.weight", (D, F), "ffn", times=t)
        else:
            add(p + "ffn_gate_inp.weight", (X, D), "router", times=t)
            add(p + "exp_probs_b.bias", (X,), "probs_bias", times=t)
            for stem, shape in (
                ("ffn_gate_exps", (X, Fe, D)),
                ("ffn_up_exps", (X, Fe, D)),
                ("ffn_down_exps", (X, D, Fe)),
            ):
                add(p + stem + ".weight", shape, "ffn", times=t)
            if Fs:
                add(p + "ffn_gate_shexp.weight", (Fs, D), "ffn", times=t)
                add(p + "ffn_up_shexp.weight", (Fs, D), "ffn", times=t)
                add(p + "ffn_down_shexp.weight", (D, Fs), "ffn", times=t)
        if i >= spec.n_layers:  # the MTP head's own tensors: GGUF dims {2 * n_embd, n_embd} for eh_proj
            add(p + "nextn.eh_proj.weight", (D, 2 * D), "attn", times=t)
            add(p + "nextn.enorm.weight", (D,), None, times=t)
            add(p + "nextn.hnorm.weight", (D,), None, times=t)
            add(p + "nextn.shared_head_norm.weight", (D,), None, times=t)
    add("output_norm.weight", (D,), None)
    if not spec.tied_output:
        add("output.weight", (V, D), "output", scale=head_scale)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# GLM-4.5 in small, F32: 3 blocks run (the first dense) and 1 MTP block after them; 4 heads of 16 over 2 KV heads
# with Q/K/V biases and Q/K norms, neox RoPE on the first 8 dims of each head; 8 routed experts, 3 chosen on
# sigmoid(logits) + exp_probs_b (expert_gating_func absent: glm4moe's fallback), weights normed and scaled by 2.5,
# 1 shared expert; an untied head.
GLM4MOE = TinyGLM4MoE(
    **{
        **vars(replace(FLOAT, n_layers=3, hidden_dim=32)),
        "arch": "glm4moe",
        "seed": 540,
        "n_heads": 4,
        "n_kv_heads": 2,
        "key_length": 16,
        "rope_theta": 1e6,
        "tied_output": False,
        "n_experts": 8,
        "n_experts_used": 3,
        "expert_hidden_dim": 8,
    }
)
GLM4MOE_FIXTURES: dict[str, TinyGLM4MoE] = {"glm4moe_f32": GLM4MOE}
WRITERS[TinyGLM4MoE] = write_tiny_glm4moe
FIXTURES.update(GLM4MOE_FIXTURES)
