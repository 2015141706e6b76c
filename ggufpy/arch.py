"""Architecture registry: one `ArchSpec` record per GGUF `general.architecture`.

Differences between architectures are data, read by the forward pass; there is no per-architecture
model class. llama.cpp's equivalents live in `src/llama-model.cpp` (`llama_model_rope_type`, the hparams
loaders) and `src/models/<arch>.cpp` (the graph builders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import GGUFUnsupportedError


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


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in [
        # SmolLM2, Llama 2 / 3, Mistral and TinyLlama all convert to `llama`.
        ArchSpec("llama"),
        ArchSpec("qwen2", rope_style="neox", qkv_bias=True),
        ArchSpec("qwen3", rope_style="neox", qk_norm=True),
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
