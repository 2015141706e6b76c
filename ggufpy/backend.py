"""The one place that chooses how a matrix is multiplied by a quantized weight.

The NumPy reference dequantizes a weight when it is used and multiplies in float32 with BLAS. It keeps
dequantized weights in a bounded cache; the numba kernels (`ggufpy/kernels/`) compute from the blocks.
"""

from __future__ import annotations

import sys
from typing import Protocol

import numpy as np

from .numerics import NUMERICS, Numerics
from .quants import vecdot
from .weights import QuantTensor

DEFAULT_CACHE_BYTES = 256 << 20


class Backend(Protocol):
    name: str

    def linear(self, x: np.ndarray, w: QuantTensor) -> np.ndarray:
        """x (T, in) float32 times w (out, in) transposed -> (T, out) float32."""
        ...


def linears(backend: Backend, x: np.ndarray, ws: tuple[QuantTensor, ...]) -> list[np.ndarray]:
    """x times each of `ws` (weights sharing their input, like Q/K/V): one call where the backend can do
    that (`backend.linears`), else one `linear` each."""
    many = getattr(backend, "linears", None)
    return many(x, ws) if many is not None else [backend.linear(x, w) for w in ws]


class NumpyBackend:
    """Dequantize on use, then `x @ W.T`.

    Dequantized weights are cached until `cache_bytes` is used up; later weights are not cached. Unlike an
    LRU, this keeps a fixed share of the model hot when a forward pass sweeps through more weights than fit.
    """

    name = "numpy"

    def __init__(self, numerics: Numerics = NUMERICS["exact"], cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.numerics = numerics
        self.cache_bytes = cache_bytes
        self._cache: dict[tuple[QuantTensor, str], np.ndarray] = {}  # by identity (QuantTensor has eq=False)
        self._used = 0

    def dense(self, w: QuantTensor) -> np.ndarray:
        return self._cached(w, "dense", w.dequantize)  # (out, in)

    def _cached(self, w: QuantTensor, kind: str, make):
        hit = self._cache.get((w, kind))
        if hit is not None:
            return hit
        value = make()
        if self._used + value.nbytes <= self.cache_bytes:
            self._cache[w, kind] = value
            self._used += value.nbytes
        return value

    def linear(self, x: np.ndarray, w: QuantTensor) -> np.ndarray:
        if self.numerics.quantize_activations:  # llama.cpp's CPU matmul: activations in the vec_dot type
            if self.numerics.x86_kernels:  # ... and its kernels' f32 operations, straight from the blocks
                return vecdot.linear_x86(x, w.raw, w.type, w.shape)
            return vecdot.linear(x, self._cached(w, "split", lambda: vecdot.split_weight(w.raw, w.type, w.shape)))
        return x @ self.dense(w).T


def _numba_backend(**options) -> Backend:
    from .kernels import NumbaBackend  # imported on demand: ImportError naming the cause without numba

    return NumbaBackend(**options)


BACKENDS = {"numpy": NumpyBackend, "numba": _numba_backend}


def default_backend() -> str:
    """The backend to use by default: "numba" when numba imports, else "numpy" (saying so on stderr)."""
    from .kernels import AVAILABLE, IMPORT_ERROR

    if AVAILABLE:
        return "numba"
    print(f"ggufpy: numba unavailable ({IMPORT_ERROR}); using the NumPy backend", file=sys.stderr)
    return "numpy"


def make_backend(name: str, **options) -> Backend:
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}") from None
    return factory(**options)
