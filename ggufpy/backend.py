"""The one place that chooses how a matrix is multiplied by a quantized weight.

The NumPy reference dequantizes a weight when it is used and multiplies in float32 with BLAS. It keeps
dequantized weights in a bounded cache; the numba kernels (`ggufpy/kernels/`) compute from the blocks.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .numerics import NUMERICS, Numerics
from .weights import QuantTensor

DEFAULT_CACHE_BYTES = 256 << 20


class Backend(Protocol):
    name: str

    def linear(self, x: np.ndarray, w: QuantTensor) -> np.ndarray:
        """x (T, in) float32 times w (out, in) transposed -> (T, out) float32."""
        ...


class NumpyBackend:
    """Dequantize on use, then `x @ W.T`.

    Dequantized weights are cached until `cache_bytes` is used up; later weights are not cached. Unlike an
    LRU, this keeps a fixed share of the model hot when a forward pass sweeps through more weights than fit.
    """

    name = "numpy"

    def __init__(self, numerics: Numerics = NUMERICS["exact"], cache_bytes: int = DEFAULT_CACHE_BYTES):
        if numerics.quantize_activations:
            raise NotImplementedError(f"the numpy backend does not implement numerics {numerics.name!r} yet")
        self.numerics = numerics
        self.cache_bytes = cache_bytes
        self._cache: dict[QuantTensor, np.ndarray] = {}  # keyed by identity (QuantTensor has eq=False)
        self._used = 0

    def dense(self, w: QuantTensor) -> np.ndarray:
        hit = self._cache.get(w)
        if hit is not None:
            return hit
        dense = w.dequantize()  # (out, in)
        if self._used + dense.nbytes <= self.cache_bytes:
            self._cache[w] = dense
            self._used += dense.nbytes
        return dense

    def linear(self, x: np.ndarray, w: QuantTensor) -> np.ndarray:
        return x @ self.dense(w).T


BACKENDS = {"numpy": NumpyBackend}


def make_backend(name: str, **options) -> Backend:
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}") from None
    return factory(**options)
