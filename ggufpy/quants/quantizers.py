"""Reference quantizers: f32[n_blocks, block_size] -> u8[n_blocks, type_size].

They follow `quantize_row_*_ref` in llama.cpp `ggml/src/ggml-quants.c` operation by operation, in f32,
without fused multiply-adds. Q4_0/Q4_1/Q5_0/Q5_1 truncate `x * id + 8.5` (or `+ 0.5`); a C build that
contracts this into an FMA could round differently when `x * id` is within an ulp of a half-integer
(gguf-py `quants.py`: "Q4_0's reference rounding is cursed and depends on FMA"). We implement the unfused
expression, as gguf-py does; the ggml build in llama-cpp-python agrees byte for byte (tests/test_quantize.py).
Q8_0/Q8_1 round with `roundf` (ties away from zero), Q8_K with `nearest_int` (ties to even).

`quantize_q8_0_x86` / `quantize_q8_1_x86` are the variants llama.cpp's CPU matmul actually runs on x86.
The k-quant and IQ weight quantizers (iterative scale searches) are not implemented.
"""

from __future__ import annotations

import numpy as np

from .fields import as_bytes

__all__ = [
    "quantize_q4_0",
    "quantize_q4_1",
    "quantize_q5_0",
    "quantize_q5_1",
    "quantize_q8_0",
    "quantize_q8_0_x86",
    "quantize_q8_1",
    "quantize_q8_1_x86",
    "quantize_q8_K",
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
    return np.take_along_axis(x, idx, axis=1)


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
    lo = x.min(axis=1, keepdims=True)
    d = (x.max(axis=1, keepdims=True) - lo) / np.float32(levels)
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
