"""Dequantizers for the non-linear 4-bit formats IQ4_NL and IQ4_XS.

Each 4-bit index selects a value of the table `kvalues_iq4nl` (llama.cpp `ggml/src/ggml-common.h`);
arithmetic follows `dequantize_row_iq4_nl` / `dequantize_row_iq4_xs` in `ggml/src/ggml-quants.c`.
Products of an fp16 scale, a 6-bit sub-scale and a table value fit in 24 bits, so they are exact.
"""

from __future__ import annotations

import numpy as np

from .fields import f16_field, nibbles, u16_field

__all__ = ["KVALUES_IQ4NL", "dequantize_iq4_nl", "dequantize_iq4_xs"]

QK_K = 256
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_KVALUES_F32 = KVALUES_IQ4NL.astype(np.float32)  # exact; f32 by f32 products are NumPy's fast path


# block_iq4_nl (18 bytes) -> `dequantize_row_iq4_nl`
#   +0 d   fp16
#   +2 qs  u8[16]   lo nibble -> element j, hi nibble -> element j+16;   y = d * kvalues[q]
def dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    return d * _KVALUES_F32[nibbles(blocks[:, 2:18]).reshape(n, 32)]


# block_iq4_xs (136 bytes) -> `dequantize_row_iq4_xs`: eight 32-element sub-blocks ib, each coded like IQ4_NL
#   +0 d         fp16
#   +2 scales_h  u16      bits 2ib..2ib+1 = high 2 bits of the 6-bit scale of sub-block ib
#   +4 scales_l  u8[4]    nibble ib % 2 of byte ib // 2 = low 4 bits of that scale
#   +8 qs        u8[128]  sub-block ib uses qs[16ib : 16ib+16]
#                         y = (d * (ls - 32)) * kvalues[q]
def dequantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)  # f32[n, 1]
    scales_h = u16_field(blocks, 2)  # u16[n, 1]
    scales_l = nibbles(blocks[:, 4:8]).transpose(0, 2, 1).reshape(n, 8)  # [n, ib]
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, ib]
    ls = (scales_l | (high.astype(np.uint8) << 4)).astype(np.int8) - 32
    dl = (d * ls).reshape(n, 8, 1)
    q = _KVALUES_F32[nibbles(blocks[:, 8:136].reshape(n, 8, 16)).reshape(n, 8, 32)]
    q *= dl
    return q.reshape(n, QK_K)
