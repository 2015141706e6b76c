"""numba versions of the `llamacpp` numerics' per-token glue: RoPE, SiLU and attention with ggml's roundings.

Same contracts as the NumPy functions of the numerics record (`ggufpy.numerics`):

    rope_ggml(x, cos, sin, style)      == numerics.rope_ggml, bit for bit (the FMA-contracted rotation)
    silu_rows(x)                       == quants.x86.unary.silu_rows, bit for bit (ggml_v_expf, libm expf tail)
    attention(q, k, v, start, scale)   ~= numerics.attention_ggml (the same rounding points; see below)

The NumPy versions emulate f32 FMAs in float64 (`quants.x86.simd.fma`) and cost tens to hundreds of
microseconds per call; here each is one compiled call (`_numba.fma_f32` is LLVM's exact `llvm.fma.f32`).

`attention` rounds where `attention_ggml` does: Q to f16, K and V as stored in the f16 cache, the scores
(sums of exact f16 x f16 products, in float64) once to f32, times the scale in f32, the softcap
cap * tanh(s / cap) in f32; the softmax's exp in f32, summed in float64, times (float)(1/sum); the
probabilities rounded to f16 and their products with V summed in float64. The exp and tanh are NumPy's own
float32 SIMD kernels replayed (`np_expf`, `np_tanhf`: equal to `np.exp` / `np.tanh` on every float32 on x86
with AVX2 or AVX-512), because a last-bit difference there can move a probability to the neighbouring f16
value. The float64 sums are exact for ordinary magnitudes (`attention_ggml` sums in another order), so the
result usually equals `attention_ggml` bit for bit. One parallel task per (query, head), as the exact-mode
kernel (`kernels.attention`).

The kernels that must be bit-exact compile without fastmath (a contracted `a*b + c` or a reassociated
`(q + 0x1.8p23) - 0x1.8p23` would change results); only the attention kernel allows reassociation, for its
float64 sums, and calls the strict `np_expf`, `np_tanhf` and `round_f16` as separately compiled functions.
"""

from __future__ import annotations

import math

import numpy as np

from ._numba import DISABLED, fma_f32, get_threads, half_to_float, jit, prange, use_threads

__all__ = ["attention", "np_expf", "np_tanhf", "rope_ggml", "round_f16", "round_f16_array", "silu_rows", "v_expf"]

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


# -- attention ------------------------------------------------------------------------------------------------------

# NumPy's float32 exp on x86 with AVX2+FMA3 or AVX-512F (umath/loops_exponent_log.dispatch.c.src
# `simd_exp_FLOAT`): Cody-Waite reduction, a rational minimax approximation, scalef.
_NP_XMAX = _f32(88.72283935546875)
_NP_XMIN = _f32(-103.97208404541015625)
_NP_MAGIC = _f32(float.fromhex("0x1.8p23"))
_NP_LOG2E = _f32(1.442695040888963407359924681001892137)
_NP_LN2_HI = _f32(-6.93145752e-1)
_NP_LN2_LO = _f32(-1.42860677e-6)
_NP_P0 = _f32(9.999999999980870924916e-01)
_NP_P1 = _f32(7.257664613233124478488e-01)
_NP_P2 = _f32(2.473615434895520810817e-01)
_NP_P3 = _f32(5.114512081637298353406e-02)
_NP_P4 = _f32(6.757896990527504603057e-03)
_NP_P5 = _f32(5.082762527590693718096e-04)
_NP_Q0 = _f32(1.0)
_NP_Q1 = _f32(-2.742335390411667452936e-01)
_NP_Q2 = _f32(2.159509375685829852307e-02)


@jit
def np_expf(x):
    """`np.exp` of a float32 as NumPy computes it on AVX2/AVX-512 x86 (bit for bit there; elsewhere NumPy
    calls the C library's expf and this differs in the last bit now and then)."""
    if x != x:
        return x
    if x >= _NP_XMAX:
        return np.float32(np.inf)
    if x <= _NP_XMIN:
        return np.float32(0.0)
    q = x * _NP_LOG2E
    q = (q + _NP_MAGIC) - _NP_MAGIC  # round to nearest integer
    y = fma_f32(q, _NP_LN2_HI, x)
    y = fma_f32(q, _NP_LN2_LO, y)
    num = fma_f32(_NP_P5, y, _NP_P4)
    num = fma_f32(num, y, _NP_P3)
    num = fma_f32(num, y, _NP_P2)
    num = fma_f32(num, y, _NP_P1)
    num = fma_f32(num, y, _NP_P0)
    den = fma_f32(fma_f32(_NP_Q2, y, _NP_Q1), y, _NP_Q0)
    return np.float32(np.float64(num / den) * _pow2(q))  # scalef: one rounding


@jit
def _np_expf_array(x, out):
    for i in range(x.size):
        out[i] = np_expf(x[i])


# NumPy's float32 tanh with native FMA (umath/loops_hyperbolic.dispatch.cpp.src `simd_tanh_f32`, from SVML):
# |x| falls in one of 32 intervals chosen by its exponent and top mantissa bits; on each, tanh = sign(x) *
# P(|x| - b) with a degree-6 polynomial in FMAs. Rows: b, c0, c1, ..., c6 (f32 bit patterns).
_NP_TANH_LUT = np.array(
    [
        [0x0,        0x3d700000, 0x3d900000, 0x3db00000, 0x3dd00000, 0x3df00000, 0x3e100000, 0x3e300000,
         0x3e500000, 0x3e700000, 0x3e900000, 0x3eb00000, 0x3ed00000, 0x3ef00000, 0x3f100000, 0x3f300000,
         0x3f500000, 0x3f700000, 0x3f900000, 0x3fb00000, 0x3fd00000, 0x3ff00000, 0x40100000, 0x40300000,
         0x40500000, 0x40700000, 0x40900000, 0x40b00000, 0x40d00000, 0x40f00000, 0x41100000, 0x0],
        [0x0,        0x3d6fb9c9, 0x3d8fc35f, 0x3daf9169, 0x3dcf49ab, 0x3deee849, 0x3e0f0ee8, 0x3e2e4984,
         0x3e4d2f8e, 0x3e6bb32e, 0x3e8c51cd, 0x3ea96163, 0x3ec543f1, 0x3edfd735, 0x3f028438, 0x3f18abf0,
         0x3f2bc480, 0x3f3bec1c, 0x3f4f2e5b, 0x3f613c53, 0x3f6ce37d, 0x3f743c4f, 0x3f7a5feb, 0x3f7dea85,
         0x3f7f3b3d, 0x3f7fb78c, 0x3f7fefd4, 0x3f7ffdd0, 0x3f7fffb4, 0x3f7ffff6, 0x3f7fffff, 0x3f800000],
        [0x3f800000, 0x3f7f1f84, 0x3f7ebd11, 0x3f7e1e5f, 0x3f7d609f, 0x3f7c842d, 0x3f7b00e5, 0x3f789580,
         0x3f75b8ad, 0x3f726fd9, 0x3f6cc59b, 0x3f63fb92, 0x3f59ff97, 0x3f4f11d7, 0x3f3d7573, 0x3f24f360,
         0x3f0cbfe7, 0x3eec1a69, 0x3eb0a801, 0x3e6753a2, 0x3e132f1a, 0x3db7e7d3, 0x3d320845, 0x3c84d3d4,
         0x3bc477b7, 0x3b10d3da, 0x3a01601e, 0x388c1a3b, 0x3717b0da, 0x35a43bce, 0x338306c6, 0x0],
        [0xb0343c7b, 0xbd6ee69d, 0xbd8f0da7, 0xbdae477d, 0xbdcd2a1f, 0xbdeba80d, 0xbe0c443b, 0xbe293cf3,
         0xbe44f282, 0xbe5f3651, 0xbe81c7c0, 0xbe96d7ca, 0xbea7fb8e, 0xbeb50e9e, 0xbec12efe, 0xbec4be92,
         0xbebce070, 0xbead510e, 0xbe8ef7d6, 0xbe4b8704, 0xbe083237, 0xbdaf7449, 0xbd2e1ec4, 0xbc83bf06,
         0xbbc3e0b5, 0xbb10aadc, 0xba0157db, 0xb88c18f2, 0xb717b096, 0xb5a43bae, 0xb383012c, 0x0],
        [0xbeaaaaa5, 0xbeab0612, 0xbea7f01f, 0xbea4e120, 0xbea387b7, 0xbea15962, 0xbe9d57f7, 0xbe976b5a,
         0xbe90230d, 0xbe880dff, 0xbe7479b3, 0xbe4c3d88, 0xbe212482, 0xbdeb8cba, 0xbd5e78ad, 0x3c6b5e6e,
         0x3d839143, 0x3dc21ee1, 0x3de347af, 0x3dcbec96, 0x3d99ef2d, 0x3d542ea1, 0x3cdde701, 0x3c2cca67,
         0x3b81cb27, 0x3ac073a1, 0x39ac3032, 0x383a94d9, 0x36ca081d, 0x355abd4c, 0x332b3cb6, 0x0],
        [0xb76dd6b9, 0xbe1c276d, 0x3c1dcf2f, 0x3dc1a78d, 0x3d96f985, 0x3da2b61b, 0x3dc13397, 0x3dd2f670,
         0x3df48a0a, 0x3e06c5a8, 0x3e1a3aba, 0x3e27c405, 0x3e2e78d0, 0x3e2c3e44, 0x3e1d3097, 0x3df4a8f4,
         0x3da38508, 0x3d31416a, 0x3b562657, 0xbcaeeac9, 0xbcce9419, 0xbcaaeac4, 0xbc49e7d0, 0xbba71ddd,
         0xbb003b0e, 0xba3f9a05, 0xb92c08a7, 0xb7ba9232, 0xb64a0b0f, 0xb4dac169, 0xb2ab78ac, 0x0],
        [0x3e0910e9, 0x43761143, 0x4165ecdc, 0xc190f756, 0xc08c097d, 0xc02ba813, 0xbf7f6bda, 0x3f2b1dc0,
         0x3ece105d, 0x3f426a94, 0xbadb0dc4, 0x3da43b17, 0xbd51ab88, 0xbcaea23d, 0xbd3b6d8d, 0xbd6caaad,
         0xbd795bed, 0xbd5fddda, 0xbd038f3b, 0xbc1cad63, 0x3abb4766, 0x3b95f10b, 0x3b825873, 0x3afaea66,
         0x3a49f878, 0x39996bf3, 0x388f3e6c, 0x371bb0e3, 0x35a8a5e6, 0x34369b17, 0x322487b0, 0x0],
        [0xbc0e2f66, 0x460bda12, 0x43d638ef, 0xc3e11c3e, 0xc2baa4e9, 0xc249da2d, 0xc1859b82, 0x40dd5b57,
         0x40494640, 0x40c730a8, 0xbf0f160e, 0x3e30e76f, 0xbea81387, 0xbdb26a1c, 0xbd351e57, 0xbb4c01a0,
         0x3c1d7bfb, 0x3c722cd1, 0x3c973f1c, 0x3c33a31b, 0x3b862ef4, 0x3a27b3d0, 0xba3b5907, 0xba0efc22,
         0xb97f9f0f, 0xb8c8af50, 0xb7bdddfb, 0xb64f2950, 0xb4e085b1, 0xb3731dfa, 0xb15a1f04, 0x0],
    ],
    np.uint32,
).view(np.float32)  # fmt: skip


@jit
def np_tanhf(x):
    """`np.tanh` of a float32 as NumPy computes it where its SIMD kernels have native FMA (x86 AVX2 and
    AVX-512 among them); elsewhere NumPy calls the C library's tanhf."""
    if x != x:
        return x
    u = np.int64(np.float32(x).view(np.uint32))
    top = u & 0x7FE00000
    if top > 0x7F000000:  # |x| >= 2^127 or inf
        r = np.float32(1.0)
    else:
        i = min(max(top - 0x3D400000, 0), 0x3E00000) >> 21
        y = abs(x) - _NP_TANH_LUT[0, i]
        r = fma_f32(_NP_TANH_LUT[7, i], y, _NP_TANH_LUT[6, i])
        r = fma_f32(r, y, _NP_TANH_LUT[5, i])
        r = fma_f32(r, y, _NP_TANH_LUT[4, i])
        r = fma_f32(r, y, _NP_TANH_LUT[3, i])
        r = fma_f32(r, y, _NP_TANH_LUT[2, i])
        r = fma_f32(r, y, _NP_TANH_LUT[1, i])
    return np.uint32(np.int64(np.float32(r).view(np.uint32)) | (u & 0x80000000)).view(np.float32)


@jit
def _np_tanhf_array(x, out):
    for i in range(x.size):
        out[i] = np_tanhf(x[i])


@jit
def _softcap(s, cap):
    """attention_ggml's softcap: cap * tanh(s / cap), all in f32."""
    return cap * np_tanhf(s / cap)


@jit(parallel=True)
def _attention(nt, q, k, v, start, scale, window, softcap, out):
    """q (T, H, E) f32; k, v (S, G, E) fp16 bits; out (T, H, E) f32."""
    previous = use_threads(nt)
    T, H, E = q.shape
    S, G, _ = k.shape
    per_group = H // G
    for i in prange(T * H):
        t = i // H
        h = i % H
        g = h // per_group
        pos = start + t
        lo = max(0, pos - window + 1) if window > 0 else 0  # keys lo..hi-1 are visible
        hi = min(S, pos + 1)
        if hi <= lo:  # every key masked: attention_ggml's softmax of -inf only
            for e in range(E):
                out[t, h, e] = np.nan
            continue
        q16 = np.empty(E, np.float32)
        for e in range(E):
            q16[e] = round_f16(q[t, h, e])
        scores = np.empty(hi - lo, np.float32)
        peak = np.float32(-np.inf)
        for s in range(lo, hi):
            acc = 0.0
            for e in range(E):
                acc += np.float64(q16[e] * half_to_float(k[s, g, e]))  # f16 x f16: exact in f32
            sc = np.float32(acc) * scale
            if softcap > 0:
                sc = _softcap(sc, softcap)
            scores[s - lo] = sc
            peak = max(peak, sc)
        total = 0.0
        for j in range(hi - lo):
            scores[j] = np_expf(scores[j] - peak)
            total += np.float64(scores[j])
        inv = np.float32(1.0 / total)
        acc_v = np.zeros(E, np.float64)
        for s in range(lo, hi):
            p = np.float64(round_f16(scores[s - lo] * inv))
            for e in range(E):
                acc_v[e] += p * np.float64(half_to_float(v[s, g, e]))
        for e in range(E):
            out[t, h, e] = np.float32(acc_v[e])
    use_threads(previous)


def _f16_bits(a: np.ndarray) -> np.ndarray:
    """K or V as contiguous fp16 bits: the f16 cache as is, anything else rounded to f16 (nearest even)."""
    if a.dtype != np.float16:
        with np.errstate(over="ignore"):
            a = np.asarray(a, np.float32).astype(np.float16)
    return np.ascontiguousarray(a).view(np.uint16)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    threads: int = 0,
) -> np.ndarray:
    """`numerics.attention_ggml` as a numba kernel: q (T, H, E) at positions start..start+T-1 over k, v
    (S, G, E) (the f16 cache, or f32 rounded to f16) -> (T, H*E) f32, on `threads` threads (0: numba's
    current count)."""
    T, H, E = q.shape
    out = np.empty((T, H, E), np.float32)
    _attention(
        threads or get_threads(),
        np.ascontiguousarray(q, np.float32),
        _f16_bits(k),
        _f16_bits(v),
        int(start),
        np.float32(scale),
        int(window or 0),
        np.float32(softcap or 0.0),
        out,
    )
    return out.reshape(T, H * E)
