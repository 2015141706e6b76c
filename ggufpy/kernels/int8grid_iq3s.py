"""IQ3_S times one Q8_K activation row (decode, T = 1) in the llamacpp numerics, as LLVM IR: the integers and f32
steps of `ggml_vec_dot_iq3_s_q8_K` (arch/x86/quants.c, AVX2; `int8ir_iqgrid.grid_dot("IQ3_S")`'s) in fewer
instructions, on `int8grid_decode.staged_dot`.

block_iq3_s (110 bytes): d (fp16) | qs[64] low index bytes per 4 elements | qh[8] (bit k of qh[ib]: index bit 8
of group k of sub-block ib) | signs[32] (bit j of a byte: element j of its 8 negated) | scales[4] (a nibble per 32
elements). `grid_dot` assembles each of the 64 indices of a block in scalar code (two byte loads, shifts, an or)
and looks every sign byte up in a table. Here the stage computes the 64 indices at once,

    idx <64 x i16> = qs | (qh[q // 8] << (8 - q % 8)) & 0x100        (a multiply: AVX2 has no per-lane i16 shift)

and the scales as one <16 x i16>; per sub-block the grid rows are plain loads at the staged indices, the sign
bytes become `vpsignb`'s operand straight from the block (`int8grid_decode.signs_at`), and the scale is one in-lane
shuffle.
"""

from __future__ import annotations

from llvmlite import ir

from .int8grid_blocks import _rows
from .int8grid_decode import signs_at, spread_scales, staged_dot
from .int8ir import (
    F32,
    I8,
    I16,
    I64,
    V8F32,
    V8I32,
    V16I16,
    V32I8,
    _broadcast,
    _fma,
    _half,
    _hsum_float_8,
    _load,
    _madd,
    _maddubs,
    _psign,
    _shuffle,
    _splat,
)

__all__ = ["iq3_s_dot"]

BLOCK_BYTES, _QS, _QH, _SIGNS, _SCALES = 110, 2, 66, 74, 106
_V32I16 = ir.VectorType(I16, 32)
_IDX, _SC = 0, 128  # stage offsets: the 64 indices, the scales (`spread_scales` layout)
_STAGE = 160


def _stage(builder, blk, at, _):
    qh = builder.zext(_load(builder, blk, _QH, ir.VectorType(I8, 8)), ir.VectorType(I16, 8))
    for h in range(2):  # index groups q = 32h .. 32h + 31
        spread = _shuffle(builder, qh, qh, [(32 * h + q) // 8 for q in range(32)])
        high = builder.mul(spread, ir.Constant(_V32I16, [1 << (8 - q % 8) for q in range(32)]))
        low = builder.zext(_load(builder, blk, _QS + 32 * h, V32I8), _V32I16)
        idx = builder.or_(low, builder.and_(high, _splat(_V32I16, 0x100)))
        ptr = builder.gep(at, [ir.Constant(I64, _IDX + 64 * h)])
        builder.store(idx, builder.bitcast(ptr, _V32I16.as_pointer()), align=32)
    v4i16 = ir.VectorType(I16, 4)
    sc = builder.zext(_load(builder, blk, _SCALES, ir.VectorType(I8, 4)), v4i16)
    lo, hi = builder.and_(sc, _splat(v4i16, 15)), builder.lshr(sc, _splat(v4i16, 4))
    s = _shuffle(builder, lo, hi, [4 * (ib % 2) + ib // 2 for ib in range(8)] * 2)  # sub-block ib: byte ib // 2
    s = builder.add(builder.shl(s, _splat(V16I16, 1)), _splat(V16I16, 1))
    builder.store(s, builder.bitcast(builder.gep(at, [ir.Constant(I64, _SC)]), V16I16.as_pointer()), align=32)


def _dot(builder, blk, at, ablk, _bsblk, da, gtab, accs):
    (acc,) = accs
    scales = _load(builder, at, _SC, V16I16, align=32)
    lanes = ir.Constant(V8I32, [0] * 8)
    for ib in range(8):
        idx = [builder.zext(_load(builder, at, _IDX + 16 * ib + 2 * k, I16, 2), I64) for k in range(8)]
        a = _psign(builder, _load(builder, ablk, 32 * ib, V32I8), signs_at(builder, blk, _SIGNS + 4 * ib))
        p = _maddubs(builder, _rows(builder, gtab, idx, width=4), a)
        lanes = builder.add(lanes, _madd(builder, p, spread_scales(builder, scales, ib)))
    d = _broadcast(builder, builder.fmul(da, _half(builder, blk, 0)), V8F32)
    return [_fma(builder, d, builder.sitofp(lanes, V8F32), acc)]


def _finish(builder, accs):
    return builder.fmul(ir.Constant(F32, 1.0), _hsum_float_8(builder, accs[0]))  # `grid_dot`'s c = 1


def iq3_s_dot():
    """Intrinsic (w, r, aq, t, ad, bsums, nb, grid) -> f32, bit for bit `int8ir_iqgrid.grid_dot("IQ3_S")`;
    grid = `int8ir_iqgrid.GRIDS["IQ3_S"]` (u32 per grid row)."""
    return staged_dot(BLOCK_BYTES, _STAGE, _stage, _dot, lambda: [ir.Constant(V8F32, [0.0] * 8)], _finish)
