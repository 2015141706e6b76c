"""Tiny synthetic mixture-of-experts GGUF models (qwen3moe, qwen2moe, granitemoe, gpt-oss), written with
gguf.GGUFWriter in the layout llama.cpp's loaders read (src/models/qwen3moe.cpp, qwen2moe.cpp, granite-moe.cpp,
openai-moe-iswa.cpp): a router `ffn_gate_inp` (kept F32, as llama-quantize keeps it), stacked experts
`ffn_{gate,up,down}_exps` (GGUF dims (in, out, n_experts)) and, for qwen2moe and granitemoe, a shared expert
`ffn_*_shexp` (qwen2moe's behind its sigmoid gate `ffn_gate_inp_shexp`); gpt-oss's router and expert biases,
`attn_sinks`, `attn_output.bias` and `post_attention_norm` as the FFN's norm, as its ArchSpec asks.

`MOE_FIXTURES` and `GPT_OSS_FIXTURES` join the conformance catalogue: importing this module (fixtures.py does)
adds them to `fixtures.FIXTURES`, and `fixtures.write_tiny_llama` hands a `TinyMoE` to `write_tiny_moe`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from ggufpy.arch import ArchSpec, arch_spec
from ggufpy.constants import GGMLType

from .fixtures import FIXTURES, FLOAT, WRITERS, TinyLlama, _quantize, _tokens, add_vocab


@dataclass(frozen=True)
class TinyMoE(TinyLlama):
    """A `TinyLlama` whose feed-forward is a mixture of experts. The "ffn" role's type applies to the experts."""

    n_experts: int = 8  # expert_count
    n_experts_used: int = 2  # expert_used_count
    expert_hidden_dim: int = 8  # expert_feed_forward_length
    shared_hidden_dim: int = 0  # expert_shared_feed_forward_length (qwen2moe's shared expert)
    glu_scale: float = 1.0  # the gate and up experts' weights this much larger (gpt-oss: so its clamp at 7 bites)


def write_tiny_moe(path: str | Path, spec: TinyMoE) -> Path:
    """Write the model to `path` and return it."""
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _tokens()
    V, D, E = len(tokens), spec.dim, spec.head_dim
    X, Fe, Fs = spec.n_experts, spec.expert_hidden_dim, spec.shared_hidden_dim
    Q, K = spec.n_heads * E, spec.n_kv_heads * E
    a = arch_spec(spec.arch)
    if a.moe is None:
        raise ValueError(f"{a.name} is not a mixture-of-experts architecture")
    if a.moe.shared_expert == "required" and not Fs:
        raise ValueError(f"{a.name} needs a shared expert: set shared_hidden_dim")

    w = gguf.GGUFWriter(str(path), a.name)
    w.add_name(f"tiny-{a.name}-synthetic")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.hidden_dim)
    w.add_expert_count(X)
    w.add_expert_used_count(spec.n_experts_used)
    if a.moe.expert_width_key:
        w.add_expert_feed_forward_length(Fe)
    elif Fe != spec.hidden_dim:
        raise ValueError(f"{a.name}'s experts are feed_forward_length wide: set hidden_dim = expert_hidden_dim")
    if Fs:
        w.add_expert_shared_feed_forward_length(Fs)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_dimension_count(E)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    if spec.sliding_window is not None:
        w.add_sliding_window(spec.sliding_window)
    if spec.key_length is not None:
        w.add_key_length(spec.key_length)
        w.add_value_length(spec.key_length)
    for k, value in spec.extra_kv:  # as fixtures.write_tiny_llama: RoPE scaling, granite's multipliers
        add_kv = {float: w.add_float32, int: w.add_uint32, str: w.add_string}[type(value)]
        add_kv(f"{a.name}.{k}", value)
    w.add_vocab_size(V)
    add_vocab(w, tokens, token_types)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add(name: str, shape: tuple[int, ...], role: str | None, scale: float | None = None):
        if role is None:  # norm weights: around 1
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        if role == "bias":
            w.add_tensor(name, (0.5 * rng.standard_normal(shape)).astype(np.float32))
            return
        data = (rng.standard_normal(shape) * (scale or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)
        qtype = GGMLType.F32 if role == "router" else spec.types[role]
        if qtype == GGMLType.F32:
            w.add_tensor(name, data)
        else:  # quantized row by row: the experts' rows are rows like any other
            raw = _quantize(data.reshape(-1, shape[-1]), qtype).reshape(*shape[:-1], -1)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    head_scale = None if spec.logit_std is None else spec.logit_std / np.sqrt(D)
    add("token_embd.weight", (V, D), "embd", scale=(head_scale if spec.tied_output else None) or 1.0)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (D,), None)
        for proj, rows in (("q", Q), ("k", K), ("v", K)):
            add(p + f"attn_{proj}.weight", (rows, D), "attn")
            if a.qkv_bias:
                add(p + f"attn_{proj}.bias", (rows,), "bias")
        if a.qk_norm:
            add(p + "attn_q_norm.weight", (E,), None)
            add(p + "attn_k_norm.weight", (E,), None)
        add(p + "attn_output.weight", (D, Q), "attn")
        if a.attn_output_bias:
            add(p + "attn_output.bias", (D,), "bias")
        if a.attn_sinks:
            add(p + "attn_sinks.weight", (spec.n_heads,), "bias")
        add(p + a.ffn_norm_name + ".weight", (D,), None)
        add(p + "ffn_gate_inp.weight", (X, D), "router")
        experts = (("ffn_gate_exps", (X, Fe, D)), ("ffn_up_exps", (X, Fe, D)), ("ffn_down_exps", (X, D, Fe)))
        for stem, shape in experts:
            glu = spec.glu_scale if stem != "ffn_down_exps" else 1.0
            add(p + stem + ".weight", shape, "ffn", scale=glu / np.sqrt(shape[-1]))
        if a.moe.biases:
            add(p + "ffn_gate_inp.bias", (X,), "bias")
            for stem, shape in experts:
                add(p + stem + ".bias", shape[:2], "bias")
        if a.moe.shared_gate is not None:
            add(p + "ffn_gate_inp_shexp.weight", (D,), "router")
        if Fs:
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


_MOE = TinyMoE(**{**vars(replace(FLOAT, n_layers=2, hidden_dim=32))})

# gpt-oss's block is in ggufpy.arch's registry now; tests/test_moe.py still reads the spec from here
PENDING: dict[str, ArchSpec] = {"gpt-oss": arch_spec("gpt-oss")}
# gpt-oss-20b in small: 8 experts, 4 used (32 / 4 there), alternating 32-token windows, YaRN x32 over 4096.
GPT_OSS = replace(
    _MOE,
    arch="gpt-oss",
    seed=503,
    key_length=16,
    rope_theta=150000.0,
    tied_output=False,
    sliding_window=32,
    n_experts=8,
    n_experts_used=4,
    glu_scale=3.0,
    extra_kv=(
        ("rope.scaling.type", "yarn"),
        ("rope.scaling.factor", 32.0),
        ("rope.scaling.original_context_length", 4096),
    ),
)

# One F32 fixture per mixture-of-experts architecture, 2 layers, dim 32. qwen3moe: 8 experts, 2 used, heads of
# 24 (Qwen3-30B-A3B's 128 experts / 8 used in small). qwen2moe: 17 experts, 4 used, so the router's softmax runs
# both ggml's 16-wide SIMD exp and the scalar expf tail, and top-k sorts more than 16 (libstdc++'s introsort
# path); Q/K/V biases, an untied head and a shared expert of width 16 behind its sigmoid gate.
MOE_FIXTURES: dict[str, TinyMoE] = {
    "qwen3moe_f32": replace(_MOE, arch="qwen3moe", seed=500, key_length=24, rope_theta=1e6),
    "qwen2moe_f32": replace(
        _MOE,
        arch="qwen2moe",
        seed=501,
        rope_theta=1e6,
        tied_output=False,
        n_experts=17,
        n_experts_used=4,
        shared_hidden_dim=16,
    ),
    # granite's multipliers (as fixtures.ARCH_FIXTURES["granite"]) around 4 experts, 2 used, and the optional
    # shared expert of "Granite MoE Shared" (no gate)
    "granitemoe_f32": replace(
        _MOE,
        arch="granitemoe",
        seed=502,
        hidden_dim=8,
        n_experts=4,
        shared_hidden_dim=16,
        extra_kv=(("embedding_scale", 12.0), ("attention.scale", 0.2), ("residual_scale", 0.22), ("logit_scale", 2.0)),
    ),
    # quantized as llama.cpp's mixes are: Q4_0 experts (x86 repacks them: ggml_mul_mat_id's per-row gemv), Q8_0
    # elsewhere, the router F32; dim 64 for the 32-element blocks
    "qwen3moe_q4_0": replace(
        _MOE,
        arch="qwen3moe",
        seed=504,
        dim=64,
        rope_theta=1e6,
        expert_hidden_dim=32,
        types={"embd": GGMLType.Q8_0, "output": GGMLType.Q8_0, "attn": GGMLType.Q8_0, "ffn": GGMLType.Q4_0},
    ),
}
# gpt-oss: sinks, biases, layer 0 in a 32-token window and layer 1 global over the 128-token prompt, YaRN. Apart
# from MOE_FIXTURES, whose tests (tests/test_moe.py) check the experts against a dense definition without
# gpt-oss's biases and clamped unit; tests/test_gptoss.py covers it.
GPT_OSS_FIXTURES: dict[str, TinyMoE] = {
    "gpt_oss_f32": GPT_OSS,
    # as gpt-oss ships: MXFP4 experts (ggml_mul_mat_id over MXFP4 x Q8_0 blocks), the rest unquantized; dim 64 and
    # experts 32 wide for the 32-element blocks
    "gpt_oss_mxfp4": replace(
        GPT_OSS, seed=505, dim=64, expert_hidden_dim=32, types={**FLOAT.types, "ffn": GGMLType.MXFP4}
    ),
}
WRITERS[TinyMoE] = write_tiny_moe
FIXTURES.update(MOE_FIXTURES)
FIXTURES.update(GPT_OSS_FIXTURES)
