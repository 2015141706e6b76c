"""The NumPy replays of llama.cpp's x86 attention and SiLU (`quants/x86/`), compiled: bit for bit the same.

`quants.x86.attention.attention` and `quants.x86.unary.silu_rows` emulate each f32 FMA in float64 and cost
seconds per prefill; they made the llamacpp numerics (`--numerics host`) 4-9x slower than the exact ones at
512-token chunks. Here each is one compiled call. Nothing is approximated: the FMAs are LLVM's exact
`llvm.fma.f32` (`_numba.fma_f32`), the F16 products are exact in f32 (two 11-bit significands), so a lane's
`acc + w * a` is the same single rounding as ggml's FMA, and every lane, horizontal sum and double sum is
kept in ggml's order. No fastmath anywhere (a contracted or reassociated step would change bits).

    attention(q, k, v, start, scale, window, isa, sinks)  == quants.x86.attention.attention (no softcap)
    silu_rows(x, isa)                                     == quants.x86.unary.silu_rows

Each (query, head) is one task of a parallel loop; a task computes its outputs serially in ggml's order, so
the result does not depend on the thread count. A decoded token (T = 1) over the f16 cache goes to
`x86_decode.attention_one` instead: the same sums, vectorized, 2.5-3x faster.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from ..quants.x86.attention import n_kv_cells
from ._numba import call_native, get_threads, half_to_float, jit, native, prange, use_threads
from .glue_ggml import _libm_expf, round_f16, round_f16_array, v_expf
from .x86_decode import _soft_max_row, attention_one, v_expf_256, writable

__all__ = ["ISA_LANES", "attention", "silu_rows", "v_expf_256"]

_f32 = np.float32
ISA_LANES = {"avx512": 16, "avx2": 8}  # f32 lanes of one vector register, by x86 build (`quants.x86.simd.ISAS`)


@jit(inline=True)
def _v_expf(x, wide):
    """The build's ggml_v_expf: AVX-512's (`glue_ggml.v_expf`) when `wide`, else AVX2's."""
    return v_expf(x) if wide else v_expf_256(x)


# -- SiLU (vec.cpp ggml_vec_swiglu_f32 / ggml_vec_silu_f32) ------------------------------------------------------


@jit
def _silu_rows(x, lanes, out):
    rows, n = x.shape
    body = n - n % lanes
    one = np.float32(1.0)
    wide = lanes == 16
    for r in range(rows):
        for i in range(body):  # ggml_v_silu: x / (1 + ggml_v_expf(0 - x))
            v = x[r, i]
            out[r, i] = v / (one + _v_expf(np.float32(0.0) - v, wide))
        for i in range(body, n):  # the scalar tail, ggml_silu_f32 with the C library's expf
            v = x[r, i]
            out[r, i] = v / (one + _libm_expf(-v))


def silu_rows(x: np.ndarray, isa: str = "avx512") -> np.ndarray:
    """`quants.x86.unary.silu_rows(x, isa)`, compiled: SiLU of f32 rows (..., n)."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    x2 = x.reshape(-1, n) if x.ndim != 2 else x
    out = np.empty(x2.shape, np.float32)
    _silu_rows(x2, ISA_LANES[isa], out)
    return out.reshape(x.shape)


# -- the F16 dot products of the two attention mul_mats (`quants.x86.floats`, exact products) --------------------
#
# One output of an F16 mul_mat keeps one f32 accumulator per lane: tinyBLAS<lanes> one register (acc_i over the
# elements i, i + lanes, ...), `ggml_vec_dot_f16` four (4 * lanes accumulators over steps of 4 * lanes). Here
# the accumulators of many outputs are updated together, `acc[i, j] += w[l + i, j] * a[l + i]` with the outputs j
# innermost: each accumulator still sees its own sequence of roundings, and the loop over j vectorizes without
# reassociating anything. The products of two f16 values are exact in f32, so each add is ggml's FMA.


@jit(inline=True)
def _hsum(x, lanes):
    """`hsum_float_8` (AVX2) or `_mm512_reduce_add_ps` (AVX-512) of x[:lanes]."""
    if lanes == 8:
        return ((x[4] + x[0]) + (x[6] + x[2])) + ((x[5] + x[1]) + (x[7] + x[3]))
    u0 = (x[12] + x[4]) + (x[8] + x[0])
    u1 = (x[13] + x[5]) + (x[9] + x[1])
    u2 = (x[14] + x[6]) + (x[10] + x[2])
    u3 = (x[15] + x[7]) + (x[11] + x[3])
    return (u0 + u2) + (u1 + u3)


@jit(inline=True)
def _accumulate(wt, c0, cols, a, n, width, acc, lo, hi):
    """acc[i, j] = sum over l = 0, width, 2 width, ... < n of wt[l + i, c0 + j] * a[l + i] for j < cols, in order
    of l, where a[l] = 0 outside lo <= l < hi: those steps add +-0 to accumulators that are never -0, and are
    skipped. The loop over j runs on 1-D row slices (unit stride known: it vectorizes; on 2-D column slices of
    wt and acc, with run-time strides, it stayed scalar)."""
    for i in range(width):
        acc[i, :cols] = 0.0
    for l in range(lo - lo % width, min(n, hi), width):
        for i in range(width):
            ai = a[l + i]
            src = wt[l + i, c0 : c0 + cols]
            dst = acc[i, :cols]
            for j in range(cols):
                dst[j] += src[j] * ai


@jit(inline=True)
def _hsum_into(acc, lanes, cols, out):
    """out[j] = tinyBLAS's `hsum` of acc[:lanes, j] (j < cols): `hsum_float_8` (AVX2) or `_mm512_reduce_add_ps`."""
    for j in range(cols):
        if lanes == 8:
            out[j] = ((acc[4, j] + acc[0, j]) + (acc[6, j] + acc[2, j])) + (
                (acc[5, j] + acc[1, j]) + (acc[7, j] + acc[3, j])
            )
        else:
            u0 = (acc[12, j] + acc[4, j]) + (acc[8, j] + acc[0, j])
            u1 = (acc[13, j] + acc[5, j]) + (acc[9, j] + acc[1, j])
            u2 = (acc[14, j] + acc[6, j]) + (acc[10, j] + acc[2, j])
            u3 = (acc[15, j] + acc[7, j]) + (acc[11, j] + acc[3, j])
            out[j] = (u0 + u2) + (u1 + u3)


@jit(inline=True)
def _vec_dot_into(wt, c0, cols, a, n, lanes, acc, out, lo, hi):
    """out[j] = `ggml_vec_dot_f16` of column c0 + j of wt (n, .) with a (n,): four registers over steps of
    4 * lanes, (r0 + r2) + (r1 + r3), the reduce (`hadd_reduce_8` on AVX2), then the n % (4 * lanes) leftovers
    in double."""
    step = 4 * lanes
    main = n - n % step
    _accumulate(wt, c0, cols, a, main, step, acc, lo, hi)
    for i in range(lanes):
        for j in range(cols):
            acc[i, j] = (acc[i, j] + acc[2 * lanes + i, j]) + (acc[lanes + i, j] + acc[3 * lanes + i, j])
    if lanes == 8:
        for j in range(cols):
            out[j] = ((acc[0, j] + acc[4, j]) + (acc[1, j] + acc[5, j])) + (
                (acc[2, j] + acc[6, j]) + (acc[3, j] + acc[7, j])
            )
    else:
        _hsum_into(acc, lanes, cols, out)
    if main < n:
        for j in range(cols):
            s = np.float64(out[j])
            for l in range(main, n):
                s += np.float64(wt[l, c0 + j] * a[l])
            out[j] = np.float32(s)


@jit(inline=True)
def _f16_products(wt, c0, cols, a, n, lanes, tinyblas, acc, out, lo, hi):
    """out[j] = the F16 mul_mat's output j < cols for the f16 rows wt[:, c0 + j] (n values down the column) and
    a (n,), whose values outside lo <= l < hi are 0."""
    if tinyblas:
        _accumulate(wt, c0, cols, a, n, lanes, acc, lo, hi)
        _hsum_into(acc, lanes, cols, out)
    else:
        _vec_dot_into(wt, c0, cols, a, n, lanes, acc, out, lo, hi)


# -- attention (`quants.x86.attention`: mul_mat, soft_max_ext, mul_mat) --------------------------------------------

_KEYS = 256  # outputs of the KQ product computed together: accumulators (4 * lanes, 256) stay in L1/L2


@jit(inline=True)
def _soft_max(w, lo, hi, scale, lanes, sinks, h):
    """w (n_kv,): the scores of keys lo <= j < hi in, fp16(soft_max_ext(w, mask, scale)) out, zeros elsewhere:
    `x86_decode._soft_max_row` (the same steps as `quants.x86.attention`, as branch-free lanes that vectorize).
    sinks: each head's sink logit (H,), or none (0,); h: this row's head."""
    has_sink = sinks.size > 0
    _soft_max_row(w, 0, lo, hi, w.size, scale, lanes, sinks[h] if has_sink else _f32(0.0), has_sink)


@jit
def _query(q16, kt, vc, t, h, start, S, scale, window, sinks, lanes, tb_kq, tb_kqv, out):
    """out[t, h]: query t of head h (see `_attention`)."""
    n_kv = vc.shape[1]
    E = q16.shape[2]
    g = h // (q16.shape[1] // vc.shape[0])
    p = start + t
    acc = np.empty((4 * lanes, max(_KEYS, E)), np.float32)
    w = np.empty(n_kv, np.float32)
    lo = max(0, p - window + 1) if window > 0 else 0  # the keys this query sees: lo <= j < hi
    hi = min(p + 1, S)
    for j0 in range(lo - lo % _KEYS, hi, _KEYS):  # kq = mul_mat(K, fp16(q)), a block of keys at a time
        # each output is its own column's sum, so the masked keys past hi (-inf below) are not computed
        j1 = min(j0 + _KEYS, hi)
        _f16_products(kt[g], j0, j1 - j0, q16[t, h], E, lanes, tb_kq, acc, w[j0:j1], 0, E)
    _soft_max(w, lo, hi, scale, lanes, sinks, h)
    _f16_products(vc[g], 0, E, w, n_kv, lanes, tb_kqv, acc, out[t, h], lo, hi)  # kqv = mul_mat(V^T, fp16(p))


@functools.cache
def _query_task() -> tuple[int, int]:
    """(address, key) of `_query` for the argument types `_attention` passes it (C-contiguous, writable)."""
    a3, a1 = np.zeros((1, 1, 8), np.float32), np.zeros(0, np.float32)
    return native(_query, (a3, a3, a3, 0, 0, 0, 1, _f32(1.0), 0, a1, 8, False, False, a3))


@jit(parallel=True)
def _attention(q16, kt, vc, start, S, scale, window, sinks, lanes, task, nt, out):
    """q16 (T, H, E), kt (G, E, n_kv), vc (G, n_kv, E): f32 holding f16 values (zeros past S); sinks (H,) or
    (0,); task: `_query_task()`, called at its address (linked in, its code is optimized again in the parfor
    body: 22 s of a cold compile against ~5); out (T, H, E)."""
    T, H, E = q16.shape
    n_kv = vc.shape[1]
    tb_kq = T >= 2 and E % lanes == 0  # tinyBLAS takes the product (`float_matmul`); n_kv % 4 == 0 always
    tb_kqv = T >= 2 and n_kv % lanes == 0 and E % 4 == 0
    previous = use_threads(nt)
    for i in prange(T * H):
        args = (q16, kt, vc, i // H, i % H, start, S, scale, window, sinks, lanes, tb_kq, tb_kqv, out)
        call_native(task[0], task[1], args)
    use_threads(previous)


@jit
def _cache_layout(k, v, f16_bits, kt, vc):
    """kt[g, e, j] = K[j, g, e] and vc[g, j, e] = V[j, g, e] as f16 values in f32, from an f16 cache (u16 bits)
    or from f32 keys and values rounded to f16 as the cache stores them."""
    S, G, E = k.shape
    for j in range(S):
        for g in range(G):
            for e in range(E):
                if f16_bits:
                    kt[g, e, j] = half_to_float(k[j, g, e])
                    vc[g, j, e] = half_to_float(v[j, g, e])
                else:
                    kt[g, e, j] = round_f16(k[j, g, e])
                    vc[g, j, e] = round_f16(v[j, g, e])


_buffers = threading.local()
_NO_SINKS = np.empty(0, np.float32)


def _layout_buffers(G: int, E: int, n_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's f32 copies of the cache in the kernel's layout, reused from call to call: a fresh pair
    per call (up to 2 x 512 KB per layer at 256 cells) cost more in page faults than the attention itself."""
    pair = getattr(_buffers, "pair", None)
    if pair is None or pair[0].shape != (G, E, n_kv):
        pair = _buffers.pair = (np.empty((G, E, n_kv), np.float32), np.empty((G, n_kv, E), np.float32))
    return pair


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    isa: str = "avx512",
    threads: int | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """`quants.x86.attention.attention(q, k, v, start, scale, window, isa=isa, sinks=sinks)`, compiled (no
    softcap: glibc's tanhf is replayed in NumPy only). q (T, H, E) f32, k, v (S, G, E), sinks (H,) gpt-oss's
    sink logits or None; returns (T, H*E) f32."""
    T, H, E = q.shape
    S, G, _ = k.shape
    if v.shape != k.shape or H % G or S < start + T:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} at start {start}: not an attention of the cache")
    n_kv = n_kv_cells(S)
    nt = get_threads() if threads is None else threads
    sinks = _NO_SINKS if sinks is None else np.ascontiguousarray(sinks, np.float32).reshape(H)
    if T == 1 and k.dtype == np.float16 and v.dtype == np.float16:  # a decoded token over the f16 cache
        return attention_one(q[0], k, v, start, scale, window, sinks, ISA_LANES[isa], nt, n_kv).reshape(1, H * E)
    q16 = round_f16_array(q)  # mul_mat converts the queries to F16's vec_dot type
    kt, vc = _layout_buffers(G, E, n_kv)  # K: each group's keys as columns; V: columns = rows of ggml's V^T
    vc[:, S:] = 0.0  # zeros past S, as llama.cpp's padded cells: read (times p = 0) by the last lane block
    f16 = k.dtype == np.float16 and v.dtype == np.float16
    k, v = (a.view(np.uint16) if f16 else np.asarray(a, np.float32) for a in (k, v))
    _cache_layout(k, v, f16, kt, vc)
    out = np.empty((T, H, E), np.float32)
    sinks = writable(sinks, np.float32)  # the types `_query_task` was compiled for
    _attention(q16, kt, vc, start, S, np.float32(scale), window or 0, sinks, ISA_LANES[isa], _query_task(), nt, out)
    return out.reshape(T, H * E)
