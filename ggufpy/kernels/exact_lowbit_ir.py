"""LLVM IR of the exact numerics' low-bit products (`exact_lowbit.py`): each block decoded in registers straight to
its f32 weights, then multiply-added with the f32 activations. (MXFP4 and NVFP4: `exact_fp4_ir.py`.)

Every format is decoded 8 elements (one `<8 x float>`, a "chunk") at a time, in 32-bit lanes: the chunk's code
bytes zero-extended (`vpmovzxbd` from memory), the code moved to the low bits by a shift, and the weight read
from an 8-entry table of the block's weights with `vpermps`, which looks at the low 3 bits of
each lane only:

    TQ2_0   table d * [-1, 0, 1, 2, -1, 0, 1, 2]        index: qs as 8 dwords >> (8s + 2l), no byte spread: a chunk
                                                        holds elements 4i + s of 32, the activations `strided`
    TQ1_0   table d * [-1, 0, 1, ...]                   index: the base-3 digit ((u8)(q 3^k) 3) >> 8, formed as
                                                        t' = 3t, digit = t' >> 8, t = t' & 255 per power
    Q1_0    select(bit, d, -d)                          the sign byte's bits shifted to bit 31 (`vpsllvd`)

Each table entry is fl(scale * value), the reference's single rounding (`quants/lowbit.py` `scaled`), so every
weight equals the reference dequantizer's. The products then differ from `x @ dequantize(W).T` in f32 summation
order only: chunk c of a row goes to accumulator c % ACC (`acc = fma(x, w, acc)`), in increasing c; at the row's
end a0 + a1 and `hsum_float_8`'s order.

`row_dot(n)` decodes n weight rows side by side for one activation row. For 2+ activation rows the same decoders
write two weight rows into a scratch (`row_decode`: decoded once for all activation rows) and `scratch_dot(2, m)`
dots them with m activation rows at a time: the same chunks into the same accumulators in the same order, so each
activation row's result is bit for bit its one-row result. The intrinsics take the format's `kind` (an index into
`FORMATS`) at run time and branch once per call (a switch over the registry).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..constants import GGMLType
from .int8ir import F32, F32T, I8, I32, I64, U8, V8F32, _broadcast, _fma, _fn, _half, _load, _loop, _row, _splat

__all__ = ["ACC", "FORMATS", "KINDS", "row_decode", "row_dot", "scratch_dot"]

# Accumulators per (weight row, activation row). The FMA latency (4 cycles, 2 per cycle) wants 8 chains: one-row
# products get them from weight rows side by side (`Format.rows`), the scratch dot from a tile of 2 weight rows x
# 3 activation rows (12 accumulators of the 16 registers).
ACC = 2
PIECE = 4  # chunks per step of the decoders' loops
V8I8, V8I32 = ir.VectorType(I8, 8), ir.VectorType(I32, 8)


def _permps(builder, table, idx):
    return builder.call(_fn(builder, "llvm.x86.avx2.permps", V8F32, [V8F32, V8I32]), [table, idx])


def _dwords(builder, blk, at):
    """The 8 bytes at blk + at, each zero-extended to a 32-bit lane (`vpmovzxbd` from memory)."""
    return builder.zext(_load(builder, blk, at, V8I8), V8I32)


def _table(builder, values, scale):
    """<8 x float> fl(values[i] * scale): the weights a code can take (the reference's `value * scale`)."""
    return builder.fmul(ir.Constant(V8F32, [float(v) for v in values]), _broadcast(builder, scale, V8F32))


# -- decoders ----------------------------------------------------------------------------------------------------
# decode(builder, blks, carried, consume) -> carried: for the blocks at the pointers blks (one per weight row,
# decoded side by side), calls consume(carried, row, chunk, slot, w) for every chunk of each block, chunks in
# increasing order (chunk: the i64 index in the block, an ir.Value or int; slot = chunk % ACC, known when the IR is
# built). Formats with many chunks run pieces of PIECE chunks in a loop: unrolled, LLVM's scheduler hoisted every
# decode above the FMAs and spilled the weights to the stack (~1.3x the time).
# Block layouts: the diagrams above the reference unpackers in quants/lowbit.py.
def _i64(builder, v):
    return v if isinstance(v, ir.Value) else ir.Constant(I64, v)


def _chunk(builder, piece, j):
    return builder.add(builder.mul(piece, ir.Constant(I64, PIECE)), ir.Constant(I64, j))


def _tq2_0(builder, blks, carried, consume):
    """block_tq2_0: bits 2l..2l+1 of qs[32h + m] -> element 128h + 32l + m. The 32 bytes of a half h are loaded as
    8 lanes (lane i: qs[32h + 4i + s] in bits 8s..8s+7), so chunk 16h + 4l + s is (lanes >> (8s + 2l)): elements
    128h + 32l + 4i + s, the activations' strided order (`Format.strided`). No byte-to-lane spread per chunk:
    `vpmovzxbd` and `vpermps` both take the one shuffle port (measured 1.3-1.4x the time with them)."""
    tables = [_table(builder, [-1, 0, 1, 2] * 2, _half(builder, blk, 64)) for blk in blks]

    def piece(h, carried):
        at = builder.mul(h, ir.Constant(I64, 32))
        lanes = [_load(builder, blk, at, V8I32) for blk in blks]
        for ll in range(4):
            for s in range(PIECE):
                chunk = builder.add(builder.mul(h, ir.Constant(I64, 16)), ir.Constant(I64, 4 * ll + s))
                for rr, (v, table) in enumerate(zip(lanes, tables, strict=True)):
                    idx = builder.lshr(v, _splat(V8I32, 8 * s + 2 * ll)) if s or ll else v
                    carried = consume(carried, rr, chunk, s % ACC, _permps(builder, table, idx))
        return carried

    return _loop(builder, ir.Constant(I64, 2), carried, piece)


def _digits(builder, t):
    """(digit, next t): the top base-3 digit of the fixed-point byte t, (3t) >> 8, and 3t mod 256."""
    u = builder.add(t, builder.shl(t, _splat(V8I32, 1)))
    return builder.lshr(u, _splat(V8I32, 8)), builder.and_(u, _splat(V8I32, 255))


def _tq1_0(builder, blks, carried, consume):
    """block_tq1_0: digit k of qs[m] -> element 32k + m (m < 32), of qs[32 + m] -> 160 + 16k + m, of qh[m] ->
    240 + 4k + m (`lowbit.parts_tq1_0`)."""
    tables = [_table(builder, [-1, 0, 1, 0, 0, 0, 0, 0], _half(builder, blk, 52)) for blk in blks]
    n = len(carried)

    def piece(k, state):  # digit k of qs[0:32]: chunks 4k + j
        carried, t = state[:n], list(state[n:])
        for j in range(PIECE):
            for rr, table in enumerate(tables):
                digit, t[PIECE * rr + j] = _digits(builder, t[PIECE * rr + j])
                carried = consume(carried, rr, _chunk(builder, k, j), j % ACC, _permps(builder, table, digit))
        return list(carried) + t

    t = [_dwords(builder, blk, 8 * j) for blk in blks for j in range(PIECE)]
    carried = _loop(builder, ir.Constant(I64, 5), list(carried) + t, piece)[:n]
    for rr, (blk, table) in enumerate(zip(blks, tables, strict=True)):
        t = [_dwords(builder, blk, 32 + 8 * j) for j in range(2)]
        for k in range(5):  # digit k of qs[32:48]: chunks 20 + 2k + j
            for j in range(2):
                digit, t[j] = _digits(builder, t[j])
                c = 20 + 2 * k + j
                carried = consume(carried, rr, c, c % ACC, _permps(builder, table, digit))
        qh = _load(builder, blk, 48, ir.VectorType(I8, 4))
        qh8 = builder.zext(builder.shuffle_vector(qh, qh, ir.Constant(V8I32, [0, 1, 2, 3] * 2)), V8I32)
        for c, (p0, p1) in ((30, (1, 3)), (31, (9, 27))):  # lanes 0-3: digit k of qh[0..3], lanes 4-7: digit k + 1
            t8 = builder.and_(builder.mul(qh8, ir.Constant(V8I32, [p0] * 4 + [p1] * 4)), _splat(V8I32, 255))
            carried = consume(carried, rr, c, c % ACC, _permps(builder, table, _digits(builder, t8)[0]))
    return carried


def _q1_0(builder, blks, carried, consume):
    """block_q1_0: fp16 d at 0; bit j % 8 of qs[j // 8] (at 2) set: element j is d, else -d."""
    ds = [_half(builder, blk, 0) for blk in blks]
    signs = [(_broadcast(builder, d, V8F32), _broadcast(builder, builder.fneg(d), V8F32)) for d in ds]

    def piece(k, carried):  # the 32 sign bits of qs[4k:4k+4]: chunks 4k + j
        at = builder.add(builder.mul(k, ir.Constant(I64, 4)), ir.Constant(I64, 2))
        words = [_broadcast(builder, _load(builder, blk, at, I32), V8I32) for blk in blks]
        for j in range(PIECE):
            for rr, (word, (plus, minus)) in enumerate(zip(words, signs, strict=True)):
                at_31 = builder.shl(word, ir.Constant(V8I32, [31 - 8 * j - i for i in range(8)]))
                bit = builder.icmp_signed("<", at_31, _splat(V8I32, 0))
                carried = consume(carried, rr, _chunk(builder, k, j), j % ACC, builder.select(bit, plus, minus))
        return carried

    return _loop(builder, ir.Constant(I64, 4), carried, piece)


class Format:
    """One format's block: bytes, elements, the decoder of its chunks, and how many weight rows `row_dot` may
    decode side by side (TQ1_0: 1, its base-3 state of 4 vectors per row would spill)."""

    def __init__(self, block_bytes: int, block_size: int, decode, rows: int, strided: bool = False):
        self.block_bytes, self.block_size, self.decode, self.rows = block_bytes, block_size, decode, rows
        self.strided = strided  # chunk 4g + s holds elements 32g + 4i + s (i = lane): activations `strided` first


FORMATS = {
    GGMLType.TQ1_0: Format(54, 256, _tq1_0, rows=2),
    GGMLType.TQ2_0: Format(66, 256, _tq2_0, rows=2, strided=True),
    GGMLType.Q1_0: Format(18, 128, _q1_0, rows=2),
}
KINDS = {t: k for k, t in enumerate(FORMATS)}
"""GGML type -> the `kind` argument of the intrinsics."""


# -- the intrinsics -----------------------------------------------------------------------------------------------
def _switch(builder, kind, case, result_type=None, formats=None):
    """Emit case(format) for the format numbered `kind` (a run-time i64) of `formats` (default: `FORMATS`);
    returns the result's phi, if any."""
    done = builder.append_basic_block("exact.done")
    default = builder.append_basic_block("exact.default")
    sw = builder.switch(kind, default)
    incoming = []
    for k, f in enumerate((FORMATS if formats is None else formats).values()):
        bb = builder.append_basic_block(f"exact.kind{k}")
        sw.add_case(ir.Constant(I64, k), bb)
        builder.position_at_end(bb)
        value = case(f)
        incoming.append((value, builder.block))
        builder.branch(done)
    builder.position_at_end(default)  # an unknown kind: no result (the Python side passes only KINDS' values)
    builder.branch(done)
    builder.position_at_end(done)
    if result_type is None:
        return None
    phi = builder.phi(result_type)
    for value, bb in incoming:
        phi.add_incoming(value, bb)
    phi.add_incoming(ir.Constant(result_type, 0.0 if result_type == F32 else 64), default)  # (64: a whole group done)
    return phi


def _reduce(builder, accs):
    """The row's sum: the ACC accumulators pairwise, then the 8 lanes as `hsum_float_8` adds them."""
    while len(accs) > 1:
        accs = [builder.fadd(accs[i], accs[i + 1]) for i in range(0, len(accs), 2)]
    s = accs[0]
    x = [builder.extract_element(s, ir.Constant(I32, i)) for i in range(8)]
    r = [builder.fadd(x[i + 4], x[i]) for i in range(4)]
    return builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))


def _check(args, dtypes):
    for a, dt in zip(args, dtypes, strict=True):
        if dt is int:
            if not isinstance(a, types.Integer):
                return False
        elif not (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == dt):
            return False
    return True


def _at(builder, base, elements):
    """i8* to f32 element `elements` (an i64 ir.Value) of the row at `base`."""
    return builder.gep(base, [builder.mul(elements, ir.Constant(I64, 4))])


def row_dot(rows: int):
    """Intrinsic (kind, q u8 (R, row bytes), r, xv f32 (T, cols), t, nb, out f32 (T, R)) -> int: out[t, r + i] =
    weight row r + i (nb blocks) times activation row t for i < n, decoded in registers; returns n = `rows`, or
    1 for formats whose decode state fills the registers (`Format.rows`). Rows side by side give 4 FMA chains
    per row more to overlap (one row alone waits on the FMA latency), each row's operations unchanged."""

    @intrinsic
    def dot(typingctx, kind, q, r, xv, t, nb, out):
        if not _check((kind, q, r, xv, t, nb, out), (int, U8, int, F32T, int, int, F32T)):
            return None

        def codegen(context, builder, signature, args):
            kind_, q_, r_, xv_, t_, nb_, out_ = args
            xrow = _row(context, builder, signature.args[3], xv_, t_)
            orow = _row(context, builder, signature.args[6], out_, t_)

            def case(f):
                n = min(rows, f.rows)
                rs = [builder.add(r_, ir.Constant(I64, i)) for i in range(n)]
                qrows = [_row(context, builder, signature.args[1], q_, ri) for ri in rs]

                def body(b, accs):
                    blks = [builder.gep(qrow, [builder.mul(b, ir.Constant(I64, f.block_bytes))]) for qrow in qrows]
                    xblk = _at(builder, xrow, builder.mul(b, ir.Constant(I64, f.block_size)))

                    def consume(accs, rr, chunk, slot, w):
                        x = _load(builder, xblk, builder.mul(_i64(builder, chunk), ir.Constant(I64, 32)), V8F32)
                        accs = list(accs)
                        accs[ACC * rr + slot] = _fma(builder, x, w, accs[ACC * rr + slot])
                        return accs

                    return list(f.decode(builder, blks, list(accs), consume))

                accs = _loop(builder, nb_, [_splat(V8F32, 0.0)] * (ACC * n), body)
                for i, ri in enumerate(rs):
                    y = _reduce(builder, accs[ACC * i : ACC * i + ACC])
                    builder.store(y, builder.bitcast(_at(builder, orow, ri), F32.as_pointer()))
                return ir.Constant(I64, n)

            return _switch(builder, kind_, case, I64)

        return types.int64(types.int64, q, types.int64, xv, types.int64, types.int64, out), codegen

    return dot


@intrinsic
def row_decode(typingctx, kind, q, r, w, i, nb):
    """(kind, q, r, w f32 (R, cols), i, nb): the weights of row r into w[i], as `row_dot` computes them."""
    if not _check((kind, q, r, w, i, nb), (int, U8, int, F32T, int, int)):
        return None

    def codegen(context, builder, signature, args):
        kind_, q_, r_, w_, i_, nb_ = args
        qrow = _row(context, builder, signature.args[1], q_, r_)
        wrow = _row(context, builder, signature.args[3], w_, i_)

        def case(f):
            def body(b, carried):
                blk = builder.gep(qrow, [builder.mul(b, ir.Constant(I64, f.block_bytes))])
                wblk = _at(builder, wrow, builder.mul(b, ir.Constant(I64, f.block_size)))

                def consume(carried, rr, chunk, slot, w):
                    at = builder.gep(wblk, [builder.mul(_i64(builder, chunk), ir.Constant(I64, 32))])
                    builder.store(w, builder.bitcast(at, V8F32.as_pointer()), align=4)
                    return carried

                f.decode(builder, [blk], [], consume)
                return []

            _loop(builder, nb_, [], body)

        _switch(builder, kind_, case)
        return context.get_dummy_value()

    return types.none(types.int64, q, types.int64, w, types.int64, types.int64), codegen


def scratch_dot(rows: int, acts: int):
    """Intrinsic (w f32 (rows, cols), xv f32 (T, cols), t0, out f32 (T, R), r): out[t0 + j, r + i] = w[i] . xv[t0 + j]
    for i < rows, j < acts, each with `row_dot`'s accumulators and order (cols a multiple of 8 ACC)."""

    @intrinsic
    def dot(typingctx, w, xv, t0, out, r):
        if not _check((w, xv, t0, out, r), (F32T, F32T, int, F32T, int)):
            return None

        def codegen(context, builder, signature, args):
            w_, xv_, t0_, out_, r_ = args
            wrows = [_row(context, builder, signature.args[0], w_, ir.Constant(I64, i)) for i in range(rows)]
            ts = [builder.add(t0_, ir.Constant(I64, j)) for j in range(acts)]
            xrows = [_row(context, builder, signature.args[1], xv_, t) for t in ts]
            cols = builder.extract_value(context.make_array(signature.args[1])(context, builder, xv_).shape, 1)

            def body(step, accs):
                at = [
                    builder.add(builder.mul(step, ir.Constant(I64, 32 * ACC)), ir.Constant(I64, 32 * c))
                    for c in range(ACC)
                ]
                ws = [[_load(builder, wrow, a, V8F32) for a in at] for wrow in wrows]
                accs = list(accs)
                for j, xrow in enumerate(xrows):
                    for c, a in enumerate(at):
                        x = _load(builder, xrow, a, V8F32)
                        for i in range(rows):
                            k = ACC * (acts * i + j) + c
                            accs[k] = _fma(builder, x, ws[i][c], accs[k])
                return accs

            steps = builder.sdiv(cols, ir.Constant(I64, 8 * ACC))
            accs = _loop(builder, steps, [_splat(V8F32, 0.0)] * (ACC * rows * acts), body)
            for j, t in enumerate(ts):
                orow = _row(context, builder, signature.args[3], out_, t)
                for i in range(rows):
                    k = ACC * (acts * i + j)
                    y = _reduce(builder, accs[k : k + ACC])
                    at = _at(builder, orow, builder.add(r_, ir.Constant(I64, i)))
                    builder.store(y, builder.bitcast(at, F32.as_pointer()))
            return context.get_dummy_value()

        return types.none(w, xv, types.int64, out, types.int64), codegen

    return dot
