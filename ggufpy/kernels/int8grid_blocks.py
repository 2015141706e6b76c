"""Grid-type blocks decoded a whole super-block at a time in vector registers, for `int8ir_iqgrid`'s kernels
(vec_dot and, through `int8grid_tiles`, the tiled kernel): the 32 grid indices, the signs and the 16 scales of a
block are computed together instead of per sub-block in scalar code (byte loads, shifts, masks, inserts), which
made IQ1_M's vec_dot 1.3x llama.cpp's time. Same (u, s, scale) per sub-block as `int8ir_iqgrid._CHUNKS` would
give, so the kernels' integers and f32 steps do not change.

    BLOCKS[type](builder, blk, grid, signs) -> eight (u <32 x i8>, s, scale <16 x i16>)

and the table-row helpers `_rows` / `_vector` both modules use.
"""

from __future__ import annotations

from llvmlite import ir

from .int8ir import I8, I16, I32, I64, V8I32, V16I16, V32I8, _load, _shuffle, _splat

__all__ = ["BLOCKS"]


# -- building vectors from table rows -------------------------------------------------------------------------------
def _vector(builder, values, ty: ir.VectorType):
    v = ir.Constant(ty, ir.Undefined)
    for i, x in enumerate(values):
        v = builder.insert_element(v, x, ir.Constant(I32, i))
    return v


def _rows(builder, table, idx: list, width: int = 8):
    """The table rows idx (i64 values) of a u64 (width 8) or u32 (width 4) table, as one <32 x i8>."""
    ty = I64 if width == 8 else I32
    words = [_load(builder, table, builder.mul(i, ir.Constant(I64, width)), ty, align=width) for i in idx]
    return builder.bitcast(_vector(builder, words, ir.VectorType(ty, len(words))), V32I8)


# IQ1_M (56): +0 low index bytes, +32 a nibble per 8 elements (index bits 8-10, delta sign at 3), +48 u16 scales
# (3 bits per 16 elements; the fp16 d in the top nibbles)
def _iq1_m_block(builder, blk, grid, _):
    """IQ1_M's eight sub-blocks (u, s = the +-1 delta bytes, scale) at once, in vector registers: the 32 grid
    indices, delta signs and 16 scales of a block computed together (per element in scalar code, they made
    IQ1_M's vec_dot 1.3x llama.cpp's time)."""
    v16i8, v32i16 = ir.VectorType(I8, 16), ir.VectorType(I16, 32)
    qh = _load(builder, blk, 32, v16i8)  # nibble k (8 elements each) = byte k // 2 >> 4 (k % 2)
    nib = _shuffle(builder, builder.and_(qh, _splat(v16i8, 15)), builder.lshr(qh, _splat(v16i8, 4)),
                   [k // 2 + 16 * (k % 2) for k in range(32)])  # fmt: skip
    high = builder.shl(builder.zext(builder.and_(nib, _splat(V32I8, 7)), v32i16), _splat(v32i16, 8))
    idx = builder.or_(builder.zext(_load(builder, blk, 0, V32I8), v32i16), high)
    sign = builder.sub(_splat(V32I8, 1), builder.and_(builder.lshr(nib, _splat(V32I8, 2)), _splat(V32I8, 2)))
    # scale m (16 elements) = bits 3 (m % 4) .. +2 of u16 m // 4 at 48
    scales = _pair_scales(builder, _load(builder, blk, 48, ir.VectorType(I16, 4)), 4, 3, 7)
    chunks = []
    for ib in range(8):
        words = [builder.zext(builder.extract_element(idx, ir.Constant(I32, 4 * ib + k)), I64) for k in range(4)]
        delta = _shuffle(builder, sign, sign, [4 * ib + j // 8 for j in range(32)])
        chunks.append((_rows(builder, grid, words), delta, scales[ib]))
    return chunks


def _pair_scales(builder, fields, per: int, bits: int, mask: int) -> list:
    """The 16 scales (one per 16 elements) packed `per` to a field of `fields` (<n x i16> or <n x i8>), `bits`
    apart, as the eight sub-blocks' `vpmaddwd` operands <16 x i16>: 2 s + 1 for elements 0-15, then 16-31."""
    words = builder.zext(fields, ir.VectorType(I32, fields.type.count))
    halves = []
    for h in range(2):  # scales 8h .. 8h + 7, one per i32 lane, in both of its i16 halves
        x = _shuffle(builder, words, words, [(8 * h + m) // per for m in range(8)])
        x = builder.lshr(x, ir.Constant(V8I32, [bits * ((8 * h + m) % per) for m in range(8)]))
        x = builder.add(builder.shl(builder.and_(x, _splat(V8I32, mask)), _splat(V8I32, 1)), _splat(V8I32, 1))
        halves.append(builder.or_(x, builder.shl(x, _splat(V8I32, 16))))
    pairs = []
    for ib in range(8):
        half, j = halves[ib // 4], 2 * (ib % 4)
        pairs.append(builder.bitcast(_shuffle(builder, half, half, [j] * 4 + [j + 1] * 4), V16I16))
    return pairs


# IQ2_S (82): +2 low index bytes, +34 sign bytes, +66 qh (2 index bits per 8 elements), +74 scale nibbles per 16;
# index = low byte | (qh >> 2k & 3) << 8, element j of a group signed by bit j of its sign byte
def _iq2_s_block(builder, blk, grid, _):
    """IQ2_S's eight sub-blocks (u, s = +-1 sign bytes, scale) at once, in vector registers."""
    v32i16 = ir.VectorType(I16, 32)
    qh = _shuffle(builder, _load(builder, blk, 66, ir.VectorType(I8, 8)), ir.Constant(ir.VectorType(I8, 8), None),
                  [g // 4 for g in range(32)])  # fmt: skip
    # (qh >> 2 (g % 4) & 3) << 8 = qh << (8 - 2 (g % 4)) & 0x300: a multiply, AVX2 has no per-lane i16 shift
    high = builder.mul(builder.zext(qh, v32i16), ir.Constant(v32i16, [1 << (8 - 2 * (g % 4)) for g in range(32)]))
    idx = builder.or_(builder.zext(_load(builder, blk, 2, V32I8), v32i16), builder.and_(high, _splat(v32i16, 0x300)))
    sbytes = _load(builder, blk, 34, V32I8)
    bit = ir.Constant(V32I8, [1 << (j % 8) if j % 8 < 7 else -128 for j in range(32)])
    scales = _pair_scales(builder, _load(builder, blk, 74, ir.VectorType(I8, 8)), 2, 4, 15)
    chunks = []
    for ib in range(8):
        words = [builder.zext(builder.extract_element(idx, ir.Constant(I32, 4 * ib + k)), I64) for k in range(4)]
        spread = _shuffle(builder, sbytes, sbytes, [4 * ib + j // 8 for j in range(32)])
        clear = builder.sext(builder.icmp_signed("==", builder.and_(spread, bit), _splat(V32I8, 0)), V32I8)
        signs = builder.sub(_splat(V32I8, -1), builder.add(clear, clear))  # clear: -1 - 2 (-1) = 1, set: -1
        chunks.append((_rows(builder, grid, words), signs, scales[ib]))
    return chunks


BLOCKS = {"IQ1_M": _iq1_m_block, "IQ2_S": _iq2_s_block}
