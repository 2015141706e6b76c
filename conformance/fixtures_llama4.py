"""A tiny synthetic llama4 GGUF model, written with gguf.GGUFWriter in the layout llama.cpp's loader reads
(src/models/llama4.cpp `load_arch_tensors`): dense `ffn_{gate,up,down}` layers and, every
`interleave_moe_layer_step`-th layer, a router `ffn_gate_inp` (F32), stacked experts `ffn_{gate,up,down}_exps` and
a shared expert `ffn_*_shexp` as wide as a routed one. No `attention.sliding_window` key: llama.cpp then chunks
layers 0-2 of every 4 (8192 positions, a literal) and leaves RoPE off the 4th.

`LLAMA4_FIXTURES` joins the conformance catalogue: importing this module (fixtures.py does) adds them to
`fixtures.FIXTURES`, and `fixtures.write_tiny_llama` hands a `TinyLlama4` to `write_tiny_llama4`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from ggufpy.constants import GGMLType

from .fixtures import FIXTURES, FLOAT, ROLES, WRITERS, _quantize, _tokens, add_vocab
from .fixtures_moe import TinyMoE


@dataclass(frozen=True)
class TinyLlama4(TinyMoE):
    """A `TinyMoE` whose MoE layers interleave with dense ones (`hidden_dim` wide); the shared expert is
    `expert_hidden_dim` wide, as llama.cpp's loader requires."""

    moe_layer_step: int = 2  # interleave_moe_layer_step: layers (il + 1) % step == 0 are MoE


def write_tiny_llama4(path: str | Path, spec: TinyLlama4) -> Path:
    """Write the model to `path` and return it."""
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _tokens()
    V, D, F, E = len(tokens), spec.dim, spec.hidden_dim, spec.head_dim
    X, Fe = spec.n_experts, spec.expert_hidden_dim
    Q, K = spec.n_heads * E, spec.n_kv_heads * E

    w = gguf.GGUFWriter(str(path), "llama4")
    w.add_name("tiny-llama4-synthetic")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(F)
    w.add_expert_count(X)
    w.add_expert_used_count(spec.n_experts_used)
    w.add_expert_feed_forward_length(Fe)
    w.add_interleave_moe_layer_step(spec.moe_layer_step)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_dimension_count(E)  # llama.cpp asserts n_rot == head size
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
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

    head_scale = None if spec.logit_std is None else spec.logit_std / np.sqrt(D)
    add("token_embd.weight", (V, D), "embd", scale=(head_scale if spec.tied_output else None) or 1.0)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (D,), None)
        for proj, rows in (("q", Q), ("k", K), ("v", K)):
            add(p + f"attn_{proj}.weight", (rows, D), "attn")
        add(p + "attn_output.weight", (D, Q), "attn")
        add(p + "ffn_norm.weight", (D,), None)
        if (i + 1) % spec.moe_layer_step == 0:
            add(p + "ffn_gate_inp.weight", (X, D), "router")  # logits of about +-1
            for stem, shape in (
                ("ffn_gate_exps", (X, Fe, D)),
                ("ffn_up_exps", (X, Fe, D)),
                ("ffn_down_exps", (X, D, Fe)),
            ):
                add(p + stem + ".weight", shape, "ffn")
            for stem, shape in (("ffn_gate_shexp", (Fe, D)), ("ffn_up_shexp", (Fe, D)), ("ffn_down_shexp", (D, Fe))):
                add(p + stem + ".weight", shape, "ffn")
        else:
            add(p + "ffn_gate.weight", (F, D), "ffn")
            add(p + "ffn_up.weight", (F, D), "ffn")
            add(p + "ffn_down.weight", (D, F), "ffn")
    add("output_norm.weight", (D,), None)
    if not spec.tied_output:
        add("output.weight", (V, D), "output", scale=head_scale)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Llama 4 Scout in small, F16 weights (the router F32, as llama-quantize keeps it): 4 layers (3 chunked RoPE layers
# with the Q/K L2 norm, then a global NoPE one), MoE on layers 1 and 3 (step 2) with 4 experts, 2 used (Scout routes
# to 1 of 16; 2 exercise the slots' sum and each expert's own weighted input), a shared expert of width 16, RoPE base
# 5e5 as Scout's. The chunk (8192) and the temperature's first step (position 8191) are llama.cpp literals, past the
# 128-token prompt: tests/test_llama4.py checks them against llama.cpp over 8256 tokens (slow).
LLAMA4_FIXTURES: dict[str, TinyLlama4] = {
    "llama4_f16": TinyLlama4(
        **{
            **vars(replace(FLOAT, n_layers=4, hidden_dim=32)),
            "arch": "llama4",
            "seed": 520,
            "rope_theta": 5e5,
            "n_experts": 4,
            "n_experts_used": 2,
            "expert_hidden_dim": 16,
            "types": dict.fromkeys(ROLES, GGMLType.F16),  # half the bytes (the fixtures' 8 MB budget)
        }
    ),
}
WRITERS[TinyLlama4] = write_tiny_llama4
FIXTURES.update(LLAMA4_FIXTURES)
