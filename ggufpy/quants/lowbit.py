"""Dequantizers for the ternary, binary and 4-bit float formats: TQ1_0, TQ2_0, Q1_0, MXFP4 and NVFP4.

Layouts are the structs of llama.cpp `ggml/src/ggml-common.h`; arithmetic follows `dequantize_row_*` in
`ggml/src/ggml-quants.c`. As in `iqgrid.py`, each format is split into `parts` (scales f32[n, m], integer
values i8[n, m, sub]) with y = scale * value, ggml's single rounding; the numba kernels repack the same parts.

The FP4 formats store E2M1 codes whose values ggml keeps doubled (`kvalues_mxfp4`, integers), and halve the
block scales instead: E8M0 (MXFP4, a power of two) and unsigned E4M3 (NVFP4, 16-element sub-blocks).
"""

from __future__ import annotations

import numpy as np

from .fields import f16_field, nibbles
from .iqgrid import scaled

__all__ = [
    "KVALUES_MXFP4",
    "PARTS",
    "UE4M3_HALF",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "dequantize_q1_0",
    "dequantize_tq1_0",
    "dequantize_tq2_0",
    "e8m0_to_fp32_half",
]

QK_K = 256
# ggml-common.h `kvalues_fp4` (= kvalues_mxfp4): E2M1 values doubled, indexed by the 4-bit code
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    """ggml-impl.h `ggml_e8m0_to_fp32_half`: 2^(e - 128) as f32 bits (e = 0, 1 subnormal; 255 is no NaN)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23)
    return bits.astype(np.uint32).view(np.float32)


def _ue4m3_half_table() -> np.ndarray:
    """ggml-impl.h `ggml_ue4m3_to_fp32` for every byte: half the unsigned E4M3 value (bias 7, no sign; bit 7
    is ignored), 0 for the codes 0x00 and 0x7F. ldexpf of a value with 4 significant bits is exact."""
    x = np.arange(256)
    exp, man = (x >> 3) & 15, x & 7
    raw = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(1 + man / 8, exp - 7))
    out = (raw * 0.5).astype(np.float32)
    out[(x == 0) | (x == 0x7F)] = 0
    out.flags.writeable = False
    return out


UE4M3_HALF = _ue4m3_half_table()


# block_tq1_0 (54 bytes) -> `dequantize_row_tq1_0`: five (or four) base-3 digits per byte
#   +0  qs  u8[48]   digit k of qs[m] (k = 0..4) -> element 32k + m (m < 32), then 160 + 16k + (m - 32)
#   +48 qh  u8[4]    digit k of qh[m] (k = 0..3) -> element 240 + 4k + m
#   +52 d   fp16     digit k of a byte q: ((u8)(q * 3^k) * 3) >> 8;   y = (digit - 1) * d
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _trits(b: np.ndarray, k: int) -> np.ndarray:
    """The first k base-3 digits of each byte, fixed-point as ggml reads them: u8[n, m] -> u8[n, k, m]."""
    q = b[:, None, :] * _POW3[:k, None]  # wraps mod 256 like the C cast to uint8_t
    return ((q.astype(np.uint16) * 3) >> 8).astype(np.uint8)


def parts_tq1_0(blocks: np.ndarray):
    n = blocks.shape[0]
    q = np.concatenate(
        [
            _trits(blocks[:, 0:32], 5).reshape(n, 160),
            _trits(blocks[:, 32:48], 5).reshape(n, 80),
            _trits(blocks[:, 48:52], 4).reshape(n, 16),
        ],
        axis=1,
    )
    return f16_field(blocks, 52), (q.view(np.int8) - np.int8(1)).reshape(n, 1, QK_K)


# block_tq2_0 (66 bytes) -> `dequantize_row_tq2_0`
#   +0  qs  u8[64]   bits 2l..2l+1 of qs[32h + m] -> element 128h + 32l + m
#   +64 d   fp16     y = (q - 1) * d
def parts_tq2_0(blocks: np.ndarray):
    n = blocks.shape[0]
    q = (blocks[:, 0:64].reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    return f16_field(blocks, 64), (q.view(np.int8) - np.int8(1)).reshape(n, 1, QK_K)


# block_q1_0 (18 bytes) -> `dequantize_row_q1_0`
#   +0 d   fp16
#   +2 qs  u8[16]   bit j % 8 of qs[j / 8]: element j is d if set, else -d
def parts_q1_0(blocks: np.ndarray):
    bits = np.unpackbits(blocks[:, 2:18], axis=1, bitorder="little").view(np.int8)
    return f16_field(blocks, 0), (2 * bits - 1).reshape(blocks.shape[0], 1, 128)


def dequantize_q1_0(blocks: np.ndarray) -> np.ndarray:
    # `bit ? d : -d`: a negation, which flips the sign of a NaN too (a product by -1 would not)
    d = f16_field(blocks, 0)
    bits = np.unpackbits(blocks[:, 2:18], axis=1, bitorder="little").astype(bool)
    return np.where(bits, d, -d)


# block_mxfp4 (17 bytes) -> `dequantize_row_mxfp4`
#   +0 e   u8 (E8M0)  d = 2^(e - 128), half the block scale
#   +1 qs  u8[16]     lo nibble -> element j, hi nibble -> element j+16;   y = kvalues_mxfp4[q] * d
def parts_mxfp4(blocks: np.ndarray):
    n = blocks.shape[0]
    return e8m0_to_fp32_half(blocks[:, 0:1]), KVALUES_MXFP4[nibbles(blocks[:, 1:17])].reshape(n, 1, 32)


# block_nvfp4 (36 bytes) -> `dequantize_row_nvfp4`, four 16-element sub-blocks s
#   +0 d   u8[4] (UE4M3)  scale of sub-block s, halved (UE4M3_HALF)
#   +4 qs  u8[32]         qs[8s + j]: lo nibble -> element 16s + j, hi nibble -> 16s + 8 + j
#                         y = kvalues_mxfp4[q] * d[s]
def parts_nvfp4(blocks: np.ndarray):
    n = blocks.shape[0]
    return UE4M3_HALF[blocks[:, 0:4]], KVALUES_MXFP4[nibbles(blocks[:, 4:36].reshape(n, 4, 8))].reshape(n, 4, 16)


def dequantize_tq1_0(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_tq1_0(blocks))


def dequantize_tq2_0(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_tq2_0(blocks))


def dequantize_mxfp4(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_mxfp4(blocks))


def dequantize_nvfp4(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_nvfp4(blocks))


PARTS = {  # type name -> parts function, for the kernels' repacking
    "TQ1_0": parts_tq1_0,
    "TQ2_0": parts_tq2_0,
    "Q1_0": parts_q1_0,
    "MXFP4": parts_mxfp4,
    "NVFP4": parts_nvfp4,
}
