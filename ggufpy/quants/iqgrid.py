"""Dequantizers for the grid formats IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M.

An index stored in a block selects a row of 8 (or 4) byte values from a grid (`grids.py`, from llama.cpp
`ggml/src/ggml-common.h`); sign bits flip elements, and one scale per 16- or 32-element sub-block multiplies
them. Arithmetic follows `dequantize_row_iq*` in `ggml/src/ggml-quants.c`.

Each format is split first into `parts`: the sub-block scales f32[n, m] and the signed integer values
i8[n, m, sub], such that y = scale * value is ggml's result bit for bit. ggml computes `db * grid[j] * sign`
(sign = +-1: the rounding is symmetric, so negating the value first gives the same float), and IQ1's
`dl * (grid[j] + delta)` with delta = +-1/8, which is (dl / 8) * (8 * grid[j] +- 1): the scale dl / 8 is exact
in f32 (dl = fp16 d times an odd integer below 16) and both expressions round the same real number once.
The numba kernels (`ggufpy.kernels.layout`) repack the same parts.
"""

from __future__ import annotations

import numpy as np

from .fields import f16_field, u16_field, u32_field
from .grids import IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID

__all__ = [
    "KSIGNS_IQ2XS",
    "PARTS",
    "dequantize_iq1_m",
    "dequantize_iq1_s",
    "dequantize_iq2_s",
    "dequantize_iq2_xs",
    "dequantize_iq2_xxs",
    "dequantize_iq3_s",
    "dequantize_iq3_xxs",
    "scaled",
]

_BYTE = np.arange(256, dtype=np.uint8)


def _words(table: np.ndarray) -> np.ndarray:
    """A table of 8- (or 4-) byte rows as one u64 (u32) per row: gathering words is ~2x faster than rows."""
    return np.ascontiguousarray(table).view(np.uint64 if table.shape[1] == 8 else np.uint32)[:, 0]


def _gather(words: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Rows `idx` of a `_words` table, as int8: idx [...] -> i8[..., width]."""
    return words[idx].view(np.int8).reshape(*idx.shape, words.itemsize)


_BIT = np.arange(8, dtype=np.uint8)
# ggml-common.h `ksigns_iq2xs`: 7 stored sign bits plus an 8th that makes the count of minus signs even
KSIGNS_IQ2XS = _BYTE[:128] | ((np.unpackbits(_BYTE[:128, None], axis=1).sum(axis=1) & 1) << 7).astype(np.uint8)
_SIGNS = _words((1 - 2 * ((_BYTE[:, None] >> _BIT) & 1)).astype(np.int8))  # [byte] -> -1 where bit j is set
_KSIGNS = _SIGNS[KSIGNS_IQ2XS]  # [7-bit sign index] -> 8 signs
_IQ2XXS, _IQ2XS, _IQ2S = _words(IQ2XXS_GRID), _words(IQ2XS_GRID), _words(IQ2S_GRID)
_IQ3XXS, _IQ3S, _IQ1S = _words(IQ3XXS_GRID), _words(IQ3S_GRID), _words(IQ1S_GRID)
_IQ1_DELTA = np.array([1, -1], np.int8)  # IQ1S_DELTA = 0.125, sign bit set: -0.125; stored as 8 * delta


def scaled(parts: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """y = scale * value: (f32[n, m], i8[n, m, sub]) -> f32[n, m * sub]."""
    scale, v = parts
    y = v.astype(np.float32)  # exact; f32 by f32 products are NumPy's fast path
    with np.errstate(over="ignore", invalid="ignore"):  # inf/NaN scales and overflow give inf/NaN, as in ggml
        y *= scale[:, :, None]
    return y.reshape(v.shape[0], v.shape[1] * v.shape[2])


def _nibble_scales(b: np.ndarray) -> np.ndarray:
    """u8[n, k] -> u8[n, 2k]: low nibble first (sub-block 2i), then high (2i + 1)."""
    return np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], 2 * b.shape[1])


def _signed(grid_rows: np.ndarray, signs: np.ndarray) -> np.ndarray:
    grid_rows *= signs  # grid values are < 64, so the int8 product cannot overflow
    return grid_rows


# block_iq2_xxs (66 bytes) -> `dequantize_row_iq2_xxs`, eight 32-element sub-blocks ib
#   +0 d    fp16
#   +2 qs   u32[16]  per ib two u32: a0 = four grid indices (bytes, iq2xxs_grid, 8 values each),
#                    a1 = four 7-bit sign indices (bits 7l..7l+6, ksigns_iq2xs) | scale ls << 28
#                    y = (d * (0.5 + ls) * 0.25) * grid[j] * (sign bit j ? -1 : 1)
def parts_iq2_xxs(blocks: np.ndarray):
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    a1 = u32_field(blocks, 2, 16).reshape(n, 8, 2)[:, :, 1]  # [n, ib]
    idx = blocks[:, 2:66].reshape(n, 8, 8)[:, :, :4]  # [n, ib, l]
    db = d * (np.float32(0.5) + (a1 >> 28).astype(np.float32)) * np.float32(0.25)
    signs = _gather(_KSIGNS, (a1[:, :, None] >> (7 * np.arange(4, dtype=np.uint32))) & 127)  # [n, ib, l, j]
    return db, _signed(_gather(_IQ2XXS, idx), signs).reshape(n, 8, 32)


# block_iq2_xs (74 bytes) -> `dequantize_row_iq2_xs`, sixteen 16-element sub-blocks
#   +0  d       fp16
#   +2  qs      u16[32]  one per 8 elements: grid index (bits 0-8, iq2xs_grid) | 7-bit sign index << 9
#   +66 scales  u8[8]    nibble per 16 elements (low first);   y = (d * (0.5 + s) * 0.25) * grid[j] * sign
def parts_iq2_xs(blocks: np.ndarray):
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs = u16_field(blocks, 2, 32)
    db = d * (np.float32(0.5) + _nibble_scales(blocks[:, 66:74]).astype(np.float32)) * np.float32(0.25)
    return db, _signed(_gather(_IQ2XS, qs & 511), _gather(_KSIGNS, qs >> 9)).reshape(n, 16, 16)


# block_iq2_s (82 bytes) -> `dequantize_row_iq2_s`, sixteen 16-element sub-blocks
#   +0  d       fp16
#   +2  qs      u8[32]   low 8 bits of the grid index (iq2s_grid) of each 8 elements
#   +34 signs   u8[32]   bit j: element j of those 8 is negative (all 8 bits stored, no parity)
#   +66 qh      u8[8]    bits 2l..2l+1 of qh[ib]: index bits 8-9 of group l of sub-block ib (32 elements)
#   +74 scales  u8[8]    as IQ2_XS;   y = (d * (0.5 + s) * 0.25) * grid[j] * sign
def parts_iq2_s(blocks: np.ndarray):
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    high = (blocks[:, 66:74, None] >> (2 * _BIT[:4])) & 3  # [n, ib, l]
    idx = blocks[:, 2:34].astype(np.uint16) | (high.reshape(n, 32).astype(np.uint16) << 8)
    db = d * (np.float32(0.5) + _nibble_scales(blocks[:, 74:82]).astype(np.float32)) * np.float32(0.25)
    return db, _signed(_gather(_IQ2S, idx), _gather(_SIGNS, blocks[:, 34:66])).reshape(n, 16, 16)


# block_iq3_xxs (98 bytes) -> `dequantize_row_iq3_xxs`, eight 32-element sub-blocks ib
#   +0  d     fp16
#   +2  qs    u8[64]   grid index (iq3xxs_grid, 4 values each) of every 4 elements, in element order
#   +66 ss    u32[8]   per ib: four 7-bit sign indices (ksigns_iq2xs, one per 8 elements) | scale ls << 28
#                      y = (d * (0.5 + ls) * 0.5) * grid[j] * sign
def parts_iq3_xxs(blocks: np.ndarray):
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    ss = u32_field(blocks, 66, 8)  # [n, ib]
    db = d * (np.float32(0.5) + (ss >> 28).astype(np.float32)) * np.float32(0.5)
    signs = _gather(_KSIGNS, (ss[:, :, None] >> (7 * np.arange(4, dtype=np.uint32))) & 127)  # [n, ib, l, j]
    grid = _gather(_IQ3XXS, blocks[:, 2:66]).reshape(n, 8, 4, 8)  # [n, ib, l, j]
    return db, _signed(grid, signs).reshape(n, 8, 32)


# block_iq3_s (110 bytes) -> `dequantize_row_iq3_s`, eight 32-element sub-blocks ib
#   +0   d       fp16
#   +2   qs      u8[64]   low 8 bits of the grid index (iq3s_grid) of every 4 elements, in element order
#   +66  qh      u8[8]    bit k of qh[ib]: index bit 8 of the k-th 4 elements of sub-block ib
#   +74  signs   u8[32]   bit j of signs[4ib + l]: element 8l + j of sub-block ib is negative
#   +106 scales  u8[4]    nibble per sub-block (low first);   y = (d * (1 + 2s)) * grid[j] * sign
def parts_iq3_s(blocks: np.ndarray):
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    high = ((blocks[:, 66:74, None] >> _BIT) & 1).reshape(n, 64).astype(np.uint16)  # [n, 8ib + k]
    idx = blocks[:, 2:66].astype(np.uint16) | (high << 8)
    db = d * (1 + 2 * _nibble_scales(blocks[:, 106:110]).astype(np.int32)).astype(np.float32)
    grid = _gather(_IQ3S, idx).reshape(n, 32, 8)  # [n, 4ib + l, j]
    return db, _signed(grid, _gather(_SIGNS, blocks[:, 74:106])).reshape(n, 8, 32)


def _iq1_values(idx: np.ndarray, negative_delta: np.ndarray) -> np.ndarray:
    """8 * (grid[j] + delta) as int8, for groups of 8: idx u16[...], negative_delta bool[...] -> i8[..., 8]."""
    v = _gather(_IQ1S, idx)
    v *= np.int8(8)
    v += _IQ1_DELTA[negative_delta.astype(np.uint8)][..., None]
    return v


# block_iq1_s (50 bytes) -> `dequantize_row_iq1_s`, eight 32-element sub-blocks ib
#   +0  d    fp16
#   +2  qs   u8[32]   low 8 bits of the grid index (iq1s_grid: -1, 0, 1) of each 8 elements
#   +34 qh   u16[8]   per ib: bits 3l..3l+2 = index bits 8-10 of group l, bits 12-14 = scale s,
#                     bit 15 = delta sign;   y = (d * (2s + 1)) * (grid[j] + (bit 15 ? -0.125 : 0.125))
def parts_iq1_s(blocks: np.ndarray):
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qh = u16_field(blocks, 34, 8)  # [n, ib]
    high = (qh[:, :, None] >> (3 * np.arange(4, dtype=np.uint16))) & 7  # [n, ib, l]
    idx = blocks[:, 2:34].reshape(n, 8, 4).astype(np.uint16) | (high << 8)
    dl = d * (2 * ((qh >> 12) & 7).astype(np.int32) + 1).astype(np.float32)
    v = _iq1_values(idx, (qh >> 15)[:, :, None].repeat(4, axis=2))
    return dl * np.float32(0.125), v.reshape(n, 8, 32)


# block_iq1_m (56 bytes) -> `dequantize_row_iq1_m`, sixteen 16-element sub-blocks
#   +0  qs      u8[32]   low 8 bits of the grid index (iq1s_grid) of each 8 elements
#   +32 qh      u8[16]   one nibble per 8 elements (low first): bits 0-2 = index bits 8-10, bit 3 = delta sign
#   +48 scales  u16[4]   bits 0-11 of u16 i: four 3-bit scales s (sub-blocks 4i..4i+3); bits 12-15 of the
#                        four u16 together are the fp16 d;   y = (d * (2s + 1)) * (grid[j] +- 0.125)
def parts_iq1_m(blocks: np.ndarray):
    n = blocks.shape[0]
    sc = u16_field(blocks, 48, 4)  # [n, 4]
    d_bits = ((sc >> 12) << (4 * np.arange(4, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    d = d_bits.view(np.float16).astype(np.float32)[:, None]
    s = (sc[:, :, None] >> (3 * np.arange(4, dtype=np.uint16))) & 7  # [n, i, 4]
    dl = d * (2 * s.reshape(n, 16).astype(np.int32) + 1).astype(np.float32)
    qh = _nibble_scales(blocks[:, 32:48])  # [n, group of 8]
    idx = blocks[:, 0:32].astype(np.uint16) | ((qh & 7).astype(np.uint16) << 8)
    v = _iq1_values(idx, (qh >> 3) != 0)
    return dl * np.float32(0.125), v.reshape(n, 16, 16)


def dequantize_iq2_xxs(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_iq2_xxs(blocks))


def dequantize_iq2_xs(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_iq2_xs(blocks))


def dequantize_iq2_s(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_iq2_s(blocks))


def dequantize_iq3_xxs(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_iq3_xxs(blocks))


def dequantize_iq3_s(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_iq3_s(blocks))


def dequantize_iq1_s(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_iq1_s(blocks))


def dequantize_iq1_m(blocks: np.ndarray) -> np.ndarray:
    return scaled(parts_iq1_m(blocks))


PARTS = {  # type name -> parts function, for the kernels' repacking
    "IQ2_XXS": parts_iq2_xxs,
    "IQ2_XS": parts_iq2_xs,
    "IQ2_S": parts_iq2_s,
    "IQ3_XXS": parts_iq3_xxs,
    "IQ3_S": parts_iq3_s,
    "IQ1_S": parts_iq1_s,
    "IQ1_M": parts_iq1_m,
}
