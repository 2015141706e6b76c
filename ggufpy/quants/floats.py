"""Plain element types (one element per "block"): F32, F16, BF16, and the storage types I8, I16, I32, F64.

Conversions follow llama.cpp `ggml/src/ggml-impl.h`: `ggml_compute_fp16_to_fp32` / `..._fp32_to_fp16`
(IEEE binary16, round to nearest even) and `ggml_compute_bf16_to_fp32` / `ggml_compute_fp32_to_bf16`.
ggml has no `to_float` for the integer types and F64 (a model keeps small tensors in them, e.g. token type
ids); they are read as C reads them, `(float)x`: integers above 2^24 and doubles round to nearest even.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "dequantize_bf16",
    "dequantize_f16",
    "dequantize_f32",
    "dequantize_f64",
    "dequantize_i8",
    "dequantize_i16",
    "dequantize_i32",
    "fp32_to_bf16_bits",
    "quantize_bf16",
    "quantize_f16",
    "quantize_f32",
]


def dequantize_f32(blocks: np.ndarray) -> np.ndarray:  # u8[n, 4] -> f32[n, 1]
    return blocks.view("<f4").astype(np.float32)


def quantize_f32(x: np.ndarray) -> np.ndarray:  # f32[n, 1] -> u8[n, 4]
    return np.ascontiguousarray(x, dtype="<f4").view(np.uint8)


def dequantize_f16(blocks: np.ndarray) -> np.ndarray:  # u8[n, 2] -> f32[n, 1]
    return blocks.view("<f2").astype(np.float32)


def quantize_f16(x: np.ndarray) -> np.ndarray:  # f32[n, 1] -> u8[n, 2]
    # NumPy's float32 -> float16 cast rounds to nearest even like F16C `_cvtps_ph`; overflow gives inf
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(x.astype("<f2")).view(np.uint8)


#   BF16: the top half of an f32      sign | exponent (8) | mantissa (7)   == f32 bits 31..16
def dequantize_bf16(blocks: np.ndarray) -> np.ndarray:  # u8[n, 2] -> f32[n, 1]
    return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """`ggml_compute_fp32_to_bf16`: round to nearest even on the top 16 bits; NaN kept, forced quiet."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16  # cannot wrap: u <= 0xFF800000 when not NaN
    quiet_nan = (u >> 16) | 0x40
    return np.where(is_nan, quiet_nan, rounded).astype("<u2")


def quantize_bf16(x: np.ndarray) -> np.ndarray:  # f32[n, 1] -> u8[n, 2]
    return fp32_to_bf16_bits(x).view(np.uint8)


def dequantize_i8(blocks: np.ndarray) -> np.ndarray:  # u8[n, 1] -> f32[n, 1]
    return blocks.view(np.int8).astype(np.float32)


def dequantize_i16(blocks: np.ndarray) -> np.ndarray:  # u8[n, 2] -> f32[n, 1]
    return blocks.view("<i2").astype(np.float32)


def dequantize_i32(blocks: np.ndarray) -> np.ndarray:  # u8[n, 4] -> f32[n, 1]
    return blocks.view("<i4").astype(np.float32)


def dequantize_f64(blocks: np.ndarray) -> np.ndarray:  # u8[n, 8] -> f32[n, 1]
    with np.errstate(over="ignore"):  # beyond f32's range -> inf, as the C cast
        return blocks.view("<f8").astype(np.float32)
