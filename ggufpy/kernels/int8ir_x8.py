"""The eight-row integer kernels of ggml's repacked Q4_0 / Q4_K gemv (`int8ir.py` has the helpers and the row kernels).

ggml's repacked layouts (`block_q4_0x8`, `block_q4_Kx8`) keep one f32 lane per weight row, so each output is
`acc = fma(float(integer block sum), scale, acc)` with no horizontal f32 sum. Here eight GGUF rows are dotted
at once and their eight integer lane vectors reduced to one vector of eight row sums by pairwise adds (a
transpose), instead of a horizontal integer sum per row and block.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .int8ir import (
    F32,
    F32T,
    HALF,
    I8T,
    I16,
    I16T,
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
    _nibbles,
    _nibbles32,
    _row,
    _shuffle,
    _signature,
    _splat,
)

__all__ = ["Q4_0X8_BYTES", "q4_0_dot8", "q4_0x8_dot", "q4_k_dot8"]


def _hadd(builder, a, b):
    """`vphaddd` on <8 x i32>: [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]."""
    even = _shuffle(builder, a, b, [0, 2, 8, 10, 4, 6, 12, 14])
    odd = _shuffle(builder, a, b, [1, 3, 9, 11, 5, 7, 13, 15])
    return builder.add(even, odd)


def _reduce8(builder, v: list):
    """8 vectors <8 x i32> -> <8 x i32> whose lane i is the sum of v[i]'s lanes (exact): a transpose by
    pairwise adds, as ggml's repacked kernels avoid per-row horizontal sums."""

    def hadd(a, b):
        return _hadd(builder, a, b)

    h0, h1 = hadd(hadd(v[0], v[1]), hadd(v[2], v[3])), hadd(hadd(v[4], v[5]), hadd(v[6], v[7]))
    lo = _shuffle(builder, h0, h1, [0, 1, 2, 3, 8, 9, 10, 11])
    hi = _shuffle(builder, h0, h1, [4, 5, 6, 7, 12, 13, 14, 15])
    return builder.add(lo, hi)


def _halves8(builder, ptrs: list, offset) -> ir.Value:
    """<8 x float>: the fp16 field at `offset` of each of 8 blocks."""
    v = ir.Constant(ir.VectorType(HALF, 8), ir.Undefined)
    for i, p in enumerate(ptrs):
        v = builder.insert_element(v, _load(builder, p, offset, HALF), ir.Constant(I32, i))
    return builder.fpext(v, V8F32)


def _store8(context, builder, signature, out_arg, t, r0, v):
    """out[t, r0:r0+8] = v (f32 lanes)."""
    orow = _row(context, builder, signature.args[-1], out_arg, t)
    builder.store(
        v, builder.bitcast(builder.gep(orow, [builder.mul(r0, ir.Constant(I64, 4))]), V8F32.as_pointer()), align=4
    )


def _signature8(args, dtypes):
    sig = _signature(args[:-1], dtypes)
    out = args[-1]
    if sig is None or not (isinstance(out, types.Array) and out.ndim == 2 and out.dtype == F32T and out.layout == "C"):
        return None
    return types.void(*sig.args, out)


def q4_0_dot8():
    """Intrinsic (w, r0, aq, t, ad, s, asum, nb, out): out[t, r0:r0+8] for Q4_0 rows r0..r0+7, as the repacked
    gemv (`repack_q8_0.py`): acc = fma(float(block sum), d_w * d_a, acc) per block, one lane per row."""

    @intrinsic
    def dot(typingctx, w, r0, aq, t, ad, s, asum, nb, out):
        sig = _signature8((w, r0, aq, t, ad, s, asum, nb, out), (U8, int, I8T, int, F32T, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            w_, r0_, aq_, t_, ad_, _, asum_, nb_, out_ = args
            arr = context.make_array(signature.args[0])(context, builder, w_)
            row_bytes = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
            w0 = _row(context, builder, signature.args[0], w_, r0_)
            rows = [builder.gep(w0, [builder.mul(row_bytes, ir.Constant(I64, i))]) for i in range(8)]
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            sumrow = _row(context, builder, signature.args[6], asum_, t_)

            def body(b, carried):
                (acc,) = carried
                off = builder.mul(b, ir.Constant(I64, 18))
                blks = [builder.gep(p, [off]) for p in rows]
                a = _load(builder, arow, builder.mul(b, ir.Constant(I64, 32)), V32I8)
                lanes = []
                for blk in blks:
                    u = _nibbles(builder, _load(builder, blk, 2, V16I8))
                    lanes.append(_madd(builder, _maddubs(builder, u, a), _splat(V16I16, 1)))
                asum = _hsum_i32(builder, _load(builder, sumrow, builder.mul(b, ir.Constant(I64, 32)), V8I32))
                isum = builder.sub(
                    _reduce8(builder, lanes), _broadcast(builder, builder.mul(asum, ir.Constant(I32, 8)), V8I32)
                )
                da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                d = builder.fmul(_halves8(builder, blks, 0), _broadcast(builder, da, V8F32))
                return [_fma(builder, builder.sitofp(isum, V8F32), d, acc)]

            (acc,) = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)], body)
            _store8(context, builder, signature, out_, t_, r0_, acc)
            return context.get_dummy_value()

        return sig, codegen

    return dot


# One Q4_0 block of eight rows, interleaved (`int8dot.interleaved`; ggml's `block_q4_0x8` has the same idea):
#
#     bytes 0-15     d of rows 0..7 (fp16)
#     bytes 16-47    qs of row 0 | qs of row 4      (16 bytes each: low nibbles = elements 0-15, high = 16-31)
#     bytes 48-79    qs of row 1 | qs of row 5
#     bytes 80-111   qs of row 2 | qs of row 6
#     bytes 112-143  qs of row 3 | qs of row 7
#
# so that the eight rows stream as one, each 32-byte load holds two rows (no lane inserts), and three
# `vphaddd` put the eight row sums in order.
Q4_0X8_BYTES = 144


def q4_0x8_dot():
    """Intrinsic (w, g, aq, t, ad, s, asum, nb, out): out[t, 8g:8g+8] for the interleaved Q4_0 group g (w u8
    (rows / 8, nb * 144)), with the f32 steps of `q4_0_dot8`: acc = fma(float(block sum), d_w * d_a, acc)."""

    @intrinsic
    def dot(typingctx, w, g, aq, t, ad, s, asum, nb, out):
        sig = _signature8((w, g, aq, t, ad, s, asum, nb, out), (U8, int, I8T, int, F32T, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            w_, g_, aq_, t_, ad_, _, asum_, nb_, out_ = args
            group = _row(context, builder, signature.args[0], w_, g_)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            sumrow = _row(context, builder, signature.args[6], asum_, t_)
            ones = _splat(V16I16, 1)

            def body(b, carried):
                (acc,) = carried
                blk = builder.gep(group, [builder.mul(b, ir.Constant(I64, Q4_0X8_BYTES))])
                ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 32))])
                a_lo = _load(builder, ablk, 0, V16I8)
                a_hi = _load(builder, ablk, 16, V16I8)
                a_lo, a_hi = (_shuffle(builder, a, a, list(range(16)) * 2) for a in (a_lo, a_hi))
                lanes = []
                for c in range(4):  # rows c and c + 4
                    lo, hi = _nibbles32(builder, _load(builder, blk, 16 + 32 * c, V32I8))
                    p = builder.add(_maddubs(builder, lo, a_lo), _maddubs(builder, hi, a_hi))  # |p| <= 7680
                    lanes.append(_madd(builder, p, ones))
                h = _hadd(builder, _hadd(builder, lanes[0], lanes[1]), _hadd(builder, lanes[2], lanes[3]))
                asum = _hsum_i32(builder, _load(builder, sumrow, builder.mul(b, ir.Constant(I64, 32)), V8I32))
                isum = builder.sub(h, _broadcast(builder, builder.mul(asum, ir.Constant(I32, 8)), V8I32))
                da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                dw = builder.fpext(_load(builder, blk, 0, ir.VectorType(HALF, 8)), V8F32)
                d = builder.fmul(dw, _broadcast(builder, da, V8F32))
                return [_fma(builder, builder.sitofp(isum, V8F32), d, acc)]

            (acc,) = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)], body)
            _store8(context, builder, signature, out_, t_, builder.mul(g_, ir.Constant(I64, 8)), acc)
            return context.get_dummy_value()

        return sig, codegen

    return dot


_KMASK1, _KMASK2, _KMASK3 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303


def _k4_scales_mins_vec(builder, blk):
    """ggml's `utmp` unpacking of a Q4_K block's 12 scale bytes: (scales <8 x i16>, mins <8 x i32>)."""
    u = [_load(builder, blk, 4 + 4 * i, I32) for i in range(3)]
    k1, k2, k3 = (ir.Constant(I32, k) for k in (_KMASK1, _KMASK2, _KMASK3))
    c4, c6 = ir.Constant(I32, 4), ir.Constant(I32, 6)
    u3 = builder.or_(
        builder.and_(builder.lshr(u[2], c4), k2), builder.shl(builder.and_(builder.lshr(u[1], c6), k3), c4)
    )
    u2 = builder.and_(u[1], k1)
    u1 = builder.or_(builder.and_(u[2], k2), builder.shl(builder.and_(builder.lshr(u[0], c6), k3), c4))
    u0 = builder.and_(u[0], k1)
    words = ir.Constant(ir.VectorType(I32, 4), ir.Undefined)
    for i, x in enumerate((u0, u1, u2, u3)):
        words = builder.insert_element(words, x, ir.Constant(I32, i))
    b16 = builder.bitcast(words, V16I8)
    scales = builder.zext(_shuffle(builder, b16, b16, list(range(8))), ir.VectorType(I16, 8))
    mins = builder.zext(_shuffle(builder, b16, b16, list(range(8, 16))), V8I32)
    return scales, mins


def q4_k_dot8(grouped: bool = False):
    """Intrinsic (w, r0, aq, t, ad, bsums, nb, out): out[t, r0:r0+8] for Q4_K rows r0..r0+7 as the repacked
    q4_K_8x8 gemv (`repack.py`, piece 256): per super-block I and M of each row (int32), then
    acc = fma(float(I), fl(dw * da), acc), accm = fma(float(M), fl(dmin * da), accm); out = acc - accm.
    grouped: w is (rows / 8, nb * 1152), block b of the eight rows side by side, one stream."""

    @intrinsic
    def dot(typingctx, w, r0, aq, t, ad, bsums, nb, out):
        sig = _signature8((w, r0, aq, t, ad, bsums, nb, out), (U8, int, I8T, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r0_, aq_, t_, ad_, bs_, nb_, out_ = args
            if grouped:
                w0 = _row(context, builder, signature.args[0], w_, builder.sdiv(r0_, ir.Constant(I64, 8)))
                rows = [builder.gep(w0, [ir.Constant(I64, 144 * i)]) for i in range(8)]
            else:
                arr = context.make_array(signature.args[0])(context, builder, w_)
                row_bytes = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
                w0 = _row(context, builder, signature.args[0], w_, r0_)
                rows = [builder.gep(w0, [builder.mul(row_bytes, ir.Constant(I64, i))]) for i in range(8)]
            stride = ir.Constant(I64, 1152 if grouped else 144)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            bsrow = _row(context, builder, signature.args[5], bs_, t_)
            zero = ir.Constant(V8F32, [0.0] * 8)

            def body(b, carried):
                acc, accm = carried
                off = builder.mul(b, stride)
                blks = [builder.gep(p, [off]) for p in rows]
                ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
                bs = _load(builder, bsrow, builder.mul(b, ir.Constant(I64, 32)), V16I16)
                pairs = _madd(builder, bs, _splat(V16I16, 1))  # bsum_2j + bsum_2j+1: one per sub-block j
                isums, msums = [], []
                for blk in blks:
                    scales, mins = _k4_scales_mins_vec(builder, blk)
                    isum = ir.Constant(V8I32, [0] * 8)
                    for c in range(4):
                        lo, hi = _nibbles32(builder, _load(builder, blk, 16 + 32 * c, V32I8))
                        for j, u in ((2 * c, lo), (2 * c + 1, hi)):
                            a = _load(builder, ablk, 32 * j, V32I8)
                            scale = _shuffle(builder, scales, scales, [j] * 16)
                            isum = builder.add(isum, _madd(builder, _maddubs(builder, u, a), scale))
                    isums.append(isum)
                    msums.append(builder.mul(mins, pairs))
                da = _broadcast(builder, _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32), V8F32)
                dd = builder.fmul(_halves8(builder, blks, 0), da)
                dm = builder.fmul(_halves8(builder, blks, 2), da)
                acc = _fma(builder, builder.sitofp(_reduce8(builder, isums), V8F32), dd, acc)
                accm = _fma(builder, builder.sitofp(_reduce8(builder, msums), V8F32), dm, accm)
                return [acc, accm]

            acc, accm = _loop(builder, nb_, [zero, zero], body)
            _store8(context, builder, signature, out_, t_, r0_, builder.fsub(acc, accm))
            return context.get_dummy_value()

        return sig, codegen

    return dot
