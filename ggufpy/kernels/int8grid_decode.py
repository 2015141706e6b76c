"""The grid types' one-row (decode, T = 1) kernels in the llamacpp numerics, in fewer instructions than
`int8ir_iqgrid.grid_dot`: the driver `staged_dot` that IQ2_XS, IQ1_M, IQ1_S and IQ3_S share
(`int8grid_iq2xs.py`, `int8grid_iq1.py`, `int8grid_iq3s.py`), after `int8grid_iq2s.iq2_s_dot`.

    for each chunk of CHUNK super-blocks:
        stage(blk, at)          per block, vector code: what its sub-blocks need (grid indices, sign bytes,
                                scales, d_w) into a stack buffer, `PREFETCH` bytes of the row prefetched ahead
        dot(blk, at, ablk, ...) per block: eight sub-blocks' `vpmaddubsw` + `vpmaddwd` from the staged values
                                (each index a plain load: no `vpextrw`), then the replay's f32 steps

Staging a chunk before its dots overlaps the cache misses of its blocks (IQ2_S: 0.65x the time per token against
0.78x decoding each block just before its dot); the prefetch was measured within noise here (0.98-1.00x of no
prefetch on the bench model's products) and is kept for the DRAM-bound case (NVFP4, `int8ir_nvfp4.PREFETCH`).
The integers are the replay's lanes (lane j: elements 4j..4j+3 of each sub-block times its scale; exact), the f32
steps are `grid_dot`'s: acc = fma(fl(d_a * d_w), float(lanes), acc) per super-block, y = c * hsum_float_8(acc)
(+ the IQ1 delta part).

Measured (one thread, CPU time; old = `grid_dot`, alternating in one process; load average 2-5 on 2 cores): the
products of the 8-layer bench models (`types-*-d1024-f2816-l8.gguf`, every matrix once) 0.69-0.71x (IQ2_XS),
0.62-0.67x (IQ1_M), 0.69x (IQ1_S), 0.70-0.71x (IQ3_S); per decoded token 0.70-0.76x.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .int8ir import (
    I8,
    I16,
    I32,
    I64,
    V8I32,
    V16I16,
    V32I8,
    _broadcast,
    _fn,
    _load,
    _loop,
    _row,
    _shuffle,
    _signature,
    _splat,
)

__all__ = ["CHUNK", "PREFETCH", "nibble_scales", "signs_at", "spread_bytes", "spread_scales", "staged_dot", "vpshufb"]

# Super-blocks staged (into the stack) before their dots.
CHUNK = 16
# Bytes ahead of the block being staged that each block prefetches (a token streams every weight from DRAM once).
PREFETCH = 2048

_ARGS = (types.uint8, int, types.int8, int, types.float32, types.int16, int)


def vpshufb(builder, table, idx):
    """`vpshufb`: byte j of each 128-bit half = table[idx[j] & 15] of that half (0 where idx[j] < 0)."""
    fn = _fn(builder, "llvm.x86.avx2.pshuf.b", V32I8, [V32I8, V32I8])
    return builder.call(fn, [table, idx])


def _prefetch(builder, ptr):
    """`prefetcht0` of the line at ptr (never faults: past the weight's end it is dropped)."""
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    builder.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _opaque(builder, ptr):
    """An empty asm that may read or write *ptr: the staged values are read back as loads (LLVM would otherwise
    forward the stored vectors and extract each index with `vpextrw`, the cost this staging removes)."""
    fnty = ir.FunctionType(ir.VoidType(), [ptr.type])
    builder.asm(fnty, "", "r,~{memory}", [ptr], side_effect=True)


def spread_bytes(builder, at, offset):
    """<32 x i8>: byte j = the byte at at + offset + j // 8 (a broadcast load and one in-lane `vpshufb`)."""
    word = _broadcast(builder, _load(builder, at, offset, I32), V8I32)
    return vpshufb(builder, builder.bitcast(word, V32I8), ir.Constant(V32I8, [j // 8 for j in range(32)]))


def signs_at(builder, at, offset):
    """`vpsignb`'s operand for one sub-block from its four sign bytes at at + offset (bit j % 8 of byte j // 8
    set: element j negated): the bytes broadcast (a load) and spread in-lane (one `vpshufb`); (byte & bit) + 127
    is negative exactly where the bit is set and never 0 (ggml: compare, or with 1)."""
    spread = spread_bytes(builder, at, offset)
    bit = ir.Constant(V32I8, [1 << (j % 8) if j % 8 < 7 else -128 for j in range(32)])
    return builder.add(builder.and_(spread, bit), _splat(V32I8, 127))


def spread_scales(builder, scales, ib):
    """Sub-block ib's `vpmaddwd` operand from a block's <16 x i16> scales (word k: elements 32k..32k+15, word
    8 + k: 32k+16..32k+31): word ib of the low 128-bit half, word 8 + ib of the high (in-lane: one `vpshufb`)."""
    return _shuffle(builder, scales, scales, [ib] * 8 + [8 + ib] * 8)


def nibble_scales(builder, fields, bits: int = 4, mask: int = 15):
    """<8 x i8> of two `bits`-bit scales per byte (low: elements 32k..32k+15, high: the next 16) -> the <16 x i16>
    2 s + 1 that `spread_scales` reads."""
    v8i16 = ir.VectorType(I16, 8)
    sc = builder.zext(fields, v8i16)
    lo = builder.and_(sc, _splat(v8i16, mask))
    hi = builder.and_(builder.lshr(sc, _splat(v8i16, bits)), _splat(v8i16, mask))
    s = _shuffle(builder, lo, hi, list(range(16)))
    return builder.add(builder.shl(s, _splat(V16I16, 1)), _splat(V16I16, 1))


def staged_dot(block_bytes: int, stage_bytes: int, stage, dot, init, finish, sums: int = 16):
    """Intrinsic (w, r, aq, t, ad, bsums, nb, grid) -> f32: weight row r of w (u8 (rows, nb * block_bytes)) times
    Q8_K activation row t (aq int8 (T, 256 nb), ad f32 (T, nb), bsums int16 (T, sums * nb): the Q8_K bsums, or
    other per-block activation sums a type's kernel computes once per row).

        stage(builder, blk, at, gtab)                         stage_bytes (a multiple of 32) at `at` (32-byte
                                                              aligned) for the block
        dot(builder, blk, at, ablk, bsblk, da, gtab, accs)    -> the accumulators after this block
        init() -> the accumulators' initial values;  finish(builder, accs) -> the f32 result
    """

    @intrinsic
    def kernel(typingctx, w, r, aq, t, ad, bsums, nb, grid):
        sig = _signature((w, r, aq, t, ad, bsums, nb), _ARGS)
        if sig is None or not (isinstance(grid, types.Array) and grid.ndim == 1 and grid.layout == "C"):
            return None
        sig = types.float32(*sig.args, grid)

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t_, ad_, bs_, nb_, grid_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            bsrow = _row(context, builder, signature.args[5], bs_, t_)
            gtab = builder.bitcast(context.make_array(signature.args[7])(context, builder, grid_).data, I8.as_pointer())
            buf = cgutils.alloca_once(builder, V32I8, size=CHUNK * stage_bytes // 32)  # 32-byte aligned
            buf = builder.bitcast(buf, I8.as_pointer())

            def block_at(b):
                return builder.gep(wrow, [builder.mul(b, ir.Constant(I64, block_bytes))])

            def stage_at(j):
                return builder.gep(buf, [builder.mul(j, ir.Constant(I64, stage_bytes))])

            def chunk(c, carried):
                first = builder.mul(c, ir.Constant(I64, CHUNK))
                rest = builder.sub(nb_, first)
                small = builder.icmp_signed("<", rest, ir.Constant(I64, CHUNK))
                n = builder.select(small, rest, ir.Constant(I64, CHUNK))

                def prepare(j, _):
                    blk = block_at(builder.add(first, j))
                    _prefetch(builder, builder.gep(blk, [ir.Constant(I64, PREFETCH)]))
                    stage(builder, blk, stage_at(j), gtab)
                    return []

                _loop(builder, n, [], prepare)
                _opaque(builder, buf)

                def body(j, accs):
                    b = builder.add(first, j)
                    ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
                    bsblk = builder.gep(bsrow, [builder.mul(b, ir.Constant(I64, 2 * sums))])
                    da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), ir.FloatType())
                    return dot(builder, block_at(b), stage_at(j), ablk, bsblk, da, gtab, list(accs))

                return _loop(builder, n, carried, body)

            chunks = builder.sdiv(builder.add(nb_, ir.Constant(I64, CHUNK - 1)), ir.Constant(I64, CHUNK))
            return finish(builder, _loop(builder, chunks, init(), chunk))

        return sig, codegen

    return kernel
