"""Activation terms for the matvec kernels, and ggml's activation quantizers (Q8_0, Q8_1, Q8_K).

A kernel computes, for each row r and sub-block s of `S` elements (see `layout.py` for A, B, zo),

    y[r] = sum_s (A[r,s] * ad[s]) * (sum_k xv[k] * v[k,r] + zo * xs[s]) + B[r,s] * am[s]

so the activations enter only through `xv` (one value per element) and three numbers per sub-block:

    exact   xv = x                 xs = sum x    ad = 1      am = sum x
    Q8_0    xv = q (int8 values)   xs = sum q    ad = fp16(d)               (Q4_0, Q5_0, Q8_0, IQ4_NL weights)
    Q8_1    as Q8_0, and                                      am = fp16(d * sum q)   (Q4_1, Q5_1: ggml's `s`)
    Q8_K    xv = q                 xs = sum q    ad = d (f32) am = d * sum q         (k-quants, IQ4_XS)

In the quantized modes every partial sum `sum_k xv[k] * v[k,r]` is an integer below 2^24, so the f32 kernels
compute ggml's integer block dots exactly (ggml-cpu/quants.c `ggml_vec_dot_*`); only the order in which the
scaled block results are added differs.

The quantizers follow ggml bit for bit and are tested against `ggufpy.quants.quantize`: Q8_0/Q8_1 in the
x86 form llama.cpp runs on AVX machines (`id = 127/amax`, round half to even; ggml-cpu/arch/x86/quants.c
`quantize_row_q8_0`) or in the reference form (`id = 1/d`, `roundf`); Q8_K always in the reference form,
which x86 also uses.
"""

from __future__ import annotations

import numpy as np

from ._numba import jit

__all__ = [
    "EXACT",
    "Q8_0",
    "Q8_1",
    "Q8_K",
    "f16_bits_to_f32",
    "f32_to_f16_bits",
    "prepare",
    "round_bf16",
    "round_f16",
]

EXACT, Q8_0, Q8_1, Q8_K = 0, 1, 2, 3  # activation modes; the last three are ggml vec_dot types


@jit(inline=True)
def f32_to_f16_bits(x):
    """IEEE binary16 bits of the f32 `x`, rounded to nearest even (F16C `_cvtss_sh`; NumPy's
    `npy_floatbits_to_halfbits`). NaN payloads are not preserved."""
    f = np.int64(np.float32(x).view(np.uint32))
    sign = (f >> 16) & 0x8000
    exp = f & 0x7F800000
    if exp >= 0x47800000:  # overflow, inf or NaN
        if exp == 0x7F800000 and (f & 0x007FFFFF) != 0:
            return sign | 0x7E00
        return sign | 0x7C00
    if exp <= 0x38000000:  # subnormal half or zero
        if exp < 0x33000000:
            return sign
        sig = 0x00800000 + (f & 0x007FFFFF)
        sig_shifted = sig >> (113 - (exp >> 23))
        if (sig_shifted & 0x3FFF) != 0x1000 or (f & 0x7FF) != 0:
            sig_shifted += 0x1000
        return sign | (sig_shifted >> 13)
    sig = f & 0x007FFFFF
    if (sig & 0x3FFF) != 0x1000:
        sig += 0x1000
    return sign + ((exp - 0x38000000) >> 13) + (sig >> 13)  # a carry into the exponent is correct


@jit(inline=True)
def f16_bits_to_f32(h):
    """The f32 value of binary16 bits `h` (exact)."""
    h = np.int64(h)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = np.float32(m) * np.float32(2.0**-24)
    elif e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(1024 + m) * np.float32(2.0 ** (e - 25))
    return -v if h & 0x8000 else v


@jit(inline=True)
def _f16(x):
    """x rounded to fp16 and back: what `GGML_CPU_FP16_TO_FP32(GGML_CPU_FP32_TO_FP16(x))` gives."""
    return f16_bits_to_f32(f32_to_f16_bits(x))


@jit
def round_f16(x, out):
    """Round every element of the f32 array x to fp16 (kept as f32), like ggml's F16 vec_dot_type."""
    xf, of = x.reshape(-1), out.reshape(-1)
    for i in range(xf.size):
        of[i] = _f16(xf[i])


@jit
def round_bf16(x, out):
    """Round every element to bf16 (`ggml_compute_fp32_to_bf16`: nearest even, NaN kept quiet)."""
    xf, of = x.reshape(-1), out.reshape(-1)
    for i in range(xf.size):
        u = np.int64(np.float32(xf[i]).view(np.uint32))
        if (u & 0x7FFFFFFF) > 0x7F800000:
            r = (u >> 16) | 64
        else:
            r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        of[i] = np.uint32((r & 0xFFFF) << 16).view(np.float32)


@jit(inline=True)
def _round_half_away(v):
    """C `roundf`: nearest integer, ties away from zero."""
    t = np.trunc(v)
    if abs(v - t) >= np.float32(0.5):
        t += np.float32(1.0) if v > 0 else np.float32(-1.0)
    return t


@jit
def _prepare_exact(x, S, xv, xs, ad, am):
    T, C = x.shape
    for t in range(T):
        for s in range(C // S):
            acc = 0.0
            for k in range(s * S, s * S + S):
                acc += x[t, k]
            xs[t, s] = acc
            am[t, s] = acc
            ad[t, s] = 1.0


@jit
def _prepare_q8_0(x, S, x86, with_s, xv, xs, ad, am):
    """Q8_0 (with_s=False) or Q8_1 (with_s=True) blocks of 32; the kernels' sub-blocks must be 32 too."""
    T, C = x.shape
    for t in range(T):
        for b in range(C // 32):
            o = 32 * b
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[t, o + j]))
            d = amax / np.float32(127.0)
            if x86:
                inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            else:
                inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            total = 0
            for j in range(32):
                v = x[t, o + j] * inv
                q = np.rint(v) if x86 else _round_half_away(v)
                xv[t, o + j] = q
                total += np.int64(q)
            xs[t, b] = np.float32(total)
            ad[t, b] = _f16(d)
            am[t, b] = _f16(d * np.float32(total)) if with_s else np.float32(0.0)


@jit
def _prepare_q8_k(x, S, xv, xs, ad, am):
    """Q8_K blocks of 256 (`quantize_row_q8_K_ref`), summarized per sub-block of S elements."""
    T, C = x.shape
    for t in range(T):
        for b in range(C // 256):
            o = 256 * b
            amax = np.float32(0.0)
            peak = np.float32(0.0)
            for j in range(256):
                ax = abs(x[t, o + j])
                if ax > amax:
                    amax = ax
                    peak = x[t, o + j]
            if amax == 0:
                d = np.float32(0.0)
                for j in range(256):
                    xv[t, o + j] = 0.0
            else:
                iscale = np.float32(-127.0) / peak
                d = np.float32(1.0) / iscale
                for j in range(256):
                    xv[t, o + j] = min(np.rint(iscale * x[t, o + j]), np.float32(127.0))
            for s in range(o // S, (o + 256) // S):
                total = np.float32(0.0)
                for k in range(s * S, s * S + S):
                    total += xv[t, k]
                xs[t, s] = total
                ad[t, s] = d
                am[t, s] = d * total


def prepare(x: np.ndarray, mode: int, S: int, x86: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The activation terms of f32 x (T, C) for sub-blocks of S: xv (T, C) and terms (3, T, C // S) holding
    xs, ad, am (see the module docstring)."""
    T, C = x.shape
    terms = np.empty((3, T, C // S), np.float32)
    xs, ad, am = terms[0], terms[1], terms[2]
    if mode == EXACT:
        _prepare_exact(x, S, x, xs, ad, am)
        return x, terms
    xv = np.empty((T, C), np.float32)
    if mode == Q8_K:
        _prepare_q8_k(x, S, xv, xs, ad, am)
    else:
        if S != 32:
            raise ValueError(f"Q8_0/Q8_1 activations come in blocks of 32, not sub-blocks of {S}")
        _prepare_q8_0(x, S, x86, mode == Q8_1, xv, xs, ad, am)
    return xv, terms
