"""LLVM IR for ggml's AVX2 dot products of the 1-2 bit types: TQ1_0, TQ2_0 (Q8_K activations), Q1_0 (Q8_0).

The llamacpp numerics' spec is the NumPy replay of each type's x86 kernel (`ggufpy.quants.x86.ternary`,
`q1_0`: `vec_dot` for every shape, no repacked or tiled variant). Per weight row and activation row, the
intrinsics here compute the replay's exact integer lanes with `vpmaddubsw` / `vpmaddwd` (`int8ir.py`'s helpers)
and then its f32 steps in its order, so their results are the replay's bit for bit:

    TQ1_0, TQ2_0: 256 per block, q in {0, 1, 2}, weight (q - 1) d_w   (arch/x86/quants.c `ggml_vec_dot_tq{1,2}_0_q8_K`)
        s16 = sum over the 8 chunks of maddubs(q, y) - bsums       16-bit lane m: bytes 2m, 2m + 1 of each chunk
        I   = madd(s16, 1)                                          32-bit lane L: elements 4L..4L+3 of each chunk
        acc = fma(float(I), fl(d_a * d_w), acc);  y = hsum_float_8(acc)

    Q1_0: 128 per block, weight +-d_w, four Q8_0 activation blocks K   (the replay's `ggml_vec_dot_q1_0_q8_0`)
        I_K = madd(maddubs(1, bit ? a : -a), 1)                     the 8 lanes of Q8_0 block K
        blk = d_a0 * float(I_0);  blk = fma(d_aK, float(I_K), blk), K = 1..3;  acc = fma(d_w, blk, acc)
        y = hsum_float_8(acc)

Every 16-bit partial sum is exact: |q| <= 3 (a TQ2_0 code 3, which no quantizer writes, included) times |y| <=
127 over 8 chunks of pairs is below 2^13, and the Q8_0 quantizer never writes -128, so `-a` never wraps. Each
intrinsic takes (w u8 (rows, row_bytes) C, r, aq int8 (T, C) C, t, ad f32 (T, nb) ...): weight row r as stored
in the GGUF file, activation row t quantized by `int8dot.quantize`. From two activation rows on, TQ1_0's codes
(base-3 digits, the costly decode) are unpacked once per weight row into a scratch row of bytes; the integer
sums and so the results are the same. One activation row (decode) runs `int8ir_ternary_rows`' intrinsics: TQ2_0
two and Q1_0 four weight rows per call, prefetched, each row's steps the one-row intrinsic's (the code decoders
live there too).

    KERNELS[type] = (activation format, block bytes, elements per block, kernel)   # merged into int8lowbit's
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..constants import GGMLType
from ._numba import jit, prange, use_threads
from .int8ir import (
    _BITS,
    F32,
    F32T,
    I8,
    I8T,
    I16T,
    I64,
    U8,
    V8F32,
    V16I16,
    V32I8,
    _broadcast,
    _fma,
    _half,
    _hsum_float_8,
    _load,
    _loop,
    _madd,
    _maddubs,
    _psign,
    _row,
    _shuffle,
    _signature,
    _splat,
)
from .int8ir_ternary_rows import Q1_0_ROWS, TQ2_0_ROWS, q1_0_rows, tq1_0_codes, tq2_0_codes, tq_rows
from .int8ir_tq2_gemm import ROWS as TQ2_GROUP
from .int8ir_tq2_gemm import SCRATCH_PER_BLOCK as TQ2_SCRATCH
from .int8ir_tq2_gemm import tq2_0_group

__all__ = ["KERNELS", "q1_0_dot", "q1_0_unpack", "tq1_0_dot", "tq1_0_unpack", "tq2_0_dot"]

Q8_0, Q8_K = "Q8_0", "Q8_K"  # activation formats, as int8dot names them
ROWS_PER_TASK = 16  # weight rows per parallel task of the unpacked TQ1_0 / Q1_0 kernels (one scratch row each)


# type -> (block bytes, offset of the fp16 d, block -> the 8 code vectors)
_TQ = {"tq1_0": (54, 52, tq1_0_codes), "tq2_0": (66, 64, tq2_0_codes)}


def _tq_dot(kind: str, unpacked: bool = False):
    """Intrinsic (w, r, aq, t, ad, bsums, nb) -> f32: `ggml_vec_dot_tq{1,2}_0_q8_K` (AVX2) of weight row r and
    activation row t (ad f32 (T, nb) the Q8_K d, bsums int16 (T, nb*16)), as `quants.x86.ternary` replays it.
    unpacked=True: (codes, w, r, aq, t, ad, bsums, nb), the codes of row r read from `codes` u8 (1, nb*256) (as
    `tq1_0_unpack` wrote them) instead of decoded from w, which then gives only the block scales."""
    size, d_at, codes_of = _TQ[kind]

    def codegen(context, builder, signature, args):
        if unpacked:
            crow = _row(context, builder, signature.args[0], args[0], ir.Constant(I64, 0))
            args, types_ = args[1:], signature.args[1:]
        else:
            types_ = signature.args
        w_, r_, aq_, t_, ad_, bs_, nb_ = args
        wrow = _row(context, builder, types_[0], w_, r_)
        arow = _row(context, builder, types_[2], aq_, t_)
        drow = _row(context, builder, types_[4], ad_, t_)
        bsrow = _row(context, builder, types_[5], bs_, t_)

        def body(b, carried):
            (acc,) = carried
            blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, size))])
            ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
            if unpacked:
                cblk = builder.gep(crow, [builder.mul(b, ir.Constant(I64, 256))])
                codes = [_load(builder, cblk, 32 * c, V32I8) for c in range(8)]
            else:
                codes = codes_of(builder, blk)
            s16 = None
            for c, q in enumerate(codes):
                p = _maddubs(builder, q, _load(builder, ablk, 32 * c, V32I8))
                s16 = p if s16 is None else builder.add(s16, p)
            bs = _load(builder, bsrow, builder.mul(b, ir.Constant(I64, 32)), V16I16)
            lanes = _madd(builder, builder.sub(s16, bs), _splat(V16I16, 1))
            da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
            d = _broadcast(builder, builder.fmul(da, _half(builder, blk, d_at)), V8F32)
            return [_fma(builder, builder.sitofp(lanes, V8F32), d, acc)]

        (acc,) = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)], body)
        return _hsum_float_8(builder, acc)

    dtypes = (U8, int, I8T, int, F32T, I16T, int)
    if unpacked:

        @intrinsic
        def dot_unpacked(typingctx, codes, w, r, aq, t, ad, bsums, nb):
            return _signature((codes, w, r, aq, t, ad, bsums, nb), (U8, *dtypes)), codegen

        return dot_unpacked

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, bsums, nb):
        return _signature((w, r, aq, t, ad, bsums, nb), dtypes), codegen

    return dot


def _unpacker(block_bytes: int, vectors_of):
    """Intrinsic (w, r, out, nb): the <32 x i8> vectors `vectors_of(builder, block)` of the nb blocks of weight row
    r, stored one after the other into `out` u8 (1, ...): a row decoded once for all activation rows (ggml decodes
    it again for each)."""

    @intrinsic
    def unpack(typingctx, w, r, out, nb):
        if _signature((w, r, out, nb), (U8, int, U8, int)) is None:
            return None

        def codegen(context, builder, signature, args):
            w_, r_, o_, nb_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            orow = builder.bitcast(
                _row(context, builder, signature.args[2], o_, ir.Constant(I64, 0)), V32I8.as_pointer()
            )

            def body(b, carried):
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, block_bytes))])
                vectors = vectors_of(builder, blk)
                at = builder.mul(b, ir.Constant(I64, len(vectors)))
                for c, v in enumerate(vectors):
                    builder.store(v, builder.gep(orow, [builder.add(at, ir.Constant(I64, c))]), align=1)
                return []

            _loop(builder, nb_, [], body)
            return context.get_dummy_value()

        return types.none(w, types.int64, out, types.int64), codegen

    return unpack


tq1_0_dot = _tq_dot("tq1_0")
tq2_0_dot = _tq_dot("tq2_0")
_tq1_0_unpacked_dot = _tq_dot("tq1_0", unpacked=True)
tq1_0_unpack = _unpacker(54, tq1_0_codes)  # (w, r, codes u8 (1, nb*256), nb)


# -- Q1_0 -------------------------------------------------------------------------------------------------------------
def _q1_0_plus(builder, blk, k):
    """<32 x i1>: which elements of the block's Q8_0 block k are +d (bit j % 8 of sign byte 4k + j // 8), spread
    as `bytes_from_bits_32` does."""
    qs = _load(builder, blk, 2 + 4 * k, ir.VectorType(I8, 4))
    spread = _shuffle(builder, qs, qs, [j // 8 for j in range(32)])
    return builder.icmp_unsigned("!=", builder.and_(spread, ir.Constant(V32I8, _BITS)), _splat(V32I8, 0))


def _q1_0_codegen(unpacked: bool):
    """Codegen of `q1_0_dot` (w, r, aq, t, ad, nb); unpacked: (signs, w, r, aq, t, ad, nb) with the +-1 bytes of
    row r in `signs` u8 (1, nb*128) (`q1_0_unpack`), applied with `vpsignb`."""

    def codegen(context, builder, signature, args):
        if unpacked:
            srow = _row(context, builder, signature.args[0], args[0], ir.Constant(I64, 0))
            args, types_ = args[1:], signature.args[1:]
        else:
            types_ = signature.args
        w_, r_, aq_, t_, ad_, nb_ = args
        wrow = _row(context, builder, types_[0], w_, r_)
        arow = _row(context, builder, types_[2], aq_, t_)
        drow = _row(context, builder, types_[4], ad_, t_)
        ones8, ones16, zero = _splat(V32I8, 1), _splat(V16I16, 1), _splat(V32I8, 0)

        def body(b, carried):
            (acc,) = carried
            blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, 18))])
            ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 128))])
            dblk = builder.gep(drow, [builder.mul(b, ir.Constant(I64, 16))])
            part = None
            for k in range(4):  # the Q8_0 blocks 4b + k
                a = _load(builder, ablk, 32 * k, V32I8)
                if unpacked:
                    sblk = builder.gep(srow, [builder.mul(b, ir.Constant(I64, 128))])
                    signed = _psign(builder, a, _load(builder, sblk, 32 * k, V32I8))
                else:
                    signed = builder.select(_q1_0_plus(builder, blk, k), a, builder.sub(zero, a))
                lanes = builder.sitofp(_madd(builder, _maddubs(builder, ones8, signed), ones16), V8F32)
                da = _broadcast(builder, _load(builder, dblk, 4 * k, F32), V8F32)
                part = builder.fmul(da, lanes) if part is None else _fma(builder, da, lanes, part)
            dw = _broadcast(builder, _half(builder, blk, 0), V8F32)
            return [_fma(builder, dw, part, acc)]

        (acc,) = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)], body)
        return _hsum_float_8(builder, acc)

    return codegen


@intrinsic
def q1_0_dot(typingctx, w, r, aq, t, ad, nb):
    """(w, r, aq, t, ad, nb) -> f32: Q1_0 weight row r (nb blocks of 18 bytes: fp16 d, 16 bytes of signs, bit
    e % 8 of byte e // 8 set: +d) times Q8_0 activation row t (ad f32 (T, 4 nb) the fp16 d), as
    `quants.x86.q1_0` replays `ggml_vec_dot_q1_0_q8_0` (AVX2)."""
    return _signature((w, r, aq, t, ad, nb), (U8, int, I8T, int, F32T, int)), _q1_0_codegen(False)


@intrinsic
def _q1_0_unpacked_dot(typingctx, signs, w, r, aq, t, ad, nb):
    return _signature((signs, w, r, aq, t, ad, nb), (U8, U8, int, I8T, int, F32T, int)), _q1_0_codegen(True)


def _q1_0_signs(builder, blk) -> list:
    """The +-1 bytes of a Q1_0 block's four Q8_0 blocks, as <32 x i8>."""
    one, minus = _splat(V32I8, 1), _splat(V32I8, -1)
    return [builder.select(_q1_0_plus(builder, blk, k), one, minus) for k in range(4)]


q1_0_unpack = _unpacker(18, _q1_0_signs)  # (w, r, signs u8 (1, nb*128), nb)


# -- the kernels: weight rows in parallel, each row against every activation row (int8dot's calling convention) -----
@jit(parallel=True)
def _mv_tq1_0(nt, w, aq, ad, bsums, out):
    """From 2 activation rows, each weight row's codes are decoded once (`tq1_0_unpack`), 16 rows per task."""
    previous = use_threads(nt)
    T = aq.shape[0]
    nb = aq.shape[1] // 256
    rows = w.shape[0]
    if T == 1:
        for r in prange(rows):
            out[0, r] = tq1_0_dot(w, r, aq, 0, ad, bsums, nb)
    else:
        for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            codes = np.empty((1, 256 * nb), np.uint8)
            for r in range(task * ROWS_PER_TASK, min(rows, task * ROWS_PER_TASK + ROWS_PER_TASK)):
                tq1_0_unpack(w, r, codes, nb)
                for t in range(T):
                    out[t, r] = _tq1_0_unpacked_dot(codes, w, r, aq, t, ad, bsums, nb)
    use_threads(previous)


_TQ2_0_ROWS = tq_rows("tq2_0", TQ2_0_ROWS)
_Q1_0_ROWS = q1_0_rows(Q1_0_ROWS)


@jit(parallel=True)
def _mv_tq2_0(nt, w, aq, ad, bsums, out):
    """One activation row: TQ2_0_ROWS weight rows per call (`int8ir_ternary_rows.tq_rows`), the rest one by one;
    from 4 activation rows, eight-row groups with lanes = rows (`int8ir_tq2_gemm`)."""
    previous = use_threads(nt)
    T = aq.shape[0]
    nb = aq.shape[1] // 256
    rows = w.shape[0]
    if T == 1:
        R = TQ2_0_ROWS
        for g in prange(rows // R):
            y = _TQ2_0_ROWS(w, R * g, aq, 0, ad, bsums, nb)
            for i in range(R):
                out[0, R * g + i] = y[i]
        for r in range(rows - rows % R, rows):
            out[0, r] = tq2_0_dot(w, r, aq, 0, ad, bsums, nb)
    elif T >= 4 and rows >= TQ2_GROUP:  # lanes = weight rows (int8ir_tq2_gemm): from 4 activation rows it wins
        for g in prange((rows + TQ2_GROUP - 1) // TQ2_GROUP):
            scratch = np.empty(nb * TQ2_SCRATCH, np.uint8)
            # the last group starts at rows - 8: a few rows computed twice, with the same bits
            tq2_0_group(w, min(TQ2_GROUP * g, rows - TQ2_GROUP), aq, ad, bsums, nb, T, scratch, out)
    else:
        for r in prange(rows):
            for t in range(T):
                out[t, r] = tq2_0_dot(w, r, aq, t, ad, bsums, nb)
    use_threads(previous)


@jit(parallel=True)
def _mv_q1_0(nt, w, aq, ad, s, asum, out):
    """One activation row: Q1_0_ROWS weight rows per call (`int8ir_ternary_rows.q1_0_rows`), the rest one by
    one. From 2 activation rows, each weight row's signs are unpacked once (`q1_0_unpack`), 16 rows per task."""
    previous = use_threads(nt)
    T = aq.shape[0]
    nb = aq.shape[1] // 128
    rows = w.shape[0]
    if T == 1:
        R = Q1_0_ROWS
        for g in prange(rows // R):
            y = _Q1_0_ROWS(w, R * g, aq, 0, ad, nb)
            for i in range(R):
                out[0, R * g + i] = y[i]
        for r in range(rows - rows % R, rows):
            out[0, r] = q1_0_dot(w, r, aq, 0, ad, nb)
    else:
        for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            signs = np.empty((1, 128 * nb), np.uint8)
            for r in range(task * ROWS_PER_TASK, min(rows, task * ROWS_PER_TASK + ROWS_PER_TASK)):
                q1_0_unpack(w, r, signs, nb)
                for t in range(T):
                    out[t, r] = _q1_0_unpacked_dot(signs, w, r, aq, t, ad, nb)
    use_threads(previous)


KERNELS = {
    GGMLType.TQ1_0: (Q8_K, 54, 256, _mv_tq1_0),
    GGMLType.TQ2_0: (Q8_K, 66, 256, _mv_tq2_0),
    GGMLType.Q1_0: (Q8_0, 18, 128, _mv_q1_0),
}
"""GGML type -> (activation format, block bytes, elements per block, kernel): `int8lowbit.KERNELS` entries."""
