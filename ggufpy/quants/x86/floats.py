"""Bit-exact emulation of llama.cpp's x86 CPU matmul for F32, F16 and BF16 weights (tinyBLAS, vec_dot).

The mul_mat driver (ggml-cpu.c `ggml_compute_forward_mul_mat`, llamafile on, this AVX-512 build) offers the
batch to `llamafile_sgemm` (llamafile/sgemm.cpp), which declines a single row, and otherwise calls the type's
`vec_dot` per (activation row, weight row); see `llamafile.py` for the quantized types.

F32 / F16 / BF16. T >= 2, in % KN == 0 and out % 4 == 0: `tinyBLAS<KN, __m512, V, TA, TB, float>` (the
`__AVX512F__` instantiations; BF16 the `__AVX512BF16__` one with KN = 32, V = __m512bh). Every tile shape
keeps one 16-lane accumulator per output element and walks k in steps of KN, so for any tiling:

    F32, F16:  acc_i = fma(w[l + i], a[l + i], acc_i)          l = 0, 16, 32, ...;  i = 0..15
    BF16:      acc_i = fma(w[l+2i+1], a[l+2i+1], acc_i); acc_i = fma(w[l+2i], a[l+2i], acc_i)  (VDPBF16PS)
    y = _mm512_reduce_add_ps(acc)

Otherwise vec_dot (vec.cpp `ggml_vec_dot_f32` / `_f16` / `_bf16`, their AVX-512 branches): 4 x 16 lanes over
steps of 64 (F32, F16) reduced pairwise, or 2 x (32 bf16) `dpbf16` accumulators over steps of 64 (BF16),
then the leftover elements one by one (see the functions).

The F32/F16/BF16 kernels take `a` as what the driver hands to the kernel: the f32 activation rows for F32,
the rows converted to f16 (`ggml_cpu_fp32_to_fp16`, round to nearest even) for F16 and to bf16
(`ggml_cpu_fp32_to_bf16`) for BF16. `float_activations(x, type)` builds them from f32 rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from ..floats import fp32_to_bf16_bits
from .llamafile import rows_per_chunk
from .simd import FmaAccumulator, reduce_add_ps_512

__all__ = ["KERNELS", "float_activations", "float_matmul", "matmul_bf16", "matmul_f16", "matmul_f32"]


_FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def float_activations(x: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """f32 activation rows (T, n) -> what mul_mat hands the kernel of a `ggml_type` weight: the f32 rows for
    F32; f16 values for F16 (`ggml_cpu_fp32_to_fp16`: F16C `_mm512_cvtps_ph`, nearest even, which NumPy's
    cast matches); bf16 bits u16 for BF16 (`ggml_cpu_fp32_to_bf16`: scalar GGML_FP32_TO_BF16, nearest even)."""
    x = np.ascontiguousarray(x, np.float32)
    if ggml_type == GGMLType.F32:
        return x
    if ggml_type == GGMLType.F16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    if ggml_type == GGMLType.BF16:
        return fp32_to_bf16_bits(x).reshape(x.shape)
    raise ValueError(f"{GGMLType(ggml_type).name} is not a float type")


def _element_rows(r: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """Rows of F32 / F16 / BF16 elements given as their NumPy dtype (f32, f16), u16 bits, or raw u8 bytes
    (rows, n * element size) -> the same memory viewed as (rows, n) elements: f32, or u16 bits."""
    r = np.ascontiguousarray(r)
    if r.ndim != 2:
        raise ValueError(f"expected 2-D rows, got shape {r.shape}")
    return r.view(np.float32) if ggml_type == GGMLType.F32 else r.view(np.uint16)


def _widen(r: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """Elements from `_element_rows` -> f32 values (exact)."""
    if ggml_type == GGMLType.F32:
        return r
    if ggml_type == GGMLType.F16:
        return r.view(np.float16).astype(np.float32)
    return (r.astype(np.uint32) << 16).view(np.float32)


def _tinyblas_kn16_kernel(W: np.ndarray, A: np.ndarray, exact_products: bool) -> np.ndarray:
    """`tinyBLAS<16, __m512, __m512, TA, TB, float>::gemm_bloc`: acc_i = fma(w[l+i], a[l+i], acc_i) for
    l = 0, 16, ..., then `hsum(__m512)` = `_mm512_reduce_add_ps`. With `exact_products` (F16: a product of
    two fp16 values fits in 22 bits, exact in f32) each FMA is an f32 add of the f32 product."""
    T, n = A.shape
    O = W.shape[0]
    Wl = W.reshape(O, n // 16, 16).transpose(1, 2, 0)[:, :, None, :]  # (steps, 16 lanes, 1, O)
    Al = A.reshape(T, n // 16, 16).transpose(1, 2, 0)[:, :, :, None]  # (steps, 16 lanes, T, 1)
    if exact_products:
        acc = np.zeros((16, T, O), np.float32)
        for s in range(n // 16):
            acc += Wl[s] * Al[s]
    else:
        fma = FmaAccumulator((16, T, O))
        W64, A64 = Wl.astype(np.float64), Al.astype(np.float64)  # same-dtype products are faster
        for s in range(n // 16):
            fma.add(W64[s], A64[s])
        acc = fma.acc
    return reduce_add_ps_512(np.moveaxis(acc, 0, -1))


def _tinyblas_bf16_kernel(W: np.ndarray, A: np.ndarray) -> np.ndarray:
    """`tinyBLAS<32, __m512, __m512bh, ggml_bf16_t, ggml_bf16_t, float>`: madd = `_mm512_dpbf16_ps(acc, w, a)`
    on 32 bf16 at a time, then `_mm512_reduce_add_ps`.

    VDPBF16PS (Intel SDM), lane i: srcdest += w[2i+1] * a[2i+1], then srcdest += w[2i] * a[2i], each an FMA
    rounding to nearest even. A product of two bf16 (8-bit significands) is exact in f32, so each FMA is an
    f32 add of that product. (The instruction also treats denormal inputs as zero and flushes denormal results
    to zero; not emulated: real weights and activations are far from the f32 denormal range.)"""
    T, n = A.shape
    O = W.shape[0]
    Wl = W.reshape(O, n // 32, 16, 2).transpose(1, 3, 2, 0)[:, :, :, None, :]  # (steps, pair member, lane, 1, O)
    Al = A.reshape(T, n // 32, 16, 2).transpose(1, 3, 2, 0)[:, :, :, :, None]  # (steps, pair member, lane, T, 1)
    acc = np.zeros((16, T, O), np.float32)
    for s in range(n // 32):
        acc += Wl[s, 1] * Al[s, 1]  # the odd element of each pair first
        acc += Wl[s, 0] * Al[s, 0]
    return reduce_add_ps_512(np.moveaxis(acc, 0, -1))


def _vec_dot_kernel(W: np.ndarray, A: np.ndarray, exact_products: bool) -> np.ndarray:
    """vec.cpp `ggml_vec_dot_f32` / `ggml_vec_dot_f16`, AVX-512 branch (GGML_F32_STEP = GGML_F16_STEP = 64,
    EPR = 16, ARR = 4): sum[j] = fma(x[i+16j..], y[i+16j..], sum[j]) over i += 64; GGML_F32x16_REDUCE:
    sum0 += sum2, sum1 += sum3, sum0 += sum1, `_mm512_reduce_add_ps(sum0)`. Then the n % 64 leftovers one by
    one: F32 `sumf += x*y` on a float (f32 multiply, then f32 add: not contracted, checked against the
    library); F16 into a double `sumf` (the f32 product of two fp16 values is exact), rounded to f32 at the
    end. F16's FMAs are f32 adds of exact products, as in `_tinyblas_kn16_kernel`."""
    T, n = A.shape
    O = W.shape[0]
    main = n - n % 64
    fma = FmaAccumulator((4, 16, T, O))
    for i in range(0, main, 64):
        wv = W[:, i : i + 64].reshape(O, 4, 16).transpose(1, 2, 0)[:, :, None, :]  # (4 registers, 16, 1, O)
        av = A[:, i : i + 64].reshape(T, 4, 16).transpose(1, 2, 0)[:, :, :, None]  # (4 registers, 16, T, 1)
        if exact_products:
            fma.acc += wv * av
        else:
            fma.add(wv, av)
    acc = fma.acc
    r = reduce_add_ps_512(np.moveaxis((acc[0] + acc[2]) + (acc[1] + acc[3]), 0, -1))  # (T, O)
    if exact_products:
        r = r.astype(np.float64)
        for i in range(main, n):
            r = r + (A[:, i, None] * W[None, :, i]).astype(np.float64)
        return r.astype(np.float32)
    for i in range(main, n):
        r = r + A[:, i, None] * W[None, :, i]
    return r


def _vec_dot_bf16_kernel(W: np.ndarray, A: np.ndarray) -> np.ndarray:
    """vec.cpp `ggml_vec_dot_bf16`, `__AVX512BF16__` branch: c1 = dpbf16(c1, x[i..i+32], y[i..i+32]) and
    c2 = dpbf16(c2, x[i+32..i+64], y[i+32..i+64]) for i += 64; a double `sumf` = reduce(c1), += reduce(c2),
    += each leftover product (exact in f32) in turn; stored as float."""
    T, n = A.shape
    O = W.shape[0]
    main = n - n % 64
    acc = np.zeros((2, 16, T, O), np.float32)
    for i in range(0, main, 64):
        # (pair member, register, lane, ...): register c1 takes elements i..i+31, c2 i+32..i+63
        wv = W[:, i : i + 64].reshape(O, 2, 16, 2).transpose(3, 1, 2, 0)[:, :, :, None, :]
        av = A[:, i : i + 64].reshape(T, 2, 16, 2).transpose(3, 1, 2, 0)[:, :, :, :, None]
        acc += wv[1] * av[1]
        acc += wv[0] * av[0]
    r = reduce_add_ps_512(np.moveaxis(acc[0], 0, -1)).astype(np.float64)
    r = r + reduce_add_ps_512(np.moveaxis(acc[1], 0, -1))
    for i in range(main, n):
        r = r + (A[:, i, None] * W[None, :, i]).astype(np.float64)
    return r.astype(np.float32)


def float_matmul(w: np.ndarray, a: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """The F32 / F16 / BF16 mul_mat: tinyBLAS when `llamafile_sgemm` accepts (T >= 2; `tinyBLAS::matmul`:
    in % KN == 0 and out % 4 == 0, KN = 16, or 32 for BF16), else vec_dot per (activation, weight) pair."""
    if ggml_type not in _FLOAT_TYPES:
        raise ValueError(f"{GGMLType(ggml_type).name} is not a float type")
    w = _element_rows(w, ggml_type)
    A = _widen(_element_rows(a, ggml_type), ggml_type)
    T, n = A.shape
    out = w.shape[0]
    if w.shape[1] != n:
        raise ValueError(f"weight rows hold {w.shape[1]} elements, activation rows {n}")
    kn = 32 if ggml_type == GGMLType.BF16 else 16
    tinyblas = T >= 2 and n % kn == 0 and out % 4 == 0
    exact = ggml_type == GGMLType.F16
    y = np.empty((T, out), np.float32)
    step = rows_per_chunk(8 * max(64 * T, n))  # the (4, 16, T) float64 buffers of vec_dot, or one weight row
    for lo in range(0, out, step):
        W = _widen(w[lo : lo + step], ggml_type)
        if ggml_type == GGMLType.BF16:
            r = _tinyblas_bf16_kernel(W, A) if tinyblas else _vec_dot_bf16_kernel(W, A)
        else:
            r = _tinyblas_kn16_kernel(W, A, exact) if tinyblas else _vec_dot_kernel(W, A, exact)
        y[:, lo : lo + step] = r
    return y


def matmul_f32(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: F32 weight rows f32 (out, in) (or their bytes u8 (out, 4*in)); a: the f32 activation rows (T, in).
    Returns y f32 (T, out) as llama.cpp computes it: `tinyBLAS<16, __m512, __m512, float, float, float>`
    (the driver's first `llamafile_sgemm` call) when T >= 2, in % 16 == 0 and out % 4 == 0, otherwise
    `ggml_vec_dot_f32` for each (activation row, weight row)."""
    return float_matmul(w, a, GGMLType.F32)


def matmul_f16(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: F16 weight rows (out, in) as float16 values, u16 bits or bytes u8 (out, 2*in); a: the activation rows
    converted to f16 (T, in), same encodings (`float_activations(x, GGMLType.F16)`). Returns y f32 (T, out):
    `tinyBLAS<16, __m512, __m512, ggml_fp16_t, ggml_fp16_t, float>` (the driver's second `llamafile_sgemm`
    call, after converting the activations) when T >= 2, in % 16 == 0 and out % 4 == 0, otherwise
    `ggml_vec_dot_f16`."""
    return float_matmul(w, a, GGMLType.F16)


def matmul_bf16(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """w: BF16 weight rows (out, in) as u16 bits or bytes u8 (out, 2*in); a: the activation rows converted to
    bf16, u16 bits (T, in) (`float_activations(x, GGMLType.BF16)`). Returns y f32 (T, out):
    `tinyBLAS<32, __m512, __m512bh, ggml_bf16_t, ggml_bf16_t, float>` when T >= 2, in % 32 == 0 and
    out % 4 == 0, otherwise `ggml_vec_dot_bf16`."""
    return float_matmul(w, a, GGMLType.BF16)


KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    GGMLType.F32: matmul_f32,
    GGMLType.F16: matmul_f16,
    GGMLType.BF16: matmul_bf16,
}
