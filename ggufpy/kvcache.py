"""The KV cache: the only state of a sequence, preallocated per layer.

One `KVCache` object holds one sequence; independent sequences use independent caches. A shard's cache
holds only the shard's layers, indexed by their global layer number.

Preallocating a whole context is cheap: `np.zeros` of this size is an anonymous memory map, and the OS gives
a page physical memory only when a position in it is first written (measured: a 32768-position Gemma 3 cache,
1.1 GB of address space, adds ~0 MB resident until used). So a cache can be made as long as the model's
context and costs only what the sequence fills.
"""

from __future__ import annotations

import numpy as np


class ContextLengthError(ValueError):
    """A sequence would grow past the cache capacity or the model's context length."""


class KVCache:
    """Keys and values for positions 0..length-1 of every layer in `layers`.

    k[layer]: (capacity, n_kv_heads, head_dim) float32 (float16 in llama.cpp numerics); v[layer] the same, or
    `v_dim` wide where values and keys differ in width (deepseek2's attn_kv_b heads), 0 for a cache of keys only
    (MLA: llama.cpp's K-only cache, whose values are the first kv_lora_rank dims of each key row).
    """

    kv_type: str | None = None  # None: K and V as `dtype` values; else the name of their block type (`KV_TYPES`)

    def __init__(
        self, layers: range, capacity: int, n_kv_heads: int, head_dim: int, dtype=np.float32, v_dim: int | None = None
    ):
        self.layers = layers
        self.capacity = capacity
        self.dtype = np.dtype(dtype)
        shape = (capacity, n_kv_heads, head_dim)
        self.k = {i: np.zeros(shape, self.dtype) for i in layers}
        self.v = {i: np.zeros((*shape[:2], head_dim if v_dim is None else v_dim), self.dtype) for i in layers}
        self.length = 0  # positions filled (the same for every layer once a forward call returns)

    def check(self, pos: int, n_new: int) -> None:
        """Refuse a write that leaves a gap or runs past the capacity, before any layer is touched."""
        if pos < 0 or pos > self.length:
            raise ValueError(f"position {pos} is not in 0..{self.length}: the cache holds {self.length} positions")
        if pos + n_new > self.capacity:
            raise ContextLengthError(
                f"{pos + n_new} positions do not fit in a KV cache of {self.capacity}: "
                "create the cache with a larger capacity (model.new_cache(capacity=...))"
            )

    def update(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v (T, G, E) at positions pos..pos+T-1 of `layer`; return the views of positions 0..pos+T-1."""
        end = pos + k.shape[0]
        self.k[layer][pos:end] = k
        self.v[layer][pos:end] = v
        return self.k[layer][:end], self.v[layer][:end]

    def advance(self, end: int) -> None:
        self.length = end

    def truncate(self, length: int) -> None:
        """Forget positions ``length..`` (to reuse a common prefix, as llama.cpp's ``llama_memory_seq_rm``).

        The values stay in memory and are overwritten by the next write; attention reads only ``0..length-1``.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def resized(self, capacity: int) -> KVCache:
        """A copy with room for `capacity` positions holding the same filled ones (caches grow this way)."""
        if capacity < self.length:
            raise ContextLengthError(f"capacity {capacity} cannot hold the {self.length} positions of this cache")
        n_kv_heads, head_dim = next(iter(self.k.values())).shape[1:] if self.k else (0, 0)
        v_dim = next(iter(self.v.values())).shape[2] if self.v else None
        grown = KVCache(self.layers, capacity, n_kv_heads, head_dim, self.dtype, v_dim)
        for i in self.layers:
            grown.k[i][: self.length] = self.k[i][: self.length]
            grown.v[i][: self.length] = self.v[i][: self.length]
        grown.advance(self.length)
        return grown

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k.values()) + sum(a.nbytes for a in self.v.values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={self.layers}, length={self.length}, capacity={self.capacity})"


class Q8Cache(KVCache):
    """K and V rows stored as Q8_0 blocks, like llama.cpp's `-ctk q8_0 -ctv q8_0` (34 bytes per 32 values:
    0.27x an f32 cache, 0.53x an f16 one).

    k[layer], v[layer]: u8 (capacity, n_kv_heads, head_dim/32*34); `update` quantizes the new rows with ggml's
    x86 `quantize_row_q8_0` (what `ggml_set_rows` writes into a q8_0 cache) and returns the block views of
    positions 0..pos+T-1: attention reads them through `attention_q8` (`ggufpy.quants.x86.flash_attention`,
    or the backend's compiled kernel), as llama.cpp's flash attention reads its cache.
    """

    kv_type = "q8_0"

    def __init__(
        self,
        layers: range,
        capacity: int,
        n_kv_heads: int,
        head_dim: int,
        v_dim: int | None = None,
        rotation: str | None = None,
    ):
        if head_dim % 32 or (v_dim is not None and v_dim != head_dim):
            raise ValueError(
                f"a q8_0 KV cache needs keys and values of one width that is a multiple of 32 (Q8_0 blocks), "
                f"got head_dim {head_dim}, value width {v_dim}"
            )
        if rotation not in ROTATIONS:
            raise ValueError(f"unknown rotation {rotation!r}; available: {', '.join(map(str, ROTATIONS))}")
        if rotation is not None and head_dim % 64:
            rotation = None  # llama.cpp rotates only heads whose size is a multiple of 64
        self.head_dim = head_dim
        self.rotation = rotation  # how K/V (and Q, and the output) are Hadamard-rotated: None, "f32", or an x86 isa
        super().__init__(layers, capacity, n_kv_heads, head_dim // 32 * 34, np.uint8)

    def update(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from .quants.x86.flash_attention import quantize_q8_0_rows

        k, v = self.rotate(k), self.rotate(v)
        return super().update(layer, pos, quantize_q8_0_rows(k), quantize_q8_0_rows(v))

    def rotate(self, x: np.ndarray) -> np.ndarray:
        """x (..., E) Hadamard-rotated as this cache's K and V are (the identity without a rotation)."""
        from .quants.x86.flash_attention import rotate

        return x if self.rotation is None else rotate(x, None if self.rotation == "f32" else self.rotation)

    def resized(self, capacity: int) -> Q8Cache:
        if capacity < self.length:
            raise ContextLengthError(f"capacity {capacity} cannot hold the {self.length} positions of this cache")
        n_kv_heads = next(iter(self.k.values())).shape[1] if self.k else 0
        grown = Q8Cache(self.layers, capacity, n_kv_heads, self.head_dim, rotation=self.rotation)
        for i in self.layers:
            grown.k[i][: self.length] = self.k[i][: self.length]
            grown.v[i][: self.length] = self.v[i][: self.length]
        grown.advance(self.length)
        return grown


# A Q8Cache's Hadamard rotation (llama.cpp's default with a quantized cache): none, NumPy f32 products (the
# exact numerics), or ggml's f32 mul_mat of an x86 build (the llamacpp numerics)
ROTATIONS = (None, "f32", "avx512", "avx2")

# Cache types a model's `new_cache(kv_type=...)` accepts beyond its numerics' own (f32 exact, f16 llamacpp)
KV_TYPES = {"q8_0": Q8Cache}


def attention_q8(numerics, backend=None, cache: Q8Cache | None = None):
    """The attention over a Q8_0 cache (`ops.attention` contract, k and v as Q8_0 rows u8 (S, G, E/32*34)):
    the backend's compiled kernel where it has one (`backend.attention_q8`), else in the llamacpp numerics
    llama.cpp's flash attention replayed bit for bit, in the exact numerics the numerics' own attention over
    the dequantized rows (the cache's rounding is the only difference from an f32 cache). With the `cache`'s
    rotation, Q is rotated like the stored keys and the output rotated back (H is its own inverse)."""
    from .quants.x86 import flash_attention as fa

    def reference(q, k, v, start, scale, **extra):
        if numerics.x86_kernels:
            return fa.flash_attention_q8_0(q, k, v, start, scale, **extra)
        return numerics.attention(q, fa.dequantize_q8_0_rows(k), fa.dequantize_q8_0_rows(v), start, scale, **extra)

    compiled = getattr(backend, "attention_q8", None)

    def attend(q, k, v, start, scale, **extra):
        if compiled is None or "sinks" in extra:  # the NumPy functions alone know sinks (gpt-oss)
            return reference(q, k, v, start, scale, **extra)
        return compiled(q, k, v, start, scale, **extra)

    if cache is None or cache.rotation is None:
        return attend

    def rotated(q, k, v, start, scale, **extra):
        return cache.rotate(attend(cache.rotate(q), k, v, start, scale, **extra))

    return rotated
