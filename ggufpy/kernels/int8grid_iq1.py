"""IQ1_M and IQ1_S times one Q8_K activation row (decode, T = 1) in the llamacpp numerics, as LLVM IR: the integers
and f32 steps of `ggml_vec_dot_iq1_m_q8_K` / `ggml_vec_dot_iq1_s_q8_K` (arch/x86/quants.c, AVX2;
`int8ir_iqgrid.grid_dot`'s) in fewer instructions, on `int8grid_decode.staged_dot`.

`grid_dot` decodes an IQ1_M block in vector registers (`int8grid_blocks._iq1_m_block`) and then moves each of its
32 grid indices to a general register with `vpextrw` and spreads the delta signs and scales with cross-lane
shuffles. Here the stage writes, per block:

    idx  <32 x i16>   qs[g] | (nibble g & 7) << 8 (IQ1_M: one byte unpack, each grid row: a plain load at idx
                      words in `_pos` order)
    sc   bytes        2 s + 1 per 16 elements (IQ1_S: per 32)            per sub-block one in-lane `vpshufb`
    ssc  <32 x i16>   IQ1_M: per 8 elements its scale times its delta      the delta part (below)
                      sign (nibble bit 3: -1); IQ1_S: +-(2 s + 1) per bsum
    d_w  f32          IQ1_M: the fp16 d from the scales' top nibbles

Grid values are -1, 0, 1: they sign the activations (`vpsignb`), as ggml does, and `vpmaddubsw` multiplies them by
the scale bytes (`_grid_lanes`: the pairs sum exactly in i16, one `vpmaddwd` per block). The
delta terms take no per-element work: IQ1_M's delta sign is constant over 8 elements, so its lane L is
sum_ib ssc . Q(ib, L) with Q the activations' four-element sums (`delta_sums`, once per product), two sub-blocks
per `vpmaddwd` (4 per block instead of 8 `vpsignb` + `vpmaddubsw` + `vpmaddwd`: 0.86-0.90x the time); IQ1_S's is one
integer per block, one `vpmaddwd` of the bsums and a sum. Every integer is exact (|a| <= 127), so the lanes and the
f32 steps are `grid_dot`'s: y = hsum_float_8(acc) + 0.125f * (the delta part).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from ._numba import jit
from .int8grid_blocks import _rows
from .int8grid_decode import staged_dot, vpshufb
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
    _hsum_i32,
    _load,
    _madd,
    _maddubs,
    _psign,
    _shuffle,
    _splat,
)

__all__ = ["delta_sums", "iq1_m_dot", "iq1_s_dot"]

_V32I16 = ir.VectorType(I16, 32)
_IDX, _SSC, _SC, _DW = 0, 64, 128, 160  # stage offsets
_STAGE = 192


def _store(builder, value, at, offset):
    ptr = builder.gep(at, [ir.Constant(I64, offset)])
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=32)


@jit
def delta_sums(aq, t):
    """The four-element sums Q of activation row t (aq int8 (T, 256 nb)) as IQ1_M's decode reads them, int16
    (1, 64 nb): per block and pair k of sub-blocks, word 2L + j = Q(2k + j, L) (elements 32 (2k + j) + 4L..+3)."""
    nb = aq.shape[1] // 256
    q = np.empty((1, 64 * nb), np.int16)
    for b in range(nb):
        for k in range(4):
            for j in range(2):
                for L in range(8):
                    at = 256 * b + 32 * (2 * k + j) + 4 * L
                    s = (
                        np.int32(aq[t, at])
                        + np.int32(aq[t, at + 1])
                        + np.int32(aq[t, at + 2])
                        + np.int32(aq[t, at + 3])
                    )
                    q[0, 64 * b + 16 * k + 2 * L + j] = np.int16(s)
    return q


# -- IQ1_M (56 bytes): qs[32] low index bytes | qh[16] a nibble per 8 elements (index bits 8-10, delta sign at 3) |
# scales u16[4] (3 bits per 16 elements; the fp16 d in the top nibbles)
def _pos(g: int) -> int:
    """The staged word of group g (idx, ssc): bits 3 and 4 of g swapped, the order of `vpunpcklbw` / `vpunpckhbw`
    (words 0-15: groups 0-7, 16-23; 16-31: groups 8-15, 24-31)."""
    return (g & 7) | (g & 8) << 1 | (g & 16) >> 1


def _iq1_m_stage(builder, blk, at, _):
    v16i8 = ir.VectorType(I8, 16)
    qh = _load(builder, blk, 32, v16i8)  # nibble g = byte g // 2 >> 4 (g % 2)
    nib = _shuffle(builder, builder.and_(qh, _splat(v16i8, 15)), builder.lshr(qh, _splat(v16i8, 4)),
                   [g // 2 + 16 * (g % 2) for g in range(32)])  # fmt: skip
    qs = _load(builder, blk, 0, V32I8)
    # scale m (16 elements) = bits 3 (m % 4) .. +2 of u16 m // 4: (x << (13 - 3 (m % 4))) >> 13, a multiply (AVX2
    # has no per-lane i16 shift); 2 s + 1
    fields = _load(builder, blk, 48, ir.VectorType(I16, 4))
    f = _shuffle(builder, fields, fields, [m // 4 for m in range(16)])
    f = builder.mul(f, ir.Constant(V16I16, [1 << (13 - 3 * (m % 4)) for m in range(16)]))
    sc = builder.add(builder.shl(builder.lshr(f, _splat(V16I16, 13)), _splat(V16I16, 1)), _splat(V16I16, 1))
    _store(builder, builder.trunc(sc, ir.VectorType(I8, 16)), at, _SC)
    sign = _fn(builder, "llvm.x86.avx2.psign.w", V16I16, [V16I16, V16I16])
    for h in range(2):  # staged words 16h .. 16h + 15
        groups = [_pos(p) for p in range(16 * h, 16 * h + 16)]  # (`_pos` is its own inverse)
        # word = qs[g] | nibble g << 8: one byte unpack; the index is its low 11 bits, the delta sign its bit 11
        w = builder.bitcast(_shuffle(builder, qs, nib, [i for g in groups for i in (g, 32 + g)]), V16I16)
        _store(builder, builder.and_(w, _splat(V16I16, 0x7FF)), at, _IDX + 32 * h)
        # per group of 8: its scale times its delta sign (-1 where nibble bit 3 is set; (w << 4) | 1 is never 0)
        delta = builder.or_(builder.shl(w, _splat(V16I16, 4)), _splat(V16I16, 1))
        scw = _shuffle(builder, sc, sc, [g // 2 for g in groups])  # in-lane
        _store(builder, builder.call(sign, [scw, delta]), at, _SSC + 32 * h)
    x = _load(builder, blk, 48, I64)  # d: the top nibbles of the four u16
    bits = ir.Constant(I64, 0)
    for i in range(4):
        bits = builder.or_(
            bits, builder.and_(builder.lshr(x, ir.Constant(I64, 12 * (i + 1))), ir.Constant(I64, 0xF << 4 * i))
        )
    dw = builder.fpext(builder.bitcast(builder.trunc(bits, I16), ir.HalfType()), F32)
    builder.store(dw, builder.bitcast(builder.gep(at, [ir.Constant(I64, _DW)]), F32.as_pointer()), align=4)


def _grid(builder, at, gtab, ib, pos):
    """Sub-block ib's grid values (-1, 0, 1) as <32 x i8>, from its four staged indices (group g's at word pos(g))."""
    offsets = [_IDX + 2 * pos(4 * ib + k) for k in range(4)]
    return _rows(builder, gtab, [builder.zext(_load(builder, at, o, I16, 2), I64) for o in offsets])


# the delta lanes of sub-blocks 2k, 2k + 1 in one `vpmaddwd`: lane L = Q(2k, L) ssc(8k + L // 2) + Q(2k + 1, L)
# ssc(8k + 4 + L // 2), Q the activations' four-element sums (`delta_sums`); word 2L + j of the scale operand is
# staged word 4j + L // 2 of the eight at 8k (bytes within each 128-bit half: one `vpshufb` of a broadcast load)
_SSC_PICK = ir.Constant(V32I8, [2 * (4 * (w % 2) + w // 4) + byte for w in range(16) for byte in range(2)])


# the grid lanes: per sub-block `vpmaddubsw`(its scale bytes, a signed by the grid) = pairs sc (g . a), |.| <= 15 * 2
# * 127 = 3810, so the eight sub-blocks sum exactly in i16 (two accumulators: shorter dependency chains) and one
# `vpmaddwd` with ones gives the lanes: 8 `vpmaddwd` fewer per block than ggml's order (0.96x the time)
_SC_PICK_M = [[2 * ib] * 16 + [2 * ib + 1] * 16 for ib in range(8)]  # IQ1_M: bytes m = 16-element scales
_SC_PICK_S = [[ib] * 32 for ib in range(8)]  # IQ1_S: byte ib = sub-block ib's scale


def _grid_lanes(builder, at, ablk, gtab, sc32, picks, pos):
    pairs = [ir.Constant(V16I16, [0] * 16)] * 2
    for ib in range(8):
        a = _psign(builder, _load(builder, ablk, 32 * ib, V32I8), _grid(builder, at, gtab, ib, pos))
        sc = vpshufb(builder, sc32, ir.Constant(V32I8, picks[ib]))
        pairs[ib % 2] = builder.add(pairs[ib % 2], _maddubs(builder, sc, a))
    return _madd(builder, builder.add(pairs[0], pairs[1]), _splat(V16I16, 1))


def _iq1_m_dot(builder, blk, at, ablk, qblk, da, gtab, accs):
    acc, acc2 = accs
    sc16 = _load(builder, at, _SC, ir.VectorType(I8, 16), align=16)
    lanes = _grid_lanes(builder, at, ablk, gtab, _shuffle(builder, sc16, sc16, list(range(16)) * 2), _SC_PICK_M, _pos)
    dlanes = ir.Constant(V8I32, [0] * 8)
    v8i16 = ir.VectorType(I16, 8)
    for k in range(4):  # the delta part, two sub-blocks a `vpmaddwd` (`_SSC_PICK`)
        eight = _load(builder, at, _SSC + 2 * _pos(8 * k), v8i16, align=16)
        both = builder.bitcast(_shuffle(builder, eight, eight, list(range(8)) * 2), V32I8)
        ssc = builder.bitcast(vpshufb(builder, both, _SSC_PICK), V16I16)
        dlanes = builder.add(dlanes, _madd(builder, _load(builder, qblk, 32 * k, V16I16), ssc))
    d = _broadcast(builder, builder.fmul(da, _load(builder, at, _DW, F32, align=4)), V8F32)
    return [_fma(builder, d, builder.sitofp(lanes, V8F32), acc), _fma(builder, d, builder.sitofp(dlanes, V8F32), acc2)]


def _iq1_m_finish(builder, accs):
    acc, acc2 = accs
    eighth = ir.Constant(F32, 0.125)
    return builder.fadd(_hsum_float_8(builder, acc), builder.fmul(eighth, _hsum_float_8(builder, acc2)))


def iq1_m_dot():
    """Intrinsic (w, r, aq, t, ad, qd, nb, grid) -> f32, bit for bit `int8ir_iqgrid.grid_dot("IQ1_M")`; qd =
    `delta_sums(aq, t)`, grid = `int8ir_iqgrid.GRIDS["IQ1_M"]`."""
    zero8 = ir.Constant(V8F32, [0.0] * 8)
    return staged_dot(56, _STAGE, _iq1_m_stage, _iq1_m_dot, lambda: [zero8, zero8], _iq1_m_finish, sums=64)


# -- IQ1_S (50 bytes): d (fp16) | qs[32] low index bytes | qh u16[8], one per sub-block: index bits 8-10 of its
# group k at 3k, the scale s at 12, the delta sign at 15
_S_SC, _S_SSC = 64, 96  # stage offsets: indices (at _IDX, group order), scale bytes, signed scales
_S_STAGE = 128


def _iq1_s_stage(builder, blk, at, _):
    qh = _load(builder, blk, 34, ir.VectorType(I16, 8))
    # index bits 8-10 of group g = qh[g // 4] >> 3 (g % 4) & 7: (x << (13 - 3 (g % 4))) >> 13 (a multiply), << 8
    f = builder.mul(_shuffle(builder, qh, qh, [g // 4 for g in range(32)]),
                    ir.Constant(_V32I16, [1 << (13 - 3 * (g % 4)) for g in range(32)]))  # fmt: skip
    high = builder.shl(builder.lshr(f, _splat(_V32I16, 13)), _splat(_V32I16, 8))
    _store(builder, builder.or_(builder.zext(_load(builder, blk, 2, V32I8), _V32I16), high), at, _IDX)
    v8i16 = ir.VectorType(I16, 8)
    sc = builder.add(builder.shl(builder.and_(builder.lshr(qh, _splat(v8i16, 12)), _splat(v8i16, 7)),
                                 _splat(v8i16, 1)), _splat(v8i16, 1))  # fmt: skip
    _store(builder, builder.trunc(sc, ir.VectorType(I8, 8)), at, _S_SC)
    # bsum m (16 elements) takes +-(2 s + 1) of sub-block m // 2: negative where bit 15 is set
    negative = builder.icmp_signed("<", qh, _splat(v8i16, 0))
    ssc = builder.select(negative, builder.sub(_splat(v8i16, 0), sc), sc)
    _store(builder, _shuffle(builder, ssc, ssc, [m // 2 for m in range(16)]), at, _S_SSC)


def _iq1_s_dot(builder, blk, at, ablk, bsblk, da, gtab, accs):
    acc, acc2 = accs
    sc8 = _load(builder, at, _S_SC, ir.VectorType(I8, 8), align=8)
    sc32 = _shuffle(builder, sc8, sc8, list(range(8)) * 4)
    lanes = _grid_lanes(builder, at, ablk, gtab, sc32, _SC_PICK_S, lambda g: g)  # indices in group order
    # the delta: sumi1 = sum_ib +-(2 s + 1) (bsum 2ib + bsum 2ib+1), an exact integer (one `vpmaddwd`, a sum)
    sumi1 = _hsum_i32(builder, _madd(builder, _load(builder, bsblk, 0, V16I16), _load(builder, at, _S_SSC, V16I16)))
    d = builder.fmul(da, _half(builder, blk, 0))
    acc = _fma(builder, _broadcast(builder, d, V8F32), builder.sitofp(lanes, V8F32), acc)
    return [acc, _fma(builder, d, builder.sitofp(sumi1, F32), acc2)]


def _iq1_s_finish(builder, accs):
    acc, acc2 = accs
    return builder.fadd(_hsum_float_8(builder, acc), builder.fmul(ir.Constant(F32, 0.125), acc2))


def iq1_s_dot():
    """Intrinsic (w, r, aq, t, ad, bsums, nb, grid) -> f32, bit for bit `int8ir_iqgrid.grid_dot("IQ1_S")`;
    grid = `int8ir_iqgrid.GRIDS["IQ1_S"]`."""
    init = [ir.Constant(V8F32, [0.0] * 8), ir.Constant(F32, 0.0)]
    return staged_dot(50, _S_STAGE, _iq1_s_stage, _iq1_s_dot, lambda: init, _iq1_s_finish)
