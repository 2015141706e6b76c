"""IQ2_S times one Q8_K activation row (decode, T = 1) in the llamacpp numerics, as LLVM IR: the integers and f32
steps of `ggml_vec_dot_iq2_s_q8_K` (arch/x86/quants.c, AVX2; `int8ir_iqgrid.grid_dot`'s), in fewer instructions.

`grid_dot` decodes a super-block in vector registers (`int8grid_blocks._iq2_s_block`) and then moves each of its
32 grid indices to a general register with `vpextrw` (two micro-ops each, on the vector ports the block dot needs
too), spreads the 16 scales with two shuffles per sub-block and spills them. Here, per super-block:

    idx[32] (i16, in a stack buffer)   qs | (qh << (8 - 2 (g % 4)) & 0x300), 32 at once, for `CHUNK` blocks
                                       ahead; each grid row is then a plain load at idx (no vector extract)
    S <16 x i16>                       2 ls + 1: the low nibbles (elements 0-15 of sub-block ib) in the low
                                       128-bit lane, the high ones in the upper; sub-block ib's `vpmaddwd`
                                       operand is word ib of each lane (one in-lane shuffle)
    signs                              the sub-block's four sign bytes broadcast (a load) and spread (one
                                       `vpshufb`); (byte & bit) + 127 is negative exactly where the bit is set
                                       and never 0, so `vpsignb` takes it as is (ggml: compare, xor, subtract)

Measured (one thread, CPU time, A/B in one process on a loaded 2-core machine): 0.75-0.79x the time of `grid_dot`
on a 2816 x 1024 product; per token of the 8-layer bench model 0.65x (products) and 0.69x (decode). What was tried
and did not pay: the grid rows as broadcast loads blended together (LLVM folds them back into `vmovq` + `vpunpcklqdq` +
`vinserti128`, and the C equivalent was no faster), `vpgatherqq` for the rows (slower on this Zen 3), prefetching
ahead (the products are bound by computation here, not memory).

The lanes are the same exact integers (lane j: elements 4j..4j+3 of each sub-block times its scale), and the f32
steps are the replay's: acc = fma(fl(d_a * d_w), float(lanes), acc) per super-block, y = 0.125 * hsum_float_8(acc).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .int8grid_blocks import _rows
from .int8ir import (
    F32,
    I8,
    I16,
    I32,
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
    _loop,
    _madd,
    _maddubs,
    _psign,
    _row,
    _shuffle,
    _signature,
    _splat,
)

__all__ = ["BLOCK_BYTES", "iq2_s_dot"]

# block_iq2_s (82 bytes): d (fp16) | qs[32] low index bytes | signs[32] | qh[8] (2 index bits per 8 elements) |
# scales[8] (a nibble per 16 elements)
BLOCK_BYTES, _QS, _SIGNS, _QH, _SCALES = 82, 2, 34, 66, 74
_V32I16 = ir.VectorType(I16, 32)
# Super-blocks whose indices and scales are computed (into the stack, 1.5 KiB) before their dots: reading 16 blocks'
# qs, qh and scales ahead overlaps their cache misses (per token of the bench model 0.65x the previous kernel's
# time, against 0.78x decoding each block just before its dot; in cache the two are equal).
CHUNK = 16


def _indices(builder, blk):
    """The 32 grid indices of a block, <32 x i16>: low byte qs[g], bits 8-9 = qh[g // 4] >> 2 (g % 4) & 3."""
    qh = _shuffle(builder, _load(builder, blk, _QH, ir.VectorType(I8, 8)), ir.Constant(ir.VectorType(I8, 8), None),
                  [g // 4 for g in range(32)])  # fmt: skip
    # (qh >> 2 (g % 4) & 3) << 8 = qh << (8 - 2 (g % 4)) & 0x300: a multiply, AVX2 has no per-lane i16 shift
    high = builder.mul(builder.zext(qh, _V32I16), ir.Constant(_V32I16, [1 << (8 - 2 * (g % 4)) for g in range(32)]))
    low = builder.zext(_load(builder, blk, _QS, V32I8), _V32I16)
    return builder.or_(low, builder.and_(high, _splat(_V32I16, 0x300)))


def _scales(builder, blk):
    """<16 x i16>: words k = 2 (scales[k] & 15) + 1 (elements 32k..32k+15), words 8 + k = 2 (scales[k] >> 4) + 1."""
    sc = builder.zext(_load(builder, blk, _SCALES, ir.VectorType(I8, 8)), ir.VectorType(I16, 8))
    lo = builder.and_(sc, _splat(ir.VectorType(I16, 8), 15))
    hi = builder.lshr(sc, _splat(ir.VectorType(I16, 8), 4))
    s = _shuffle(builder, lo, hi, list(range(16)))
    return builder.add(builder.shl(s, _splat(V16I16, 1)), _splat(V16I16, 1))


def _signs(builder, blk, ib):
    """`vpsignb`'s operand for sub-block ib (<32 x i8>): negative where bit j % 8 of signs[4 ib + j // 8] is set,
    positive elsewhere, never 0: (the byte & the bit) + 127 is 127 or 128..255 (0xFF for bit 7)."""
    word = _broadcast(builder, _load(builder, blk, _SIGNS + 4 * ib, I32), V8I32)
    spread = _shuffle(
        builder,
        builder.bitcast(word, V32I8),
        builder.bitcast(word, V32I8),
        [16 * (j // 16) + j // 8 for j in range(32)],
    )  # fmt: skip (in-lane: one vpshufb)
    bit = ir.Constant(V32I8, [1 << (j % 8) if j % 8 < 7 else -128 for j in range(32)])
    return builder.add(builder.and_(spread, bit), _splat(V32I8, 127))


def _opaque(builder, ptr):
    """An empty asm that may read or write *ptr: the index loads after it stay loads (LLVM would otherwise
    forward the stored vector and extract each index with `vpextrw`, the cost this module removes)."""
    fnty = ir.FunctionType(ir.VoidType(), [ptr.type])
    builder.asm(fnty, "", "r,~{memory}", [ptr], side_effect=True)


def iq2_s_dot():
    """Intrinsic (w, r, aq, t, ad, nb, grid) -> f32: IQ2_S row r of w (u8 (rows, nb * 82)) times Q8_K activation
    row t (aq int8 (T, 256 nb), ad f32 (T, nb)), bit for bit `int8ir_iqgrid.grid_dot("IQ2_S")`; grid =
    `int8ir_iqgrid.GRIDS["IQ2_S"]` (u64 per grid row)."""

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, nb, grid):
        sig = _signature((w, r, aq, t, ad, nb), (types.uint8, int, types.int8, int, types.float32, int))
        if sig is None or not (isinstance(grid, types.Array) and grid.ndim == 1 and grid.layout == "C"):
            return None
        sig = types.float32(*sig.args, grid)

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t_, ad_, nb_, grid_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            gtab = builder.bitcast(context.make_array(signature.args[6])(context, builder, grid_).data, I8.as_pointer())
            idx_buf = builder.bitcast(cgutils.alloca_once(builder, _V32I16, size=CHUNK), I8.as_pointer())
            sc_buf = builder.bitcast(cgutils.alloca_once(builder, V16I16, size=CHUNK), I8.as_pointer())

            def block_at(b):
                return builder.gep(wrow, [builder.mul(b, ir.Constant(I64, BLOCK_BYTES))])

            def chunk(c, carried):
                first = builder.mul(c, ir.Constant(I64, CHUNK))
                rest = builder.sub(nb_, first)
                n = builder.select(
                    builder.icmp_signed("<", rest, ir.Constant(I64, CHUNK)), rest, ir.Constant(I64, CHUNK)
                )

                def prepare(j, _):  # the chunk's indices and scales, ahead of their use
                    blk = block_at(builder.add(first, j))
                    at = builder.gep(idx_buf, [builder.mul(j, ir.Constant(I64, 64))])
                    builder.store(_indices(builder, blk), builder.bitcast(at, _V32I16.as_pointer()), align=32)
                    at = builder.gep(sc_buf, [builder.mul(j, ir.Constant(I64, 32))])
                    builder.store(_scales(builder, blk), builder.bitcast(at, V16I16.as_pointer()), align=32)
                    return []

                _loop(builder, n, [], prepare)
                _opaque(builder, idx_buf)

                def body(j, carried):
                    (acc,) = carried
                    b = builder.add(first, j)
                    blk = block_at(b)
                    ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
                    idx_at = builder.gep(idx_buf, [builder.mul(j, ir.Constant(I64, 64))])
                    scales = _load(builder, sc_buf, builder.mul(j, ir.Constant(I64, 32)), V16I16, align=32)
                    lanes = ir.Constant(V8I32, [0] * 8)
                    for ib in range(8):
                        words = [builder.zext(_load(builder, idx_at, 8 * ib + 2 * k, I16, 2), I64) for k in range(4)]
                        a = _psign(builder, _load(builder, ablk, 32 * ib, V32I8), _signs(builder, blk, ib))
                        p = _maddubs(builder, _rows(builder, gtab, words), a)
                        sc = _shuffle(builder, scales, scales, [ib] * 8 + [8 + ib] * 8)  # in-lane: one `vpshufb`
                        lanes = builder.add(lanes, _madd(builder, p, sc))
                    da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                    d = _broadcast(builder, builder.fmul(da, _half(builder, blk, 0)), V8F32)
                    return [_fma(builder, d, builder.sitofp(lanes, V8F32), acc)]

                return _loop(builder, n, carried, body)

            chunks = builder.sdiv(builder.add(nb_, ir.Constant(I64, CHUNK - 1)), ir.Constant(I64, CHUNK))
            (acc,) = _loop(builder, chunks, [ir.Constant(V8F32, [0.0] * 8)], chunk)
            return builder.fmul(ir.Constant(F32, 0.125), _hsum_float_8(builder, acc))

        return sig, codegen

    return dot
