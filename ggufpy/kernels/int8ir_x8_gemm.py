"""Prefill kernels that unpack each weight block once for every activation row: grouped Q4_K, Q6_K tiled.

ggml's repacked gemm (`ggml_gemm_q4_K_8x8_q8_K`) takes 4 activation rows x 8 weight rows per pass, so each
Q4_K super-block is unpacked (nibbles, 6-bit scales and mins, fp16 d) once per 4 rows. The kernels here go
further: each block of an eight-row group (Q4_K, `int8dot.interleaved`) or of a row (Q6_K, whose tiled kernel
serves T >= 8) is unpacked once and then dotted with all T activation rows (a loop over the rows inside the
loop over blocks), each row's f32 accumulators waiting in memory between blocks (a store and a load of an f32
value: no rounding). The f32 steps per output are those of the one-row kernels (`int8ir.q4_k_dot(64)`,
`int8ir.q6_k_dot(lanes=False)`), so every product stays bit for bit the replay's (`ggufpy.quants.x86.repack`,
`tiled`): the integer sums are exact in any order, and each output sees the same sequence of roundings.
(Unrolled over 4 rows with everything in registers, LLVM spilled the decoded block around every row and the
Q4_K kernel ran at half this speed. The same loop for Q4_0's groups measured no faster than its one-row
kernel, whose unpacking is 12 instructions a block: not kept.)
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .int8ir import (
    F32,
    F32T,
    HALF,
    I8T,
    I16T,
    I64,
    U8,
    V8F32,
    V8I32,
    V16I8,
    V16I16,
    V32I8,
    _broadcast,
    _fma,
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
from .int8ir_x8 import _hadd, _halves8, _k4_scales_mins_vec, _signature8

__all__ = ["block_major", "q4_kx8_gemm", "q6_k_gemm"]

_Q4_K_GROUP = 8 * 144  # bytes of one super-block of eight Q4_K rows


def _transpose8(builder, v: list) -> list:
    """8 vectors <8 x i32> -> their transpose (out[j] lane r = v[r] lane j): three butterfly stages of shuffles."""
    for k in (1, 2, 4):
        new = list(v)
        for r in range(8):
            if r & k:
                continue
            new[r] = _shuffle(builder, v[r], v[r + k], [c if not c & k else 8 + c - k for c in range(8)])
            new[r + k] = _shuffle(builder, v[r], v[r + k], [c + k if not c & k else 8 + c for c in range(8)])
        v = new
    return v


def _push(builder, stack: list, v) -> None:
    """Add row vector v to a pairwise-add tree kept as a stack of (level, vector): `_reduce8`'s `vphaddd`
    tree, built as the rows come so that few vectors stay live."""
    level = 0
    while stack and stack[-1][0] == level and level < 2:
        v = _hadd(builder, stack.pop()[1], v)
        level += 1
    stack.append((level, v))


def _tree_sum(builder, stack: list):
    """The tree of 8 rows -> lane r = sum of row r's lanes (`_reduce8`'s result)."""
    (_, h0), (_, h1) = stack
    lo = _shuffle(builder, h0, h1, [0, 1, 2, 3, 8, 9, 10, 11])
    hi = _shuffle(builder, h0, h1, [4, 5, 6, 7, 12, 13, 14, 15])
    return builder.add(lo, hi)


def _lane(builder, v, i: int, ty):
    """Lane i of the <8 x i32> v broadcast to every lane of `ty`."""
    return _shuffle(builder, v, v, [i] * ty.count)


def block_major(a, n: int, width: int):
    """Rows 0..n of a (T, nb * width) activation array as (nb * n, width), row b * n + t = block b of row t: the
    n rows' copies of one block side by side. Row-major, the kernels' loop over rows read one block every
    `cols` bytes, and at 4 or 8 KiB strides those all fall in the same L1 sets."""
    nb = a.shape[1] // width
    return np.ascontiguousarray(a[:n].reshape(n, nb, width).transpose(1, 0, 2)).reshape(nb * n, width)


def _signature_gemm(args, dtypes):
    """void(args, out, accm): `_signature`'s checks, then out and the scratch accm, C-contiguous 2-D f32."""
    sig = _signature(args[:-2], dtypes)
    ok = all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == F32T and a.layout == "C" for a in args[-2:])
    return types.void(*sig.args, *args[-2:]) if sig is not None and ok else None


def _lanes8(context, builder, arrty, arr, t, col) -> ir.Value:
    """<8 x float>* to arr[t, col:col+8]."""
    row = _row(context, builder, arrty, arr, t)
    return builder.bitcast(builder.gep(row, [builder.mul(col, ir.Constant(I64, 4))]), V8F32.as_pointer())


def q4_kx8_gemm():
    """Intrinsic (w, g, aq, n, ad, bsums, nb, out, accm): out[0:n, 8g:8g+8] for the grouped Q4_K group g (w u8
    (rows / 8, nb * 1152)) as the repacked gemm (`repack.py`, piece 64): per 64 elements I and M of each
    (activation row, weight row) (int32), acc = fma(float(I), fl(dw * da), acc), accm = fma(float(M),
    fl(dmin * da), accm); out = acc - accm. The lanes are the eight weight rows. Each super-block of the group
    is decoded once (nibbles, 6-bit scales and mins, fp16 d) for all n activation rows, whose acc and accm
    (f32 (n, 8) scratch) wait in memory between super-blocks: stores of f32 values, so no extra rounding.
    The activations come block-major (`block_major`): aq int8 (nb * n, 256), ad f32 (nb, n), bsums int16
    (nb * n, 16), row b * n + t holding block b of row t."""

    @intrinsic
    def gemm(typingctx, w, g, aq, n, ad, bsums, nb, out, accm):
        sig = _signature_gemm((w, g, aq, n, ad, bsums, nb, out, accm), (U8, int, I8T, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, g_, aq_, n_, ad_, bs_, nb_, out_, accm_ = args
            group = _row(context, builder, signature.args[0], w_, g_)
            r0, zero_col = builder.mul(g_, ir.Constant(I64, 8)), ir.Constant(I64, 0)
            zero = ir.Constant(V8F32, [0.0] * 8)
            ones = _splat(V16I16, 1)

            def acc_ptrs(t):
                return (
                    _lanes8(context, builder, signature.args[7], out_, t, r0),
                    _lanes8(context, builder, signature.args[8], accm_, t, zero_col),
                )

            def clear(t, _):
                for p in acc_ptrs(t):
                    builder.store(zero, p, align=4)
                return []

            _loop(builder, n_, [], clear)

            def block(b, _):
                base = builder.gep(group, [builder.mul(b, ir.Constant(I64, _Q4_K_GROUP))])
                blks = [builder.gep(base, [ir.Constant(I64, 144 * r)]) for r in range(8)]
                scales, mins = zip(*(_k4_scales_mins_vec(builder, blk) for blk in blks), strict=True)
                mins_t = _transpose8(builder, list(mins))  # lane r: row r's min of sub-block j
                dw, dm = _halves8(builder, blks, 0), _halves8(builder, blks, 2)
                drows = _row(context, builder, signature.args[4], ad_, b)
                nib = [[_nibbles32(builder, _load(builder, blk, 16 + 32 * c, V32I8)) for blk in blks] for c in range(4)]
                sc = [
                    [[_shuffle(builder, s, s, [j] * 16) for j in (2 * c, 2 * c + 1)] for s in scales] for c in range(4)
                ]

                def row(t, _):
                    bt = builder.add(builder.mul(b, n_), t)  # block-major activations: row b * n + t
                    arow = _row(context, builder, signature.args[2], aq_, bt)
                    da = _load(builder, drows, builder.mul(t, ir.Constant(I64, 4)), F32)
                    da = _broadcast(builder, da, V8F32)
                    dd, dmm = builder.fmul(dw, da), builder.fmul(dm, da)
                    bs = _load(builder, _row(context, builder, signature.args[5], bs_, bt), 0, V16I16)
                    pairs = _madd(builder, bs, ones)  # lane j: bsum_2j + bsum_2j+1
                    pa, pm = acc_ptrs(t)
                    acc, accm = builder.load(pa, align=4), builder.load(pm, align=4)
                    for c in range(4):  # 64 elements: sub-blocks 2c (low nibbles) and 2c + 1 (high), one FMA each
                        a0, a1 = (_load(builder, arow, 64 * c + 32 * h, V32I8) for h in (0, 1))
                        tree = []
                        for (lo, hi), (s0, s1) in zip(nib[c], sc[c], strict=True):
                            v = builder.add(
                                _madd(builder, _maddubs(builder, lo, a0), s0),
                                _madd(builder, _maddubs(builder, hi, a1), s1),
                            )
                            _push(builder, tree, v)
                        msum = builder.add(
                            builder.mul(mins_t[2 * c], _lane(builder, pairs, 2 * c, V8I32)),
                            builder.mul(mins_t[2 * c + 1], _lane(builder, pairs, 2 * c + 1, V8I32)),
                        )
                        acc = _fma(builder, builder.sitofp(_tree_sum(builder, tree), V8F32), dd, acc)
                        accm = _fma(builder, builder.sitofp(msum, V8F32), dmm, accm)
                    builder.store(acc, pa, align=4)
                    builder.store(accm, pm, align=4)
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)

            def finish(t, _):
                pa, pm = acc_ptrs(t)
                builder.store(builder.fsub(builder.load(pa, align=4), builder.load(pm, align=4)), pa, align=4)
                return []

            _loop(builder, n_, [], finish)
            return context.get_dummy_value()

        return sig, codegen

    return gemm


def q6_k_gemm():
    """Intrinsic (w, r, aq, n, ad, bsums, nb, out): out[0:n, r] for the Q6_K GGUF row r (210-byte blocks) as
    ggml's tiled kernel (`int8ir.q6_k_dot(lanes=False)`: s = sum of the lanes, p = fl(float(s) * dw), y =
    fma(p, da, y) per super-block), each block's 6-bit codes and scales unpacked once for all n rows.
    Block-major activations (`block_major`): aq int8 (nb * n, 256), ad f32 (nb, n), bsums int16 (nb * n, 16)."""

    @intrinsic
    def gemm(typingctx, w, r, aq, n, ad, bsums, nb, out):
        sig = _signature8((w, r, aq, n, ad, bsums, nb, out), (U8, int, I8T, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, n_, ad_, bs_, nb_, out_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            three, four = _splat(V32I8, 3), _splat(V32I8, 4)

            def out_ptr(t):
                orow = _row(context, builder, signature.args[7], out_, t)
                return builder.bitcast(builder.gep(orow, [builder.mul(r_, ir.Constant(I64, 4))]), F32.as_pointer())

            def clear(t, _):
                builder.store(ir.Constant(F32, 0.0), out_ptr(t), align=4)
                return []

            _loop(builder, n_, [], clear)

            def block(b, _):
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, 210))])
                sc16 = builder.sext(_load(builder, blk, 192, V16I8), V16I16)
                codes, scales = [], []
                for h in range(2):  # block_q6_K: ql[128], qh[64], scales[16], d
                    ql0, ql1 = (_load(builder, blk, 64 * h + 32 * i, V32I8) for i in range(2))
                    qh = _load(builder, blk, 128 + 32 * h, V32I8)
                    lo0, hi0 = _nibbles32(builder, ql0)
                    lo1, hi1 = _nibbles32(builder, ql1)
                    for i, low in enumerate((lo0, lo1, hi0, hi1)):  # elements 128h + 32i + l
                        top = builder.and_(builder.lshr(qh, _splat(V32I8, 2 * i)), three)
                        codes.append(builder.or_(low, builder.shl(top, four)))
                        chunk = 4 * h + i
                        scales.append(_shuffle(builder, sc16, sc16, [2 * chunk] * 8 + [2 * chunk + 1] * 8))
                dw = builder.fpext(_load(builder, blk, 208, HALF), F32)
                drows = _row(context, builder, signature.args[4], ad_, b)

                def row(t, _):
                    bt = builder.add(builder.mul(b, n_), t)  # block-major activations: row b * n + t
                    arow = _row(context, builder, signature.args[2], aq_, bt)
                    isum = ir.Constant(V8I32, [0] * 8)
                    for chunk, (u, scale) in enumerate(zip(codes, scales, strict=True)):
                        a = _load(builder, arow, 32 * chunk, V32I8)
                        isum = builder.add(isum, _madd(builder, _maddubs(builder, u, a), scale))
                    bs = _load(builder, _row(context, builder, signature.args[5], bs_, bt), 0, V16I16)
                    isum = builder.sub(isum, builder.shl(_madd(builder, bs, sc16), _splat(V8I32, 5)))
                    da = _load(builder, drows, builder.mul(t, ir.Constant(I64, 4)), F32)
                    p = builder.fmul(builder.sitofp(_hsum_i32(builder, isum), F32), dw)
                    ptr = out_ptr(t)
                    builder.store(_fma(builder, p, da, builder.load(ptr, align=4)), ptr, align=4)
                    return []

                _loop(builder, n_, [], row)
                return []

            _loop(builder, nb_, [], block)
            return context.get_dummy_value()

        return sig, codegen

    return gemm
