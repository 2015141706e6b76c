"""Dequantizers for the 32-element "legacy" formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.

Layouts are the `block_q*` structs of llama.cpp `ggml/src/ggml-common.h`; the arithmetic follows
`dequantize_row_q*` in `ggml/src/ggml-quants.c`. Each value is `q*d` (exact in f32: an 11-bit fp16
mantissa times a <= 8-bit integer) plus, for the `_1` types, one rounding `+ m`, so results are
bit-identical to ggml whether or not the C compiler fuses the multiply-add.

Nibble order: byte j of `qs` holds element j in its low nibble and element j+16 in its high nibble.

The integer codes are widened to f32 (exactly) before meeting the per-block scales: NumPy multiplies a
u8/i8 array by a broadcast f32 column through small conversion buffers, 4x slower than f32 by f32.
"""

from __future__ import annotations

import numpy as np

from .fields import f16_field, i8_field, nibbles, u32_field

__all__ = [
    "dequantize_q4_0",
    "dequantize_q4_1",
    "dequantize_q5_0",
    "dequantize_q5_1",
    "dequantize_q8_0",
    "dequantize_q8_1",
    "fifth_bits",
]

_BIT = np.arange(32, dtype=np.uint32)


def _low4(qs: np.ndarray) -> np.ndarray:
    """u8[n, 16] packed nibbles -> u8[n, 32] in element order (low nibbles = 0..15, high = 16..31)."""
    return nibbles(qs).reshape(qs.shape[0], 32)


def fifth_bits(qh: np.ndarray) -> np.ndarray:
    """The u32 `qh` of Q5_0/Q5_1, bit j = bit 4 of element j: u32[n, 1] -> u8[n, 32] (0 or 16)."""
    return (((qh >> _BIT) & 1) << 4).astype(np.uint8)


# block_q4_0 (18 bytes) -> `dequantize_row_q4_0`
#   +0 d   fp16
#   +2 qs  u8[16]   lo nibble -> element j, hi nibble -> element j+16;   y = (q - 8) * d
def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _low4(blocks[:, 2:18]).astype(np.float32)  # f32[n, 32], exact small integers
    q -= 8
    q *= f16_field(blocks, 0)  # f32[n, 1]
    return q


# block_q4_1 (20 bytes) -> `dequantize_row_q4_1`
#   +0 d   fp16
#   +2 m   fp16
#   +4 qs  u8[16]   as Q4_0;   y = q * d + m
def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _low4(blocks[:, 4:20]).astype(np.float32)
    q *= f16_field(blocks, 0)
    q += f16_field(blocks, 2)
    return q


# block_q5_0 (22 bytes) -> `dequantize_row_q5_0`
#   +0 d   fp16
#   +2 qh  u32 (LE)   bit j = 5th bit of element j (j = 0..31)
#   +6 qs  u8[16]     low 4 bits as Q4_0;   y = (q - 16) * d
def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    qh = u32_field(blocks, 2)
    q = (_low4(blocks[:, 6:22]) | fifth_bits(qh)).astype(np.float32)
    q -= 16
    q *= f16_field(blocks, 0)
    return q


# block_q5_1 (24 bytes) -> `dequantize_row_q5_1`
#   +0 d   fp16
#   +2 m   fp16
#   +4 qh  u32 (LE)   as Q5_0
#   +8 qs  u8[16]     y = q * d + m
def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    qh = u32_field(blocks, 4)
    q = (_low4(blocks[:, 8:24]) | fifth_bits(qh)).astype(np.float32)
    q *= f16_field(blocks, 0)
    q += f16_field(blocks, 2)
    return q


# block_q8_0 (34 bytes) -> `dequantize_row_q8_0`
#   +0 d   fp16
#   +2 qs  i8[32]   y = q * d
def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    q = i8_field(blocks, 2, 32).astype(np.float32)
    q *= f16_field(blocks, 0)
    return q


# block_q8_1 (36 bytes), the activation format paired with Q4_1/Q5_1 in vec_dot (ggml has no dequantizer for it)
#   +0 d   fp16
#   +2 s   fp16     d * sum(qs), used by the dot product only
#   +4 qs  i8[32]   y = q * d
def dequantize_q8_1(blocks: np.ndarray) -> np.ndarray:
    q = i8_field(blocks, 4, 32).astype(np.float32)
    q *= f16_field(blocks, 0)
    return q
