"""Dequantizers for the 256-element k-quant super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K.

Layouts are the `block_q*_K` structs of llama.cpp `ggml/src/ggml-common.h` (QK_K = 256); arithmetic follows
`dequantize_row_q*_K` in `ggml/src/ggml-quants.c`, keeping its f32 operation order: the sub-block scale
`dl = d * sc` and min `ml = dmin * m` are formed first, then `y = dl * q - ml`. `dl * q` is exact in f32, so
the only rounding is the final subtraction and the results are bit-identical to ggml. The integer codes
are widened to f32 (exactly) before meeting the scales: NumPy's mixed u8-by-f32 broadcasts are 4x slower.

Axis names in the shape comments: n = blocks, h = 128-element half, c = 64-element chunk, j = 2-bit plane,
k/t/s = 16- or 32-element sub-block picked by position or nibble, l = element within a sub-block.
"""

from __future__ import annotations

import numpy as np

from .fields import f16_field, f32_field, i8_field, nibbles

__all__ = [
    "dequantize_q2_K",
    "dequantize_q3_K",
    "dequantize_q4_K",
    "dequantize_q5_K",
    "dequantize_q6_K",
    "dequantize_q8_K",
    "k4_scales_mins",
]

QK_K = 256
_SHIFT_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)  # bit planes j = 0..3 of a byte of 2-bit values
_SHIFT_NIBBLE = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """qs u8[n, 64] -> u8[n, h=2, j=4, k=2, l=16]: element 128h + 32j + 16k + l = (qs[32h+16k+l] >> 2j) & 3."""
    n = qs.shape[0]
    return (qs.reshape(n, 2, 1, 2, 16) >> _SHIFT_2BIT.reshape(1, 1, 4, 1, 1)) & 3


# block_q2_K (84 bytes) -> `dequantize_row_q2_K`
#   +0  scales u8[16]   sub-block i (16 elements): low nibble = scale, high nibble = min
#   +16 qs     u8[64]   2-bit quants, see _two_bit_planes; sub-block of element 128h+32j+16k+l is 8h+2j+k
#   +80 d      fp16
#   +82 dmin   fp16     y = (d * (sc & 15)) * q - (dmin * (sc >> 4))
def dequantize_q2_K(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sc = blocks[:, 0:16].reshape(n, 2, 4, 2, 1)  # [h, j, k, 1]
    d = f16_field(blocks, 80).reshape(n, 1, 1, 1, 1)
    dmin = f16_field(blocks, 82).reshape(n, 1, 1, 1, 1)
    dl = d * (sc & 0x0F)
    ml = dmin * (sc >> 4)
    q = _two_bit_planes(blocks[:, 16:80]).astype(np.float32)  # [n, h, j, k, l]
    q *= dl
    q -= ml
    return q.reshape(n, QK_K)


def _q3_k_scales(b: np.ndarray) -> np.ndarray:
    """The sixteen 6-bit Q3_K scales, packed in 12 bytes, as signed s - 32: u8[n, 12] -> i8[n, 16].

    Scale i: low 4 bits = b[i] & 15 (i < 8) or b[i-8] >> 4 (i >= 8); high 2 bits = (b[8 + i%4] >> 2*(i//4)) & 3.
    """
    n = b.shape[0]
    low = nibbles(b[:, 0:8]).reshape(n, 16)  # [i // 8, i % 8]
    high = (b[:, None, 8:12] >> _SHIFT_2BIT.reshape(1, 4, 1)) & 3  # [i // 4, i % 4]
    return (low | (high.reshape(n, 16) << 4)).astype(np.int8) - 32


# block_q3_K (110 bytes) -> `dequantize_row_q3_K`
#   +0   hmask  u8[32]   bit (4h + j) of hmask[16k + l] is the high bit of element 128h+32j+16k+l
#   +32  qs     u8[64]   low 2 bits, as Q2_K
#   +96  scales u8[12]   sixteen 6-bit scales, see _q3_k_scales
#   +108 d      fp16     y = (d * (s - 32)) * (q_low - (high bit ? 0 : 4))
def dequantize_q3_K(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    hmask = blocks[:, 0:32].reshape(n, 1, 1, 2, 16)  # [k, l]
    bit = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1, 1)  # 4h + j
    minus4 = (((hmask >> bit) & 1) ^ 1) << 2  # [n, h, j, k, l]: 4 where the high bit is clear
    q = (_two_bit_planes(blocks[:, 32:96]).astype(np.int8) - minus4.astype(np.int8)).astype(np.float32)
    d = f16_field(blocks, 108).reshape(n, 1, 1, 1, 1)
    q *= d * _q3_k_scales(blocks[:, 96:108]).reshape(n, 2, 4, 2, 1)  # dl
    return q.reshape(n, QK_K)


def k4_scales_mins(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`get_scale_min_k4` for all eight sub-blocks: the 12 packed bytes -> (sc u8[n, 8], m u8[n, 8]).

    bytes 0-3:  sc0..sc3 (low 6 bits), top 2 bits = high bits of sc4..sc7
    bytes 4-7:  m0..m3   (low 6 bits), top 2 bits = high bits of m4..m7
    bytes 8-11: low nibble = low 4 bits of sc4..sc7, high nibble = low 4 bits of m4..m7
    """
    sc = np.concatenate([b[:, 0:4] & 63, (b[:, 8:12] & 0x0F) | ((b[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([b[:, 4:8] & 63, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], axis=1)
    return sc, m


# block_q4_K (144 bytes) -> `dequantize_row_q4_K`
#   +0  d      fp16
#   +2  dmin   fp16
#   +4  scales u8[12]   eight 6-bit (scale, min) pairs, see k4_scales_mins
#   +16 qs     u8[128]  chunk c (64 elements) uses qs[32c : 32c+32]: low nibbles are sub-block 2c, high 2c+1
#                       y = (d * sc) * q - (dmin * m)
def dequantize_q4_K(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    dl, ml = _k4_scale_terms(blocks)
    q = nibbles(blocks[:, 16:144].reshape(n, 4, 32)).astype(np.float32)  # [n, c, t, l]
    q *= dl
    q -= ml
    return q.reshape(n, QK_K)


# block_q5_K (176 bytes) -> `dequantize_row_q5_K`
#   +0  d      fp16
#   +2  dmin   fp16
#   +4  scales u8[12]   as Q4_K
#   +16 qh     u8[32]   bit (2c + t) of qh[l] is the 5th bit of element 64c + 32t + l
#   +48 qs     u8[128]  low 4 bits, as Q4_K;   y = (d * sc) * q - (dmin * m)
def dequantize_q5_K(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    dl, ml = _k4_scale_terms(blocks)
    qh = blocks[:, 16:48].reshape(n, 1, 1, 32)
    bit = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)  # 2c + t
    q = (nibbles(blocks[:, 48:176].reshape(n, 4, 32)) | (((qh >> bit) & 1) << 4)).astype(np.float32)  # [n, c, t, l]
    q *= dl
    q -= ml
    return q.reshape(n, QK_K)


def _k4_scale_terms(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per sub-block (d * sc, dmin * m), each f32[n, c=4, t=2, 1]."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0).reshape(n, 1, 1, 1)
    dmin = f16_field(blocks, 2).reshape(n, 1, 1, 1)
    sc, m = k4_scales_mins(blocks[:, 4:16])
    return d * sc.reshape(n, 4, 2, 1), dmin * m.reshape(n, 4, 2, 1)


# block_q6_K (210 bytes) -> `dequantize_row_q6_K`
#   +0   ql     u8[128]  low 4 bits; half h uses ql[64h : 64h+64]
#   +128 qh     u8[64]   high 2 bits; half h uses qh[32h : 32h+32]
#   +192 scales i8[16]   one per 16 elements
#   +208 d      fp16
# Element 128h + 32r + l (r = 0..3, l = 0..31) is
#   low  = ql[64h + 32(r % 2) + l], nibble r // 2
#   high = (qh[32h + l] >> 2r) & 3
#   y = (d * scales[8h + 2r + l // 16]) * ((low | high << 4) - 32)
def dequantize_q6_K(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 2, 32)  # [n, h, 1, s, l]
    low = ((ql >> _SHIFT_NIBBLE) & 0x0F).reshape(n, 2, 4, 32)  # [n, h, r = 2*nibble + s, l]
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> _SHIFT_2BIT.reshape(1, 1, 4, 1)) & 3  # [n, h, r, l]
    q = (low | (high << 4)).astype(np.float32)
    q -= 32
    d = f16_field(blocks, 208).reshape(n, 1, 1, 1, 1)
    dl = d * i8_field(blocks, 192, 16).reshape(n, 2, 4, 2, 1)  # [n, h, r, l // 16, 1]
    q = q.reshape(n, 2, 4, 2, 16)
    q *= dl
    return q.reshape(n, QK_K)


# block_q8_K (292 bytes) -> `dequantize_row_q8_K`, the activation format paired with the k-quants and IQ4_XS in vec_dot
#   +0   d      f32 (not fp16)
#   +4   qs     i8[256]      y = d * q
#   +260 bsums  i16[16]      sums of qs over groups of 16, used by the dot products only
def dequantize_q8_K(blocks: np.ndarray) -> np.ndarray:
    return f32_field(blocks, 0) * i8_field(blocks, 4, QK_K)
