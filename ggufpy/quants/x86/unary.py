"""ggml's elementwise functions on x86: its own SIMD exp (vec.h `ggml_v_expf`, the AVX-512 and the AVX2 branch),
the SiLU built on it (`ggml_v_silu`, as `ggml_vec_swiglu_f32` runs it), and glibc 2.36's tanhf (what `ggml_tanh`
calls), replayed in NumPy bit for bit.

`ggml_v_expf` (ARM optimized-routines exp, 16 lanes, `_mm512_fmadd_ps` / `_mm512_fnmadd_ps` are single-rounding
FMAs):

    z = fma(x, 0x1.715476p+0, 0x1.8p23);  n = z - 0x1.8p23               n = round(x / ln 2)
    b = fma(-n, 0x1.7f7d1cp-20, fma(-n, 0x1.62e4p-1, x))                 x - n ln 2 in two steps
    u = b * b
    j = fma(fma(fma(c5, b, c4), u, fma(c3, b, c2)), u, fma(c1, b, 1))    degree-5 polynomial
    e = scalef(j, n) = j * 2^n rounded once;  where |n| > 192: 0 if n <= 0, else +inf

The AVX2 branch (8 lanes) computes the same polynomial except its last term, `c1 * b` instead of
`fma(c1, b, 1)`, and scales by bit arithmetic instead of `scalef`:

    k = bits(bits(z) << 23 + bits(1.0f)) = 2^n;  e = fma(k, j, k)                  |n| <= 126
    s1, s2 = two powers of two splitting 2^n;  e = fma(s2, j, s2) * s1             126 < |n| <= 192
    e = s1 * s1 (0 or +inf)                                                        |n| > 192

tanhf is glibc 2.36's (the libm this llama.cpp links; sysdeps/ieee754/flt-32/s_tanhf.c and s_expm1f.c, the
fdlibm float code, compiled for baseline x86-64: plain f32 operations, no FMA). glibc 2.41 replaced it with a
correctly rounded tanhf: on such a system llama.cpp's results would differ.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import numpy as np

from .simd import fma

__all__ = ["V_EXPF", "silu_rows", "tanhf_glibc", "v_expf_256", "v_expf_512"]

_f32 = np.float32


# -- ggml_v_expf, AVX-512 branch (ggml-cpu/vec.h) ----------------------------------------------------------------

_EXP_SHIFT = _f32(float.fromhex("0x1.8p23"))  # adding it rounds to an integer (|x / ln 2| < 2^22)
_LOG2E = _f32(float.fromhex("0x1.715476p+0"))
_LN2_HI = _f32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = _f32(float.fromhex("0x1.7f7d1cp-20"))
_C1 = _f32(float.fromhex("0x1.ffffecp-1"))
_C2 = _f32(float.fromhex("0x1.fffdb6p-2"))
_C3 = _f32(float.fromhex("0x1.555e66p-3"))
_C4 = _f32(float.fromhex("0x1.573e2ep-5"))
_C5 = _f32(float.fromhex("0x1.0e4020p-7"))


def v_expf_512(x: np.ndarray) -> np.ndarray:
    """vec.h `ggml_v_expf(__m512)` elementwise on f32 (the lane function; every lane is independent).

    -inf (a masked score) gives n = -inf, |n| > 192, so 0, as in the C code (whose NaN intermediates are
    discarded by the final blend); here the non-finite lanes are computed on 0 and then replaced."""
    x = np.asarray(x, _f32)
    finite = np.isfinite(x)
    xs = np.where(finite, x, _f32(0))
    with np.errstate(over="ignore", invalid="ignore"):  # huge |x|: the lanes that overflow are blended away
        z = fma(xs, _LOG2E, _EXP_SHIFT)
        n = z - _EXP_SHIFT
        b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, xs))  # _mm512_fnmadd_ps(a, b, c) = -(a*b) + c, one rounding
        u = b * b
        j = fma(fma(fma(_C5, b, _C4), u, fma(_C3, b, _C2)), u, fma(_C1, b, _f32(1)))
        # _mm512_scalef_ps(j, n) = j * 2^floor(n), rounded once (n is an integer here). j * 2^n is exact in
        # float64 for |n| <= 192 (j has 24 bits; 2^-192 is far above float64's subnormals), so the cast is the
        # one rounding, also into the f32 subnormal range.
        big = np.abs(n) > 192
        res = (j.astype(np.float64) * np.exp2(np.where(big, 0, n).astype(np.float64))).astype(_f32)
    nn = np.where(finite, n, x)  # n of a non-finite lane: -inf for -inf, +inf for +inf (NaN stays NaN below)
    alt = np.where(nn <= 0, _f32(0), _f32(np.inf))
    out = np.where(big | ~finite, alt, res)
    return np.where(np.isnan(x), x, out)


# -- ggml_v_expf, AVX2 + FMA branch (ggml-cpu/vec.h) ---------------------------------------------------------------


def _u32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, _f32).view(np.uint32)


def v_expf_256(x: np.ndarray) -> np.ndarray:
    """vec.h `ggml_v_expf(__m256)` elementwise on f32 (every lane is independent: the branch on "any lane has
    |n| > 126" only skips a blend whose other lanes keep the fast value). Integer lanes wrap as in the C code."""
    x = np.asarray(x, _f32)
    with np.errstate(over="ignore", invalid="ignore"):
        z = fma(x, _LOG2E, _EXP_SHIFT)
        n = z - _EXP_SHIFT
        b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, x))  # _mm256_fnmadd_ps: -(a*b) + c, one rounding
        e = _u32(z) << np.uint32(23)  # _mm256_slli_epi32(castps_si256(z), 23)
        k = (e + _u32(_f32(1))).view(_f32)  # 2^n as bits
        an = np.abs(n)
        u = b * b
        j = fma(fma(fma(_C5, b, _C4), u, fma(_C3, b, _C2)), u, _C1 * b)
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0))
        s1 = (g + np.uint32(0x7F000000)).view(_f32)
        s2 = (e - g).view(_f32)
        out = np.where(an > 126, fma(s2, j, s2) * s1, fma(k, j, k))
        return np.where(an > 192, s1 * s1, out)


# ggml_v_expf by x86 build (`simd.ISAS`), and the vector width its loops step by.
V_EXPF = {"avx512": (v_expf_512, 16), "avx2": (v_expf_256, 8)}


# -- glibc 2.36 tanhf -------------------------------------------------------------------------------------------


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, _f32).view(np.int32)


def _from_bits(i: np.ndarray) -> np.ndarray:
    return np.asarray(i, np.int32).view(_f32)


def _expm1f_glibc(x: np.ndarray) -> np.ndarray:
    """glibc 2.36 sysdeps/ieee754/flt-32/s_expm1f.c `__expm1f` on finite f32 with |x| < 88 (all tanhf passes),
    every operation an f32 one in the C order. All branches are evaluated and selected with np.where."""
    x = np.asarray(x, _f32)
    one, half = _f32(1), _f32(0.5)
    hx = _bits(x) & 0x7FFFFFFF
    neg = x < 0  # xsb != 0 (x is never -0 here: tanhf returns early for 0)
    ln2_hi, ln2_lo, invln2 = _f32(6.9313812256e-01), _f32(9.0580006145e-06), _f32(1.4426950216e00)
    # argument reduction, |x| > 0.5 ln2
    near = hx < 0x3F851592  # |x| < 1.5 ln2: k = +-1
    kf = (invln2 * x + np.where(neg, -half, half)).astype(np.int32)  # C float -> int32 conversion truncates
    k = np.where(near, np.where(neg, -1, 1), kf).astype(np.int32)
    t = k.astype(_f32)
    hi = np.where(near, np.where(neg, x + ln2_hi, x - ln2_hi), x - t * ln2_hi)
    lo = np.where(near, np.where(neg, -ln2_lo, ln2_lo), t * ln2_lo)
    reduce = hx > 0x3EB17218
    xr = np.where(reduce, hi - lo, x)
    c = np.where(reduce, (hi - xr) - lo, _f32(0))
    k = np.where(reduce, k, 0)
    x = xr
    # x is now in the primary range
    hfx = half * x
    hxs = x * hfx
    q1, q2, q3, q4, q5 = (_f32(v) for v in (-3.3333335072e-02, 1.5873016091e-03, -7.9365076090e-05,
                                            4.0082177293e-06, -2.0109921195e-07))  # fmt: skip
    r1 = one + hxs * (q1 + hxs * (q2 + hxs * (q3 + hxs * (q4 + hxs * q5))))
    t = _f32(3) - r1 * hfx
    e = hxs * ((r1 - t) / (_f32(6) - x * t))
    res_k0 = x - (x * e - hxs)
    e = x * (e - c) - c
    e = e - hxs
    res_km1 = half * (x - e) - half
    res_k1 = np.where(x < _f32(-0.25), -_f32(2) * (e - (x + half)), one + _f32(2) * (x - e))
    shift = (k << 23).astype(np.int32)  # `SET_FLOAT_WORD(y, i + (k<<23))`: add k to y's exponent
    res_far = _from_bits(_bits(one - (e - x)) + shift) - one  # k <= -2 or k > 56
    kc = np.clip(k, 0, 31)
    t_small = _from_bits(np.int32(0x3F800000) - (np.int32(0x1000000) >> kc))  # 1 - 2^-k, 1 <= k < 23
    res_small = _from_bits(_bits(t_small - (e - x)) + shift)
    t_large = _from_bits((np.int32(0x7F) - np.clip(k, 0, 127)) << 23)  # 2^-k, 23 <= k <= 56
    res_large = _from_bits(_bits((x - (e + t_large)) + one) + shift)
    res = np.where(k == 0, res_k0, np.where(k == -1, res_km1, np.where(k == 1, res_k1, res_far)))
    res = np.where((k >= 2) & (k < 23), res_small, res)
    res = np.where((k >= 23) & (k <= 56), res_large, res)
    # |x| < 2^-25: x itself; x < -27 ln2: -1 (tiny - one rounds to -1.0f)
    res = np.where(hx < 0x33000000, x, res)
    return np.where(neg & (hx >= 0x4195B844), _f32(-1), res)


def tanhf_glibc(x: np.ndarray) -> np.ndarray:
    """glibc 2.36 `tanhf` (sysdeps/ieee754/flt-32/s_tanhf.c, fdlibm): for 2^-55 <= |x| < 22,
    |x| >= 1: 1 - 2/(expm1f(2|x|) + 2), else -t/(t + 2) with t = expm1f(-2|x|), sign restored; |x| >= 22:
    1 - 1e-30 = 1; tiny |x|: x * (1 + x) = x; +-inf: +-1; NaN: NaN. Every operation in f32."""
    x = np.asarray(x, _f32)
    ix = _bits(x) & 0x7FFFFFFF
    ax = np.abs(x)
    with np.errstate(all="ignore"):
        mid = (ix >= 0x24000000) & (ix < 0x41B00000)
        arg = np.where(ix >= 0x3F800000, _f32(2) * ax, -_f32(2) * ax)  # 2|x| exact
        t = _expm1f_glibc(np.where(mid, arg, _f32(1)))
        z = np.where(ix >= 0x3F800000, _f32(1) - _f32(2) / (t + _f32(2)), -t / (t + _f32(2)))
        z = np.where(ix >= 0x41B00000, _f32(1), z)  # |x| >= 22 (and inf: 1/x + 1 = 1)
        z = np.where(x < 0, -z, z)
        small = ix < 0x24000000  # x = +-0 returns x; 0 < |x| < 2^-55: x * (1 + x), 1 + x rounds to 1
        return np.where(small | np.isnan(x), x, z)


# -- SiLU (vec.cpp ggml_vec_swiglu_f32 / ggml_vec_silu_f32) ----------------------------------------------------


@functools.cache
def _libm_expf():
    name = ctypes.util.find_library("m")
    if not name:
        return None
    f = ctypes.CDLL(name).expf
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return f


def _silu_scalar(x: np.ndarray) -> np.ndarray:
    """vec.h `ggml_silu_f32`: x / (1.0f + expf(-x)) with the C library's expf (the loop tail)."""
    expf = _libm_expf()
    if expf is None:
        e = np.exp(-x.astype(np.float64)).astype(_f32)
    else:
        e = np.fromiter((expf(-v) for v in x.reshape(-1).tolist()), _f32, x.size).reshape(x.shape)
    return x / (_f32(1) + e)


def silu_rows(x: np.ndarray, isa: str = "avx512") -> np.ndarray:
    """SiLU of f32 rows (..., n) as `ggml_vec_swiglu_f32` / `ggml_vec_silu_f32` compute each row on the `isa`
    build: the first n - n % width values (width 16 on AVX-512, 8 on AVX2) by `ggml_v_silu`
    (x / (1 + ggml_v_expf(-x)), f32 add and division), the rest by the scalar `ggml_silu_f32`."""
    v_expf, width = V_EXPF[isa]
    x = np.asarray(x, _f32)
    n = x.shape[-1]
    body = n - n % width
    out = np.empty_like(x)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        xb = x[..., :body]
        out[..., :body] = xb / (_f32(1) + v_expf(_f32(0) - xb))
        if body < n:
            out[..., body:] = _silu_scalar(x[..., body:])
    return out
