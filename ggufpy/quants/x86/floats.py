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

AVX2 build (`isa="avx2"`: no AVX-512) the same kernels 8 lanes wide: tinyBLAS<8, __m256> for all three types
(T >= 2, in % 8 == 0, out % 4 == 0; bf16 and f16 widened to f32 on load, one FMA per step, `hsum_float_8`);
vec_dot with 4 x 8 lanes over steps of 32 (F32, F16: `GGML_F32x8_REDUCE`, sum0 += sum2, sum1 += sum3,
sum0 += sum1, then `hadd_reduce_8`; BF16: c1..c4, (c1 + c3) + (c2 + c4), `hsum_float_8`), leftovers as above.

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
from .simd import FmaAccumulator, hadd_reduce_8, hsum_float_8, reduce_add_ps_512

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


# Per x86 build (`simd.ISAS`): the f32 lanes of one vector register and its horizontal sums: tinyBLAS's
# `hsum(V)`, and the end of vec_dot's `GGML_F32_VEC_REDUCE` for F32 / F16.
_LANES = {"avx512": 16, "avx2": 8}
_HSUM = {"avx512": reduce_add_ps_512, "avx2": hsum_float_8}
_VEC_REDUCE = {"avx512": reduce_add_ps_512, "avx2": hadd_reduce_8}


def _tinyblas_kernel(W: np.ndarray, A: np.ndarray, exact_products: bool, isa: str = "avx512") -> np.ndarray:
    """`tinyBLAS<KN, V, V, TA, TB, float>::gemm_bloc` with KN f32 lanes (16: __m512; 8: __m256):
    acc_i = fma(w[l+i], a[l+i], acc_i) for l = 0, KN, ..., then `hsum(V)`. With `exact_products` (F16, BF16
    widened to f32: a product of two such values is exact in f32) each FMA is an f32 add of the product."""
    kn = _LANES[isa]
    T, n = A.shape
    O = W.shape[0]
    Wl = W.reshape(O, n // kn, kn).transpose(1, 2, 0)[:, :, None, :]  # (steps, kn lanes, 1, O)
    Al = A.reshape(T, n // kn, kn).transpose(1, 2, 0)[:, :, :, None]  # (steps, kn lanes, T, 1)
    if exact_products:
        acc = np.zeros((kn, T, O), np.float32)
        for s in range(n // kn):
            acc += Wl[s] * Al[s]
    else:
        fma = FmaAccumulator((kn, T, O))
        W64, A64 = Wl.astype(np.float64), Al.astype(np.float64)  # same-dtype products are faster
        for s in range(n // kn):
            fma.add(W64[s], A64[s])
        acc = fma.acc
    return _HSUM[isa](np.moveaxis(acc, 0, -1))


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


def _vec_dot_kernel(W: np.ndarray, A: np.ndarray, exact_products: bool, isa: str = "avx512") -> np.ndarray:
    """vec.cpp `ggml_vec_dot_f32` / `ggml_vec_dot_f16`, AVX-512 branch (GGML_F32_STEP = GGML_F16_STEP = 64,
    EPR = 16, ARR = 4): sum[j] = fma(x[i+16j..], y[i+16j..], sum[j]) over i += 64; GGML_F32x16_REDUCE:
    sum0 += sum2, sum1 += sum3, sum0 += sum1, `_mm512_reduce_add_ps(sum0)`. Then the n % 64 leftovers one by
    one: F32 `sumf += x*y` on a float (f32 multiply, then f32 add: not contracted, checked against the
    library); F16 into a double `sumf` (the f32 product of two fp16 values is exact), rounded to f32 at the
    end. F16's FMAs are f32 adds of exact products, as in `_tinyblas_kernel`. The AVX2 branch: the same with
    8 lanes (steps of 32) and `hadd_reduce_8` for the last reduction."""
    lanes = _LANES[isa]
    T, n = A.shape
    O = W.shape[0]
    step = 4 * lanes  # GGML_F32_STEP = GGML_F16_STEP
    main = n - n % step
    fma = FmaAccumulator((4, lanes, T, O))
    for i in range(0, main, step):
        wv = W[:, i : i + step].reshape(O, 4, lanes).transpose(1, 2, 0)[:, :, None, :]  # (4 registers, lanes, 1, O)
        av = A[:, i : i + step].reshape(T, 4, lanes).transpose(1, 2, 0)[:, :, :, None]  # (4 registers, lanes, T, 1)
        if exact_products:
            fma.acc += wv * av
        else:
            fma.add(wv, av)
    acc = fma.acc
    r = _VEC_REDUCE[isa](np.moveaxis((acc[0] + acc[2]) + (acc[1] + acc[3]), 0, -1))  # (T, O)
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


def _vec_dot_bf16_avx2_kernel(W: np.ndarray, A: np.ndarray) -> np.ndarray:
    """vec.cpp `ggml_vec_dot_bf16`, `__AVX2__` branch: c_j = c_j + x*y (products of bf16 exact in f32) on 8
    lanes, registers c1..c4 over elements i + 8(j-1) for i += 32; c1 = (c1 + c3) + (c2 + c4); a double sum of
    `hsum_float_8(c1)` and then each leftover product in turn; stored as float."""
    T, n = A.shape
    O = W.shape[0]
    main = n - n % 32
    acc = np.zeros((4, 8, T, O), np.float32)
    for i in range(0, main, 32):
        acc += (
            W[:, i : i + 32].reshape(O, 4, 8).transpose(1, 2, 0)[:, :, None, :]
            * (A[:, i : i + 32].reshape(T, 4, 8).transpose(1, 2, 0)[:, :, :, None])
        )
    r = hsum_float_8(np.moveaxis((acc[0] + acc[2]) + (acc[1] + acc[3]), 0, -1)).astype(np.float64)
    for i in range(main, n):
        r = r + (A[:, i, None] * W[None, :, i]).astype(np.float64)
    return r.astype(np.float32)


def _kernel(ggml_type: GGMLType, isa: str, tinyblas: bool) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The f32 kernel, on widened (out, in) and (T, in) f32 rows, that `float_matmul` runs."""
    exact = ggml_type != GGMLType.F32  # products of two f16 or two bf16 values are exact in f32
    if ggml_type == GGMLType.BF16 and isa == "avx512":  # AVX512_BF16: `dpbf16`, 32 bf16 at a time
        return _tinyblas_bf16_kernel if tinyblas else _vec_dot_bf16_kernel
    if ggml_type == GGMLType.BF16 and not tinyblas:
        return _vec_dot_bf16_avx2_kernel
    if tinyblas:
        return lambda W, A: _tinyblas_kernel(W, A, exact, isa)
    return lambda W, A: _vec_dot_kernel(W, A, exact, isa)


def float_matmul(w: np.ndarray, a: np.ndarray, ggml_type: GGMLType, isa: str = "avx512") -> np.ndarray:
    """The F32 / F16 / BF16 mul_mat on the `isa` build (`simd.ISAS`): tinyBLAS when `llamafile_sgemm` accepts
    (T >= 2; `tinyBLAS::matmul`: in % KN == 0 and out % 4 == 0, KN = 16, or 32 for BF16, on AVX-512; KN = 8 on
    AVX2), else vec_dot per (activation, weight) pair."""
    if ggml_type not in _FLOAT_TYPES:
        raise ValueError(f"{GGMLType(ggml_type).name} is not a float type")
    w = _element_rows(w, ggml_type)
    A = _widen(_element_rows(a, ggml_type), ggml_type)
    T, n = A.shape
    out = w.shape[0]
    if w.shape[1] != n:
        raise ValueError(f"weight rows hold {w.shape[1]} elements, activation rows {n}")
    kn = 32 if ggml_type == GGMLType.BF16 and isa == "avx512" else _LANES[isa]
    kernel = _kernel(ggml_type, isa, tinyblas=T >= 2 and n % kn == 0 and out % 4 == 0)
    y = np.empty((T, out), np.float32)
    step = rows_per_chunk(8 * max(64 * T, n))  # the (4, 16, T) float64 buffers of vec_dot, or one weight row
    for lo in range(0, out, step):
        y[:, lo : lo + step] = kernel(_widen(w[lo : lo + step], ggml_type), A)
    return y


def matmul_f32(w: np.ndarray, a: np.ndarray, isa: str = "avx512") -> np.ndarray:
    """w: F32 weight rows f32 (out, in) (or their bytes u8 (out, 4*in)); a: the f32 activation rows (T, in).
    Returns y f32 (T, out) as llama.cpp computes it: `tinyBLAS<16, __m512, __m512, float, float, float>`
    (the driver's first `llamafile_sgemm` call) when T >= 2, in % 16 == 0 and out % 4 == 0, otherwise
    `ggml_vec_dot_f32` for each (activation row, weight row)."""
    return float_matmul(w, a, GGMLType.F32, isa)


def matmul_f16(w: np.ndarray, a: np.ndarray, isa: str = "avx512") -> np.ndarray:
    """w: F16 weight rows (out, in) as float16 values, u16 bits or bytes u8 (out, 2*in); a: the activation rows
    converted to f16 (T, in), same encodings (`float_activations(x, GGMLType.F16)`). Returns y f32 (T, out):
    `tinyBLAS<16, __m512, __m512, ggml_fp16_t, ggml_fp16_t, float>` (the driver's second `llamafile_sgemm`
    call, after converting the activations) when T >= 2, in % 16 == 0 and out % 4 == 0, otherwise
    `ggml_vec_dot_f16`."""
    return float_matmul(w, a, GGMLType.F16, isa)


def matmul_bf16(w: np.ndarray, a: np.ndarray, isa: str = "avx512") -> np.ndarray:
    """w: BF16 weight rows (out, in) as u16 bits or bytes u8 (out, 2*in); a: the activation rows converted to
    bf16, u16 bits (T, in) (`float_activations(x, GGMLType.BF16)`). Returns y f32 (T, out):
    `tinyBLAS<32, __m512, __m512bh, ggml_bf16_t, ggml_bf16_t, float>` when T >= 2, in % 32 == 0 and
    out % 4 == 0, otherwise `ggml_vec_dot_bf16`."""
    return float_matmul(w, a, GGMLType.BF16, isa)


KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    GGMLType.F32: matmul_f32,
    GGMLType.F16: matmul_f16,
    GGMLType.BF16: matmul_bf16,
}
