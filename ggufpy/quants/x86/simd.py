"""Scalar emulation of the x86 SIMD float arithmetic ggml's CPU kernels use, on NumPy arrays.

ggml's f32 kernels keep partial sums in SIMD lanes and reduce them in a fixed tree; to reproduce their result bit
for bit, each lane's sequence of f32 roundings must be replayed in the same order. Arrays here hold lanes on the
last axis (or any axis, for `FmaAccumulator`); every function rounds to f32 exactly where the instruction does.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ISAS", "FmaAccumulator", "fma", "hadd_reduce_8", "hsum_float_8", "isa_of", "reduce_add_ps_512"]

# The x86 builds replayed: gcc `-march=native` on an AVX-512 (+ VNNI, BF16) CPU, where the conformance goldens
# were recorded, and on an AVX2 + FMA + F16C CPU (no AVX-512). They differ in vector width, hence lane order.
ISAS = ("avx512", "avx2")


def isa_of(system_info: str) -> str:
    """The build in `ISAS` that llama.cpp's `llama_print_system_info()` (as stored in the goldens) describes:
    "AVX512 = 1" for AVX-512, else "AVX2 = 1" for AVX2 (both need FMA)."""
    for isa, flag in (("avx512", "AVX512 = 1"), ("avx2", "AVX2 = 1")):
        if flag in system_info and "FMA = 1" in system_info:
            return isa
    raise ValueError(f"llama.cpp build {system_info!r}: no replay of its kernels; replayed: AVX512 or AVX2 with FMA")


_MID = np.uint64(1 << 28)  # float64 significand bits below an f32 significand: half an f32 ulp (normal range)
_LOW = np.uint64((1 << 29) - 1)
_F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)


def _round_to_odd(s: np.ndarray, p: np.ndarray, c: np.ndarray, idx: tuple) -> None:
    """s = p + c rounded in float64 (p, c float64-exact): make s[idx] rounded to odd instead, using the exact
    TwoSum error, so that the f32 rounding that follows equals one rounding of p + c (53 >= 24 + 2 bits)."""
    st, pt, ct = s[idx], p[idx], c[idx].astype(np.float64)
    bv = st - pt  # TwoSum: st + err == pt + ct exactly
    err = (pt - (st - bv)) + (ct - bv)
    even = (st.view(np.uint64) & np.uint64(1)) == 0
    s[idx] = np.where((err != 0) & even, np.nextafter(st, np.where(err > 0, np.inf, -np.inf)), st)


class FmaAccumulator:
    """acc = fma(a, b, acc) repeated on one f32 accumulator array (`_mm256_fmadd_ps` / `_mm512_fmadd_ps`:
    a*b + acc rounded once to f32), reusing float64 buffers. `a` and `b` broadcast to the accumulator's shape.

    a*b of two f32 values is exact in float64 (24 + 24 significant bits) and p + acc rounds at most once in
    float64. That rounding changes the f32 result only when it lands exactly on an f32 halfway point (in the
    f32-normal range: low 29 bits of the float64 significand = 1000...0), or when the result is f32-subnormal
    (halfway points sit elsewhere). Those few elements are redone rounding to odd.

    `subnormals=False` skips the subnormal test, for the quantized kernels: there one factor is d_w * d_a (a
    product of two fp16 or f32 scales) and the other an integer, and their sums never come near the
    f32-subnormal range (2^-126) unless the scales themselves do."""

    def __init__(self, shape: tuple[int, ...], subnormals: bool = True):
        self.acc = np.zeros(shape, np.float32)
        self.subnormals = subnormals
        self._p = np.empty(shape, np.float64)
        self._s = np.empty(shape, np.float64)
        self._bits = np.empty(shape, np.uint64)
        self._fix = np.empty(shape, bool)

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        p, s, acc = self._p, self._s, self.acc
        np.multiply(a, b, out=p, dtype=np.float64)  # exact
        np.add(p, acc, out=s)  # at most one float64 rounding
        np.bitwise_and(s.view(np.uint64), _LOW, out=self._bits)
        np.equal(self._bits, _MID, out=self._fix)
        if self.subnormals:
            self._fix |= np.abs(s) < _F32_MIN_NORMAL
        if self._fix.any():
            _round_to_odd(s, p, acc, np.nonzero(self._fix))
        acc[...] = s  # the one f32 rounding


def fma(a, b, c) -> np.ndarray:
    """`_mm256_fmadd_ps(a, b, c)` / `vfmadd231ss` elementwise on f32 arrays (broadcasting): a*b + c rounded
    once to f32."""
    a, b, c = (np.asarray(v, np.float32) for v in (a, b, c))
    shape = np.broadcast_shapes(a.shape, b.shape, c.shape)
    acc = FmaAccumulator(shape or (1,))  # np.nonzero needs at least one axis
    acc.acc[...] = c
    acc.add(a, b)
    return acc.acc.reshape(shape)


def hsum_float_8(x: np.ndarray) -> np.ndarray:
    """ggml-cpu/arch/x86/quants.c `hsum_float_8`: (..., 8) f32 -> (...,) f32.

    high 128 + low 128 -> r_i = x_{i+4} + x_i; then (r0 + r2) + (r1 + r3)."""
    x = np.asarray(x, np.float32)
    r = x[..., 4:] + x[..., :4]  # _mm_add_ps(extractf128(x, 1), castps256_ps128(x))
    r01 = r[..., :2] + r[..., 2:]  # _mm_add_ps(res, _mm_movehl_ps(res, res)), lanes 0 and 1
    return r01[..., 0] + r01[..., 1]  # _mm_add_ss(res, _mm_movehdup_ps(res))


def reduce_add_ps_512(x: np.ndarray) -> np.ndarray:
    """GCC's `_mm512_reduce_add_ps` (avx512fintrin.h `__MM512_REDUCE_OP`): (..., 16) f32 -> (...,) f32.

    upper 256 + lower 256, upper 128 + lower 128, then lanes {2,3} onto {0,1}, then lane 0 + lane 1."""
    x = np.asarray(x, np.float32)
    t3 = x[..., 8:] + x[..., :8]
    t6 = t3[..., 4:] + t3[..., :4]
    t8 = t6[..., :2] + t6[..., 2:]
    return t8[..., 0] + t8[..., 1]


def hadd_reduce_8(x: np.ndarray) -> np.ndarray:
    """The end of simd-mappings.h `GGML_F32x8_REDUCE` (AVX): (..., 8) f32 -> (...,) f32.

    t = low 128 + high 128; two `_mm_hadd_ps`: (t0 + t1) + (t2 + t3). (`hsum_float_8` pairs t0 with t2.)"""
    x = np.asarray(x, np.float32)
    t = x[..., :4] + x[..., 4:]  # _mm_add_ps(castps256_ps128(x), extractf128(x, 1))
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])
