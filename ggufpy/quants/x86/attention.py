"""Bit-exact NumPy emulation of llama.cpp's attention without flash attention, on this x86 AVX-512 build.

What llama.cpp runs (src/llama-graph.cpp `build_attn_mha`, flash attention off, f16 KV cache in the `v_trans`
layout, the whole prompt in one ubatch), per query head h of KV group g = h // (H/G):

    kq   = mul_mat(K_g, fp16(Q_h))          K_g: (n_kv, E) f16 cache rows; Q rounded to f16, the vec_dot type
                                            of F16 (ggml-cpu.c `ggml_compute_forward_mul_mat`: Q's permuted view
                                            is not contiguous, so the f32 tinyBLAS call is skipped)
    kq   = cap * tanhf(kq * (1/cap))        gemma2 only: ggml_scale, ggml_tanh (libm `tanhf`), ggml_scale
    p    = soft_max_ext(kq, mask, scale)    ops.cpp `ggml_compute_forward_soft_max_f32`, max_bias 0
    kqv  = mul_mat(V_g^T, fp16(p))          V_g^T: (E, n_kv) f16 rows of the transposed V cache

Both products are F16 mul_mats: `llamafile.matmul_f16` (tinyBLAS<16, __m512> when T >= 2, the inner size is a
multiple of 16 and the output one of 4, else `ggml_vec_dot_f16`). The cache is padded: llama-kv-cache.cpp
`get_n_kv` gives n_kv = min(cache size, max(256, GGML_PAD(used cells, 256))); the cells past the S used ones
hold zeros in a fresh cache and are masked with -inf. n_kv decides which F16 kernel runs and how the softmax
sums, so K and V are zero-padded to n_kv before the products, and every output is computed over n_kv columns.

soft_max_ext, per row of n_kv scores (ops.cpp `ggml_compute_forward_soft_max_f32`):

    w    = kq * scale                      `ggml_vec_scale_f32`, f32 multiply
    w    = w + mask                        mask 0 or -inf (slope 1: the `slope*mask` FMA is the same add)
    m    = max(w)                          `ggml_vec_max_f32`, scalar loop (order-free)
    e    = ggml_v_expf(w - m)              vec.h, `__AVX512F__ && __AVX512DQ__` branch (below)
    sum  = sum over 16-blocks i, in order, of (double) _mm512_reduce_add_ps(e[16i : 16i+16])   (vec.cpp
           `ggml_vec_soft_max_f32`; a scalar tail with libm `expf` for n % 16, never reached here: n_kv % 256 == 0)
    p    = e * (float)(1.0 / sum)          double division, rounded to f32 for `ggml_vec_scale_f32`

`ggml_v_expf` (ARM optimized-routines exp, 16 lanes, `_mm512_fmadd_ps` / `_mm512_fnmadd_ps` are single-rounding
FMAs):

    z = fma(x, 0x1.715476p+0, 0x1.8p23);  n = z - 0x1.8p23               n = round(x / ln 2)
    b = fma(-n, 0x1.7f7d1cp-20, fma(-n, 0x1.62e4p-1, x))                 x - n ln 2 in two steps
    u = b * b
    j = fma(fma(fma(c5, b, c4), u, fma(c3, b, c2)), u, fma(c1, b, 1))    degree-5 polynomial
    e = scalef(j, n) = j * 2^n rounded once;  where |n| > 192: 0 if n <= 0, else +inf

tanhf is glibc 2.36's (the libm this llama.cpp links; sysdeps/ieee754/flt-32/s_tanhf.c and s_expm1f.c, the
fdlibm float code, compiled for baseline x86-64: plain f32 operations, no FMA), replayed in `tanhf_glibc`.
glibc 2.41 replaced it with a correctly rounded tanhf: on such a system llama.cpp's softcap would differ.
"""

from __future__ import annotations

import numpy as np

from .llamafile import matmul_f16
from .simd import fma, reduce_add_ps_512

__all__ = [
    "KV_PAD",
    "attention",
    "attention_parts",
    "n_kv_cells",
    "soft_max_ext",
    "tanhf_glibc",
    "v_expf_512",
    "vec_soft_max_f32",
]

KV_PAD = 256  # llama-kv-cache.cpp `get_n_kv`: n_pad_cur = max(n_pad, 256)

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
    z = fma(xs, _LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, xs))  # _mm512_fnmadd_ps(a, b, c) = -(a*b) + c, one rounding
    u = b * b
    j = fma(fma(fma(_C5, b, _C4), u, fma(_C3, b, _C2)), u, fma(_C1, b, _f32(1)))
    # _mm512_scalef_ps(j, n) = j * 2^floor(n), rounded once (n is an integer here). j * 2^n is exact in float64
    # for |n| <= 192 (j has 24 bits; 2^-192 is far above float64's subnormals), so the cast is the one rounding,
    # also into the f32 subnormal range.
    big = np.abs(n) > 192
    with np.errstate(over="ignore"):
        res = (j.astype(np.float64) * np.exp2(np.where(big, 0, n).astype(np.float64))).astype(_f32)
    nn = np.where(finite, n, x)  # n of a non-finite lane: -inf for -inf, +inf for +inf (NaN stays NaN below)
    alt = np.where(nn <= 0, _f32(0), _f32(np.inf))
    out = np.where(big | ~finite, alt, res)
    return np.where(np.isnan(x), x, out)


# -- soft_max_ext (ggml-cpu/ops.cpp ggml_compute_forward_soft_max_f32) ----------------------------------------------


def vec_soft_max_f32(x: np.ndarray, mx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vec.cpp `ggml_vec_soft_max_f32(n, y, x, max)` on rows (..., n) f32 with their max (...,) or (..., 1):
    returns (y f32 (..., n), sum float64 (...,)).

    `__AVX512F__ && __AVX512DQ__` branch: for each block of 16, y = ggml_v_expf(x - max) and
    `sum += (ggml_float)_mm512_reduce_add_ps(y)`, block after block; then the scalar tail for n % 16,
    `y = expf(x - max)` (libm), `sum += (ggml_float)y`. The tail is replayed with a correctly rounded exp, not
    glibc's expf (not always correctly rounded): not verified bit for bit, and never reached by `attention`,
    whose rows hold n_kv cells, a multiple of 256."""
    x = np.asarray(x, _f32)
    mx = np.asarray(mx, _f32).reshape(*x.shape[:-1], 1)
    n = x.shape[-1]
    main = n - n % 16
    y = np.empty_like(x)
    total = np.zeros(x.shape[:-1], np.float64)
    if main:
        y[..., :main] = v_expf_512(x[..., :main] - mx)  # _mm512_sub_ps, then ggml_v_expf
        blocks = reduce_add_ps_512(y[..., :main].reshape(*x.shape[:-1], main // 16, 16))  # (..., n/16) f32
        for i in range(main // 16):  # in block order: the double sum is not associative
            total += blocks[..., i]
    for i in range(main, n):
        y[..., i] = np.exp((x[..., i] - mx[..., 0]).astype(np.float64)).astype(_f32)
        total += y[..., i]
    return y, total


def soft_max_ext(kq: np.ndarray, mask: np.ndarray | None, scale: float) -> np.ndarray:
    """`ggml_soft_max_ext(kq, mask, scale, max_bias=0)` over the last axis: kq f32 (..., n); mask (..., n)
    broadcastable, 0 or -inf (f16 or f32 in ggml: the same values), or None. Returns f32 (..., n).

    w = kq * scale; w += mask; (e, sum) = `vec_soft_max_f32(w, max(w))`; p = e * (float)(1.0 / sum)."""
    w = np.asarray(kq, _f32) * _f32(scale)  # ggml_vec_scale_f32: one f32 multiply per element
    if mask is not None:
        w = w + np.asarray(mask, _f32)  # wp[i] += slope*mask[i], slope = 1.0f: an exact add of 0 or -inf
    e, total = vec_soft_max_f32(w, w.max(axis=-1))  # ggml_vec_max_f32: a max, in any order
    with np.errstate(divide="ignore"):
        inv = (1.0 / total).astype(_f32)  # `sum = 1.0/sum` in double, passed to ggml_vec_scale_f32 as a float
    return e * inv[..., None]


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


# -- attention --------------------------------------------------------------------------------------------------


def n_kv_cells(S: int, cache_size: int | None = None) -> int:
    """llama-kv-cache.cpp `get_n_kv` for a cache filled from cell 0 with S positions: the number of cells the
    attention reads, max(256, GGML_PAD(S, 256)), at most the cache size."""
    n = max(KV_PAD, -(-S // KV_PAD) * KV_PAD)
    return n if cache_size is None else min(cache_size, n)


def _mask(start: int, T: int, S: int, n_kv: int, window: int | None) -> np.ndarray:
    """kq_mask (T, n_kv): 0 where query t (position start + t) sees cell j, -inf elsewhere: future positions,
    cells past the S filled ones, and with `window` keys at distance >= window (llama-hparams.cpp
    `is_masked_swa`, LLAMA_SWA_TYPE_STANDARD: p1 - p0 >= n_swa)."""
    distance = (start + np.arange(T))[:, None] - np.arange(n_kv)[None, :]
    masked = (distance < 0) | (np.arange(n_kv) >= S)[None, :]
    if window is not None:
        masked |= distance >= window
    return np.where(masked, _f32(-np.inf), _f32(0))


def _f16_rows(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, _f32).astype(np.float16)  # ggml_cpu_fp32_to_fp16: nearest even


def attention_parts(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    n_kv: int | None = None,
) -> dict[str, np.ndarray]:
    """`attention` with its intermediate tensors, named as llama.cpp's graph nodes: kq (H, T, n_kv) (after the
    softcap, if any: llama.cpp's `kq_scaled_2`), kq_soft_max (H, T, n_kv) f32, kqv_out (T, H*E) f32.
    `n_kv` overrides the padded cache length (default `n_kv_cells(S)`)."""
    T, H, E = q.shape
    S, G, _ = k.shape
    if v.shape != k.shape or H % G:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: need k, v (S, G, E) with G dividing H")
    if S < start + T:
        raise ValueError(f"{S} cached positions cannot hold queries at positions {start}..{start + T - 1}")
    n_kv = n_kv_cells(S) if n_kv is None else n_kv
    if n_kv < S:
        raise ValueError(f"n_kv = {n_kv} cells cannot hold {S} positions")
    r = H // G
    k16 = np.zeros((G, n_kv, E), np.float16)  # the K cache view per group: n_kv rows of E (zeros past S)
    k16[:, :S] = _f16_rows(k).transpose(1, 0, 2)
    vt16 = np.zeros((G, E, n_kv), np.float16)  # the transposed V cache view per group: E rows of n_kv
    vt16[:, :, :S] = _f16_rows(v).transpose(1, 2, 0)
    q16 = _f16_rows(q)  # (T, H, E): mul_mat converts the f32 queries to F16's vec_dot type

    kq = np.empty((H, T, n_kv), _f32)
    for g in range(G):
        heads = slice(g * r, (g + 1) * r)  # ggml_mul_mat broadcast: query head h reads K group h / (H/G)
        if T >= 2:  # tinyBLAS' choice depends on T only through T >= 2: the group's heads can share one call
            a = q16[:, heads].transpose(1, 0, 2).reshape(r * T, E)
            kq[heads] = matmul_f16(k16[g], a).reshape(r, T, n_kv)
        else:
            for h in range(g * r, (g + 1) * r):
                kq[h] = matmul_f16(k16[g], q16[:, h])
    if softcap:
        cap = _f32(softcap)
        kq = kq * (_f32(1) / cap)  # ggml_scale(kq, 1.0f / cap): the reciprocal in f32, then f32 multiplies
        kq = tanhf_glibc(kq)  # ggml_tanh: `tanhf` per element
        kq = kq * cap  # ggml_scale(kq, cap)

    mask = _mask(start, T, S, n_kv, window)  # (T, n_kv), shared by every head
    probs = np.empty((H, T, n_kv), _f32)
    for h in range(H):  # one head at a time bounds the float64 temporaries of the FMAs
        probs[h] = soft_max_ext(kq[h], mask, scale)

    p16 = probs.astype(np.float16)  # mul_mat converts kq_soft_max to f16 (exact range: 0 <= p <= 1)
    out = np.empty((T, H, E), _f32)
    for g in range(G):
        heads = slice(g * r, (g + 1) * r)
        if T >= 2:
            out[:, heads] = matmul_f16(vt16[g], p16[heads].reshape(r * T, n_kv)).reshape(r, T, E).transpose(1, 0, 2)
        else:
            for h in range(g * r, (g + 1) * r):
                out[:, h] = matmul_f16(vt16[g], p16[h])
    return {"kq": kq, "kq_soft_max": probs, "kqv_out": out.reshape(T, H * E)}


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """llama.cpp's non-flash attention on x86, bit for bit (`numerics.attention_ggml`'s contract): q (T, H, E)
    f32 queries at positions start..start+T-1 (after RoPE, and for gemma after the f32 Q scaling); k, v
    (S, G, E) the keys and values of positions 0..S-1 (rounded to f16 here, as the cache stores them);
    `scale` the soft_max scale (llama.cpp's `kq_scale`, used as an f32); `window` the sliding window;
    `softcap` gemma2's attention logit softcap. Returns kqv_out (T, H*E) f32.

    Assumes the cache holds exactly positions 0..S-1 in cells 0..S-1 (a prompt, then single-token steps, no
    more than the cache size), so that n_kv = max(256, GGML_PAD(S, 256))."""
    return attention_parts(q, k, v, start, scale, window, softcap)["kqv_out"]
