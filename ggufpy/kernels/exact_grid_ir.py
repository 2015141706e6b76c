"""LLVM IR for the exact numerics' grid-type products (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M):
one weight row times f32 activation rows, as a numba intrinsic (`exact_dot`), the blocks decoded in registers by
`exact_grid_decode.DECODERS` (eight unscaled weights w8 = grid row ^ sign mask, and the sub-blocks' f32 scales).
Per activation row and sub-block s of `SUB` elements:

    d8 = w8_0 * x8_0;  d8 = fma(w8_k, x8_k, d8) ...         8 lanes, over the sub-block
    acc = fma(broadcast(scale_s), d8, acc)                  one chain per activation row
    y = hsum_float_8(acc)                                   (arch/x86/quants.c's pairing, at the end)

scale_s the reference's f32 sub-block scale, so y differs from `x @ dequantize(W).T` in f32 rounding only (the
reference rounds scale * value per weight; here the scale multiplies a sub-block's 8-lane sums). Each activation
row runs exactly this sequence of f32 operations whatever the other rows are (no fast-math flags: LLVM may not
reassociate or fuse), so a row of a T-row call is bit for bit the same row alone:

    T = 1       one pass over the weight row, each block decoded as the pass reads it (the accumulator in a
                register: the decode product)
    T >= 2      the weight row decoded once into a scratch (`_stage`: 256 f32 values and the scales per block),
                then passes of 4 activation rows (accumulators in registers, each w8 load serving the 4 rows)
                and one pass of the rest, reading the scratch: the same values, so the same f32 steps
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .exact_grid_decode import BLOCK_BYTES, DECODERS, SUB, broadcast
from .int8ir import F32, I8, I32, I64, V8F32, _fma, _hsum_float_8, _load, _loop, _row

__all__ = ["STAGE_FLOATS", "exact_dot"]


def _c(v: int):
    return ir.Constant(I64, v)


# -- the row kernel -------------------------------------------------------------------------------------------------
def _table(context, builder, arrty, arr):
    return builder.bitcast(context.make_array(arrty)(context, builder, arr).data, I8.as_pointer())


def _is(a, dtype, ndim: int) -> bool:
    return isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C" and a.dtype == dtype


def _pass(context, builder, sig, args, name: str, rows: int, t0, staged: bool):
    """Activation rows t0 .. t0 + rows - 1 against the whole weight row: one pass over its blocks, decoding each
    (`staged`: reading the values and scales `_stage` wrote)."""
    bb, sub, decode = BLOCK_BYTES[name], SUB[name], DECODERS[name]
    per = sub // 8  # w8 per scale
    q_, r_, xv_, nb_, out_, grid_, signs_, buf_ = args
    xty, oty = sig.args[2], sig.args[4]
    wrow = _row(context, builder, sig.args[0], q_, r_)
    xrows = [_row(context, builder, xty, xv_, builder.add(t0, _c(k))) for k in range(rows)]
    g = _table(context, builder, sig.args[5], grid_)
    s = _table(context, builder, sig.args[6], signs_)
    buf = _table(context, builder, sig.args[7], buf_)
    zero = ir.Constant(V8F32, [0.0] * 8)

    def block(b, accs):
        xb = [builder.gep(x, [builder.mul(b, _c(1024))]) for x in xrows]
        if staged:
            values = builder.gep(buf, [builder.mul(b, _c(1024))])
            at = builder.gep(buf, [builder.add(builder.mul(nb_, _c(1024)), builder.mul(b, _c(64)))])

            def scale(i):
                return broadcast(builder, _load(builder, at, 4 * i, F32, align=4), V8F32)

            def group(ib):
                return [_load(builder, values, 32 * (4 * ib + k), V8F32, align=32) for k in range(4)]
        else:
            scales, group = decode(builder, builder.gep(wrow, [builder.mul(b, _c(bb))]), g, s)

            def scale(i):
                return builder.shuffle_vector(scales, scales, ir.Constant(ir.VectorType(I32, 8), [i] * 8))

        accs = list(accs)
        for ib in range(8):
            ws = group(ib)
            for h in range(4 // per):  # the scales of this 32-element piece
                sidx = ib * (4 // per) + h
                sc = scale(sidx)
                for k in range(rows):
                    d8 = None
                    for j in range(per):
                        x8 = _load(builder, xb[k], 4 * (32 * ib + 8 * (per * h + j)), V8F32, align=4)
                        w8 = ws[per * h + j]
                        d8 = builder.fmul(w8, x8) if d8 is None else _fma(builder, w8, x8, d8)
                    accs[k] = _fma(builder, sc, d8, accs[k])
        return accs

    accs = _loop(builder, nb_, [zero] * rows, block)
    for k in range(rows):
        orow = _row(context, builder, oty, out_, builder.add(t0, _c(k)))
        at = builder.bitcast(builder.gep(orow, [builder.mul(r_, _c(4))]), F32.as_pointer())
        builder.store(_hsum_float_8(builder, accs[k]), at)


def _stage(context, builder, sig, args, name: str):
    """The whole weight row decoded into buf: 256 f32 values per block, then 16 f32 scales per block."""
    bb, decode = BLOCK_BYTES[name], DECODERS[name]
    q_, r_, _, nb_, _, grid_, signs_, buf_ = args
    wrow = _row(context, builder, sig.args[0], q_, r_)
    g = _table(context, builder, sig.args[5], grid_)
    s = _table(context, builder, sig.args[6], signs_)
    buf = _table(context, builder, sig.args[7], buf_)

    def block(b, _):
        scales, group = decode(builder, builder.gep(wrow, [builder.mul(b, _c(bb))]), g, s)
        values = builder.gep(buf, [builder.mul(b, _c(1024))])
        for ib in range(8):
            for k, w8 in enumerate(group(ib)):
                at = builder.gep(values, [_c(32 * (4 * ib + k))])
                builder.store(w8, builder.bitcast(at, V8F32.as_pointer()), align=32)
        at = builder.gep(buf, [builder.add(builder.mul(nb_, _c(1024)), builder.mul(b, _c(64)))])
        builder.store(scales, builder.bitcast(at, scales.type.as_pointer()), align=4)
        return []

    _loop(builder, nb_, [], block)


STAGE_FLOATS = 272
"""f32 per super-block of the scratch `exact_dot` takes (256 values, 16 scales)."""


def exact_dot(name: str, most: int = 4):
    """Intrinsic (q, r, xv, nb, out, grid, signs, buf): out[t, r] = weight row r of q (u8 (R, nb * block bytes),
    C) . activation row t of xv (f32 (T, 256 nb), C) for every t, out f32 (T, R'), C; grid = F32_GRIDS[name],
    signs = SIGN_MASKS[SIGN_TABLE[name]] (any u32 array for IQ1), buf f32[STAGE_FLOATS * nb] 32-byte aligned
    scratch. One activation row: the blocks decoded in registers as the pass reads them. More: the row decoded
    once into buf, then passes of `most` activation rows and one of the rest over it (the same f32 steps)."""

    @intrinsic
    def dot(typingctx, q, r, xv, nb, out, grid, signs, buf):
        ok = (
            _is(q, types.uint8, 2)
            and _is(xv, types.float32, 2)
            and _is(out, types.float32, 2)
            and _is(buf, types.float32, 1)
            and all(isinstance(a, types.Integer) for a in (r, nb))
            and all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (grid, signs))
        )
        if not ok:
            return None
        sig = types.void(q, types.int64, xv, types.int64, out, grid, signs, buf)

        def codegen(context, builder, signature, args):
            T = cgutils.unpack_tuple(
                builder, context.make_array(signature.args[2])(context, builder, args[2]).shape, 2
            )[0]
            with builder.if_else(builder.icmp_signed("==", T, _c(1))) as (one, many):
                with one:
                    _pass(context, builder, signature, args, name, 1, _c(0), staged=False)
                with many:
                    _stage(context, builder, signature, args, name)
                    full = builder.sdiv(T, _c(most))

                    def chunk(c, _):
                        _pass(context, builder, signature, args, name, most, builder.mul(c, _c(most)), staged=True)
                        return []

                    _loop(builder, full, [], chunk)
                    rest = builder.sub(T, builder.mul(full, _c(most)))
                    t0 = builder.mul(full, _c(most))
                    for k in range(1, most):
                        with builder.if_then(builder.icmp_signed("==", rest, _c(k))):
                            _pass(context, builder, signature, args, name, k, t0, staged=True)
            return context.get_dummy_value()

        return sig, codegen

    return dot
