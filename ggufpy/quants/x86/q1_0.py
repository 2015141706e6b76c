"""Bit-exact emulation of llama.cpp's x86 matmul for Q1_0 weights (Q8_0 activations).

Q1_0 (block_q1_0, 18 bytes per 128 elements: an fp16 d and 128 sign bits, weight = bit ? d : -d) has
`vec_dot_type = GGML_TYPE_Q8_0` (four Q8_0 blocks per Q1_0 block), no repacked layout and no tinyBLAS case:
every shape runs `ggml_vec_dot_q1_0_q8_0` (arch/x86/quants.c, `__AVX2__` branch) per (activation, weight) row:

    for each Q1_0 block i (d_w) and its Q8_0 blocks K = 0..3 (d_a[4i + K]):
        lane j (j = 0..7) = sum over elements 4j..4j+3 of block K of +-q_a   (maddubs with ones, madd: exact)
        blk[j] = d_a[4i] * float(lane j)                      K = 0: an f32 multiply
        blk[j] = fma(d_a[4i + K], float(lane j), blk[j])      K = 1, 2, 3
        acc[j] = fma(d_w[i], blk[j], acc[j])
    y = hsum_float_8(acc)
"""

from __future__ import annotations

import numpy as np

from ...constants import GGMLType
from ..fields import f16_field
from .llamafile import FmaAccumulator, _lane_sums, q8_0_activations, rows_per_chunk
from .simd import fma, hsum_float_8

__all__ = ["KERNELS", "TYPE_SIZE", "matmul_q1_0", "vec_dot_q1_0_kernel"]

TYPE_SIZE = 18  # bytes per block of 128


def _signs(blocks: np.ndarray) -> np.ndarray:
    """block_q1_0 u8 (n, 18) -> int8 (n, 128): +1 where bit e (byte e // 8, bit e % 8) is set, else -1."""
    bits = np.unpackbits(blocks[:, 2:18], axis=1, bitorder="little")
    return (bits.astype(np.int8) * np.int8(2)) - np.int8(1)


def vec_dot_q1_0_kernel(d_w: np.ndarray, q_w: np.ndarray, d_a: np.ndarray, q_a: np.ndarray) -> np.ndarray:
    """d_w f32 (O, nb128), q_w int8 (O, nb32, 32) of +-1, d_a f32 (T, nb32), q_a int8 (T, nb32, 32) ->
    y f32 (T, O) as `ggml_vec_dot_q1_0_q8_0` (AVX2) computes it."""
    lanes = _lane_sums(q_a, q_w)  # (nb32, 8, T, O)
    acc = FmaAccumulator(lanes.shape[1:])
    for i in range(d_w.shape[1]):
        blk = d_a[None, :, 4 * i, None] * lanes[4 * i]  # (8, T, O) f32: _mm256_mul_ps
        for k in range(1, 4):
            blk = fma(d_a[None, :, 4 * i + k, None], lanes[4 * i + k], blk)
        acc.add(d_w[None, None, :, i], blk)
    return hsum_float_8(np.moveaxis(acc.acc, 0, -1))


def matmul_q1_0(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: u8 (out, nb*18) Q1_0 weight rows (GGUF layout); a: u8 (T, 4*nb*34) Q8_0 activation rows
    (`quantize_activations(x, GGMLType.Q8_0)`). Returns y f32 (T, out) bit-identical to llama.cpp's x86 CPU
    backend (`ggml_vec_dot_q1_0_q8_0` for every shape)."""
    d_a, q_a = q8_0_activations(a)
    T, nb32, _ = q_a.shape
    w = np.ascontiguousarray(w, np.uint8)
    if w.ndim != 2 or nb32 % 4 or w.shape[1] != nb32 // 4 * TYPE_SIZE:
        raise ValueError(f"Q1_0 weight rows of shape {w.shape} do not match {nb32} blocks of Q8_0 activations")
    out = w.shape[0]
    y = np.empty((T, out), np.float32)
    step = rows_per_chunk(nb32 * 32 * max(T, 4))
    with np.errstate(over="ignore", invalid="ignore"):  # inf / nan propagate as in ggml
        for lo in range(0, out, step):
            blocks = w[lo : lo + step].reshape(-1, TYPE_SIZE)
            rows = blocks.shape[0] // (nb32 // 4)
            d_w = f16_field(blocks, 0).reshape(rows, nb32 // 4)
            q_w = _signs(blocks).reshape(rows, nb32, 32)
            y[:, lo : lo + step] = vec_dot_q1_0_kernel(d_w, q_w, d_a, q_a)
    return y


KERNELS = {GGMLType.Q1_0: matmul_q1_0}
