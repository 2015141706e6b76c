"""Bit-exact emulation of llama.cpp's x86 matmul for TQ1_0 and TQ2_0 weights (Q8_K activations).

The ternary types (weights (q - 1) * d, q in {0, 1, 2}, 256 per block) have `vec_dot_type = GGML_TYPE_Q8_K`, no
repacked layout, no tinyBLAS case and no tiled kernel: every shape runs `ggml_vec_dot_tq1_0_q8_K` /
`ggml_vec_dot_tq2_0_q8_K` (arch/x86/quants.c, `__AVX2__` branch) per (activation, weight) row. Both unpack q
into 32-byte vectors whose byte b pairs with activation element 32k + b, multiply by `maddubs` into 16-bit
lanes (lane m: elements with e % 32 in {2m, 2m+1}), subtract the Q8_K bsums (bsum m: elements 16m..16m+15)
and pair the 16-bit lanes with `madd`. So per super-block, 32-bit lane L (L = 0..7) holds the exact integer

    I_L = sum of q_e * y_e over e with (e % 32) // 4 == L  -  sum of y_e over e in 32L..32L+31

(every partial sum fits its 16-bit lane: no wrap), and

    acc[L] = fl(float(I_L) * d + acc[L]),   d = fl(d_a * fp16(d_w))      one FMA: GCC contracts the
    y = hsum_float_8(acc)                                                `_mm256_add_ps(_mm256_mul_ps())`

The two types differ only in how q is unpacked (`lowbit.parts_tq1_0` / `parts_tq2_0` give q - 1 in element order).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from ..fields import f32_field, i8_field
from ..lowbit import parts_tq1_0, parts_tq2_0
from .llamafile import FmaAccumulator, rows_per_chunk
from .simd import hsum_float_8

__all__ = ["KERNELS", "matmul_tq1_0", "matmul_tq2_0", "vec_dot_ternary_kernel"]

QK_K = 256
_Q8K_BYTES = 292  # block_q8_K: f32 d, i8 qs[256], i16 bsums[16]
_TYPE_SIZE = {GGMLType.TQ1_0: 54, GGMLType.TQ2_0: 66}
_PARTS: dict[GGMLType, Callable] = {GGMLType.TQ1_0: parts_tq1_0, GGMLType.TQ2_0: parts_tq2_0}


def vec_dot_ternary_kernel(d_w: np.ndarray, q_w: np.ndarray, d_a: np.ndarray, q_a: np.ndarray) -> np.ndarray:
    """d_w f32 (O, nb), q_w (O, nb, 256) in {0, 1, 2}, d_a f32 (T, nb), q_a int8 (T, nb, 256) -> y f32 (T, O)."""
    T, nb, _ = q_a.shape
    O = q_w.shape[0]
    # [b, L, ., 32]: the 32 elements of lane L (e % 32 in 4L..4L+3, over the 8 chunks of 32)
    A = q_a.reshape(T, nb, 8, 8, 4).transpose(1, 3, 0, 2, 4).reshape(nb, 8, T, 32).astype(np.float32)
    W = q_w.reshape(O, nb, 8, 8, 4).transpose(1, 3, 2, 4, 0).reshape(nb, 8, 32, O).astype(np.float32)
    chunk_sums = q_a.reshape(T, nb, 8, 32).sum(axis=-1, dtype=np.int32)  # (T, nb, L): bsums 2L + 2L+1
    acc = FmaAccumulator((8, T, O), subnormals=False)
    for b in range(nb):
        lanes = np.matmul(A[b], W[b]) - chunk_sums[:, b].T[:, :, None]  # exact integers (|I_L| < 2^14)
        d = (d_a[:, b, None] * d_w[None, :, b]).astype(np.float32)  # y[i].d * GGML_CPU_FP16_TO_FP32(x[i].d)
        acc.add(lanes, d)
    return hsum_float_8(np.moveaxis(acc.acc, 0, -1))


def _matmul(w: np.ndarray, a: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    a = np.ascontiguousarray(a, np.uint8)
    w = np.ascontiguousarray(w, np.uint8)
    T = a.shape[0]
    nb = a.shape[1] // _Q8K_BYTES
    size = _TYPE_SIZE[ggml_type]
    if a.shape[1] != nb * _Q8K_BYTES or w.ndim != 2 or w.shape[1] != nb * size:
        raise ValueError(f"{ggml_type.name} weight rows {w.shape} and Q8_K activation rows {a.shape} do not match")
    ab = a.reshape(T * nb, _Q8K_BYTES)
    d_a = f32_field(ab, 0).reshape(T, nb)
    q_a = i8_field(ab, 4, QK_K).reshape(T, nb, QK_K)
    out = w.shape[0]
    y = np.empty((T, out), np.float32)
    step = rows_per_chunk(nb * QK_K * 8 * max(T, 4))
    with np.errstate(over="ignore", invalid="ignore"):  # inf / nan propagate as in ggml
        for lo in range(0, out, step):
            rows = w[lo : lo + step]
            d, v = _PARTS[ggml_type](rows.reshape(-1, size))  # (n,) f32 and (n, 1, 256) q - 1
            q_w = (v.reshape(rows.shape[0], nb, QK_K) + np.int8(1)).astype(np.int8)
            y[:, lo : lo + step] = vec_dot_ternary_kernel(d.reshape(rows.shape[0], nb), q_w, d_a, q_a)
    return y


def matmul_tq1_0(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: u8 (out, nb*54) TQ1_0 weight rows; a: u8 (T, nb*292) Q8_K activation rows
    (`quantize_activations(x, GGMLType.Q8_K)`). Returns y f32 (T, out) as `ggml_vec_dot_tq1_0_q8_K` (AVX2)."""
    return _matmul(w, a, GGMLType.TQ1_0)


def matmul_tq2_0(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """As `matmul_tq1_0` for TQ2_0 weight rows u8 (out, nb*66): `ggml_vec_dot_tq2_0_q8_K` (AVX2)."""
    return _matmul(w, a, GGMLType.TQ2_0)


KERNELS = {GGMLType.TQ1_0: matmul_tq1_0, GGMLType.TQ2_0: matmul_tq2_0}
