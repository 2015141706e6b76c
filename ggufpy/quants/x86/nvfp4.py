"""Bit-exact emulation of llama.cpp's x86 matmul for NVFP4 weights (Q8_0 activations).

NVFP4 (block_nvfp4, 36 bytes per 64 elements: four UE4M3 sub-block scales, 32 bytes of E2M1 nibbles) has
`vec_dot_type = GGML_TYPE_Q8_0` (two Q8_0 blocks per NVFP4 block), no repacked layout and no tinyBLAS case, so
every shape runs `ggml_vec_dot_nvfp4_q8_0` (arch/x86/quants.c, `__AVX2__` branch) per (activation, weight) row:

    for each NVFP4 block, for its two Q8_0 blocks b in order:
        lane j (j = 0..7) = sum of the 4 products of elements 4j..4j+3 of block b   (maddubs + madd: exact)
        acc[j] = fma(s, float(lane j), acc[j]),   s = f32(UE4M3(d[2(b%2) + j//4]) * fp16(d_a[b]))
    y = hsum_float_8(acc)

The nibbles are reordered so that lanes 0-3 hold the block's first 16-element sub-block and lanes 4-7 the
second; `GGML_CPU_UE4M3_TO_FP32` includes the halving that offsets the doubled `kvalues_mxfp4`
(`lowbit.UE4M3_HALF`). The scale product is exact in f32 unless it falls below 2^-126.
"""

from __future__ import annotations

import numpy as np

from ...constants import GGMLType
from ..lowbit import parts_nvfp4
from .llamafile import FmaAccumulator, _lane_sums, q8_0_activations, rows_per_chunk
from .simd import hsum_float_8

__all__ = ["KERNELS", "TYPE_SIZE", "matmul_nvfp4", "vec_dot_nvfp4_kernel"]

TYPE_SIZE = 36  # bytes per block of 64


def vec_dot_nvfp4_kernel(d_w: np.ndarray, q_w: np.ndarray, d_a: np.ndarray, q_a: np.ndarray) -> np.ndarray:
    """d_w f32 (O, nb32*2) sub-block scales (halved), q_w int8 (O, nb32, 32) doubled E2M1 values by Q8_0
    block, d_a f32 (T, nb32), q_a int8 (T, nb32, 32) -> y f32 (T, O) as `ggml_vec_dot_nvfp4_q8_0` computes it."""
    lanes = _lane_sums(q_a, q_w)  # (nb32, 8, T, O)
    acc = FmaAccumulator(lanes.shape[1:])
    for b in range(lanes.shape[0]):
        s = np.moveaxis(d_a[:, b, None, None] * d_w[None, :, 2 * b : 2 * b + 2], -1, 0)  # (2, T, O), f32
        acc.add(np.repeat(s, 4, axis=0), lanes[b])  # lanes 0-3: sub-block 2b, lanes 4-7: 2b+1
    return hsum_float_8(np.moveaxis(acc.acc, 0, -1))


def matmul_nvfp4(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: u8 (out, nb*36) NVFP4 weight rows (GGUF layout); a: u8 (T, 2*nb*34) Q8_0 activation rows
    (`quantize_activations(x, GGMLType.Q8_0)`). Returns y f32 (T, out) bit-identical to llama.cpp's x86 CPU
    backend (`ggml_vec_dot_nvfp4_q8_0` for every shape)."""
    d_a, q_a = q8_0_activations(a)
    T, nb32, _ = q_a.shape
    w = np.ascontiguousarray(w, np.uint8)
    if w.ndim != 2 or nb32 % 2 or w.shape[1] != nb32 // 2 * TYPE_SIZE:
        raise ValueError(f"NVFP4 weight rows of shape {w.shape} do not match {nb32} blocks of Q8_0 activations")
    out = w.shape[0]
    y = np.empty((T, out), np.float32)
    step = rows_per_chunk(nb32 * 32 * max(T, 4))
    with np.errstate(over="ignore", invalid="ignore"):  # inf / nan propagate as in ggml
        for lo in range(0, out, step):
            rows = w[lo : lo + step]
            d, q = parts_nvfp4(rows.reshape(-1, TYPE_SIZE))  # (n, 4) f32, (n, 4, 16) int8
            d_w = d.reshape(rows.shape[0], nb32 * 2).astype(np.float32)
            y[:, lo : lo + step] = vec_dot_nvfp4_kernel(d_w, q.reshape(rows.shape[0], nb32, 32), d_a, q_a)
    return y


KERNELS = {GGMLType.NVFP4: matmul_nvfp4}
