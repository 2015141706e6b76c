"""Kernels that compute straight from ggml's blocks as stored: the grid, ternary, binary and FP4 formats.

IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0, MXFP4, NVFP4 and Q1_0 hold 1.1-4.5 bits per
weight. Repacked to one small integer per weight (the `layout.py` families) they would take 2-6x their file
size; here they stay in their blocks (`layout.pack` only pads the rows to whole groups of 64: 1.0x the file).
Each task decodes one block at a time into a 256-byte scratch of int8 values plus one f32 scale per
sub-block of `sub` elements, turns them into the block's weights wf = scale * value (the reference's single
rounding: `quants/iqgrid.py`, `quants/lowbit.py` `parts`), and then

    acc[t] += sum_k xv[k] * wf[k]                         over the block (exact numerics), or
    acc[t] += ad[t, s] * sum_k xv[k] * wf[k]              over each sub-block s, ad the Q8_K/Q8_0 scale

the contract of `activations.prepare` with no zero point and no offsets. A row's sum does not depend on how
many activation rows come along (each row runs the same loop), so one row alone and the same row in a batch
give the same bits. The grids are module-level constants that the compiled code holds: one u64 word (u32
for IQ3) per grid row, so that a grid lookup is one load. Signs are applied to 8 values at once:
(g ^ m) + (m & 0x01..01) negates the bytes where the mask m is 0xFF, exact because no grid value is 0.
"""

from __future__ import annotations

import numpy as np

from ..constants import GGMLType
from ..quants.grids import IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID
from ..quants.iqgrid import KSIGNS_IQ2XS
from ..quants.lowbit import KVALUES_MXFP4, UE4M3_HALF, e8m0_to_fp32_half
from ._numba import half_to_float, jit, prange, use_threads

__all__ = ["BLOCK_TYPES", "Format", "dequantize", "matvec", "unpack"]


class Format:
    """How the kernels read one type: its run-time code, block size and the sub-block of one scale."""

    def __init__(self, kind: int, block_size: int, sub: int):
        self.kind, self.block_size, self.sub = kind, block_size, sub


# type name -> Format; `sub` is also the sub-block of the activation terms (Q1_0 repeats its scale per 32,
# the Q8_0 blocks of its vec_dot type)
_FORMATS = {
    "IQ2_XXS": Format(0, 256, 32),
    "IQ2_XS": Format(1, 256, 16),
    "IQ2_S": Format(2, 256, 16),
    "IQ3_XXS": Format(3, 256, 32),
    "IQ3_S": Format(4, 256, 32),
    "IQ1_S": Format(5, 256, 32),
    "IQ1_M": Format(6, 256, 16),
    "TQ1_0": Format(7, 256, 256),
    "TQ2_0": Format(8, 256, 256),
    "MXFP4": Format(9, 32, 32),
    "NVFP4": Format(10, 64, 16),
    "Q1_0": Format(11, 128, 32),
}
BLOCK_TYPES = {GGMLType[n]: f for n, f in _FORMATS.items() if n in GGMLType.__members__}
"""GGML type -> `Format`, for the types these kernels compute (those `GGMLType` names)."""


# --- tables: grid rows as words, sign masks, scale decoders ------------------------------------------------------
def _words(grid: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(grid).view(np.uint64 if grid.shape[1] == 8 else np.uint32)[:, 0].copy()


_G2XXS, _G2XS, _G2S = _words(IQ2XXS_GRID), _words(IQ2XS_GRID), _words(IQ2S_GRID)
_G3XXS, _G3S = _words(IQ3XXS_GRID), _words(IQ3S_GRID)
# IQ1: 8 * (grid + delta) with delta = +1/8 (rows 0..2047) or -1/8 (rows 2048..), see quants/iqgrid.py
_G1 = _words(np.concatenate([8 * IQ1S_GRID + 1, 8 * IQ1S_GRID - 1]).astype(np.int8))
_BYTES = np.arange(256, dtype=np.uint8)
_SIGN_MASK = _words((((_BYTES[:, None] >> np.arange(8, dtype=np.uint8)) & 1) * 255).astype(np.uint8))
_KSIGN_MASK = _SIGN_MASK[KSIGNS_IQ2XS]  # 7-bit sign index -> mask of its 8 signs
_E8M0_HALF = e8m0_to_fp32_half(_BYTES)
_UE4M3_HALF = np.ascontiguousarray(UE4M3_HALF)
_KVALUES_FP4 = KVALUES_MXFP4.copy()
_LOW_ONES = np.uint64(0x0101010101010101)
_HIGH_BITS = np.uint64(0x8080808080808080)
_TWO_BITS = np.uint64(0x0303030303030303)
# Q1_0: a byte of 8 sign bits -> its 8 values +1 (bit set) / -1, as one word
_PLUS_MINUS = _words((2 * ((_BYTES[:, None] >> np.arange(8, dtype=np.uint8)) & 1) - 1).astype(np.int8))
_NO_TERMS = np.zeros((3, 1, 1), np.float32)
assert min(IQ2XXS_GRID.min(), IQ2XS_GRID.min(), IQ2S_GRID.min(), IQ3XXS_GRID.min(), IQ3S_GRID.min()) > 0


@jit(inline=True)
def _signed(g, m):
    """The 8 int8 values in the word g, negated where the byte mask m is 0xFF (g's bytes are 1..127)."""
    return (g ^ m) + (m & _LOW_ONES)


@jit(inline=True)
def _u16(b, o):
    return np.uint16(b[o]) | np.uint16(np.uint16(b[o + 1]) << np.uint16(8))


@jit(inline=True)
def _u32(b, o):
    return np.uint32(_u16(b, o)) | np.uint32(np.uint32(_u16(b, o + 2)) << np.uint32(16))


@jit(inline=True)
def _u64(b, o):
    return np.uint64(_u32(b, o)) | np.uint64(np.uint64(_u32(b, o + 4)) << np.uint64(32))


@jit(inline=True)
def _minus_one(q):
    """Each byte of q (0..127) minus 1, bytes apart: the high bit set first keeps a byte from borrowing."""
    return ((q | _HIGH_BITS) - _LOW_ONES) ^ _HIGH_BITS


@jit(inline=True)
def _d(b, o):
    return half_to_float(_u16(b, o))


# --- decoding one block: values v (int8, as u64 words w) and scales sc[bs // sub] -------------------------------
# Block layouts are drawn above the reference unpackers (quants/iqgrid.py, quants/lowbit.py); scale arithmetic
# follows them operation for operation, in f32.
@jit(inline=True)
def _decode_iq2(kind, b, o, w, sc):
    d = _d(b, o + 0)
    if kind == 0:  # IQ2_XXS: per 32 elements a u32 of 4 grid indices and a u32 of 4 sign indices | scale << 28
        for ib in range(8):
            a1 = _u32(b, o + 6 + 8 * ib)
            sc[ib] = d * (np.float32(0.5) + np.float32(a1 >> np.uint32(28))) * np.float32(0.25)
            for ll in range(4):
                m = _KSIGN_MASK[(a1 >> np.uint32(7 * ll)) & np.uint32(127)]
                w[4 * ib + ll] = _signed(_G2XXS[b[o + 2 + 8 * ib + ll]], m)
    elif kind == 1:  # IQ2_XS: a u16 per 8 elements, grid index | sign index << 9; nibble scales at 66
        for s in range(16):
            nib = (b[o + 66 + s // 2] >> np.uint8(4 * (s % 2))) & np.uint8(15)
            sc[s] = d * (np.float32(0.5) + np.float32(nib)) * np.float32(0.25)
        for j in range(32):
            q = _u16(b, o + 2 + 2 * j)
            w[j] = _signed(_G2XS[q & np.uint16(511)], _KSIGN_MASK[q >> np.uint16(9)])
    else:  # IQ2_S: index low bytes at 2, full sign bytes at 34, index bits 8-9 at 66, nibble scales at 74
        for s in range(16):
            nib = (b[o + 74 + s // 2] >> np.uint8(4 * (s % 2))) & np.uint8(15)
            sc[s] = d * (np.float32(0.5) + np.float32(nib)) * np.float32(0.25)
        for j in range(32):
            high = (np.int64(b[o + 66 + j // 4]) >> (2 * (j % 4))) & 3
            w[j] = _signed(_G2S[np.int64(b[o + 2 + j]) | (high << 8)], _SIGN_MASK[b[o + 34 + j]])


@jit(inline=True)
def _decode_iq3(kind, b, o, w, sc):
    d = _d(b, o + 0)
    if kind == 3:  # IQ3_XXS: grid index per 4 elements at 2; per 32 a u32 of 4 sign indices | scale << 28
        for ib in range(8):
            ss = _u32(b, o + 66 + 4 * ib)
            sc[ib] = d * (np.float32(0.5) + np.float32(ss >> np.uint32(28))) * np.float32(0.5)
            for ll in range(4):
                i = o + 2 + 8 * ib + 2 * ll
                g = np.uint64(_G3XXS[b[i]]) | (np.uint64(_G3XXS[b[i + 1]]) << np.uint64(32))
                w[4 * ib + ll] = _signed(g, _KSIGN_MASK[(ss >> np.uint32(7 * ll)) & np.uint32(127)])
    else:  # IQ3_S: index low bytes at 2, index bit 8 at 66, sign bytes at 74, nibble scales at 106
        for ib in range(8):
            nib = (b[o + 106 + ib // 2] >> np.uint8(4 * (ib % 2))) & np.uint8(15)
            sc[ib] = d * np.float32(1 + 2 * np.int32(nib))
        for j in range(32):
            i0 = np.int64(b[o + 2 + 2 * j]) | (((np.int64(b[o + 66 + j // 4]) >> (2 * (j % 4))) & 1) << 8)
            i1 = np.int64(b[o + 3 + 2 * j]) | (((np.int64(b[o + 66 + j // 4]) >> (2 * (j % 4) + 1)) & 1) << 8)
            g = np.uint64(_G3S[i0]) | (np.uint64(_G3S[i1]) << np.uint64(32))
            w[j] = _signed(g, _SIGN_MASK[b[o + 74 + j]])


@jit(inline=True)
def _decode_iq1(kind, b, o, w, sc):
    if kind == 5:  # IQ1_S: index low bytes at 2; per 32 a u16: index bits 8-10 per 8, scale, delta sign
        d = _d(b, o + 0)
        for ib in range(8):
            qh = np.int64(_u16(b, o + 34 + 2 * ib))
            sc[ib] = d * np.float32(2 * ((qh >> 12) & 7) + 1) * np.float32(0.125)
            neg = (qh >> 15) << 11
            for ll in range(4):
                w[4 * ib + ll] = _G1[np.int64(b[o + 2 + 4 * ib + ll]) | (((qh >> (3 * ll)) & 7) << 8) | neg]
    else:  # IQ1_M: index low bytes at 0, a nibble per 8 at 32 (index bits 8-10, delta sign), scales at 48
        s0, s1, s2, s3 = _u16(b, o + 48), _u16(b, o + 50), _u16(b, o + 52), _u16(b, o + 54)
        bits = (s0 >> 12) | ((s1 >> 12) << 4) | ((s2 >> 12) << 8) | ((s3 >> 12) << 12)
        d = half_to_float(np.uint16(bits))
        for i in range(4):
            u = np.int64(_u16(b, o + 48 + 2 * i))
            for k in range(4):
                sc[4 * i + k] = d * np.float32(2 * ((u >> (3 * k)) & 7) + 1) * np.float32(0.125)
        for j in range(32):
            nib = (np.int64(b[o + 32 + j // 2]) >> (4 * (j % 2))) & 15
            w[j] = _G1[np.int64(b[o + j]) | ((nib & 7) << 8) | ((nib >> 3) << 11)]


@jit(inline=True)
def _trit(byte, k):
    """Base-3 digit k of a TQ1_0 byte minus 1, read in fixed point as ggml does: ((u8)(q * 3^k) * 3) >> 8."""
    return np.int8((((np.int64(byte) * 3**k) & 255) * 3) >> 8) - np.int8(1)


@jit(inline=True)
def _decode_small(kind, b, o, v, w, sc):
    """The ternary, binary and FP4 formats, value by value into v (int8)."""
    if kind == 7:  # TQ1_0: base-3 digits, five per byte at 0..47, four per byte at 48..51; d at 52
        sc[0] = _d(b, o + 52)
        for k in range(5):
            for m in range(32):
                v[32 * k + m] = _trit(b[o + m], k)
            for m in range(16):
                v[160 + 16 * k + m] = _trit(b[o + 32 + m], k)
        for k in range(4):
            for m in range(4):
                v[240 + 4 * k + m] = _trit(b[o + 48 + m], k)
    elif kind == 8:  # TQ2_0: 2-bit values, element 128h + 32l + m in bits 2l of byte 32h + m; d at 64
        sc[0] = _d(b, o + 64)
        for h in range(2):
            for u in range(4):  # 8 bytes at a time: a word per (h, l, u)
                q = _u64(b, o + 32 * h + 8 * u)
                for ll in range(4):
                    w[16 * h + 4 * ll + u] = _minus_one((q >> np.uint64(2 * ll)) & _TWO_BITS)
    elif kind == 9:  # MXFP4: E8M0 at 0, nibbles at 1 (low: element j, high: j + 16)
        sc[0] = _E8M0_HALF[b[o + 0]]
        for j in range(16):
            v[j] = _KVALUES_FP4[b[o + 1 + j] & np.uint8(15)]
            v[16 + j] = _KVALUES_FP4[b[o + 1 + j] >> np.uint8(4)]
    elif kind == 10:  # NVFP4: four UE4M3 scales at 0, nibbles at 4 (sub-block s: low 16s + j, high 16s + 8 + j)
        for s in range(4):
            sc[s] = _UE4M3_HALF[b[o + s]]
            for j in range(8):
                v[16 * s + j] = _KVALUES_FP4[b[o + 4 + 8 * s + j] & np.uint8(15)]
                v[16 * s + 8 + j] = _KVALUES_FP4[b[o + 4 + 8 * s + j] >> np.uint8(4)]
    else:  # Q1_0: d at 0, bit j % 8 of byte 2 + j // 8 set: +d, else -d
        d = _d(b, o + 0)
        for s in range(4):
            sc[s] = d
        for i in range(16):
            w[i] = _PLUS_MINUS[b[o + 2 + i]]


@jit(inline=True)
def _decode(kind, b, o, v, w, sc):
    """Block bytes b -> values v (int8[block_size]; w is the same memory as u64 words) and scales sc."""
    if kind <= 2:
        _decode_iq2(kind, b, o, w, sc)
    elif kind <= 4:
        _decode_iq3(kind, b, o, w, sc)
    elif kind <= 6:
        _decode_iq1(kind, b, o, w, sc)
    else:
        _decode_small(kind, b, o, v, w, sc)


# --- the kernels ------------------------------------------------------------------------------------------------
@jit(inline=True)
def _dequantize_block(kind, qf, o, bs, sub, v, w, sc, scb, wf):
    """The block at qf[o:] -> wf[0:bs], the reference's values scale * value (one rounding each). The scales
    are spread to one per element first (scb), so that the multiply is one loop over the block, which LLVM
    vectorizes; a loop of 16 per scale stayed scalar (one `cvtsi2ss` per value)."""
    _decode(kind, qf, o, v, w, sc)
    for s in range(bs // sub):
        d = sc[s]
        for k in range(sub):
            scb[sub * s + k] = d
    for k in range(bs):
        wf[k] = np.float32(v[k]) * scb[k]


@jit(fast=True)
def _group(kind, bs, ts, sub, qf, rb, xv, terms, exact, out, g):
    """Rows 64g..64g+63 of `_matvec`: each block is dequantized once (`_dequantize_block`: the reference's
    weights), then dotted with every activation row: over the whole block with exact numerics, per sub-block
    times its activation scale otherwise. Each row runs the same loop whatever T is. Measured (2048 x 2048,
    one thread) against the previous dot of 32 int8 values at a time with the scale inside it: 1.4-3.5x
    faster on the 256- and 128-element types, 1.1-1.4x slower on MXFP4 / NVFP4, whose 32 / 64-element
    blocks make the run-time-length loops short, so those two keep the previous dot (docs/kernels.md)."""
    T = xv.shape[0]
    nb = rb // ts
    v = np.empty(256, np.int8)
    w = v.view(np.uint64)
    sc = np.empty(16, np.float32)
    scb = np.empty(256, np.float32)
    wf = np.empty(256, np.float32)
    acc = np.empty(T, np.float32)
    for i in range(64):
        acc[:] = 0.0
        for blk in range(nb):
            o = blk * bs
            if bs < 128:  # MXFP4, NVFP4: over 32 / 64 elements the previous dot is faster (int8 values, scale inside)
                _decode(kind, qf, (64 * g + i) * rb + blk * ts, v, w, sc)
                for t in range(T):
                    x = xv[t]
                    a = acc[t]
                    for c in range(bs // 32):
                        oc = o + 32 * c
                        lo = sc[32 * c // sub]
                        hi = sc[(32 * c + 16) // sub]
                        dot = np.float32(0.0)
                        for k in range(32):
                            dot += x[oc + k] * (np.float32(v[32 * c + k]) * (lo if k < 16 else hi))
                        a += dot if exact else terms[1, t, oc // sub] * dot
                    acc[t] = a
                continue
            _dequantize_block(kind, qf, (64 * g + i) * rb + blk * ts, bs, sub, v, w, sc, scb, wf)
            for t in range(T):
                x = xv[t]
                if exact:
                    dot = np.float32(0.0)
                    for k in range(bs):
                        dot += x[o + k] * wf[k]
                    acc[t] += dot
                    continue
                a = acc[t]
                for j in range(bs // sub):
                    dot = np.float32(0.0)
                    for k in range(sub):
                        dot += x[o + sub * j + k] * wf[sub * j + k]
                    a += terms[1, t, o // sub + j] * dot
                acc[t] = a
        for t in range(T):
            out[t, 64 * g + i] = acc[t]


@jit(parallel=True)
def _matvec(nt, kind, bs, ts, sub, qf, rb, xv, terms, exact, out):
    """out[t, r] = weight row r (bytes qf[r * rb : (r + 1) * rb]) times activation row t, in tasks of 64 rows."""
    previous = use_threads(nt)
    for g in prange(out.shape[1] // 64):
        _group(kind, bs, ts, sub, qf, rb, xv, terms, exact, out, g)
    use_threads(previous)


@jit(parallel=True)
def _unpack_t(nt, kind, bs, ts, sub, qf, rb, g0, out):
    """Groups g0.. of the weight, dense and transposed: out[k, 64j + i] = W[64(g0 + j) + i, k], each value
    scale * value as the reference computes it. A block's values go to a row-major tile (contiguous stores),
    then the tile into `out` by columns of 64."""
    previous = use_threads(nt)
    nb = rb // ts
    for j in prange(out.shape[1] // 64):
        g = g0 + j
        v = np.empty(256, np.int8)
        w = v.view(np.uint64)
        sc = np.empty(16, np.float32)
        scb = np.empty(256, np.float32)
        tile = np.empty((64, bs), np.float32)
        for blk in range(nb):
            for i in range(64):
                _dequantize_block(kind, qf, (64 * g + i) * rb + blk * ts, bs, sub, v, w, sc, scb, tile[i])
            for k in range(bs):
                row = out[blk * bs + k]
                for i in range(64):
                    row[64 * j + i] = tile[i, k]
    use_threads(previous)


@jit(parallel=True)
def _dequantize(kind, bs, ts, sub, bf, out):
    """Blocks (flat bytes bf, `ts` per block) -> out f32[n, bs], bit-identical to the reference dequantizer."""
    for n in prange(out.shape[0]):
        v = np.empty(256, np.int8)
        w = v.view(np.uint64)
        sc = np.empty(16, np.float32)
        scb = np.empty(256, np.float32)
        _dequantize_block(kind, bf, n * ts, bs, sub, v, w, sc, scb, out[n])


def matvec(ggml_type: GGMLType, q: np.ndarray, xv: np.ndarray, terms, out: np.ndarray, threads: int) -> np.ndarray:
    """y (T, G*64) = xv (T, cols) times the weight whose blocks are q u8[G, 64, row bytes]; `terms` from
    `activations.prepare` for sub-blocks of `BLOCK_TYPES[ggml_type].sub`, or None for exact numerics."""
    f = BLOCK_TYPES[ggml_type]
    rb = q.shape[2]
    ts = rb // (xv.shape[1] // f.block_size)
    exact = terms is None
    if exact:
        fast = _exact_kernels().get(ggml_type)
        if fast is not None:
            fast(q, xv, out, threads)
            return out
    terms = _NO_TERMS if exact else terms
    _matvec(threads, f.kind, f.block_size, ts, f.sub, q.reshape(-1), rb, xv, terms, exact, out)
    return out


def _exact_kernels() -> dict:
    """GGML type -> the exact numerics' f32 kernel that decodes blocks in registers (`exact_grid.py`,
    `exact_lowbit.py`): kernel(q u8[G, 64, row bytes], xv f32[T, cols], out f32[T, G*64], threads). Imported
    on first use: those modules read this one's tables."""
    global _EXACT
    if _EXACT is None:
        from .exact_grid import KERNELS as grid
        from .exact_lowbit import KERNELS as lowbit

        _EXACT = grid | lowbit
    return _EXACT


_EXACT: dict | None = None


def unpack(ggml_type: GGMLType, q: np.ndarray, cols: int, g0: int, out: np.ndarray, threads: int) -> np.ndarray:
    """Dense rows of groups g0.. into out (cols, 64 * groups), transposed (see `matvec.unpack`)."""
    f = BLOCK_TYPES[ggml_type]
    rb = q.shape[2]
    _unpack_t(threads, f.kind, f.block_size, rb // (cols // f.block_size), f.sub, q.reshape(-1), rb, g0, out)
    return out


def dequantize(ggml_type: GGMLType, blocks: np.ndarray, out: np.ndarray) -> None:
    """A `dequant.DEQUANTIZERS` driver: blocks u8[n, type_size] -> out f32[n, block_size]."""
    f = BLOCK_TYPES[ggml_type]
    n, ts = blocks.shape
    _dequantize(f.kind, f.block_size, ts, f.sub, np.ascontiguousarray(blocks).reshape(-1), out.reshape(n, -1))
