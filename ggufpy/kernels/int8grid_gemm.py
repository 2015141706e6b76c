"""The grid types' tiled kernel with lanes = weight rows: eight weight rows decoded once per call into an L1
scratch, then every activation row against them, the accumulators in registers (as MXFP4's gemm,
`int8ir_fp4_x8.mxfp4x8_gemm`, and ggml's repacked gemms, arch/x86/repack.cpp). `int8grid_tiles.grid_tiles`
runs it for weight matrices of 8 rows or more.

Register k of sub-block s holds, in lane r, elements 4k..4k+3 of weight row r (signed values, as
`int8grid_tiles` builds them); one activation row costs, per sub-block, eight broadcasts of four biased quants
q + 128 (1..255) and eight `vpmaddubsw`:

    p_k = vpmaddubsw(broadcast(q[4k..4k+3] + 128), v_k)      16 x i16, pair sums of one row each
    lanes += vpmaddwd(p_k + ... + p_{k+n-1}, scales)          n = CHAIN[type] products summed in i16 first

Summing n products in i16 is exact while n * 2 * 255 * max|v| < 2^15: IQ3_S's grid values are 1..15 (n = 4),
IQ1's v = 8 grid + delta is 9 at most (n = 4, the 16-element scales of IQ1_M allow no more), IQ3_XXS's are even
(4..62) and are halved here (n = 2; the integer sum is doubled back), IQ2's reach 43 (n = 1). So a sub-block
costs 8 + 8 / n multiplies for eight weight rows, where the row-at-a-time form paid 16 and read 32 activation
bytes (from L2 for long rows) for every 32 products. s1 and the f32 epilogue are `int8grid_tiles`'s, per
element: s1 = lanes - corr, p = fl(float(s1) * fl(d_w * c)), y = fma(p, d_a, y) per super-block in order.

Scratch for the group (u8, nb * SCRATCH_PER_BLOCK; per super-block b, at b * SCRATCH_PER_BLOCK):

    v       (8 s, 8 k) <32 x i8>      2048    decoded row-major ([s][row]) first, transposed in place
    scales  (8 s, 2 halves) <16 x i16>  512    i16 pair r: row r's 2 ls + 1 for elements 0-15 / 16-31
    corr    <8 x i32>, dc <8 x f32>     64    128 sum sc v (halved v for IQ3_XXS), fl(d_w * c)
"""

from __future__ import annotations

from llvmlite import ir

from .int8ir import (
    F32,
    I8,
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
    _psign,
    _row,
    _shuffle,
    _splat,
)
from .int8ir_iqgrid import TYPES, _chunks, _half, _iq1_m_d

__all__ = ["CHAIN", "HALVED", "ROWS", "SCRATCH_PER_BLOCK", "TILE", "group_tiles", "signed_values"]

ROWS = 8  # weight rows per group: one per i32 lane
TILE = 4  # activation rows per pass over the decoded group (their accumulators in registers)
SCRATCH_PER_BLOCK = 2048 + 512 + 64
_SC, _CORR, _DC = 2048, 2560, 2592  # offsets within a super-block's scratch
CHAIN = {"IQ2_XXS": 1, "IQ2_XS": 1, "IQ2_S": 1, "IQ3_XXS": 2, "IQ3_S": 4, "IQ1_S": 4, "IQ1_M": 4}
SCALES16 = {"IQ2_XS", "IQ2_S", "IQ1_M"}  # a scale per 16 elements: registers k < 4 and k >= 4 apart
HALVED = {"IQ3_XXS"}  # grid values all even: v / 2 exact, the sums doubled back


def signed_values(builder, name, u, s):
    """One sub-block's signed weight values <32 x i8> from `int8ir_iqgrid`'s decode (u, s)."""
    if name == "IQ1_S":  # s = +-(2 ls + 1): its sign is the delta's
        one = builder.select(builder.icmp_signed("<", s, ir.Constant(I64, 0)), ir.Constant(I8, -1), ir.Constant(I8, 1))
        return builder.add(builder.shl(u, _splat(V32I8, 3)), _broadcast(builder, one, V32I8))
    if name == "IQ1_M":  # s = the +-1 delta bytes
        return builder.add(builder.shl(u, _splat(V32I8, 3)), s)
    return _psign(builder, u, s)  # grid bytes (0..62) with the sign bytes' +-1


def _store(builder, base, offset, value, align: int = 1):
    off = offset if isinstance(offset, ir.Value) else ir.Constant(I64, offset)
    builder.store(value, builder.bitcast(builder.gep(base, [off]), value.type.as_pointer()), align=align)


def _transpose8(builder, v):
    """Eight <8 x i32> (row j, dword k) -> eight <8 x i32> (dword k, lane j): `unpack{lo,hi}_epi32`,
    `unpack{lo,hi}_epi64`, then the 128-bit halves (`vperm2i128`)."""
    lo32, hi32 = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    lo64, hi64 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    a = [_shuffle(builder, v[2 * i], v[2 * i + 1], m) for i in range(4) for m in (lo32, hi32)]
    # a[2i]: rows 2i, 2i+1, dwords 0, 1 (| 4, 5); a[2i+1]: dwords 2, 3 (| 6, 7)
    b = [_shuffle(builder, a[i], a[i + 2], m) for i in (0, 1, 4, 5) for m in (lo64, hi64)]
    # b: rows 0-3 (i = 0, 1) or 4-7 (i = 4, 5), one dword k (| k + 4) each: k = 0, 1, 2, 3
    low, high = list(range(4)) + list(range(8, 12)), list(range(4, 8)) + list(range(12, 16))
    return [_shuffle(builder, b[k], b[k + 4], low) for k in range(4)] + [
        _shuffle(builder, b[k], b[k + 4], high) for k in range(4)
    ]


def _decode_group(context, builder, name, wty, w_, r0, nb, gtab, stab, scratch):
    """Super-blocks 0..nb of weight rows r0..r0+8 into the scratch (layout in the module docstring)."""
    size, c = TYPES[name]

    def block(b, _):
        at = builder.mul(b, ir.Constant(I64, SCRATCH_PER_BLOCK))
        base = builder.gep(scratch, [at])
        boff = builder.mul(b, ir.Constant(I64, size))

        def row(j, _):
            blk = builder.gep(_row(context, builder, wty, w_, builder.add(r0, j)), [boff])
            corr = ir.Constant(V8I32, [0] * 8)
            four_j = builder.mul(j, ir.Constant(I64, 4))
            for s, (u, sg, scale) in enumerate(_chunks(builder, name, blk, gtab, stab)):
                v = signed_values(builder, name, u, sg)
                if name in HALVED:
                    v = builder.ashr(v, _splat(V32I8, 1))
                _store(builder, base, builder.add(builder.mul(j, ir.Constant(I64, 32)), ir.Constant(I64, 256 * s)), v)
                corr = builder.add(corr, _madd(builder, _maddubs(builder, _splat(V32I8, -128), v), scale))  # 128 v
                for h in range(2):  # the scale of elements 16h..16h+15, in both halves of lane j
                    x = builder.zext(builder.extract_element(scale, ir.Constant(I32, 8 * h)), I32)
                    x = builder.or_(x, builder.shl(x, ir.Constant(I32, 16)))
                    _store(builder, base, builder.add(four_j, ir.Constant(I64, _SC + 64 * s + 32 * h)), x)
            _store(builder, base, builder.add(four_j, ir.Constant(I64, _CORR)), _hsum_i32(builder, corr))
            dw = _iq1_m_d(builder, blk) if name == "IQ1_M" else _half(builder, blk, 0)
            _store(builder, base, builder.add(four_j, ir.Constant(I64, _DC)), builder.fmul(dw, ir.Constant(F32, c)))
            return []

        _loop(builder, ir.Constant(I64, ROWS), [], row)
        for s in range(8):  # [s][row] -> [s][k], in place
            rows = [builder.bitcast(_load(builder, base, 256 * s + 32 * j, V32I8), V8I32) for j in range(8)]
            for k, x in enumerate(_transpose8(builder, rows)):
                _store(builder, base, 256 * s + 32 * k, builder.bitcast(x, V32I8))
        return []

    _loop(builder, nb, [], block)


def _sub_block(builder, name, base, s, arows, aoff, lanes):
    """lanes[i] += sub-block s (an i64) of the decoded super-block at base . activation rows arows (at byte aoff)."""
    vat = builder.mul(s, ir.Constant(I64, 256))
    v = [_load(builder, base, builder.add(vat, ir.Constant(I64, 32 * k)), V32I8) for k in range(8)]
    sat = builder.add(builder.mul(s, ir.Constant(I64, 64)), ir.Constant(I64, _SC))
    halves = 2 if name in SCALES16 else 1
    scales = [_load(builder, base, builder.add(sat, ir.Constant(I64, 32 * h)), V16I16) for h in range(halves)]
    chain = CHAIN[name]
    aoff = builder.add(aoff, builder.mul(s, ir.Constant(I64, 32)))
    out = []
    for arow, acc in zip(arows, lanes, strict=True):
        a = builder.gep(arow, [aoff])
        p = [_maddubs(builder, builder.bitcast(_broadcast(builder, _load(builder, a, 4 * k, I32), V8I32), V32I8), v[k])
             for k in range(8)]  # fmt: skip
        for k0 in range(0, 8, chain):
            x = p[k0]
            for k in range(k0 + 1, k0 + chain):
                x = builder.add(x, p[k])  # exact: chain * 2 * 255 * max|v| < 2^15
            acc = builder.add(acc, _madd(builder, x, scales[k0 // 4 if halves == 2 else 0]))
        out.append(acc)
    return out


def group_tiles(context, builder, sig, args, name, gtab, stab, scratch, r0):
    """out[t, r0:r0+8] for every t < T (>= TILE): the group decoded into the scratch, then TILE activation rows at
    a time (the last tile starts at T - TILE, recomputing a few rows, the same bits)."""
    w_, _, ab_, adt_, T_, nb_, _, _, _, out_ = args
    wty, abty, adty, oty = sig.args[0], sig.args[2], sig.args[3], sig.args[9]
    _decode_group(context, builder, name, wty, w_, r0, nb_, gtab, stab, scratch)
    tiles = builder.sdiv(builder.add(T_, ir.Constant(I64, TILE - 1)), ir.Constant(I64, TILE))
    last = builder.sub(T_, ir.Constant(I64, TILE))
    zero8 = ir.Constant(V8F32, [0.0] * 8)

    def tile(i, _):
        t0 = builder.mul(i, ir.Constant(I64, TILE))
        t0 = builder.select(builder.icmp_signed(">", t0, last), last, t0)
        ts = [builder.add(t0, ir.Constant(I64, k)) for k in range(TILE)]
        arows = [_row(context, builder, abty, ab_, t) for t in ts]

        def block(b, ys):
            base = builder.gep(scratch, [builder.mul(b, ir.Constant(I64, SCRATCH_PER_BLOCK))])
            aoff = builder.mul(b, ir.Constant(I64, 256))
            zero = [ir.Constant(V8I32, [0] * 8)] * TILE
            lanes = _loop(
                builder, ir.Constant(I64, 8), zero, lambda s, acc: _sub_block(builder, name, base, s, arows, aoff, acc)
            )
            corr = _load(builder, base, _CORR, V8I32)
            dc = _load(builder, base, _DC, V8F32)
            drow = _row(context, builder, adty, adt_, b)
            out = []
            for t, acc, y in zip(ts, lanes, ys, strict=True):
                s1 = builder.sub(acc, corr)
                if name in HALVED:
                    s1 = builder.shl(s1, _splat(V8I32, 1))
                p = builder.fmul(builder.sitofp(s1, V8F32), dc)
                da = _broadcast(builder, _load(builder, drow, builder.mul(t, ir.Constant(I64, 4)), F32), V8F32)
                out.append(_fma(builder, p, da, y))
            return out

        ys = _loop(builder, nb_, [zero8] * TILE, block)
        for t, y in zip(ts, ys, strict=True):
            orow = _row(context, builder, oty, out_, t)
            _store(builder, orow, builder.mul(r0, ir.Constant(I64, 4)), y)
        return []

    _loop(builder, tiles, [], tile)
