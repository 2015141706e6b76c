"""LLVM IR for ggml's integer products of the grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
with Q8_K activations, as numba intrinsics over one weight row: its AVX2 vec_dot (what llama.cpp runs below 8
activation rows); the tiled kernel (8 rows and more) reuses the decode in `int8grid_tiles.py`.

Each 32-element sub-block ib becomes one <32 x i8> as in arch/x86/quants.c `ggml_vec_dot_iq2_xxs_q8_K` & co.:
the grid rows its indices name (u64 loads, or u32 for the IQ3 grids, put together like `_mm256_set_epi64x`),
the signs as +-1 bytes applied to the activations (`vpsignb`), then

    lanes += pmaddwd(pmaddubsw(grid, sign(a)), scale)       scale: 2 ls + 1 per pair of i16 (per 16 elements
                                                            for IQ2_XS, IQ2_S, IQ1_M: lanes 0-3, then 4-7)

IQ1's grid values are -1, 0, 1: they sign the activations themselves against a vector of ones, and the delta
term is summed apart (IQ1_S: one scalar from the bsums, IQ1_M: lanes of +-1 . a). The integers are exact
(|grid| <= 62, Q8_K's |a| <= 127, so `vpsignb` never meets -128: a pair of products stays below 2^15, a lane
below 2^24), so only the f32 steps
matter, and they are the replay's (`ggufpy.quants.x86.iqgrid`): per super-block
acc = fma(fl(d_w * d_a), float(lanes), acc); y = c * hsum_float_8(acc) (IQ1: + 0.125f * the delta part).

The grids and sign tables are module constants (`GRIDS`, `SIGNS`, `KSIGNS`) the kernels pass as 1-D arrays.
The numba kernels that call these intrinsics, one per type: `int8grid.py`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..quants.grids import IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID
from ..quants.iqgrid import KSIGNS_IQ2XS
from .int8grid_blocks import BLOCKS, _rows, _vector
from .int8ir import (
    F32,
    I8,
    I16,
    I32,
    I64,
    V8F32,
    V8I32,
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

__all__ = ["GRIDS", "KSIGNS", "MAX_ROWS", "SIGNS", "TYPES", "grid_dot", "grid_dot_rows"]


def _words(rows: np.ndarray) -> np.ndarray:
    """A grid of 8- (4-) byte rows -> one u64 (u32) per row, the bytes in element order (little-endian)."""
    return np.ascontiguousarray(rows).view(np.uint64 if rows.shape[1] == 8 else np.uint32)[:, 0].copy()


MAX_ROWS = 7  # activation rows per call: from 8 llama.cpp runs the tiled kernel (int8lowbit's)
_BYTE = np.arange(256, dtype=np.uint8)
SIGNS = _words((1 - 2 * ((_BYTE[:, None] >> np.arange(8, dtype=np.uint8)) & 1)).astype(np.int8))
"""u64[256]: sign byte -> 8 bytes of +1 / -1 (-1 where bit j is set), `vpsignb`'s second operand."""
KSIGNS = SIGNS[KSIGNS_IQ2XS]  # u64[128]: ggml-common.h `keven_signs_q2xs`, by 7-bit sign index
GRIDS = {
    "IQ2_XXS": _words(IQ2XXS_GRID),
    "IQ2_XS": _words(IQ2XS_GRID),
    "IQ2_S": _words(IQ2S_GRID),
    "IQ3_XXS": _words(IQ3XXS_GRID),
    "IQ3_S": _words(IQ3S_GRID),
    "IQ1_S": _words(IQ1S_GRID),
    "IQ1_M": _words(IQ1S_GRID),
}
# type -> (block bytes, the factor c of `ggufpy.quants.x86.iqgrid`)
TYPES = {
    "IQ2_XXS": (66, 0.125),
    "IQ2_XS": (74, 0.125),
    "IQ2_S": (82, 0.125),
    "IQ3_XXS": (98, 0.25),
    "IQ3_S": (110, 1.0),
    "IQ1_S": (50, 0.125),
    "IQ1_M": (56, 0.125),
}


def _u8(builder, blk, offset):
    return builder.zext(_load(builder, blk, offset, I8), I64)


def _bits(builder, x, shift: int, mask: int):
    return builder.and_(builder.lshr(x, ir.Constant(x.type, shift)), ir.Constant(x.type, mask))


def _scale(builder, s):
    """A 4-bit (or 3-bit) scale s (i64) -> 2 s + 1 as i16."""
    return builder.trunc(builder.add(builder.shl(s, ir.Constant(I64, 1)), ir.Constant(I64, 1)), I16)


def _scales(builder, lo, hi=None):
    """<16 x i16> for `pmaddwd`: 2 lo + 1 on pairs 0-7 (elements 0-15), 2 hi + 1 on pairs 8-15."""
    pair = _vector(builder, [_scale(builder, lo), _scale(builder, lo if hi is None else hi)], ir.VectorType(I16, 2))
    return _shuffle(builder, pair, pair, [0] * 8 + [1] * 8)


# -- per type: sub-block ib of the block at blk -> (grid bytes u, signs s for the activations, scale) ---------------
# (IQ1: u = the grid values -1, 0, 1 as bytes, s = the delta: IQ1_S +-(2 s + 1) as i64, IQ1_M +-1 per byte)
# IQ2_XXS (66): +2 per ib two u32, a0 = four grid indices (bytes), a1 = four 7-bit sign indices | ls << 28
def _iq2_xxs(builder, blk, ib, grid, ksigns):
    a1 = builder.zext(_load(builder, blk, 2 + 8 * ib + 4, I32), I64)
    u = _rows(builder, grid, [_u8(builder, blk, 2 + 8 * ib + k) for k in range(4)])
    s = _rows(builder, ksigns, [_bits(builder, a1, 7 * k, 127) for k in range(4)])
    return u, s, _scales(builder, builder.lshr(a1, ir.Constant(I64, 28)))


# IQ2_XS (74): +2 u16 per 8 elements, grid index (9 bits) | 7-bit sign index << 9; +66 a scale nibble per 16
def _iq2_xs(builder, blk, ib, grid, ksigns):
    q = [builder.zext(_load(builder, blk, 2 + 8 * ib + 2 * k, I16), I64) for k in range(4)]
    u = _rows(builder, grid, [builder.and_(x, ir.Constant(I64, 511)) for x in q])
    s = _rows(builder, ksigns, [builder.lshr(x, ir.Constant(I64, 9)) for x in q])
    sc = _u8(builder, blk, 66 + ib)
    return u, s, _scales(builder, _bits(builder, sc, 0, 15), _bits(builder, sc, 4, 15))


# IQ3_XXS (98): +2 a u32-grid index byte per 4 elements, +66 per ib u32 four 7-bit sign indices | ls << 28
def _iq3_xxs(builder, blk, ib, grid, ksigns):
    ss = builder.zext(_load(builder, blk, 66 + 4 * ib, I32), I64)
    u = _rows(builder, grid, [_u8(builder, blk, 2 + 8 * ib + k) for k in range(8)], width=4)
    s = _rows(builder, ksigns, [_bits(builder, ss, 7 * k, 127) for k in range(4)])
    return u, s, _scales(builder, builder.lshr(ss, ir.Constant(I64, 28)))


# IQ3_S (110): +2 low index bytes per 4 elements, +66 qh (bit k: index bit 8), +74 sign bytes, +106 nibble per 32
def _iq3_s(builder, blk, ib, grid, signs):
    qh = _u8(builder, blk, 66 + ib)
    idx = [
        builder.or_(_u8(builder, blk, 2 + 8 * ib + k), builder.shl(_bits(builder, qh, k, 1), ir.Constant(I64, 8)))
        for k in range(8)
    ]
    s = _rows(builder, signs, [_u8(builder, blk, 74 + 4 * ib + k) for k in range(4)])
    sc = _bits(builder, _u8(builder, blk, 106 + ib // 2), 4 * (ib % 2), 15)
    return _rows(builder, grid, idx, width=4), s, _scales(builder, sc)


# IQ1_S (50): +2 low index bytes per 8 elements, +34 per ib u16: index bits 8-10 per group (3l), s at 12, delta at 15
def _iq1_s(builder, blk, ib, grid, _):
    qh = builder.zext(_load(builder, blk, 34 + 2 * ib, I16), I64)
    idx = [
        builder.or_(_u8(builder, blk, 2 + 4 * ib + k), builder.shl(_bits(builder, qh, 3 * k, 7), ir.Constant(I64, 8)))
        for k in range(4)
    ]
    sc = _bits(builder, qh, 12, 7)
    negative = builder.icmp_unsigned("!=", _bits(builder, qh, 15, 1), ir.Constant(I64, 0))
    sc2 = builder.add(builder.shl(sc, ir.Constant(I64, 1)), ir.Constant(I64, 1))
    delta = builder.select(negative, builder.neg(sc2), sc2)  # +-(2 s + 1): the bsum pair's factor
    return _rows(builder, grid, idx), delta, _scales(builder, sc)


def _iq1_m_d(builder, blk):
    """IQ1_M's fp16 d: the top nibbles of the four u16 scales, as f32."""
    bits = ir.Constant(I16, 0)
    for i in range(4):
        top = builder.lshr(_load(builder, blk, 48 + 2 * i, I16), ir.Constant(I16, 12))
        bits = builder.or_(bits, builder.shl(top, ir.Constant(I16, 4 * i)))
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)


_CHUNKS = {
    "IQ2_XXS": _iq2_xxs,
    "IQ2_XS": _iq2_xs,
    "IQ3_XXS": _iq3_xxs,
    "IQ3_S": _iq3_s,
    "IQ1_S": _iq1_s,
}


def _chunks(builder, name, blk, gtab, stab) -> list:
    """The eight decoded sub-blocks (u, s, scale) of the block at blk."""
    if name in BLOCKS:  # a block at a time, in vector registers (`int8grid_blocks`)
        return BLOCKS[name](builder, blk, gtab, stab)
    return [_CHUNKS[name](builder, blk, ib, gtab, stab) for ib in range(8)]


def _table(context, builder, arrty, arr):
    """i8* to the data of a 1-D array."""
    return builder.bitcast(context.make_array(arrty)(context, builder, arr).data, I8.as_pointer())


# -- one super-block: exact integers, then the f32 steps of the replay -------------------------------------------
def _block_ints(builder, name, chunks, ablk, bsblk):
    """The decoded sub-blocks `chunks` . the activation block at ablk -> (lanes <8 x i32>, IQ1_M's delta lanes,
    IQ1_S's delta sum sumi1 i64)."""
    ones = _splat(V32I8, 1)
    lanes = dlanes = ir.Constant(V8I32, [0] * 8)
    sumi1 = ir.Constant(I64, 0)
    for ib, (u, s, scale) in enumerate(chunks):
        a = _load(builder, ablk, 32 * ib, V32I8)
        if name.startswith("IQ1"):  # grid values -1, 0, 1 sign the activations; ones multiply them
            p = _maddubs(builder, ones, _psign(builder, a, u))
        else:
            p = _maddubs(builder, u, _psign(builder, a, s))
        lanes = builder.add(lanes, _madd(builder, p, scale))
        if name == "IQ1_S":  # sumi1 += +-(2 s + 1) * (bsum 2ib + bsum 2ib+1)
            pair = [builder.sext(_load(builder, bsblk, 4 * ib + 2 * k, I16), I64) for k in range(2)]
            sumi1 = builder.add(sumi1, builder.mul(s, builder.add(*pair)))
        elif name == "IQ1_M":  # lanes of the +-1 deltas . a
            dp = _maddubs(builder, ones, _psign(builder, a, s))
            dlanes = builder.add(dlanes, _madd(builder, dp, scale))
    return lanes, dlanes, sumi1


def _accumulate(builder, name, d, ints, acc, acc2):
    """acc = fma(d, float(lanes), acc) per lane; IQ1_S: acc2 = fma(d, float(sumi1), acc2) (a scalar); IQ1_M:
    acc2 = fma(d, float(delta lanes), acc2). d = fl(d_a * d_w)."""
    lanes, dlanes, sumi1 = ints
    dv = _broadcast(builder, d, V8F32)
    acc = _fma(builder, dv, builder.sitofp(lanes, V8F32), acc)
    if name == "IQ1_S":
        acc2 = _fma(builder, d, builder.sitofp(sumi1, F32), acc2)
    elif name == "IQ1_M":
        acc2 = _fma(builder, dv, builder.sitofp(dlanes, V8F32), acc2)
    return acc, acc2


def _finish(builder, name, acc, acc2):
    """y = c * hsum_float_8(acc); IQ1_S: hsum_float_8(acc) + 0.125f * acc2; IQ1_M: + 0.125f * hsum_float_8(acc2)."""
    y = _hsum_float_8(builder, acc)
    eighth = ir.Constant(F32, 0.125)
    if name == "IQ1_S":
        return builder.fadd(y, builder.fmul(eighth, acc2))
    if name == "IQ1_M":
        return builder.fadd(y, builder.fmul(eighth, _hsum_float_8(builder, acc2)))
    return builder.fmul(ir.Constant(F32, TYPES[name][1]), y)


def _decode(builder, name, wrow, b, gtab, stab):
    """Super-block b of the weight row -> (its 8 decoded sub-blocks, d_w f32)."""
    blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, TYPES[name][0]))])
    chunks = _chunks(builder, name, blk, gtab, stab)
    return chunks, _iq1_m_d(builder, blk) if name == "IQ1_M" else _half(builder, blk, 0)


def _check(sig, grid, signs):
    for table in (grid, signs):
        if sig is None or not (isinstance(table, types.Array) and table.ndim == 1 and table.layout == "C"):
            return False
    return True


_ARGS = (types.uint8, int, types.int8, int, types.float32, types.int16, int)


def grid_dot(name: str):
    """Intrinsic (w, r, aq, t, ad, bsums, nb, grid, signs) -> f32: weight row r of grid type `name` (u8
    (rows, nb * block bytes)) times Q8_K activation row t (aq int8 (T, 256 nb), ad f32 (T, nb) d, bsums int16
    (T, 16 nb)), as `ggml_vec_dot_<type>_q8_K` (AVX2) in the replay's f32 order; grid = GRIDS[name], signs =
    KSIGNS (IQ2_XXS, IQ2_XS, IQ3_XXS) or SIGNS (IQ2_S, IQ3_S; unused by IQ1_S, IQ1_M). The accumulators stay
    in registers: the fastest form for one activation row."""

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, bsums, nb, grid, signs):
        sig = _signature((w, r, aq, t, ad, bsums, nb), _ARGS)
        if not _check(sig, grid, signs):
            return None
        sig = types.float32(*sig.args, grid, signs)

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t_, ad_, bs_, nb_, grid_, signs_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            bsrow = _row(context, builder, signature.args[5], bs_, t_)
            gtab = _table(context, builder, signature.args[7], grid_)
            stab = _table(context, builder, signature.args[8], signs_)

            def body(b, carried):
                chunks, dw = _decode(builder, name, wrow, b, gtab, stab)
                ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
                bsblk = builder.gep(bsrow, [builder.mul(b, ir.Constant(I64, 32))])
                ints = _block_ints(builder, name, chunks, ablk, bsblk)
                d = builder.fmul(_load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32), dw)
                return list(_accumulate(builder, name, d, ints, *carried))

            zero8 = ir.Constant(V8F32, [0.0] * 8)
            init2 = ir.Constant(F32, 0.0) if name == "IQ1_S" else zero8
            return _finish(builder, name, *_loop(builder, nb_, [zero8, init2], body))

        return sig, codegen

    return dot


def grid_dot_rows(name: str):
    """Intrinsic (w, r, aq, T, ad, bsums, nb, grid, signs, out): out[t, r] for every t < T, each weight block
    decoded once for the T <= MAX_ROWS rows, `grid_dot`'s f32 steps with the accumulators in the stack frame
    (measured slower than `grid_dot` for one row, faster from two). From 8 rows: `int8grid_tiles`."""

    @intrinsic
    def dot(typingctx, w, r, aq, T, ad, bsums, nb, grid, signs, out):
        sig = _signature((w, r, aq, T, ad, bsums, nb, out), (*_ARGS, types.float32))
        if not _check(sig, grid, signs):
            return None
        sig = types.void(*sig.args[:7], grid, signs, sig.args[7])

        def codegen(context, builder, signature, args):
            w_, r_, aq_, T_, ad_, bs_, nb_, grid_, signs_, out_ = args
            aty, dty, bty, oty = (signature.args[i] for i in (2, 4, 5, 9))
            wrow = _row(context, builder, signature.args[0], w_, r_)
            gtab = _table(context, builder, signature.args[7], grid_)
            stab = _table(context, builder, signature.args[8], signs_)
            zero8 = ir.Constant(V8F32, [0.0] * 8)
            ty2 = F32 if name == "IQ1_S" else V8F32
            # in the entry block: allocated once per call site, not per loop iteration
            accs = cgutils.alloca_once(builder, V8F32, size=ir.Constant(I64, MAX_ROWS))
            accs2 = cgutils.alloca_once(builder, ty2, size=ir.Constant(I64, MAX_ROWS))

            def out_at(t):
                at = builder.gep(_row(context, builder, oty, out_, t), [builder.mul(r_, ir.Constant(I64, 4))])
                return builder.bitcast(at, F32.as_pointer())

            def zero(t, _):
                builder.store(zero8, builder.gep(accs, [t]))
                builder.store(ir.Constant(F32, 0.0) if name == "IQ1_S" else zero8, builder.gep(accs2, [t]))
                return []

            def block(b, _):
                chunks, dw = _decode(builder, name, wrow, b, gtab, stab)

                def row(t, _):
                    ablk = builder.gep(_row(context, builder, aty, aq_, t), [builder.mul(b, ir.Constant(I64, 256))])
                    bsblk = builder.gep(_row(context, builder, bty, bs_, t), [builder.mul(b, ir.Constant(I64, 32))])
                    ints = _block_ints(builder, name, chunks, ablk, bsblk)
                    da = _load(builder, _row(context, builder, dty, ad_, t), builder.mul(b, ir.Constant(I64, 4)), F32)
                    at, at2 = builder.gep(accs, [t]), builder.gep(accs2, [t])
                    acc, acc2 = _accumulate(
                        builder, name, builder.fmul(da, dw), ints, builder.load(at), builder.load(at2)
                    )
                    builder.store(acc, at)
                    builder.store(acc2, at2)
                    return []

                _loop(builder, T_, [], row)
                return []

            def result(t, _):
                y = _finish(builder, name, builder.load(builder.gep(accs, [t])), builder.load(builder.gep(accs2, [t])))
                builder.store(y, out_at(t))
                return []

            _loop(builder, T_, [], zero)
            _loop(builder, nb_, [], block)
            _loop(builder, T_, [], result)
            return context.get_dummy_value()

        return sig, codegen

    return dot
