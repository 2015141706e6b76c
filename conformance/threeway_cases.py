"""The three-way cases (conformance/threeway.py): one function per architecture returning a tiny transformers
config. Dims are as small as the architecture allows (dim 32, 2 layers, a 272-token vocabulary) so that each
converted F32 file stays under 300 KB; each case sets what makes its architecture differ from llama's where the
tiny model can show it (RoPE scaling past the prompt's positions, windows shorter than the prompt).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

SEED = 0
VOCAB = 272  # the 269 tokens of conformance.fixtures' vocabulary, padded (the converter names the rest [PADn])


def _common() -> dict:
    """Small dims shared by every case: 2 layers, dim 32, 4 heads of 8 over 2 KV heads, a 272-token vocab."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )


def qwen3moe():
    """Qwen3-30B-A3B's block: per-head Q/K norms, 4 experts of 24 with 2 chosen, top-k weights renormalized;
    head_dim 16 != dim / heads, as in the real model."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_common(),
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def gpt_oss():
    """gpt-oss: attention sinks, sliding (window 16) then full layers, biases everywhere, 4 experts with 2 chosen,
    the clamped SwiGLU, and the real model's YaRN (x32 over 4096, betas 32 / 1, `truncate` false: the correction
    range is not rounded to whole pairs, as OpenAI's reference computes it). With head size 16 the range is pairs
    2.02-4.35, which llama.cpp rounds to 2-5 (ggml.c `ggml_rope_yarn_corr_dims`)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        **_common() | {"intermediate_size": 24, "max_position_embeddings": 131072},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    )


def phi3():
    """Phi-3-mini-128k's block: fused qkv and gate_up, LongRoPE (short and long factors) over an original context
    of 32, so the 48-token prompt takes the long ones; its sliding window (2047) is longer than the prompt."""
    from transformers import Phi3Config

    half = 4  # head size 8: 4 rotary frequencies
    rng = np.random.default_rng(SEED + 1)
    return Phi3Config(
        **_common(),
        sliding_window=2047,
        original_max_position_embeddings=32,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": (1 + rng.random(half)).round(3).tolist(),
            "long_factor": (1 + 4 * rng.random(half)).round(3).tolist(),
            "original_max_position_embeddings": 32,
        },
        pad_token_id=0,
    )


def phi4():
    """Phi-4 (also Phi3ForCausalLM): no sliding window (`sliding_window` null, which the converter writes as
    `phi3.attention.sliding_window` 0 to tell Phi-4 apart) and no RoPE scaling."""
    from transformers import Phi3Config

    rope = {"rope_type": "default", "rope_theta": 250000.0}
    return Phi3Config(**_common(), sliding_window=None, rope_parameters=rope, pad_token_id=0)


def llama():
    """Llama 3: the converter permutes Q and K for llama.cpp's adjacent-pair RoPE (the transformers model rotates
    halves); Llama 3's frequency scaling (x8, original context 256) written as the `rope_freqs` tensor."""
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return LlamaConfig(**_common(), rope_parameters=rope)


def qwen3():
    """Qwen3: per-head Q/K norms, head size 16 != dim / heads, tied head."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common() | {"tie_word_embeddings": True}, head_dim=16)


def olmo2():
    """OLMo 2: norms after attention and FFN only, Q/K norms over all heads."""
    from transformers import Olmo2Config

    return Olmo2Config(**_common(), pad_token_id=0)


def granite():
    """Granite 3: embedding, attention, residual multipliers and the logits divided by `logits_scaling`."""
    from transformers import GraniteConfig

    return GraniteConfig(
        **_common(), embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.3, logits_scaling=4.0
    )


def qwen2moe():
    """Qwen1.5/2-MoE: Q/K/V biases, 4 experts with 2 chosen (weights not renormalized), a shared expert and its
    sigmoid gate."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **_common(),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
    )


def granitemoe():
    """Granite 3 MoE: granite's four multipliers around 4 experts with 2 chosen (the converter splits the fused
    `input_linear` into gate and up)."""
    from transformers import GraniteMoeConfig

    return GraniteMoeConfig(
        **_common() | {"intermediate_size": 24},
        num_local_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=6.0,
        attention_multiplier=0.2,
        residual_multiplier=0.3,
        logits_scaling=4.0,
    )


def smollm3():
    """SmolLM3: 4 layers, the 4th without RoPE (NoPE), tied head."""
    from transformers import SmolLM3Config

    return SmolLM3Config(**_common() | {"num_hidden_layers": 4, "tie_word_embeddings": True}, pad_token_id=0)


def gemma3():
    """Gemma 3 (text): norms stored as w with (1 + w) applied (the converter adds the 1), embeddings scaled by
    sqrt(dim), post-norms, Q/K norms, head 16 and `query_pre_attn_scalar` = head size as in the 1-12B models,
    both layers local (every 6th is global) with window 16 and the local RoPE base."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_common() | {"tie_word_embeddings": True, "rms_norm_eps": 1e-6},
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        pad_token_id=0,
    )


CASES: dict[str, Callable[[], object]] = {
    "qwen3moe": qwen3moe,
    "gpt-oss": gpt_oss,
    "phi3": phi3,
    "phi4": phi4,
    "llama": llama,
    "qwen3": qwen3,
    "olmo2": olmo2,
    "granite": granite,
    "qwen2moe": qwen2moe,
    "granitemoe": granitemoe,
    "smollm3": smollm3,
    "gemma3": gemma3,
}
