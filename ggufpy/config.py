"""Model hyperparameters, read from GGUF metadata in exactly one place.

Keys follow llama.cpp's `src/llama-arch.cpp` (LLM_KV_*): `{arch}.embedding_length`, `{arch}.block_count`, ...
The forward pass only ever sees a `ModelConfig`, never raw metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import schema
from .arch import ArchSpec, arch_spec
from .errors import GGUFMetadataError


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

    def is_local(self, layer: int) -> bool:
        """Whether `layer` uses sliding-window attention (llama.cpp `set_swa_pattern`: il % n < n - 1)."""
        n = self.arch.swa_pattern
        return self.sliding_window is not None and n > 0 and layer % n < n - 1

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_local(layer) else None

    def rope(self, layer: int) -> tuple[float, float]:
        """(theta, freq_scale) of `layer`: local layers of gemma3 use their own base and no scaling."""
        if self.is_local(layer) and self.arch.rope_theta_swa is not None:
            return self.arch.rope_theta_swa, 1.0
        return self.rope_theta, self.rope_freq_scale

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
    v = schema.read_all(md, schema.MODEL_KEYS, arch=a, source=source)

    def key(field: str) -> str:
        return schema.MODEL_KEYS[field].name.replace("{arch}", a)

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
    factor = v["rope_scaling_factor"] or v["rope_scale_linear"]
    if v["rope_scaling"] not in ("none", "linear") and factor not in (0.0, 1.0):
        raise schema.fail(key("rope_scaling"), v["rope_scaling"], "must be 'none' or 'linear' (supported)", source)
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
        rope_freq_scale=1.0 / factor if factor else 1.0,
        sliding_window=v["sliding_window"] if spec.swa_pattern else None,
        attn_softcap=v["attn_softcap"] if spec.softcaps else None,
        final_softcap=v["final_softcap"] if spec.softcaps else None,
    )
