"""Bit-exact emulation of ggml's x86 dot products for Q4_1 and Q5_1 weights with Q8_1 activations.

Follows ggml-cpu/arch/x86/quants.c `ggml_vec_dot_q4_1_q8_1` (the `__AVX2__ || __AVX__` branch, AVX2 part)
and `ggml_vec_dot_q5_1_q8_1` (the `__AVX2__` branch), with `mul_sum_us8_pairs_float` taking its
`__AVX512VNNI__ && __AVX512VL__` path (`_mm256_dpbusd_epi32`). llama.cpp's mul_mat calls these once per
(activation row, weight row) pair for Q4_1/Q5_1: there is no repacked layout and no llamafile kernel for them.

Order of float operations for one output y[t, o] (blocks b = 0..nb-1 of 32 elements):

    lane_j(b)  = float(sum of q_w * q_a over elements 4j..4j+3 of block b)   j = 0..7, exact integer
    acc_j      = fma(f32(d_w(b) * d_a(b)), lane_j(b), acc_j)                  one rounding per block and lane
    summs      = summs + m_w(b) * s_a(b)                                       scalar f32, block order
    y          = hsum_float_8(acc) + summs

`m_w * s_a` is a product of two fp16 values (11-bit significands), exact in f32, so it does not matter
whether GCC contracted `summs += m * s` into an FMA. Q4_1 quants are 0..15 and Q5_1 quants 0..31, used
unsigned by `dpbusd` against the signed Q8_1 quants: no sign trick, no saturation.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from ..fields import f16_field, i8_field, nibbles, u32_field
from ..legacy import fifth_bits
from .simd import FmaAccumulator, hsum_float_8

__all__ = ["KERNELS", "lane_spread", "lane_sums", "matmul_q4_1", "matmul_q5_1"]

QK = 32
_Q4_1_BYTES, _Q5_1_BYTES, _Q8_1_BYTES = 20, 24, 36
_TEMP_BYTES = 2 << 20  # per (T, 8, rows) float64 scratch array: a chunk of output rows stays in L2 cache


_LANE_OF = np.arange(QK) // 4  # dpbusd lane of each element of a block


def lane_spread(qa: np.ndarray) -> np.ndarray:
    """Activation quants f32 (..., 32) of one block -> (..., 8, 32), copy j keeping only the elements of lane j.

    `x @ q_w.T` with copy j of a block then gives lane j of `dpbusd`: the integer sum over elements 4j..4j+3
    (`bytes_from_nibbles_32` and the Q8_1 load put element e of the block in byte e, and int32 lane j of the
    256-bit register sums bytes 4j..4j+3). One plain matmul with 8x the work is far faster than a batched
    matmul of 4-element rows."""
    return np.where(_LANE_OF == np.arange(8)[:, None], qa[..., None, :], np.float32(0))


def lane_sums(qa_spread: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """qa_spread: f32 (T, 8, 32) from `lane_spread` for one block; qw: f32 (rows, 32) weight quants of the
    same block. Writes f32 (T, 8, rows) to `out`: the `dpbusd` lanes converted with `_mm256_cvtepi32_ps`. Every
    product and partial sum is an integer below 2^24, so the f32 matmul is exact in any summation order,
    and so is the int -> float conversion."""
    T = qa_spread.shape[0]
    np.matmul(qa_spread.reshape(T * 8, QK), qw.T, out=out.reshape(T * 8, -1))


def _q8_1_fields(a: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_1 activation rows u8 (T, nb*36) -> d (T, nb) f32, s (T, nb) f32, q (T, nb, 32) f32 (exact)."""
    T = a.shape[0]
    blocks = np.ascontiguousarray(a, np.uint8).reshape(T * nb, _Q8_1_BYTES)
    d = f16_field(blocks, 0).reshape(T, nb)
    s = f16_field(blocks, 2).reshape(T, nb)
    q = i8_field(blocks, 4, QK).astype(np.float32).reshape(T, nb, QK)
    return d, s, q


def _matmul_q8_1(
    w: np.ndarray, a: np.ndarray, block_bytes: int, unpack: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """Shared body of the Q4_1 / Q5_1 kernels: blocks whose first 4 bytes are fp16 d and fp16 m; `unpack`
    turns u8 (n, block_bytes) into the unsigned integer quants f32 (n, 32) in element order."""
    w = np.ascontiguousarray(w, np.uint8)
    out, row_bytes = w.shape
    nb = row_bytes // block_bytes
    T = a.shape[0]
    y = np.empty((T, out), np.float32)
    if T == 0 or out == 0:
        return y
    d_a, s_a, q_a = _q8_1_fields(a, nb)
    chunk = max(1, _TEMP_BYTES // (8 * 8 * T))
    for lo in range(0, out, chunk):
        rows = min(chunk, out - lo)
        acc = FmaAccumulator((T, 8, rows), subnormals=False)  # _mm256_setzero_ps, lanes on axis 1
        summs = np.zeros((T, rows), np.float32)
        lanes = np.empty((T, 8, rows), np.float32)
        for b in range(nb):
            blk = w[lo : lo + rows, b * block_bytes : (b + 1) * block_bytes]  # block b of each weight row
            d_w, m_w = f16_field(blk, 0)[:, 0], f16_field(blk, 2)[:, 0]
            d0d1 = d_a[:, b, None] * d_w  # _mm256_mul_ps(d0v, d1v): one f32 rounding
            lane_sums(lane_spread(q_a[:, b]), unpack(blk), out=lanes)
            acc.add(d0d1[:, None, :], lanes)
            with np.errstate(invalid="ignore", over="ignore"):  # s_a may be an fp16 inf: ggml gets inf/NaN too
                summs += s_a[:, b, None] * m_w  # exact product (fp16 * fp16), f32 add in block order
        with np.errstate(invalid="ignore", over="ignore"):
            y[:, lo : lo + rows] = hsum_float_8(np.moveaxis(acc.acc, 1, -1)) + summs
    return y


def _unpack_q4_1(blocks: np.ndarray) -> np.ndarray:
    # block_q4_1: +0 d fp16, +2 m fp16, +4 qs u8[16] (low nibble = element j, high nibble = element j+16)
    return nibbles(blocks[:, 4:20]).reshape(-1, QK).astype(np.float32)


def _unpack_q5_1(blocks: np.ndarray) -> np.ndarray:
    # block_q5_1: +0 d, +2 m, +4 qh u32 (bit j = bit 4 of element j), +8 qs u8[16] as Q4_1
    low = nibbles(blocks[:, 8:24]).reshape(-1, QK)
    return (low | fifth_bits(u32_field(blocks, 4))).astype(np.float32)


def matmul_q4_1(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: u8 (out, row_bytes) Q4_1 weight rows; a: u8 (T, act_row_bytes) Q8_1 activation rows.
    Returns f32 (T, out), bit-identical to `ggml_vec_dot_q4_1_q8_1` (AVX2 + AVX512-VNNI build)."""
    return _matmul_q8_1(w, a, _Q4_1_BYTES, _unpack_q4_1)


def matmul_q5_1(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: u8 (out, row_bytes) Q5_1 weight rows; a: u8 (T, act_row_bytes) Q8_1 activation rows.
    Returns f32 (T, out), bit-identical to `ggml_vec_dot_q5_1_q8_1` (AVX2 + AVX512-VNNI build).

    Same float operations as Q4_1; only the integer quants gain their fifth bit (`bytes_from_bits_32` & 0x10).
    In the C source the multiplicands of the FMA are swapped (`fmadd(q, dx*dy, acc)`), which FMA does not see."""
    return _matmul_q8_1(w, a, _Q5_1_BYTES, _unpack_q5_1)


KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    GGMLType.Q4_1: matmul_q4_1,
    GGMLType.Q5_1: matmul_q5_1,
}
