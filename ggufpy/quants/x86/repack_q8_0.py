"""Bit-exact emulation of llama.cpp's x86 matmul for Q4_0 and IQ4_NL weights: repacked 8x8, or llamafile.

Q4_0 and IQ4_NL weights whose row count is a multiple of 8 are loaded into the CPU_REPACK buffer on an AVX2
machine (repack.cpp `ggml_repack_get_optimal_repack_type`: `q4_0_8x8_q8_0` / `iq4_nl_8x8_q8_0`, blocks of 8
weight rows interleaved by `make_block_q4_0x8` / `make_block_iq4_nlx8`), and their mul_mat runs repack.cpp
`tensor_traits<...>::forward_mul_mat` instead of ggml-cpu.c's driver: activation rows 4 at a time through
`ggml_quantize_mat_t<8, GGML_TYPE_Q8_0>` (`ggml_quantize_mat_q8_0_4x8`: the same bytes as `quantize_row_q8_0`,
interleaved), the leftover T % 4 rows through `quantize_row_q8_0`; then `ggml_gemm_{q4_0,iq4_nl}_8x8_q8_0`
on the first T - T % 4 rows and `ggml_gemv_*` on each remaining row (arch/x86/repack.cpp,
`gemm_q4_b32_8x8_q8_0_lut_avx` / `gemv_q4_b32_8x8_q8_0_lut_avx`; the gemm's `__AVX512BW__ && __AVX512DQ__`
16-column tiles and its AVX2 8-column tiles, and the gemv, all accumulate the same way).

Every output element has its own f32 lane (no horizontal sum). For y[t, o] over blocks b of 32 elements:

    isum(b) = sum over the 32 elements of q_w * q_a        exact integer (dpbusd lanes added as int32)
    acc     = fma(float(isum(b)), d_w(b) * d_a(b), acc)    acc = 0 before block 0; d_w * d_a exact in f32
    y       = acc

q_w is the signed nibble (q - 8 for Q4_0: the repacking xors each nibble with 8, the lookup table sign-extends
it) or `kvalues_iq4nl[q]` for IQ4_NL. Weights not repacked (out % 8 != 0, or repacking disabled) go through
ggml-cpu.c's driver: `llamafile.matmul_q4_0_tinyblas` / `matmul_iq4_nl_tinyblas`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from .llamafile import (
    FmaAccumulator,
    matmul_iq4_nl_tinyblas,
    matmul_q4_0_tinyblas,
    q0_matmul,
)

__all__ = ["KERNELS", "is_repacked", "matmul_iq4_nl", "matmul_q4_0", "matmul_repacked_8x8", "repacked_8x8_kernel"]

_REPACKED = (GGMLType.Q4_0, GGMLType.IQ4_NL)


def is_repacked(ggml_type: GGMLType, out: int) -> bool:
    """Whether llama.cpp (repacking on, an AVX2 CPU) moves a 2-D weight of `out` rows into the CPU_REPACK
    buffer with an 8x8 layout and Q8_0 activations: Q4_0 and IQ4_NL when out % 8 == 0."""
    return ggml_type in _REPACKED and out % 8 == 0


def repacked_8x8_kernel(d_w: np.ndarray, q_w: np.ndarray, d_a: np.ndarray, q_a: np.ndarray) -> np.ndarray:
    """`gemm_q4_b32_8x8_q8_0_lut_avx` / `gemv_q4_b32_8x8_q8_0_lut_avx` on decoded blocks: d_w f32 (O, nb),
    q_w int8 (O, nb, 32), d_a f32 (T, nb), q_a int8 (T, nb, 32) -> y f32 (T, O)."""
    nb = q_a.shape[1]
    # (nb, T, O) block sums: integers below 2^20 (IQ4_NL: 32 * 127 * 127), exact in an f32 matmul
    isum = np.matmul(q_a.transpose(1, 0, 2).astype(np.float32), q_w.transpose(1, 2, 0).astype(np.float32))
    acc = FmaAccumulator(isum.shape[1:], subnormals=False)
    for b in range(nb):
        # `_mm256_mul_ps(col_scale_f32, row_scale_f32)`: a product of two fp16 values, exact in f32
        acc.add(isum[b], d_a[:, b, None].astype(np.float64) * d_w[None, :, b])
    return acc.acc


def matmul_repacked_8x8(w: np.ndarray, a: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """The repacked gemm/gemv for Q4_0 / IQ4_NL weight rows u8 (out, nb*18), given in ggml's standard
    (GGUF, not interleaved) block layout, with Q8_0 activation rows u8 (T, nb*34). Returns y f32 (T, out)."""
    if ggml_type not in _REPACKED:
        raise ValueError(f"{GGMLType(ggml_type).name} has no 8x8 repacked layout with Q8_0 activations on x86")
    return q0_matmul(w, a, ggml_type, repacked_8x8_kernel)


def matmul_q4_0(w: np.ndarray, a: np.ndarray, repack: bool = True) -> np.ndarray:
    """w: u8 (out, nb*18) Q4_0 weight rows (GGUF layout); a: u8 (T, nb*34) Q8_0 activation rows
    (`quantize_activations(x, GGMLType.Q8_0)`). Returns y f32 (T, out) bit-identical to llama.cpp's CPU
    backend: the repacked q4_0_8x8 gemm/gemv when `repack` (llama.cpp's default, `use_extra_bufts`) and
    out % 8 == 0, else `tinyBLAS_Q0_AVX` (T >= 2) / `ggml_vec_dot_q4_0_q8_0` (T == 1)."""
    if repack and is_repacked(GGMLType.Q4_0, w.shape[0]):
        return matmul_repacked_8x8(w, a, GGMLType.Q4_0)
    return matmul_q4_0_tinyblas(w, a)


def matmul_iq4_nl(w: np.ndarray, a: np.ndarray, repack: bool = True) -> np.ndarray:
    """As `matmul_q4_0` for IQ4_NL weight rows u8 (out, nb*18): the repacked iq4_nl_8x8 gemm/gemv, else
    `tinyBLAS_Q0_AVX` (T >= 2) / `ggml_vec_dot_iq4_nl_q8_0` (T == 1)."""
    if repack and is_repacked(GGMLType.IQ4_NL, w.shape[0]):
        return matmul_repacked_8x8(w, a, GGMLType.IQ4_NL)
    return matmul_iq4_nl_tinyblas(w, a)


KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    GGMLType.Q4_0: matmul_q4_0,
    GGMLType.IQ4_NL: matmul_iq4_nl,
}
