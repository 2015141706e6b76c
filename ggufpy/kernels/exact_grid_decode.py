"""The exact numerics' grid-type blocks decoded in LLVM IR (for `exact_grid_ir.exact_dot`): f32 grid rows and
f32 sign-bit masks as tables, the reference's sub-block scales in f32.

    DECODERS[type](builder, blk, grid, signs) -> (scales <n x f32>, group)   n = 256 / SUB[type]
    group(ib) -> the four <8 x f32> values of elements 32 ib .. 32 ib + 31 (grid value x sign, unscaled)

Eight weights are `load(grid row) ^ load(sign mask)`: the grids held as f32 rows (`F32_GRIDS`, 8 floats per row,
4 for IQ3: two rows per 8 weights; IQ1: rows of 8 (grid +- 1/8), no signs) and the signs as 8 lanes of 0 or
0x80000000 per sign byte (`SIGN_MASKS`): two loads and an xor, no integer-to-float conversion. Each scale is
computed with the operations of the reference's `quants/iqgrid.py` `parts_*` (which draws each block's layout).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from ..quants.grids import IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID
from ..quants.iqgrid import KSIGNS_IQ2XS
from .int8ir import F32, I8, I16, I32, I64, V8F32, _half, _load, _shuffle, _splat

__all__ = ["BLOCK_BYTES", "DECODERS", "F32_GRIDS", "SIGN_MASKS", "SIGN_TABLE", "SUB", "broadcast"]

V4I32, V8I32 = ir.VectorType(I32, 4), ir.VectorType(I32, 8)
BLOCK_BYTES = {"IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110, "IQ1_S": 50, "IQ1_M": 56}
SUB = {"IQ2_XXS": 32, "IQ2_XS": 16, "IQ2_S": 16, "IQ3_XXS": 32, "IQ3_S": 32, "IQ1_S": 32, "IQ1_M": 16}
"""Elements per scale."""

_BYTE = np.arange(256, dtype=np.uint32)
_MASKS = (((_BYTE[:, None] >> np.arange(8, dtype=np.uint32)) & 1) << 31).astype(np.uint32)  # [byte] -> 8 masks
SIGN_MASKS = {"full": _MASKS.reshape(-1).copy(), "even": _MASKS[KSIGNS_IQ2XS].reshape(-1).copy()}
"""u32 sign-bit masks, 8 per sign byte: "full" by the byte itself (IQ2_S, IQ3_S), "even" by a 7-bit index into
ggml-common.h's `ksigns_iq2xs` (IQ2_XXS, IQ2_XS, IQ3_XXS)."""
# IQ1: 8 * (grid + delta), delta = +1/8 (rows 0..2047) or -1/8 (rows 2048..): the scale is the reference's dl / 8
# (4096 rows of 32 bytes: 128 KiB, read from L2; the other tables are 4-32 KiB)
_IQ1 = np.concatenate([8 * IQ1S_GRID.astype(np.float32) + 1, 8 * IQ1S_GRID.astype(np.float32) - 1])
F32_GRIDS = {
    n: np.ascontiguousarray(g, dtype=np.float32).reshape(-1)
    for n, g in {
        "IQ2_XXS": IQ2XXS_GRID,
        "IQ2_XS": IQ2XS_GRID,
        "IQ2_S": IQ2S_GRID,
        "IQ3_XXS": IQ3XXS_GRID,
        "IQ3_S": IQ3S_GRID,
        "IQ1_S": _IQ1,
        "IQ1_M": _IQ1,
    }.items()
}
"""Grid rows as f32 (8 per row; IQ3: 4), the tables `exact_dot`'s kernels take."""
SIGN_TABLE = {"IQ2_XXS": "even", "IQ2_XS": "even", "IQ2_S": "full", "IQ3_XXS": "even", "IQ3_S": "full"}


# -- small helpers --------------------------------------------------------------------------------------------------
def _c(v: int):
    return ir.Constant(I64, v)


def _u8(builder, blk, offset):
    return builder.zext(_load(builder, blk, offset, I8), I64)


def _u16(builder, blk, offset):
    return builder.zext(_load(builder, blk, offset, I16), I64)


def _u32(builder, blk, offset):
    return builder.zext(_load(builder, blk, offset, I32), I64)


def _bits(builder, x, shift: int, mask: int):
    return builder.and_(builder.lshr(x, ir.Constant(x.type, shift)), ir.Constant(x.type, mask))


def _row8(builder, table, idx):
    """Row idx (i64) of a table of 8 x 32-bit values, as <8 x i32>."""
    return _load(builder, table, builder.mul(idx, _c(32)), V8I32, align=4)


def _row4x2(builder, table, i0, i1):
    """Rows i0, i1 of a table of 4 x 32-bit values, as one <8 x i32>."""
    lo = _load(builder, table, builder.mul(i0, _c(16)), V4I32, align=4)
    hi = _load(builder, table, builder.mul(i1, _c(16)), V4I32, align=4)
    return _shuffle(builder, lo, hi, list(range(8)))


def _signed(builder, g, m):
    """f32 grid lanes g (as <8 x i32>) with the sign bits m flipped, as <8 x f32>."""
    return builder.bitcast(g if m is None else builder.xor(g, m), V8F32)


def _half_scale(builder, d, ls, factor: float):
    """d * (0.5 + float(ls)) * factor, ls an integer vector: `parts_iq2_xxs` & co. in f32, lane by lane."""
    ty = ir.VectorType(F32, ls.type.count)
    x = builder.fadd(_splat(ty, 0.5), builder.uitofp(ls, ty))
    return builder.fmul(builder.fmul(broadcast(builder, d, ty), x), _splat(ty, factor))


def _odd_scale(builder, d, s, eighth: bool):
    """d * float(2 s + 1) (IQ3_S), times 0.125 (IQ1: the dl / 8 of 8 (grid +- 1/8)), s an integer vector."""
    ty = ir.VectorType(F32, s.type.count)
    one = ir.Constant(s.type, [1] * s.type.count)
    odd = builder.uitofp(builder.add(builder.shl(s, one), one), ty)
    y = builder.fmul(broadcast(builder, d, ty), odd)
    return builder.fmul(y, _splat(ty, 0.125)) if eighth else y


def broadcast(builder, x, ty):
    """The scalar x in every lane of the vector type ty."""
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(
        v, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(I32, ty.count), [0] * ty.count)
    )


def _nibble_scales(builder, blk, offset, n: int):
    """n bytes of two 4-bit scales (low nibble first) -> <2n x i32> in element order."""
    b = builder.zext(_load(builder, blk, offset, ir.VectorType(I8, n)), ir.VectorType(I32, n))
    lo = builder.and_(b, _splat(b.type, 15))
    hi = builder.lshr(b, _splat(b.type, 4))
    return _shuffle(builder, lo, hi, [k // 2 + n * (k % 2) for k in range(2 * n)])


# -- per type: the block at blk -> (scales <nsub x f32>, groups(ib) -> four w8 of sub-block ib) ----------------------
# Block layouts: quants/iqgrid.py draws each above its `parts_*`.
def _iq2_xxs(builder, blk, g, s):
    # +2 per 32 elements: u8[4] grid indices, then a u32 of four 7-bit sign indices | ls << 28
    words = _load(builder, blk, 2, ir.VectorType(I32, 16))
    a1 = _shuffle(builder, words, words, [2 * ib + 1 for ib in range(8)])
    scales = _half_scale(builder, _half(builder, blk, 0), builder.lshr(a1, _splat(V8I32, 28)), 0.25)

    def group(ib):
        a = _u32(builder, blk, 6 + 8 * ib)
        return [
            _signed(
                builder,
                _row8(builder, g, _u8(builder, blk, 2 + 8 * ib + k)),
                _row8(builder, s, _bits(builder, a, 7 * k, 127)),
            )
            for k in range(4)
        ]

    return scales, group


def _iq2_xs(builder, blk, g, s):
    # +2 a u16 per 8 elements: grid index (9 bits) | sign index << 9; +66 a scale nibble per 16
    scales = _half_scale(builder, _half(builder, blk, 0), _nibble_scales(builder, blk, 66, 8), 0.25)

    def group(ib):
        out = []
        for k in range(4):
            q = _u16(builder, blk, 2 + 8 * ib + 2 * k)
            m = _row8(builder, s, builder.lshr(q, _c(9)))
            out.append(_signed(builder, _row8(builder, g, builder.and_(q, _c(511))), m))
        return out

    return scales, group


def _iq2_s(builder, blk, g, s):
    # +2 low index bytes, +34 sign bytes, +66 two index bits per 8 elements, +74 a scale nibble per 16
    scales = _half_scale(builder, _half(builder, blk, 0), _nibble_scales(builder, blk, 74, 8), 0.25)

    def group(ib):
        qh = _u8(builder, blk, 66 + ib)
        out = []
        for k in range(4):
            j = 4 * ib + k
            idx = builder.or_(_u8(builder, blk, 2 + j), builder.shl(_bits(builder, qh, 2 * k, 3), _c(8)))
            out.append(_signed(builder, _row8(builder, g, idx), _row8(builder, s, _u8(builder, blk, 34 + j))))
        return out

    return scales, group


def _iq3_xxs(builder, blk, g, s):
    # +2 a grid index byte per 4 elements; +66 per 32 a u32 of four 7-bit sign indices | ls << 28
    ss = _load(builder, blk, 66, V8I32)
    scales = _half_scale(builder, _half(builder, blk, 0), builder.lshr(ss, _splat(V8I32, 28)), 0.5)

    def group(ib):
        a = _u32(builder, blk, 66 + 4 * ib)
        out = []
        for k in range(4):
            i0, i1 = _u8(builder, blk, 2 + 8 * ib + 2 * k), _u8(builder, blk, 3 + 8 * ib + 2 * k)
            out.append(_signed(builder, _row4x2(builder, g, i0, i1), _row8(builder, s, _bits(builder, a, 7 * k, 127))))
        return out

    return scales, group


def _iq3_s(builder, blk, g, s):
    # +2 low index bytes per 4 elements, +66 qh (bit k of byte ib: index bit 8 of group k), +74 sign bytes,
    # +106 a scale nibble per 32
    nib = _nibble_scales(builder, blk, 106, 4)
    scales = _odd_scale(builder, _half(builder, blk, 0), nib, eighth=False)

    def group(ib):
        qh = _u8(builder, blk, 66 + ib)
        idx = [
            builder.or_(_u8(builder, blk, 2 + 8 * ib + k), builder.shl(_bits(builder, qh, k, 1), _c(8)))
            for k in range(8)
        ]
        return [
            _signed(
                builder,
                _row4x2(builder, g, idx[2 * k], idx[2 * k + 1]),
                _row8(builder, s, _u8(builder, blk, 74 + 4 * ib + k)),
            )
            for k in range(4)
        ]

    return scales, group


def _iq1_s(builder, blk, g, _):
    # +2 low index bytes per 8 elements; +34 per 32 a u16: index bits 8-10 per group (3k), s at 12, delta sign at 15
    qh = builder.zext(_load(builder, blk, 34, ir.VectorType(I16, 8)), V8I32)
    scales = _odd_scale(
        builder, _half(builder, blk, 0), builder.and_(builder.lshr(qh, _splat(V8I32, 12)), _splat(V8I32, 7)), True
    )

    def group(ib):
        h = _u16(builder, blk, 34 + 2 * ib)
        neg = builder.shl(builder.lshr(h, _c(15)), _c(11))
        out = []
        for k in range(4):
            idx = builder.or_(_u8(builder, blk, 2 + 4 * ib + k), builder.shl(_bits(builder, h, 3 * k, 7), _c(8)))
            out.append(_signed(builder, _row8(builder, g, builder.or_(idx, neg)), None))
        return out

    return scales, group


def _iq1_m(builder, blk, g, _):
    # +0 low index bytes per 8 elements, +32 a nibble per 8 (index bits 8-10, delta sign at 3), +48 four u16:
    # 3-bit scales per 16 elements (m: bits 3 (m % 4) of u16 m // 4), the fp16 d in their top nibbles
    u = builder.zext(_load(builder, blk, 48, ir.VectorType(I16, 4)), V4I32)
    bits = ir.Constant(I32, 0)
    for i in range(4):
        top = builder.lshr(builder.extract_element(u, ir.Constant(I32, i)), ir.Constant(I32, 12))
        bits = builder.or_(bits, builder.shl(top, ir.Constant(I32, 4 * i)))
    d = builder.fpext(builder.bitcast(builder.trunc(bits, I16), ir.HalfType()), F32)
    v16 = ir.VectorType(I32, 16)
    spread = _shuffle(builder, u, u, [m // 4 for m in range(16)])
    s3 = builder.and_(builder.lshr(spread, ir.Constant(v16, [3 * (m % 4) for m in range(16)])), _splat(v16, 7))
    scales = _odd_scale(builder, d, s3, True)

    def group(ib):
        out = []
        for k in range(4):
            j = 4 * ib + k
            nib = _bits(builder, _u8(builder, blk, 32 + j // 2), 4 * (j % 2), 15)
            idx = builder.or_(_u8(builder, blk, j), builder.shl(builder.and_(nib, _c(7)), _c(8)))
            idx = builder.or_(idx, builder.shl(builder.lshr(nib, _c(3)), _c(11)))
            out.append(_signed(builder, _row8(builder, g, idx), None))
        return out

    return scales, group


DECODERS = {
    "IQ2_XXS": _iq2_xxs,
    "IQ2_XS": _iq2_xs,
    "IQ2_S": _iq2_s,
    "IQ3_XXS": _iq3_xxs,
    "IQ3_S": _iq3_s,
    "IQ1_S": _iq1_s,
    "IQ1_M": _iq1_m,
}
