"""LLVM IR of the batched decode's inner products: every activation row times one unpacked sub-block.

    row_sums(vals, xv, s, blk)

    vals  f32 (S, 64)   sub-block s's values v[k, r] (lane r: weight row r of the group)
    xv    f32 (B, C)    the activation rows; the sub-block's columns are s * S .. s * S + S - 1
    blk   f32 (B, 64)   out: blk[t, r] = sum over k of xv[t, s * S + k] * v[k, r]

Each lane's sum takes the single-row kernels' operations in their order (`matvec._nib_row`, `_row` with the
`*_dot1` products): from 0, one multiply-add per k in order, as `fmul` and `fadd` with the `contract` flag
numba gives them, so that LLVM fuses them into one FMA exactly where it does in those kernels (every one, on
an FMA CPU); no `reassoc` flag, so nothing else may change the order.

Why IR: written in numba, this loop stores its accumulators back to memory after every k (LLVM cannot prove
that `blk` does not alias `vals`): 8 stores per 8 vector multiply-adds, and a row cost about as much as a
whole single-row product. Here a tile of rows keeps its sums in registers for the whole sub-block:

    for each pair of rows (t, t+1), for each half of the lanes (32 = 4 vectors of 8):
        for k in 0..S-1:   v = vals[k, half] (4 vector loads, shared by both rows)
                           sum_t += x[t, k] * v;  sum_t1 += x[t+1, k] * v     (8 vector multiply-adds)

and an odd last row alone (64 lanes, 8 vectors). A row's operations do not depend on its tile.

The scale step after it (`batched._rows`) stays numba code shaped like the single-row kernels' own: those
kernels round some steps differently depending on whether their parallel body was compiled in this process
or loaded from numba's cache (see `batched.py`), and a copy of the same code follows them either way.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._numba import DISABLED

__all__ = ["carray", "f32_pointer", "row_sums"]

I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
V8F32 = ir.VectorType(F32, 8)
LANES = 64  # lanes of a group (`layout.GROUP`): one per weight row
CONTRACT = ("contract",)  # the flag of numba's `fast` kernels that allows fusing x * y + acc, without reassoc


def _loop(builder, n, init: list, body) -> list:
    """for i in range(n): carried = body(i, carried); returns the final carried values."""
    pre = builder.block
    head = builder.append_basic_block("sub.head")
    loop = builder.append_basic_block("sub.body")
    done = builder.append_basic_block("sub.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), pre)
    phis = []
    for v in init:
        phi = builder.phi(v.type)
        phi.add_incoming(v, pre)
        phis.append(phi)
    builder.cbranch(builder.icmp_signed("<", i, n), loop, done)
    builder.position_at_end(loop)
    new = body(i, phis)
    end = builder.block
    i.add_incoming(builder.add(i, ir.Constant(I64, 1)), end)
    for phi, v in zip(phis, new, strict=True):
        phi.add_incoming(v, end)
    builder.branch(head)
    builder.position_at_end(done)
    return phis


def _ptr(builder, base, offset, ty):
    """Pointer to a `ty` at byte `offset` (int or i64 value) from the i8* `base`."""
    off = offset if isinstance(offset, ir.Value) else ir.Constant(I64, offset)
    return builder.bitcast(builder.gep(base, [off]), ty.as_pointer())


def _broadcast(builder, x):
    v = builder.insert_element(ir.Constant(V8F32, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(V8F32, ir.Undefined), ir.Constant(ir.VectorType(I32, 8), [0] * 8))


def _mul_add(builder, x, y, acc):
    return builder.fadd(builder.fmul(x, y, flags=CONTRACT), acc, flags=CONTRACT)


def _tile(builder, arrays, rows: list, vec0: int, nvec: int) -> None:
    """Rows `rows` (i64 row numbers) over lanes [8 vec0, 8 (vec0 + nvec)): the sums over k stay in registers,
    then go to blk."""
    (vbase, S), (xbase, xstride), (bbase, bstride) = arrays
    xrows = [builder.gep(xbase, [builder.mul(t, xstride)]) for t in rows]

    def body(k, sums):
        vrow = builder.mul(k, ir.Constant(I64, 4 * LANES))
        v = [
            builder.load(_ptr(builder, vbase, builder.add(vrow, ir.Constant(I64, 32 * (vec0 + j))), V8F32), align=4)
            for j in range(nvec)
        ]
        out = []
        for i, xrow in enumerate(xrows):
            x = _broadcast(builder, builder.load(_ptr(builder, xrow, builder.mul(k, ir.Constant(I64, 4)), F32)))
            out += [_mul_add(builder, x, v[j], sums[i * nvec + j]) for j in range(nvec)]
        return out

    sums = _loop(builder, S, [ir.Constant(V8F32, [0.0] * 8)] * (len(rows) * nvec), body)
    for i, t in enumerate(rows):
        brow = builder.gep(bbase, [builder.mul(t, bstride)])
        for j in range(nvec):
            builder.store(sums[i * nvec + j], _ptr(builder, brow, 32 * (vec0 + j), V8F32), align=4)


def _compiled_row_sums():
    @intrinsic
    def row_sums(typingctx, vals, xv, s, blk):
        for a in (vals, xv, blk):
            if not (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32):
                return None
        if not isinstance(s, types.Integer):
            return None
        sig = types.none(vals, xv, types.int64, blk)

        def codegen(context, builder, signature, args):
            s_ = args[2]
            va, xa, ba = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 3))
            i8p = ir.IntType(8).as_pointer()
            S = cgutils.unpack_tuple(builder, va.shape, 2)[0]
            B = cgutils.unpack_tuple(builder, xa.shape, 2)[0]
            xbase = builder.gep(builder.bitcast(xa.data, i8p), [builder.mul(builder.mul(s_, S), ir.Constant(I64, 4))])
            arrays = (
                (builder.bitcast(va.data, i8p), S),
                (xbase, cgutils.unpack_tuple(builder, xa.strides, 2)[0]),
                (builder.bitcast(ba.data, i8p), cgutils.unpack_tuple(builder, ba.strides, 2)[0]),
            )
            one, two = ir.Constant(I64, 1), ir.Constant(I64, 2)

            def pair(p, carried):
                t = builder.mul(p, two)
                for half in range(2):
                    _tile(builder, arrays, [t, builder.add(t, one)], 4 * half, 4)
                return []

            _loop(builder, builder.sdiv(B, two), [], pair)
            with builder.if_then(builder.icmp_signed("!=", builder.srem(B, two), ir.Constant(I64, 0))):
                _tile(builder, arrays, [builder.sub(B, one)], 0, 8)
            return context.get_dummy_value()

        return sig, codegen

    return row_sums


def _python_row_sums(vals, xv, s, blk):
    """NUMBA_DISABLE_JIT: a multiply and an add per k, as the plain-Python single-row kernels."""
    S = vals.shape[0]
    for t in range(xv.shape[0]):
        acc = np.zeros(LANES, np.float32)
        for k in range(S):
            acc += xv[t, s * S + k] * vals[k]
        blk[t] = acc


row_sums = _python_row_sums if DISABLED else _compiled_row_sums()


def _compiled_f32_pointer():
    @intrinsic
    def f32_pointer(typingctx, address):
        """The float32 pointer at integer `address` (`ndarray.ctypes.data`): with `carray`, a kernel reads B
        arrays of different lengths (the KV caches of a batch) from one int64 array of addresses, where a tuple
        of arrays would compile once per B."""
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], F32.as_pointer())

        return types.CPointer(types.float32)(address), codegen

    return f32_pointer


f32_pointer = None if DISABLED else _compiled_f32_pointer()  # NUMBA_DISABLE_JIT: callers pass the arrays instead
