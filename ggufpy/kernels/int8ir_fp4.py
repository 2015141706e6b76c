"""LLVM IR for ggml's FP4 block dot products (MXFP4, NVFP4) with Q8_0 activations, as numba intrinsics.

Both formats store 4-bit E2M1 codes that ggml maps to int8 through the 16-entry `kvalues_mxfp4` (the values
doubled, -12..12) with one `vpshufb` per 32 codes, and scale each block in f32 (`GGML_E8M0_TO_FP32_HALF` of
MXFP4's exponent byte, `GGML_UE4M3_TO_FP32` of NVFP4's four sub-block bytes). The table here holds the values
plus 12 (0..24, unsigned), so that `vpmaddubsw` takes them as they are and the lanes are corrected by
12 * (sum of the four activation quants), which `int8dot.quantize` already keeps (`asum`): the same exact
integers as ggml's sign trick (`_mm256_sign_epi8` on both operands, two instructions per row and block,
where the eight-row kernels correct all eight rows at once); pairs stay below 2 * 24 * 127 < 2^15 (no
saturation). The f32 steps are those of the replays:

    MXFP4, out % 8 != 0   `ggml_vec_dot_mxfp4_q8_0` (quants/x86/mxfp4.py): blocks 2i and 2i+1 into two 8-lane
                          accumulators, acc = fma(d, float(lane), acc), d = fl(d_w * d_a);
                          y = hsum_float_8(acc1 + acc2), then an odd last block as y + d * float(isum)
    MXFP4, out % 8 == 0   the repacked gemv / gemm (`gemm_q4_b32_8x8_q8_0_lut_avx`): one lane per weight row,
                          acc = fma(float(isum_b), d, acc); eight GGUF rows per call, as `int8ir_x8.q4_0_dot8`
    NVFP4                 `ggml_vec_dot_nvfp4_q8_0` (quants/x86/nvfp4.py): per Q8_0 block, lanes 0-3 scaled
                          by the first 16-element sub-block's d, lanes 4-7 by the second's; four activation
                          rows per call here, single rows (decode) by `int8ir_nvfp4` (activations permuted
                          once per call, the weights prefetched ahead)

The weights are read as stored in the GGUF file (no copy; expert stacks use the eight-row groups of
`int8ir_fp4_x8.py`, one stream instead of eight). Every intrinsic takes (w u8 (rows, row_bytes) C,
r, aq int8 (T, C) C, t, ad f32 (T, nb), asum int32 (T, C / 4), nb), as `int8ir.q0_dot` does.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from ..constants import GGMLType
from ._numba import jit, prange, use_threads
from .int8ir import (
    F32,
    F32T,
    I8,
    I8T,
    I32,
    I32T,
    I64,
    U8,
    V8F32,
    V8I32,
    V16I8,
    V16I16,
    V32I8,
    _broadcast,
    _fma,
    _fn,
    _hsum_float_8,
    _hsum_i32,
    _load,
    _loop,
    _madd,
    _maddubs,
    _row,
    _shuffle,
    _signature,
    _splat,
)
from .int8ir_nvfp4 import nvfp4_row_dot, permuted
from .int8ir_x8 import _reduce8, _signature8, _store8

__all__ = ["KERNELS", "mxfp4_dot", "mxfp4_dot8", "nvfp4_dot"]

# ggml-common.h `kvalues_mxfp4` + 12, twice (`vpshufb` looks up within each 128-bit half)
_KVALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
_OFFSET = 12
_TABLE = [v + _OFFSET for v in _KVALUES] * 2
MXFP4_BYTES, NVFP4_BYTES = 17, 36  # block_mxfp4: e, qs[16]; block_nvfp4: d[4], qs[32]


def _const(ty, value):
    return _splat(ty, value) if isinstance(ty, ir.VectorType) else ir.Constant(ty, value)


def _values(builder, u):
    """<32 x i8> codes 0..15 -> kvalues_mxfp4 + 12 (`vpshufb`)."""
    fn = _fn(builder, "llvm.x86.avx2.pshuf.b", V32I8, [V32I8, V32I8])
    return builder.call(fn, [ir.Constant(V32I8, _TABLE), u])


def _lanes(builder, u, ablk, sblk):
    """The 8 exact int32 lanes (elements 4j..4j+3) of a 32-element block: codes u <32 x i8> against the
    activations at ablk (32 int8) with their four-quant sums at sblk (8 int32)."""
    p = _maddubs(builder, _values(builder, u), _load(builder, ablk, 0, V32I8))
    lanes = _madd(builder, p, _splat(V16I16, 1))
    return builder.sub(lanes, builder.mul(_load(builder, sblk, 0, V8I32), _splat(V8I32, _OFFSET)))


def _e8m0_half(builder, e):
    """ggml-impl.h `ggml_e8m0_to_fp32_half` of an i8 (or <8 x i8>) exponent: 2^(e - 128) as f32 bits, e < 2
    subnormal (0x00200000 << e); exact. (The shift's result for e >= 32 is never selected.)"""
    vec = isinstance(e.type, ir.VectorType)
    ity, fty = (V8I32, V8F32) if vec else (I32, F32)
    e32 = builder.zext(e, ity)
    sub = builder.shl(_const(ity, 0x00200000), e32)
    norm = builder.shl(builder.sub(e32, _const(ity, 1)), _const(ity, 23))
    small = builder.icmp_unsigned("<", e32, _const(ity, 2))
    return builder.bitcast(builder.select(small, sub, norm), fty)


def _ue4m3_half(builder, x):
    """ggml-impl.h `ggml_ue4m3_to_fp32` of <4 x i8> bytes, halved (`lowbit.UE4M3_HALF`): exponent bits 3-6
    (bias 7), mantissa bits 0-2, bit 7 ignored; exponent 0: man * 2^-10 (exact), else (1 + man / 8) *
    2^(exp - 8) written as f32 bits; the codes 0x00 and 0x7F are 0. Returns <4 x float>."""
    i4, f4 = ir.VectorType(I32, 4), ir.VectorType(F32, 4)
    x32 = builder.zext(x, i4)
    exp = builder.and_(builder.lshr(x32, _splat(i4, 3)), _splat(i4, 15))
    man = builder.and_(x32, _splat(i4, 7))
    bits = builder.or_(builder.shl(builder.add(exp, _splat(i4, 119)), _splat(i4, 23)), builder.shl(man, _splat(i4, 20)))
    sub = builder.fmul(builder.sitofp(man, f4), _splat(f4, 2.0**-10))
    v = builder.select(builder.icmp_unsigned("==", exp, _splat(i4, 0)), sub, builder.bitcast(bits, f4))
    return builder.select(builder.icmp_unsigned("==", x32, _splat(i4, 0x7F)), _splat(f4, 0.0), v)


def _mxfp4_codes(builder, blk):
    """block_mxfp4 qs (bytes 1..16) -> <32 x i8>: low nibbles (elements 0..15), then high (16..31)."""
    qs = _load(builder, blk, 1, V16I8)
    lo, hi = builder.and_(qs, _splat(V16I8, 15)), builder.lshr(qs, _splat(V16I8, 4))
    return _shuffle(builder, lo, hi, list(range(32)))


def mxfp4_dot():
    """Intrinsic (w, r, aq, t, ad, asum, nb) -> f32: MXFP4 row r . activation row t as
    `ggml_vec_dot_mxfp4_q8_0` (AVX2) computes it (weights whose row count is not a multiple of 8)."""

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, asum, nb):
        sig = _signature((w, r, aq, t, ad, asum, nb), (U8, int, I8T, int, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t_, ad_, asum_, nb_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            srow = _row(context, builder, signature.args[5], asum_, t_)

            def block(b):
                """(lanes <8 x i32>, d f32) of block b."""
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, MXFP4_BYTES))])
                at = builder.mul(b, ir.Constant(I64, 32))  # 32 int8 quants, 8 int32 sums, per block
                lanes = _lanes(builder, _mxfp4_codes(builder, blk), builder.gep(arow, [at]), builder.gep(srow, [at]))
                da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                return lanes, builder.fmul(da, _e8m0_half(builder, _load(builder, blk, 0, I8)))

            def body(i, carried):
                accs = []
                for h, acc in enumerate(carried):  # block 2i into accum1, 2i + 1 into accum2
                    lanes, d = block(builder.add(builder.mul(i, ir.Constant(I64, 2)), ir.Constant(I64, h)))
                    accs.append(_fma(builder, _broadcast(builder, d, V8F32), builder.sitofp(lanes, V8F32), acc))
                return accs

            zero = ir.Constant(V8F32, [0.0] * 8)
            pairs = builder.ashr(nb_, ir.Constant(I64, 1))
            acc1, acc2 = _loop(builder, pairs, [zero, zero], body)
            y = _hsum_float_8(builder, builder.fadd(acc1, acc2))
            odd = builder.icmp_signed("!=", builder.and_(nb_, ir.Constant(I64, 1)), ir.Constant(I64, 0))
            before = builder.block
            with builder.if_then(odd):  # the last block in scalar code: sumf += d * (sumi1 + sumi2)
                lanes, d = block(builder.sub(nb_, ir.Constant(I64, 1)))
                y_odd = builder.fadd(y, builder.fmul(d, builder.sitofp(_hsum_i32(builder, lanes), F32)))
                then = builder.block
            out = builder.phi(F32)
            out.add_incoming(y, before)
            out.add_incoming(y_odd, then)
            return out

        return sig, codegen

    return dot


def mxfp4_dot8(n_act: int = 1):
    """Intrinsic (w, r0, aq, t, ad, asum, nb, out): out[t:t+n_act, r0:r0+8] for MXFP4 rows r0..r0+7 as the
    repacked mxfp4_8x8 gemv / gemm: per block, acc = fma(float(isum), fl(d_w * d_a), acc), one lane per row
    and activation row. n_act = 4: each block of the eight rows decoded once for four activation rows (as the
    gemm's 4-row tiles; every output's steps are the gemv's)."""

    @intrinsic
    def dot(typingctx, w, r0, aq, t, ad, asum, nb, out):
        sig = _signature8((w, r0, aq, t, ad, asum, nb, out), (U8, int, I8T, int, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            w_, r0_, aq_, t_, ad_, asum_, nb_, out_ = args
            arr = context.make_array(signature.args[0])(context, builder, w_)
            row_bytes = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
            w0 = _row(context, builder, signature.args[0], w_, r0_)
            rows = [builder.gep(w0, [builder.mul(row_bytes, ir.Constant(I64, i))]) for i in range(8)]
            ts = [builder.add(t_, ir.Constant(I64, i)) for i in range(n_act)]
            arows = [_row(context, builder, signature.args[2], aq_, t) for t in ts]
            drows = [_row(context, builder, signature.args[4], ad_, t) for t in ts]
            srows = [_row(context, builder, signature.args[5], asum_, t) for t in ts]
            ones = _splat(V16I16, 1)

            def body(b, carried):
                off = builder.mul(b, ir.Constant(I64, MXFP4_BYTES))
                blks = [builder.gep(p, [off]) for p in rows]
                codes = [_values(builder, _mxfp4_codes(builder, k)) for k in blks]
                e = ir.Constant(ir.VectorType(I8, 8), ir.Undefined)
                for i, k in enumerate(blks):
                    e = builder.insert_element(e, _load(builder, k, 0, I8), ir.Constant(I32, i))
                dw = _e8m0_half(builder, e)
                at = builder.mul(b, ir.Constant(I64, 32))
                accs = []
                for acc, arow, drow, srow in zip(carried, arows, drows, srows, strict=True):
                    a = _load(builder, arow, at, V32I8)
                    lanes = [_madd(builder, _maddubs(builder, u, a), ones) for u in codes]
                    # the +12 of the table, once per block for all eight rows: 12 * (sum of the block's quants)
                    asum = _hsum_i32(builder, _load(builder, srow, at, V8I32))
                    zp = _broadcast(builder, builder.mul(asum, ir.Constant(I32, _OFFSET)), V8I32)
                    isum = builder.sub(_reduce8(builder, lanes), zp)
                    da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                    d = builder.fmul(dw, _broadcast(builder, da, V8F32))  # `_mm256_mul_ps(col_scale, row_scale)`
                    accs.append(_fma(builder, builder.sitofp(isum, V8F32), d, acc))
                return accs

            accs = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)] * n_act, body)
            for t, acc in zip(ts, accs, strict=True):
                _store8(context, builder, signature, out_, t, r0_, acc)
            return context.get_dummy_value()

        return sig, codegen

    return dot


def nvfp4_dot(n_act: int = 1):
    """Intrinsic (w, r, aq, t, ad, asum, nb) -> f32 (nb: Q8_0 blocks, two per NVFP4 block): NVFP4 row r .
    activation row t as `ggml_vec_dot_nvfp4_q8_0` (AVX2): acc = fma(s, float(lane), acc) per Q8_0 block, s of
    lanes 0-3 = fl(UE4M3(d[2h]) * d_a), of lanes 4-7 = fl(UE4M3(d[2h + 1]) * d_a); y = hsum_float_8(acc).
    n_act > 1: (w, r, aq, t, ad, asum, nb, out) -> out[t:t+n_act, r], each block decoded once for the rows."""

    dtypes = (U8, int, I8T, int, F32T, I32T, int)

    def codegen(context, builder, signature, args):
        w_, r_, aq_, t_, ad_, asum_, nb_ = args[:7]
        wrow = _row(context, builder, signature.args[0], w_, r_)
        ts = [builder.add(t_, ir.Constant(I64, i)) for i in range(n_act)]
        arows = [_row(context, builder, signature.args[2], aq_, t) for t in ts]
        drows = [_row(context, builder, signature.args[4], ad_, t) for t in ts]
        srows = [_row(context, builder, signature.args[5], asum_, t) for t in ts]
        # qs[8s + j]: low nibble -> element 16s + j, high -> 16s + 8 + j; per 16 bytes (two sub-blocks):
        order = [*range(8), *range(16, 24), *range(8, 16), *range(24, 32)]

        def body(b, carried):
            blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, NVFP4_BYTES))])
            scales = _ue4m3_half(builder, _load(builder, blk, 0, ir.VectorType(I8, 4)))
            codes = []
            for h in range(2):
                qs = _load(builder, blk, 4 + 16 * h, V16I8)
                lo, hi = builder.and_(qs, _splat(V16I8, 15)), builder.lshr(qs, _splat(V16I8, 4))
                codes.append(_shuffle(builder, lo, hi, order))
            accs = []
            for acc, arow, drow, srow in zip(carried, arows, drows, srows, strict=True):
                da2 = _load(builder, drow, builder.mul(b, ir.Constant(I64, 8)), ir.VectorType(F32, 2))
                # fl(UE4M3(d[s]) * d_a of the Q8_0 block s // 2), s = 0..3
                s4 = builder.fmul(scales, _shuffle(builder, da2, da2, [0, 0, 1, 1]))
                for h in range(2):  # the Q8_0 blocks 2b and 2b + 1
                    q = builder.add(builder.mul(b, ir.Constant(I64, 2)), ir.Constant(I64, h))
                    at = builder.mul(q, ir.Constant(I64, 32))
                    lanes = _lanes(builder, codes[h], builder.gep(arow, [at]), builder.gep(srow, [at]))
                    s = _shuffle(builder, s4, s4, [2 * h] * 4 + [2 * h + 1] * 4)  # lanes 0-3, 4-7
                    acc = _fma(builder, s, builder.sitofp(lanes, V8F32), acc)
                accs.append(acc)
            return accs

        pairs = builder.ashr(nb_, ir.Constant(I64, 1))
        accs = _loop(builder, pairs, [ir.Constant(V8F32, [0.0] * 8)] * n_act, body)
        ys = [_hsum_float_8(builder, acc) for acc in accs]
        if n_act == 1:
            return ys[0]
        for t, y in zip(ts, ys, strict=True):
            orow = _row(context, builder, signature.args[-1], args[-1], t)
            builder.store(
                y, builder.bitcast(builder.gep(orow, [builder.mul(r_, ir.Constant(I64, 4))]), F32.as_pointer())
            )
        return context.get_dummy_value()

    if n_act == 1:

        @intrinsic
        def dot(typingctx, w, r, aq, t, ad, asum, nb):
            return _signature((w, r, aq, t, ad, asum, nb), dtypes), codegen

    else:

        @intrinsic
        def dot(typingctx, w, r, aq, t, ad, asum, nb, out):
            return _signature8((w, r, aq, t, ad, asum, nb, out), dtypes), codegen

    return dot


# -- the kernels: weight rows (or eight-row groups) in parallel, each against every activation row ---------------
_MXFP4 = mxfp4_dot()
_MXFP4_8 = mxfp4_dot8()
_MXFP4_8X4 = mxfp4_dot8(4)
_NVFP4_ROW = nvfp4_row_dot()  # one activation row, permuted once per call (`int8ir_nvfp4`)
_NVFP4_X4 = nvfp4_dot(4)


@jit(parallel=True)
def _mv_mxfp4_8(nt, w, aq, ad, asum, out):
    previous = use_threads(nt)
    nb = aq.shape[1] // 32
    T = aq.shape[0]
    for r8 in prange(w.shape[0] // 8):
        for t in range(0, T - T % 4, 4):
            _MXFP4_8X4(w, 8 * r8, aq, t, ad, asum, nb, out)
        for t in range(T - T % 4, T):
            _MXFP4_8(w, 8 * r8, aq, t, ad, asum, nb, out)
    use_threads(previous)


@jit(parallel=True)
def _mv_mxfp4(nt, w, aq, ad, asum, out):
    previous = use_threads(nt)
    nb = aq.shape[1] // 32
    for r in prange(w.shape[0]):
        for t in range(aq.shape[0]):
            out[t, r] = _MXFP4(w, r, aq, t, ad, asum, nb)
    use_threads(previous)


@jit(parallel=True)
def _mv_nvfp4(nt, w, aq, ad, asum, out):
    previous = use_threads(nt)
    nb = aq.shape[1] // 32
    T = aq.shape[0]
    t0 = T - T % 4
    ap, c12, dap = permuted(aq, ad, asum, t0)  # the rows after the groups of four (decode: the one row)
    for r in prange(w.shape[0]):
        for t in range(0, t0, 4):
            _NVFP4_X4(w, r, aq, t, ad, asum, nb, out)
        for t in range(t0, T):
            out[t, r] = _NVFP4_ROW(w, r, ap, t - t0, dap, c12, nb)
    use_threads(previous)


def mxfp4_kernel(nt, w, aq, ad, s, asum, out):
    """`int8dot`'s Q8_0 kernel contract for MXFP4 rows u8 (rows, nb * 17): the repacked gemv / gemm when
    rows % 8 == 0 (as llama.cpp repacks them), else the vec_dot."""
    (_mv_mxfp4_8 if w.shape[0] % 8 == 0 else _mv_mxfp4)(nt, w, aq, ad, asum, out)


def nvfp4_kernel(nt, w, aq, ad, s, asum, out):
    """`int8dot`'s Q8_0 kernel contract for NVFP4 rows u8 (rows, nb / 2 * 36): the vec_dot for every shape, four
    activation rows at a time (`nvfp4_dot(4)`), the rest one at a time (`int8ir_nvfp4.nvfp4_row_dot`)."""
    _mv_nvfp4(nt, w, aq, ad, asum, out)


KERNELS = {
    GGMLType.MXFP4: ("Q8_0", MXFP4_BYTES, 32, mxfp4_kernel),
    GGMLType.NVFP4: ("Q8_0", NVFP4_BYTES, 64, nvfp4_kernel),
}
"""GGML type -> (activation format, block bytes, elements per block, kernel): `int8lowbit.KERNELS` entries."""
