"""Model hyperparameters, read from GGUF metadata in exactly one place.

Keys follow llama.cpp's `src/llama-arch.cpp` (LLM_KV_*): `{arch}.embedding_length`, `{arch}.block_count`, ...
The forward pass only ever sees a `ModelConfig`, never raw metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .arch import ArchSpec, arch_spec
from .errors import GGUFError


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


def _get(md: Mapping[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    if key not in md:
        if default is ...:
            raise GGUFError(f"metadata key {key!r} is required but missing")
        return default
    value = md[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise GGUFError(f"metadata key {key!r} is {value!r}: expected {kind.__name__}")
    return value


def config_from_metadata(md: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    """Build the config; `vocab_size` comes from the embedding tensor (the authority llama.cpp uses)."""
    spec = arch_spec(md.get("general.architecture"))
    a = spec.name
    dim = _get(md, f"{a}.embedding_length", int)
    n_heads = _get(md, f"{a}.attention.head_count", int)
    n_kv_heads = _get(md, f"{a}.attention.head_count_kv", int, n_heads)
    if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise GGUFError(f"head_count {n_heads} must be a positive multiple of head_count_kv {n_kv_heads}")
    head_dim = _get(md, f"{a}.attention.key_length", int, dim // n_heads)
    scaling = _get(md, f"{a}.rope.scaling.type", str, "none")
    factor = _get(md, f"{a}.rope.scaling.factor", float, 0.0) or _get(md, f"{a}.rope.scale_linear", float, 0.0)
    if scaling not in ("none", "linear") and factor not in (0.0, 1.0):
        raise GGUFError(f"metadata {a}.rope.scaling.type is {scaling!r}: only 'none' and 'linear' are supported")
    return ModelConfig(
        arch=spec,
        dim=dim,
        hidden_dim=_get(md, f"{a}.feed_forward_length", int),
        n_layers=_get(md, f"{a}.block_count", int),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        context_length=_get(md, f"{a}.context_length", int),
        norm_eps=_get(md, f"{a}.attention.layer_norm_rms_epsilon", float, 1e-5),
        rope_theta=_get(md, f"{a}.rope.freq_base", float, 10000.0),
        rope_dim=_get(md, f"{a}.rope.dimension_count", int, head_dim),
        rope_freq_scale=1.0 / factor if factor else 1.0,
        sliding_window=_get(md, f"{a}.attention.sliding_window", int, None) if spec.swa_pattern else None,
        attn_softcap=_get(md, f"{a}.attn_logit_softcapping", float, None) if spec.softcaps else None,
        final_softcap=_get(md, f"{a}.final_logit_softcapping", float, None) if spec.softcaps else None,
    )
