"""Model hyperparameters, read from GGUF metadata in exactly one place.

Keys follow llama.cpp's `src/llama-arch.cpp` (LLM_KV_*): `{arch}.embedding_length`, `{arch}.block_count`, ...
The forward pass only ever sees a `ModelConfig`, never raw metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import schema
from .arch import ArchSpec, MoE, arch_spec
from .deltanet import DeltaNetConfig, deltanet_config
from .errors import GGUFMetadataError, GGUFUnsupportedError
from .mla import MLAConfig, mla_config
from .numerics import logf
from .ops import RopeExt, yarn_corr_dims
from .shortconv import ShortConvConfig, shortconv_config
from .shortconv import scalar_metadata as shortconv_scalars

if TYPE_CHECKING:
    from .gemma4 import Gemma4Config

_FINITE = schema.Rule("a finite number", lambda v: bool(np.isfinite(np.float32(v))))
_NON_NEGATIVE = schema.Rule("finite and >= 0 in float32", lambda v: bool(np.isfinite(np.float32(v)) and v >= 0))
# Keys of the RoPE scalings and of granite's multipliers (llama.cpp `llama_model::load_hparams`, the arch
# loaders): ModelConfig field -> key, checked like `schema.MODEL_KEYS`. Defaults are llama.cpp's hparams defaults;
# a negative YaRN ext_factor means "from the scaling type" (1 for yarn, 0 otherwise), as in llama-context.cpp.
_R = "{arch}.rope.scaling."
SCALING_KEYS: dict[str, schema.Key] = {
    "orig_ctx": schema.Key(_R + "original_context_length", "integer", schema.SIZE),
    "rope_attn_factor": schema.Key(_R + "attn_factor", "number", schema.POSITIVE_F32, default=1.0),
    "ext_factor": schema.Key(_R + "yarn_ext_factor", "number", _FINITE, default=-1.0),
    "yarn_attn_factor": schema.Key(_R + "yarn_attn_factor", "number", schema.POSITIVE_F32, default=1.0),
    "beta_fast": schema.Key(_R + "yarn_beta_fast", "number", _FINITE, default=32.0),
    "beta_slow": schema.Key(_R + "yarn_beta_slow", "number", _FINITE, default=1.0),
    "log_mul": schema.Key(_R + "yarn_log_multiplier", "number", _NON_NEGATIVE, default=0.0),
}
MULTIPLIER_KEYS: dict[str, schema.Key] = {  # 0 = not set (llama.cpp's test `if (hparams.f_residual_scale)`)
    "embedding_scale": schema.Key("{arch}.embedding_scale", "number", _NON_NEGATIVE, default=0.0),
    "attention_scale": schema.Key("{arch}.attention.scale", "number", _NON_NEGATIVE, default=0.0),
    "residual_scale": schema.Key("{arch}.residual_scale", "number", _NON_NEGATIVE, default=0.0),
}
ROPE_FINETUNED = schema.Key("{arch}.rope.scaling.finetuned", "bool", default=True)  # `arch.rope_switch`
LOGIT_SCALE = schema.Key("{arch}.logit_scale", "number", schema.POSITIVE_F32, required=True)  # `arch.logit_scale`
LAYER_NORM_EPS = schema.Key("{arch}.attention.layer_norm_epsilon", "number", schema.POSITIVE_F32, required=True)
SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp LLAMA_ROPE_SCALING_TYPE_*
# `arch.attn_temperature`; 0 = off. Its position bucket is the original context (llama.cpp's mistral3 loader sets
# n_attn_temp_floor_scale = n_ctx_orig_yarn; attention.temperature_length is not read: checked against llama.cpp)
TEMPERATURE_KEY = schema.Key("{arch}.attention.temperature_scale", "number", _NON_NEGATIVE, default=0.0)
# Mixture of experts (llama.cpp LLM_KV_EXPERT_*), read for architectures with `arch.moe`: ModelConfig field -> key.
# llama.cpp holds at most LLAMA_MAX_EXPERTS (1024) experts; an absent expert width is feed_forward_length /
# expert_used_count (qwen2moe, qwen3moe loaders).
_EXPERTS = schema.Rule("an integer in [1, 1024] (LLAMA_MAX_EXPERTS)", lambda v: 1 <= v <= 1024)
MOE_KEYS: dict[str, schema.Key] = {
    "n_experts": schema.Key("{arch}.expert_count", "integer", _EXPERTS, required=True),
    "n_experts_used": schema.Key("{arch}.expert_used_count", "integer", _EXPERTS, required=True),
    "expert_hidden_dim": schema.Key("{arch}.expert_feed_forward_length", "integer", schema.SIZE, default=0),
    "shared_hidden_dim": schema.Key("{arch}.expert_shared_feed_forward_length", "integer", schema.SIZE, default=0),
}
# expert groups, which llama.cpp reads for every architecture (`load_hparams`), and deepseek2's routing keys
# (`MoE.routing_keys`, src/models/deepseek2.cpp): field -> key. expert_gating_func is llama.cpp's
# llama_expert_gating_func_type; 0 (unset) means the architecture's `MoE.gating` (its loader's fallback: softmax
# for the DeepSeek V2 files older than the key, sigmoid for glm4moe).
_COUNT = schema.Rule("an integer >= 0", lambda v: v >= 0)
GATING_FUNCS = {0: None, 1: "softmax", 2: "sigmoid_probs", 3: "softmax_weight"}
_GATING = schema.Rule(
    "0, 1 (softmax), 2 (sigmoid) or 3 (softmax_weight), not 4 (sqrt_softplus)", lambda v: v in GATING_FUNCS
)
GROUP_KEYS: dict[str, schema.Key] = {
    "groups": schema.Key("{arch}.expert_group_count", "integer", _COUNT, default=0),
    "groups_used": schema.Key("{arch}.expert_group_used_count", "integer", _COUNT, default=0),
}
ROUTING_KEYS: dict[str, schema.Key] = {
    "n_shared": schema.Key("{arch}.expert_shared_count", "integer", _COUNT, required=True),
    "weights_scale": schema.Key("{arch}.expert_weights_scale", "number", _FINITE, default=0.0),
    "norm_weights": schema.Key("{arch}.expert_weights_norm", "bool", default=False),
    "gating": schema.Key("{arch}.expert_gating_func", "integer", _GATING, default=0),
    "leading_dense": schema.Key("{arch}.leading_dense_block_count", "integer", _COUNT, default=0),
}
# a hybrid architecture's recurrent layers (`ArchSpec.recurrent`) -> the builder of their config
RECURRENT_CONFIGS = {"deltanet": deltanet_config, "shortconv": shortconv_config}
# glm4moe's multi-token-prediction blocks, the last ones of block_count (`arch.nextn`): llama.cpp asserts
# n_layer_nextn < n_layer_all and runs the blocks before them
NEXTN_KEY = schema.Key("{arch}.nextn_predict_layers", "integer", _COUNT, default=0)

# llama4 (src/models/llama4.cpp `load_arch_hparams`): literals there, no metadata keys. Chunks of 8192 positions on
# the chunked layers, the temperature 1 + 0.1 ln(1 + floor((pos + 1) / 8192)) on the NoPE ones; the MoE layers
# every interleave_moe_layer_step-th (none with 0); Maverick's 128 experts skip the Q/K L2 norm (`use_kq_norm`).
# MobileLLM's attention.sliding_window 0 turns chunking off.
CHUNK_SIZE = 8192
LLAMA4_TEMPERATURE = dict(attn_temp_scale=0.1, attn_temp_length=8192, attn_temp_offset=1.0)
MOE_STEP = schema.Key(
    "{arch}.interleave_moe_layer_step", "integer", schema.Rule("an integer >= 0", lambda v: v >= 0), required=True
)
NO_QK_NORM_EXPERTS = 128


@dataclass(frozen=True)
class RopeScaling:
    """`rope.scaling.*` as llama.cpp's context resolves it (llama-context.cpp): the values ggml_rope_ext gets."""

    type: str = "linear"  # llama.cpp's default when the key is absent
    freq_scale: float = 1.0  # 1 / rope.scaling.factor; 1 for type none
    ext_factor: float = 0.0  # YaRN's mix of interpolated and extrapolated angles (1 for yarn)
    attn_factor: float = 1.0  # multiplies cos and sin (YaRN's magnitude correction, LongRoPE's attn_factor)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    orig_ctx: int = 0  # rope.scaling.original_context_length (else the training context)
    log_mul: float = 0.0  # rope.scaling.yarn_log_multiplier as the loader holds it (deepseek2: / 0.1f)


@dataclass(frozen=True)
class ModelConfig:
    arch: ArchSpec
    dim: int  # residual stream width (embedding_length)
    hidden_dim: int  # feed-forward inner width (feed_forward_length)
    n_layers: int
    n_heads: int
    n_kv_heads: int  # grouped-query attention: n_heads / n_kv_heads query heads share one K/V head
    head_dim: int  # key_length; defaults to dim / n_heads
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float  # rope.freq_base; 10000 when absent (llama.cpp default)
    rope_dim: int  # rope.dimension_count: how many dims of each head are rotated (defaults to head_dim)
    rope_freq_scale: float = 1.0  # 1 / rope.scaling.factor for linear scaling (llama.cpp `freq_scale`)
    sliding_window: int | None = None  # attention.sliding_window, for the local layers of `arch.swa_pattern`
    attn_softcap: float | None = None  # attn_logit_softcapping (gemma2)
    final_softcap: float | None = None  # final_logit_softcapping (gemma2)
    rope_scaling: RopeScaling = RopeScaling()
    # granite's multipliers (`arch.multipliers`); 0 = not set
    embedding_scale: float = 0.0
    attention_scale: float = 0.0  # replaces 1/sqrt(head_dim) as the KQ scale
    residual_scale: float = 0.0
    logit_factor: float = 1.0  # the logits are multiplied by it: 1 / logit_scale (granite), logit_scale (cohere2)
    attn_temp_scale: float = 0.0  # attention temperature tuning (`arch.attn_temperature`); 0 = off
    attn_temp_length: int = 0  # its position bucket: the original context
    attn_temp_offset: float = 0.0  # added to the position first (llama4: 1)
    chunk_size: int | None = None  # the chunked layers' chunk (`arch.chunked`): queries see their own chunk only
    moe_layer_step: int = 0  # interleave_moe_layer_step (`arch.moe_interleave`)
    qk_l2_norm: bool = False  # Q and K RMS-normed without weight after RoPE on the RoPE layers (`arch.qk_l2_norm`)
    rope_off: bool = False  # no RoPE on any layer (granite with rope.scaling.finetuned false)
    # mixture of experts (`arch.moe`); 0 = a dense feed-forward
    n_experts: int = 0  # expert_count: routed experts per layer
    n_experts_used: int = 0  # expert_used_count: experts each token is routed to (top-k)
    expert_hidden_dim: int = 0  # expert_feed_forward_length: each expert's inner width
    shared_hidden_dim: int = 0  # expert_shared_feed_forward_length: the shared expert's; 0 = none
    leading_dense: int = 0  # leading_dense_block_count: the first layers' feed-forward is dense (deepseek2)
    nextn_layers: int = 0  # nextn_predict_layers: MTP blocks in the file after the n_layers run (`arch.nextn`)
    # the architecture's MoE record completed by the metadata: deepseek2's gating, weight norm and scale, any
    # architecture's expert groups (`routing`)
    moe_routing: MoE | None = None
    # deepseek2 (`arch.mixer == "mla"`): the latent attention's ranks and head sizes (`ggufpy.mla`)
    mla: MLAConfig | None = None
    value_dim: int | None = None  # the V cache's head width where it is not head_dim (0: keys only, MLA)
    # hybrid recurrent models (`arch.mixer == "hybrid"`): which layers are recurrent, their hparams, by
    # `arch.recurrent` (`RECURRENT_CONFIGS`): DeltaNet layers (qwen35*), or lfm2's short-conv layers
    recurrent: DeltaNetConfig | ShortConvConfig | None = None
    # gemma4 (`arch.mixer == "gemma4"`): per-layer head sizes, widths, local layers, shared KV (`ggufpy.gemma4`)
    gemma4: Gemma4Config | None = None
    rope_theta_swa: float | None = None  # rope.freq_base_swa, where the architecture reads it (gemma4)

    def is_local(self, layer: int) -> bool:
        """Whether `layer` uses sliding-window attention (llama.cpp `set_swa_pattern`: il % n < n - 1, or
        gemma4's attention.sliding_window_pattern)."""
        if self.gemma4 is not None:
            return self.gemma4.local[layer]
        n = self.arch.swa_pattern
        return self.sliding_window is not None and n > 0 and layer % n < n - 1

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_local(layer) else None

    def rope(self, layer: int) -> tuple[float, float]:
        """(theta, freq_scale) of `layer`: local layers of gemma3 use their own base and no scaling."""
        if self.is_local(layer) and self.arch.rope_theta_swa is not None:
            return self.rope_theta_swa or self.arch.rope_theta_swa, 1.0
        return self.rope_theta, self.rope_freq_scale

    def rope_dims(self, layer: int) -> int:
        """How many dims of each head `layer` rotates (gemma4: rope.dimension_count_swa on its local layers)."""
        return self.gemma4.rope_dim[layer] if self.gemma4 is not None else self.rope_dim

    def rope_freqs_on(self, layer: int) -> bool:
        """Whether `layer` divides its frequencies by `rope_freqs` (gemma4: on its global layers only)."""
        return self.gemma4 is None or not self.gemma4.local[layer]

    def rope_ext(self, layer: int) -> RopeExt | None:
        """YaRN's ext_factor, the attention factor and the correction dims of `layer` (ggml_rope_ext's
        arguments), or None for plain RoPE (ext_factor 0, attn_factor 1: the angles as before)."""
        s = self.rope_scaling
        if (s.ext_factor == 0 and s.attn_factor == 1) or (self.is_local(layer) and self.arch.rope_theta_swa):
            return None
        theta, _ = self.rope(layer)
        dims = yarn_corr_dims(self.rope_dim, s.orig_ctx or self.context_length, theta, s.beta_fast, s.beta_slow)
        return RopeExt(s.ext_factor, s.attn_factor, *dims)

    def chunk(self, layer: int) -> int | None:
        """The chunk of a chunked layer (llama4's local ones: LLAMA_SWA_TYPE_CHUNKED), else None."""
        n = self.arch.swa_pattern
        return self.chunk_size if self.chunk_size and n > 0 and layer % n < n - 1 else None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s feed-forward is the mixture of experts: every layer of an MoE architecture past the
        leading dense ones (deepseek2), or llama4's (il + 1) % interleave_moe_layer_step == 0."""
        if not self.n_experts or layer < self.leading_dense:
            return False
        step = self.moe_layer_step
        return not self.arch.moe_interleave or (step > 0 and (layer + 1) % step == 0)

    def temperature_on(self, layer: int) -> bool:
        """Whether Q of `layer` is scaled by the attention temperature (llama4: on its NoPE layers only)."""
        return bool(self.attn_temp_scale) and not (self.arch.attn_temperature_nope_only and self.uses_rope(layer))

    def uses_rope(self, layer: int) -> bool:
        """False on the NoPE layers: smollm3's (il + 1) % 4 == 0, cohere2's global ones, all of a granite with
        rope.scaling.finetuned false."""
        if self.rope_off or (self.arch.rope_local_only and not self.is_local(layer)):
            return False
        n = self.arch.nope_step
        return not (n and (layer + 1) % n == 0)

    def long_factors(self) -> bool:
        """LongRoPE: whether the long factors apply. llama.cpp compares its context size (n_ctx_seq) with the
        original context; ggufpy compares the model's context length (llama.cpp's choice at full context)."""
        return self.context_length > (self.rope_scaling.orig_ctx or self.context_length)

    def fused_block(self, layer: int) -> bool:
        """Whether the fused numba decode block may compute `layer` (it knows the block of the first six
        architectures, with RoPE on every layer)."""
        return self.arch.fused_block() and self.uses_rope(layer) and not self.attn_temp_scale

    def attn_temperature(self, positions: np.ndarray) -> np.ndarray:
        """Q's scale per position (T,) f32: 1 + scale * ln(1 + floor(pos / length)), in double as llama.cpp's
        `llm_graph_input_attn_temp::set_input` (offset 0), rounded to f32."""
        shifted = positions.astype(np.float32) + np.float32(self.attn_temp_offset)  # (T,)
        bucket = np.floor(shifted / np.float32(self.attn_temp_length))  # (T,)
        return (np.log(bucket.astype(np.float64) + 1.0) * np.float32(self.attn_temp_scale) + 1.0).astype(np.float32)

    @property
    def routing(self) -> MoE | None:
        """How the experts are routed: `moe_routing`, else the architecture's record."""
        return self.moe_routing or self.arch.moe

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def config_from_metadata(md: Mapping[str, Any], vocab_size: int, source: str | None = None) -> ModelConfig:
    """Build the config; `vocab_size` comes from the embedding tensor (the authority llama.cpp uses).

    Every key is checked against `ggufpy.schema.MODEL_KEYS`, and the keys against each other, so the forward
    pass can trust the result; a violation is a `GGUFMetadataError` naming `source` (the file), key and rule.
    """
    spec = arch_spec(schema.read(md, schema.ARCHITECTURE, source=source))
    a = spec.name
    full_md = md
    if spec.mixer == "gemma4":  # per-layer arrays: layer 0's value here, all of them in `gemma4_config`
        from .gemma4 import scalar_metadata

        md = scalar_metadata(md, a)
    if spec.recurrent == "shortconv":  # lfm2: head_count_kv per layer, 0 on the short-conv layers
        md = shortconv_scalars(md, a, source)
    v = schema.read_all(md, schema.MODEL_KEYS, arch=a, source=source)

    def key(field: str) -> str:
        return schema.MODEL_KEYS[field].name.replace("{arch}", a)

    nextn = {}
    if spec.nextn:  # glm4moe: the MTP blocks are in block_count but never run (n_layer = n_layer_all - nextn)
        n = schema.read(md, NEXTN_KEY, arch=a, source=source)
        if n >= v["n_layers"]:
            raise schema.fail(
                NEXTN_KEY.name.replace("{arch}", a), n, f"must be < {key('n_layers')} = {v['n_layers']}", source
            )
        v["n_layers"], nextn["nextn_layers"] = v["n_layers"] - n, n
    n_heads = v["n_heads"]
    n_kv_heads = v["n_kv_heads"] or n_heads
    if n_heads % n_kv_heads:
        raise schema.fail(key("n_kv_heads"), n_kv_heads, f"must divide {key('n_heads')} = {n_heads}", source)
    head_dim = v["head_dim"] or v["dim"] // n_heads
    if head_dim <= 0:
        raise schema.fail(key("n_heads"), n_heads, f"must be <= {key('dim')} = {v['dim']} (head size 0)", source)
    rope_dim = v["rope_dim"] or head_dim
    if rope_dim > head_dim or rope_dim % 2:
        raise schema.fail(key("rope_dim"), rope_dim, f"must be even and <= the head size {head_dim}", source)
    if vocab_size <= 0:
        raise GGUFMetadataError(f"{source or 'model'}: token_embd has {vocab_size} rows: no vocabulary")
    sections = md.get(f"{a}.rope.dimension_sections")
    if spec.mixer != "hybrid" and sections is not None and any(np.asarray(sections).ravel()):
        # llama.cpp's ggml_rope_multi (M-RoPE: GLM-4.5V, the VL models); plain RoPE would run silently wrong
        listed = np.asarray(sections).ravel().tolist()
        raise GGUFUnsupportedError(
            f"{source or 'model'}: {a}.rope.dimension_sections = {listed}: multi-section RoPE (M-RoPE) "
            f"is not supported for {a}"
        )
    scaling = rope_scaling(md, spec, v, source)
    multipliers = schema.read_all(md, MULTIPLIER_KEYS, arch=a, source=source) if spec.multipliers else {}
    if spec.logit_scale != "none":  # ggml_scale(cur, 1.0f / f_logit_scale) (granite) or (cur, f_logit_scale)
        s = np.float32(schema.read(md, LOGIT_SCALE, arch=a, source=source))
        multipliers["logit_factor"] = float(np.float32(1) / s if spec.logit_scale == "divide" else s)
    if spec.rope_switch and not schema.read(md, ROPE_FINETUNED, arch=a, source=source):
        multipliers["rope_off"] = True
    if spec.norm == "layer":
        v["norm_eps"] = schema.read(md, LAYER_NORM_EPS, arch=a, source=source)
    temperature = {}
    if spec.attn_temperature and schema.read(md, TEMPERATURE_KEY, arch=a, source=source):
        length = scaling.orig_ctx or v["context_length"]
        temperature = dict(
            attn_temp_scale=schema.read(md, TEMPERATURE_KEY, arch=a, source=source), attn_temp_length=length
        )
    experts = moe_fields(md, spec, v, source) if spec.moe else {}
    if spec.chunked:
        temperature = {"chunk_size": None if v["sliding_window"] == 0 else CHUNK_SIZE, **LLAMA4_TEMPERATURE}
    elif (spec.swa_pattern or spec.mixer == "gemma4") and v["sliding_window"] == 0:  # a window of no position
        raise schema.fail(f"{a}.attention.sliding_window", 0, f"must be {schema.SIZE.text}", source)
    if spec.moe_interleave:
        experts["moe_layer_step"] = schema.read(md, MOE_STEP, arch=a, source=source)
    if spec.qk_l2_norm:
        experts["qk_l2_norm"] = experts.get("n_experts") != NO_QK_NORM_EXPERTS
    hybrid = {}
    if spec.mixer == "hybrid":
        hybrid["recurrent"] = RECURRENT_CONFIGS[spec.recurrent](full_md, a, v["n_layers"], v["norm_eps"], source)
    if spec.mixer == "mla":  # deepseek2: the latent attention's shapes; its cache holds keys only, or wider values
        hybrid["mla"] = mla_config(md, a, n_heads, n_kv_heads, head_dim, rope_dim, scaling, source)
        hybrid["value_dim"] = 0 if hybrid["mla"].absorbed else hybrid["mla"].value_dim
    if spec.mixer == "gemma4":
        from .gemma4 import gemma4_config

        hybrid["gemma4"] = gemma4_config(full_md, a, {**v, "head_dim": head_dim, "rope_dim": rope_dim}, source)
        hybrid["rope_theta_swa"] = hybrid["gemma4"].rope_theta_swa
    return ModelConfig(
        arch=spec,
        dim=v["dim"],
        hidden_dim=v["hidden_dim"],
        n_layers=v["n_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        context_length=v["context_length"],
        norm_eps=v["norm_eps"],
        rope_theta=v["rope_theta"],
        rope_dim=rope_dim,
        rope_freq_scale=scaling.freq_scale,
        sliding_window=v["sliding_window"] if spec.swa_pattern or spec.mixer == "gemma4" else None,
        attn_softcap=v["attn_softcap"] if spec.softcaps else None,
        final_softcap=v["final_softcap"] if spec.softcaps or spec.mixer == "gemma4" else None,
        rope_scaling=scaling,
        **multipliers,
        **temperature,
        **experts,
        **hybrid,
        **nextn,
    )


def moe_fields(md: Mapping[str, Any], spec: ArchSpec, v: dict[str, Any], source: str | None) -> dict[str, Any]:
    """The expert hparams, checked against each other (llama-model.cpp `load_hparams` asserts the same)."""
    a = spec.name
    e = schema.read_all(md, MOE_KEYS, arch=a, source=source)
    used = MOE_KEYS["n_experts_used"].name.replace("{arch}", a)
    if e["n_experts_used"] > e["n_experts"]:
        raise schema.fail(used, e["n_experts_used"], f"must be <= expert_count = {e['n_experts']}", source)
    g = schema.read_all(md, GROUP_KEYS, arch=a, source=source)
    groups, groups_used = GROUP_KEYS["groups"].name.replace("{arch}", a), f"{a}.expert_group_used_count"
    if g["groups"] >= e["n_experts"] or (g["groups"] > 1 and e["n_experts"] % g["groups"]):
        raise schema.fail(groups, g["groups"], f"must divide expert_count = {e['n_experts']} and be smaller", source)
    if g["groups"] > 1 and not 0 < g["groups_used"] < g["groups"]:
        raise schema.fail(groups_used, g["groups_used"], f"must be in [1, expert_group_count = {g['groups']})", source)
    routing = {"groups": g["groups"], "groups_used": g["groups_used"]} if g["groups"] > 1 else {}
    if spec.moe.routing_keys:  # deepseek2: the gating, weight norm and scale, shared experts, leading dense layers
        r = schema.read_all(md, ROUTING_KEYS, arch=a, source=source)
        if r["leading_dense"] > v["n_layers"]:
            lead = ROUTING_KEYS["leading_dense"].name.replace("{arch}", a)
            raise schema.fail(lead, r["leading_dense"], f"must be <= block_count = {v['n_layers']}", source)
        e["leading_dense"], e["n_shared"] = r["leading_dense"], r["n_shared"]
        routing.update(gating=GATING_FUNCS[r["gating"]] or spec.moe.gating, norm_weights=r["norm_weights"])
        routing.update(weights_scale=r["weights_scale"])
    e["moe_routing"] = replace(spec.moe, **routing)
    if not spec.moe.expert_width_key:
        e["expert_hidden_dim"] = v["hidden_dim"]
    e["expert_hidden_dim"] = e["expert_hidden_dim"] or v["hidden_dim"] // e["n_experts_used"]
    if spec.moe.shared_expert == "required":
        e["shared_hidden_dim"] = e["shared_hidden_dim"] or v["hidden_dim"]
    elif spec.moe.shared_expert == "expert_width":
        e["shared_hidden_dim"] = e["expert_hidden_dim"]
    elif spec.moe.shared_expert == "expert_count":
        e["shared_hidden_dim"] = e.pop("n_shared") * e["expert_hidden_dim"]
    elif spec.moe.shared_expert == "none":
        e["shared_hidden_dim"] = 0
    return e


def rope_scaling(md: Mapping[str, Any], spec: ArchSpec, v: dict[str, Any], source: str | None) -> RopeScaling:
    """The scaling llama.cpp's context derives from `rope.scaling.*` (src/llama-context.cpp), in float32 as
    there: YaRN's attention factor get_mscale(factor) / (1 + 0.1 ln factor) cancels the mscale ggml's
    `rope_yarn` multiplies in (up to rounding), times `rope.scaling.attn_factor`."""
    a = spec.name
    kind = v["rope_scaling"] if f"{a}.rope.scaling.type" in md else "linear"
    if kind not in SCALING_TYPES:
        raise schema.fail(f"{a}.rope.scaling.type", kind, f"must be one of {', '.join(SCALING_TYPES)}", source)
    e = schema.read_all(md, SCALING_KEYS, arch=a, source=source)
    f32 = np.float32
    factor = v["rope_scaling_factor"] or v["rope_scale_linear"]
    freq_scale = f32(1) / f32(factor) if factor and kind != "none" else f32(1)
    ext = e["ext_factor"] if e["ext_factor"] >= 0 else (1.0 if kind == "yarn" else 0.0)
    log_mul = e["log_mul"]
    if a == "deepseek2":  # [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: its loader cancels the converter's factor 0.1
        log_mul = float(f32(log_mul) / f32(0.1))
    attn = f32(e["yarn_attn_factor"])
    if ext != 0:
        factor = f32(1) / freq_scale

        def mscale(m: float):  # get_mscale: scale <= 1 ? 1 : 0.1f * mscale * logf(scale) + 1.0f
            return f32(1) if factor <= 1 else f32(0.1) * f32(m) * logf(factor) + f32(1)

        if log_mul:
            m = log_mul if a == "deepseek2" and log_mul != 1 else 1.0  # [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]
            attn = mscale(m) / mscale(log_mul)
        else:
            attn = mscale(1.0)
        attn = attn * (f32(1) / (f32(1) + f32(0.1) * logf(factor)))
    attn = attn * f32(e["rope_attn_factor"])
    return RopeScaling(
        kind, float(freq_scale), float(ext), float(attn), e["beta_fast"], e["beta_slow"], e["orig_ctx"] or 0, log_mul
    )
