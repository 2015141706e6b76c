"""Integer kernels for Q5_K and Q3_K in the llamacpp numerics: ggml's AVX2 block dots as LLVM IR (`int8ir.py`'s
helpers), and their drivers, one registry.

    KERNELS[type] = (activation format, block bytes, elements per block, kernel)   # registered by int8dot
    kernel(nt, w, aq, ad, bsums, out)      out[t, r] = weight row r . activation row t (Q8_K), every T

llama.cpp repacks neither type on x86, so its mul_mat runs (`ggufpy.quants.x86.kernel_for`):

    T < 8    vec_dot, 8 f32 lanes      arch/x86/quants.c `ggml_vec_dot_q{5,3}_K_q8_K`   quants.x86.kquants
    T >= 8   tiled, one f32 per output  tiled/tiled-kernel.cpp                          quants.x86.tiled

The integer sums are exact in any order (`vpmaddubsw` never saturates: |code| <= 31 against |a| <= 127, Q3_K's
two products |q_low| <= 3 and 4 * !hbit <= 4), so each kernel gives the replay's integers and then its f32
steps in its order: bit for bit the replay. As for Q6_K (`int8dot._mv_q6_k`), the tiled kernel unpacks each
weight block once for all T activation rows, which come block-major (`int8ir_x8_gemm.block_major`).

    block_q5_K (176 bytes)                          block_q3_K (110 bytes)
      0  d fp16     2  dmin fp16                      0  hmask[32]: bit 4h + j of byte l = high bit of 128h + 32j + l
      4  scales[12] (6-bit scales and mins, as Q4_K) 32  qs[64]: bits 2j of byte 32h + l = low 2 bits of the same
     16  qh[32]: bit 2c + s of byte l = bit 4 of      96  scales[12]: 16 6-bit scales (minus 32), one per 16
         element 64c + 32s + l                      108  d fp16
     48  qs[128]: nibble s of byte 32c + l = bits 0-3 of element 64c + 32s + l
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from ..constants import GGMLType
from ..quants.x86.tiled import TILED_MIN_BATCH
from ._numba import jit, prange, use_threads
from .int8ir import (
    F32,
    F32T,
    I8T,
    I16T,
    I32,
    I64,
    U8,
    V8F32,
    V16I8,
    V16I16,
    V32I8,
    _broadcast,
    _fma,
    _half,
    _hsum_float_8,
    _hsum_i32,
    _load,
    _loop,
    _madd,
    _maddubs,
    _nibbles32,
    _row,
    _shuffle,
    _signature,
    _splat,
)
from .int8ir_x8 import _k4_scales_mins_vec, _signature8
from .int8ir_x8_gemm import block_major

__all__ = ["KERNELS", "q3_k_dot", "q3_k_gemm", "q5_k_dot", "q5_k_gemm"]

Q8_K = "Q8_K"  # the activation format, as int8dot names it


# -- unpacking one block to the operands of `vpmaddubsw` / `vpmaddwd` ------------------------------------------------
def _q5_k_block(builder, blk):
    """A Q5_K block -> (codes: 8 <32 x i8> (element 32j + l, 0..31), scales: 8 <16 x i16> broadcasts of sub-block
    j's scale, mins <8 x i32> (lane j: sub-block j's min))."""
    scales, mins = _k4_scales_mins_vec(builder, blk)  # the same 12 bytes at offset 4 as Q4_K
    qh = _load(builder, blk, 16, V32I8)
    one, four = _splat(V32I8, 1), _splat(V32I8, 4)
    codes, bcast = [], []
    for c in range(4):
        low = _nibbles32(builder, _load(builder, blk, 48 + 32 * c, V32I8))
        for s in range(2):
            j = 2 * c + s
            top = builder.shl(builder.and_(builder.lshr(qh, _splat(V32I8, j)), one), four)  # bit 4
            codes.append(builder.or_(low[s], top))
            bcast.append(_shuffle(builder, scales, scales, [j] * 16))
    return codes, bcast, mins


def _q5_k_isum(builder, codes, bcast, ablk):
    """<8 x i32> lanes of sum_j sc_j * codes_j . a_j (lane k: bytes 4k..4k+3 of every 32-element chunk)."""
    isum = None
    for j, (u, sc) in enumerate(zip(codes, bcast, strict=True)):
        v = _madd(builder, _maddubs(builder, u, _load(builder, ablk, 32 * j, V32I8)), sc)
        isum = v if isum is None else builder.add(isum, v)
    return isum


def _min_sum(builder, bsblk, mins):
    """sum_j m_j * (bsum_2j + bsum_2j+1): i32, exact (ggml's `_mm_hadd_epi16` of the bsums, madd with mins)."""
    pairs = _madd(builder, _load(builder, bsblk, 0, V16I16), _splat(V16I16, 1))
    return _hsum_i32(builder, builder.mul(pairs, mins))


def q5_k_dot():
    """Intrinsic (w, r, aq, t, ad, bsums, nb) -> f32: Q5_K row r . Q8_K row t as `ggml_vec_dot_q5_K_q8_K`
    (AVX2; kquants.py): per super-block acc = fma(fl(da * dw), float(lanes), acc) and summs = fma(-fl(da *
    dmin), float(sum_j m_j * bsum pair j), summs) (GCC's contracted `summs += dmin * m`); y = hsum_float_8(acc)
    + summs."""

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, bsums, nb):
        sig = _signature((w, r, aq, t, ad, bsums, nb), (U8, int, I8T, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t_, ad_, bs_, nb_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            bsrow = _row(context, builder, signature.args[5], bs_, t_)

            def body(b, carried):
                acc, summs = carried
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, 176))])
                ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
                bsblk = builder.gep(bsrow, [builder.mul(b, ir.Constant(I64, 32))])
                codes, bcast, mins = _q5_k_block(builder, blk)
                isum = _q5_k_isum(builder, codes, bcast, ablk)
                da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                d = _broadcast(builder, builder.fmul(da, _half(builder, blk, 0)), V8F32)
                acc = _fma(builder, d, builder.sitofp(isum, V8F32), acc)
                dmin = builder.fneg(builder.fmul(da, _half(builder, blk, 2)))  # -y.d * dmin: exact negation
                msum = builder.sitofp(_min_sum(builder, bsblk, mins), F32)
                return [acc, _fma(builder, dmin, msum, summs)]

            init = [ir.Constant(V8F32, [0.0] * 8), ir.Constant(F32, 0.0)]
            acc, summs = _loop(builder, nb_, init, body)
            return builder.fadd(_hsum_float_8(builder, acc), summs)

        return sig, codegen

    return dot


def q5_k_gemm():
    """Intrinsic (w, r, aq, n, ad, bsums, nb, out): out[0:n, r] for the Q5_K row r as ggml's tiled kernel
    (tiled.py): per super-block s1 = sum of the lanes, s2 = sum_j m_j * bsum pair j, p = fl(float(s1) * dw),
    p = fma(-dmin, float(s2), p), y = fma(p, da, y); each block unpacked once for all n rows. Block-major
    activations (`block_major`): aq int8 (nb * n, 256), ad f32 (nb, n), bsums int16 (nb * n, 16)."""

    @intrinsic
    def gemm(typingctx, w, r, aq, n, ad, bsums, nb, out):
        sig = _signature8((w, r, aq, n, ad, bsums, nb, out), (U8, int, I8T, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, n_, ad_, bs_, nb_, out_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            out_ptr = _tiled_outputs(context, builder, signature.args[7], out_, r_, n_)

            def block(b, _):
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, 176))])
                codes, bcast, mins = _q5_k_block(builder, blk)
                dw, dmin = _half(builder, blk, 0), builder.fneg(_half(builder, blk, 2))
                drows = _row(context, builder, signature.args[4], ad_, b)

                def row(t, _):
                    bt = builder.add(builder.mul(b, n_), t)  # block-major activations: row b * n + t
                    arow = _row(context, builder, signature.args[2], aq_, bt)
                    bsrow = _row(context, builder, signature.args[5], bs_, bt)
                    s1 = _hsum_i32(builder, _q5_k_isum(builder, codes, bcast, arow))
                    s2 = _min_sum(builder, bsrow, mins)
                    p = builder.fmul(builder.sitofp(s1, F32), dw)
                    p = _fma(builder, dmin, builder.sitofp(s2, F32), p)
                    _tiled_fma(builder, drows, out_ptr(t), p, t)
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)
            return context.get_dummy_value()

        return sig, codegen

    return gemm


def _tiled_outputs(context, builder, outty, out_, r_, n_):
    """t -> f32* to out[t, r], after zeroing out[0:n, r] (the tiled kernel's y starts at 0)."""

    def out_ptr(t):
        orow = _row(context, builder, outty, out_, t)
        return builder.bitcast(builder.gep(orow, [builder.mul(r_, ir.Constant(I64, 4))]), F32.as_pointer())

    def clear(t, _):
        builder.store(ir.Constant(F32, 0.0), out_ptr(t), align=4)
        return []

    _loop(builder, n_, [], clear)
    return out_ptr


def _tiled_fma(builder, drows, ptr, p, t):
    """*ptr = fma(p, da_t, *ptr): the tiled kernel's `buf += result * d1` (one rounding)."""
    da = _load(builder, drows, builder.mul(t, ir.Constant(I64, 4)), F32)
    builder.store(_fma(builder, p, da, builder.load(ptr, align=4)), ptr, align=4)


# -- Q3_K -------------------------------------------------------------------------------------------------------------
_KMASK1, _KMASK2 = 0x03030303, 0x0F0F0F0F


def _q3_k_scales(builder, blk):
    """ggml's AVX2 `scales128`: the 16 scales s - 32 of a Q3_K block as <16 x i16> (sub-block i in lane i)."""
    aux = [_load(builder, blk, 96 + 4 * i, I32) for i in range(3)]
    k1, k2 = ir.Constant(I32, _KMASK1), ir.Constant(I32, _KMASK2)

    def c(v):
        return ir.Constant(I32, v)

    def high(shift):  # the 2 high bits of four scales, from aux[2]
        return builder.shl(builder.and_(builder.lshr(aux[2], c(shift)), k1), c(4))

    words = (
        builder.or_(builder.and_(aux[0], k2), high(0)),
        builder.or_(builder.and_(aux[1], k2), high(2)),
        builder.or_(builder.and_(builder.lshr(aux[0], c(4)), k2), high(4)),
        builder.or_(builder.and_(builder.lshr(aux[1], c(4)), k2), high(6)),
    )
    v = ir.Constant(ir.VectorType(I32, 4), ir.Undefined)
    for i, x in enumerate(words):
        v = builder.insert_element(v, x, ir.Constant(I32, i))
    return builder.sext(builder.sub(builder.bitcast(v, V16I8), _splat(V16I8, 32)), V16I16)


def _q3_k_block(builder, blk):
    """A Q3_K block -> (low: 8 <32 x i8> low 2 bits of elements 32j + l, fours: 8 <32 x i8> 4 * !hbit,
    scales: 8 <16 x i16> (sub-block 2j in lanes 0-7, 2j + 1 in 8-15))."""
    sc16 = _q3_k_scales(builder, blk)
    hmask = _load(builder, blk, 0, V32I8)
    three, zero, four = _splat(V32I8, 3), _splat(V32I8, 0), _splat(V32I8, 4)
    low, fours, scales = [], [], []
    for h in range(2):
        qs = _load(builder, blk, 32 + 32 * h, V32I8)
        for j in range(4):
            chunk = 4 * h + j
            low.append(builder.and_(builder.lshr(qs, _splat(V32I8, 2 * j)), three))
            bit = builder.and_(hmask, _splat(V32I8, 1 << chunk))
            fours.append(builder.select(builder.icmp_unsigned("==", bit, zero), four, zero))
            scales.append(_shuffle(builder, sc16, sc16, [2 * chunk] * 8 + [2 * chunk + 1] * 8))
    return low, fours, scales


def _q3_k_isum(builder, low, fours, scales, ablk):
    """<8 x i32> lanes of sum over chunks of madd(maddubs(low, a) - maddubs(4 * !hbit, a), scales)."""
    isum = None
    for chunk in range(8):
        a = _load(builder, ablk, 32 * chunk, V32I8)
        p = builder.sub(_maddubs(builder, low[chunk], a), _maddubs(builder, fours[chunk], a))
        v = _madd(builder, p, scales[chunk])
        isum = v if isum is None else builder.add(isum, v)
    return isum


def q3_k_dot():
    """Intrinsic (w, r, aq, t, ad, bsums, nb) -> f32: Q3_K row r . Q8_K row t as `ggml_vec_dot_q3_K_q8_K`
    (AVX2; kquants.py): per super-block acc = fma(fl(da * dw), float(lanes), acc); y = hsum_float_8(acc)."""

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, bsums, nb):
        sig = _signature((w, r, aq, t, ad, bsums, nb), (U8, int, I8T, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t_, ad_, _, nb_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)

            def body(b, carried):
                (acc,) = carried
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, 110))])
                ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
                isum = _q3_k_isum(builder, *_q3_k_block(builder, blk), ablk)
                da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                d = _broadcast(builder, builder.fmul(da, _half(builder, blk, 108)), V8F32)
                return [_fma(builder, d, builder.sitofp(isum, V8F32), acc)]

            (acc,) = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)], body)
            return _hsum_float_8(builder, acc)

        return sig, codegen

    return dot


def q3_k_gemm():
    """Intrinsic (w, r, aq, n, ad, bsums, nb, out): out[0:n, r] for the Q3_K row r as ggml's tiled kernel
    (tiled.py, BIAS 4: the same integers): s1 = sum of the lanes, p = fl(float(s1) * dw), y = fma(p, da, y);
    each block unpacked once for all n rows (block-major activations, as `q5_k_gemm`)."""

    @intrinsic
    def gemm(typingctx, w, r, aq, n, ad, bsums, nb, out):
        sig = _signature8((w, r, aq, n, ad, bsums, nb, out), (U8, int, I8T, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, n_, ad_, _, nb_, out_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            out_ptr = _tiled_outputs(context, builder, signature.args[7], out_, r_, n_)

            def block(b, _):
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, 110))])
                unpacked = _q3_k_block(builder, blk)
                dw = _half(builder, blk, 108)
                drows = _row(context, builder, signature.args[4], ad_, b)

                def row(t, _):
                    arow = _row(context, builder, signature.args[2], aq_, builder.add(builder.mul(b, n_), t))
                    s1 = _hsum_i32(builder, _q3_k_isum(builder, *unpacked, arow))
                    _tiled_fma(builder, drows, out_ptr(t), builder.fmul(builder.sitofp(s1, F32), dw), t)
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)
            return context.get_dummy_value()

        return sig, codegen

    return gemm


# -- the drivers: weight rows in parallel, each against every activation row (as int8dot._mv_q6_k) -----------------
_Q5_K_LANES, _Q5_K_TILED = q5_k_dot(), q5_k_gemm()
_Q3_K_LANES, _Q3_K_TILED = q3_k_dot(), q3_k_gemm()
_block_major = jit(block_major)


@jit(parallel=True)
def _mv_q5_k(nt, w, aq, ad, bsums, out):
    """T < 8: vec_dot (8 f32 lanes); T >= 8: the tiled kernel, each block of a row unpacked once for all T."""
    previous = use_threads(nt)
    T, nb = aq.shape[0], aq.shape[1] // 256
    if T >= TILED_MIN_BATCH:
        aqb, adb, bsb = _block_major(aq, T, 256), np.ascontiguousarray(ad.T), _block_major(bsums, T, 16)
        for r in prange(w.shape[0]):
            _Q5_K_TILED(w, r, aqb, T, adb, bsb, nb, out)
    else:
        for r in prange(w.shape[0]):
            for t in range(T):
                out[t, r] = _Q5_K_LANES(w, r, aq, t, ad, bsums, nb)
    use_threads(previous)


@jit(parallel=True)
def _mv_q3_k(nt, w, aq, ad, bsums, out):
    """As `_mv_q5_k`, for Q3_K."""
    previous = use_threads(nt)
    T, nb = aq.shape[0], aq.shape[1] // 256
    if T >= TILED_MIN_BATCH:
        aqb, adb, bsb = _block_major(aq, T, 256), np.ascontiguousarray(ad.T), _block_major(bsums, T, 16)
        for r in prange(w.shape[0]):
            _Q3_K_TILED(w, r, aqb, T, adb, bsb, nb, out)
    else:
        for r in prange(w.shape[0]):
            for t in range(T):
                out[t, r] = _Q3_K_LANES(w, r, aq, t, ad, bsums, nb)
    use_threads(previous)


KERNELS = {
    GGMLType.Q5_K: (Q8_K, 176, 256, _mv_q5_k),
    GGMLType.Q3_K: (Q8_K, 110, 256, _mv_q3_k),
}
"""GGML type -> (activation format, block bytes, elements per block, kernel): `int8dot.INT8_TYPES` entries."""
