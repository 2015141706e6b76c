"""Architecture registry: one `ArchSpec` record per GGUF `general.architecture`.

Differences between architectures are data, read by the forward pass; there is no per-architecture
model class. llama.cpp's equivalents live in `src/llama-model.cpp` (`llama_model_rope_type`, the per-arch
graph builders).
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
    qk_norm: bool = False  # RMSNorm on each head of Q and K before RoPE (qwen3, gemma3)
    post_norms: bool = False  # extra norms after attention and after the FFN (gemma2/3)
    embed_scale: bool = False  # multiply token embeddings by sqrt(dim) (gemma)
    tied_output: bool = True  # without `output.weight`, the head reuses `token_embd.weight`


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in [
        # SmolLM2, Llama 2 / 3, Mistral and TinyLlama all convert to `llama`.
        ArchSpec("llama"),
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
