"""Architecture registry: one `ArchSpec` record per GGUF `general.architecture`.

Differences between architectures are data, read by the forward pass; there is no per-architecture
model class. llama.cpp's equivalents live in `src/llama-model.cpp` (`llama_model_rope_type`, the hparams
loaders) and `src/models/<arch>.cpp` (the graph builders).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from .errors import GGUFUnsupportedError


@dataclass(frozen=True)
class MoE:
    """How an architecture's mixture-of-experts feed-forward routes and mixes (the arguments its graph passes to
    llama.cpp's `build_moe_ffn`, src/llama-graph.cpp); the math is `ggufpy.moe`."""

    # router probabilities from the logits: "softmax" over all experts (qwen*moe), or "softmax_weight": the
    # logits as they are for the choice, a softmax over the chosen ones for their weights (gpt-oss), or "sigmoid":
    # chosen on the logits, weighted by their sigmoid (llama4: build_moe_ffn's `selection_probs = logits`), or
    # "sigmoid_probs": the sigmoid of every logit, chosen on it and weighted by it (deepseek2's gating func 2)
    gating: Literal["softmax", "softmax_weight", "sigmoid", "sigmoid_probs"] = "softmax"
    # the weights multiply each chosen expert's input instead of its output (llama4: `weight_before_ffn`)
    weights_on_input: bool = False
    norm_weights: bool = False  # the chosen experts' weights divided by their sum (`norm_w`: qwen3moe)
    # a dense ffn_{gate,up,down}_shexp beside the routed experts: "required" (qwen2moe; its width defaults to
    # feed_forward_length), or "optional": present when expert_shared_feed_forward_length > 0 (granitemoe), or
    # "expert_width": always there, as wide as a routed expert (llama4: n_ff_shexp = n_ff_exp), or "expert_count":
    # expert_shared_count routed experts' width side by side (deepseek2: n_ff_exp * n_expert_shared)
    shared_expert: Literal["none", "required", "optional", "expert_width", "expert_count"] = "none"
    # the shared expert's output times sigmoid(x . ffn_gate_inp_shexp), computed as llama.cpp's graph writes it:
    # "silu_div" ggml_div(ggml_silu(g), g) (qwen2moe), "sigmoid" ggml_sigmoid(g) (qwen35moe, qwen3next)
    shared_gate: Literal["silu_div", "sigmoid"] | None = None
    # the experts' width: expert_feed_forward_length (default feed_forward_length / expert_used_count), or, with
    # False, feed_forward_length itself, the other key unread (granitemoe)
    expert_width_key: bool = True
    biases: bool = False  # a bias on the router's logits and on each expert's gate, up and down (gpt-oss)
    # the experts' gated unit: act(gate) * up, or gpt-oss's clamped `swiglu_oai` (ggml_swiglu_oai, alpha 1.702,
    # limit 7: min(gate, 7) * sigmoid(1.702 min(gate, 7)) * (clamp(up, -7, 7) + 1))
    glu: Literal["swiglu", "swiglu_oai"] = "swiglu"
    # deepseek2 (src/models/deepseek2.cpp): gating, norm_weights and weights_scale read from expert_gating_func,
    # expert_weights_norm and expert_weights_scale (`config.moe_fields`; an unset gating func is `gating`: softmax
    # for deepseek2, sigmoid_probs for glm4moe); the first leading_dense_block_count
    # layers dense; the optional `exp_probs_b` (X,) added to the probabilities for the choice only
    routing_keys: bool = False
    leading_dense: bool = False
    probs_bias: bool = False
    # from the metadata (`ModelConfig.moe_routing`): the chosen weights times weights_scale unless it is 0 or 1
    # (ggml_scale); expert groups (any architecture's expert_group_count / _used_count): only the experts of the
    # `groups_used` groups whose two best scores sum highest compete (build_moe_ffn, DeepSeek-V3's routing)
    weights_scale: float = 0.0
    groups: int = 0
    groups_used: int = 0


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one decoder-only architecture from the plain Llama block."""

    name: str
    # "norm" rotates adjacent pairs (x[2i], x[2i+1]); "neox" rotates x[i] with x[i + n_rot/2].
    # llama-arch GGUF files store Q/K permuted so that "norm" applies (convert_hf_to_gguf.py `permute`).
    rope_style: Literal["norm", "neox"] = "norm"
    activation: Literal["silu", "gelu_tanh"] = "silu"
    qkv_bias: bool = False  # attn_q/k/v carry a bias (qwen2)
    qk_norm: bool = False  # RMSNorm over each head of Q and K before RoPE (qwen3, gemma3)
    # the Q/K norms only where the file has attn_q_norm (glm4moe: GLM-4.5 has them, 4.5-Air not; TENSOR_NOT_REQUIRED)
    qk_norm_optional: bool = False
    post_norms: bool = False  # RMSNorm on the attention and FFN outputs before the residual add (gemma2/3)
    embed_scale: bool = False  # token embeddings times sqrt(dim) (gemma)
    # Q is multiplied by the attention scale (f32) before the KQ matmul, which then runs unscaled (gemma*:
    # llama.cpp `ggml_scale(Qcur, 1/sqrt(n_embd_head))`, `kq_scale` 1). Same maths; in llamacpp numerics it
    # moves the scale before Q's f16 rounding, as ggml does.
    scale_q: bool = False
    tied_output: bool = True  # without `output.weight`, the head reuses `token_embd.weight`
    # Sliding-window attention: every `swa_pattern`-th layer is global, the others see only the last
    # `attention.sliding_window` positions (llama.cpp `hparams.set_swa_pattern`); 0 = all global.
    swa_pattern: int = 0
    rope_theta_swa: float | None = None  # local layers' RoPE base when it differs (gemma3: 10000)
    # Softcaps read from metadata when the architecture has them (gemma2 only; gemma3 with SWA has none).
    softcaps: bool = False

    # -- steps the fused numba decode block (ggufpy/kernels/layer.py) does not know: see `fused_block` ---------
    pre_norms: bool = True  # attn_norm / ffn_norm before each branch; olmo2 has only the post-norms
    # "head": attn_q_norm/attn_k_norm (E,) over each head; "all": (Q,) and (K,) over all heads at once (olmo2)
    qk_norm_span: Literal["head", "all"] = "head"
    nope_step: int = 0  # layers with (il + 1) % nope_step == 0 skip RoPE (smollm3: 4, a literal in llama.cpp)
    # granite's scalars from metadata: embedding_scale (embeddings), attention.scale (the KQ scale),
    # residual_scale (each branch before its residual add), logit_scale (logits divided by it)
    multipliers: bool = False
    # granite: `rope.scaling.finetuned` false turns RoPE off on every layer (llama.cpp's granite loader reads it as
    # the RoPE switch, default true)
    rope_switch: bool = False
    # one attn_qkv (Q+2K, D) product split into Q, K, V when the file has it (phi3; separate ones otherwise).
    # phi3's attention.sliding_window needs no field: llama.cpp reads it and disables SWA (swa_pattern 0)
    fused_qkv: bool = False
    fused_gate_up: bool = False  # one ffn_up (2F, D) product: gate rows first, then up (phi3, LLM_FFN_SWIGLU)
    # LongRoPE: `rope_factors_short` / `rope_factors_long` divide the frequencies, long ones past the original
    # context (phi3; llama.cpp `get_rope_factors`)
    longrope: bool = False
    # attention temperature tuning: Q times 1 + attention.temperature_scale * ln(1 + floor(pos / n)), n the
    # original context (llama.cpp `llm_graph_input_attn_temp`; mistral3 when the file has the scale)
    attn_temperature: bool = False
    norm: Literal["rms", "layer"] = "rms"  # "layer": LayerNorm without bias, eps from attention.layer_norm_epsilon
    # parallel block (cohere2): attention and feed-forward both read attn_norm(h); h + ffn + attention
    parallel: bool = False
    rope_local_only: bool = False  # RoPE on the sliding-window layers only, the global ones NoPE (cohere2)
    # `{arch}.logit_scale`: the logits divided by it (granite) or multiplied by it (cohere2)
    logit_scale: Literal["none", "divide", "multiply"] = "none"
    moe: MoE | None = None  # the feed-forward is a mixture of experts (ffn_gate_inp + ffn_*_exps): `ggufpy.moe`
    # "hybrid": Gated DeltaNet layers beside gated attention layers, a `HybridState` per sequence (`ggufpy.hybrid`);
    # "gemma4": attention with per-layer shapes, shared-KV layers and per-layer embeddings (`ggufpy.gemma4`)
    # "mla": deepseek2's multi-head latent attention, a latent K-only cache (`ggufpy.mla`)
    mixer: Literal["attention", "hybrid", "gemma4", "mla"] = "attention"
    # a hybrid architecture's recurrent layers: Gated DeltaNet beside gated attention (qwen35*), or LFM2's short conv
    # beside the plain attention (`ggufpy.shortconv`); their config is `ModelConfig.recurrent`
    recurrent: Literal["deltanet", "shortconv"] = "deltanet"
    # llama4 (src/models/llama4.cpp): the MoE feed-forward on every `interleave_moe_layer_step`-th layer, dense
    # elsewhere; the `swa_pattern` local layers are chunked (a query sees its own chunk of `CHUNK_SIZE` positions),
    # the global ones NoPE with the temperature; Q and K RMS-normed without weight after RoPE (Llama4TextL2Norm)
    moe_interleave: bool = False
    chunked: bool = False
    qk_l2_norm: bool = False
    attn_temperature_nope_only: bool = False  # Q's temperature on the NoPE layers only (llama4)
    # gpt-oss (src/models/openai-moe-iswa.cpp): `attn_sinks` (H,), one logit per head in each softmax's max and
    # sum only (`ggml_soft_max_add_sinks`); an attn_output bias; the FFN's pre-norm stored as post_attention_norm
    attn_sinks: bool = False
    attn_output_bias: bool = False
    ffn_norm_name: str = "ffn_norm"
    # the last `{arch}.nextn_predict_layers` blocks are multi-token-prediction heads: llama.cpp loads their tensors
    # (TENSOR_SKIP) but runs the first block_count - nextn_predict_layers blocks only (glm4moe)
    nextn: bool = False
    # the final norm's tensor: lfm2 stores it as token_embd_norm (llama-arch.cpp `LLM_TENSOR_OUTPUT_NORM_LFM2`)
    output_norm_name: str = "output_norm"

    def fused_block(self) -> bool:
        """Whether this architecture's block is the one `kernels.layer.decode_block` computes, as far as the
        architecture decides (`ModelConfig.fused_block` adds the per-layer conditions, the kernel checks the
        weights, numerics and window itself)."""
        return _fusable(self)


@functools.cache  # asked for every layer of every token: building the plain spec each time cost ~0.1 ms a token
def _fusable(spec: ArchSpec) -> bool:
    plain = ArchSpec(spec.name)
    return all(getattr(spec, f) == getattr(plain, f) for f in _UNFUSED_FIELDS)


# fields added after the fused decode block was written: a non-default value sends the block to `Model.block`
# (nope_step only on its RoPE-less layers: `ModelConfig.fused_block`)
_UNFUSED_FIELDS = (
    "pre_norms", "qk_norm_span", "multipliers", "fused_qkv", "fused_gate_up", "longrope", "moe", "mixer", "norm",
    "parallel", "chunked", "qk_l2_norm", "attn_sinks", "attn_output_bias", "ffn_norm_name",
)  # fmt: skip


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in [
        # SmolLM2, Llama 2 / 3, Mistral and TinyLlama all convert to `llama`.
        ArchSpec("llama"),
        ArchSpec("qwen2", rope_style="neox", qkv_bias=True),
        ArchSpec("qwen3", rope_style="neox", qk_norm=True),
        ArchSpec("qwen35", rope_style="neox", qk_norm=True, mixer="hybrid"),  # Qwen3.5 / 3.6 dense
        ArchSpec(  # Qwen3.5 / 3.6 MoE (35B-A3B, ...): qwen35's mixers, qwen2moe's feed-forward with qwen3moe's norm_w
            "qwen35moe",
            rope_style="neox",
            qk_norm=True,
            mixer="hybrid",
            moe=MoE(norm_weights=True, shared_expert="required", shared_gate="sigmoid"),
        ),
        # Liquid LFM2 (src/models/lfm2.cpp): short-conv layers where attention.head_count_kv is 0, attention with
        # per-head Q/K norms and neox RoPE on the others, a dense SwiGLU feed-forward, the final norm token_embd_norm
        ArchSpec(
            "lfm2",
            rope_style="neox",
            qk_norm=True,
            mixer="hybrid",
            recurrent="shortconv",
            output_norm_name="token_embd_norm",
        ),
        ArchSpec(  # Qwen3-Next-80B-A3B: qwen35moe's blocks with NeoX RoPE and one ssm_ba product
            "qwen3next",
            rope_style="neox",
            qk_norm=True,
            mixer="hybrid",
            moe=MoE(norm_weights=True, shared_expert="required", shared_gate="sigmoid"),
        ),
        ArchSpec("gemma", rope_style="neox", activation="gelu_tanh", embed_scale=True, scale_q=True),
        ArchSpec(
            "gemma2",
            rope_style="neox",
            activation="gelu_tanh",
            embed_scale=True,
            scale_q=True,
            post_norms=True,
            swa_pattern=2,
            softcaps=True,
        ),
        ArchSpec(
            "gemma3",
            rope_style="neox",
            activation="gelu_tanh",
            embed_scale=True,
            scale_q=True,
            post_norms=True,
            qk_norm=True,
            swa_pattern=6,
            rope_theta_swa=10000.0,
        ),
        # Gemma 4 (E2B, E4B, 31B, 26B-A4B): gemma3's block without the Q scaling; the local layers from
        # attention.sliding_window_pattern, their RoPE base from rope.freq_base_swa (default 10000); the rest is
        # per layer (`ggufpy.gemma4`: head sizes, shared KV, per-layer embeddings; experts: `ggufpy.gemma4_moe`)
        ArchSpec(
            "gemma4",
            rope_style="neox",
            activation="gelu_tanh",
            embed_scale=True,
            post_norms=True,
            qk_norm=True,
            rope_theta_swa=10000.0,
            mixer="gemma4",
        ),
        # Mistral Small 3 / Ministral: the llama block, often with YaRN scaling (rope.scaling.type "yarn")
        ArchSpec("mistral3", attn_temperature=True),
        ArchSpec("smollm3", nope_step=4),
        ArchSpec(  # Llama 4 Scout / Maverick: 3 chunked RoPE layers then a global NoPE one
            "llama4",
            swa_pattern=4,
            nope_step=4,
            moe=MoE(gating="sigmoid", weights_on_input=True, shared_expert="expert_width"),
            moe_interleave=True,
            chunked=True,
            qk_l2_norm=True,
            attn_temperature=True,
            attn_temperature_nope_only=True,
        ),
        ArchSpec("granite", multipliers=True, logit_scale="divide", rope_switch=True),
        ArchSpec(
            "olmo2",
            rope_style="neox",
            pre_norms=False,
            post_norms=True,
            qk_norm=True,
            qk_norm_span="all",
            tied_output=False,
        ),
        ArchSpec("exaone", rope_style="neox"),  # EXAONE 3.x: the llama block with neox RoPE
        # Command R7B: parallel block, LayerNorm, 3 sliding-window layers with RoPE then a global NoPE one
        ArchSpec("cohere2", norm="layer", parallel=True, swa_pattern=4, rope_local_only=True, logit_scale="multiply"),
        ArchSpec(
            "phi3",
            rope_style="neox",
            scale_q=True,
            fused_qkv=True,
            fused_gate_up=True,
            longrope=True,
        ),
        # mixture of experts (`ggufpy.moe`): qwen3 / qwen2 blocks whose feed-forward routes each token
        ArchSpec("qwen3moe", rope_style="neox", qk_norm=True, moe=MoE(norm_weights=True)),
        ArchSpec(
            "qwen2moe",
            rope_style="neox",
            qkv_bias=True,
            tied_output=False,
            moe=MoE(shared_expert="required", shared_gate="silu_div"),
        ),
        ArchSpec(
            "granitemoe",
            multipliers=True,
            logit_scale="divide",
            moe=MoE(norm_weights=True, shared_expert="optional", expert_width_key=False),
        ),
        # DeepSeek V2 / V3, Kimi K2, GLM 4.7 Flash: multi-head latent attention, leading dense layers, then shared
        # and routed experts with the gating, weight norm and scale from the metadata, and expert groups
        ArchSpec(
            "deepseek2",
            mixer="mla",
            moe=MoE(shared_expert="expert_count", routing_keys=True, leading_dense=True, probs_bias=True),
        ),
        # GLM-4.5 / 4.5-Air / 4.6 (src/models/glm4-moe.cpp): neox RoPE over part of each head (partial_rotary_factor
        # 0.5), Q/K/V biases, Q/K norms where the file has them, the FFN's pre-norm stored as post_attention_norm;
        # deepseek2's routing (sigmoid when expert_gating_func is unset, exp_probs_b) with its shared experts and
        # leading dense layers; the MTP blocks at the end skipped
        ArchSpec(
            "glm4moe",
            rope_style="neox",
            qkv_bias=True,
            qk_norm=True,
            qk_norm_optional=True,
            ffn_norm_name="post_attention_norm",
            moe=MoE(
                gating="sigmoid_probs",
                shared_expert="expert_count",
                routing_keys=True,
                leading_dense=True,
                probs_bias=True,
            ),
            nextn=True,
        ),
        # gpt-oss 20b / 120b: alternating sliding-window and full layers (set_swa_pattern(2)), YaRN from the
        # metadata, Q/K/V/output biases, sinks, and a MoE whose softmax runs over the chosen experts only
        ArchSpec(
            "gpt-oss",
            rope_style="neox",
            qkv_bias=True,
            tied_output=False,
            swa_pattern=2,
            attn_sinks=True,
            attn_output_bias=True,
            ffn_norm_name="post_attention_norm",
            moe=MoE(gating="softmax_weight", biases=True, glu="swiglu_oai"),
        ),
    ]
}


def arch_spec(name: str | None) -> ArchSpec:
    """The spec for `general.architecture`, or an error listing the supported ones."""
    try:
        return ARCHITECTURES[name]  # type: ignore[index]
    except KeyError:
        raise GGUFUnsupportedError(
            f"architecture {name!r} is not supported; supported architectures: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
