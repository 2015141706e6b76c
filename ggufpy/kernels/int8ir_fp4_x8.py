"""MXFP4 in groups of eight rows that stream as one (`int8ir_fp4.py` has the row kernels and the helpers).

ggml repacks MXFP4 weights of out % 8 == 0 rows into `block_mxfp4x8` (repack.cpp `make_block_mxfp4x8`) and
keeps one f32 lane per row. `mxfp4_dot8` reads eight GGUF rows, eight short streams of 17-byte blocks; here
the eight rows' blocks are copied side by side once, so that one stream holds them and each 32-byte load
holds two rows' codes (as `int8ir_x8`'s Q4_0 groups). One block of eight rows:

    bytes 0-7      e of rows 0..7 (E8M0)
    bytes 8-39     qs of row 0 | qs of row 4      (16 bytes each: low nibbles = elements 0-15, high = 16-31)
    bytes 40-71    qs of row 1 | qs of row 5
    bytes 72-103   qs of row 2 | qs of row 6
    bytes 104-135  qs of row 3 | qs of row 7

136 bytes for 8 * 17: the copy is 1.0x the type's bytes. Measured on one thread (2880 x 2880, T = 1, CPU
time): 0.49 ms against the GGUF rows' 0.71 ms with the weights out of cache, 0.29 against 0.47 in cache.
The f32 steps are `mxfp4_dot8`'s (the repacked gemv / gemm), bit for bit.

From `GEMM_MIN_ROWS` activation rows on, `mxfp4x8_gemm` decodes each block of a group once for all T rows, into
eight registers transposed so that lane r holds weight row r (register k: elements 4k..4k+3 of the eight rows),
and each activation row then costs eight broadcast loads of four quants, eight `vpmaddubsw`, four `vpmaddwd` and
no horizontal sums (ggml's repacked gemm keeps lanes = rows the same way, arch/x86/repack.cpp
`gemm_q4_b32_8x8_q8_0_lut_avx`). Measured 1.7-2.1x `mxfp4x8_dot(4)` at T = 8..128 (1.3x at T = 4), one thread.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from ._numba import jit, prange, use_threads
from .int8ir import (
    F32,
    F32T,
    I8,
    I8T,
    I32,
    I32T,
    I64,
    U8,
    V8F32,
    V8I32,
    V16I8,
    V16I16,
    V32I8,
    _broadcast,
    _fma,
    _hsum_i32,
    _load,
    _loop,
    _madd,
    _maddubs,
    _nibbles32,
    _row,
    _shuffle,
    _splat,
)
from .int8ir_fp4 import _OFFSET, MXFP4_BYTES, _e8m0_half, _values
from .int8ir_x8 import _hadd, _signature8, _store8
from .int8ir_x8_gemm import _lanes8, _signature_gemm, block_major

__all__ = [
    "GEMM_MIN_ROWS",
    "MXFP4X8_BYTES",
    "gemm_operands",
    "interleave_mxfp4",
    "mxfp4x8_dot",
    "mxfp4x8_gemm",
    "mxfp4x8_kernel",
]

MXFP4X8_BYTES = 8 * MXFP4_BYTES


def interleave_mxfp4(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """MXFP4 GGUF rows u8 (rows, nb * 17), rows % 8 == 0 -> the eight-row groups u8 (rows / 8, nb * 136)."""
    rows, row_bytes = raw.shape
    G, nb = rows // 8, row_bytes // MXFP4_BYTES
    blocks = raw.reshape(G, 8, nb, MXFP4_BYTES)  # (group, row in group, block, bytes)
    if out is None:
        out = np.empty((G, nb * MXFP4X8_BYTES), np.uint8)
    grouped = out.reshape(G, nb, MXFP4X8_BYTES)
    grouped[:, :, :8] = blocks[..., 0].transpose(0, 2, 1)
    qs = blocks[..., 1:].reshape(G, 2, 4, nb, 16).transpose(0, 3, 2, 1, 4)  # (G, nb, pair c, row c / c + 4, 16)
    grouped[:, :, 8:].reshape(G, nb, 4, 2, 16)[:] = qs
    return out


def mxfp4x8_dot(n_act: int = 1):
    """Intrinsic (w, g, aq, t, ad, asum, nb, out): out[t:t+n_act, 8g:8g+8] for the group g of w u8 (rows / 8,
    nb * 136), as `int8ir_fp4.mxfp4_dot8`: acc = fma(float(isum), fl(d_w * d_a), acc) per block and row; each
    block of the group decoded once for the n_act activation rows."""

    @intrinsic
    def dot(typingctx, w, g, aq, t, ad, asum, nb, out):
        sig = _signature8((w, g, aq, t, ad, asum, nb, out), (U8, int, I8T, int, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            w_, g_, aq_, t_, ad_, asum_, nb_, out_ = args
            group = _row(context, builder, signature.args[0], w_, g_)
            ts = [builder.add(t_, ir.Constant(I64, i)) for i in range(n_act)]
            arows = [_row(context, builder, signature.args[2], aq_, t) for t in ts]
            drows = [_row(context, builder, signature.args[4], ad_, t) for t in ts]
            srows = [_row(context, builder, signature.args[5], asum_, t) for t in ts]
            ones = _splat(V16I16, 1)

            def body(b, carried):
                blk = builder.gep(group, [builder.mul(b, ir.Constant(I64, MXFP4X8_BYTES))])
                codes = [_nibbles32(builder, _load(builder, blk, 8 + 32 * c, V32I8)) for c in range(4)]
                codes = [(_values(builder, lo), _values(builder, hi)) for lo, hi in codes]
                dw = _e8m0_half(builder, _load(builder, blk, 0, ir.VectorType(I8, 8)))
                at = builder.mul(b, ir.Constant(I64, 32))
                accs = []
                for acc, arow, drow, srow in zip(carried, arows, drows, srows, strict=True):
                    ablk = builder.gep(arow, [at])
                    a_lo, a_hi = (_load(builder, ablk, o, V16I8) for o in (0, 16))
                    a_lo, a_hi = (_shuffle(builder, a, a, list(range(16)) * 2) for a in (a_lo, a_hi))
                    lanes = []
                    for lo, hi in codes:  # rows c and c + 4; |p| <= 2 * 2 * 24 * 127 < 2^15
                        p = builder.add(_maddubs(builder, lo, a_lo), _maddubs(builder, hi, a_hi))
                        lanes.append(_madd(builder, p, ones))
                    h = _hadd(builder, _hadd(builder, lanes[0], lanes[1]), _hadd(builder, lanes[2], lanes[3]))
                    asum = _hsum_i32(builder, _load(builder, srow, at, V8I32))  # the table's +12, all rows
                    isum = builder.sub(h, _broadcast(builder, builder.mul(asum, ir.Constant(I32, _OFFSET)), V8I32))
                    da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                    d = builder.fmul(dw, _broadcast(builder, da, V8F32))  # `_mm256_mul_ps(col_scale, row_scale)`
                    accs.append(_fma(builder, builder.sitofp(isum, V8F32), d, acc))
                return accs

            accs = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)] * n_act, body)
            r0 = builder.mul(g_, ir.Constant(I64, 8))
            for t, acc in zip(ts, accs, strict=True):
                _store8(context, builder, signature, out_, t, r0, acc)
            return context.get_dummy_value()

        return sig, codegen

    return dot


def _lanes_are_rows(builder, blk) -> list:
    """A block of eight rows -> eight <32 x i8> of values + 12, register k lane r (bytes 4r..4r+3) = elements
    4k..4k+3 of row r. Each 32-byte load holds rows c | c + 4, so low nibbles give elements 0..15 of both halves
    and high ones 16..31: a 4 x 4 transpose of i32 within each 128-bit half puts row c in lane c of both."""
    lo, hi = [], []
    for c in range(4):
        u_lo, u_hi = _nibbles32(builder, _load(builder, blk, 8 + 32 * c, V32I8))
        lo.append(builder.bitcast(_values(builder, u_lo), V8I32))  # lane m: row c (m < 4) / c + 4, elements 4m..
        hi.append(builder.bitcast(_values(builder, u_hi), V8I32))  # the same for elements 16 + 4m..

    def transpose(v):  # `unpacklo/hi_epi32`, then `unpacklo/hi_epi64`
        a, b = (_shuffle(builder, v[0], v[1], i) for i in ([0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]))
        c, d = (_shuffle(builder, v[2], v[3], i) for i in ([0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]))
        lo64, hi64 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
        return [_shuffle(builder, a, c, lo64), _shuffle(builder, a, c, hi64), _shuffle(builder, b, d, lo64),
                _shuffle(builder, b, d, hi64)]  # fmt: skip

    return [builder.bitcast(v, V32I8) for v in transpose(lo) + transpose(hi)]


def mxfp4x8_gemm():
    """Intrinsic (w, g, ab, T, adt, corr, nb, out, acc): out[0:T, 8g:8g+8] for the group g of w u8 (rows / 8,
    nb * 136) with `mxfp4x8_dot`'s f32 steps (acc = fma(float(isum), fl(d_w * d_a), acc) per block from 0), each
    block decoded once for all T rows, whose accumulators wait in acc f32 (T, 8) between blocks (stores of f32
    values: no rounding). Operands from `gemm_operands`: ab int8 (nb * T, 32) block-major, adt f32 (nb, T),
    corr int32 (nb, T) = 12 x the block's quant sum (the table's +12)."""

    @intrinsic
    def gemm(typingctx, w, g, ab, T, adt, corr, nb, out, acc):
        sig = _signature_gemm((w, g, ab, T, adt, corr, nb, out, acc), (U8, int, I8T, int, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            w_, g_, ab_, T_, adt_, corr_, nb_, out_, acc_ = args
            group = _row(context, builder, signature.args[0], w_, g_)
            zero_col = ir.Constant(I64, 0)
            ones = _splat(V16I16, 1)

            def acc_ptr(t):
                return _lanes8(context, builder, signature.args[8], acc_, t, zero_col)

            def clear(t, _):
                builder.store(ir.Constant(V8F32, [0.0] * 8), acc_ptr(t), align=4)
                return []

            _loop(builder, T_, [], clear)

            def block(b, _):
                blk = builder.gep(group, [builder.mul(b, ir.Constant(I64, MXFP4X8_BYTES))])
                vals = _lanes_are_rows(builder, blk)
                dw = _e8m0_half(builder, _load(builder, blk, 0, ir.VectorType(I8, 8)))
                drow = _row(context, builder, signature.args[4], adt_, b)
                crow = _row(context, builder, signature.args[5], corr_, b)
                first = builder.mul(b, T_)

                def row(t, _):
                    arow = _row(context, builder, signature.args[2], ab_, builder.add(first, t))
                    p = []
                    for k, v in enumerate(vals):  # four quants broadcast to every lane; |pair| <= 2 * 24 * 127
                        a = _broadcast(builder, _load(builder, arow, 4 * k, I32), V8I32)
                        p.append(_maddubs(builder, v, builder.bitcast(a, V32I8)))
                    lanes = [_madd(builder, builder.add(p[2 * i], p[2 * i + 1]), ones) for i in range(4)]
                    isum = builder.add(builder.add(lanes[0], lanes[1]), builder.add(lanes[2], lanes[3]))
                    four_t = builder.mul(t, ir.Constant(I64, 4))
                    isum = builder.sub(isum, _broadcast(builder, _load(builder, crow, four_t, I32), V8I32))
                    d = builder.fmul(dw, _broadcast(builder, _load(builder, drow, four_t, F32), V8F32))
                    y = _fma(builder, builder.sitofp(isum, V8F32), d, builder.load(acc_ptr(t), align=4))
                    builder.store(y, acc_ptr(t), align=4)
                    return []

                _loop(builder, T_, [], row)
                return []

            _loop(builder, nb_, [], block)
            r0 = builder.mul(g_, ir.Constant(I64, 8))

            def finish(t, _):
                y = builder.load(acc_ptr(t), align=4)
                builder.store(y, _lanes8(context, builder, signature.args[7], out_, t, r0), align=4)
                return []

            _loop(builder, T_, [], finish)
            return context.get_dummy_value()

        return sig, codegen

    return gemm


_block_major = jit(block_major)


@jit
def gemm_operands(aq, ad, asum):
    """Q8_0 activations (aq int8 (T, C), ad f32 (T, nb), asum int32 (T, C / 4)) -> `mxfp4x8_gemm`'s operands:
    aq block-major (nb * T, 32), ad transposed (nb, T), corr int32 (nb, T) = 12 x each block's quant sum."""
    T, nb = aq.shape[0], aq.shape[1] // 32
    corr = np.empty((nb, T), np.int32)
    for t in range(T):
        for b in range(nb):
            total = 0
            for j in range(8 * b, 8 * b + 8):
                total += asum[t, j]
            corr[b, t] = np.int32(_OFFSET * total)
    return _block_major(aq, T, 32), np.ascontiguousarray(ad.T), corr


GEMM_MIN_ROWS = 4  # activation rows from which `mxfp4x8_gemm` runs (its operands cost one pass over them)
GEMM_CHUNK = 8  # groups per parallel task (each allocates its accumulators)

_X8 = mxfp4x8_dot()
_X8X4 = mxfp4x8_dot(4)
_GEMM = mxfp4x8_gemm()


@jit(parallel=True)
def _mv_mxfp4x8(nt, w, aq, ad, asum, out):
    previous = use_threads(nt)
    T = aq.shape[0]
    nb = aq.shape[1] // 32
    for g in prange(w.shape[0]):
        for t in range(0, T - T % 4, 4):
            _X8X4(w, g, aq, t, ad, asum, nb, out)
        for t in range(T - T % 4, T):
            _X8(w, g, aq, t, ad, asum, nb, out)
    use_threads(previous)


@jit(parallel=True)
def _mm_mxfp4x8(nt, w, aq, ad, asum, out):
    previous = use_threads(nt)
    T, nb, G = aq.shape[0], aq.shape[1] // 32, w.shape[0]
    ab, adt, corr = gemm_operands(aq, ad, asum)
    for c in prange((G + GEMM_CHUNK - 1) // GEMM_CHUNK):
        acc = np.empty((T, 8), np.float32)
        for g in range(c * GEMM_CHUNK, min(G, (c + 1) * GEMM_CHUNK)):
            _GEMM(w, g, ab, T, adt, corr, nb, out, acc)
    use_threads(previous)


def mxfp4x8_kernel(nt, w, aq, ad, s, asum, out):
    """`int8dot`'s Q8_0 kernel contract for MXFP4 eight-row groups u8 (rows / 8, nb * 136)."""
    if aq.shape[0] >= GEMM_MIN_ROWS:
        _mm_mxfp4x8(nt, w, aq, ad, asum, out)
    else:
        _mv_mxfp4x8(nt, w, aq, ad, asum, out)
