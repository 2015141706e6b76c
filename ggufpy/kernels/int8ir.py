"""LLVM IR for ggml's integer block dot products (AVX2), as numba intrinsics: one weight row . one activation row.

ggml's x86 `vec_dot` kernels (ggml-cpu/arch/x86/quants.c) multiply weight codes by int8 activations with
`vpmaddubsw` (u8 x s8 -> pairs of s16) and `vpmaddwd` (pairs of s16 -> s32), then scale each block's integer
sums in f32. numba's own integer arithmetic widens to int64, so those instructions are written here in IR:

    p     = pmaddubsw(u, a)          u: the weight codes as u8 (or |w| with a's sign flipped, `vpsignb`)
    lanes = pmaddwd(p, s)            s: ones, or the sub-block scale of each pair; lane j sums elements 4j..4j+3

Each intrinsic below runs the whole loop over a row's blocks and returns its f32 result, with the f32
operations in the order of the ggml kernel that `ggufpy.quants.x86` replays for that type and shape (cited at
each builder), so that the result is bit for bit the replay's. The integer sums are exact (no `vpmaddubsw`
saturation: |u| <= 63 or 15 against |a| <= 128, or |w| <= 128 against |a| <= 127 for Q8_0's sign trick), so
only the f32 steps need to follow ggml, and they do: one rounding per `fma`, `fmul`, `fadd`, `sitofp`, no
fast-math flags (the calling kernels are compiled without `fast`).

Every intrinsic takes (w u8 (rows, row_bytes) C, r, aq int8 (T, C) C, t, ...): weight row r as stored in the
GGUF file, activation row t quantized by `int8dot.quantize`.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["q0_dot", "q4_k_dot", "q6_k_dot"]  # eight-row kernels: int8ir_x8.py

I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
F32, HALF = ir.FloatType(), ir.HalfType()
U8, I8T, I16T, I32T, F32T = types.uint8, types.int8, types.int16, types.int32, types.float32
V32I8, V16I8, V16I16, V8I32, V8F32 = (
    ir.VectorType(I8, 32),
    ir.VectorType(I8, 16),
    ir.VectorType(I16, 16),
    ir.VectorType(I32, 8),
    ir.VectorType(F32, 8),
)


def _signature(args, dtypes):
    """float32(args) when each argument is a C-contiguous 2-D array of its dtype (read-only allowed) or an
    integer where `dtypes` says int; None otherwise (numba then reports a typing error)."""
    for a, dt in zip(args, dtypes, strict=True):
        if dt is int:
            if not isinstance(a, types.Integer):
                return None
        elif not (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == dt):
            return None
    return types.float32(*(types.int64 if dt is int else a for a, dt in zip(args, dtypes, strict=True)))


# -- small IR helpers ---------------------------------------------------------------------------------------------
def _splat(ty: ir.VectorType, value: int | float) -> ir.Constant:
    return ir.Constant(ty, [value] * ty.count)


def _fn(builder, name: str, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _row(context, builder, arrty, arr, i) -> ir.Value:
    """i8* to the start of row i of a C-contiguous 2-D array."""
    a = context.make_array(arrty)(context, builder, arr)
    stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    return builder.gep(builder.bitcast(a.data, I8.as_pointer()), [builder.mul(i, stride)])


def _load(builder, base, offset, ty, align: int = 1) -> ir.Value:
    """A value of type `ty` at byte `offset` (an ir.Value or int) from the i8* `base`, unaligned."""
    off = offset if isinstance(offset, ir.Value) else ir.Constant(I64, offset)
    return builder.load(builder.bitcast(builder.gep(base, [off]), ty.as_pointer()), align=align)


def _half(builder, base, offset) -> ir.Value:
    """An fp16 field as f32 (`fpext half`: exact, `vcvtph2ps`)."""
    return builder.fpext(_load(builder, base, offset, HALF), F32)


def _maddubs(builder, u, a):
    return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8]), [u, a])


def _madd(builder, p, s):
    return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16]), [p, s])


def _fma(builder, a, b, c):
    suffix = "v8f32" if isinstance(a.type, ir.VectorType) else "f32"
    return builder.call(_fn(builder, f"llvm.fma.{suffix}", a.type, [a.type] * 3), [a, b, c])


def _broadcast(builder, x, ty: ir.VectorType):
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(
        v, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(I32, ty.count), [0] * ty.count)
    )


def _shuffle(builder, a, b, idx: list[int]):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(idx)), idx))


def _nibbles(builder, qs):
    """<16 x i8> -> <32 x i8>: the low nibbles (elements 0..15), then the high ones (16..31)."""
    lo = builder.and_(qs, _splat(V16I8, 15))
    hi = builder.lshr(qs, _splat(V16I8, 4))
    return _shuffle(builder, lo, hi, list(range(32)))


def _nibbles32(builder, qs):
    """<32 x i8> -> (low nibbles, high nibbles), each <32 x i8>."""
    return builder.and_(qs, _splat(V32I8, 15)), builder.lshr(qs, _splat(V32I8, 4))


def _hsum_i32(builder, v):
    """Sum of the 8 lanes (exact: integer)."""
    s = builder.add(_shuffle(builder, v, v, [4, 5, 6, 7, 0, 1, 2, 3]), v)
    s = builder.add(_shuffle(builder, s, s, [2, 3, 0, 1, 2, 3, 0, 1]), s)
    s = builder.add(_shuffle(builder, s, s, [1, 0, 1, 0, 1, 0, 1, 0]), s)
    return builder.extract_element(s, ir.Constant(I32, 0))


def _hsum_float_8(builder, v):
    """arch/x86/quants.c `hsum_float_8`: r_i = x_{i+4} + x_i, then (r0 + r2) + (r1 + r3)."""
    x = [builder.extract_element(v, ir.Constant(I32, i)) for i in range(8)]
    r = [builder.fadd(x[i + 4], x[i]) for i in range(4)]
    return builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))


def _loop(builder, n, init: list, body) -> list:
    """for i in range(n): carried = body(i, carried); returns the final carried values."""
    pre = builder.block
    head = builder.append_basic_block("int8.head")
    loop = builder.append_basic_block("int8.body")
    done = builder.append_basic_block("int8.done")
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


# -- the 32-element types with Q8_0 / Q8_1 activations ------------------------------------------------------------
# kind -> (block bytes, offset of qs, zero point (codes are q + zp), offset of qh (5th bits) or None, m offset)
Q0_KINDS = {
    "q4_0": (18, 2, 8, None, None),
    "q5_0": (22, 6, 16, 2, None),
    "q8_0": (34, 2, 0, None, None),
    "q4_1": (20, 4, 0, None, 2),
    "q5_1": (24, 8, 0, 4, 2),
}
_BITS = [1 << (i % 8) for i in range(32)]


def _q0_codes(builder, blk, kind):
    """Block -> (u <32 x i8> to multiply, a-operand transform): the codes as stored, unsigned, or for Q8_0
    (signed) |w| and the sign of w to put on the activations (ggml's `mul_sum_i8_pairs`)."""
    _, qs_at, _, qh_at, _ = Q0_KINDS[kind]
    if kind == "q8_0":
        w = _load(builder, blk, qs_at, V32I8)
        neg = builder.icmp_signed("<", w, _splat(V32I8, 0))
        return builder.select(neg, builder.sub(_splat(V32I8, 0), w), w), w
    u = _nibbles(builder, _load(builder, blk, qs_at, V16I8))
    if qh_at is not None:  # bit j of the u32 qh is bit 4 of element j (`bytes_from_bits_32`)
        qh = builder.bitcast(_load(builder, blk, qh_at, I32), ir.VectorType(I8, 4))
        spread = _shuffle(builder, qh, qh, [j // 8 for j in range(32)])
        bit = builder.icmp_unsigned("!=", builder.and_(spread, ir.Constant(V32I8, _BITS)), _splat(V32I8, 0))
        u = builder.or_(u, builder.select(bit, _splat(V32I8, 16), _splat(V32I8, 0)))
    return u, None


def _psign(builder, a, w):
    return builder.call(_fn(builder, "llvm.x86.avx2.psign.b", V32I8, [V32I8, V32I8]), [a, w])


def q0_dot(kind: str, lanes: bool):
    """Intrinsic (w, r, aq, t, ad, s, asum, nb) -> f32 for a 32-element type `kind` with Q8_0/Q8_1 activations.

    ad (T, nb) f32: the activation blocks' fp16 d; s (T, nb): Q8_1's fp16 s (Q4_1/Q5_1); asum int32 (T, nb*8):
    sums of 4 activation quants (lane sums), for the zero points of Q4_0/Q5_0 (codes q + zp: the dot is
    sum u*a - zp * sum a, exact).

    lanes=True: `ggml_vec_dot_{q4_0,q5_0,q8_0}_q8_0` / `tinyBLAS_Q0_AVX` / `ggml_vec_dot_q{4,5}_1_q8_1`
    (llamafile.py, legacy.py): acc_j = fma(d_w * d_a, lane_j, acc_j) per block, y = hsum_float_8(acc)
    (+ summs = sum of m_w * s_a in block order for Q4_1/Q5_1). lanes=False: the repacked Q4_0 gemv/gemm
    (repack_q8_0.py): acc = fma(float(block sum), d_w * d_a, acc), one lane per output."""
    size, _, zp, _, m_at = Q0_KINDS[kind]

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, s, asum, nb):
        sig = _signature((w, r, aq, t, ad, s, asum, nb), (U8, int, I8T, int, F32T, F32T, I32T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t_, ad_, s_, asum_, nb_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            srow = _row(context, builder, signature.args[5], s_, t_) if m_at is not None else None
            sumrow = _row(context, builder, signature.args[6], asum_, t_) if zp else None
            zero = ir.Constant(V8F32, [0.0] * 8) if lanes else ir.Constant(F32, 0.0)
            init = [zero, ir.Constant(F32, 0.0)]

            def body(b, carried):
                acc, summs = carried
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, size))])
                a = _load(builder, arow, builder.mul(b, ir.Constant(I64, 32)), V32I8)
                u, sign = _q0_codes(builder, blk, kind)
                p = _maddubs(builder, u, a if sign is None else _psign(builder, a, sign))
                isum = _madd(builder, p, _splat(V16I16, 1))  # lane j: elements 4j..4j+3
                if zp:
                    asums = _load(builder, sumrow, builder.mul(b, ir.Constant(I64, 32)), V8I32)
                    isum = builder.sub(isum, builder.mul(asums, _splat(V8I32, zp)))
                da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                d = builder.fmul(_half(builder, blk, 0), da)  # fp16 * fp16: exact in f32
                if lanes:
                    acc = _fma(builder, _broadcast(builder, d, V8F32), builder.sitofp(isum, V8F32), acc)
                else:
                    acc = _fma(builder, builder.sitofp(_hsum_i32(builder, isum), F32), d, acc)
                if m_at is not None:  # summs += m_w * s_a (exact fp16 product), in block order
                    sa = _load(builder, srow, builder.mul(b, ir.Constant(I64, 4)), F32)
                    summs = builder.fadd(summs, builder.fmul(_half(builder, blk, m_at), sa))
                return [acc, summs]

            acc, summs = _loop(builder, nb_, init, body)
            y = _hsum_float_8(builder, acc) if lanes else acc
            return builder.fadd(y, summs) if m_at is not None else y

        return sig, codegen

    return dot


# -- Q4_K (repacked q4_K_8x8 gemv / gemm, repack.py) ----------------------------------------------------------------
def _k4_scales_mins(builder, blk):
    """`get_scale_min_k4` for j = 0..7: the 6-bit scales and mins of a Q4_K block (bytes 4..15), as i32."""
    q = [builder.zext(_load(builder, blk, 4 + i, I8), I32) for i in range(12)]
    c = {v: ir.Constant(I32, v) for v in (4, 6, 15, 63)}
    sc, mn = [], []
    for j in range(8):
        if j < 4:
            sc.append(builder.and_(q[j], c[63]))
            mn.append(builder.and_(q[j + 4], c[63]))
        else:
            hi_sc = builder.shl(builder.lshr(q[j - 4], c[6]), c[4])
            hi_mn = builder.shl(builder.lshr(q[j], c[6]), c[4])
            sc.append(builder.or_(builder.and_(q[j + 4], c[15]), hi_sc))
            mn.append(builder.or_(builder.lshr(q[j + 4], c[4]), hi_mn))
    return sc, mn


def q4_k_dot(piece: int):
    """Intrinsic (w, r, aq, t, ad, bsums, nb) -> f32 for Q4_K weights (144-byte blocks) and Q8_K activations
    (ad f32 (T, nb) d, bsums int16 (T, nb*16)), as repack.py's `_kernel` with this `piece`: per `piece`
    elements (256: the gemv; 64: the gemm's `sb` iterations) I = sum sc_j * dot_j and M = sum m_j * bsum_j
    (int32), acc = fma(float(I), fl(dw * da), acc), accm = fma(float(M), fl(dmin * da), accm); y = acc - accm.
    (The eight-row groups' gemm, all activation rows per block: `int8ir_x8_gemm.q4_kx8_gemm`.)"""

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, bsums, nb):
        sig = _signature((w, r, aq, t, ad, bsums, nb), (U8, int, I8T, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t_, ad_, bs_, nb_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            stride = ir.Constant(I64, 144)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            bsrow = _row(context, builder, signature.args[5], bs_, t_)
            f0 = ir.Constant(F32, 0.0)

            def body(b, carried):
                acc, accm = carried
                blk = builder.gep(wrow, [builder.mul(b, stride)])
                ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
                bsblk = builder.gep(bsrow, [builder.mul(b, ir.Constant(I64, 32))])
                da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                dd = builder.fmul(_half(builder, blk, 0), da)
                dm = builder.fmul(_half(builder, blk, 2), da)
                sc, mn = _k4_scales_mins(builder, blk)
                bs = [builder.sext(_load(builder, bsblk, 2 * i, I16), I32) for i in range(16)]
                isum = ir.Constant(V8I32, [0] * 8)
                msum = ir.Constant(I32, 0)
                for c in range(4):  # 64 elements: sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles)
                    lo, hi = _nibbles32(builder, _load(builder, blk, 16 + 32 * c, V32I8))
                    for j, u in ((2 * c, lo), (2 * c + 1, hi)):
                        a = _load(builder, ablk, 32 * j, V32I8)
                        scale = _broadcast(builder, builder.trunc(sc[j], I16), V16I16)
                        isum = builder.add(isum, _madd(builder, _maddubs(builder, u, a), scale))
                        pair = builder.add(bs[2 * j], bs[2 * j + 1])
                        msum = builder.add(msum, builder.mul(mn[j], pair))
                    if (64 * (c + 1)) % piece == 0:
                        acc = _fma(builder, builder.sitofp(_hsum_i32(builder, isum), F32), dd, acc)
                        accm = _fma(builder, builder.sitofp(msum, F32), dm, accm)
                        isum = ir.Constant(V8I32, [0] * 8)
                        msum = ir.Constant(I32, 0)
                return [acc, accm]

            acc, accm = _loop(builder, nb_, [f0, f0], body)
            return builder.fsub(acc, accm)

        return sig, codegen

    return dot


# -- Q6_K (vec_dot: kquants.py; tiled, T >= 8: tiled.py) ---------------------------------------------------------
def q6_k_dot(lanes: bool):
    """Intrinsic (w, r, aq, t, ad, bsums, nb) -> f32 for Q6_K weights (210-byte blocks), Q8_K activations.

    Per super-block the 8 int32 lanes of `ggml_vec_dot_q6_K_q8_K` (AVX2): lane k = sum over elements e with
    (e % 32) // 4 == k of sc * q_unsigned * a, minus 32 * (bsum_2k sc_2k + bsum_2k+1 sc_2k+1). lanes=True
    (vec_dot, T < 8): acc = fma(fl(da * dw), float(lanes), acc), y = hsum_float_8(acc). lanes=False (the tiled
    kernel, T >= 8): s = sum of the lanes, p = fl(float(s) * dw), y = fma(p, da, y)."""

    @intrinsic
    def dot(typingctx, w, r, aq, t, ad, bsums, nb):
        sig = _signature((w, r, aq, t, ad, bsums, nb), (U8, int, I8T, int, F32T, I16T, int))

        def codegen(context, builder, signature, args):
            w_, r_, aq_, t_, ad_, bs_, nb_ = args
            wrow = _row(context, builder, signature.args[0], w_, r_)
            arow = _row(context, builder, signature.args[2], aq_, t_)
            drow = _row(context, builder, signature.args[4], ad_, t_)
            bsrow = _row(context, builder, signature.args[5], bs_, t_)
            three, four = _splat(V32I8, 3), _splat(V32I8, 4)

            def body(b, carried):
                (acc,) = carried
                blk = builder.gep(wrow, [builder.mul(b, ir.Constant(I64, 210))])
                ablk = builder.gep(arow, [builder.mul(b, ir.Constant(I64, 256))])
                sc16 = builder.sext(_load(builder, blk, 192, V16I8), V16I16)
                isum = ir.Constant(V8I32, [0] * 8)
                for h in range(2):  # block_q6_K: ql[128], qh[64], scales[16], d
                    ql0, ql1 = (_load(builder, blk, 64 * h + 32 * i, V32I8) for i in range(2))
                    qh = _load(builder, blk, 128 + 32 * h, V32I8)
                    lo0, hi0 = _nibbles32(builder, ql0)
                    lo1, hi1 = _nibbles32(builder, ql1)
                    low = (lo0, lo1, hi0, hi1)  # elements 128h + 32i + l, i = 0..3
                    for i in range(4):
                        top = builder.and_(builder.lshr(qh, _splat(V32I8, 2 * i)), three)
                        u = builder.or_(low[i], builder.shl(top, four))
                        chunk = 4 * h + i
                        a = _load(builder, ablk, 32 * chunk, V32I8)
                        scale = _shuffle(builder, sc16, sc16, [2 * chunk] * 8 + [2 * chunk + 1] * 8)
                        isum = builder.add(isum, _madd(builder, _maddubs(builder, u, a), scale))
                bs = _load(builder, bsrow, builder.mul(b, ir.Constant(I64, 32)), V16I16)
                isum = builder.sub(isum, builder.shl(_madd(builder, bs, sc16), _splat(V8I32, 5)))
                da = _load(builder, drow, builder.mul(b, ir.Constant(I64, 4)), F32)
                dw = _half(builder, blk, 208)
                if lanes:
                    d = _broadcast(builder, builder.fmul(da, dw), V8F32)
                    return [_fma(builder, d, builder.sitofp(isum, V8F32), acc)]
                p = builder.fmul(builder.sitofp(_hsum_i32(builder, isum), F32), dw)
                return [_fma(builder, p, da, acc)]

            zero = ir.Constant(V8F32, [0.0] * 8) if lanes else ir.Constant(F32, 0.0)
            (acc,) = _loop(builder, nb_, [zero], body)
            return _hsum_float_8(builder, acc) if lanes else acc

        return sig, codegen

    return dot
