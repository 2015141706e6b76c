"""LLVM IR of the exact numerics' MXFP4 and NVFP4 products (`exact_lowbit.py`): the codes decoded in registers to
integer-valued f32 weights, multiply-added with the f32 activations, and the scales applied once per 32 products.

The reference's weight is fl(d * k), k in ggml's `kvalues_mxfp4` (0, 1, 2, 3, 4, 6, 8, 12 and their negatives: the
E2M1 values doubled) and d the block's E8M0 "half" scale (MXFP4, a power of two) or a 16-element sub-block's
UE4M3 half scale (NVFP4, 4 significant bits). k has at most 2 significant bits, so d * k is exact in f32 (barring
overflow and subnormals) and sum_i x_i (d k_i) = d sum_i x_i k_i: scaling a sum instead of each weight changes the
result by the f32 roundings of the summation only, as `exact_grid` does for the IQ types. Per 16 code bytes:

    k    = pshufb(kvalues, nibbles)                  <32 x i8>, one `vpshufb` (as `int8ir_nvfp4`)
    w8_m = float(byte m of each 32-bit lane of k, moved to the lane's top byte)   = k 2^24, exact; m = 0..3
    s8   = x8_0 * w8_0;  s8 = fma(x8_m, w8_m, s8)    over the 4 chunks
    acc  = fma(d8, s8, acc)                          d8: each lane's scale times 2^-24 (a table), exact
    y    = hsum_float_8(acc)

A chunk holds byte m of every lane, so its 8 weights are elements 4i + m of the 16 low nibbles and of the 16 high
ones (`Format.order`): the activations are permuted to it once per call, and no instruction moves bytes to lanes
(`vpshufb` or `vpmovsxbd` per chunk ran ~1.5x the time). Each lane's 4 products share one scale (NVFP4's lanes
hold two sub-blocks: d8 = d0 d0 d1 d1 twice). Compared with `exact_lowbit_ir`'s per-chunk `vpmovzxbd` + `vpermps`
of an 8-entry table + sign xor: ~16 instead of ~30 vector instructions per 32 weights. Range: x k 2^24 overflows
for |x| > ~1.7e30, and MXFP4 exponents e <= 2 (d <= 2^-126) give d 2^-24 = 0 (see `_SCALES`).

`row_dot(n)`: one activation row, n weight rows decoded side by side. From 2 activation rows, `row_decode` writes a
weight row's f32 weights and lane scales into a scratch once, and `scratch_dot(n, m)` runs n weight rows x m
activation rows with each activation row's operations exactly those of `row_dot` (`_group`: the same chunks, order
and accumulator; no fast-math flags, so no FMA contraction or reassociation): a row of a batch is bit for bit the
row alone.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..constants import GGMLType
from ..quants.lowbit import KVALUES_MXFP4, UE4M3_HALF, e8m0_to_fp32_half
from .exact_lowbit_ir import _at, _check, _reduce, _switch
from .int8ir import F32, F32T, I8, I32, I64, U8, V8F32, V32I8, _broadcast, _fma, _fn, _load, _loop, _row, _splat
from .int8ir_nvfp4 import _codes

__all__ = ["FORMATS", "KINDS", "row_decode", "row_dot", "scratch_dot"]

V8I32 = ir.VectorType(I32, 8)


def _kvalues(builder, codes):
    """<32 x i8> codes 0..15 -> ggml's int8 kvalues_mxfp4 (`vpshufb`, the 16-byte table in both halves)."""
    fn = _fn(builder, "llvm.x86.avx2.pshuf.b", V32I8, [V32I8, V32I8])
    return builder.call(fn, [ir.Constant(V32I8, [int(v) for v in KVALUES_MXFP4] * 2), codes])


def _chunks(builder, blk, at):
    """The 32 codes of the 16 bytes at blk + at as 4 <8 x float> chunks of kvalue 2^UNIT. Chunk m, lane i: byte m
    of the i-th 32-bit lane of the kvalues (code byte j = 4 (i % 4) + m, its low nibble for i < 4, else its high
    one), moved to the lane's top byte (a shift and `vpand`; LLVM makes bytes 1 and 2 one `vpshufb` each): its i32
    is kvalue 2^24, converted exactly. (An arithmetic shift back to kvalue cost ~15%: the 2^-24 is in the scales.)"""
    k = builder.bitcast(_kvalues(builder, _codes(builder, blk, at)), V8I32)
    top = _splat(V8I32, -(1 << 24))  # 0xFF000000
    lanes = [builder.shl(k, _splat(V8I32, 24))]  # byte 0: the shift alone clears the bytes below
    lanes += [builder.and_(builder.shl(k, _splat(V8I32, 8 * (3 - m))), top) for m in (1, 2)]
    lanes.append(builder.and_(k, top))
    return [builder.sitofp(v, V8F32) for v in lanes]


UNIT = 24  # the weights are kvalue 2^UNIT in the lanes, the scales d 2^-UNIT (`_SCALES`): d' w = d kvalue exactly


def _order(element):
    """Per 32 positions (chunk m, lane i at 8m + i), the element there: element(j, half) of code byte j's nibble."""
    return np.array([element(4 * (i % 4) + m, i // 4) for m in range(4) for i in range(8)], np.int64)


# Each scale byte's f32 value as the reference has it (`quants/lowbit.py`) times 2^-UNIT: one load per scale (the
# E8M0 formula in registers, scalar then `vmovd` + `vpbroadcastd`, cost ~1/4 of an MXFP4 block's time). Exact for
# every UE4M3 byte (the smallest nonzero half is 2^-10) and E8M0 e >= 3; e = 0, 1, 2 (d <= 2^-126, weights at most
# 12 * 2^-126, subnormal products in the reference too) round to 0.
_SCALES = {
    "e8m0_half": np.ldexp(e8m0_to_fp32_half(np.arange(256, dtype=np.uint8)), -UNIT).astype(np.float32),
    "ue4m3_half": np.ldexp(np.asarray(UE4M3_HALF, np.float32), -UNIT).astype(np.float32),
}


def _scale(builder, name, byte):
    """_SCALES[name][byte] (an i8 ir.Value): a load from a constant global of the module."""
    gv = builder.module.globals.get(f"exact_fp4.{name}")
    if gv is None:
        ty = ir.ArrayType(F32, 256)
        gv = ir.GlobalVariable(builder.module, ty, f"exact_fp4.{name}")
        gv.initializer = ir.Constant(ty, [float(v) for v in _SCALES[name]])
        gv.global_constant, gv.linkage = True, "internal"
    return builder.load(builder.gep(gv, [ir.Constant(I64, 0), builder.zext(byte, I64)]))


# -- decoders: decode(builder, blk) -> [(d8, [(position, w8) x 4]), ...]: per 16 code bytes (32 positions), the
# f32 scale of each lane (a lane's 4 weights share one scale) and the 4 chunks. Layouts: quants/lowbit.py.
def _mxfp4(builder, blk):
    """block_mxfp4: E8M0 e at 0; qs at 1: low nibble -> element j, high -> j + 16."""
    d = _broadcast(builder, _scale(builder, "e8m0_half", _load(builder, blk, 0, I8)), V8F32)
    return [(d, [(8 * m, w) for m, w in enumerate(_chunks(builder, blk, 1))])]


def _nvfp4(builder, blk):
    """block_nvfp4: UE4M3 d[4] at 0; qs[8s + j] at 4: low nibble -> element 16s + j, high -> 16s + 8 + j. In the
    16 bytes of sub-blocks 2h, 2h + 1, lanes i % 4 < 2 (bytes 0-7) belong to 2h and the others to 2h + 1."""
    d = [_broadcast(builder, _scale(builder, "ue4m3_half", _load(builder, blk, s, I8)), V8F32) for s in range(4)]
    groups = []
    for h in range(2):  # lanes [d_2h, d_2h, d_2h+1, d_2h+1] twice (`vblendps`)
        d8 = builder.shuffle_vector(d[2 * h], d[2 * h + 1], ir.Constant(V8I32, [0, 1, 10, 11, 4, 5, 14, 15]))
        groups.append((d8, [(32 * h + 8 * m, w) for m, w in enumerate(_chunks(builder, blk, 4 + 16 * h))]))
    return groups


class Format:
    """One format's block: bytes, elements, decoder, and `order`: per 32 elements, the element at each position
    (the activations are put in this order once per call, the scratch holds the weights in it)."""

    def __init__(self, block_bytes: int, block_size: int, decode, element):
        self.block_bytes, self.block_size, self.decode = block_bytes, block_size, decode
        self.order = _order(element)


FORMATS = {
    GGMLType.MXFP4: Format(17, 32, _mxfp4, lambda j, half: j + 16 * half),
    GGMLType.NVFP4: Format(36, 64, _nvfp4, lambda j, half: 16 * (j // 8) + 8 * half + j % 8),
}
KINDS = {t: k for k, t in enumerate(FORMATS)}
"""GGML type -> the `kind` argument of the intrinsics."""


def _group(builder, acc, d8, pairs):
    """acc + d8 * (x . w), lane by lane, over 32 positions' chunks (x8, w8): the one operation sequence of both
    paths (lane-wise scales: NVFP4's lanes hold two sub-blocks). (Two sums of 2 chunks into two accumulators, or
    2 or 4 weight rows side by side, measured the same: the decode's throughput bounds it, not the FMA latency.)"""
    (x, w), *rest = pairs
    s = builder.fmul(x, w)
    for x, w in rest:
        s = _fma(builder, x, w, s)
    return _fma(builder, d8, s, acc)


def _y(builder, acc):
    return _reduce(builder, [acc])  # (the 8 lanes in `hsum_float_8`'s order)


def _x8(builder, base, element):
    return _load(builder, _at(builder, base, ir.Constant(I64, element)), 0, V8F32)


def row_dot(rows: int):
    """Intrinsic (kind, q u8 (R, row bytes), r, xv f32 (T, cols), t, nb, out f32 (T, R)) -> int: out[t, r + i] =
    weight row r + i (nb blocks) times activation row t for i < rows, decoded in registers; returns `rows`."""

    @intrinsic
    def dot(typingctx, kind, q, r, xv, t, nb, out):
        if not _check((kind, q, r, xv, t, nb, out), (int, U8, int, F32T, int, int, F32T)):
            return None

        def codegen(context, builder, signature, args):
            kind_, q_, r_, xv_, t_, nb_, out_ = args
            xrow = _row(context, builder, signature.args[3], xv_, t_)
            orow = _row(context, builder, signature.args[6], out_, t_)

            def case(f):
                rs = [builder.add(r_, ir.Constant(I64, i)) for i in range(rows)]
                qrows = [_row(context, builder, signature.args[1], q_, ri) for ri in rs]

                def body(b, accs):
                    xblk = _at(builder, xrow, builder.mul(b, ir.Constant(I64, f.block_size)))
                    accs = list(accs)
                    for i, qrow in enumerate(qrows):
                        blk = builder.gep(qrow, [builder.mul(b, ir.Constant(I64, f.block_bytes))])
                        for d8, chunks in f.decode(builder, blk):
                            accs[i] = _group(builder, accs[i], d8, [(_x8(builder, xblk, e), w) for e, w in chunks])
                    return accs

                accs = _loop(builder, nb_, [_splat(V8F32, 0.0)] * rows, body)
                for acc, ri in zip(accs, rs, strict=True):
                    builder.store(_y(builder, acc), builder.bitcast(_at(builder, orow, ri), F32.as_pointer()))
                return ir.Constant(I64, rows)

            return _switch(builder, kind_, case, I64, FORMATS)

        return types.int64(types.int64, q, types.int64, xv, types.int64, types.int64, out), codegen

    return dot


@intrinsic
def row_decode(typingctx, kind, q, r, w, s, i, nb):
    """(kind, q, r, w f32 (R, cols), s f32 (R, cols / 4), i, nb): row r's weights (UNIT * kvalue, in the positions'
    order) into w[i] and each position group's lane scales into s[i] (8 per 32 positions), as `row_dot` has them."""
    if not _check((kind, q, r, w, s, i, nb), (int, U8, int, F32T, F32T, int, int)):
        return None

    def codegen(context, builder, signature, args):
        kind_, q_, r_, w_, s_, i_, nb_ = args
        qrow = _row(context, builder, signature.args[1], q_, r_)
        wrow = _row(context, builder, signature.args[3], w_, i_)
        srow = _row(context, builder, signature.args[4], s_, i_)

        def store(v, base, at):
            builder.store(v, builder.bitcast(_at(builder, base, ir.Constant(I64, at)), V8F32.as_pointer()), align=4)

        def case(f):
            def body(b, carried):
                blk = builder.gep(qrow, [builder.mul(b, ir.Constant(I64, f.block_bytes))])
                wblk = _at(builder, wrow, builder.mul(b, ir.Constant(I64, f.block_size)))
                sblk = _at(builder, srow, builder.mul(b, ir.Constant(I64, f.block_size // 4)))
                for g, (d8, chunks) in enumerate(f.decode(builder, blk)):
                    store(d8, sblk, 8 * g)
                    for e, w in chunks:
                        store(w, wblk, e)
                return carried

            _loop(builder, nb_, [], body)

        _switch(builder, kind_, case, None, FORMATS)
        return context.get_dummy_value()

    return types.none(types.int64, q, types.int64, w, s, types.int64, types.int64), codegen


def scratch_dot(rows: int, acts: int):
    """Intrinsic (kind, w f32 (rows, cols), s f32 (rows, cols / 4), xv f32 (T, cols), t0, out f32 (T, R), r):
    out[t0 + j, r + i] = the scratch row i . xv[t0 + j] for i < rows, j < acts, each with `row_dot`'s operations."""

    @intrinsic
    def dot(typingctx, kind, w, s, xv, t0, out, r):
        if not _check((kind, w, s, xv, t0, out, r), (int, F32T, F32T, F32T, int, F32T, int)):
            return None

        def codegen(context, builder, signature, args):
            kind_, w_, s_, xv_, t0_, out_, r_ = args
            wrows = [_row(context, builder, signature.args[1], w_, ir.Constant(I64, i)) for i in range(rows)]
            srows = [_row(context, builder, signature.args[2], s_, ir.Constant(I64, i)) for i in range(rows)]
            ts = [builder.add(t0_, ir.Constant(I64, j)) for j in range(acts)]
            xrows = [_row(context, builder, signature.args[3], xv_, t) for t in ts]
            cols = builder.extract_value(context.make_array(signature.args[3])(context, builder, xv_).shape, 1)

            def case(f):
                def body(g, accs):  # positions 32g..32g+31: `row_dot`'s chunks, in its order
                    at, at8 = builder.mul(g, ir.Constant(I64, 32)), builder.mul(g, ir.Constant(I64, 8))
                    wg = [_at(builder, wrow, at) for wrow in wrows]
                    xg = [_at(builder, xrow, at) for xrow in xrows]
                    d8 = [_load(builder, _at(builder, srow, at8), 0, V8F32) for srow in srows]
                    accs = list(accs)
                    for i in range(rows):
                        for j in range(acts):  # (the loads of w and x are shared: one per chunk and row)
                            pairs = [(_x8(builder, xg[j], e), _x8(builder, wg[i], e)) for e in range(0, 32, 8)]
                            accs[acts * i + j] = _group(builder, accs[acts * i + j], d8[i], pairs)
                    return accs

                groups = builder.sdiv(cols, ir.Constant(I64, 32))
                accs = _loop(builder, groups, [_splat(V8F32, 0.0)] * (rows * acts), body)
                for j, t in enumerate(ts):
                    orow = _row(context, builder, signature.args[5], out_, t)
                    for i in range(rows):
                        at = _at(builder, orow, builder.add(r_, ir.Constant(I64, i)))
                        builder.store(_y(builder, accs[acts * i + j]), builder.bitcast(at, F32.as_pointer()))

            _switch(builder, kind_, case, None, FORMATS)
            return context.get_dummy_value()

        return types.none(types.int64, w, s, xv, types.int64, out, types.int64), codegen

    return dot
