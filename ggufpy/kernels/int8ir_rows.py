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

Q4_0's eight-row groups (`int8dot.interleaved`) take the same idea with the repacked gemv's steps
(`q4_0x8_rows`): a group's block is decoded once into a stack scratch, then dotted with each row, whose
accumulator waits in a stack array between blocks. The k-quants' rows forms are in `int8ir_rows_k.py`.
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
from .int8ir_x8 import Q4_0X8_BYTES, _hadd, _signature8, _store8

MAX_ROWS = 8  # activation rows per intrinsic call: eight f32 accumulators beside the decoded block


def _stack(builder, ty, n: int, zero=None):
    """An array of n values of `ty` on the stack (an alloca in the entry block), each set to `zero` if given."""
    array = cgutils.alloca_once(builder, ir.ArrayType(ty, n))
    for i in range(n if zero is not None else 0):
        builder.store(zero, _slot(builder, array, i))
    return array


def _slot(builder, array, i):
    """A pointer to element i (an int, or an i32 value) of a `_stack` array."""
    index = i if isinstance(i, ir.Value) else ir.Constant(I32, i)
    return builder.gep(array, [ir.Constant(I32, 0), index])


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
            codes = _stack(builder, V32I8, 8)  # [2c]: low nibbles of rows c, c + 4
            accs = _stack(builder, V8F32, MAX_ROWS, ir.Constant(V8F32, [0.0] * 8))
            ones = _splat(V16I16, 1)

            def block(b, carried):
                blk = builder.gep(group, [builder.mul(b, ir.Constant(I64, Q4_0X8_BYTES))])
                for c in range(4):  # decoded once for the n rows
                    lo, hi = _nibbles32(builder, _load(builder, blk, 16 + 32 * c, V32I8))
                    builder.store(lo, _slot(builder, codes, 2 * c))
                    builder.store(hi, _slot(builder, codes, 2 * c + 1))
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
                        lo, hi = (
                            builder.load(_slot(builder, codes, 2 * c)),
                            builder.load(_slot(builder, codes, 2 * c + 1)),
                        )
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
                    acc_p = _slot(builder, accs, builder.trunc(t, I32))
                    builder.store(_fma(builder, builder.sitofp(isum, V8F32), d, builder.load(acc_p)), acc_p)
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)
            r0 = builder.mul(g_, ir.Constant(I64, 8))

            def store(t, _):
                acc = builder.load(_slot(builder, accs, builder.trunc(t, I32)))
                _store8(context, builder, signature, out_, builder.add(t0_, t), r0, acc)
                return []

            _loop(builder, n_, [], store)
            return context.get_dummy_value()

        return sig, codegen

    return dot
