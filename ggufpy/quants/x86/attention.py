"""Bit-exact NumPy emulation of llama.cpp's attention without flash attention, on its x86 AVX-512 and AVX2 builds.

What llama.cpp runs for one ubatch of T queries (src/llama-graph.cpp `build_attn_mha`, flash attention off,
f16 KV cache in the `v_trans` layout), per query head h of KV group g = h // (H/G):

    kq   = mul_mat(K_g, fp16(Q_h))          K_g: (n_kv, E) f16 cache rows; Q rounded to f16, the vec_dot type
                                            of F16 (ggml-cpu.c `ggml_compute_forward_mul_mat`: Q's permuted view
                                            is not contiguous, so the f32 tinyBLAS call is skipped)
    kq   = cap * tanhf(kq * (1/cap))        gemma2 only: ggml_scale, ggml_tanh (libm `tanhf`), ggml_scale
    p    = soft_max_ext(kq, mask, scale)    ops.cpp `ggml_compute_forward_soft_max_f32`, max_bias 0
    kqv  = mul_mat(V_g^T, fp16(p))          V_g^T: (E, n_kv) f16 rows of the transposed V cache

Both products are F16 mul_mats: `floats.matmul_f16` (tinyBLAS<16, __m512> when T >= 2, the inner size is a
multiple of 16 and the output one of 4, else `ggml_vec_dot_f16`). The cache is padded: llama-kv-cache.cpp
`get_n_kv` gives n_kv = min(cache size, max(256, GGML_PAD(used cells, 256))); the cells past the S used ones
hold zeros in a fresh cache and are masked with -inf. n_kv decides which F16 kernel runs and how the softmax
sums, so K and V are zero-padded to n_kv before the products, and every output is computed over n_kv columns.
`attention` returns kqv_out; `attention_parts` also returns kq and kq_soft_max, as llama.cpp's graph holds them.

soft_max_ext, per row of n_kv scores (ops.cpp `ggml_compute_forward_soft_max_f32`):

    w    = kq * scale                      `ggml_vec_scale_f32`, f32 multiply
    w    = w + mask                        mask 0 or -inf (slope 1: the `slope*mask` FMA is the same add)
    m    = max(w)                          `ggml_vec_max_f32`, scalar loop (order-free)
    e    = ggml_v_expf(w - m)              vec.h, `__AVX512F__ && __AVX512DQ__` branch (`unary.v_expf_512`)
    sum  = sum over 16-blocks i, in order, of (double) _mm512_reduce_add_ps(e[16i : 16i+16])   (vec.cpp
           `ggml_vec_soft_max_f32`; a scalar tail with libm `expf` for n % 16, never reached here: n_kv % 256 == 0)
    p    = e * (float)(1.0 / sum)          double division, rounded to f32 for `ggml_vec_scale_f32`

On an AVX2 build (`isa="avx2"`, no AVX-512: `simd.ISAS`) the same steps run 8 lanes wide: `ggml_v_expf`'s AVX2
branch (`unary.v_expf_256`), 8-blocks summed by `hsum_float_8`, and both F16 products as tinyBLAS<8, __m256>
or the AVX `ggml_vec_dot_f16` (`floats.matmul_f16(..., isa="avx2")`). Everything else is scalar and the same.

`ggml_v_expf` and glibc 2.36's `tanhf` (the softcap) are replayed in `unary.py`.
"""

from __future__ import annotations

import numpy as np

from ...ops import ATTENTION_BUDGET, query_blocks, query_rows
from .floats import matmul_f16
from .simd import hsum_float_8, reduce_add_ps_512
from .unary import V_EXPF, _libm_expf, tanhf_glibc

__all__ = [
    "KV_PAD",
    "attention",
    "attention_parts",
    "n_kv_cells",
    "soft_max_ext",
    "vec_soft_max_f32",
]

KV_PAD = 256  # llama-kv-cache.cpp `get_n_kv`: n_pad_cur = max(n_pad, 256)

_f32 = np.float32
_HSUM = {"avx512": reduce_add_ps_512, "avx2": hsum_float_8}  # the horizontal sum of one exp block, by build


# -- soft_max_ext (ggml-cpu/ops.cpp ggml_compute_forward_soft_max_f32) ----------------------------------------------


def vec_soft_max_f32(x: np.ndarray, mx: np.ndarray, isa: str = "avx512") -> tuple[np.ndarray, np.ndarray]:
    """vec.cpp `ggml_vec_soft_max_f32(n, y, x, max)` on rows (..., n) f32 with their max (...,) or (..., 1):
    returns (y f32 (..., n), sum float64 (...,)). On `isa="avx2"` blocks of 8: `v_expf_256`, `hsum_float_8`.

    `__AVX512F__ && __AVX512DQ__` branch: for each block of 16, y = ggml_v_expf(x - max) and
    `sum += (ggml_float)_mm512_reduce_add_ps(y)`, block after block; then the scalar tail for n % 16,
    `y = expf(x - max)` (libm), `sum += (ggml_float)y`. The tail is replayed with a correctly rounded exp, not
    glibc's expf (not always correctly rounded): not verified bit for bit, and never reached by `attention`,
    whose rows hold n_kv cells, a multiple of 256."""
    v_expf, width = V_EXPF[isa]
    x = np.asarray(x, _f32)
    mx = np.asarray(mx, _f32).reshape(*x.shape[:-1], 1)
    n = x.shape[-1]
    main = n - n % width
    y = np.empty_like(x)
    total = np.zeros(x.shape[:-1], np.float64)
    if main:
        y[..., :main] = v_expf(x[..., :main] - mx)  # _mm512_sub_ps / _mm256_sub_ps, then ggml_v_expf
        blocks = _HSUM[isa](y[..., :main].reshape(*x.shape[:-1], main // width, width))  # (..., n/width) f32
        for i in range(main // width):  # in block order: the double sum is not associative
            total += blocks[..., i]
    for i in range(main, n):
        y[..., i] = np.exp((x[..., i] - mx[..., 0]).astype(np.float64)).astype(_f32)
        total += y[..., i]
    return y, total


def soft_max_ext(
    kq: np.ndarray, mask: np.ndarray | None, scale: float, isa: str = "avx512", sink: float | None = None
) -> np.ndarray:
    """`ggml_soft_max_ext(kq, mask, scale, max_bias=0)` over the last axis: kq f32 (..., n); mask (..., n)
    broadcastable, 0 or -inf (f16 or f32 in ggml: the same values), or None. Returns f32 (..., n).

    w = kq * scale; w += mask; (e, sum) = `vec_soft_max_f32(w, max(w))`; p = e * (float)(1.0 / sum).
    With `sink` (this head's `ggml_soft_max_add_sinks` value, gpt-oss): max = MAX(max, sink) before the exps,
    then sum += (ggml_float) expf(sink - max), the C library's expf."""
    w = np.asarray(kq, _f32) * _f32(scale)  # ggml_vec_scale_f32: one f32 multiply per element
    if mask is not None:
        w = w + np.asarray(mask, _f32)  # wp[i] += slope*mask[i], slope = 1.0f: an exact add of 0 or -inf
    mx = w.max(axis=-1)  # ggml_vec_max_f32: a max, in any order
    if sink is not None:
        mx = np.where(mx > _f32(sink), mx, _f32(sink))  # MAX(max, sink[h])
    e, total = vec_soft_max_f32(w, mx, isa)
    if sink is not None:
        total = total + np.array([_expf(d) for d in (_f32(sink) - mx).reshape(-1).tolist()]).reshape(total.shape)
    with np.errstate(divide="ignore"):
        inv = (1.0 / total).astype(_f32)  # `sum = 1.0/sum` in double, passed to ggml_vec_scale_f32 as a float
    return e * inv[..., None]


# -- attention --------------------------------------------------------------------------------------------------


def _expf(x: float) -> float:
    """The C library's expf of one f32 (ggml's scalar code); the correctly rounded value without one."""
    f = _libm_expf()
    return float(f(x)) if f is not None else float(np.float32(np.exp(np.float64(x))))


def n_kv_cells(S: int, cache_size: int | None = None) -> int:
    """llama-kv-cache.cpp `get_n_kv` for a cache filled from cell 0 with S positions: the number of cells the
    attention reads, max(256, GGML_PAD(S, 256)), at most the cache size."""
    n = max(KV_PAD, -(-S // KV_PAD) * KV_PAD)
    return n if cache_size is None else min(cache_size, n)


def _mask(start: int, T: int, S: int, n_kv: int, window: int | None) -> np.ndarray:
    """kq_mask (T, n_kv): 0 where query t (position start + t) sees cell j, -inf elsewhere: future positions,
    cells past the S filled ones, and with `window` keys at distance >= window (llama-hparams.cpp
    `is_masked_swa`, LLAMA_SWA_TYPE_STANDARD: p1 - p0 >= n_swa)."""
    distance = (start + np.arange(T))[:, None] - np.arange(n_kv)[None, :]
    masked = (distance < 0) | (np.arange(n_kv) >= S)[None, :]
    if window is not None:
        masked |= distance >= window
    return np.where(masked, _f32(-np.inf), _f32(0))


def _f16_rows(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, _f32).astype(np.float16)  # ggml_cpu_fp32_to_fp16: nearest even


def _f16_matmul(w: np.ndarray, a: np.ndarray, isa: str) -> np.ndarray:
    """F16 mul_mat of f16 rows w (O, n) by the f16 rows a (r, T, n) of the r query heads that share w:
    (r, T, O). ggml runs one mul_mat per head; which kernel it takes depends on T only through T >= 2
    (`llamafile_sgemm` declines T < 2) and tinyBLAS computes every element alike whatever the tiling, so for
    T >= 2 the heads' rows go to `matmul_f16` together."""
    r, T, n = a.shape
    if T >= 2:
        return matmul_f16(w, a.reshape(r * T, n), isa).reshape(r, T, -1)
    return np.stack([matmul_f16(w, a[h], isa) for h in range(r)])


def _attention_groups(q, k, v, start, scale, window, softcap, n_kv, isa, sinks=None, budget=ATTENTION_BUDGET):
    """Yield (g, rows, kq, kq_soft_max, kqv) for each KV group g and block of queries `rows` (a slice of T):
    (r, t, n_kv), (r, t, n_kv), (r, t, E) for its r = H/G query heads (ggml_mul_mat broadcasting: query head h
    reads K/V group h // r) and the t queries of the block. A group and a block at a time bound the temporaries
    by `budget` bytes of scores (`ops.query_rows`); every element is computed as in one block of all T rows
    (the replayed kernels depend on T only through T >= 2, and every block of T >= 2 rows has >= 2 rows).
    `sinks` (H,) f32: each query head's sink logit (gpt-oss), or None."""
    T, H, E = q.shape
    S, G, _ = k.shape
    if v.shape != k.shape or H % G:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: need k, v (S, G, E) with G dividing H")
    if S < start + T:
        raise ValueError(f"{S} cached positions cannot hold queries at positions {start}..{start + T - 1}")
    if n_kv < S:
        raise ValueError(f"n_kv = {n_kv} cells cannot hold {S} positions")
    r = H // G
    q16 = _f16_rows(q).reshape(T, G, r, E)  # mul_mat converts the f32 queries to F16's vec_dot type
    blocks = query_blocks(T, query_rows(T, n_kv, r, 4, budget))
    for g in range(G):
        kc = np.zeros((n_kv, E), np.float16)  # the K cache view: n_kv rows of E, zeros past S
        kc[:S] = _f16_rows(k[:, g])  # the f16 cache
        vt = np.zeros((E, n_kv), np.float16)  # the transposed V cache view: E rows of n_kv cells
        vt[:, :S] = _f16_rows(v[:, g]).T
        sink = [None] * r if sinks is None else [_f32(s) for s in sinks[g * r : (g + 1) * r]]
        for rows in blocks:
            mask = _mask(start + rows.start, rows.stop - rows.start, S, n_kv, window)  # (t, n_kv), every head's
            kq = _f16_matmul(kc, q16[rows, g].transpose(1, 0, 2), isa)  # (r, t, n_kv)
            if softcap:
                cap = _f32(softcap)
                kq = kq * (_f32(1) / cap)  # ggml_scale(kq, 1.0f / cap): the reciprocal in f32, then f32 multiplies
                kq = tanhf_glibc(kq)  # ggml_tanh: libm `tanhf` per element
                kq = kq * cap  # ggml_scale(kq, cap)
            probs = np.stack([soft_max_ext(kq[h], mask, scale, isa, sink[h]) for h in range(r)])  # a head at a time
            kqv = _f16_matmul(vt, probs.astype(np.float16), isa)  # mul_mat converts kq_soft_max to f16: (r, t, E)
            yield g, rows, kq, probs, kqv


def attention_parts(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    n_kv: int | None = None,
    isa: str = "avx512",
    sinks: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """`attention` with its intermediate tensors, as llama.cpp's graph nodes hold them: kq (H, T, n_kv) f32
    (after the softcap, if any: llama.cpp's `kq_scaled_2-N`, else `kq-N`), kq_soft_max (H, T, n_kv) f32 and
    kqv_out (T, H*E) f32. `n_kv` overrides the number of cache cells read (default `n_kv_cells(S)`); `isa` is the
    x86 build replayed (`simd.ISAS`)."""
    T, H, E = q.shape
    n_kv = n_kv_cells(k.shape[0]) if n_kv is None else n_kv
    r = H // k.shape[1]
    kq = np.empty((H, T, n_kv), _f32)
    probs = np.empty((H, T, n_kv), _f32)
    out = np.empty((T, H, E), _f32)
    for g, rows, kq_g, probs_g, kqv_g in _attention_groups(q, k, v, start, scale, window, softcap, n_kv, isa, sinks):
        heads = slice(g * r, (g + 1) * r)
        kq[heads, rows], probs[heads, rows], out[rows, heads] = kq_g, probs_g, kqv_g.transpose(1, 0, 2)
    return {"kq": kq, "kq_soft_max": probs, "kqv_out": out.reshape(T, H * E)}


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    isa: str = "avx512",
    sinks: np.ndarray | None = None,
    budget: int = ATTENTION_BUDGET,
) -> np.ndarray:
    """llama.cpp's non-flash attention on x86 (the `isa` build: `simd.ISAS`), bit for bit, with
    `numerics.attention_ggml`'s contract: q (T, H, E) f32 queries at positions start..start+T-1 (after RoPE,
    and for gemma after the f32 Q scaling); k, v (S, G, E) the keys and values of positions 0..S-1 (rounded to
    f16 here, as the cache stores them); `window` the sliding window; `softcap` gemma2's attention logit
    softcap; `sinks` (H,) gpt-oss's per-head sink logits (`soft_max_ext`). Returns kqv_out (T, H*E) f32, the
    heads side by side (`ggml_cont_2d` of the permuted kqv). The queries go in blocks of at most `budget` bytes
    of scores per KV group (memory O(rows x S), not O(T x S)); the result does not depend on the block.

    `scale` is used as an f32: pass llama.cpp's `kq_scale` as it computes it, `np.float32(1) /
    np.sqrt(np.float32(E))` (1.0f/sqrtf(E)); float32(1/sqrt(E)) from a float64 differs in the last bit for
    E = 24, 96, 112, ... and then kq_soft_max no longer matches.

    Assumes the cache holds exactly positions 0..S-1 in cells 0..S-1 (a prompt, then further ubatches, within
    the cache size; so n_kv = max(256, GGML_PAD(S, 256))) and zeros in the cells past S."""
    T, H, E = q.shape
    out = np.empty((T, H, E), _f32)
    r = H // k.shape[1]
    n_kv = n_kv_cells(k.shape[0])
    for g, rows, _, _, kqv in _attention_groups(q, k, v, start, scale, window, softcap, n_kv, isa, sinks, budget):
        out[rows, g * r : (g + 1) * r] = kqv.transpose(1, 0, 2)
    return out.reshape(T, H * E)
