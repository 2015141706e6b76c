"""Bit-exact emulation of ggml's x86 dot product for IQ4_XS weights with Q8_K activations.

Follows ggml-cpu/arch/x86/quants.c `ggml_vec_dot_iq4_xs_q8_K`, the `__AVX2__` branch (taken on this
AVX512 build; the kernel has no AVX512 or VNNI variant, and `mul_add_epi8` is `maddubs` on sign-adjusted
bytes). llama.cpp's mul_mat calls it once per (activation row, weight row) pair: IQ4_XS has no repacked
layout and no llamafile kernel.

All integer work of one 256-element super-block lands in 8 int32 lanes; lane k collects, over the eight
32-element sub-blocks ib, ls_ib * (sum of kvalue * q_a over elements 4k..4k+3 of sub-block ib). Then, per
output y[t, o] and super-block ibl in order:

    acc_k = fma(f32(d_w(ibl) * d_a(ibl)), float(lane_k(ibl)), acc_k)     d_w fp16 -> f32, d_a the Q8_K f32
    y     = hsum_float_8(acc)

Exactness of the integer part: |kvalue| <= 127, |q_a| <= 127, |ls| <= 32, so a lane is at most
8 * 4 * 32 * 127 * 127 < 2^24 in magnitude: exact in int32, in `_mm256_cvtepi32_ps`, and in an f32 matmul.
The `maddubs` pair sums (<= 2 * 127 * 127) never saturate. `_mm256_sign_epi8(y, x)` would mis-negate
q_a = -128, but Q8_K quants are `min(127, nearest_int(-127/max * x))`, never below -127.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from ..fields import f16_field, f32_field, i8_field, nibbles, u16_field
from ..iquants import KVALUES_IQ4NL
from .simd import FmaAccumulator, hsum_float_8

__all__ = ["KERNELS", "matmul_iq4_xs"]

QK_K = 256
_IQ4_XS_BYTES, _Q8_K_BYTES = 136, 292
_TEMP_BYTES = 2 << 20  # per (T, 8, rows) float64 scratch array: a chunk of output rows stays in L2 cache
_KV = KVALUES_IQ4NL.astype(np.float32)
# dpbusd/madd lane of each element of a super-block: element e of sub-block ib sits in byte e of the
# 256-bit register (low 128 bits = low nibbles = elements 0..15, high 128 = high nibbles = 16..31),
# and int32 lane k sums bytes 4k..4k+3.
_LANE_OF = (np.arange(QK_K) % 32) // 4


def _iq4_xs_scaled_quants(blk: np.ndarray) -> np.ndarray:
    """One super-block column of IQ4_XS rows, u8 (rows, 136) -> f32 (rows, 256): ls_ib * kvalues[q], the
    integer weight each element contributes to its lane (|value| <= 32 * 127, exact).

    block_iq4_xs: +0 d fp16, +2 scales_h u16, +4 scales_l u8[4], +8 qs u8[128] (see ggufpy/quants/iquants.py
    `dequantize_iq4_xs`; the kernel forms ls the same way, two sub-blocks per step of `sh >>= 4`)."""
    rows = blk.shape[0]
    scales_h = u16_field(blk, 2)  # (rows, 1)
    scales_l = nibbles(blk[:, 4:8]).transpose(0, 2, 1).reshape(rows, 8)  # nibble ib % 2 of byte ib // 2
    high = ((scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.int16)
    ls = (scales_l.astype(np.int16) | (high << 4)) - 32  # (rows, 8)
    q = _KV[nibbles(blk[:, 8:136].reshape(rows, 8, 16)).reshape(rows, 8, 32)]  # `_mm_shuffle_epi8(values128, .)`
    return (q * ls[:, :, None].astype(np.float32)).reshape(rows, QK_K)


def _q8_K_fields(a: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_K activation rows u8 (T, nb*292) -> d (T, nb) f32 and q (T, nb, 1, 256) f32 (bsums are unused)."""
    T = a.shape[0]
    blocks = np.ascontiguousarray(a, np.uint8).reshape(T * nb, _Q8_K_BYTES)
    d = f32_field(blocks, 0).reshape(T, nb)
    q = i8_field(blocks, 4, QK_K).astype(np.float32).reshape(T, nb, 1, QK_K)
    return d, q


def matmul_iq4_xs(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: u8 (out, row_bytes) IQ4_XS weight rows; a: u8 (T, act_row_bytes) Q8_K activation rows.
    Returns f32 (T, out), bit-identical to `ggml_vec_dot_iq4_xs_q8_K` (AVX2 branch)."""
    w = np.ascontiguousarray(w, np.uint8)
    out, row_bytes = w.shape
    nb = row_bytes // _IQ4_XS_BYTES
    T = a.shape[0]
    y = np.empty((T, out), np.float32)
    if T == 0 or out == 0:
        return y
    d_a, q_a = _q8_K_fields(a, nb)
    lane_mask = _LANE_OF == np.arange(8)[:, None]  # (8, 256)
    chunk = max(1, _TEMP_BYTES // (8 * 8 * T))
    for lo in range(0, out, chunk):
        rows = min(chunk, out - lo)
        acc = FmaAccumulator((T, 8, rows), subnormals=False)  # _mm256_setzero_ps, lanes on axis 1
        lanes = np.empty((T * 8, rows), np.float32)
        for b in range(nb):
            blk = w[lo : lo + rows, b * _IQ4_XS_BYTES : (b + 1) * _IQ4_XS_BYTES]
            # copy k of the activation quants keeps only lane k's elements, so one plain matmul with the
            # scaled weight quants yields all 8 lanes (8x the multiplications, but one BLAS call);
            # sumi1 + sumi2 are integers, so the order of the sub-blocks (even/odd accumulators) does not matter
            spread = np.where(lane_mask, q_a[:, b], np.float32(0)).reshape(T * 8, QK_K)
            np.matmul(spread, _iq4_xs_scaled_quants(blk).T, out=lanes)
            # `GGML_CPU_FP16_TO_FP32(x.d) * y.d`: a scalar f32 product (no FMA can absorb it: it feeds a
            # multiplicand of `_mm256_fmadd_ps`), then one FMA per lane
            scale = d_a[:, b, None] * f16_field(blk, 0)[:, 0]
            acc.add(scale[:, None, :], lanes.reshape(T, 8, rows))
        y[:, lo : lo + rows] = hsum_float_8(np.moveaxis(acc.acc, 1, -1))
    return y


KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {GGMLType.IQ4_XS: matmul_iq4_xs}
