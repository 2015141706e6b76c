"""Numerics modes: how much of llama.cpp's arithmetic the forward pass reproduces.

`exact` dequantizes weights and computes in float32: the teaching reference. Further modes (llama.cpp's
activation quantization, f16 KV cache, its rounding points) plug in here as records, and the forward
pass and the backends read only these fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import ops


@dataclass(frozen=True)
class Numerics:
    name: str
    kv_dtype: np.dtype  # storage type of the KV cache
    rope_angles: Callable = ops.rope_angles  # (positions, rope_dim, theta, freq_scale, freq_factors) -> cos, sin
    attention: Callable = ops.attention  # (q, k, v, start, scale) -> (T, H*E)
    quantize_activations: bool = False  # round activations to each weight type's vec_dot type (ggml-cpu.c)


NUMERICS: dict[str, Numerics] = {"exact": Numerics("exact", np.dtype(np.float32))}


def numerics_mode(name: str) -> Numerics:
    try:
        return NUMERICS[name]
    except KeyError:
        raise ValueError(f"unknown numerics mode {name!r}; available: {', '.join(NUMERICS)}") from None
