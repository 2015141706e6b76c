"""TQ2_0 times T >= 2 activation rows in the llamacpp numerics with lanes = weight rows (issue 12).

ggml runs `ggml_vec_dot_tq2_0_q8_K` (arch/x86/quants.c, AVX2) for every (weight row, activation row), so each
output is that vec_dot's (`int8ir_ternary.tq2_0_dot`, replayed by `quants.x86.ternary`). Per 256-element block
it forms, in each of its eight 32-bit lanes L, the exact integer

    I_L = sum over the 8 chunks c of q . y on elements 32c + 4L..4L+3  -  (bsums[2L] + bsums[2L+1])

(16-bit partial sums: `vpmaddubsw(q, y)` over the chunks minus the Q8_K bsums, then `vpmaddwd` with ones), then
acc[L] = fma(float(I_L), fl(d_a * d_w), acc[L]) block by block and y = hsum_float_8(acc). Lane L reads dword L of
every 32-byte chunk, which is what a broadcast of activation dword L gives when the vector lanes are weight rows:

    W[b, L, c]  <8 x i32>: lane j = the four codes (0..3) of weight row r0 + j, chunk c, bytes 4L..4L+3
    s16 = sum_c vpmaddubsw(W[b, L, c], broadcast(y[t, b, c, dword L])) - broadcast(bsums[t, b] dword L)
    I_L = vpmaddwd(s16, 1)       lane j: weight row r0 + j (the same integer as ggml's lane L: every sum exact,
                                 |s16| <= 8 * 2 * 3 * 127 + 16 * 127 < 2^15, no pair saturates)
    A_L = fma(float(I_L), fl(d_a[t, b] * d_w[b]), A_L)    eight rows' acc[L] at once, blocks in order
    y   = (fl(A_4 + A_0) + fl(A_6 + A_2)) + (fl(A_5 + A_1) + fl(A_7 + A_3))    `hsum_float_8`, per lane

so out[t, r0 + j] is `tq2_0_dot`'s result bit for bit. The eight weight rows' codes are decoded once per group
into an L1 scratch (transposed so dword L of the eight rows is one vector), then the activation rows run against
them TILE at a time, lane L by lane L (the loop over blocks innermost: TILE <8 x f32> accumulators stay in
registers, and W[b, L, c] is loaded once for the TILE rows; the T % TILE rows left over run as one smaller
tile). The multiplies are the vec_dot's (64 `vpmaddubsw`
per block and eight (weight row, activation row) pairs); what the form saves is the decode of the codes (done
once per weight row instead of once per pair) and most of the epilogue.

Measured (one thread, CPU time, alternating in one process against `tq2_0_dot` per (row, activation row)): at
T = 128 the products 2816x1024, 1024x2816, 1024x1024 take 0.55-0.65x the time (TILE 3 the same within noise, 2
~0.7x, 6 ~0.84x); at T = 4 0.83-0.94x, T = 3 0.88-1.09x, T = 2 1.07-1.31x (the group's decode is not yet paid
back), so the driver should run this from T = 4. Removing the activation broadcasts (a timing-only experiment)
saved nothing: the loop is bound by its `vpmaddubsw`, as many as ggml's.

Scratch (u8, nb * SCRATCH_PER_BLOCK per group; super-block b at b * SCRATCH_PER_BLOCK):

    W     (8 L, 8 c) <32 x i8>     2048
    d_w   <8 x f32>                  32    the rows' fp16 d
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ._numba import jit, prange, use_threads
from .int8grid_gemm import _transpose8
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
    _half,
    _load,
    _loop,
    _madd,
    _maddubs,
    _row,
    _splat,
)
from .int8ir_ternary_rows import tq_rows

__all__ = ["ROWS", "SCRATCH_PER_BLOCK", "TILE", "mv_tq2_0_rows", "tq2_0_group"]

ROWS = 8  # weight rows per group: one per i32 lane
TILE = 4  # activation rows per pass over a lane L of the decoded group
SCRATCH_PER_BLOCK = 2048 + 32
_DW = 2048  # offset of the rows' d_w within a block's scratch
_SIZE, _D_AT = 66, 64  # block_tq2_0: qs[64], fp16 d
# ggml's lanes in an order that lets `hsum_float_8`'s sums be formed as soon as both operands exist
_LANE_ORDER = (0, 4, 2, 6, 1, 5, 3, 7)


def _store(builder, base, offset, value):
    off = offset if isinstance(offset, ir.Value) else ir.Constant(I64, offset)
    builder.store(value, builder.bitcast(builder.gep(base, [off]), value.type.as_pointer()), align=1)


def _decode_group(context, builder, wty, w_, r0, nb, scratch):
    """Blocks 0..nb of weight rows r0..r0+8 into the scratch: block_tq2_0 keeps the codes of chunk 4h + l in bits
    2l..2l+1 of qs[32h..32h+32] (`int8ir_ternary_rows.tq2_0_codes`), so dword L of the eight rows' qs half h,
    transposed into one vector, gives W[b, L, 4h + l] after a shift and a mask."""
    wrows = [_row(context, builder, wty, w_, builder.add(r0, ir.Constant(I64, j))) for j in range(ROWS)]
    three = _splat(V8I32, 0x03030303)

    def block(b, _):
        base = builder.gep(scratch, [builder.mul(b, ir.Constant(I64, SCRATCH_PER_BLOCK))])
        blks = [builder.gep(wrow, [builder.mul(b, ir.Constant(I64, _SIZE))]) for wrow in wrows]
        for h in range(2):
            x = _transpose8(builder, [_load(builder, blk, 32 * h, V8I32) for blk in blks])  # x[L]: lane j = row j
            for L in range(8):
                for sh in range(4):
                    v = builder.lshr(x[L], _splat(V8I32, 2 * sh)) if sh else x[L]
                    _store(builder, base, 256 * L + 32 * (4 * h + sh), builder.and_(v, three))
        dw = ir.Constant(V8F32, ir.Undefined)
        for j, blk in enumerate(blks):
            dw = builder.insert_element(dw, _half(builder, blk, _D_AT), ir.Constant(I32, j))
        _store(builder, base, _DW, dw)
        return []

    _loop(builder, nb, [], block)


def _tile(context, builder, sig, args, scratch, r0, t0, tile: int):
    """out[t0..t0+tile, r0..r0+8] from the decoded group."""
    _, _, aq_, ad_, bs_, nb_, _, _, out_ = args
    aqty, adty, bsty, oty = sig.args[2], sig.args[3], sig.args[4], sig.args[8]
    ts = [builder.add(t0, ir.Constant(I64, k)) for k in range(tile)]
    arows = [_row(context, builder, aqty, aq_, t) for t in ts]
    drows = [_row(context, builder, adty, ad_, t) for t in ts]
    bsrows = [_row(context, builder, bsty, bs_, t) for t in ts]
    ones = _splat(V16I16, 1)
    lanes = {}

    for L in _LANE_ORDER:

        def block(b, accs, L=L):
            base = builder.gep(scratch, [builder.mul(b, ir.Constant(I64, SCRATCH_PER_BLOCK))])
            aoff = builder.add(builder.mul(b, ir.Constant(I64, 256)), ir.Constant(I64, 4 * L))
            s16 = [None] * tile
            for c in range(8):
                w = _load(builder, base, 256 * L + 32 * c, V32I8)
                for k, arow in enumerate(arows):
                    a = _load(builder, arow, builder.add(aoff, ir.Constant(I64, 32 * c)), I32)
                    p = _maddubs(builder, w, builder.bitcast(_broadcast(builder, a, V8I32), V32I8))
                    s16[k] = p if s16[k] is None else builder.add(s16[k], p)
            dw = _load(builder, base, _DW, V8F32)
            boff = builder.add(builder.mul(b, ir.Constant(I64, 32)), ir.Constant(I64, 4 * L))
            out = []
            for k in range(tile):
                bs = builder.bitcast(_broadcast(builder, _load(builder, bsrows[k], boff, I32), V8I32), V16I16)
                i32 = _madd(builder, builder.sub(s16[k], bs), ones)
                da = _load(builder, drows[k], builder.mul(b, ir.Constant(I64, 4)), F32)
                d = builder.fmul(_broadcast(builder, da, V8F32), dw)  # fl(d_a * d_w), the vec_dot's order
                out.append(_fma(builder, builder.sitofp(i32, V8F32), d, accs[k]))
            return out

        lanes[L] = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)] * tile, block)
    for k, t in enumerate(ts):
        r = [builder.fadd(lanes[i + 4][k], lanes[i][k]) for i in range(4)]  # hsum_float_8: x_{i+4} + x_i
        y = builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))
        _store(builder, _row(context, builder, oty, out_, t), builder.mul(r0, ir.Constant(I64, 4)), y)


def _is(a, ndim: int, dtype) -> bool:
    return isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C" and a.dtype == dtype


@intrinsic
def tq2_0_group(typingctx, w, r0, aq, ad, bsums, nb, T, scratch, out):
    """(w, r0, aq, ad, bsums, nb, T, scratch, out) -> None: out[t, r0..r0+8] for every t < T, `tq2_0_dot`'s
    values; w u8 (rows, nb * 66), aq int8 (T, 256 nb), ad f32 (T, nb), bsums int16 (T, 16 nb), out f32 (T, rows),
    scratch u8 of at least nb * SCRATCH_PER_BLOCK."""
    arrays = (
        (w, 2, types.uint8),
        (aq, 2, types.int8),
        (ad, 2, types.float32),
        (bsums, 2, types.int16),
        (out, 2, types.float32),
        (scratch, 1, types.uint8),
    )
    if not (all(_is(a, n, dt) for a, n, dt in arrays) and all(isinstance(i, types.Integer) for i in (r0, nb, T))):
        return None
    sig = types.void(w, types.int64, aq, ad, bsums, types.int64, types.int64, scratch, out)

    def codegen(context, builder, signature, args):
        w_, r0_, _, _, _, nb_, T_, scratch_, _ = args
        sa = context.make_array(signature.args[7])(context, builder, scratch_)
        buf = builder.bitcast(sa.data, I8.as_pointer())
        _decode_group(context, builder, signature.args[0], w_, r0_, nb_, buf)
        full = builder.sdiv(T_, ir.Constant(I64, TILE))

        def tiles(i, _):
            _tile(context, builder, signature, args, buf, r0_, builder.mul(i, ir.Constant(I64, TILE)), TILE)
            return []

        _loop(builder, full, [], tiles)
        done = builder.mul(full, ir.Constant(I64, TILE))
        rest = builder.sub(T_, done)
        for n in range(1, TILE):  # the T % TILE rows left over: one tile of their count
            with builder.if_then(builder.icmp_signed("==", rest, ir.Constant(I64, n))):
                _tile(context, builder, signature, args, buf, r0_, done, n)
        return context.get_dummy_value()

    return sig, codegen


# `tq2_0_dot`'s steps for one weight row (`int8ir_ternary_rows`: importing `int8ir_ternary` here would be circular
# once its `_mv_tq2_0` calls this module)
_one_row = tq_rows("tq2_0", 1)


@jit(parallel=True)
def mv_tq2_0_rows(nt, w, aq, ad, bsums, out):
    """`int8ir_ternary._mv_tq2_0`'s product for any T (faster from T = 4): groups of eight weight rows in
    parallel, the last group starting at rows - 8 (recomputing a few rows, the same bits); under eight weight
    rows, `tq2_0_dot`'s steps per (row, activation row)."""
    previous = use_threads(nt)
    T = aq.shape[0]
    nb = aq.shape[1] // 256
    rows = w.shape[0]
    if rows < ROWS:
        for r in prange(rows):
            for t in range(T):
                out[t, r] = _one_row(w, r, aq, t, ad, bsums, nb)[0]
    else:
        for g in prange((rows + ROWS - 1) // ROWS):
            scratch = np.empty(nb * SCRATCH_PER_BLOCK, np.uint8)
            tq2_0_group(w, min(ROWS * g, rows - ROWS), aq, ad, bsums, nb, T, scratch, out)
    use_threads(previous)
