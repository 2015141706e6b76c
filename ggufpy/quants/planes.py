"""Dequantization in plane order, for the NumPy backend's products with weights it does not cache.

The reference dequantizers (`legacy`, `kquants`, `iquants`) produce f32[n_blocks, block_size]: every step
is a NumPy operation over short rows of 16-32 elements broadcast against per-block scales. Here the quant
bytes of a tile of rows are first transposed, so that every field is a *plane* over all blocks,
u8/f32[nb, rows], and the same formulas run over planes of thousands of elements. Measured on real
tensors, 1 MB tiles: 1.4-3x the reference's speed for the 4-, 5- and 6-bit formats. Q8_0 is not here: its
reference is as fast (one widening and one product; the transposing copy of 32 bytes costs what the planes
save), nor are the types no real model here uses (Q2_K, Q3_K, IQ4_XS). The result is the weight in plane order:

    P[j, b, r] = W[r, b * block_size + j]        f32[block_size, nb, rows]

`x @ W.T == permute(x, block_size) @ P.reshape(cols, rows)`, a plain BLAS product (`permute` reorders the
few activation rows the same way). Each value is bit-identical to the reference dequantizer's (tested in
tests/test_planes.py); the f32 operation order is ggml's, as there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..constants import GGML_BLOCK_LAYOUT, GGMLType
from .iquants import KVALUES_IQ4NL

__all__ = ["PLANE_TYPES", "dequantize_planes", "permute"]

_BIT8 = (1 << np.arange(8)).astype(np.uint8).reshape(1, 8, 1, 1)  # bit k of a byte
_KVALUES = KVALUES_IQ4NL.astype(np.float32)


def permute(x: np.ndarray, block_size: int) -> np.ndarray:
    """Activations (T, cols) in plane order: column j * nb + b holds x[:, b * block_size + j]."""
    T = x.shape[0]
    return x.reshape(T, -1, block_size).transpose(0, 2, 1).reshape(T, -1)  # (T, nb, bs) -> (T, bs, nb) -> (T, cols)


def dequantize_planes(blocks: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """u8[rows, row_bytes] (whole blocks of one type) -> f32[block_size, nb, rows] in plane order."""
    type_size = GGML_BLOCK_LAYOUT[ggml_type][1]
    b3 = blocks.reshape(blocks.shape[0], -1, type_size)  # (rows, nb, type_size)
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN scales decode to inf/NaN, as in ggml
        return _PLANES[ggml_type](b3)


# -- fields as planes: b3 is u8[rows, nb, type_size], a field of every block becomes [..., nb, rows] ---------
def _f16(b3: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte `offset` of every block, widened to f32 (exact): f32[nb, rows]."""
    return b3[:, :, offset : offset + 2].view("<f2")[:, :, 0].T.astype(np.float32, order="C")


def _bytes(b3: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bytes start..stop-1 of every block: u8[stop - start, nb, rows] (the one transposing copy)."""
    return np.ascontiguousarray(b3[:, :, start:stop].transpose(2, 1, 0))


def _codes4(qs: np.ndarray) -> np.ndarray:
    """u8[16, nb, rows] packed nibbles -> u8[32, nb, rows]: low nibbles are elements 0..15, high 16..31."""
    q = np.empty((32, *qs.shape[1:]), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:16])
    np.right_shift(qs, 4, out=q[16:])
    return q


def _codes5(b3: np.ndarray, qh_at: int, qs_at: int) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit codes: u8[32, nb, rows]. Bit k of qh byte i is bit 4 of element 8i + k."""
    q = _codes4(_bytes(b3, qs_at, qs_at + 16))
    qh = _bytes(b3, qh_at, qh_at + 4)[:, None]  # (4, 1, nb, rows)
    fifth = (qh & _BIT8) != 0  # (4, 8, nb, rows); mask-and-compare: 3-5x faster than shifts by an array of amounts
    q |= fifth.reshape(q.shape).view(np.uint8) * np.uint8(16)  # -> (32, nb, rows)
    return q


# -- the 32-element formats (legacy.py): the same formulas, over planes. Codes stay u8/i8 until they are
# widened to f32 for the scales ((q - 8) etc. are exact either way; a mixed i8-by-f32 product is slower).
def _q4_0(b3: np.ndarray) -> np.ndarray:
    q = _codes4(_bytes(b3, 2, 18)).view(np.int8)
    q -= 8
    y = q.astype(np.float32)
    y *= _f16(b3, 0)
    return y


def _q4_1(b3: np.ndarray) -> np.ndarray:
    y = _codes4(_bytes(b3, 4, 20)).astype(np.float32)
    y *= _f16(b3, 0)
    y += _f16(b3, 2)
    return y


def _q5_0(b3: np.ndarray) -> np.ndarray:
    q = _codes5(b3, 2, 6).view(np.int8)
    q -= 16
    y = q.astype(np.float32)
    y *= _f16(b3, 0)
    return y


def _q5_1(b3: np.ndarray) -> np.ndarray:
    y = _codes5(b3, 4, 8).astype(np.float32)
    y *= _f16(b3, 0)
    y += _f16(b3, 2)
    return y


def _iq4_nl(b3: np.ndarray) -> np.ndarray:
    return _f16(b3, 0) * _KVALUES[_codes4(_bytes(b3, 2, 18))]


# -- k-quants (kquants.py): sub-block terms first (dl = d * sc), then dl * q - ml, or dl * (q - 32) (Q6_K) -----
def _k4_terms(b3: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: (d * sc, dmin * m) for the eight 32-element sub-blocks, each f32[8, 1, nb, rows]. The
    6-bit packing of `kquants.k4_scales_mins`, over byte planes."""
    b = _bytes(b3, 4, 16)  # (12, nb, rows)
    sc = np.concatenate([b[0:4] & 63, (b[8:12] & 0x0F) | ((b[0:4] >> 6) << 4)])  # (8, nb, rows)
    m = np.concatenate([b[4:8] & 63, (b[8:12] >> 4) | ((b[4:8] >> 6) << 4)])
    return (_f16(b3, 0) * sc)[:, None], (_f16(b3, 2) * m)[:, None]


def _q4_k(b3: np.ndarray) -> np.ndarray:
    rows, nb = b3.shape[:2]
    qs = _bytes(b3, 16, 144).reshape(4, 32, nb, rows)  # chunk c: low nibbles are sub-block 2c, high 2c+1
    q = np.empty((4, 2, 32, nb, rows), np.uint8)  # (c, t, l): sub-block 2c + t
    np.bitwise_and(qs, 0x0F, out=q[:, 0])
    np.right_shift(qs, 4, out=q[:, 1])
    dl, ml = _k4_terms(b3)
    y = q.astype(np.float32).reshape(8, 32, nb, rows)
    y *= dl
    y -= ml
    return y.reshape(256, nb, rows)


def _q5_k(b3: np.ndarray) -> np.ndarray:
    rows, nb = b3.shape[:2]
    qs = _bytes(b3, 48, 176).reshape(4, 32, nb, rows)  # low 4 bits, as Q4_K
    qh = _bytes(b3, 16, 48)  # (l, nb, rows): bit 2c + t of qh[l] is bit 4 of element 64c + 32t + l
    q = np.empty((4, 2, 32, nb, rows), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, 0])
    np.right_shift(qs, 4, out=q[:, 1])
    fifth = (qh & _BIT8.reshape(8, 1, 1, 1)) != 0  # (2c + t, l, nb, rows)
    q.reshape(8, 32, nb, rows)[...] |= fifth.view(np.uint8) * np.uint8(16)
    dl, ml = _k4_terms(b3)
    y = q.astype(np.float32).reshape(8, 32, nb, rows)
    y *= dl
    y -= ml
    return y.reshape(256, nb, rows)


def _q6_k(b3: np.ndarray) -> np.ndarray:
    rows, nb = b3.shape[:2]
    ql = _bytes(b3, 0, 128).reshape(2, 2, 32, nb, rows)  # (h, s, l): low 4 bits
    qh = _bytes(b3, 128, 192).reshape(2, 32, nb, rows)  # (h, l): high 2 bits at 2r
    q = np.empty((2, 4, 32, nb, rows), np.uint8)  # (h, r, l): element 128h + 32r + l
    for r in range(4):  # one shift amount per call: shifting by a broadcast array of amounts measured far slower
        low = ql[:, r % 2] & 0x0F if r < 2 else ql[:, r % 2] >> 4
        np.bitwise_or(low, ((qh >> 2 * r) & 3) << 4, out=q[:, r])
    q.view(np.int8)[...] -= 32
    y = q.view(np.int8).astype(np.float32).reshape(2, 4, 2, 16, nb, rows)
    sc = _bytes(b3, 192, 208).view(np.int8).reshape(2, 4, 2, 1, nb, rows)  # (h, r, l // 16)
    y *= _f16(b3, 208) * sc  # dl
    return y.reshape(256, nb, rows)


_PLANES: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.IQ4_NL: _iq4_nl,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
PLANE_TYPES = frozenset(_PLANES)
