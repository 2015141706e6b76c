"""The one place that chooses how a matrix is multiplied by a quantized weight.

The NumPy reference dequantizes a weight when it is used and multiplies in float32 with BLAS. It keeps
dequantized weights in a bounded cache; the numba kernels (`ggufpy/kernels/`) compute from the blocks.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Protocol

import numpy as np

from .constants import GGML_BLOCK_LAYOUT
from .numerics import NUMERICS, Numerics
from .quants import dequantize, vecdot
from .quants.planes import PLANE_TYPES, dequantize_planes, permute
from .weights import QuantTensor

DEFAULT_CACHE_BYTES = 256 << 20
TILE_BYTES = 1 << 20  # f32 rows dequantized at a time for uncached weights: 1 MB stays in L2; 4 MB tiles
# measured 2x slower for k-quant models (fresh temporaries past malloc's mmap threshold fault their pages in)
FEW_ROWS = 16  # products with fewer activation rows are memory-bound matrix-vector work


@functools.cache
def _blas_controller():
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # a declared dependency, but the reference runs without it
        return None
    return ThreadpoolController().select(user_api="blas")


@contextlib.contextmanager
def one_blas_thread():
    """BLAS on one thread for the duration. A product with a few activation rows reads each weight once and
    does little arithmetic: a second BLAS thread only adds a fork-join, and when another process holds the
    other core it waits for a time slice. Measured on SmolLM2 Q4_1 decode, NumPy backend, 2 cores under a
    load of 3: 850 ms/token with OpenBLAS's 2 threads, 130 ms with one."""
    controller = _blas_controller()
    if controller is None:
        yield
        return
    with controller.limit(limits=1):
        yield


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
        if x.shape[0] < FEW_ROWS:  # decode: a matrix-vector product on one BLAS thread
            with one_blas_thread():
                return self._linear(x, w)
        return self._linear(x, w)

    def _linear(self, x: np.ndarray, w: QuantTensor) -> np.ndarray:
        if self.numerics.quantize_activations:  # llama.cpp's CPU matmul: activations in the vec_dot type
            if self.numerics.x86_kernels:  # ... and its kernels' f32 operations, straight from the blocks
                return vecdot.linear_x86(x, w.raw, w.type, w.shape, isa=self.numerics.x86_isa)
            return vecdot.linear(x, self._cached(w, "split", lambda: vecdot.split_weight(w.raw, w.type, w.shape)))
        hit = self._cache.get((w, "dense"))
        if hit is None and self._used + 4 * int(np.prod(w.shape)) <= self.cache_bytes:
            hit = self.dense(w)
        if hit is not None:
            return x @ hit.T
        return self._tiled(x, w)

    def _tiled(self, x: np.ndarray, w: QuantTensor) -> np.ndarray:
        """x @ W.T for a weight the cache has no room for: dequantized TILE_BYTES of rows at a time, so the f32
        copy never exists whole and its tile stays in cache (a whole fresh f32 copy of SmolLM2's 49152 x 576
        output head costs more in page faults than in dequantizing). Types with a faster plane-order
        dequantizer use it, with the activations permuted to match (`ggufpy.quants.planes`)."""
        rows, cols = w.shape
        blocks = w.raw.reshape(rows, -1)  # (rows, row_bytes)
        step = max(1, TILE_BYTES // (4 * cols))
        y = np.empty((x.shape[0], rows), np.float32)
        if w.type in PLANE_TYPES:
            x = permute(x, GGML_BLOCK_LAYOUT[w.type][0])

            def tile(r0: int, r1: int) -> np.ndarray:  # (cols, r1 - r0) in plane order
                return dequantize_planes(blocks[r0:r1], w.type).reshape(cols, r1 - r0)
        else:

            def tile(r0: int, r1: int) -> np.ndarray:  # (cols, r1 - r0)
                return dequantize(blocks[r0:r1].reshape(-1), w.type, (r1 - r0, cols)).T

        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            # the tile is a temporary, freed before the next one is made, so malloc hands back the same warm
            # pages (a tile kept alive in a variable over the next one measured 35% slower: fresh pages)
            y[:, r0:r1] = x @ tile(r0, r1)
        return y


def _numba_backend(**options) -> Backend:
    from .kernels import NumbaBackend  # imported on demand: ImportError naming the cause without numba

    return NumbaBackend(**options)


BACKENDS = {"numpy": NumpyBackend, "numba": _numba_backend}


def default_backend() -> str:
    """The backend to use by default: "numba" when numba imports and compiles, else "numpy" (saying so on
    stderr). With NUMBA_DISABLE_JIT=1 the numba kernels would run as plain Python loops, minutes per token:
    they stay available as `backend="numba"` (for debugging them), but are not the default."""
    from .kernels import AVAILABLE, IMPORT_ERROR, JIT_DISABLED

    if AVAILABLE and not JIT_DISABLED:
        return "numba"
    why = "NUMBA_DISABLE_JIT is set" if AVAILABLE else f"numba unavailable ({IMPORT_ERROR})"
    print(f"ggufpy: {why}; using the NumPy backend", file=sys.stderr)
    return "numpy"


def make_backend(name: str, **options) -> Backend:
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}") from None
    return factory(**options)
