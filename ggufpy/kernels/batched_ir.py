"""LLVM IR of the batched decode's products: one work unit (a group of 64 weight rows, some of its lanes) for
every activation row, from the packed bytes to the output, in registers.

    unit_rows(q, a, b, sc, mn, per, zo, xv, sums, u, wide, out)      (one intrinsic per storage family and style)

    q, a, b, sc, mn, per   the weight (`matvec.plan`); zo as f32
    xv    f32 (B, C)       the activation rows; sums f32 (B, n): each row's sum over each sub-block (`_sub_sums`)
    u                      the unit: group u // U, lanes of unit u % U (U = 4 units of 16 lanes, or 2 of 32 if wide)
    out   f32 (B, G*64)    out: the unit's lanes of every row

Each lane of each row takes the single-row kernels' operations in their order (`matvec._nib_row`, `_row` with
the `*_dot1` products and `_accumulate_direct`), which the tests check bit for bit:

    acc = 0
    for each sub-block s:  blk = 0;  for k in 0..S-1: blk = x[t, k] * v[k] + blk          (one FMA each)
                           acc = A * (blk + zo * sum_s) + acc;  acc = B * sum_s + acc      (A = a * sc, B = b * mn)

with `contract` on exactly the multiply-adds the single-row kernels fuse (numba's `fast` kernels give them that
flag, and LLVM fuses every one on an FMA CPU), and no flag on the rest (`zo * sum`, `a * sc`, `b * mn`, `blk +
corr`): nothing else may change a rounding. A row's operations do not depend on the other rows, on its tile or on
how the lanes are cut into units, so units can be any size and go to any thread.

Why whole units in IR: the previous form unpacked each sub-block to an f32 scratch (stores and loads), summed
tiles of rows in IR and ran the scale step in numba code over memory; here the values are widened in registers
(`vpmovzxbd` + `vcvtdq2ps`) straight from the bytes, used by a tile of R rows x W vectors of 8 lanes with the
sums in registers (R x W = 8 independent FMA chains, two FMAs per cycle at four cycles' latency), and the scale
step reads the sums from registers. Tiles: W = 2 vectors (16 lanes, U = 4 units per group) and R = 4 rows from
B = 4 rows on; below, W = 4 (32 lanes) and R = 2, so that a tile still has 8 chains. Four units per group also
let two threads share small matrices evenly (SmolLM2's 576 rows: 36 units 18/18, where 9 groups split 5/4).

Lanes of a narrow unit j (16 lanes, two vectors) in each family's bytes (`layout.py`):

    nib    bytes 8j..8j+7:  low nibbles -> rows 8j.., high -> rows 32+8j..
    i8     bytes 8j..8j+7 -> rows 8j..;  bytes 32+8j.. -> rows 32+8j..
    nib6   j < 2, r = 8j:       nibble bytes r..    + bit pairs 0-1 / 4-5 of bytes 32+r.. -> rows r.., 32+r..
           j >= 2, r = 8(j-2):  nibble bytes 16+r.. + bit pairs 2-3 / 6-7 of bytes 32+r.. -> rows 16+r.., 48+r..

and a wide unit j is narrow units 2j and 2j+1 (nib6: j and j+2, which share their bit-pair bytes).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._numba import DISABLED

__all__ = ["UNITS", "carray", "f32_pointer", "u16_pointer", "unit_rows"]

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V8F32, V8I32, V8I8, V8I16 = (ir.VectorType(t, 8) for t in (F32, I32, I8, I16))
V8HALF = ir.VectorType(ir.HalfType(), 8)
LANES = 64  # lanes of a group (`layout.GROUP`): one per weight row
UNITS = 4  # narrow units per group (2 wide ones)
WIDE_BELOW = 4  # rows: below this many, wide units (32 lanes) keep 8 FMA chains per tile
CONTRACT = ("contract",)  # the flag of numba's `fast` kernels that allows fusing x * y + acc, without reassoc


def _c(v: int):
    return ir.Constant(I64, v)


def _loop(builder, n, init: list, body) -> list:
    """for i in range(n): carried = body(i, carried); returns the final carried values."""
    pre = builder.block
    head = builder.append_basic_block("unit.head")
    loop = builder.append_basic_block("unit.body")
    done = builder.append_basic_block("unit.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(I64)
    i.add_incoming(_c(0), pre)
    phis = []
    for v in init:
        phi = builder.phi(v.type)
        phi.add_incoming(v, pre)
        phis.append(phi)
    builder.cbranch(builder.icmp_signed("<", i, n), loop, done)
    builder.position_at_end(loop)
    new = body(i, phis)
    end = builder.block
    i.add_incoming(builder.add(i, _c(1)), end)
    for phi, v in zip(phis, new, strict=True):
        phi.add_incoming(v, end)
    builder.branch(head)
    builder.position_at_end(done)
    return phis


def _when(builder, cond, make, default: list) -> list:
    """make() where `cond` holds (only computed then), else `default`."""
    with builder.if_else(cond) as (then, other):
        with then:
            made = make()
            then_end = builder.block
        with other:
            other_end = builder.block
    out = []
    for v, d in zip(made, default, strict=True):
        phi = builder.phi(v.type)
        phi.add_incoming(v, then_end)
        phi.add_incoming(d, other_end)
        out.append(phi)
    return out


def _broadcast(builder, x):
    v = builder.insert_element(ir.Constant(V8F32, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(V8F32, ir.Undefined), ir.Constant(ir.VectorType(I32, 8), [0] * 8))


class _Array:
    """An array argument: its shape, and pointers to its elements from its strides."""

    def __init__(self, context, builder, ty, value):
        a = context.make_array(ty)(context, builder, value)
        self.builder = builder
        self.shape = cgutils.unpack_tuple(builder, a.shape, ty.ndim)
        self.strides = cgutils.unpack_tuple(builder, a.strides, ty.ndim)
        self.data = builder.bitcast(a.data, I8.as_pointer())

    def ptr(self, index, ty):
        """Pointer to a `ty` at element `index` (i64 values or ints)."""
        b = self.builder
        offset = _c(0)
        for i, stride in zip(index, self.strides, strict=True):
            offset = b.add(offset, b.mul(i if isinstance(i, ir.Value) else _c(i), stride))
        return b.bitcast(b.gep(self.data, [offset]), ty.as_pointer())


def _narrow(builder, family: str, q: _Array, signed: bool, g, j):
    """[(first lane, values(s, k) -> <8 x i32>)] of narrow unit j of group g: its two vectors of 8 lanes."""
    b = builder

    def const(v):
        return ir.Constant(V8I32, [v] * 8)

    def load(s, k, byte):
        raw = b.load(q.ptr([g, s, k, byte], V8I8), align=1)
        return b.sext(raw, V8I32) if signed else b.zext(raw, V8I32)

    r0 = b.mul(j, _c(8))
    if family == "nib":
        return [
            (r0, lambda s, k: b.and_(load(s, k, r0), const(15))),
            (b.add(r0, _c(32)), lambda s, k: b.lshr(load(s, k, r0), const(4))),
        ]
    if family == "i8":
        r1 = b.add(r0, _c(32))
        return [(r0, lambda s, k: load(s, k, r0)), (r1, lambda s, k: load(s, k, r1))]
    upper = b.icmp_signed(">=", j, _c(2))  # nib6
    r = b.mul(b.srem(j, _c(2)), _c(8))
    nibbles, lane = b.add(r, b.select(upper, _c(16), _c(0))), b.add(r, b.select(upper, _c(16), _c(0)))
    planes = b.add(r, _c(32))

    def first(s, k):  # rows r (bit pairs 0-1) or 16+r (bit pairs 2-3)
        h = load(s, k, planes)
        high = b.select(upper, b.shl(b.and_(h, const(12)), const(2)), b.shl(b.and_(h, const(3)), const(4)))
        return b.or_(b.and_(load(s, k, nibbles), const(15)), high)

    def second(s, k):  # rows 32+r (bit pairs 4-5) or 48+r (bit pairs 6-7)
        h = load(s, k, planes)
        high = b.select(upper, b.lshr(b.and_(h, const(192)), const(2)), b.and_(h, const(48)))
        return b.or_(b.lshr(load(s, k, nibbles), const(4)), high)

    return [(lane, first), (b.add(lane, _c(32)), second)]


def _unit(builder, family: str, style_super: bool, args: dict, g, js: list, r_max: int) -> None:
    """The lanes of narrow units `js` of group g, for every row, in tiles of up to r_max rows."""
    b = builder
    q, a, bs, sc, mn, xv, sums, out = (args[k] for k in ("q", "a", "b", "sc", "mn", "xv", "sums", "out"))
    vectors = [v for j in js for v in _narrow(b, family, q, args["signed"], g, j)]
    W = len(vectors)
    lanes = [lane for lane, _ in vectors]
    cols = [b.add(b.mul(g, _c(LANES)), lane) for lane in lanes]
    n, S = q.shape[1], q.shape[2]
    rows = xv.shape[0]
    zero = ir.Constant(V8F32, [0.0] * 8)
    has_b = b.icmp_signed(">", bs.shape[0], _c(0))

    def scale(arr, half, sb, lane):  # fp16 bits widened exactly (`vcvtph2ps`), or f32
        if half:
            return b.fpext(b.bitcast(b.load(arr.ptr([g, sb, lane], V8I16), align=2), V8HALF), V8F32)
        return b.load(arr.ptr([g, sb, lane], V8F32), align=4)

    def times_int(values, arr, s):  # values * the int8 sub-block scales (sc or mn) of sub-block s
        ints = [b.sitofp(b.sext(b.load(arr.ptr([g, s, lane], V8I8), align=1), V8I32), V8F32) for lane in lanes]
        return [b.fmul(v, i) for v, i in zip(values, ints, strict=True)]

    def zero_row(t, _):  # the single-row kernel's acc = np.zeros(64)
        for c in cols:
            b.store(zero, out.ptr([t, c], V8F32), align=4)
        return []

    _loop(b, rows, [], zero_row)

    def sub_block(s, _):
        sb = b.sdiv(s, args["per"])
        A = [scale(a, args["a_half"], sb, lane) for lane in lanes]
        if style_super:
            A = _when(b, b.icmp_signed(">", sc.shape[0], _c(0)), lambda: times_int(A, sc, s), A)

        def offsets():
            B = [scale(bs, args["b_half"], sb, lane) for lane in lanes]
            if style_super:
                B = _when(b, b.icmp_signed(">", mn.shape[0], _c(0)), lambda: times_int(B, mn, s), B)
            return B

        B = _when(b, has_b, offsets, [zero] * W)
        first = b.mul(s, S)

        def tile(ts: list) -> None:
            xs = [xv.ptr([t, first], F32) for t in ts]

            def step(k, blk):
                v = [b.sitofp(values(s, k), V8F32) for _, values in vectors]
                new = []
                for i, x in enumerate(xs):
                    xk = _broadcast(b, b.load(b.gep(x, [k]), align=4))
                    new += [b.fadd(b.fmul(xk, v[w], flags=CONTRACT), blk[i * W + w], flags=CONTRACT) for w in range(W)]
                return new

            blk = _loop(b, S, [zero] * (len(ts) * W), step)
            for i, t in enumerate(ts):
                total = b.load(sums.ptr([t, s], F32), align=4)
                corr = _broadcast(b, b.fmul(args["zo"], total))  # zo * sum, rounded on its own
                for w in range(W):
                    p = out.ptr([t, cols[w]], V8F32)
                    scaled = b.fmul(A[w], b.fadd(blk[i * W + w], corr), flags=CONTRACT)
                    b.store(b.fadd(scaled, b.load(p, align=4), flags=CONTRACT), p, align=4)
            with b.if_then(has_b):
                for t in ts:
                    total = _broadcast(b, b.load(sums.ptr([t, s], F32), align=4))
                    for w in range(W):
                        p = out.ptr([t, cols[w]], V8F32)
                        b.store(
                            b.fadd(b.fmul(B[w], total, flags=CONTRACT), b.load(p, align=4), flags=CONTRACT), p, align=4
                        )

        def full_tile(i, _):
            t0 = b.mul(i, _c(r_max))
            tile([b.add(t0, _c(r)) for r in range(r_max)])
            return []

        _loop(b, b.sdiv(rows, _c(r_max)), [], full_tile)
        rest, t0 = b.srem(rows, _c(r_max)), b.mul(b.sdiv(rows, _c(r_max)), _c(r_max))
        for r in range(1, r_max):
            with b.if_then(b.icmp_signed("==", rest, _c(r))):
                tile([b.add(t0, _c(i)) for i in range(r)])
        return []

    _loop(b, n, [], sub_block)


def _compiled_unit_rows(family: str, style_super: bool):
    """The `unit_rows` intrinsic of one storage family; `style_super` compiles the sc and mn branches."""

    @intrinsic
    def unit_rows(typingctx, q, a, b, sc, mn, per, zo, xv, sums, u, wide, out):
        arrays = {q: 4, a: 3, b: 3, sc: 3, mn: 3, xv: 2, sums: 2, out: 2}
        if not all(isinstance(x, types.Array) and x.ndim == nd and x.layout == "C" for x, nd in arrays.items()):
            return None
        if not all(x.dtype == types.float32 for x in (xv, sums, out)) or zo != types.float32:
            return None
        sig = types.none(q, a, b, sc, mn, types.int64, types.float32, xv, sums, types.int64, types.int64, out)
        signed = q.dtype.signed

        def codegen(context, builder, signature, values):
            names = ("q", "a", "b", "sc", "mn", "per", "zo", "xv", "sums", "u", "wide", "out")
            args = dict(zip(names, values, strict=True))
            for name, ty in zip(names, signature.args, strict=True):
                if isinstance(ty, types.Array):
                    args[name] = _Array(context, builder, ty, args[name])
            args.update(signed=signed, a_half=signature.args[1].dtype.bitwidth == 16)
            args["b_half"] = signature.args[2].dtype.bitwidth == 16
            u = args["u"]
            with builder.if_else(builder.icmp_signed("!=", args["wide"], _c(0))) as (wide, narrow):
                with wide:  # units of 32 lanes, 2 per group, tiles of 2 rows
                    g, j = builder.sdiv(u, _c(UNITS // 2)), builder.srem(u, _c(UNITS // 2))
                    pair = (
                        [j, builder.add(j, _c(2))]
                        if family == "nib6"
                        else [builder.mul(j, _c(2)), builder.add(builder.mul(j, _c(2)), _c(1))]
                    )
                    _unit(builder, family, style_super, args, g, pair, 2)
                with narrow:  # units of 16 lanes, 4 per group, tiles of 4 rows
                    g, j = builder.sdiv(u, _c(UNITS)), builder.srem(u, _c(UNITS))
                    _unit(builder, family, style_super, args, g, [j], 4)
            return context.get_dummy_value()

        return sig, codegen

    return unit_rows


def _python_unit_rows(family: str, style_super: bool):
    """NUMBA_DISABLE_JIT: the same unit in NumPy, a multiply and an add per step (as the plain-Python
    single-row kernels)."""

    def values(q, g, s, k):  # (64,) f32 values of element k of sub-block s, lane r = row r
        byte = q[g, s, k].astype(np.int32)
        if family == "nib":
            return np.concatenate([byte & 15, byte >> 4]).astype(np.float32)
        if family == "i8":
            return byte.astype(np.float32)
        n0, n1, h = byte[:16], byte[16:32], byte[32:48]
        parts = [
            (n0 & 15) | ((h & 3) << 4),
            (n1 & 15) | ((h & 12) << 2),
            (n0 >> 4) | (h & 48),
            (n1 >> 4) | ((h & 192) >> 2),
        ]
        return np.concatenate(parts).astype(np.float32)

    def narrow(j):  # first lanes of narrow unit j's two vectors
        return [16 + 8 * (j - 2), 48 + 8 * (j - 2)] if family == "nib6" and j >= 2 else [8 * j, 32 + 8 * j]

    def unit_rows(q, a, b, sc, mn, per, zo, xv, sums, u, wide, out):
        g, j = divmod(u, UNITS // 2 if wide else UNITS)
        js = ([j, j + 2] if family == "nib6" else [2 * j, 2 * j + 1]) if wide else [j]
        starts = [r for i in js for r in narrow(i)]
        lanes = np.concatenate([np.arange(r, r + 8) for r in starts])
        _, n, S, _ = q.shape
        f16 = (lambda x: x.view(np.float16).astype(np.float32)) if a.dtype == np.uint16 else (lambda x: x)
        for t in range(xv.shape[0]):
            acc = np.zeros(len(lanes), np.float32)
            for s in range(n):
                blk = np.zeros(len(lanes), np.float32)
                for k in range(S):
                    blk += xv[t, s * S + k] * values(q, g, s, k)[lanes]
                A = f16(a[g, s // per, lanes])
                if style_super and sc.shape[0] > 0:
                    A = A * sc[g, s, lanes].astype(np.float32)
                acc += A * (blk + np.float32(zo) * sums[t, s])
                if b.shape[0] > 0:
                    B = (
                        b[g, s // per, lanes].view(np.float16) if b.dtype == np.uint16 else b[g, s // per, lanes]
                    ).astype(np.float32)
                    if style_super and mn.shape[0] > 0:
                        B = B * mn[g, s, lanes].astype(np.float32)
                    acc += B * sums[t, s]
            out[t, g * LANES + lanes] = acc

    return unit_rows


_make = _python_unit_rows if DISABLED else _compiled_unit_rows
unit_rows = {(family, s): _make(family, s) for family in ("nib", "i8", "nib6") for s in (False, True)}


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


def _compiled_u16_pointer():
    @intrinsic
    def u16_pointer(typingctx, address):
        """`f32_pointer` for uint16 data: the llamacpp numerics' f16 KV caches, as bits."""
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], I16.as_pointer())

        return types.CPointer(types.uint16)(address), codegen

    return u16_pointer


f32_pointer = None if DISABLED else _compiled_f32_pointer()  # NUMBA_DISABLE_JIT: callers pass the arrays instead
u16_pointer = None if DISABLED else _compiled_u16_pointer()
