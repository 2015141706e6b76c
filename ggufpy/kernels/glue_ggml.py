"""numba versions of the `llamacpp` numerics' per-token glue: RoPE, SiLU and the f16 rounding, with ggml's roundings.

Same contracts as the NumPy functions of the numerics record (`ggufpy.numerics`):

    rope_ggml(x, cos, sin, style)      == numerics.rope_ggml, bit for bit (the FMA-contracted rotation)
    silu_rows(x)                       == quants.x86.unary.silu_rows (AVX-512 build), bit for bit
    round_f16(x), v_expf(x)            the f16 conversion (F16C) and ggml_v_expf's AVX-512 lane

The NumPy versions emulate f32 FMAs in float64 (`quants.x86.simd.fma`) and cost tens to hundreds of
microseconds per call; here each is one compiled call (`_numba.fma_f32` is LLVM's exact `llvm.fma.f32`).
Everything compiles without fastmath: a contracted `a*b + c` or a reassociated `(q + 0x1.8p23) - 0x1.8p23`
would change results. The attention of the llamacpp numerics, compiled, is `kernels.x86`.
"""

from __future__ import annotations

import math

import numpy as np

from ._numba import DISABLED, fma_f32, jit

__all__ = ["cos_sin", "expf_array", "rope_ggml", "round_f16", "round_f16_array", "silu_rows", "v_expf"]

_f32 = np.float32

# -- f32 -> f16 -> f32 -------------------------------------------------------------------------------------------


@jit
def round_f16(x):
    """The f32 `x` rounded to the nearest f16 value (ties to even), returned as f32: NumPy's
    `astype(np.float16)` / F16C `vcvtps2ph`. f16 subnormals are kept, |x| >= 65520 gives inf, NaN stays NaN."""
    u = np.int64(np.float32(x).view(np.uint32))
    sign = u & 0x80000000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN: quiet
        r = a | 0x00400000
    elif a >= 0x38800000:  # |x| >= 2^-14: 10 mantissa bits, round half to even on bit 13
        r = (a + 0xFFF + ((a >> 13) & 1)) & 0x7FFFE000  # a carry into the exponent is right
        if r >= 0x47800000:  # 65536 or more (and inf)
            r = 0x7F800000
    elif a <= 0x33000000:  # |x| <= 2^-25: 0 (2^-25 itself is a tie, to even)
        r = 0
    else:  # an f16 subnormal: a multiple q of 2^-24, q = |x| / 2^-24 rounded half to even (0 < q <= 1024)
        e = a >> 23  # 102..112
        sig = (a & 0x007FFFFF) | 0x00800000  # |x| = sig * 2^(e - 150)
        shift = 126 - e  # 14..24
        q = sig >> shift
        rem = sig & ((np.int64(1) << shift) - 1)
        half = np.int64(1) << (shift - 1)
        if rem > half or (rem == half and (q & 1) == 1):
            q += 1
        r = np.int64(np.float32(np.float32(q) * np.float32(2.0**-24)).view(np.uint32))  # exact
    return np.uint32(r | sign).view(np.float32)


@jit
def _round_f16_array(x, out):
    for i in range(x.size):
        out[i] = round_f16(x[i])


def round_f16_array(x: np.ndarray) -> np.ndarray:
    """`round_f16` elementwise: f32 -> nearest-even f16 -> f32 (`quants.vecdot.round_f16`)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _round_f16_array(x.reshape(-1), out.reshape(-1))
    return out


# -- RoPE ----------------------------------------------------------------------------------------------------------


@jit
def _rope(x, cos, sin, neox, out):
    T, heads, E = x.shape
    half = cos.shape[1]
    for t in range(T):
        for h in range(heads):
            for e in range(2 * half, E):  # dims past the rotated ones are copied
                out[t, h, e] = x[t, h, e]
            for i in range(half):
                i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
                x0 = x[t, h, i0]
                x1 = x[t, h, i1]
                c = cos[t, i]
                s = sin[t, i]
                out[t, h, i0] = fma_f32(x0, c, -(x1 * s))
                out[t, h, i1] = fma_f32(x0, s, x1 * c)


def rope_ggml(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """`numerics.rope_ggml`: fma(x0, cos, -(x1*sin)), fma(x0, sin, x1*cos) on the first R dims of every head.
    x: (T, heads, E); cos, sin: (T, R/2) (or (1, R/2), broadcast over T)."""
    x = np.ascontiguousarray(x, np.float32)
    cos = np.ascontiguousarray(cos, np.float32)
    sin = np.ascontiguousarray(sin, np.float32)
    if cos.shape[0] != x.shape[0]:
        cos = np.ascontiguousarray(np.broadcast_to(cos, (x.shape[0], cos.shape[1])))
        sin = np.ascontiguousarray(np.broadcast_to(sin, (x.shape[0], sin.shape[1])))
    out = np.empty_like(x)
    _rope(x, cos, sin, style != "norm", out)
    return out


# -- ggml_v_expf and SiLU --------------------------------------------------------------------------------------------

# vec.h ggml_v_expf (AVX-512 branch), as `quants.x86.unary.v_expf_512`
_EXP_SHIFT = _f32(float.fromhex("0x1.8p23"))
_LOG2E = _f32(float.fromhex("0x1.715476p+0"))
_LN2_HI = _f32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = _f32(float.fromhex("0x1.7f7d1cp-20"))
_C1 = _f32(float.fromhex("0x1.ffffecp-1"))
_C2 = _f32(float.fromhex("0x1.fffdb6p-2"))
_C3 = _f32(float.fromhex("0x1.555e66p-3"))
_C4 = _f32(float.fromhex("0x1.573e2ep-5"))
_C5 = _f32(float.fromhex("0x1.0e4020p-7"))
_F32_MAX = _f32(np.finfo(np.float32).max)


@jit(inline=True)
def _pow2(n):
    """2^n as float64 for an integer-valued float32 |n| <= 192 (exact)."""
    return np.int64((np.int64(n) + 1023) << 52).view(np.float64)


@jit(inline=True)
def v_expf(x):
    """ggml_v_expf on one lane: n = round(x / ln 2), b = x - n ln 2 in two FMAs, a degree-5 polynomial j(b)
    in FMAs, then j * 2^n rounded once (`_mm512_scalef_ps`); 0 or inf where |n| > 192; NaN stays NaN."""
    if not abs(x) <= _F32_MAX:  # inf or NaN
        if x != x:
            return x
        return np.float32(0.0) if x < 0 else np.float32(np.inf)
    z = fma_f32(x, _LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = fma_f32(-n, _LN2_LO, fma_f32(-n, _LN2_HI, x))
    u = b * b
    j = fma_f32(fma_f32(fma_f32(_C5, b, _C4), u, fma_f32(_C3, b, _C2)), u, fma_f32(_C1, b, np.float32(1.0)))
    if abs(n) > 192:
        return np.float32(0.0) if n <= 0 else np.float32(np.inf)
    return np.float32(np.float64(j) * _pow2(n))  # exact product, one rounding (also into subnormals)


if DISABLED:

    def _libm_expf(x):
        """The C library's expf (plain Python: `math.exp` would be the double exp)."""
        from ..quants.x86.unary import _libm_expf as libm

        f = libm()
        return np.float32(f(float(x)) if f is not None else np.exp(np.float64(x)))

else:

    @jit(inline=True)
    def _libm_expf(x):
        """The C library's expf: numba lowers math.exp of a float32 to `llvm.exp.f32`, a call to expf."""
        return math.exp(np.float32(x))


@jit
def _expf_flat(x, out):
    for i in range(x.size):
        out[i] = _libm_expf(x[i])


@jit
def _cos_sin_flat(x, cos, sin):
    for i in range(x.size):  # math.cos/sin of a float32: `llvm.cos.f32`, a call to the C library's cosf (sinf)
        cos[i] = math.cos(np.float32(x[i]))
        sin[i] = math.sin(np.float32(x[i]))


def cos_sin(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`numerics.rope_angles_ggml`'s cosf and sinf of every element, compiled (f32 in, f32 out): ~64 ctypes
    calls per token and layer kind before (0.2-0.3 ms a token)."""
    x = np.ascontiguousarray(x, np.float32)
    cos, sin = np.empty_like(x), np.empty_like(x)
    _cos_sin_flat(x.reshape(-1), cos.reshape(-1), sin.reshape(-1))
    return cos, sin


def expf_array(x: np.ndarray) -> np.ndarray:
    """`numerics.libm_expf`, compiled: the C library's expf of every element (f32 in, f32 out)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _expf_flat(x.reshape(-1), out.reshape(-1))
    return out


@jit
def _silu_rows(x, out):
    rows, n = x.shape
    body = n - n % 16
    one = np.float32(1.0)
    for r in range(rows):
        for i in range(body):  # ggml_v_silu, 16 lanes at a time in ggml
            v = x[r, i]
            out[r, i] = v / (one + v_expf(np.float32(0.0) - v))
        for i in range(body, n):  # the scalar tail: ggml_silu_f32 with expf
            v = x[r, i]
            out[r, i] = v / (one + _libm_expf(-v))


def silu_rows(x: np.ndarray) -> np.ndarray:
    """`quants.x86.unary.silu_rows`: SiLU of f32 rows (..., n) as ggml_vec_swiglu_f32 computes each row."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    x2 = x.reshape(-1, n) if x.ndim != 2 else x  # a 2-D view (strided: decode's gate slice) is used as is
    out = np.empty(x2.shape, np.float32)
    _silu_rows(x2, out)
    return out.reshape(x.shape)
