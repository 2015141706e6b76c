"""IQ2_XS times one Q8_K activation row (decode, T = 1) in the llamacpp numerics, as LLVM IR: the integers and f32
steps of `ggml_vec_dot_iq2_xs_q8_K` (arch/x86/quants.c, AVX2; `int8ir_iqgrid.grid_dot("IQ2_XS")`'s) in fewer
instructions, on `int8grid_decode.staged_dot`.

block_iq2_xs (74 bytes): d (fp16) | qs u16[32]: per 8 elements a 9-bit grid index | a 7-bit sign index << 9 |
scales[8]: a nibble per 16 elements. The 7 sign bits are the first seven of a byte with even parity
(ggml-common.h `ksigns_iq2xs`); `grid_dot` looks each up in that table (four u64 loads and an insert chain per
sub-block). Here a block's 32 sign bytes are computed at once in the stage, as ggml's AVX2 kernel does:

    s = q >> 9;  byte = s | 0x80 * parity(s)     parity from a `vpshufb` table of the nibble s ^ s >> 4

and packed to bytes (`vpackuswb`, in-lane: groups 0-7, 16-23, 8-15, 24-31, so sub-block ib's four bytes sit at
`_SIGN_AT[ib]`); per sub-block they become `vpsignb`'s operand with a broadcast load and one `vpshufb`
(`int8grid_decode.signs_at`). The scales are one <16 x i16> per block (one in-lane shuffle per sub-block), and the
grid rows are loaded at q & 511 straight from the block.
"""

from __future__ import annotations

from llvmlite import ir

from .int8grid_blocks import _rows
from .int8grid_decode import nibble_scales, signs_at, spread_scales, staged_dot, vpshufb
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
    _fn,
    _half,
    _hsum_float_8,
    _load,
    _madd,
    _maddubs,
    _psign,
    _splat,
)

__all__ = ["iq2_xs_dot"]

BLOCK_BYTES, _QS, _SCALES = 74, 2, 66
_STAGE = 64  # per block: 32 sign bytes, then the <16 x i16> scales
_SIGN_AT = [0, 4, 16, 20, 8, 12, 24, 28]  # sub-block ib's four sign bytes in the packed order
# 0x80 where the nibble has odd parity: the eighth sign bit that makes the byte's parity even
_PARITY = ir.Constant(V32I8, [-128 if bin(i % 16).count("1") % 2 else 0 for i in range(32)])


def _sign_bytes(builder, blk):
    """<32 x i8>: the block's 32 full sign bytes, groups 0-7, 16-23, 8-15, 24-31."""
    halves = []
    for h in range(2):  # groups 16h .. 16h + 15, one per i16 lane (high bytes 0 throughout)
        s = builder.lshr(_load(builder, blk, _QS + 32 * h, V16I16), _splat(V16I16, 9))
        nib = builder.bitcast(builder.xor(s, builder.lshr(s, _splat(V16I16, 4))), V32I8)
        odd = builder.bitcast(vpshufb(builder, _PARITY, nib), V16I16)
        halves.append(builder.or_(s, odd))
    pack = _fn(builder, "llvm.x86.avx2.packuswb", V32I8, [V16I16, V16I16])
    return builder.call(pack, halves)


def _stage(builder, blk, at, _):
    builder.store(_sign_bytes(builder, blk), builder.bitcast(at, V32I8.as_pointer()), align=32)
    scales = nibble_scales(builder, _load(builder, blk, _SCALES, ir.VectorType(I8, 8)))
    builder.store(scales, builder.bitcast(builder.gep(at, [ir.Constant(I64, 32)]), V16I16.as_pointer()), align=32)


def _dot(builder, blk, at, ablk, _bsblk, da, gtab, accs):
    (acc,) = accs
    scales = _load(builder, at, 32, V16I16, align=32)
    lanes = ir.Constant(V8I32, [0] * 8)
    for ib in range(8):
        q = [builder.zext(_load(builder, blk, _QS + 8 * ib + 2 * k, I16), I64) for k in range(4)]
        u = _rows(builder, gtab, [builder.and_(x, ir.Constant(I64, 511)) for x in q])
        a = _psign(builder, _load(builder, ablk, 32 * ib, V32I8), signs_at(builder, at, _SIGN_AT[ib]))
        lanes = builder.add(lanes, _madd(builder, _maddubs(builder, u, a), spread_scales(builder, scales, ib)))
    d = _broadcast(builder, builder.fmul(da, _half(builder, blk, 0)), V8F32)
    return [_fma(builder, d, builder.sitofp(lanes, V8F32), acc)]


def _finish(builder, accs):
    return builder.fmul(ir.Constant(F32, 0.125), _hsum_float_8(builder, accs[0]))


def iq2_xs_dot():
    """Intrinsic (w, r, aq, t, ad, bsums, nb, grid) -> f32, bit for bit `int8ir_iqgrid.grid_dot("IQ2_XS")`;
    grid = `int8ir_iqgrid.GRIDS["IQ2_XS"]`."""
    return staged_dot(BLOCK_BYTES, _STAGE, _stage, _dot, lambda: [ir.Constant(V8F32, [0.0] * 8)], _finish)
