"""The k-quants' rows forms: one weight row (or eight-row group) against up to eight activation rows, each row's
f32 steps those of the kernel llama.cpp runs for one token (`int8ir_rows.py` has the idea and the 32-element
types; `int8rows.py` uses them).

    Q4_K  eight-row groups   the repacked q4_K_8x8 gemv (`int8ir_x8.q4_k_dot8(grouped=True)`)     `q4_kx8_rows`
    Q6_K  GGUF rows          ggml_vec_dot_q6_K_q8_K (`int8ir.q6_k_dot(lanes=True)`)              `q6_k_rows`
    Q5_K  GGUF rows          ggml_vec_dot_q5_K_q8_K (`int8ir_k5.q5_k_dot`)                        `k5_rows("q5_k")`
    Q3_K  GGUF rows          ggml_vec_dot_q3_K_q8_K (`int8ir_k5.q3_k_dot`)                        `k5_rows("q3_k")`

llama.cpp switches to other f32 steps from 4 rows (Q4_K's gemm) or 8 (the tiled kernels), so a batched pass
that must equal each token decoded alone cannot take those. Here each super-block is decoded once (codes,
scales, mins) and dotted with each of n rows in a loop; each row's accumulators wait in a stack array between
blocks (a store and a load: no rounding), so out[t, r] is bit for bit the one-row kernel's
(tests/test_int8_rows.py).
"""

from __future__ import annotations

from llvmlite import ir
from numba.extending import intrinsic

from .int8ir import (
    F32,
    F32T,
    I8T,
    I16T,
    I32,
    I64,
    U8,
    V8F32,
    V8I32,
    V16I8,
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
    _nibbles32,
    _row,
    _shuffle,
    _splat,
)
from .int8ir_k5 import _min_sum, _q3_k_block, _q3_k_isum, _q5_k_block, _q5_k_isum
from .int8ir_rows import MAX_ROWS, _slot, _stack
from .int8ir_x8 import _halves8, _k4_scales_mins_vec, _reduce8, _signature8, _store8

__all__ = ["k5_rows", "q4_kx8_rows", "q6_k_rows"]


# -- Q4_K in eight-row groups (`int8dot.interleaved`): the repacked gemv's steps per row ------------------------------
Q4_KX8_BYTES = 8 * 144  # a super-block of the eight rows of a group, side by side


def q4_kx8_rows():
    """Intrinsic (w, g, aq, t0, n, ad, bsums, nb, out): out[t0 + i, 8g:8g+8] for i < n (1 <= n <= MAX_ROWS),
    each row the value of `int8ir_x8.q4_k_dot8(grouped=True)` (the repacked q4_K_8x8 gemv llama.cpp runs for one
    token: per super-block I and M of each weight row, acc = fma(float(I), dw * da, acc), accm likewise;
    acc - accm), while its gemm (4+ rows) has other steps.

    Each super-block of the group is decoded once (nibbles, the 6-bit scales as i16 pairs, the mins) into a
    stack scratch of 64 code vectors, 64 scale vectors and 8 min vectors, then dotted with each of the n rows;
    each row's two accumulators wait in a stack array between blocks (a store and a load of an f32 vector: no
    rounding)."""

    @intrinsic
    def dot(typingctx, w, g, aq, t0, n, ad, bsums, nb, out):
        sig = _signature8((w, g, aq, t0, n, ad, bsums, nb, out), (U8, int, I8T, int, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, g_, aq_, t0_, n_, ad_, bs_, nb_, out_ = args
            group = _row(context, builder, signature.args[0], w_, g_)
            codes = _stack(builder, V32I8, 64)  # [8 * row + sub-block]
            scales = _stack(builder, V16I16, 64)  # its scale in all 16 lanes
            mins = _stack(builder, V8I32, 8)  # [row]: the 8 sub-blocks' mins
            zero = ir.Constant(V8F32, [0.0] * 8)
            accs = _stack(builder, V8F32, 2 * MAX_ROWS, zero)  # [2t]: acc, [2t + 1]: accm

            def block(b, carried):
                blks = [
                    builder.gep(
                        group, [builder.add(builder.mul(b, ir.Constant(I64, Q4_KX8_BYTES)), ir.Constant(I64, 144 * i))]
                    )
                    for i in range(8)
                ]
                for i, blk in enumerate(blks):  # decoded once for the n rows
                    sc, mn = _k4_scales_mins_vec(builder, blk)
                    builder.store(mn, _slot(builder, mins, i))
                    for c in range(4):
                        lo, hi = _nibbles32(builder, _load(builder, blk, 16 + 32 * c, V32I8))
                        builder.store(lo, _slot(builder, codes, 8 * i + 2 * c))
                        builder.store(hi, _slot(builder, codes, 8 * i + 2 * c + 1))
                    for j in range(8):
                        builder.store(_shuffle(builder, sc, sc, [j] * 16), _slot(builder, scales, 8 * i + j))
                dw, dmin = _halves8(builder, blks, 0), _halves8(builder, blks, 2)

                def row(t, _):
                    r = builder.add(t0_, t)
                    ablk = builder.gep(
                        _row(context, builder, signature.args[2], aq_, r), [builder.mul(b, ir.Constant(I64, 256))]
                    )
                    bsrow = _row(context, builder, signature.args[6], bs_, r)
                    bs = _load(builder, bsrow, builder.mul(b, ir.Constant(I64, 32)), V16I16)
                    pairs = _madd(builder, bs, _splat(V16I16, 1))  # bsum_2j + bsum_2j+1: one per sub-block j
                    a = [_load(builder, ablk, 32 * j, V32I8) for j in range(8)]
                    isums, msums = [], []
                    for i in range(8):
                        isum = ir.Constant(V8I32, [0] * 8)
                        for j in range(8):
                            p = _maddubs(builder, builder.load(_slot(builder, codes, 8 * i + j)), a[j])
                            isum = builder.add(isum, _madd(builder, p, builder.load(_slot(builder, scales, 8 * i + j))))
                        isums.append(isum)
                        msums.append(builder.mul(builder.load(_slot(builder, mins, i)), pairs))
                    da_row = _row(context, builder, signature.args[5], ad_, r)
                    da = _broadcast(builder, _load(builder, da_row, builder.mul(b, ir.Constant(I64, 4)), F32), V8F32)
                    at = builder.trunc(builder.mul(t, ir.Constant(I64, 2)), I32)
                    acc_p, accm_p = _slot(builder, accs, at), _slot(builder, accs, builder.add(at, ir.Constant(I32, 1)))
                    dd, dm = builder.fmul(dw, da), builder.fmul(dmin, da)
                    builder.store(
                        _fma(builder, builder.sitofp(_reduce8(builder, isums), V8F32), dd, builder.load(acc_p)), acc_p
                    )
                    builder.store(
                        _fma(builder, builder.sitofp(_reduce8(builder, msums), V8F32), dm, builder.load(accm_p)), accm_p
                    )
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)
            r0 = builder.mul(g_, ir.Constant(I64, 8))

            def store(t, _):
                at = builder.trunc(builder.mul(t, ir.Constant(I64, 2)), I32)
                acc = builder.load(_slot(builder, accs, at))
                accm = builder.load(_slot(builder, accs, builder.add(at, ir.Constant(I32, 1))))
                _store8(context, builder, signature, out_, builder.add(t0_, t), r0, builder.fsub(acc, accm))
                return []

            _loop(builder, n_, [], store)
            return context.get_dummy_value()

        return sig, codegen

    return dot


# -- Q6_K in GGUF rows: ggml_vec_dot_q6_K_q8_K's steps per row --------------------------------------------------------
def q6_k_rows():
    """Intrinsic (w, r, aq, t0, n, ad, bsums, nb, out): out[t0 + i, r] for i < n (1 <= n <= MAX_ROWS), each the
    value of `int8ir.q6_k_dot(lanes=True)` (the AVX2 vec_dot llama.cpp runs below 8 rows, so for one token:
    acc = fma(fl(da * dw), float(lanes), acc), y = hsum_float_8(acc)), while its tiled kernel (8+ rows) has
    other steps. Each super-block's 6-bit codes and scale pairs are decoded once into a stack scratch; each
    row's accumulator waits in a stack array between blocks."""
    three, four = _splat(V32I8, 3), _splat(V32I8, 4)

    @intrinsic
    def dot(typingctx, w, r, aq, t0, n, ad, bsums, nb, out):
        sig = _signature8((w, r, aq, t0, n, ad, bsums, nb, out), (U8, int, I8T, int, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t0_, n_, ad_, bs_, nb_, out_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            codes = _stack(builder, V32I8, 8)  # [chunk]: elements 32 chunk..
            scales = _stack(builder, V16I16, 8)  # [chunk]: its two scales, 8 lanes each
            accs = _stack(builder, V8F32, MAX_ROWS, ir.Constant(V8F32, [0.0] * 8))

            def block(b, carried):
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, 210))])
                sc16 = builder.sext(_load(builder, blk, 192, V16I8), V16I16)
                for h in range(2):  # block_q6_K: ql[128], qh[64], scales[16], d; decoded once for the n rows
                    ql0, ql1 = (_load(builder, blk, 64 * h + 32 * i, V32I8) for i in range(2))
                    qh = _load(builder, blk, 128 + 32 * h, V32I8)
                    lo0, hi0 = _nibbles32(builder, ql0)
                    lo1, hi1 = _nibbles32(builder, ql1)
                    low = (lo0, lo1, hi0, hi1)  # elements 128h + 32i + l, i = 0..3
                    for i in range(4):
                        top = builder.and_(builder.lshr(qh, _splat(V32I8, 2 * i)), three)
                        chunk = 4 * h + i
                        builder.store(builder.or_(low[i], builder.shl(top, four)), _slot(builder, codes, chunk))
                        pair = _shuffle(builder, sc16, sc16, [2 * chunk] * 8 + [2 * chunk + 1] * 8)
                        builder.store(pair, _slot(builder, scales, chunk))
                dw = _half(builder, blk, 208)

                def row(t, _):
                    r = builder.add(t0_, t)
                    ablk = builder.gep(
                        _row(context, builder, signature.args[2], aq_, r), [builder.mul(b, ir.Constant(I64, 256))]
                    )
                    isum = ir.Constant(V8I32, [0] * 8)
                    for chunk in range(8):
                        a = _load(builder, ablk, 32 * chunk, V32I8)
                        p = _maddubs(builder, builder.load(_slot(builder, codes, chunk)), a)
                        isum = builder.add(isum, _madd(builder, p, builder.load(_slot(builder, scales, chunk))))
                    bsrow = _row(context, builder, signature.args[6], bs_, r)
                    bs = _load(builder, bsrow, builder.mul(b, ir.Constant(I64, 32)), V16I16)
                    isum = builder.sub(isum, builder.shl(_madd(builder, bs, sc16), _splat(V8I32, 5)))
                    drow = _row(context, builder, signature.args[5], ad_, r)
                    da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                    d = _broadcast(builder, builder.fmul(da, dw), V8F32)
                    acc_p = _slot(builder, accs, builder.trunc(t, I32))
                    builder.store(_fma(builder, d, builder.sitofp(isum, V8F32), builder.load(acc_p)), acc_p)
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)
            col = builder.mul(r_, ir.Constant(I64, 4))

            def store(t, _):
                y = _hsum_float_8(builder, builder.load(_slot(builder, accs, builder.trunc(t, I32))))
                orow = _row(context, builder, signature.args[-1], out_, builder.add(t0_, t))
                builder.store(y, builder.bitcast(builder.gep(orow, [col]), F32.as_pointer()), align=4)
                return []

            _loop(builder, n_, [], store)
            return context.get_dummy_value()

        return sig, codegen

    return dot


# -- Q5_K and Q3_K in GGUF rows: their AVX2 vec_dot's steps per row ---------------------------------------------------
# kind -> (block bytes, offset of d, offset of dmin or None)
K5_KINDS = {"q5_k": (176, 0, 2), "q3_k": (110, 108, None)}


def k5_rows(kind: str):
    """Intrinsic (w, r, aq, t0, n, ad, bsums, nb, out): out[t0 + i, r] for i < n (1 <= n <= MAX_ROWS), each the
    value of `int8ir_k5.q5_k_dot` / `q3_k_dot` for that row: per super-block acc = fma(fl(da * dw),
    float(lanes), acc) (and Q5_K's summs = fma(-fl(da * dmin), float(sum_j m_j * bsum pair j), summs));
    y = hsum_float_8(acc) (+ summs). The decoded super-block stays in SSA values across the rows' loop."""
    size, d_at, dmin_at = K5_KINDS[kind]

    @intrinsic
    def dot(typingctx, w, r, aq, t0, n, ad, bsums, nb, out):
        sig = _signature8((w, r, aq, t0, n, ad, bsums, nb, out), (U8, int, I8T, int, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t0_, n_, ad_, bs_, nb_, out_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            accs = _stack(builder, V8F32, MAX_ROWS, ir.Constant(V8F32, [0.0] * 8))
            summs = _stack(builder, F32, MAX_ROWS, ir.Constant(F32, 0.0))

            def block(b, carried):
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, size))])
                decoded = _q5_k_block(builder, blk) if kind == "q5_k" else _q3_k_block(builder, blk)  # once
                dw = _half(builder, blk, d_at)

                def row(t, _):
                    r = builder.add(t0_, t)
                    arow = _row(context, builder, signature.args[2], aq_, r)
                    ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
                    if kind == "q5_k":
                        codes, bcast, mins = decoded
                        isum = _q5_k_isum(builder, codes, bcast, ablk)
                    else:
                        isum = _q3_k_isum(builder, *decoded, ablk)
                    drow = _row(context, builder, signature.args[5], ad_, r)
                    da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                    d = _broadcast(builder, builder.fmul(da, dw), V8F32)
                    at = builder.trunc(t, I32)
                    acc_p = _slot(builder, accs, at)
                    builder.store(_fma(builder, d, builder.sitofp(isum, V8F32), builder.load(acc_p)), acc_p)
                    if dmin_at is not None:  # -y.d * dmin: exact negation; GCC's contracted summs += dmin * m
                        dmin = builder.fneg(builder.fmul(da, _half(builder, blk, dmin_at)))
                        bsrow = _row(context, builder, signature.args[6], bs_, r)
                        bsblk = builder.gep(bsrow, [builder.mul(b, ir.Constant(I64, 32))])
                        msum = builder.sitofp(_min_sum(builder, bsblk, mins), F32)
                        s_p = _slot(builder, summs, at)
                        builder.store(_fma(builder, dmin, msum, builder.load(s_p)), s_p)
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)
            col = builder.mul(r_, ir.Constant(I64, 4))

            def store(t, _):
                at = builder.trunc(t, I32)
                y = _hsum_float_8(builder, builder.load(_slot(builder, accs, at)))
                if dmin_at is not None:
                    y = builder.fadd(y, builder.load(_slot(builder, summs, at)))
                orow = _row(context, builder, signature.args[-1], out_, builder.add(t0_, t))
                builder.store(y, builder.bitcast(builder.gep(orow, [col]), F32.as_pointer()), align=4)
                return []

            _loop(builder, n_, [], store)
            return context.get_dummy_value()

        return sig, codegen

    return dot
