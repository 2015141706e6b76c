"""Helpers that read the fixed-width fields of a block array and pack them back.

Every quant block is a packed little-endian C struct (llama.cpp `ggml/src/ggml-common.h`). The blocks of a
tensor arrive as `u8[n_blocks, type_size]`; a field is a column slice of that array.
"""

from __future__ import annotations

import numpy as np

__all__ = ["as_bytes", "f16_field", "f32_field", "i8_field", "nibbles", "u16_field", "u32_field"]


def f16_field(blocks: np.ndarray, offset: int, count: int = 1) -> np.ndarray:
    """fp16 values at byte `offset`, widened to f32 (exact): f32[n_blocks, count]."""
    return _view(blocks, offset, count, "<f2").astype(np.float32)


def f32_field(blocks: np.ndarray, offset: int, count: int = 1) -> np.ndarray:
    return _view(blocks, offset, count, "<f4").astype(np.float32)


def u16_field(blocks: np.ndarray, offset: int, count: int = 1) -> np.ndarray:
    return _view(blocks, offset, count, "<u2").astype(np.uint16)


def u32_field(blocks: np.ndarray, offset: int, count: int = 1) -> np.ndarray:
    return _view(blocks, offset, count, "<u4").astype(np.uint32)


def i8_field(blocks: np.ndarray, offset: int, count: int) -> np.ndarray:
    return blocks[:, offset : offset + count].view(np.int8)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """Split bytes into 4-bit values, low nibbles first: u8[..., m] -> u8[..., 2, m]."""
    out = np.empty((*qs.shape[:-1], 2, qs.shape[-1]), np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[..., 0, :])
    np.right_shift(qs, 4, out=out[..., 1, :])
    return out


def as_bytes(*fields: np.ndarray) -> np.ndarray:
    """Concatenate per-block fields (any dtype, each [n_blocks, ...]) into u8[n_blocks, type_size]."""
    n_blocks = fields[0].shape[0]
    parts = [np.ascontiguousarray(f).reshape(n_blocks, -1).view(np.uint8) for f in fields]
    return np.concatenate(parts, axis=1)


def _view(blocks: np.ndarray, offset: int, count: int, dtype: str) -> np.ndarray:
    width = np.dtype(dtype).itemsize * count
    # a column slice has a unit stride on its last axis, so NumPy can reinterpret it in place
    return blocks[:, offset : offset + width].view(dtype)
