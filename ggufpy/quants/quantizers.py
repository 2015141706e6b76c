"""Reference quantizers: f32[n_blocks, block_size] -> u8[n_blocks, type_size].

They follow `quantize_row_*_ref` in llama.cpp `ggml/src/ggml-quants.c` operation by operation, in f32,
without fused multiply-adds. Q4_0/Q4_1/Q5_0/Q5_1 truncate `x * id + 8.5` (or `+ 0.5`); a C build that
contracts this into an FMA could round differently when `x * id` is within an ulp of a half-integer
(gguf-py `quants.py`: "Q4_0's reference rounding is cursed and depends on FMA"). We implement the unfused
expression, as gguf-py does; the ggml build in llama-cpp-python agrees byte for byte (tests/test_quantize.py).
Q8_0/Q8_1 round with `roundf` (ties away from zero), Q8_K with `nearest_int` (ties to even).

`quantize_q8_0_x86` / `quantize_q8_1_x86` are the variants llama.cpp's CPU matmul actually runs on x86.
TQ1_0/TQ2_0 (`lroundf`, ties away from zero), MXFP4, NVFP4 and Q1_0 follow their `quantize_row_*_ref` too.
The k-quant and IQ weight quantizers (iterative scale searches) are not implemented.
"""

from __future__ import annotations

import numpy as np

from .fields import as_bytes
from .lowbit import KVALUES_MXFP4, UE4M3_HALF, e8m0_to_fp32_half

__all__ = [
    "fp32_to_ue4m3",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize_q1_0",
    "quantize_q4_0",
    "quantize_q4_1",
    "quantize_q5_0",
    "quantize_q5_1",
    "quantize_q8_0",
    "quantize_q8_0_x86",
    "quantize_q8_1",
    "quantize_q8_1_x86",
    "quantize_q8_K",
    "quantize_tq1_0",
    "quantize_tq2_0",
    "round_half_away",
]


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C `roundf`: nearest integer, ties away from zero (np.rint would round ties to even)."""
    t = np.trunc(v)
    frac = v - t  # exact in floating point
    return t + np.where(np.abs(frac) >= 0.5, np.sign(v), 0).astype(v.dtype)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude, keeping its sign; the first one on ties: f32[n, b] -> f32[n, 1]."""
    idx = np.argmax(np.abs(x), axis=1)[:, None]
    v = np.take_along_axis(x, idx, axis=1)
    # ggml starts from `max = 0.0f` and replaces it only on a larger magnitude: an all-zero block keeps +0.0
    # even when it holds -0.0 (then d = +0.0 / -levels = -0.0, as ggml stores it)
    return np.where(v == 0, np.float32(0), v)


def _inverse(d: np.ndarray) -> np.ndarray:
    """`id = d ? 1.0f/d : 0.0f` in f32."""
    return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """u8[n, 32] (values < 16) -> u8[n, 16]: element j in the low nibble of byte j, j+16 in the high one."""
    return q[:, :16] | (q[:, 16:] << 4)


def _pack_fifth_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of the 32 values -> the little-endian u32 `qh` as u8[n, 4] (bit j = element j)."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def _fp16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x.astype("<f2")


def _symmetric_scale(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0: d = max / -levels (max = signed absmax), id = 1/d."""
    d = _signed_absmax(x) / np.float32(-levels)
    return d, _inverse(d)


def _affine_scale(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1/Q5_1: min, d = (max - min) / levels, id = 1/d."""
    # the first occurrence, as ggml's strict `<`/`>` scan keeps it (-0.0 and +0.0 compare equal)
    lo = np.take_along_axis(x, np.argmin(x, axis=1)[:, None], axis=1)
    hi = np.take_along_axis(x, np.argmax(x, axis=1)[:, None], axis=1)
    d = (hi - lo) / np.float32(levels)
    return lo, d, _inverse(d)


def _truncate(v: np.ndarray) -> np.ndarray:
    """The C cast `(int8_t)v` / `(uint8_t)v` of a value in [0, 32): truncation toward zero."""
    return np.trunc(v).astype(np.uint8)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:  # `quantize_row_q4_0_ref`
    d, inv = _symmetric_scale(x, 8)
    q = np.minimum(_truncate(x * inv + np.float32(8.5)), 15)
    return as_bytes(_fp16(d), _pack_nibbles(q))


def quantize_q4_1(x: np.ndarray) -> np.ndarray:  # `quantize_row_q4_1_ref`
    lo, d, inv = _affine_scale(x, 15)
    q = np.minimum(_truncate((x - lo) * inv + np.float32(0.5)), 15)
    return as_bytes(_fp16(d), _fp16(lo), _pack_nibbles(q))


def quantize_q5_0(x: np.ndarray) -> np.ndarray:  # `quantize_row_q5_0_ref`
    d, inv = _symmetric_scale(x, 16)
    q = np.minimum(_truncate(x * inv + np.float32(16.5)), 31)
    return as_bytes(_fp16(d), _pack_fifth_bits(q), _pack_nibbles(q & 0x0F))


def quantize_q5_1(x: np.ndarray) -> np.ndarray:  # `quantize_row_q5_1_ref` (no clamp to 31 in ggml either)
    lo, d, inv = _affine_scale(x, 31)
    q = _truncate((x - lo) * inv + np.float32(0.5))
    return as_bytes(_fp16(d), _fp16(lo), _pack_fifth_bits(q), _pack_nibbles(q & 0x0F))


def _q8_scale_and_quants(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0/Q8_1: d = amax / 127 (f32), q = roundf(x * (1/d))."""
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    q = round_half_away(x * _inverse(d)).astype(np.int8)
    return d, q


def quantize_q8_0(x: np.ndarray) -> np.ndarray:  # `quantize_row_q8_0_ref`
    d, q = _q8_scale_and_quants(x)
    return as_bytes(_fp16(d), q)


def quantize_q8_1(x: np.ndarray) -> np.ndarray:  # `quantize_row_q8_1_ref`
    d, q = _q8_scale_and_quants(x)
    s = q.sum(axis=1, keepdims=True, dtype=np.int32).astype(np.float32) * d  # uses the f32 d, not fp16(d)
    return as_bytes(_fp16(d), _fp16(s), q)


# What llama.cpp's matmul really uses for activations on x86 with AVX/AVX2/AVX-512: `quantize_row_q8_0` /
# `quantize_row_q8_1` in `ggml/src/ggml-cpu/arch/x86/quants.c`. Same d = amax/127, but the multiplier is
# 127/amax (not 1/d) and `_mm256_round_ps(NEAREST)` rounds ties to even, so about one block in 10^4 of
# Gaussian data differs from the reference by one step. Not registered: the registry holds the references.
def _q8_x86_scale_and_quants(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    amax = np.abs(x).max(axis=1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    return amax / np.float32(127), np.rint(x * inv).astype(np.int8)


def quantize_q8_0_x86(x: np.ndarray) -> np.ndarray:
    d, q = _q8_x86_scale_and_quants(x)
    return as_bytes(_fp16(d), q)


def quantize_q8_1_x86(x: np.ndarray) -> np.ndarray:
    d, q = _q8_x86_scale_and_quants(x)
    s = d * q.sum(axis=1, keepdims=True, dtype=np.int32).astype(np.float32)
    return as_bytes(_fp16(d), _fp16(s), q)


def quantize_q8_K(x: np.ndarray) -> np.ndarray:  # `quantize_row_q8_K_ref`
    """d = 1/iscale (f32, may be negative) with iscale = -127/max, max the signed absmax element;
    q = min(127, nearest_int(iscale * x)); bsums = int16 sums of q over groups of 16. All-zero blocks
    store d = 0 and zero quants (ggml leaves their bsums unwritten; we store zeros)."""
    n = x.shape[0]
    peak = _signed_absmax(x)
    nonzero = peak != 0
    iscale = np.divide(np.float32(-127), peak, out=np.zeros_like(peak), where=nonzero)
    q = np.minimum(np.rint(x * iscale), 127).astype(np.int8)  # nearest_int: ties to even
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=nonzero)
    bsums = q.reshape(n, 16, 16).sum(axis=2, dtype=np.int16)
    return as_bytes(d.astype("<f4"), q, bsums.astype("<i2"))


def _ternary(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """TQ1_0/TQ2_0: d = amax (f32), digits lroundf(x / d) + 1 in {0, 1, 2}: u8[n, 256]."""
    d = np.abs(x).max(axis=1, keepdims=True)
    return d, (round_half_away(x * _inverse(d)) + 1).astype(np.uint8)


def _base3(digits: np.ndarray) -> np.ndarray:
    """Digits u8[n, k, m] (most significant first along k) -> the bytes `ceil(q * 256 / 243)` that put q's
    trits at the top of a byte, as ggml reads them back (`((u8)(b * 3^k) * 3) >> 8`)."""
    k = digits.shape[1]
    q = (digits.astype(np.uint16) * (3 ** np.arange(k - 1, -1, -1, dtype=np.uint16))[:, None]).sum(axis=1)
    q = q * 3 ** (5 - k)  # the qh bytes hold 4 trits, shifted to the top one
    return ((q * 256 + 242) // 243).astype(np.uint8)


def quantize_tq1_0(x: np.ndarray) -> np.ndarray:  # `quantize_row_tq1_0_ref`; layout in lowbit.py
    n = x.shape[0]
    d, q = _ternary(x)
    qs0 = _base3(q[:, :160].reshape(n, 5, 32))  # byte m: elements m + 32k, k = 0..4
    qs1 = _base3(q[:, 160:240].reshape(n, 5, 16))  # byte 32 + m: elements 160 + m + 16k
    qh = _base3(q[:, 240:].reshape(n, 4, 4))  # byte 48 + j: elements 240 + j + 4k
    return as_bytes(qs0, qs1, qh, _fp16(d))


def quantize_tq2_0(x: np.ndarray) -> np.ndarray:  # `quantize_row_tq2_0_ref`; layout in lowbit.py
    n = x.shape[0]
    d, q = _ternary(x)
    q = q.reshape(n, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)  # [h, l, m]
    return as_bytes(np.bitwise_or.reduce(q, axis=2), _fp16(d))


def _nearest_fp4(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """ggml-quants.c `best_index_mxfp4`: the code whose kvalues_mxfp4[code] * d is nearest to each element of
    x (f32[n, k]), the first on ties; d f32[n, 1]: u8[n, k]."""
    err = np.abs(KVALUES_MXFP4.astype(np.float32) * d[:, :, None] - x[:, :, None])  # [n, k, 16]
    return np.argmin(err, axis=2).astype(np.uint8)


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:  # `quantize_row_mxfp4_ref`
    """e = floor(log2(amax)) - 2 + 127 (E8M0), then each element's nearest doubled E2M1 value times
    d = 2^(e - 128), the first on ties. log2f of f32 is taken as the double log2 rounded to f32 (correctly
    rounded, which decides floor() just below a power of two)."""
    n = x.shape[0]
    amax = np.abs(x).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        log2 = np.log2(amax.astype(np.float64)).astype(np.float32)
        e = np.where(amax > 0, np.floor(log2) - 2 + 127, 0).astype(np.int32).astype(np.uint8)  # C: wraps
    q = _nearest_fp4(x, e8m0_to_fp32_half(e)).reshape(n, 2, 16)
    return as_bytes(e, q[:, 0] | (q[:, 1] << 4))


def fp32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml-impl.h `ggml_fp32_to_ue4m3`: 0 unless x > 0 (NaN too); clamp to 448; exponent (bias 7) <= 0: the
    subnormal code (int)(x * 512 + 0.5) capped at 7; >= 15: 0x7E; else the mantissa's top 3 bits rounded half
    up on bit 19, a carry bumping the exponent (to 0x7E again at 15)."""
    x = np.minimum(np.asarray(x, np.float32), np.float32(448))
    bits = x.view(np.uint32).astype(np.int64)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    with np.errstate(invalid="ignore", over="ignore"):
        sub = np.minimum((x * np.float32(512) + np.float32(0.5)).astype(np.int64), 7)
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    carried = np.where(man > 7, exp + 1, exp)
    normal = np.where(carried >= 15, 0x7E, (carried << 3) | np.where(man > 7, 0, man))
    code = np.where(exp <= 0, np.where(sub < 1, 0, sub), np.where(exp >= 15, 0x7E, normal))
    return np.where(x > 0, code, 0).astype(np.uint8)


def quantize_nvfp4(x: np.ndarray) -> np.ndarray:  # `quantize_row_nvfp4_ref`; layout in lowbit.py
    """Per 16 elements: the UE4M3 code of amax / 6 (6 is E2M1's largest value), then the nearest E2M1 codes
    times that scale, decoded and halved as the dequantizer reads it."""
    n = x.shape[0]
    xs = x.reshape(n * 4, 16)
    ue = fp32_to_ue4m3(np.fmax.reduce(np.abs(xs), axis=1) / np.float32(6))  # u8[4n]; amax skips NaN, as ggml
    q = _nearest_fp4(xs, UE4M3_HALF[ue][:, None]).reshape(n, 4, 2, 8)  # [n, s, nibble, j]
    return as_bytes(ue.reshape(n, 4), q[:, :, 0] | (q[:, :, 1] << 4))


def quantize_q1_0(x: np.ndarray) -> np.ndarray:  # `quantize_row_q1_0_ref`
    """d = (sum |x|, summed left to right in f32) / 128; bit j set where x[j] >= 0."""
    d = np.cumsum(np.abs(x), axis=1, dtype=np.float32)[:, -1:] / np.float32(128)
    return as_bytes(_fp16(d), np.packbits(x >= 0, axis=1, bitorder="little"))
