"""NVFP4 times single Q8_0 activation rows (decode) in the llamacpp numerics: `ggml_vec_dot_nvfp4_q8_0`'s integers
and f32 steps (arch/x86/quants.c, AVX2; `int8ir_fp4.nvfp4_dot`'s), with the activations permuted once per call
so that a block's codes need no cross-lane shuffle.

ggml orders each Q8_0 block's 32 codes as elements: qs[8s + j] holds element 16s + j (low nibble) and 16s + 8 + j
(high). `nvfp4_dot` rebuilds that order per weight row and block (nibbles, then a cross-lane permute). Here the
codes stay as they come, low nibbles of the 16 bytes then high nibbles (one load, a shift, a mask), and the
activation row is permuted to match, once for all weight rows (`permuted`):

    position p (the code order)   0-7   8-15   16-23  24-31
    element _ELEM[p]              0-7   16-23  8-15   24-31

Lane L of `vpmaddwd` (positions 4L..4L+3) then holds ggml's lane _PERM[L] = [0, 1, 4, 5, 2, 3, 6, 7][L]: the same four
products, so the same exact integer. The per-lane scales and the activations' four-quant sums (the +12 of the
code table, `int8ir_fp4`) follow the permutation, and the accumulator is put back into ggml's lane order before
`hsum_float_8`: every f32 step is the replay's, on the same values, bit for bit. The four scales of a block
are converted once into both 128-bit halves ([s0..s3, s0..s3] times [d0 d0 d1 d1] twice), so each Q8_0 block's
lane scales [A A B B A A B B] are one in-lane shuffle, and the weights are prefetched `PREFETCH` bytes ahead.

Measured (one thread, CPU time, A/B in one process on a loaded 2-core machine): 0.75-0.85x the time of
`nvfp4_dot` on a 2816 x 1024 product in cache; per token of the 8-layer bench model 0.65-0.73x (products) and
0.80x (decode, `Model.block`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..quants.lowbit import KVALUES_MXFP4
from ._numba import jit
from .int8ir import (
    F32,
    I8,
    I32,
    I64,
    V8F32,
    V8I32,
    V16I16,
    V32I8,
    _fma,
    _fn,
    _hsum_float_8,
    _load,
    _loop,
    _madd,
    _maddubs,
    _row,
    _shuffle,
    _signature,
    _splat,
)

__all__ = ["nvfp4_row_dot", "permuted"]

NVFP4_BYTES = 36  # block_nvfp4: d[4] (UE4M3), qs[32]
_OFFSET = 12  # the code table holds kvalues_mxfp4 + 12 (0..24, unsigned for `vpmaddubsw`), as `int8ir_fp4`'s

_ELEM = np.array([*range(8), *range(16, 24), *range(8, 16), *range(24, 32)], np.int64)  # position -> element
_PERM = np.array([0, 1, 4, 5, 2, 3, 6, 7], np.int64)  # our lane -> ggml's lane (its own inverse)


@jit
def permuted(aq, ad, asum, t0):
    """Activation rows t0.. of (aq int8 (T, C), ad f32 (T, C / 32), asum int32 (T, C / 4)) in the code order:
    (ap int8 (n, C): per 32-block element _ELEM[p] at p; c12 int32 (n, C / 4): 12 x the four-quant sum of our lane
    L = ggml's lane _PERM[L]; da f32 (n, C / 8): per NVFP4 block the Q8_0 d of its four sub-blocks, d0 d0 d1 d1,
    twice: one per 128-bit half of the scale vector)."""
    T, C = aq.shape
    n = T - t0
    ap = np.empty((n, C), np.int8)
    c12 = np.empty((n, C // 4), np.int32)
    da = np.empty((n, C // 8), np.float32)
    for i in range(n):
        for q in range(C // 32):
            for p in range(32):
                ap[i, 32 * q + p] = aq[t0 + i, 32 * q + _ELEM[p]]
            for lane in range(8):
                c12[i, 8 * q + lane] = np.int32(_OFFSET) * asum[t0 + i, 8 * q + _PERM[lane]]
        for b in range(C // 64):
            for k in range(8):
                da[i, 8 * b + k] = ad[t0 + i, 2 * b + (k % 4) // 2]
    return ap, c12, da


def _ue4m3_half(builder, x):
    """`int8ir_fp4._ue4m3_half` on n bytes at once (<n x i8> -> <n x float>), in fewer steps: v = x & 0x7F is the
    f32 exponent and mantissa bits shifted down 20 (v << 20 + 119 << 23 is (1 + man / 8) 2^(exp - 8)); exponent
    0 is man 2^-10 = float(v) 2^-10; the byte 0x7F is 0."""
    n = x.type.count
    i32, f32 = ir.VectorType(ir.IntType(32), n), ir.VectorType(F32, n)
    xi = builder.zext(x, i32)
    v = builder.and_(xi, _splat(i32, 0x7F))
    normal = builder.bitcast(builder.add(builder.shl(v, _splat(i32, 20)), _splat(i32, 119 << 23)), f32)
    small = builder.fmul(builder.sitofp(v, f32), _splat(f32, 2.0**-10))
    value = builder.select(builder.icmp_unsigned("<", v, _splat(i32, 8)), small, normal)
    return builder.select(builder.icmp_unsigned("==", xi, _splat(i32, 0x7F)), _splat(f32, 0.0), value)


def _values(builder, u):
    """<32 x i8> codes 0..15 -> kvalues_mxfp4 + 12 (`vpshufb`, the table in both 128-bit halves)."""
    fn = _fn(builder, "llvm.x86.avx2.pshuf.b", V32I8, [V32I8, V32I8])
    return builder.call(fn, [ir.Constant(V32I8, [int(v) + _OFFSET for v in KVALUES_MXFP4] * 2), u])


def _codes(builder, blk, at):
    """The 16 bytes at blk + at -> <32 x i8>: their low nibbles, then their high nibbles. Loaded into both 128-bit
    halves at once (`vbroadcasti128`, a load) and the upper half shifted by 4 (`vpsrlvq`): no cross-lane insert."""
    v2, v4 = ir.VectorType(I64, 2), ir.VectorType(I64, 4)
    both = _shuffle(builder, _load(builder, blk, at, v2), ir.Constant(v2, None), [0, 1, 0, 1])
    shifted = builder.lshr(both, ir.Constant(v4, [0, 0, 4, 4]))
    return builder.and_(builder.bitcast(shifted, V32I8), _splat(V32I8, 15))


def _prefetch(builder, ptr):
    """`prefetcht0` of the line at ptr (never faults: past the weight's end it is dropped)."""
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    builder.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


# Bytes ahead of the block being read that each block prefetches. A decode token streams every weight from DRAM once
# (the bench model's 51 MB do not fit the L3): the hardware prefetcher stops at each 4 KiB page and the row kernel
# waited on memory (as fast as the previous kernel despite fewer instructions). Measured per token on the bench
# model: 512 bytes ahead 0.91x the time without, 1024 0.79x, 2048 0.79x, 4096 0.90x. Rows in groups of two or
# four (independent FMA chains, shared scale conversion: faster in cache) were slower per token, prefetched or not:
# several short streams instead of one.
PREFETCH = 2048


def nvfp4_row_dot():
    """Intrinsic (w, r, ap, i, da, c12, nb) -> f32 (nb: Q8_0 blocks): NVFP4 row r of w (u8 (rows, nb / 2 * 36))
    times the permuted activation row i (`permuted`), bit for bit `int8ir_fp4.nvfp4_dot()` on the row as given."""

    dtypes = (types.uint8, int, types.int8, int, types.float32, types.int32, int)

    @intrinsic
    def dot(typingctx, w, r, ap, i, da, c12, nb):
        sig = _signature((w, r, ap, i, da, c12, nb), dtypes)

        def codegen(context, builder, signature, args):
            w_, r_, ap_, i_, da_, c12_, nb_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            arow = _row(context, builder, signature.args[2], ap_, i_)
            drow = _row(context, builder, signature.args[4], da_, i_)
            crow = _row(context, builder, signature.args[5], c12_, i_)
            ones = _splat(V16I16, 1)

            def body(b, carried):
                (acc,) = carried
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, NVFP4_BYTES))])
                _prefetch(builder, builder.gep(blk, [ir.Constant(I64, PREFETCH)]))
                # fl(UE4M3(d[s]) * d_a of the Q8_0 block s // 2), s = 0..3, in both 128-bit halves
                d8 = _load(builder, drow, builder.mul(b, ir.Constant(I64, 32)), V8F32)
                d = _load(builder, blk, 0, ir.VectorType(I8, 4))
                s8 = builder.fmul(_ue4m3_half(builder, _shuffle(builder, d, d, [0, 1, 2, 3] * 2)), d8)
                for h in range(2):  # the Q8_0 blocks 2b and 2b + 1
                    q = builder.add(builder.mul(b, ir.Constant(I64, 2)), ir.Constant(I64, h))
                    codes = _values(builder, _codes(builder, blk, 4 + 16 * h))
                    p = _maddubs(builder, codes, _load(builder, arow, builder.mul(q, ir.Constant(I64, 32)), V32I8))
                    corr = _load(builder, crow, builder.mul(q, ir.Constant(I64, 32)), V8I32)
                    lanes = builder.sub(_madd(builder, p, ones), corr)
                    pick = [2 * h, 2 * h, 2 * h + 1, 2 * h + 1]  # our lanes' sub-blocks: in-lane, one `vpermilps`
                    s = _shuffle(builder, s8, s8, pick + [4 + k for k in pick])
                    acc = _fma(builder, s, builder.sitofp(lanes, V8F32), acc)
                return [acc]

            pairs = builder.ashr(nb_, ir.Constant(I64, 1))
            (acc,) = _loop(builder, pairs, [ir.Constant(V8F32, [0.0] * 8)], body)
            return _hsum_float_8(builder, _shuffle(builder, acc, acc, list(_PERM)))  # back to ggml's lanes

        return sig, codegen

    return dot
