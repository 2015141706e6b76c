"""llama.cpp's x86 attention for one query (a decoded token), compiled with its lanes vectorized: bit for bit
`quants.x86.attention.attention` at T = 1 over an f16 cache (`x86.attention` takes this path).

At T = 1 both F16 mul_mats are `ggml_vec_dot_f16` (ggml-cpu/vec.cpp; `llamafile_sgemm` declines one column):

    kq[j]  = vec_dot_f16(K[j], fp16(q))      4 registers of `lanes` over E, (r0 + r2) + (r1 + r3), the reduce,
                                              E % (4 lanes) leftovers in double
    p      = fp16(soft_max_ext(kq, scale))    ggml_v_expf per lane block, (double) hsum per block, 1 / sum
    kqv[e] = vec_dot_f16(V^T[e], p)           the same over the cells: cell j feeds accumulator j % (4 lanes)

The arithmetic is `x86._attention`'s, reordered only across independent values so that it vectorizes without
reassociating any sum (no fastmath): the exps and the f16 roundings are branch-free lane functions (selects,
not ifs) over a head's whole score row, and a task computes its query heads (one KV group's, or one head when
there are fewer groups than threads) from each K and V row while that row is in L1. With E a multiple of 8 the
two products are `x86_decode_ir`'s intrinsics: the K rows widened once per block of 64 keys for the task's
heads, 8 keys' horizontal reduces done together with vector shuffles in ggml's pairing order, and the V
accumulators of a lane block held in registers for up to 4 heads while the lane's cells stream by; other head
sizes (and NUMBA_DISABLE_JIT) take the loops below. A task's outputs do not depend on the thread count.

Measured (2026-12-02, AMD EPYC (AVX2), one thread, CPU time, best of 7, load average 2-4; A/B in one process):
16/4 heads of 64, avx512 numerics (16 lanes): 140 keys 88 -> 32 us a call (2.8x), 500 keys 3.6x, 1000 keys
608 -> 179 us (3.4x); avx2 (8 lanes) 3.9x-4.5x; 32/8 heads 2.8x (140) and 3.5x (1000); gpt-oss's 64/8 with
sinks 2.9x (140, window 128) and 3.6x (1000 keys). Per token on types-TQ2_0-d1024-f2816-l8 (8 layers, decode
at 128-160): 3.26 -> 2.74 ms. Of the 140-key call (16 lanes) about 9 us are the K products, 11 the V product,
7 the softmax (its exps: LLVM vectorizes the lane functions poorly), 2 the setup. Before (the
loops alone): K products ~60% (2/3 of it the horizontal sums, which LLVM leaves scalar), V ~20%, softmax 7%.
"""

from __future__ import annotations

import functools

import numpy as np

from ._numba import DISABLED, call_native, fma_f32, half_to_float, jit, native, prange, use_threads
from .glue_ggml import _libm_expf
from .x86_decode_ir import kq_scores_8, kq_scores_16, pv_1, pv_2, pv_4, widen_f16

__all__ = ["attention_one", "round_f16_lane", "task", "v_expf_256", "v_expf_lane", "writable"]

_f32 = np.float32

# vec.h ggml_v_expf's constants (`quants.x86.unary`)
_EXP_SHIFT = _f32(float.fromhex("0x1.8p23"))
_LOG2E = _f32(float.fromhex("0x1.715476p+0"))
_LN2_HI = _f32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = _f32(float.fromhex("0x1.7f7d1cp-20"))
_C1 = _f32(float.fromhex("0x1.ffffecp-1"))
_C2 = _f32(float.fromhex("0x1.fffdb6p-2"))
_C3 = _f32(float.fromhex("0x1.555e66p-3"))
_C4 = _f32(float.fromhex("0x1.573e2ep-5"))
_C5 = _f32(float.fromhex("0x1.0e4020p-7"))
_F32_MAX = _f32(np.finfo(np.float32).max)
_HALF = _f32(0.5)
_ONE_BITS = 0x3F800000
_MASK32 = 0xFFFFFFFF

# -- ggml_v_expf on one lane, branch-free (a loop over lanes vectorizes) ---------------------------------------


@jit(inline=True)
def _bits(x):
    return np.int64(np.float32(x).view(np.uint32))


@jit(inline=True)
def _from_bits(u):
    return np.uint32(u & _MASK32).view(np.float32)


@jit(inline=True)
def v_expf_256(x):
    """ggml_v_expf(__m256), AVX2 + FMA branch, on one lane (`quants.x86.unary.v_expf_256`); the integer lanes
    wrap at 32 bits as in the C code."""
    z = fma_f32(x, _LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = fma_f32(-n, _LN2_LO, fma_f32(-n, _LN2_HI, x))
    e = (_bits(z) << 23) & _MASK32  # _mm256_slli_epi32(castps_si256(z), 23)
    k = _from_bits(e + _ONE_BITS)
    an = abs(n)
    u = b * b
    j = fma_f32(fma_f32(fma_f32(_C5, b, _C4), u, fma_f32(_C3, b, _C2)), u, _C1 * b)
    g = 0x82000000 if n <= 0 else 0
    s1 = _from_bits(g + 0x7F000000)
    s2 = _from_bits(e - g)
    out = fma_f32(s2, j, s2) * s1 if an > 126 else fma_f32(k, j, k)
    return s1 * s1 if an > 192 else out


@jit(inline=True)
def _v_expf_512(x):
    """ggml_v_expf(__m512), AVX-512 branch: `glue_ggml.v_expf` without branches. Every lane is computed on a
    finite input and the special ones are selected afterwards (as the C code blends them)."""
    finite = abs(x) <= _F32_MAX  # false for +-inf and NaN
    xs = x if finite else _f32(0.0)
    z = fma_f32(xs, _LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = fma_f32(-n, _LN2_LO, fma_f32(-n, _LN2_HI, xs))
    u = b * b
    j = fma_f32(fma_f32(fma_f32(_C5, b, _C4), u, fma_f32(_C3, b, _C2)), u, fma_f32(_C1, b, _f32(1.0)))
    big = abs(n) > 192
    ni = np.int64(n if not big else _f32(0.0))  # |ni| <= 192: 2^ni as float64 bits, exact
    res = _f32(np.float64(j) * np.int64((ni + 1023) << 52).view(np.float64))  # _mm512_scalef_ps: one rounding
    nn = n if finite else x
    alt = _f32(0.0) if nn <= 0 else _f32(np.inf)
    out = alt if big or not finite else res
    return x if x != x else out


@jit(inline=True)
def v_expf_lane(x, wide):
    """The build's ggml_v_expf on one lane, branch-free: AVX-512's when `wide`, else AVX2's."""
    return _v_expf_512(x) if wide else v_expf_256(x)


@jit(inline=True)
def round_f16_lane(x):
    """`glue_ggml.round_f16` (f32 -> nearest-even f16 -> f32, `vcvtps2ph`) without branches. Normal f16 range:
    round the f32 bits at bit 13, half to even. Below 2^-14 (f16 subnormals, multiples of 2^-24): |x| + 0.5
    rounds |x| to a multiple of 2^-24 (the ulp of [0.5, 1)), half to even, and subtracting 0.5 is exact."""
    u = np.uint32(_f32(x).view(np.uint32))
    a = u & np.uint32(0x7FFFFFFF)
    r = (a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) & np.uint32(0x7FFFE000)
    r = r if r < np.uint32(0x47800000) else np.uint32(0x7F800000)  # 65520 and more (and inf): inf
    s = np.uint32(_f32((_f32(abs(x)) + _HALF) - _HALF).view(np.uint32))
    r = r if a >= np.uint32(0x38800000) else s
    r = r if a <= np.uint32(0x7F800000) else a | np.uint32(0x00400000)  # NaN: quiet
    return np.uint32(r | (u & np.uint32(0x80000000))).view(np.float32)


@jit(inline=True)
def _hsum(x, o, lanes):
    """`_mm512_reduce_add_ps` (16 lanes) or `hsum_float_8` (8) of x[o : o + lanes]."""
    if lanes == 8:
        return ((x[o + 4] + x[o]) + (x[o + 6] + x[o + 2])) + ((x[o + 5] + x[o + 1]) + (x[o + 7] + x[o + 3]))
    u0 = (x[o + 12] + x[o + 4]) + (x[o + 8] + x[o])
    u1 = (x[o + 13] + x[o + 5]) + (x[o + 9] + x[o + 1])
    u2 = (x[o + 14] + x[o + 6]) + (x[o + 10] + x[o + 2])
    u3 = (x[o + 15] + x[o + 7]) + (x[o + 11] + x[o + 3])
    return (u0 + u2) + (u1 + u3)


@jit(inline=True)
def _vec_dot_reduce(t, row, lanes):
    """The last step of `ggml_vec_dot_f16` for the register t[row, :lanes] (its four registers already added as
    (r0 + r2) + (r1 + r3)): `_mm512_reduce_add_ps`, or on AVX2 the `hadd`-based reduce, whose order differs
    from `hsum_float_8`."""
    if lanes == 8:
        return ((t[row, 0] + t[row, 4]) + (t[row, 1] + t[row, 5])) + ((t[row, 2] + t[row, 6]) + (t[row, 3] + t[row, 7]))
    u0 = (t[row, 12] + t[row, 4]) + (t[row, 8] + t[row, 0])
    u1 = (t[row, 13] + t[row, 5]) + (t[row, 9] + t[row, 1])
    u2 = (t[row, 14] + t[row, 6]) + (t[row, 10] + t[row, 2])
    u3 = (t[row, 15] + t[row, 7]) + (t[row, 11] + t[row, 3])
    return (u0 + u2) + (u1 + u3)


# Indexing note: numba wraps negative indices with a select on the index's sign; LLVM drops it only where it
# proves the index >= 0 (a `range` from 0), and with it in place a loop over lanes does not vectorize. So the
# hot loops index views from 0, and `lanes` reaches them as a constant (`_one_task` is inlined at 8 and 16).


_KEYS = 32  # keys whose registers are summed before their horizontal sums are read back (see `_scores`)


@jit(inline=True)
def _scores(q16, k, g, hp, lo, hi, lanes, base, kf, kacc, t, w):
    """w[hh, j - base] = kq of the task's query head hh and key j, lo <= j < hi: `ggml_vec_dot_f16(K[j], q16[hh])`.
    Each K row is widened once (kf) for the task's hp heads. The horizontal sums run a block of _KEYS keys
    later than their registers (t (hp * _KEYS, lanes)): read back at once, the lanes of a vector just stored
    stall on store forwarding, which cost 3x the products."""
    E = kf.size
    step = 4 * lanes
    steps = E // step
    main = steps * step
    for j0 in range(lo, hi, _KEYS):
        n = min(_KEYS, hi - j0)
        for jj in range(n):
            for e in range(E):
                kf[e] = half_to_float(k[j0 + jj, g, e])
            for hh in range(hp):
                if steps == 0:
                    kacc[:] = 0.0
                else:  # f16 x f16 is exact in f32, so each add is the FMA's one rounding (from +0.0)
                    for i in range(step):
                        kacc[i] = np.float32(0.0) + kf[i] * q16[hh, i]
                for s in range(1, steps):
                    for i in range(step):
                        kacc[i] += kf[s * step + i] * q16[hh, s * step + i]
                row = hh * _KEYS + jj
                for i in range(lanes):  # (r0 + r2) + (r1 + r3)
                    t[row, i] = (kacc[i] + kacc[2 * lanes + i]) + (kacc[lanes + i] + kacc[3 * lanes + i])
        for hh in range(hp):
            for jj in range(n):
                y = _vec_dot_reduce(t, hh * _KEYS + jj, lanes)
                if main < E:  # the leftovers, in double
                    d = np.float64(y)
                    for e in range(main, E):
                        d += np.float64(half_to_float(k[j0 + jj, g, e]) * q16[hh, e])
                    y = _f32(d)
                w[hh, j0 + jj - base] = y


@jit(inline=True)
def _soft_max_row(row, base, lo, hi, n_kv, scale, lanes, sink, has_sink):
    """row (end - base,) a query head's scores of keys lo <= j < hi (at j - base) in, fp16(soft_max_ext) out,
    over the lane blocks holding them (`x86._soft_max`: the other blocks are all masked, exps 0, adding +0.0
    to the double sum), zeros in the rest of the row (up to the 4-lane blocks the V product reads)."""
    b_lo, b_hi = lo - lo % lanes, min(n_kv, hi + (-hi) % lanes)
    blocks = row[b_lo - base : b_hi - base]
    first, last = lo - b_lo, hi - b_lo
    mx = _f32(-np.inf)
    for j in range(blocks.size):  # ggml_vec_scale_f32, then + mask (0 or -inf); the max in any order
        s = blocks[j] * scale if first <= j < last else _f32(-np.inf)
        blocks[j] = s
        mx = max(mx, s)
    if has_sink:  # ops.cpp soft_max with src[2]: max = MAX(max, sk[h])
        mx = mx if mx > sink else sink
    wide = lanes == 16
    for j in range(blocks.size):  # ggml_vec_soft_max_f32's exps, every lane block of the row at once
        blocks[j] = v_expf_lane(blocks[j] - mx, wide)
    total = np.float64(0.0)
    for b in range(blocks.size // lanes):  # its (ggml_float) hsum of each block, in order
        total += np.float64(_hsum(blocks, b * lanes, lanes))
    if has_sink:  # sum += (ggml_float) expf(sk[h] - max), the C library's expf
        total += np.float64(_libm_expf(sink - mx))
    inv = _f32(1.0 / total)
    for j in range(blocks.size):
        blocks[j] = round_f16_lane(blocks[j] * inv)  # kq_soft_max, in F16's vec_dot type
    row[: b_lo - base] = 0.0
    row[b_hi - base :] = 0.0


@jit(inline=True)
def _values(v, g, row, base, kv_hi, lanes, acc, out):
    """out[e] = `ggml_vec_dot_f16(V^T[e], p)` over cells base <= j < kv_hi, p = row[j - base] (cells past the
    keys seen have p = 0 and add +0 to accumulators that are never -0, as llama.cpp's padded cells do)."""
    E = out.size
    step = 4 * lanes
    acc[:, :] = 0.0
    for jj in range(kv_hi - base):
        a = row[jj]
        i = jj % step
        for e in range(E):
            acc[i, e] += half_to_float(v[base + jj, g, e]) * a
    _reduce_lanes(acc, lanes, out)


@jit(inline=True)
def _reduce_lanes(acc, lanes, out):
    """out[e] = the last steps of `ggml_vec_dot_f16` for the accumulators acc (4 lanes, E): (r0 + r2) + (r1 + r3),
    then the reduce, lane by lane with the E outputs innermost."""
    E = out.size
    for i in range(lanes):
        for e in range(E):
            acc[i, e] = (acc[i, e] + acc[2 * lanes + i, e]) + (acc[lanes + i, e] + acc[3 * lanes + i, e])
    if lanes == 8:
        for e in range(E):
            out[e] = ((acc[0, e] + acc[4, e]) + (acc[1, e] + acc[5, e])) + (
                (acc[2, e] + acc[6, e]) + (acc[3, e] + acc[7, e])
            )
    else:
        for e in range(E):
            u0 = (acc[12, e] + acc[4, e]) + (acc[8, e] + acc[0, e])
            u1 = (acc[13, e] + acc[5, e]) + (acc[9, e] + acc[1, e])
            u2 = (acc[14, e] + acc[6, e]) + (acc[10, e] + acc[2, e])
            u3 = (acc[15, e] + acc[7, e]) + (acc[11, e] + acc[3, e])
            out[e] = (u0 + u2) + (u1 + u3)


_BLOCK = 64  # keys widened to f32 at a time for the score products (16 KB at E = 64, in L1 for every head)


@jit(inline=True)
def _scores_ir(q16, k, g, hp, lo, hi, lanes, base, w):
    """`_scores` through `x86_decode_ir.kq_scores`: blocks of 8 keys from the multiple of 8 at or below lo (keys
    past hi repeat key hi - 1); the scores outside lo <= j < hi land in w's masked cells."""
    E = q16.shape[1]
    steps = E // (4 * lanes)
    main = steps * 4 * lanes
    kf = np.empty((_BLOCK, E), np.float32)
    for j0 in range(lo - lo % 8, hi, _BLOCK):
        nb = (min(_BLOCK, hi - j0) + 7) // 8
        widen_f16(k, g, j0, hi - 1, 8 * nb, _BLOCK, 1, kf, main)  # kf[jj] = K[min(j0 + jj, hi - 1)]
        for hh in range(hp):
            if steps == 0:  # fewer elements than one step: all leftovers
                w[hh, j0 - base : j0 - base + 8 * nb] = 0.0
            elif lanes == 16:
                kq_scores_16(kf, q16, hh, steps, w, hh, j0 - base, nb)
            else:
                kq_scores_8(kf, q16, hh, steps, w, hh, j0 - base, nb)
    if main < E:  # the leftovers, in double
        for hh in range(hp):
            for j in range(lo, hi):
                d = np.float64(w[hh, j - base])
                for e in range(main, E):
                    d += np.float64(half_to_float(k[j, g, e]) * q16[hh, e])
                w[hh, j - base] = _f32(d)


@jit(inline=True)
def _values_ir(v, g, w, hp, base, kv_hi, lanes, acc, out, h0):
    """`_values` of the task's hp heads through `x86_decode_ir.pv_*` (E a multiple of 8), up to 4 heads per
    pass over the V rows: acc (hp * 4 lanes, E)."""
    step = 4 * lanes
    if hp % 4 == 0:
        for h in range(0, hp, 4):
            pv_4(v, g, base, w, h, kv_hi - base, step, acc)
    elif hp % 2 == 0:
        for h in range(0, hp, 2):
            pv_2(v, g, base, w, h, kv_hi - base, step, acc)
    else:
        for h in range(hp):
            pv_1(v, g, base, w, h, kv_hi - base, step, acc)
    for hh in range(hp):
        _reduce_lanes(acc[hh * step : (hh + 1) * step], lanes, out[h0 + hh])


@jit(inline=True)
def _one_task(q, k, v, g, h0, hp, lo, hi, S, n_kv, scale, sinks, lanes, out):
    """Query heads h0 .. h0 + hp - 1 (of KV group g): their outputs out[h0 + hh]. The products go through
    `x86_decode_ir` (E a multiple of 8; the same values), else the loops below."""
    E = q.shape[1]
    step = 4 * lanes
    base = lo - lo % step  # the first 4-lane block the V product reads ...
    end = hi + (-hi) % step  # ... and its end (<= n_kv, a multiple of 256); the cells past S hold zeros
    q16 = np.empty((hp, E), np.float32)
    for hh in range(hp):
        for e in range(E):
            q16[hh, e] = round_f16_lane(q[h0 + hh, e])  # mul_mat converts the queries to F16
    w = np.empty((hp, end - base), np.float32)
    fast = E % 8 == 0 and not DISABLED
    acc = np.empty((hp * step if fast else step, E), np.float32)
    if fast:
        _scores_ir(q16, k, g, hp, lo, hi, lanes, base, w)
    else:
        kf = np.empty(E, np.float32)
        kacc = np.empty(step, np.float32)
        t = np.empty((hp * _KEYS, lanes), np.float32)
        _scores(q16, k, g, hp, lo, hi, lanes, base, kf, kacc, t, w)
    for hh in range(hp):
        sink = sinks[h0 + hh] if sinks.size else _f32(0.0)
        _soft_max_row(w[hh], base, lo, hi, n_kv, scale, lanes, sink, sinks.size > 0)
    if fast:
        _values_ir(v, g, w, hp, base, min(S, end), lanes, acc, out, h0)
    else:
        for hh in range(hp):
            _values(v, g, w[hh], base, min(S, end), lanes, acc, out[h0 + hh])


@jit
def _task_16(q, k, v, g, h0, hp, lo, hi, S, n_kv, scale, sinks, out):
    _one_task(q, k, v, g, h0, hp, lo, hi, S, n_kv, scale, sinks, 16, out)


@jit
def _task_8(q, k, v, g, h0, hp, lo, hi, S, n_kv, scale, sinks, out):
    _one_task(q, k, v, g, h0, hp, lo, hi, S, n_kv, scale, sinks, 8, out)


@functools.cache
def task(lanes: int) -> tuple[int, int]:
    """(address, key) of `_one_task` for `lanes` (16 or 8), compiled for the argument types `_attention_one`
    passes it: q, out (H, E) f32, k, v (S, G, E) u16, sinks (H,) or (0,) f32, all C-contiguous and writable."""
    q, kv, sinks = np.zeros((1, 8), np.float32), np.zeros((1, 1, 8), np.uint16), np.zeros(0, np.float32)
    args = (q, kv, kv, 0, 0, 1, 0, 1, 1, 256, _f32(1.0), sinks, q)
    return native(_task_16 if lanes == 16 else _task_8, args)


@jit(parallel=True)
def _attention_one(q, k, v, p, S, n_kv, scale, window, sinks, task, hp, nt, out):
    """q (H, E) f32 at position p; k, v (S, G, E) f16 bits (u16); sinks (H,) or (0,); task: `task(lanes)`;
    hp query heads per task (a divisor of H / G); out (H, E). The task is called at its address: linked in,
    its code would be optimized again in the parfor body and in this function (~70 s of LLVM per lane count,
    cold cache, against ~10 s)."""
    H = q.shape[0]
    r = H // k.shape[1]
    lo = max(0, p - window + 1) if window > 0 else 0  # the keys this query sees: lo <= j < hi
    hi = min(p + 1, S)
    previous = use_threads(nt)
    for t in prange(H // hp):
        h0 = t * hp
        call_native(task[0], task[1], (q, k, v, h0 // r, h0, hp, lo, hi, S, n_kv, scale, sinks, out))
    use_threads(previous)


def writable(a: np.ndarray, dtype) -> np.ndarray:
    """a as a C-contiguous, writable array of `dtype` (a copy only where it is not): the argument types the
    tasks called at their addresses were compiled for. (np.require costs ~2 us a call, this ~0.3.)"""
    a = np.ascontiguousarray(a, dtype)
    return a if a.flags.writeable else a.copy()


def attention_one(q, k, v, start, scale, window, sinks, lanes, threads, n_kv) -> np.ndarray:
    """`x86.attention` for T = 1 over an f16 cache: q (H, E) f32, k, v (S, G, E) f16, sinks (H,) f32 or (0,);
    returns (H, E) f32. A task takes one KV group's query heads (one pass over its K rows), or a single head
    when there are fewer groups than threads."""
    H, E = q.shape
    G = k.shape[1]
    hp = H // G if G >= threads else 1
    out = np.empty((H, E), np.float32)
    _attention_one(
        writable(q, np.float32),
        writable(k, k.dtype).view(np.uint16),  # the IR products take C-contiguous caches
        writable(v, v.dtype).view(np.uint16),
        start,
        k.shape[0],
        n_kv,
        np.float32(scale),
        window or 0,
        writable(sinks, np.float32),
        task(lanes),
        hp,
        threads,
        out,
    )
    return out
