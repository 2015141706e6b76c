"""LLVM IR for the two products of `x86_decode` (one query over the f16 cache), as numba intrinsics: the same
f32 operations as `ggml_vec_dot_f16` (ggml-cpu/vec.cpp), in its order, with the independent values in vector
lanes where LLVM's vectorizer leaves them scalar.

    kq_scores[lanes]   8 keys at a time: per key the 4 registers of `lanes` floats accumulated over the
                       row's steps (one `fma` per element, from +0.0), (r0 + r2) + (r1 + r3), then the 8 keys'
                       horizontal reduces together: each reduce level is one vector add of two shuffles, whose
                       lanes hold the same pairs of the same keys as ggml's reduce (`GGML_F32x8_REDUCE`'s
                       extract + hadd, or `_mm512_reduce_add_ps`), so every score is the scalar reduce's.
    pv_{1,2,4}         the V product's accumulators: acc[i, e] = sum over the cells j = i (mod 4 lanes), in
                       cell order, of V[j, e] * p[j] (ggml's register i % lanes of block i // lanes), a lane i
                       at a time, 1, 2 or 4 query heads' accumulators of 64, 32 or 16 outputs held in registers
                       across the lane's cells (each V row widened once for the heads).
    widen_f16          K rows to f32 once for the task's heads (`kq_scores` reads them for each).

f16 values are widened with `fpext` (exact, `vcvtph2ps`). Products of two f16 values are exact in f32, so `fma`
here and ggml's `_mm256_fmadd_ps` (or mul then add) round alike. No fast-math flags.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["kq_scores_8", "kq_scores_16", "pv_1", "pv_2", "pv_4", "widen_f16"]

I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()


def _f32_2d(*arrays) -> bool:
    """Whether every argument type is a C-contiguous 2-D f32 array (read-only allowed)."""
    return all(
        isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32 for a in arrays
    )


def _data(context, builder, arrty, arr):
    """(float* data, the row length) of a C-contiguous 2-D f32 array."""
    a = context.make_array(arrty)(context, builder, arr)
    return a.data, cgutils.unpack_tuple(builder, a.shape, 2)[1]


def _c(n: int) -> ir.Constant:
    return ir.Constant(I64, n)


def _vec_at(builder, base, index, width: int):
    """Pointer to <width x float> at element `index` (i64) of the float* base (unaligned)."""
    return builder.bitcast(builder.gep(base, [index]), ir.VectorType(F32, width).as_pointer())


def _load_vec(builder, base, index, width: int):
    return builder.load(_vec_at(builder, base, index, width), align=4)


def _store_vec(builder, value, base, index):
    builder.store(value, _vec_at(builder, base, index, value.type.count), align=4)


def _widen_8(builder, base, index):
    """<8 x float> from the 8 f16 at element `index` (i64) of the i16* base: `fpext`, exact (`vcvtph2ps`)."""
    ptr = builder.bitcast(builder.gep(base, [index]), ir.VectorType(ir.HalfType(), 8).as_pointer())
    return builder.fpext(builder.load(ptr, align=2), ir.VectorType(F32, 8))


def _splat(builder, x, width: int):
    v = builder.insert_element(ir.Constant(ir.VectorType(F32, width), ir.Undefined), x, ir.Constant(I32, 0))
    return _shuffle(builder, v, v, [0] * width)


def _shuffle(builder, a, b, idx: list[int]):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(idx)), idx))


def _fma(builder, a, b, c):
    name = f"llvm.fma.v{a.type.count}f32"  # vector types have no llvmlite intrinsic name
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(fn, [a, b, c])


def _loop(builder, start, stop, step, init: list, body, name: str) -> list:
    """for i in range(start, stop, step) (step > 0): carried = body(i, carried); the final carried values."""
    pre = builder.block
    head = builder.append_basic_block(f"{name}.head")
    loop = builder.append_basic_block(f"{name}.body")
    done = builder.append_basic_block(f"{name}.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(I64)
    i.add_incoming(start, pre)
    phis = []
    for v in init:
        phi = builder.phi(v.type)
        phi.add_incoming(v, pre)
        phis.append(phi)
    builder.cbranch(builder.icmp_signed("<", i, stop), loop, done)
    builder.position_at_end(loop)
    new = body(i, phis)
    end = builder.block
    i.add_incoming(builder.add(i, step), end)
    for phi, v in zip(phis, new, strict=True):
        phi.add_incoming(v, end)
    builder.branch(head)
    builder.position_at_end(done)
    return phis


def _pairwise(builder, x: list, first: list[int], second: list[int]) -> list:
    """Adjacent vectors (x[0], x[1]), (x[2], x[3]), ...: shuffle(a, b, first) + shuffle(a, b, second)."""
    return [
        builder.fadd(_shuffle(builder, x[i], x[i + 1], first), _shuffle(builder, x[i], x[i + 1], second))
        for i in range(0, len(x), 2)
    ]


_EVENS, _ODDS = list(range(0, 16, 2)), list(range(1, 16, 2))
_FIRST8, _LAST8 = list(range(8)), list(range(8, 16))
_HALVES = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])  # (a0..a3, b0..b3), (a4..a7, b4..b7)


def _key_pair(builder, a, b, lanes: int):
    """Keys a, b (<lanes x float> each, (r0 + r2) + (r1 + r3)) -> (a: 4 sums, b: 4 sums), the reduce's first
    levels. AVX2 (vec.h GGML_F32x8_REDUCE's tail: lo128 + hi128): x_i + x_(i+4). AVX-512
    (`_mm512_reduce_add_ps`): h_i = x_i + x_(i+8), then h_i + h_(i+4)."""
    if lanes == 16:  # the two halves of each key: no lane crosses keys
        a, b = (builder.fadd(_shuffle(builder, x, x, _FIRST8), _shuffle(builder, x, x, _LAST8)) for x in (a, b))
    return _pairwise(builder, [a, b], *_HALVES)[0]


def _four_keys(builder, u, v, lanes: int):
    """Two key pairs' 4 sums -> (k: 2 sums, k+1: 2, k+2: 2, k+3: 2). AVX2: the two hadds' first,
    (x0+x4) + (x1+x5) and (x2+x6) + (x3+x7); AVX-512: f_i = g_i + g_(i+2)."""
    if lanes == 16:
        return _pairwise(builder, [u, v], [0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15])[0]
    return _pairwise(builder, [u, v], _EVENS, _ODDS)[0]


def _eight_keys(builder, v, w):
    """Keys 0..3 and 4..7, 2 sums each -> their reduces, key k in lane k: the second hadd (AVX2), f_0 + f_1."""
    return _pairwise(builder, [v, w], _EVENS, _ODDS)[0]


def _kq_scores(lanes: int):
    vty = ir.VectorType(F32, lanes)

    @intrinsic
    def kq_scores(typingctx, kf, q16, hh, steps, w, row, col, nblocks):
        """w[row, col + j] = the vec-reduce part of `ggml_vec_dot_f16(kf[j], q16[hh])` over steps >= 1 steps
        of 4 x `lanes` elements (the leftovers are the caller's), for the keys j < 8 x nblocks of kf. A key pair's
        first reduce levels run as soon as both keys are summed (few registers live)."""
        if not _f32_2d(kf, q16, w):
            return None
        sig = types.void(kf, q16, types.int64, types.int64, w, types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            kf_, q_, hh_, steps_, w_, row_, col_, nb_ = args
            kbase, E = _data(context, builder, signature.args[0], kf_)
            qbase, _ = _data(context, builder, signature.args[1], q_)
            wbase, W = _data(context, builder, signature.args[4], w_)
            qrow = builder.gep(qbase, [builder.mul(hh_, E)])
            wrow = builder.gep(wbase, [builder.add(builder.mul(row_, W), col_)])
            zero = ir.Constant(vty, [0.0] * lanes)

            def registers(krow, at, acc):  # one step at element `at`: r_i = fma(k, q, r_i)
                e = [builder.add(at, _c(r * lanes)) for r in range(4)]
                kv = [_load_vec(builder, krow, e[r], lanes) for r in range(4)]
                return [_fma(builder, kv[r], _load_vec(builder, qrow, e[r], lanes), acc[r]) for r in range(4)]

            def key(b, k, steps):  # key 8b + k: its 4 registers over the steps (from +0.0), (r0 + r2) + (r1 + r3)
                krow = builder.gep(kbase, [builder.mul(builder.add(builder.mul(b, _c(8)), _c(k)), E)])
                # one step: r_i = fma(k, q, +0) is the exact product (+0 for a zero), so r0 + r2 = fma(k2, q2, r0):
                # one rounding of the same exact sum (r0 is never -0: a -0 product adds as +0 does)
                if steps == 1:
                    e = [_c(r * lanes) for r in range(4)]
                    kv = [_load_vec(builder, krow, e[r], lanes) for r in range(4)]
                    qv = [_load_vec(builder, qrow, e[r], lanes) for r in range(4)]
                    r = [_fma(builder, kv[i], qv[i], zero) for i in range(2)]
                    return builder.fadd(_fma(builder, kv[2], qv[2], r[0]), _fma(builder, kv[3], qv[3], r[1]))
                r = [zero] * 4
                for s in range(steps or 1):
                    r = registers(krow, _c(4 * lanes * s), r)
                if steps is None:  # any count: the further steps in a loop
                    r = _loop(
                        builder, _c(1), steps_, _c(1), r,
                        lambda s, acc: registers(krow, builder.mul(s, _c(4 * lanes)), acc), f"kq{k}",
                    )  # fmt: skip
                return builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))

            def block(b, steps):
                pairs = [_key_pair(builder, key(b, 2 * m, steps), key(b, 2 * m + 1, steps), lanes) for m in range(4)]
                fours = [_four_keys(builder, pairs[0], pairs[1], lanes), _four_keys(builder, pairs[2], pairs[3], lanes)]
                _store_vec(builder, _eight_keys(builder, *fours), wrow, builder.mul(b, _c(8)))
                return []

            # 1 step (E = 64 at 16 lanes, 32 at 8) and 2 (128 at 16, 64 at 8) straight-line, more in a loop
            done = builder.append_basic_block("kq.done")
            other = builder.append_basic_block("kq.steps")
            switch = builder.switch(steps_, other)
            for steps in (1, 2, None):
                if steps is None:
                    builder.position_at_end(other)
                else:
                    switch.add_case(_c(steps), builder.append_basic_block(f"kq.steps{steps}"))
                    builder.position_at_end(switch.cases[-1][1])
                _loop(builder, _c(0), nb_, _c(1), [], lambda b, _, steps=steps: block(b, steps), "kqb")
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    return kq_scores


kq_scores_8 = _kq_scores(8)
kq_scores_16 = _kq_scores(16)


@intrinsic
def widen_f16(typingctx, src, g, first, last, n, step, M, dst, count):
    """dst[(jj % step) * M + jj // step, :count] = src[min(first + jj, last), g, :count] as f32 for jj < n:
    src (S, G, E) u16 f16 bits, C-contiguous; dst (R, E) f32; count a multiple of 8."""
    if not (isinstance(src, types.Array) and src.ndim == 3 and src.layout == "C" and src.dtype == types.uint16):
        return None
    if not _f32_2d(dst):
        return None
    i64 = types.int64
    sig = types.void(src, i64, i64, i64, i64, i64, i64, dst, i64)

    def codegen(context, builder, signature, args):
        src_, g_, first_, last_, n_, step_, M_, dst_, count_ = args
        a = context.make_array(signature.args[0])(context, builder, src_)
        _, G, E = cgutils.unpack_tuple(builder, a.shape, 3)
        sbase = builder.bitcast(a.data, ir.IntType(16).as_pointer())
        dbase, W = _data(context, builder, signature.args[7], dst_)

        def row(jj, _):
            j = builder.add(first_, jj)
            j = builder.select(builder.icmp_signed("<", j, last_), j, last_)
            at = builder.mul(builder.add(builder.mul(j, G), g_), E)
            r = builder.add(builder.mul(builder.srem(jj, step_), M_), builder.sdiv(jj, step_))
            out = builder.mul(r, W)

            def eight(x, _):
                e = builder.mul(x, _c(8))
                _store_vec(builder, _widen_8(builder, sbase, builder.add(at, e)), dbase, builder.add(out, e))
                return []

            _loop(builder, _c(0), builder.sdiv(count_, _c(8)), _c(1), [], eight, "widen.e")
            return []

        _loop(builder, _c(0), n_, _c(1), [], row, "widen.row")
        return context.get_dummy_value()

    return sig, codegen


def _pv_heads(heads: int):
    """`pv` for `heads` query heads at once (their accumulators of 8 x (8 // heads) outputs in registers)."""
    wide = 8 // heads

    @intrinsic
    def pv(typingctx, v, g, base, w, h0, n, step, acc):
        """acc[h * step + i, e] = sum over the cells jj = i, i + step, ... < n, in order, of V[jj, e] * w[h, jj],
        from +0.0, for the query heads h0 <= h < h0 + heads and i < step; V[jj] = v[base + jj, g] (S, G, E) f16
        bits, E a multiple of 8; acc (hp * step, E)."""
        if not (isinstance(v, types.Array) and v.ndim == 3 and v.layout == "C" and v.dtype == types.uint16):
            return None
        if not _f32_2d(w, acc):
            return None
        i64 = types.int64
        sig = types.void(v, i64, i64, w, i64, i64, i64, acc)

        def codegen(context, builder, signature, args):
            v_, g_, base_, w_, h0_, n_, step_, acc_ = args
            a = context.make_array(signature.args[0])(context, builder, v_)
            _, G, E = cgutils.unpack_tuple(builder, a.shape, 3)
            vbase = builder.bitcast(a.data, ir.IntType(16).as_pointer())
            stride = builder.mul(G, E)  # halves from one cell to the next
            first = builder.add(builder.mul(base_, stride), builder.mul(g_, E))
            wbase, W = _data(context, builder, signature.args[3], w_)
            abase, _ = _data(context, builder, signature.args[7], acc_)
            prows = [builder.gep(wbase, [builder.mul(builder.add(h0_, _c(h)), W)]) for h in range(heads)]
            zero = ir.Constant(ir.VectorType(F32, 8), [0.0] * 8)

            def lane(i, _):  # each chunk's pass reads the lane's cells while they are in L1 from the last one
                e_at = _c(0)
                for width in (wide, 1):  # chunks of 8 x wide outputs, then of 8
                    floats = _c(8 * width)
                    chunks = builder.sdiv(builder.sub(E, e_at), floats)

                    def chunk(c, _, width=width, floats=floats, e_first=e_at):
                        e0 = builder.add(e_first, builder.mul(c, floats))

                        def cell(jj, acc):
                            at = builder.add(builder.add(first, builder.mul(jj, stride)), e0)
                            vx = [_widen_8(builder, vbase, builder.add(at, _c(8 * x))) for x in range(width)]
                            out = []
                            for h in range(heads):
                                p = _splat(builder, builder.load(builder.gep(prows[h], [jj]), align=4), 8)
                                out += [_fma(builder, vx[x], p, acc[h * width + x]) for x in range(width)]
                            return out

                        acc = _loop(builder, i, n_, step_, [zero] * (heads * width), cell, f"pv{width}.cell")
                        for h in range(heads):
                            row = builder.add(builder.mul(builder.add(h0_, _c(h)), step_), i)
                            at = builder.add(builder.mul(row, E), e0)
                            for x in range(width):
                                _store_vec(builder, acc[h * width + x], abase, builder.add(at, _c(8 * x)))
                        return []

                    _loop(builder, _c(0), chunks, _c(1), [], chunk, f"pv{width}.chunk")
                    e_at = builder.add(e_at, builder.mul(chunks, floats))
                return []

            _loop(builder, _c(0), step_, _c(1), [], lane, "pv.lane")
            return context.get_dummy_value()

        return sig, codegen

    return pv


pv_1, pv_2, pv_4 = _pv_heads(1), _pv_heads(2), _pv_heads(4)
