"""Bit-exact emulation of llama.cpp's x86 CPU matmul for Q8_0, Q5_0, Q4_0 and IQ4_NL weights (tinyBLAS, vec_dot).

Which kernel runs (ggml-cpu.c `ggml_compute_forward_mul_mat`, llamafile on, this AVX-512 build): the driver
first offers the f32 activations to `llamafile_sgemm` (llamafile/sgemm.cpp); if that declines, it converts
the activation rows to the weight's vec_dot type and offers them again; if that declines too it calls the
type's `vec_dot` once per (activation row, weight row). `llamafile_sgemm` declines every batch of one row
(T < 2), so single-token steps always take `vec_dot`. Q4_0 and IQ4_NL weights with out % 8 == 0 are
normally repacked and never reach this driver: see `repack_q8_0.py`.

Q8_0 / Q5_0 / Q4_0 / IQ4_NL (activations Q8_0). T >= 2: `tinyBLAS_Q0_AVX` (the `gemm4xN` / `gemmMx4` /
`gemm<RM, RN>` tiles differ only in which tiles they cover; `updot` takes the `__AVX512VNNI__ &&
__AVX512VL__` branch, `_mm256_dpbusd_epi32`). T == 1: `ggml_vec_dot_*_q8_0` of arch/x86/quants.c, the
`__AVX2__` branch. For one output y[t, o] over blocks b of 32 elements:

    lane_j(b) = float(sum of q_w * q_a over elements 4j..4j+3 of block b)    j = 0..7, exact integers
    acc_j     = fma(d_w(b) * d_a(b), lane_j(b), acc_j)                       acc_j = 0 before block 0
    y         = hsum_float_8(acc)                                            ((a4+a0)+(a6+a2))+((a5+a1)+(a7+a3))

d_w * d_a is a product of two fp16 values (11-bit significands), exact in f32. Q8_0, Q5_0 and Q4_0's vec_dot
run this same sequence, so their result does not depend on T. IQ4_NL's vec_dot differs: two accumulators
(even / odd blocks), `hsum_float_8(acc_even + acc_odd)`, and an odd last block added by scalar code as
`y = y + d * float(sum of its 32 products)`, two roundings: this build does not contract scalar `a += b*c`
into an FMA (checked against the library and in its disassembly).

F32 / F16 / BF16 weights: `floats.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from ..fields import f16_field, i8_field, nibbles, u32_field
from ..iquants import KVALUES_IQ4NL
from ..legacy import fifth_bits
from .simd import FmaAccumulator, hsum_float_8

__all__ = [
    "KERNELS",
    "Q0_TYPE_SIZE",
    "matmul_iq4_nl_tinyblas",
    "matmul_q4_0_tinyblas",
    "matmul_q5_0",
    "matmul_q8_0",
    "q0_matmul",
    "q0_weight",
    "q8_0_activations",
    "rows_per_chunk",
    "tinyblas_q0_kernel",
    "vec_dot_iq4_nl_kernel",
]

QK = 32
_Q8_0_BYTES = 34
_TEMP_BYTES = 24 << 20  # budget for one temporary of a chunk of output rows; a few of them live at once


def rows_per_chunk(bytes_per_row: int) -> int:
    """Output rows per chunk so that a temporary of `bytes_per_row` per output row stays within budget."""
    return max(1, _TEMP_BYTES // max(1, bytes_per_row))


# -- block decoding ------------------------------------------------------------------------------------------------


def q8_0_activations(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 activation rows u8 (T, nb*34) -> (d f32 (T, nb), q int8 (T, nb, 32))."""
    a = np.ascontiguousarray(a, np.uint8)
    T = a.shape[0]
    if a.shape[1] % _Q8_0_BYTES:
        raise ValueError(f"Q8_0 activation rows of {a.shape[1]} bytes are not whole blocks of {_Q8_0_BYTES}")
    blocks = a.reshape(-1, _Q8_0_BYTES)
    return f16_field(blocks, 0).reshape(T, -1), i8_field(blocks, 2, QK).reshape(T, -1, QK)


# block layouts (ggml-common.h) and the integer values the kernels multiply (element order 0..31 of the block):
#   Q8_0   (34 B): d fp16, qs i8[32]                                      q = qs
#   Q4_0   (18 B): d fp16, qs u8[16] (lo nibble: element j, hi: j + 16)    q = nibble - 8
#   Q5_0   (22 B): d fp16, qh u32 (bit j: 5th bit of element j), qs       q = (nibble | bit << 4) - 16
#   IQ4_NL (18 B): d fp16, qs as Q4_0                                     q = kvalues_iq4nl[nibble]
Q0_TYPE_SIZE = {GGMLType.Q8_0: 34, GGMLType.Q4_0: 18, GGMLType.Q5_0: 22, GGMLType.IQ4_NL: 18}


def q0_weight(w: np.ndarray, ggml_type: GGMLType) -> tuple[np.ndarray, np.ndarray]:
    """Weight rows u8 (out, nb*type_size) -> (d f32 (out, nb), q int8 (out, nb, 32))."""
    w = np.ascontiguousarray(w, np.uint8)
    out = w.shape[0]
    blocks = w.reshape(-1, Q0_TYPE_SIZE[ggml_type])
    n = blocks.shape[0]
    d = f16_field(blocks, 0).reshape(out, -1)
    if ggml_type == GGMLType.Q8_0:
        q = i8_field(blocks, 2, QK)
    elif ggml_type == GGMLType.Q5_0:
        low = nibbles(blocks[:, 6:22]).reshape(n, QK)
        q = (low | fifth_bits(u32_field(blocks, 2))).astype(np.int8) - np.int8(16)
    else:
        nib = nibbles(blocks[:, 2:18]).reshape(n, QK)
        q = KVALUES_IQ4NL[nib] if ggml_type == GGMLType.IQ4_NL else nib.astype(np.int8) - np.int8(8)
    return d, q.reshape(out, -1, QK)


Q0Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def q0_matmul(w: np.ndarray, a: np.ndarray, ggml_type: GGMLType, kernel: Q0Kernel) -> np.ndarray:
    """Run `kernel(d_w, q_w, d_a, q_a) -> (T, O)` over chunks of weight rows, decoding each chunk on the way
    (an output head of 262144 rows is never widened at once)."""
    d_a, q_a = q8_0_activations(a)
    T, nb, _ = q_a.shape
    w = np.ascontiguousarray(w, np.uint8)
    if w.ndim != 2 or w.shape[1] != nb * Q0_TYPE_SIZE[ggml_type]:
        raise ValueError(f"{GGMLType(ggml_type).name} weight rows of shape {w.shape} do not match {nb} blocks")
    out = w.shape[0]
    y = np.empty((T, out), np.float32)
    # largest temporaries per output row: the lane sums (nb * 8 * T f32) and the widened quants (nb * 32 f32)
    step = rows_per_chunk(nb * QK * max(T, 4))
    for lo in range(0, out, step):
        d_w, q_w = q0_weight(w[lo : lo + step], ggml_type)
        y[:, lo : lo + step] = kernel(d_w, q_w, d_a, q_a)
    return y


# -- Q8_0-activation kernels ----------------------------------------------------------------------------------


def _lane_sums(q_a: np.ndarray, q_w: np.ndarray) -> np.ndarray:
    """int8 (T, nb, 32) x int8 (O, nb, 32) -> f32 (nb, 8, T, O): the 8 dpbusd lanes of every block.

    Lane j of block b holds the four products of elements 4j..4j+3 (`_mm256_dpbusd_epi32` sums the four
    bytes of each 32-bit lane; the sign trick |w| * (a * sign(w)) leaves the products unchanged). The sums are
    integers below 2^17, exact in an f32 matmul whatever its order."""
    T, nb, _ = q_a.shape
    O = q_w.shape[0]
    A = q_a.reshape(T, nb * 8, 4).transpose(1, 0, 2).astype(np.float32)  # (lanes, T, 4)
    W = q_w.reshape(O, nb * 8, 4).transpose(1, 2, 0).astype(np.float32)  # (lanes, 4, O)
    return np.matmul(A, W).reshape(nb, 8, T, O)


def _scales(d_a: np.ndarray, d_w: np.ndarray, b: int) -> np.ndarray:
    """(T, O) d_a * d_w of block b: a product of two fp16 values (11-bit significands), exact in f32 (so its
    order and whether it is formed in f32 or float64 do not matter)."""
    return d_a[:, b, None].astype(np.float64) * d_w[None, :, b]


def tinyblas_q0_kernel(d_w: np.ndarray, q_w: np.ndarray, d_a: np.ndarray, q_a: np.ndarray) -> np.ndarray:
    """`tinyBLAS_Q0_AVX` (and the AVX2 `ggml_vec_dot_{q8_0,q5_0,q4_0}_q8_0`): per output, 8 lanes of
    acc = fma(d_w * d_a, lane, acc) over the blocks, then hsum_float_8."""
    lanes = _lane_sums(q_a, q_w)
    acc = FmaAccumulator(lanes.shape[1:], subnormals=False)  # (8, T, O)
    for b in range(lanes.shape[0]):
        acc.add(_scales(d_a, d_w, b), lanes[b])
    return hsum_float_8(np.moveaxis(acc.acc, 0, -1))


def vec_dot_iq4_nl_kernel(d_w: np.ndarray, q_w: np.ndarray, d_a: np.ndarray, q_a: np.ndarray) -> np.ndarray:
    """arch/x86/quants.c `ggml_vec_dot_iq4_nl_q8_0`, `__AVX2__` branch, for every (t, o).

    Blocks go in pairs: block 2i into accum1, block 2i+1 into accum2, lane j = float(sum of the products of
    elements 4j..4j+3) (maddubs pairs, then madd with ones: exact, |pair| <= 2*127*127) times
    fp16(d_a) * fp16(d_w), as an FMA. Then hsum_float_8(accum1 + accum2). An odd last block is added by
    scalar code, `sumf += d * (sumi1 + sumi2)`: an f32 multiply, then an f32 add (not contracted into an FMA:
    the library's code is vcvtsi2ss, vmulss, vaddss)."""
    lanes = _lane_sums(q_a, q_w)
    nb = lanes.shape[0]
    acc = [FmaAccumulator(lanes.shape[1:], subnormals=False) for _ in range(2)]
    for b in range(nb - nb % 2):
        acc[b % 2].add(_scales(d_a, d_w, b), lanes[b])
    y = hsum_float_8(np.moveaxis(acc[0].acc + acc[1].acc, 0, -1))
    if nb % 2:
        d = _scales(d_a, d_w, nb - 1).astype(np.float32)
        y = y + d * lanes[nb - 1].sum(axis=0)  # the block's integer sum is exact in f32
    return y


def matmul_q8_0(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: u8 (out, nb*34) Q8_0 weight rows; a: u8 (T, nb*34) Q8_0 activation rows in ggml's standard block
    layout (`quantize_activations(x, GGMLType.Q8_0)`). Returns y f32 (T, out), bit-identical to llama.cpp's
    CPU mul_mat: `tinyBLAS_Q0_AVX<block_q8_0>` for T >= 2, `ggml_vec_dot_q8_0_q8_0` for T == 1 (the same
    rounding sequence). Q8_0 weights are repacked only on ARM / RISC-V."""
    return q0_matmul(w, a, GGMLType.Q8_0, tinyblas_q0_kernel)


def matmul_q5_0(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """As `matmul_q8_0` for Q5_0 weight rows u8 (out, nb*22): `tinyBLAS_Q0_AVX<block_q5_0>` (T >= 2) or
    `ggml_vec_dot_q5_0_q8_0` (T == 1), the same rounding sequence. Q5_0 has no repacked layout on x86."""
    return q0_matmul(w, a, GGMLType.Q5_0, tinyblas_q0_kernel)


def matmul_q4_0_tinyblas(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Q4_0 weight rows u8 (out, nb*18) in ggml's plain CPU buffer (not repacked: out % 8 != 0, or repacking
    off): `tinyBLAS_Q0_AVX<block_q4_0>` (T >= 2) or `ggml_vec_dot_q4_0_q8_0` (T == 1), the same rounding."""
    return q0_matmul(w, a, GGMLType.Q4_0, tinyblas_q0_kernel)


def matmul_iq4_nl_tinyblas(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """IQ4_NL weight rows u8 (out, nb*18) in the plain CPU buffer: `tinyBLAS_Q0_AVX<block_iq4_nl>` for
    T >= 2, `ggml_vec_dot_iq4_nl_q8_0` (two accumulators: a different rounding) for T == 1."""
    kernel = tinyblas_q0_kernel if np.shape(a)[0] >= 2 else vec_dot_iq4_nl_kernel
    return q0_matmul(w, a, GGMLType.IQ4_NL, kernel)


# Quantized weight types whose mul_mat never takes a repacked path on x86. Q4_0 and IQ4_NL: `repack_q8_0.KERNELS`.
KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    GGMLType.Q8_0: matmul_q8_0,
    GGMLType.Q5_0: matmul_q5_0,
}
