"""One weight row against up to eight activation rows, each row's f32 steps those of its one-row kernel.

A batched pass in the llamacpp numerics computes every row as that token decoded alone (`Model.prefill_batch`),
so each row must take the kernel llama.cpp runs for one token, not its gemm. The one-row intrinsics
(`int8ir.q0_dot(kind, lanes=True)`) decode a weight block and dot it with one activation row; B rows through
them decode every block B times. Here the block is decoded once (nibbles, 5th bits, Q8_0's |w| and sign) and
then dotted with each of T activation rows, each row with its own eight f32 lanes and its own `summs`:

    per block b:  u = codes(w[r, b])                                   (once)
                  for t < T:  isum = pmaddwd(pmaddubsw(u, a[t, b]), 1) - zp * asum[t, b]
                              acc[t] = fma(d_w * d_a[t, b], float(isum), acc[t])
                              summs[t] += m_w * s_a[t, b]               (Q4_1, Q5_1)
    out[t, r] = hsum_float_8(acc[t]) (+ summs[t])

The integer sums are exact in any order and each output sees the one-row kernel's roundings in its order, so
out[t, r] is bit for bit `q0_dot(kind, True)(w, r, aq, t, ...)` (tests/test_int8_rows.py). A call takes 1..8 rows,
each count its own code path (a switch), so that the T accumulators stay in registers (8 + the decoded block
fit AVX2's 16).

The eight-row groups of Q4_0 and Q4_K (`int8dot.interleaved`) take the same idea with the repacked gemv's
steps (`q4_0x8_rows`, `q4_kx8_rows`), and Q6_K with its vec_dot's (`q6_k_rows`): a block is decoded once into
a stack scratch, then dotted with each row, whose accumulators wait in a stack array between blocks.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from .int8ir import (
    F32,
    F32T,
    HALF,
    I8T,
    I16T,
    I32,
    I32T,
    I64,
    Q0_KINDS,
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
    _psign,
    _q0_codes,
    _row,
    _shuffle,
    _splat,
)
from .int8ir_x8 import Q4_0X8_BYTES, _hadd, _halves8, _k4_scales_mins_vec, _reduce8, _signature8, _store8

MAX_ROWS = 8  # activation rows per intrinsic call: eight f32 accumulators beside the decoded block


def q0_dot_rows(kind: str):
    """Intrinsic (w, r, aq, t0, n, adT, sT, asum, nb, out): out[t0 + i, r] for i < n (1 <= n <= MAX_ROWS), each
    the value of `int8ir.q0_dot(kind, lanes=True)` for weight row r and activation row t0 + i. adT, sT f32
    (nb, T + MAX_ROWS): the activations' d and s transposed (`by_block`), so that a block's scales of eight rows
    are one vector. One code path per n (a switch): each keeps its n accumulators in registers."""
    size, _, zp, _, m_at = Q0_KINDS[kind]

    @intrinsic
    def dot(typingctx, w, r, aq, t0, n, adT, sT, asum, nb, out):
        sig = _signature8((w, r, aq, t0, n, adT, sT, asum, nb, out), (U8, int, I8T, int, int, F32T, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            wrow = _row(context, builder, signature.args[0], args[0], args[1])
            n_ = args[4]
            done = builder.append_basic_block("rows.done")
            switch = builder.switch(n_, done)
            for T in range(1, MAX_ROWS + 1):
                case = builder.append_basic_block(f"rows.{T}")
                switch.add_case(ir.Constant(I64, T), case)
                builder.position_at_end(case)
                _rows(context, builder, signature, args, wrow, T, size, zp, m_at, kind)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    return dot


def _lane(builder, v, i: int):
    """Lane i of <8 x float> in all eight lanes (`vpermps`)."""
    return _shuffle(builder, v, v, [i] * 8)


def _rows(context, builder, signature, args, wrow, T: int, size: int, zp: int, m_at, kind: str) -> None:
    """The loop over weight row r's blocks for activation rows t0..t0+T-1, then the T stores.

    Row i's f32 steps are the one-row kernel's: d = d_w * d_a (one `fmul`), acc = fma(d, float(isum), acc),
    summs = summs + m_w * s_a (an `fmul`, then an `fadd`). The scalar ones run in lane i of vectors over the
    eight rows (the same IEEE operation in each lane), not once per row."""
    _, r_, aq_, t0_, _, adT_, sT_, asum_, nb_, out_ = args
    ts = [builder.add(t0_, ir.Constant(I64, i)) for i in range(T)]
    arows = [_row(context, builder, signature.args[2], aq_, t) for t in ts]
    sumrows = [_row(context, builder, signature.args[7], asum_, t) for t in ts] if zp else None
    t0_bytes = builder.mul(t0_, ir.Constant(I64, 4))
    init = [ir.Constant(V8F32, [0.0] * 8)] * (T + 1)  # T lane accumulators, then the rows' summs (lane i: row i)

    def body(b, carried):
        accs, summs = list(carried[:T]), carried[T]
        blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, size))])
        u, sign = _q0_codes(builder, blk, kind)  # decoded once for the T rows
        a_off = builder.mul(b, ir.Constant(I64, 32))
        da = _load(builder, _row(context, builder, signature.args[5], adT_, b), t0_bytes, V8F32)
        d = builder.fmul(_broadcast(builder, _half(builder, blk, 0), V8F32), da)  # fp16 * fp16: exact in f32
        for i in range(T):  # row i: the one-row kernel's steps for this block
            a = _load(builder, arows[i], a_off, V32I8)
            p = _maddubs(builder, u, a if sign is None else _psign(builder, a, sign))
            isum = _madd(builder, p, _splat(V16I16, 1))
            if zp:
                asums = _load(builder, sumrows[i], a_off, V8I32)
                isum = builder.sub(isum, builder.mul(asums, _splat(V8I32, zp)))
            accs[i] = _fma(builder, _lane(builder, d, i), builder.sitofp(isum, V8F32), accs[i])
        if m_at is not None:  # summs += m_w * s_a, every row at once
            sa = _load(builder, _row(context, builder, signature.args[6], sT_, b), t0_bytes, V8F32)
            mw = _broadcast(builder, _half(builder, blk, m_at), V8F32)
            summs = builder.fadd(summs, builder.fmul(mw, sa))
        return [*accs, summs]

    carried = _loop(builder, nb_, init, body)
    col = builder.mul(r_, ir.Constant(I64, 4))
    for i, t in enumerate(ts):
        y = _hsum_float_8(builder, carried[i])
        if m_at is not None:
            y = builder.fadd(y, builder.extract_element(carried[T], ir.Constant(I32, i)))
        orow = _row(context, builder, signature.args[-1], out_, t)
        builder.store(y, builder.bitcast(builder.gep(orow, [col]), F32.as_pointer()), align=4)


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
            codes = cgutils.alloca_once(builder, ir.ArrayType(V32I8, 64))  # [8 * row + sub-block]
            scales = cgutils.alloca_once(builder, ir.ArrayType(V16I16, 64))  # its scale in all 16 lanes
            mins = cgutils.alloca_once(builder, ir.ArrayType(V8I32, 8))  # [row]: the 8 sub-blocks' mins
            accs = cgutils.alloca_once(builder, ir.ArrayType(V8F32, 2 * MAX_ROWS))  # [2t]: acc, [2t + 1]: accm
            zero = ir.Constant(V8F32, [0.0] * 8)

            def slot(array, i):
                return builder.gep(array, [ir.Constant(I32, 0), i if isinstance(i, ir.Value) else ir.Constant(I32, i)])

            for i in range(2 * MAX_ROWS):
                builder.store(zero, slot(accs, i))

            def block(b, carried):
                blks = [
                    builder.gep(
                        group, [builder.add(builder.mul(b, ir.Constant(I64, Q4_KX8_BYTES)), ir.Constant(I64, 144 * i))]
                    )
                    for i in range(8)
                ]
                for i, blk in enumerate(blks):  # decoded once for the n rows
                    sc, mn = _k4_scales_mins_vec(builder, blk)
                    builder.store(mn, slot(mins, i))
                    for c in range(4):
                        lo, hi = _nibbles32(builder, _load(builder, blk, 16 + 32 * c, V32I8))
                        builder.store(lo, slot(codes, 8 * i + 2 * c))
                        builder.store(hi, slot(codes, 8 * i + 2 * c + 1))
                    for j in range(8):
                        builder.store(_shuffle(builder, sc, sc, [j] * 16), slot(scales, 8 * i + j))
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
                            p = _maddubs(builder, builder.load(slot(codes, 8 * i + j)), a[j])
                            isum = builder.add(isum, _madd(builder, p, builder.load(slot(scales, 8 * i + j))))
                        isums.append(isum)
                        msums.append(builder.mul(builder.load(slot(mins, i)), pairs))
                    da_row = _row(context, builder, signature.args[5], ad_, r)
                    da = _broadcast(builder, _load(builder, da_row, builder.mul(b, ir.Constant(I64, 4)), F32), V8F32)
                    at = builder.trunc(builder.mul(t, ir.Constant(I64, 2)), I32)
                    acc_p, accm_p = slot(accs, at), slot(accs, builder.add(at, ir.Constant(I32, 1)))
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
                acc = builder.load(slot(accs, at))
                accm = builder.load(slot(accs, builder.add(at, ir.Constant(I32, 1))))
                _store8(context, builder, signature, out_, builder.add(t0_, t), r0, builder.fsub(acc, accm))
                return []

            _loop(builder, n_, [], store)
            return context.get_dummy_value()

        return sig, codegen

    return dot


# -- Q4_0 in eight-row groups (`int8ir_x8`'s layout): the repacked gemv / gemm's steps per row -----------------------
def q4_0x8_rows():
    """Intrinsic (w, g, aq, t0, n, ad, zsum, nb, out): out[t0 + i, 8g:8g+8] for i < n (1 <= n <= MAX_ROWS), each
    row the value of `int8ir_x8.q4_0x8_dot` for that row (acc = fma(float(block sum), d_w * d_a, acc), one lane
    per weight row). zsum int32 (T, nb): 8 * the sum of row t's quants in block b, the zero point's term
    (`zero_sums`), which the one-row kernel sums again for every group.

    Each block of the group is decoded once (its 8 code vectors) into a stack scratch and dotted with each of
    the n rows; each row's accumulator waits in a stack array between blocks (no rounding)."""

    @intrinsic
    def dot(typingctx, w, g, aq, t0, n, ad, zsum, nb, out):
        sig = _signature8((w, g, aq, t0, n, ad, zsum, nb, out), (U8, int, I8T, int, int, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            w_, g_, aq_, t0_, n_, ad_, zs_, nb_, out_ = args
            group = _row(context, builder, signature.args[0], w_, g_)
            codes = cgutils.alloca_once(builder, ir.ArrayType(V32I8, 8))  # [2c]: low nibbles of rows c, c + 4
            accs = cgutils.alloca_once(builder, ir.ArrayType(V8F32, MAX_ROWS))
            ones = _splat(V16I16, 1)

            def slot(array, i):
                index = i if isinstance(i, ir.Value) else ir.Constant(I32, i)
                return builder.gep(array, [ir.Constant(I32, 0), index])

            for i in range(MAX_ROWS):
                builder.store(ir.Constant(V8F32, [0.0] * 8), slot(accs, i))

            def block(b, carried):
                blk = builder.gep(group, [builder.mul(b, ir.Constant(I64, Q4_0X8_BYTES))])
                for c in range(4):  # decoded once for the n rows
                    lo, hi = _nibbles32(builder, _load(builder, blk, 16 + 32 * c, V32I8))
                    builder.store(lo, slot(codes, 2 * c))
                    builder.store(hi, slot(codes, 2 * c + 1))
                dw = builder.fpext(_load(builder, blk, 0, ir.VectorType(HALF, 8)), V8F32)

                def row(t, _):
                    r = builder.add(t0_, t)
                    ablk = builder.gep(
                        _row(context, builder, signature.args[2], aq_, r), [builder.mul(b, ir.Constant(I64, 32))]
                    )
                    a_lo, a_hi = (_load(builder, ablk, o, V16I8) for o in (0, 16))
                    a_lo, a_hi = (_shuffle(builder, a, a, list(range(16)) * 2) for a in (a_lo, a_hi))
                    lanes = []
                    for c in range(4):  # rows c and c + 4
                        lo, hi = builder.load(slot(codes, 2 * c)), builder.load(slot(codes, 2 * c + 1))
                        p = builder.add(_maddubs(builder, lo, a_lo), _maddubs(builder, hi, a_hi))  # |p| <= 7680
                        lanes.append(_madd(builder, p, ones))
                    h = _hadd(builder, _hadd(builder, lanes[0], lanes[1]), _hadd(builder, lanes[2], lanes[3]))
                    zs = _load(
                        builder,
                        _row(context, builder, signature.args[6], zs_, r),
                        builder.mul(b, ir.Constant(I64, 4)),
                        I32,
                    )
                    isum = builder.sub(h, _broadcast(builder, zs, V8I32))
                    da = _load(
                        builder,
                        _row(context, builder, signature.args[5], ad_, r),
                        builder.mul(b, ir.Constant(I64, 4)),
                        F32,
                    )
                    d = builder.fmul(dw, _broadcast(builder, da, V8F32))
                    acc_p = slot(accs, builder.trunc(t, I32))
                    builder.store(_fma(builder, builder.sitofp(isum, V8F32), d, builder.load(acc_p)), acc_p)
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)
            r0 = builder.mul(g_, ir.Constant(I64, 8))

            def store(t, _):
                acc = builder.load(slot(accs, builder.trunc(t, I32)))
                _store8(context, builder, signature, out_, builder.add(t0_, t), r0, acc)
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
            codes = cgutils.alloca_once(builder, ir.ArrayType(V32I8, 8))  # [chunk]: elements 32 chunk..
            scales = cgutils.alloca_once(builder, ir.ArrayType(V16I16, 8))  # [chunk]: its two scales, 8 lanes each
            accs = cgutils.alloca_once(builder, ir.ArrayType(V8F32, MAX_ROWS))

            def slot(array, i):
                index = i if isinstance(i, ir.Value) else ir.Constant(I32, i)
                return builder.gep(array, [ir.Constant(I32, 0), index])

            for i in range(MAX_ROWS):
                builder.store(ir.Constant(V8F32, [0.0] * 8), slot(accs, i))

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
                        builder.store(builder.or_(low[i], builder.shl(top, four)), slot(codes, chunk))
                        pair = _shuffle(builder, sc16, sc16, [2 * chunk] * 8 + [2 * chunk + 1] * 8)
                        builder.store(pair, slot(scales, chunk))
                dw = _half(builder, blk, 208)

                def row(t, _):
                    r = builder.add(t0_, t)
                    ablk = builder.gep(
                        _row(context, builder, signature.args[2], aq_, r), [builder.mul(b, ir.Constant(I64, 256))]
                    )
                    isum = ir.Constant(V8I32, [0] * 8)
                    for chunk in range(8):
                        a = _load(builder, ablk, 32 * chunk, V32I8)
                        p = _maddubs(builder, builder.load(slot(codes, chunk)), a)
                        isum = builder.add(isum, _madd(builder, p, builder.load(slot(scales, chunk))))
                    bsrow = _row(context, builder, signature.args[6], bs_, r)
                    bs = _load(builder, bsrow, builder.mul(b, ir.Constant(I64, 32)), V16I16)
                    isum = builder.sub(isum, builder.shl(_madd(builder, bs, sc16), _splat(V8I32, 5)))
                    drow = _row(context, builder, signature.args[5], ad_, r)
                    da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                    d = _broadcast(builder, builder.fmul(da, dw), V8F32)
                    acc_p = slot(accs, builder.trunc(t, I32))
                    builder.store(_fma(builder, d, builder.sitofp(isum, V8F32), builder.load(acc_p)), acc_p)
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)
            col = builder.mul(r_, ir.Constant(I64, 4))

            def store(t, _):
                y = _hsum_float_8(builder, builder.load(slot(accs, builder.trunc(t, I32))))
                orow = _row(context, builder, signature.args[-1], out_, builder.add(t0_, t))
                builder.store(y, builder.bitcast(builder.gep(orow, [col]), F32.as_pointer()), align=4)
                return []

            _loop(builder, n_, [], store)
            return context.get_dummy_value()

        return sig, codegen

    return dot
