"""TQ1_0, TQ2_0 and Q1_0 decode (one activation row) in the llamacpp numerics: ggml's AVX2 vec_dot for R weight
rows per call, each row's integers and f32 steps those of `int8ir_ternary`'s one-row intrinsics (the replay's, bit
for bit), with the activation work of a block done once for the R rows and the weights prefetched.

A decode token streams every weight once. Per token of the bench models (8 layers, dim 1024, ffn 2816) the
one-row kernels were bound by different things: TQ2_0 by memory (as fast as a plain byte loop over the weights:
the hardware prefetcher stops at each 4 KiB page), TQ1_0 and Q1_0 by vector instructions (~100 per TQ1_0 block,
~50 per Q1_0 block, ~3 per cycle). So:

    TQ2_0  2 rows per call, each block prefetched `TQ2_0_PREFETCH` bytes ahead (both lines of a 66-byte block)
    TQ1_0  1 row; its base-3 digits in 4 instructions instead of 6 (`_digit`), the powers of 3 of qs[32:48]
           formed in 256-bit halves
    Q1_0   4 rows per call: each Q8_0 block's activations and d loaded once for the rows, the loop over the four
           Q8_0 blocks outside the loop over the rows (so the 16 AVX2 registers hold one activation block and
           the rows' sums: no spills); prefetched `Q1_0_PREFETCH` bytes ahead. (A `vpblendvb` with -a shared by
           the rows would save one more instruction per row and block, but LLVM rewrites any select of a and -a
           into (a ^ m) - m per row; forced by inline assembly, 3 rows per call were 0.96x of this, noise.)

Measured on the bench models' 57 matrices (one thread, CPU time, 16-20 alternating rounds in one process against
the one-row kernels): the products of a token 0.74-0.78x (TQ2_0), 0.94x (TQ1_0), 0.88x (Q1_0) the time. More rows
per call without prefetch were slower (1.15-1.25x: several interleaved streams); TQ1_0 gained nothing from
prefetch or from more rows (its decode is the cost), Q1_0 ~3% from prefetch.

Each intrinsic (w u8 (rows, row_bytes) C, r, aq int8 (T, C) C, t, ad f32 (T, nb), [bsums int16 (T, nb * 16),] nb)
returns the R results of weight rows r..r+R-1 times activation row t as a tuple of float32.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .int8ir import (
    _BITS,
    F32,
    F32T,
    I8,
    I8T,
    I16,
    I16T,
    I32,
    I64,
    U8,
    V8F32,
    V16I8,
    V16I16,
    V32I8,
    _broadcast,
    _fma,
    _fn,
    _half,
    _hsum_float_8,
    _load,
    _loop,
    _madd,
    _maddubs,
    _row,
    _shuffle,
    _signature,
    _splat,
)

__all__ = ["TQ", "q1_0_rows", "tq1_0_codes", "tq2_0_codes", "tq_rows"]

# Bytes ahead of the block being read that each block prefetches (per token on the bench model, TQ2_0: 2048
# 0.86x the time without, 4096 0.80-0.84x, 8192 0.80-0.84x; Q1_0 at 2048: ~0.97x of its 4-row kernel without).
TQ2_0_PREFETCH = 4096
Q1_0_PREFETCH = 2048
TQ2_0_ROWS, Q1_0_ROWS = 2, 4  # weight rows per call of the drivers (`int8ir_ternary._mv_*`; TQ1_0: 1)


def _prefetch(builder, ptr):
    """`prefetcht0` of the line at ptr (never faults: past the weight's end it is dropped)."""
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    builder.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


# -- the ternary codes ------------------------------------------------------------------------------------------------
def _flip(builder, v):
    return builder.xor(v, _splat(v.type, 0x80))


def _nine(builder, v):
    """9v mod 256 per byte as ggml's AVX2 TQ1_0 kernel forms it, (8v & -8) + v with 8v shifted in 16-bit lanes
    (as bytes, LLVM would fold the adds into a byte multiply, which x86 lacks and it emulates in 5 instructions)."""
    wide = ir.VectorType(I16, v.type.count // 2)
    v8 = builder.bitcast(builder.shl(builder.bitcast(v, wide), _splat(wide, 3)), v.type)
    return builder.add(builder.and_(v8, _splat(v.type, 0xF8)), v)


def _three(builder, v):
    return builder.add(v, builder.add(v, v))


def _digit(builder, m):
    """Top base-3 digit (3 m) >> 8 of the fixed-point bytes (`lowbit._trits`), [m > 85] + [m > 170], from m ^ 0x80:
    two signed compares (`vpcmpgtb`), where unsigned ones take a `vpmaxub` + `vpcmpeqb` pair each. The flip costs
    nothing: x 3^k + 128 = (x + 128) 3^k mod 256 (3^k is odd), so the powers are formed from the flipped bytes."""
    ty = m.type
    one, zero = _splat(ty, 1), _splat(ty, 0)
    d1 = builder.select(builder.icmp_signed(">", m, _splat(ty, 85 - 128)), one, zero)
    d2 = builder.select(builder.icmp_signed(">", m, _splat(ty, 170 - 128)), one, zero)
    return builder.add(d1, d2)


def tq1_0_codes(builder, blk) -> list:
    """block_tq1_0 (`lowbit.parts_tq1_0`'s layout) -> q of elements 32c..32c+31, c = 0..7, as <32 x i8>.

    qs[0:32]: digit k -> chunk k; qs[32:48]: digit k -> elements 160 + 16k + m (chunks 5, 6 and the first half
    of 7); qh[0:4]: digit k of byte m -> element 240 + 4k + m (the second half of chunk 7)."""
    x = _flip(builder, _load(builder, blk, 0, V32I8))
    x3, x9 = _three(builder, x), _nine(builder, x)
    codes = [_digit(builder, m) for m in (x, x3, x9, _nine(builder, x3), _nine(builder, x9))]  # x 3^k, k = 0..4
    y = _flip(builder, _load(builder, blk, 32, V16I8))
    y13 = _shuffle(builder, y, _three(builder, y), list(range(32)))  # [y | 3y]
    y927 = _nine(builder, y13)  # [9y | 27y]
    qh = builder.bitcast(_load(builder, blk, 48, I32), ir.VectorType(I8, 4))
    qh16 = _shuffle(builder, qh, qh, [m for _ in range(4) for m in range(4)])
    qh16 = _flip(builder, builder.mul(qh16, ir.Constant(V16I8, [3**k for k in range(4) for _ in range(4)])))
    y81y243 = _nine(builder, y927)
    y81 = _shuffle(
        builder, _shuffle(builder, y81y243, y81y243, list(range(16))), qh16, list(range(32))
    )  # [81y | qh 3^k]
    return codes + [_digit(builder, m) for m in (y13, y927, y81)]


def tq2_0_codes(builder, blk) -> list:
    """block_tq2_0: bits 2l..2l+1 of qs[32h + m] -> element 128h + 32l + m; chunk 4h + l, as <32 x i8>."""
    codes = []
    for h in range(2):
        qs = _load(builder, blk, 32 * h, V32I8)
        for sh in range(4):
            v = builder.lshr(qs, _splat(V32I8, 2 * sh)) if sh else qs
            codes.append(builder.and_(v, _splat(V32I8, 3)))
    return codes


# type -> (block bytes, offset of the fp16 d, block -> the 8 code vectors, prefetch distance or 0)
TQ = {"tq1_0": (54, 52, tq1_0_codes, 0), "tq2_0": (66, 64, tq2_0_codes, TQ2_0_PREFETCH)}


def _tuple(context, builder, signature, accs):
    return context.make_tuple(builder, signature.return_type, [_hsum_float_8(builder, acc) for acc in accs])


def tq_rows(kind: str, R: int):
    """Intrinsic (w, r, aq, t, ad, bsums, nb) -> R x f32: `ggml_vec_dot_tq{1,2}_0_q8_K` (AVX2) of weight rows
    r..r+R-1 and activation row t, each as `int8ir_ternary._tq_dot` computes it:

        s16 = sum over the 8 chunks of maddubs(q, y) - bsums;  acc = fma(float(madd(s16, 1)), fl(d_a * d_w), acc)"""
    size, d_at, codes_of, ahead = TQ[kind]

    def codegen(context, builder, signature, args):
        w_, r_, aq_, t_, ad_, bs_, nb_ = args
        ty = signature.args
        wrows = [_row(context, builder, ty[0], w_, builder.add(r_, ir.Constant(I64, i))) for i in range(R)]
        arow = _row(context, builder, ty[2], aq_, t_)
        drow = _row(context, builder, ty[4], ad_, t_)
        bsrow = _row(context, builder, ty[5], bs_, t_)

        def body(b, accs):
            ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
            a = [_load(builder, ablk, 32 * c, V32I8) for c in range(8)]
            bs = _load(builder, bsrow, builder.mul(b, ir.Constant(I64, 32)), V16I16)
            da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
            out = []
            for wrow, acc in zip(wrows, accs, strict=True):
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, size))])
                if ahead:  # both lines a 66-byte block can touch
                    for line in range(0, size, 64):
                        _prefetch(builder, builder.gep(blk, [ir.Constant(I64, ahead + line)]))
                s16 = None
                for c, q in enumerate(codes_of(builder, blk)):
                    p = _maddubs(builder, q, a[c])
                    s16 = p if s16 is None else builder.add(s16, p)
                lanes = _madd(builder, builder.sub(s16, bs), _splat(V16I16, 1))
                d = _broadcast(builder, builder.fmul(da, _half(builder, blk, d_at)), V8F32)
                out.append(_fma(builder, builder.sitofp(lanes, V8F32), d, acc))
            return out

        return _tuple(context, builder, signature, _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)] * R, body))

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, bsums, nb):
        sig = _signature((w, r, aq, t, ad, bsums, nb), (U8, int, I8T, int, F32T, I16T, int))
        return None if sig is None else (types.UniTuple(types.float32, R)(*sig.args), codegen)

    return dot


def q1_0_rows(R: int):
    """Intrinsic (w, r, aq, t, ad, nb) -> R x f32: `ggml_vec_dot_q1_0_q8_0` (AVX2) of weight rows r..r+R-1 and
    Q8_0 activation row t, each as `int8ir_ternary.q1_0_dot` computes it:

        I_K = madd(maddubs(1, bit ? a : -a), 1);  blk = d_a0 float(I_0);  blk = fma(d_aK, float(I_K), blk);
        acc = fma(d_w, blk, acc)"""

    def codegen(context, builder, signature, args):
        w_, r_, aq_, t_, ad_, nb_ = args
        ty = signature.args
        wrows = [_row(context, builder, ty[0], w_, builder.add(r_, ir.Constant(I64, i))) for i in range(R)]
        arow = _row(context, builder, ty[2], aq_, t_)
        drow = _row(context, builder, ty[4], ad_, t_)
        ones8, ones16, zero = _splat(V32I8, 1), _splat(V16I16, 1), _splat(V32I8, 0)
        bits = ir.Constant(V32I8, _BITS)

        def body(b, accs):
            ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 128))])
            dblk = builder.gep(drow, [builder.mul(b, ir.Constant(I64, 16))])
            blks = [builder.gep(wrow, [builder.mul(b, ir.Constant(I64, 18))]) for wrow in wrows]
            for blk in blks:
                _prefetch(builder, builder.gep(blk, [ir.Constant(I64, Q1_0_PREFETCH)]))
            parts = [None] * R
            for k in range(4):  # the Q8_0 blocks 4b + k, once for the R rows
                a = _load(builder, ablk, 32 * k, V32I8)
                na = builder.sub(zero, a)  # never wraps: the Q8_0 quantizer writes no -128
                da = _broadcast(builder, _load(builder, dblk, 4 * k, F32), V8F32)
                for i, blk in enumerate(blks):
                    # bit j % 8 of sign byte 4k + j // 8 -> element j (`bytes_from_bits_32`)
                    qs = _load(builder, blk, 2 + 4 * k, ir.VectorType(I8, 4))
                    spread = _shuffle(builder, qs, qs, [j // 8 for j in range(32)])
                    plus = builder.icmp_unsigned("!=", builder.and_(spread, bits), zero)
                    signed = builder.select(plus, a, na)
                    lanes = builder.sitofp(_madd(builder, _maddubs(builder, ones8, signed), ones16), V8F32)
                    parts[i] = builder.fmul(da, lanes) if parts[i] is None else _fma(builder, da, lanes, parts[i])
            dws = [_broadcast(builder, _half(builder, blk, 0), V8F32) for blk in blks]
            return [_fma(builder, dw, part, acc) for dw, part, acc in zip(dws, parts, accs, strict=True)]

        return _tuple(context, builder, signature, _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)] * R, body))

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, nb):
        sig = _signature((w, r, aq, t, ad, nb), (U8, int, I8T, int, F32T, int))
        return None if sig is None else (types.UniTuple(types.float32, R)(*sig.args), codegen)

    return dot
