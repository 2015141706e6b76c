"""numba dequantizers, one per registered type, bit-identical to the NumPy reference in `ggufpy.quants`.

Each kernel takes the blocks as `u8[n, type_size]` plus the block's fp16/f32 scale fields already widened
to f32 by NumPy (`ggufpy.quants.fields`; numba has no float16), and writes `f32[n, block_size]`. The f32
operations and their order are those of the reference (ggml `dequantize_row_*`, ggml-quants.c), so every
output is bitwise equal: products of a scale and a small integer are exact, and each value has at most one
rounding (the final `+ m` or `- dmin * m`). Kernels run without fastmath, so nothing is contracted.

Integer fields are widened with `np.int32(...)` before any arithmetic, so that the kernels give the same
results when run as plain Python under NUMBA_DISABLE_JIT (where uint8 arithmetic would wrap).
"""

from __future__ import annotations

from math import prod

import numpy as np

from ..constants import GGMLType
from ..errors import GGUFError
from ..quants import floats, lowbit, quant_type
from ..quants.fields import f16_field, f32_field
from ..quants.iquants import KVALUES_IQ4NL
from . import rawblocks
from ._numba import jit, prange

__all__ = ["DEQUANTIZERS", "F16_TO_F32", "dequantize", "dequantize_blocks"]

# every fp16 bit pattern widened to f32: exact, inf and NaN included (256 KiB)
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
_KV = KVALUES_IQ4NL.astype(np.int32)  # kvalues_iq4nl, ggml-common.h


def _u32(b, i, o):
    """Little-endian u32 at byte offset o of block i, as int64."""
    return (
        np.int64(b[i, o]) | (np.int64(b[i, o + 1]) << 8) | (np.int64(b[i, o + 2]) << 16) | (np.int64(b[i, o + 3]) << 24)
    )


_u32 = jit(inline=True)(_u32)


def _s8(v):
    """A u8 reinterpreted as int8 (two's complement), as int32."""
    v = np.int32(v)
    return v - ((v >> 7) << 8)


_s8 = jit(inline=True)(_s8)


# --- 32-element legacy blocks (ggml-quants.c dequantize_row_q4_0 .. q8_0) ------------------------------------
@jit(parallel=True)
def _q4_0(b, d, out):  # +0 d, +2 qs[16]; y = (q - 8) * d
    for i in prange(b.shape[0]):
        di = d[i, 0]
        for j in range(16):
            q = np.int32(b[i, 2 + j])
            out[i, j] = np.float32((q & 15) - 8) * di
            out[i, j + 16] = np.float32((q >> 4) - 8) * di


@jit(parallel=True)
def _q4_1(b, dm, out):  # +0 d, +2 m, +4 qs[16]; y = q * d + m
    for i in prange(b.shape[0]):
        di, mi = dm[i, 0], dm[i, 1]
        for j in range(16):
            q = np.int32(b[i, 4 + j])
            out[i, j] = np.float32(q & 15) * di + mi
            out[i, j + 16] = np.float32(q >> 4) * di + mi


@jit(parallel=True)
def _q5_0(b, d, out):  # +0 d, +2 qh u32, +6 qs[16]; y = (q5 - 16) * d
    for i in prange(b.shape[0]):
        di = d[i, 0]
        qh = _u32(b, i, 2)
        for j in range(16):
            q = np.int32(b[i, 6 + j])
            lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            out[i, j] = np.float32(lo - 16) * di
            out[i, j + 16] = np.float32(hi - 16) * di


@jit(parallel=True)
def _q5_1(b, dm, out):  # +0 d, +2 m, +4 qh u32, +8 qs[16]; y = q5 * d + m
    for i in prange(b.shape[0]):
        di, mi = dm[i, 0], dm[i, 1]
        qh = _u32(b, i, 4)
        for j in range(16):
            q = np.int32(b[i, 8 + j])
            lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            out[i, j] = np.float32(lo) * di + mi
            out[i, j + 16] = np.float32(hi) * di + mi


@jit(parallel=True)
def _q8_0(b, d, out):  # +0 d, +2 qs i8[32]; y = q * d
    for i in prange(b.shape[0]):
        di = d[i, 0]
        for j in range(32):
            out[i, j] = np.float32(_s8(b[i, 2 + j])) * di


@jit(parallel=True)
def _q8_1(b, d, out):  # +0 d, +2 s, +4 qs i8[32]; y = q * d
    for i in prange(b.shape[0]):
        di = d[i, 0]
        for j in range(32):
            out[i, j] = np.float32(_s8(b[i, 4 + j])) * di


@jit(parallel=True)
def _iq4_nl(b, d, out):  # +0 d, +2 qs[16]; y = d * kvalues[q]
    for i in prange(b.shape[0]):
        di = d[i, 0]
        for j in range(16):
            q = np.int32(b[i, 2 + j])
            out[i, j] = di * np.float32(_KV[q & 15])
            out[i, j + 16] = di * np.float32(_KV[q >> 4])


# --- 256-element k-quant super-blocks (ggml-quants.c dequantize_row_q2_K .. q8_K) ---------------------------
@jit(parallel=True)
def _q2_k(b, dd, out):  # +0 scales[16], +16 qs[64], +80 d, +82 dmin
    for i in prange(b.shape[0]):
        d, dmin = dd[i, 0], dd[i, 1]
        for h in range(2):
            for j in range(4):
                for k in range(2):
                    sc = np.int32(b[i, 8 * h + 2 * j + k])
                    dl = d * np.float32(sc & 15)
                    ml = dmin * np.float32(sc >> 4)
                    for l in range(16):
                        q = (np.int32(b[i, 16 + 32 * h + 16 * k + l]) >> (2 * j)) & 3
                        out[i, 128 * h + 32 * j + 16 * k + l] = dl * np.float32(q) - ml


@jit(inline=True)
def _q3_k_scale(b, i, s):
    """Six-bit scale s (0..15) of Q3_K block i, minus 32: low 4 bits from bytes 0-7, high 2 from bytes 8-11."""
    o = 96
    low = np.int32(b[i, o + s]) & 15 if s < 8 else np.int32(b[i, o + s - 8]) >> 4
    high = (np.int32(b[i, o + 8 + s % 4]) >> (2 * (s // 4))) & 3
    return (low | (high << 4)) - 32


@jit(parallel=True)
def _q3_k(b, dd, out):  # +0 hmask[32], +32 qs[64], +96 scales[12], +108 d
    for i in prange(b.shape[0]):
        d = dd[i, 0]
        for h in range(2):
            for j in range(4):
                for k in range(2):
                    dl = d * np.float32(_q3_k_scale(b, i, 8 * h + 2 * j + k))
                    for l in range(16):
                        low = (np.int32(b[i, 32 + 32 * h + 16 * k + l]) >> (2 * j)) & 3
                        high = (np.int32(b[i, 16 * k + l]) >> (4 * h + j)) & 1
                        out[i, 128 * h + 32 * j + 16 * k + l] = dl * np.float32(low - 4 * (1 - high))


@jit(inline=True)
def _k4_scale_min(b, i, o, j):
    """ggml `get_scale_min_k4(j)` on the 12 scale bytes at offset o of block i: (scale, min) as int32."""
    if j < 4:
        return np.int32(b[i, o + j]) & 63, np.int32(b[i, o + j + 4]) & 63
    sc = (np.int32(b[i, o + j + 4]) & 15) | ((np.int32(b[i, o + j - 4]) >> 6) << 4)
    m = (np.int32(b[i, o + j + 4]) >> 4) | ((np.int32(b[i, o + j]) >> 6) << 4)
    return sc, m


@jit(parallel=True)
def _q4_k(b, dd, out):  # +0 d, +2 dmin, +4 scales[12], +16 qs[128]
    for i in prange(b.shape[0]):
        d, dmin = dd[i, 0], dd[i, 1]
        for c in range(4):
            for t in range(2):
                sc, m = _k4_scale_min(b, i, 4, 2 * c + t)
                dl = d * np.float32(sc)
                ml = dmin * np.float32(m)
                for l in range(32):
                    q = (np.int32(b[i, 16 + 32 * c + l]) >> (4 * t)) & 15
                    out[i, 64 * c + 32 * t + l] = dl * np.float32(q) - ml


@jit(parallel=True)
def _q5_k(b, dd, out):  # +0 d, +2 dmin, +4 scales[12], +16 qh[32], +48 qs[128]
    for i in prange(b.shape[0]):
        d, dmin = dd[i, 0], dd[i, 1]
        for c in range(4):
            for t in range(2):
                sc, m = _k4_scale_min(b, i, 4, 2 * c + t)
                dl = d * np.float32(sc)
                ml = dmin * np.float32(m)
                for l in range(32):
                    q = (np.int32(b[i, 48 + 32 * c + l]) >> (4 * t)) & 15
                    q |= ((np.int32(b[i, 16 + l]) >> (2 * c + t)) & 1) << 4
                    out[i, 64 * c + 32 * t + l] = dl * np.float32(q) - ml


@jit(parallel=True)
def _q6_k(b, dd, out):  # +0 ql[128], +128 qh[64], +192 scales i8[16], +208 d
    for i in prange(b.shape[0]):
        d = dd[i, 0]
        for h in range(2):
            for r in range(4):
                for half in range(2):
                    dl = d * np.float32(_s8(b[i, 192 + 8 * h + 2 * r + half]))
                    for l in range(16 * half, 16 * half + 16):
                        low = (np.int32(b[i, 64 * h + 32 * (r % 2) + l]) >> (4 * (r // 2))) & 15
                        high = (np.int32(b[i, 128 + 32 * h + l]) >> (2 * r)) & 3
                        out[i, 128 * h + 32 * r + l] = dl * np.float32((low | (high << 4)) - 32)


@jit(parallel=True)
def _q8_k(b, d, out):  # +0 d f32, +4 qs i8[256], +260 bsums i16[16]; y = d * q
    for i in prange(b.shape[0]):
        di = d[i, 0]
        for j in range(256):
            out[i, j] = di * np.float32(_s8(b[i, 4 + j]))


@jit(parallel=True)
def _iq4_xs(b, d, out):  # +0 d, +2 scales_h u16, +4 scales_l[4], +8 qs[128]
    for i in prange(b.shape[0]):
        di = d[i, 0]
        scales_h = np.int32(b[i, 2]) | (np.int32(b[i, 3]) << 8)
        for ib in range(8):
            low = (np.int32(b[i, 4 + ib // 2]) >> (4 * (ib % 2))) & 15
            ls = low | (((scales_h >> (2 * ib)) & 3) << 4)
            dl = di * np.float32(ls - 32)
            for j in range(16):
                q = np.int32(b[i, 8 + 16 * ib + j])
                out[i, 32 * ib + j] = dl * np.float32(_KV[q & 15])
                out[i, 32 * ib + 16 + j] = dl * np.float32(_KV[q >> 4])


# --- plain floats ------------------------------------------------------------------------------------------
@jit(parallel=True)
def _f16(b, table, out):
    for i in prange(b.shape[0]):
        out[i, 0] = table[np.int32(b[i, 0]) | (np.int32(b[i, 1]) << 8)]


def _dequantize_f32(blocks: np.ndarray, out: np.ndarray) -> None:
    out.reshape(-1)[:] = blocks.reshape(-1).view("<f4")


def _dequantize_f16(blocks: np.ndarray, out: np.ndarray) -> None:
    _f16(blocks, F16_TO_F32, out)


def _dequantize_bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    out.reshape(-1).view(np.uint32)[:] = blocks.reshape(-1).view("<u2").astype(np.uint32) << 16


def _raw(ggml_type: GGMLType):
    """A driver for the formats `rawblocks.py` decodes inside its kernels (grids looked up there)."""
    return lambda blocks, out: rawblocks.dequantize(ggml_type, blocks, out)


def _numpy(dequantize_blocks):
    """A driver for the storage types (I8, I16, I32, F64): a NumPy cast is all there is to it."""

    def run(blocks: np.ndarray, out: np.ndarray) -> None:
        out.reshape(-1)[:] = dequantize_blocks(blocks).reshape(-1)

    return run


def _scales(*fields):
    """A kernel driver: NumPy widens the named scale fields to f32[n, k], the kernel does the rest."""

    def make(kernel):
        def run(blocks: np.ndarray, out: np.ndarray) -> None:
            cols = [f16_field(blocks, o) if kind == "f16" else f32_field(blocks, o) for kind, o in fields]
            kernel(blocks, np.ascontiguousarray(np.concatenate(cols, axis=1)), out)

        run.kernel = kernel
        return run

    return make


F16, F32 = "f16", "f32"
DEQUANTIZERS = {
    GGMLType.F32: _dequantize_f32,
    GGMLType.F16: _dequantize_f16,
    GGMLType.BF16: _dequantize_bf16,
    GGMLType.Q4_0: _scales((F16, 0))(_q4_0),
    GGMLType.Q4_1: _scales((F16, 0), (F16, 2))(_q4_1),
    GGMLType.Q5_0: _scales((F16, 0))(_q5_0),
    GGMLType.Q5_1: _scales((F16, 0), (F16, 2))(_q5_1),
    GGMLType.Q8_0: _scales((F16, 0))(_q8_0),
    GGMLType.Q8_1: _scales((F16, 0))(_q8_1),
    GGMLType.Q2_K: _scales((F16, 80), (F16, 82))(_q2_k),
    GGMLType.Q3_K: _scales((F16, 108))(_q3_k),
    GGMLType.Q4_K: _scales((F16, 0), (F16, 2))(_q4_k),
    GGMLType.Q5_K: _scales((F16, 0), (F16, 2))(_q5_k),
    GGMLType.Q6_K: _scales((F16, 208))(_q6_k),
    GGMLType.Q8_K: _scales((F32, 0))(_q8_k),
    GGMLType.IQ4_NL: _scales((F16, 0))(_iq4_nl),
    GGMLType.IQ4_XS: _scales((F16, 0))(_iq4_xs),
    GGMLType.IQ2_XXS: _raw(GGMLType.IQ2_XXS),
    GGMLType.IQ2_XS: _raw(GGMLType.IQ2_XS),
    GGMLType.IQ2_S: _raw(GGMLType.IQ2_S),
    GGMLType.IQ3_XXS: _raw(GGMLType.IQ3_XXS),
    GGMLType.IQ3_S: _raw(GGMLType.IQ3_S),
    GGMLType.IQ1_S: _raw(GGMLType.IQ1_S),
    GGMLType.IQ1_M: _raw(GGMLType.IQ1_M),
    GGMLType.TQ1_0: _raw(GGMLType.TQ1_0),
    GGMLType.TQ2_0: _raw(GGMLType.TQ2_0),
    GGMLType.MXFP4: _raw(GGMLType.MXFP4),
    GGMLType.I8: _numpy(floats.dequantize_i8),
    GGMLType.I16: _numpy(floats.dequantize_i16),
    GGMLType.I32: _numpy(floats.dequantize_i32),
    GGMLType.F64: _numpy(floats.dequantize_f64),
}
"""GGML type -> `run(blocks u8[n, type_size], out f32[n, block_size])`; one entry per registered type."""
# types that `GGMLType` may not name yet (see quants/registry.py); Q1_0's reference negates, which differs from
# the product by -1 only in the sign of a NaN
_BY_NAME = {"NVFP4": lambda: _raw(GGMLType.NVFP4), "Q1_0": lambda: _numpy(lowbit.dequantize_q1_0)}
DEQUANTIZERS |= {GGMLType[name]: run() for name, run in _BY_NAME.items() if name in GGMLType.__members__}


def dequantize_blocks(ggml_type: GGMLType | int, blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """u8[n, type_size] -> f32[n, block_size], written into `out` when given."""
    qt = quant_type(ggml_type)
    blocks = np.ascontiguousarray(blocks).reshape(-1, qt.type_size)
    if out is None:
        out = np.empty((blocks.shape[0], qt.block_size), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        DEQUANTIZERS[qt.ggml_type](blocks, out)
    return out


def dequantize(raw: np.ndarray, ggml_type: GGMLType | int, shape: tuple[int, ...]) -> np.ndarray:
    """Like `ggufpy.quants.dequantize`: the bytes of a tensor -> float32 of NumPy `shape`."""
    qt = quant_type(ggml_type)
    shape = tuple(int(s) for s in shape)
    n = prod(shape)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if (shape and shape[-1] % qt.block_size) or data.size != n // qt.block_size * qt.type_size:
        raise GGUFError(
            f"{qt.name} tensor of shape {shape} does not match {data.size} bytes "
            f"(blocks of {qt.block_size} elements in {qt.type_size} bytes)"
        )
    return dequantize_blocks(qt.ggml_type, data).reshape(shape)
