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
        return f"KVCache(layers={self.layers}, length={self.length}, capacity={self.capacity})"
