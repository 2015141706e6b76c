"""Bit-exact emulation of llama.cpp's x86 matmul for MXFP4 weights (Q8_0 activations), AVX2 and AVX-512 alike.

MXFP4 (block_mxfp4, 17 bytes per 32 elements: an E8M0 exponent e, 16 bytes of E2M1 nibbles) multiplies Q8_0
activations (ggml-cpu.c type_traits_cpu: `vec_dot_type = GGML_TYPE_Q8_0`). ggml keeps the E2M1 values doubled
(`kvalues_mxfp4`: integers -12..12) and halves the scale instead, d_w = `GGML_CPU_E8M0_TO_FP32_HALF(e)` =
2^(e - 128). llamafile's tinyBLAS has no MXFP4 case, so the driver runs one of two kernels:

- out % 8 == 0: the weight is repacked (repack.cpp `ggml_repack_get_optimal_repack_type`: `mxfp4_8x8_q8_0` on
  any AVX2 CPU) and `ggml_gemm_mxfp4_8x8_q8_0` / `_gemv_` run `gemm_q4_b32_8x8_q8_0_lut_avx` /
  `gemv_q4_b32_8x8_q8_0_lut_avx` (arch/x86/repack.cpp), the template of the repacked Q4_0 and IQ4_NL: one f32
  lane per output, acc = fma(float(isum_b), d_w * d_a, acc) over the blocks;
- otherwise `ggml_vec_dot_mxfp4_q8_0` (arch/x86/quants.c, `__AVX2__` branch, the only x86 SIMD one) for every
  row: the structure of `ggml_vec_dot_iq4_nl_q8_0` (blocks in pairs into two 8-lane FMA accumulators, lane j =
  elements 4j..4j+3, `hsum_float_8(accum1 + accum2)`, an odd last block added by scalar code as d * isum).

The scale d_a * d_w is an fp16 value times a power of two: exact in f32 except where it falls below 2^-126
(e < 17 or so); it is rounded to f32 here as the C code does before its FMA.
"""

from __future__ import annotations

import numpy as np

from ...constants import GGMLType
from ..lowbit import parts_mxfp4
from .llamafile import FmaAccumulator, _lane_sums, q8_0_activations, rows_per_chunk
from .simd import hsum_float_8

__all__ = ["KERNELS", "TYPE_SIZE", "is_repacked", "matmul_mxfp4", "vec_dot_mxfp4_kernel"]

TYPE_SIZE = 17  # bytes per block of 32


def is_repacked(out: int) -> bool:
    """Whether llama.cpp (repacking on, any AVX2 CPU) keeps an MXFP4 weight of `out` rows as mxfp4x8 blocks."""
    return out % 8 == 0


def _scale(d_a: np.ndarray, d_w: np.ndarray, b: int) -> np.ndarray:
    """(T, O) `GGML_CPU_FP16_TO_FP32(y.d) * GGML_CPU_E8M0_TO_FP32_HALF(x.e)` of block b, rounded to f32."""
    return (d_a[:, b, None] * d_w[None, :, b]).astype(np.float32)


def vec_dot_mxfp4_kernel(d_w: np.ndarray, q_w: np.ndarray, d_a: np.ndarray, q_a: np.ndarray) -> np.ndarray:
    """arch/x86/quants.c `ggml_vec_dot_mxfp4_q8_0`, `__AVX2__` branch, for every (t, o): d_w f32 (O, nb),
    q_w int8 (O, nb, 32) doubled E2M1 values, d_a f32 (T, nb), q_a int8 (T, nb, 32) -> y f32 (T, O).

    Block 2i into accum1, block 2i+1 into accum2: accum = fma(d, float(lane), accum) per 8-lane group of four
    products (maddubs + madd with ones: exact); y = hsum_float_8(accum1 + accum2); an odd last block:
    `sumf += d * (sumi1 + sumi2)`, an f32 multiply and an f32 add."""
    lanes = _lane_sums(q_a, q_w)  # (nb, 8, T, O)
    nb = lanes.shape[0]
    acc = [FmaAccumulator(lanes.shape[1:], subnormals=True) for _ in range(2)]
    for b in range(nb - nb % 2):
        acc[b % 2].add(_scale(d_a, d_w, b), lanes[b])
    y = hsum_float_8(np.moveaxis(acc[0].acc + acc[1].acc, 0, -1))
    if nb % 2:
        y = y + _scale(d_a, d_w, nb - 1) * lanes[nb - 1].sum(axis=0)  # the integer sum is exact in f32
    return y


def _repacked_kernel(d_w: np.ndarray, q_w: np.ndarray, d_a: np.ndarray, q_a: np.ndarray) -> np.ndarray:
    """`gemm_q4_b32_8x8_q8_0_lut_avx<block_mxfp4x8>` / the gemv: `repack_q8_0.repacked_8x8_kernel` with the
    scale product `_mm256_mul_ps(col_scale_f32, row_scale_f32)` rounded to f32 (not always exact here)."""
    nb = q_a.shape[1]
    # (nb, T, O) block sums: integers below 2^17 (32 * 12 * 127), exact in an f32 matmul
    isum = np.matmul(q_a.transpose(1, 0, 2).astype(np.float32), q_w.transpose(1, 2, 0).astype(np.float32))
    acc = FmaAccumulator(isum.shape[1:])
    for b in range(nb):
        acc.add(isum[b], _scale(d_a, d_w, b))
    return acc.acc


def matmul_mxfp4(w: np.ndarray, a: np.ndarray, repack: bool = True) -> np.ndarray:
    """w: u8 (out, nb*17) MXFP4 weight rows (GGUF layout); a: u8 (T, nb*34) Q8_0 activation rows
    (`quantize_activations(x, GGMLType.Q8_0)`). Returns y f32 (T, out) bit-identical to llama.cpp's x86 CPU
    backend: the repacked mxfp4_8x8 gemm/gemv when `repack` (llama.cpp's default) and out % 8 == 0, else
    `ggml_vec_dot_mxfp4_q8_0` per row."""
    d_a, q_a = q8_0_activations(a)
    T, nb, _ = q_a.shape
    w = np.ascontiguousarray(w, np.uint8)
    if w.ndim != 2 or w.shape[1] != nb * TYPE_SIZE:
        raise ValueError(f"MXFP4 weight rows of shape {w.shape} do not match {nb} blocks of Q8_0 activations")
    out = w.shape[0]
    kernel = _repacked_kernel if repack and is_repacked(out) else vec_dot_mxfp4_kernel
    y = np.empty((T, out), np.float32)
    step = rows_per_chunk(nb * 32 * max(T, 4))
    with np.errstate(over="ignore", invalid="ignore"):  # inf / nan propagate as in ggml
        for lo in range(0, out, step):
            rows = w[lo : lo + step]
            d, q = parts_mxfp4(rows.reshape(-1, TYPE_SIZE))  # (n, 1) f32, (n, 1, 32) int8
            d_w = d.reshape(rows.shape[0], nb).astype(np.float32)
            y[:, lo : lo + step] = kernel(d_w, q.reshape(rows.shape[0], nb, 32), d_a, q_a)
    return y


KERNELS = {GGMLType.MXFP4: matmul_mxfp4}
