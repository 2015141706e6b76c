"""The grid types' tiled kernel (T >= 8 activation rows, `ggufpy.quants.x86.tiled`) as LLVM IR.

    grid_tiles(name)(w, r, ab, adt, T, nb, grid, signs, scratch, out)    out[t, r] for every t < T

Weight matrices of 8 rows or more run `int8grid_gemm`: the call for a row r with r % 8 == 0 computes rows
r..r+8 (the last group starts at rows - 8, recomputing a few rows, the same bits) with lanes = weight rows, the
others return at once; the drivers (`int8grid.py`) call every row, 16 to a parallel task, so each group runs
once. Under 8 rows, each row runs alone here: decoded once into an L1 scratch, then eight activation rows at a
time against it.

Per super-block b of weight row r, the tiled kernel's integer s1 = sum_e sc_e * v_e * q_e is exact, so any exact
way of computing it gives the same bits. `int8ir_iqgrid` follows ggml's vec_dot (`vpsignb` of the activations,
then `vpmaddubsw`, `vpmaddwd`; IQ1: twice, the delta apart). Here the weight's signed values are built once:

    v = sign * grid                     IQ2_*, IQ3_* (|v| <= 62)
    v = 8 grid + delta sign             IQ1_S, IQ1_M (|v| <= 9: the tiled kernel's value, s1 = 8 s_grid + s_delta)

and the activations are biased to unsigned bytes q + 128 (1..255: Q8_K's |q| <= 127), so each 32 elements cost
one `vpmaddubsw(q + 128, v)` (pairs <= 2 * 255 * 62 < 2^15, no saturation) and one `vpmaddwd` with the scales:

    s1 = sum_e sc_e v_e (q_e + 128) - 128 sum_e sc_e v_e        the second sum (`corr`) once per weight block

(|first sum| < 256 * 31 * 62 * 255 < 2^31). The eight rows' lane sums reduce in one transpose-add tree, then the
f32 epilogue of `quants.x86.tiled` runs on eight rows at once: p = fl(float(s1) * fl(d_w * c)), y = fma(p, d_a, y)
from 0, one super-block at a time in order; y stays in a register across the row's blocks. A last group that
would overrun T starts at T - 8 (recomputing a few rows, the same bits).

Scratch (u8, nb * `SCRATCH_PER_BLOCK`, sized for `int8grid_gemm`'s group); one row uses v (nb, 8, 32) i8 | the
`vpmaddwd` scales (nb, 8, 16) i16 | corr (nb,) i32 | d_w * c (nb,) f32 of it."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import int8grid_gemm
from ._numba import jit
from .int8grid_gemm import group_tiles, signed_values
from .int8ir import (
    F32,
    I32,
    I64,
    V8F32,
    V8I32,
    V16I16,
    V32I8,
    _broadcast,
    _fma,
    _hsum_i32,
    _load,
    _loop,
    _madd,
    _maddubs,
    _row,
    _shuffle,
    _splat,
)
from .int8ir_iqgrid import TYPES, _chunks, _half, _iq1_m_d, _table

__all__ = ["SCRATCH_PER_BLOCK", "activation_tiles", "grid_tiles"]

ROWS = 8  # activation rows per group: eight <8 x i32> accumulators, one <8 x f32> of outputs
# scratch bytes per super-block: a decoded group of eight weight rows (`int8grid_gemm`), or one row here
SCRATCH_PER_BLOCK = max(int8grid_gemm.SCRATCH_PER_BLOCK, 256 + 256 + 8)


@jit
def activation_tiles(aq, ad):
    """aq int8 (T, C), ad f32 (T, nb) -> (q + 128 as u8 (T, C), d transposed f32 (nb, T)): the tile loop's
    operands, once per product."""
    T, C = aq.shape
    ab = np.empty((T, C), np.uint8)
    for t in range(T):
        for k in range(C):
            ab[t, k] = np.uint8(np.int16(aq[t, k]) + 128)
    return ab, np.ascontiguousarray(ad.T)


def _decode_row(builder, name, wrow, nb, gtab, stab, scratch):
    """Every super-block of the weight row into the scratch."""
    size, c = TYPES[name]
    sc_at = builder.mul(nb, ir.Constant(I64, 256))
    corr_at = builder.mul(nb, ir.Constant(I64, 512))
    dc_at = builder.add(corr_at, builder.mul(nb, ir.Constant(I64, 4)))

    def block(b, _):
        blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, size))])
        corr = ir.Constant(V8I32, [0] * 8)
        for ib, (u, s, scale) in enumerate(_chunks(builder, name, blk, gtab, stab)):
            v = signed_values(builder, name, u, s)
            at = builder.add(builder.mul(b, ir.Constant(I64, 256)), ir.Constant(I64, 32 * ib))
            builder.store(v, builder.bitcast(builder.gep(scratch, [at]), V32I8.as_pointer()), align=1)
            at = builder.add(sc_at, at)
            builder.store(scale, builder.bitcast(builder.gep(scratch, [at]), V16I16.as_pointer()), align=1)
            corr = builder.add(corr, _madd(builder, _maddubs(builder, _splat(V32I8, -128), v), scale))  # 128 v
        four_b = builder.mul(b, ir.Constant(I64, 4))
        at = builder.gep(scratch, [builder.add(corr_at, four_b)])
        builder.store(_hsum_i32(builder, corr), builder.bitcast(at, I32.as_pointer()), align=1)
        dw = _iq1_m_d(builder, blk) if name == "IQ1_M" else _half(builder, blk, 0)
        at = builder.gep(scratch, [builder.add(dc_at, four_b)])
        builder.store(builder.fmul(dw, ir.Constant(F32, c)), builder.bitcast(at, F32.as_pointer()), align=1)
        return []

    _loop(builder, nb, [], block)


def _sums8(builder, v):
    """Eight <8 x i32> -> <8 x i32> of their lane sums, in a transpose-add tree (exact: integers)."""

    def pairs(a, b, lo, hi):
        return builder.add(_shuffle(builder, a, b, lo), _shuffle(builder, a, b, hi))

    e1 = [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]
    e2 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    e3 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    a = [pairs(v[2 * i], v[2 * i + 1], *e1) for i in range(4)]
    b = [pairs(a[0], a[1], *e2), pairs(a[2], a[3], *e2)]
    return pairs(b[0], b[1], *e3)


def _tiles(context, builder, sig, args, name, scratch):
    """out[t, r] for the groups of eight activation rows, from the decoded row in the scratch."""
    _, r_, ab_, adt_, T_, nb_, _, _, _, out_ = args
    abty, adty, oty = sig.args[2], sig.args[3], sig.args[9]
    sc_at = builder.mul(nb_, ir.Constant(I64, 256))
    corr_at = builder.mul(nb_, ir.Constant(I64, 512))
    dc_at = builder.add(corr_at, builder.mul(nb_, ir.Constant(I64, 4)))
    groups = builder.sdiv(builder.add(T_, ir.Constant(I64, ROWS - 1)), ir.Constant(I64, ROWS))
    last = builder.sub(T_, ir.Constant(I64, ROWS))

    def group(g, _):
        t0 = builder.mul(g, ir.Constant(I64, ROWS))
        t0 = builder.select(builder.icmp_signed(">", t0, last), last, t0)
        rows = [_row(context, builder, abty, ab_, builder.add(t0, ir.Constant(I64, k))) for k in range(ROWS)]

        def block(b, carried):
            (y,) = carried
            base = builder.mul(b, ir.Constant(I64, 256))
            lanes = [ir.Constant(V8I32, [0] * 8)] * ROWS
            for ib in range(8):
                at = builder.add(base, ir.Constant(I64, 32 * ib))
                v = _load(builder, scratch, at, V32I8)
                scale = _load(builder, scratch, builder.add(sc_at, at), V16I16)
                for k in range(ROWS):
                    p = _maddubs(builder, _load(builder, rows[k], at, V32I8), v)
                    lanes[k] = builder.add(lanes[k], _madd(builder, p, scale))
            four_b = builder.mul(b, ir.Constant(I64, 4))
            corr = _load(builder, scratch, builder.add(corr_at, four_b), I32)
            s1 = builder.sub(_sums8(builder, lanes), _broadcast(builder, corr, V8I32))
            dc = _load(builder, scratch, builder.add(dc_at, four_b), F32)
            p = builder.fmul(builder.sitofp(s1, V8F32), _broadcast(builder, dc, V8F32))
            da = _load(builder, _row(context, builder, adty, adt_, b), builder.mul(t0, ir.Constant(I64, 4)), V8F32)
            return [_fma(builder, p, da, y)]

        (y,) = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)], block)
        for k in range(ROWS):
            orow = _row(context, builder, oty, out_, builder.add(t0, ir.Constant(I64, k)))
            at = builder.gep(orow, [builder.mul(r_, ir.Constant(I64, 4))])
            builder.store(builder.extract_element(y, ir.Constant(I32, k)), builder.bitcast(at, F32.as_pointer()))
        return []

    _loop(builder, groups, [], group)


def _is(a, ndim: int, dtype) -> bool:
    return isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C" and a.dtype == dtype


def grid_tiles(name: str):
    """Intrinsic (w, r, ab, adt, T, nb, grid, signs, scratch, out) -> None: weight row r of grid type `name`
    (u8 (rows, nb * block bytes)) times the T >= 8 activation rows of `activation_tiles` (ab u8 (T, 256 nb),
    adt f32 (nb, T)), into out f32 (T, rows) column r, as `ggufpy.quants.x86.tiled` computes it; grid, signs as
    for `int8ir_iqgrid.grid_dot`; scratch u8 of at least nb * SCRATCH_PER_BLOCK, one per thread."""

    @intrinsic
    def tiles(typingctx, w, r, ab, adt, T, nb, grid, signs, scratch, out):
        arrays = ((w, 2, types.uint8), (ab, 2, types.uint8), (adt, 2, types.float32), (out, 2, types.float32))
        tables = (grid, signs)
        ok = all(_is(a, n, dt) for a, n, dt in arrays) and all(isinstance(i, types.Integer) for i in (r, T, nb))
        ok = ok and _is(scratch, 1, types.uint8) and all(isinstance(x, types.Array) for x in tables)
        if not (ok and all(_is(x, 1, x.dtype) for x in tables)):
            return None
        sig = types.void(w, types.int64, ab, adt, types.int64, types.int64, grid, signs, scratch, out)

        def codegen(context, builder, signature, args):
            w_, r_, _, _, _, nb_, grid_, signs_, scratch_, _ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            gtab = _table(context, builder, signature.args[6], grid_)
            stab = _table(context, builder, signature.args[7], signs_)
            buf = _table(context, builder, signature.args[8], scratch_)
            rows = cgutils.unpack_tuple(builder, context.make_array(signature.args[0])(context, builder, w_).shape)[0]
            eight = ir.Constant(I64, int8grid_gemm.ROWS)
            with builder.if_else(builder.icmp_signed("<", rows, eight)) as (few, groups):
                with few:  # under eight weight rows: row r alone
                    _decode_row(builder, name, wrow, nb_, gtab, stab, buf)
                    _tiles(context, builder, signature, args, name, buf)
                with groups:  # rows r..r+8 when r % 8 == 0 (the last group starts at rows - 8); other r: nothing
                    start = builder.icmp_signed("==", builder.srem(r_, eight), ir.Constant(I64, 0))
                    with builder.if_then(start):
                        r0 = builder.sub(rows, eight)
                        r0 = builder.select(builder.icmp_signed(">", r_, r0), r0, r_)
                        group_tiles(context, builder, signature, args, name, gtab, stab, buf, r0)
            return context.get_dummy_value()

        return sig, codegen

    return tiles
