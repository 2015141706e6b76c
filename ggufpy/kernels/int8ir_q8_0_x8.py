"""Q8_0 weights in groups of eight rows that stream as one, with ggml's per-row vec_dot arithmetic (llamacpp numerics).

llama.cpp does not repack Q8_0 on x86 (repack.cpp `ggml_repack_get_optimal_repack_type` has Q8_0 layouts for
NEON and RISC-V only), so each output stays `ggml_vec_dot_q8_0_q8_0` (arch/x86/quants.c; tinyBLAS from two
activation rows rounds alike, `quants/x86/llamafile.py`): eight f32 lanes per row,
acc = fma(d_w * d_a, float(lane sums), acc) per block, y = hsum_float_8(acc) -- exactly `int8ir.q0_dot("q8_0",
lanes=True)`. What changes here is only where the bytes sit. The row kernel's one FMA chain per row waits on
its own latency every block; eight rows side by side give eight independent chains over one forward stream
(the layout below; `int8dot.interleaved` copies it once, 1.0x the file's bytes, and releases the file pages),
and from four activation rows on each weight block is loaded once for four. Measured on one thread (CPU time,
the 48 attention weights of the gpt-oss bench model, 134 MB, past the L3): T = 1 11.8 ms against the rows'
12.8 (both at about a plain read's 11.5 GB/s: a decode step is memory-bound), T = 8 35.5 against 52.1 ms.

One block of eight rows (272 bytes = 8 * 34):

    bytes 0-15       d of rows 0..7 (fp16)
    bytes 16-47      qs of row 0 (32 int8)
    bytes 48-79      qs of row 1
    ...
    bytes 240-271    qs of row 7
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from ._numba import jit, prange, use_threads
from .int8ir import (
    F32,
    F32T,
    HALF,
    I8T,
    I32,
    I32T,
    I64,
    U8,
    V8F32,
    V16I16,
    V32I8,
    _broadcast,
    _fma,
    _hsum_float_8,
    _load,
    _loop,
    _madd,
    _maddubs,
    _psign,
    _row,
    _shuffle,
    _splat,
)
from .int8ir_x8 import _signature8, _store8
from .layout import release_pages

__all__ = ["Q8_0X8_BYTES", "interleave_q8_0", "q8_0x8_dot", "q8_0x8_kernel"]

Q8_0_BYTES = 34
Q8_0X8_BYTES = 8 * Q8_0_BYTES
_CHUNK = 256  # groups copied between two releases of file pages: the copy's source is never resident whole


def interleave_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 GGUF rows u8 (rows, nb * 34), rows % 8 == 0 -> the eight-row groups u8 (rows / 8, nb * 272); the
    file pages of each chunk of rows are released once it is copied (`layout.release_pages`)."""
    rows, row_bytes = raw.shape
    G, nb = rows // 8, row_bytes // Q8_0_BYTES
    out = np.empty((G, nb * Q8_0X8_BYTES), np.uint8)
    words = raw.view(np.uint16).reshape(G, 8, nb, Q8_0_BYTES // 2)  # (group, row in group, block, d + 16 qs words)
    grouped = out.view(np.uint16).reshape(G, nb, Q8_0X8_BYTES // 2)
    for g0 in range(0, G, _CHUNK):
        g1 = min(G, g0 + _CHUNK)
        src = words[g0:g1]
        grouped[g0:g1, :, :8] = src[..., 0].transpose(0, 2, 1)  # (g, nb, 8): the eight d
        grouped[g0:g1, :, 8:].reshape(g1 - g0, nb, 8, 16)[:] = src[..., 1:].transpose(0, 2, 1, 3)
        release_pages(raw[8 * g0 : 8 * g1])
    return out


def _abs_and_sign(builder, w):
    """(|w| as u8, w): ggml's `mul_sum_i8_pairs` multiplies |w| by the activations with w's sign
    (`vpsignb`), as `int8ir._q0_codes` does for a Q8_0 row."""
    neg = builder.icmp_signed("<", w, _splat(V32I8, 0))
    return builder.select(neg, builder.sub(_splat(V32I8, 0), w), w), w


def q8_0x8_dot(n_act: int = 1):
    """Intrinsic (w, g, aq, t, ad, s, asum, nb, out): out[t:t+n_act, 8g:8g+8] for the group g of w u8 (rows / 8,
    nb * 272), row by row as `int8ir.q0_dot("q8_0", lanes=True)`: acc_i = fma(broadcast(fl(d_w,i * d_a)),
    float(lanes_i), acc_i), y_i = hsum_float_8(acc_i); each weight block's |w| loaded once for n_act rows."""

    @intrinsic
    def dot(typingctx, w, g, aq, t, ad, s, asum, nb, out):
        sig = _signature8((w, g, aq, t, ad, s, asum, nb, out), (U8, int, I8T, int, F32T, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            w_, g_, aq_, t_, ad_, _, _, nb_, out_ = args
            group = _row(context, builder, signature.args[0], w_, g_)
            ts = [builder.add(t_, ir.Constant(I64, i)) for i in range(n_act)]
            arows = [_row(context, builder, signature.args[2], aq_, t) for t in ts]
            drows = [_row(context, builder, signature.args[4], ad_, t) for t in ts]
            ones = _splat(V16I16, 1)

            def body(b, carried):
                blk = builder.gep(group, [builder.mul(b, ir.Constant(I64, Q8_0X8_BYTES))])
                codes = [_abs_and_sign(builder, _load(builder, blk, 16 + 32 * i, V32I8)) for i in range(8)]
                dw = builder.fpext(_load(builder, blk, 0, ir.VectorType(HALF, 8)), V8F32)
                new = []
                for k in range(n_act):
                    a = _load(builder, arows[k], builder.mul(b, ir.Constant(I64, 32)), V32I8)
                    da = _load(builder, drows[k], builder.mul(b, ir.Constant(I64, 4)), F32)
                    d = builder.fmul(dw, _broadcast(builder, da, V8F32))  # lane i: fl(d_w,i * d_a), exact
                    for i, (u, sign) in enumerate(codes):
                        isum = _madd(builder, _maddubs(builder, u, _psign(builder, a, sign)), ones)
                        di = _shuffle(builder, d, d, [i] * 8)
                        new.append(_fma(builder, di, builder.sitofp(isum, V8F32), carried[8 * k + i]))
                return new

            accs = _loop(builder, nb_, [ir.Constant(V8F32, [0.0] * 8)] * (8 * n_act), body)
            r0 = builder.mul(g_, ir.Constant(I64, 8))
            for k, t in enumerate(ts):
                y = ir.Constant(V8F32, ir.Undefined)
                for i in range(8):
                    y = builder.insert_element(y, _hsum_float_8(builder, accs[8 * k + i]), ir.Constant(I32, i))
                _store8(context, builder, signature, out_, t, r0, y)
            return context.get_dummy_value()

        return sig, codegen

    return dot


_X8 = q8_0x8_dot()
_X8X4 = q8_0x8_dot(4)


@jit(parallel=True)
def q8_0x8_kernel(nt, w, aq, ad, s, asum, out):
    """`int8dot`'s Q8_0 kernel contract for eight-row groups u8 (rows / 8, nb * 272): activation rows four at a
    time (each weight block's codes decoded once for the four; 32 accumulators: 1.25x two at a time at T = 8,
    2880 x 2048, one thread), the last T % 4 one by one."""
    previous = use_threads(nt)
    T = aq.shape[0]
    nb = aq.shape[1] // 32
    for g in prange(w.shape[0]):
        for t in range(0, T - T % 4, 4):
            _X8X4(w, g, aq, t, ad, s, asum, nb, out)
        for t in range(T - T % 4, T):
            _X8(w, g, aq, t, ad, s, asum, nb, out)
    use_threads(previous)
