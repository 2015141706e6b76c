"""Bit-exact emulation of ggml's x86 repacked Q4_K / Q2_K matmul (CPU_REPACK buffer, AVX2 + AVX-512 build).

On x86 with AVX2 llama.cpp stores a Q4_K weight whose row count is a multiple of 8 as `block_q4_Kx8` (and, with
AVX-512, a Q2_K weight as `block_q2_Kx8`): ggml-cpu/repack.cpp `ggml_repack_get_optimal_repack_type` picks
`tensor_traits<block_q4_K|block_q2_K, 8, 8, GGML_TYPE_Q8_K>`. Its `forward_mul_mat` quantizes the activation
rows to Q8_K -- the first T - T%4 rows four at a time with `ggml_quantize_mat_q8_K_4x8` (interleaved
`block_q8_Kx4`), the last T%4 rows with the ordinary `quantize_row_q8_K` -- and then, per chunk of 8-aligned
output columns, runs `gemm` on those first T - T%4 rows and `gemv` on each remaining row. The kernels are in
ggml-cpu/arch/x86/repack.cpp: `ggml_gemm_q4_K_8x8_q8_K`, `ggml_gemv_q4_K_8x8_q8_K`, `ggml_gemm_q2_K_8x8_q8_K`,
`ggml_gemv_q2_K_8x8_q8_K` (the `__AVX2__` gemv, the `__AVX512BW__ && __AVX512DQ__` gemm; the gemm's 16-row /
4-row loops and its AVX2 tail for a leftover 8 columns all do the same float operations per output element).

Each output element y[t, o] is one SIMD lane's sequence of f32 operations; integer sums in the kernels are exact:

    dw = fp16 d of weight row o's super-block b,  mw = its fp16 dmin,  da = f32 d of activation row t's block b
    acc = accm = 0
    for every piece p (super-block b, `piece` elements):
        I = sum over the piece's sub-blocks j of  sc_j * sum_k q_w q_a                    (int32, exact)
        M = sum over the piece's sub-blocks j of  m_j * bsum_j                            (int32, exact)
        acc  = fma(float(I), fl(dw * da), acc)          # _mm512_fmadd_ps(_mm512_cvtepi32_ps(.), _mm512_mul_ps)
        accm = fma(float(M), fl(mw * da), accm)
    y = fl(acc - accm)                                   # _mm512_sub_ps before the store

The piece is what the kernel accumulates in integers before one FMA: the gemm does one FMA per `sb` iteration
(Q4_K: 64 elements = two 32-sub-blocks, Q2_K: 128 elements = eight 16-sub-blocks); the gemv sums its `sb`
iterations in `iacc_b` and does one FMA per 256-element super-block. So the rows that go through gemm and
those that go through gemv round differently, and which rows those are depends on T (T % 4).

`ggml_quantize_mat_q8_K_4x8` gives the same d, quants and bsums as `quantize_row_q8_K_ref` except when a block's
largest |x| occurs both as +m and as -m, -m first: the reference keeps the first (so d > 0), the AVX2 code prefers
the positive one (d < 0), and d, quants and bsums all come out negated. Every float step above pairs da with an
integer built from those quants (fl(dw * -da) * -I = fl(dw * da) * I; rounding is sign-symmetric), so the results
are identical and we take the standard Q8_K rows as input.

When out % 8 != 0 llama.cpp does not repack and mul_mat calls arch/x86/quants.c `ggml_vec_dot_q4_K_q8_K` /
`ggml_vec_dot_q2_K_q8_K` (`__AVX2__` branch) for every element; `_vec_dot` emulates those (eight f32 lanes, one
FMA per super-block, `hsum_float_8`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from ..fields import f16_field, f32_field, i8_field, nibbles
from ..kquants import k4_scales_mins
from .simd import fma, hsum_float_8

__all__ = ["KERNELS", "matmul_q2_k", "matmul_q4_k"]

QK_K = 256
_Q8K_BYTES = 292  # block_q8_K: f32 d, i8 qs[256], i16 bsums[16]
_CHUNK_BYTES = 16 << 20  # per output-row chunk: bound on the decoded weight and on each (T, rows) f64 temporary


# -- weights: integer quants times sub-block scale, mins per 16 elements, super-block d and dmin -----------------


def _q4_k_parts(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """block_q4_K u8[n, 144] -> (sq f32[n, 256] = sc * q, m16 f32[n, 16] min per 16 elements, d, dmin f32[n]).

    qs bytes 32c..32c+31: low nibbles are elements 64c + l (sub-block 2c), high nibbles 64c + 32 + l (2c + 1)."""
    n = blocks.shape[0]
    sc, m = k4_scales_mins(blocks[:, 4:16])  # [n, 8] each, 6-bit
    q = nibbles(blocks[:, 16:144].reshape(n, 4, 32))  # [n, c, t, l] -> element 64c + 32t + l
    sq = (sc.reshape(n, 4, 2, 1).astype(np.float32) * q).reshape(n, QK_K)
    m16 = np.repeat(m.astype(np.float32), 2, axis=1)  # a 32-sub-block's min applies to both of its bsums
    return sq, m16, f16_field(blocks, 0)[:, 0], f16_field(blocks, 2)[:, 0]


def _q2_k_parts(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """block_q2_K u8[n, 84] -> (sq f32[n, 256] = sc * q, m16 f32[n, 16], d, dmin f32[n]).

    Element 128h + 32j + 16k + l is (qs[32h + 16k + l] >> 2j) & 3, in sub-block 8h + 2j + k = element // 16."""
    n = blocks.shape[0]
    sc = (blocks[:, 0:16] & 0x0F).astype(np.float32)
    m16 = (blocks[:, 0:16] >> 4).astype(np.float32)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1, 1)
    q = (blocks[:, 16:80].reshape(n, 2, 1, 2, 16) >> shifts) & 3  # [n, h, j, k, l]
    sq = (sc.reshape(n, 16, 1) * q.reshape(n, 16, 16)).reshape(n, QK_K)
    return sq, m16, f16_field(blocks, 80)[:, 0], f16_field(blocks, 82)[:, 0]


# -- the shared engine -------------------------------------------------------------------------------------------


def _int_sums(qa, bs, sq, m16, e0: int, e1: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' integer accumulators over elements e0..e1 of every (activation row, weight row) pair:
    I = sum sc * q_w * q_a and M = sum m * bsum, each (T, rows) in `dtype`.

    qa f32 (T, n) activation quants, bs f32 (T, n/16) bsums; sq f32 (rows, n) sc * q_w, m16 f32 (rows, n/16). The
    products are integers; a BLAS product sums them exactly, in any order, as long as every partial sum stays
    below 2^24 in f32 (gemm pieces: Q4_K 64 * 63*15 * 127 < 7.7e6, Q2_K 128 * 15*3 * 127 < 7.4e5) or 2^53 in f64."""
    g0, g1 = e0 // 16, e1 // 16
    I = np.matmul(qa[:, e0:e1].astype(dtype, copy=False), sq[:, e0:e1].T.astype(dtype, copy=False))
    M = np.matmul(bs[:, g0:g1].astype(dtype, copy=False), m16[:, g0:g1].T.astype(dtype, copy=False))
    return I, M


def _kernel(qa, bs, da, sq, m16, dw, mw, piece: int) -> np.ndarray:
    """One FMA per `piece` elements into acc (d) and accm (dmin), then acc - accm: f32 (T, rows).

    da f32 (T, nb) activation d per block; dw, mw f32 (rows, nb) the weight's fp16 d and dmin per block."""
    acc = np.zeros((qa.shape[0], sq.shape[0]), np.float32)
    accm = np.zeros_like(acc)
    for e0 in range(0, qa.shape[1], piece):
        b = e0 // QK_K
        if piece < QK_K:  # gemm: the integer sums of one `sb` iteration fit f32 exactly
            I, M = _int_sums(qa, bs, sq, m16, e0, e0 + piece, np.float32)
        else:  # gemv: the super-block's sums can pass 2^24; cvtepi32_ps rounds them once (f64 -> f32 below)
            I, M = (v.astype(np.float32) for v in _int_sums(qa, bs, sq, m16, e0, e0 + piece, np.float64))
        # _mm512_mul_ps(col_scale, row_scale) rounds the scale product to f32 before the FMA
        acc = fma(I, dw[None, :, b] * da[:, b, None], acc)
        accm = fma(M, mw[None, :, b] * da[:, b, None], accm)
    return acc - accm


def _vec_dot(qa, bs, da, sq, m16, dw, mw, q4_k: bool) -> np.ndarray:
    """arch/x86/quants.c `ggml_vec_dot_q4_K_q8_K` / `ggml_vec_dot_q2_K_q8_K`, `__AVX2__` branch: f32 (T, rows).

    Eight f32 lanes; lane L gets the integer sums of the elements with (e % 32) // 4 == L (maddubs then madd
    pair adjacent bytes), each weighted by its sub-block scale, one FMA per super-block:
        d = fl(da * dw);  dmin = -fl(da * mw)
        Q4_K: acc_m[k] = fma(dmin, m_2k bsum32_2k + m_2k+1 bsum32_2k+1, acc_m[k]), k < 4 (an SSE accumulator)
              acc[L] = fma(d, I_L, acc[L]);   y = hsum_float_8(acc) + ((acc_m0 + acc_m2) + (acc_m1 + acc_m3))
        Q2_K: acc[L] = fma(dmin, m_2L bsum16_2L + m_2L+1 bsum16_2L+1, acc[L]);  then acc[L] = fma(d, I_L, acc[L])
              y = hsum_float_8(acc)"""
    T = qa.shape[0]
    rows, nb = dw.shape
    # [b, L, ., 32]: the 32 elements of lane L in block b (8 groups of 32, 4 consecutive elements each)
    qa_l = qa.reshape(T, nb, 8, 8, 4).transpose(1, 3, 0, 2, 4).reshape(nb, 8, T, 32)
    sq_l = sq.reshape(rows, nb, 8, 8, 4).transpose(1, 3, 2, 4, 0).reshape(nb, 8, 32, rows)
    n_min = 4 if q4_k else 8  # lanes of the min accumulator; each takes 4 (Q4_K) or 2 (Q2_K) bsums of 16
    bs_l = bs.reshape(T, nb, n_min, 16 // n_min).transpose(1, 2, 0, 3)  # [b, lane, T, bsums]
    m_l = m16.reshape(rows, nb, n_min, 16 // n_min).transpose(1, 2, 3, 0)  # [b, lane, bsums, rows]
    acc = np.zeros((8, T, rows), np.float32)
    acc_m = np.zeros((4, T, rows), np.float32)
    for b in range(nb):
        d = da[:, b, None] * dw[None, :, b]  # y[i].d * GGML_CPU_FP16_TO_FP32(x[i].d)
        dmin = -(da[:, b, None] * mw[None, :, b])  # -y[i].d * ..(x[i].dmin): negating first is exact
        mins = np.matmul(bs_l[b], m_l[b])  # exact integer sums (< 2^24)
        if q4_k:
            acc_m = fma(dmin, mins, acc_m)
        else:  # Q2_K adds the mins into the same lanes, before the quants
            acc = fma(dmin, mins, acc)
        acc = fma(d, np.matmul(qa_l[b], sq_l[b]), acc)  # lane sums < 32 * 63*15 * 127 < 2^24: exact
    y = hsum_float_8(np.moveaxis(acc, 0, -1))
    if q4_k:
        y = y + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))  # movehl, then add_ss with movehdup
    return y


def _matmul(
    w: np.ndarray, a: np.ndarray, parts: Callable, type_size: int, piece: int, repack: bool = True
) -> np.ndarray:
    w = np.ascontiguousarray(w, np.uint8)
    a = np.ascontiguousarray(a, np.uint8)
    out, T = w.shape[0], a.shape[0]
    nb = w.shape[1] // type_size
    n = nb * QK_K
    if w.shape[1] != nb * type_size or a.shape[1] != nb * _Q8K_BYTES:
        raise ValueError(f"weight rows of {w.shape[1]} bytes and activation rows of {a.shape[1]} bytes do not match")
    ab = a.reshape(T * nb, _Q8K_BYTES)
    da = f32_field(ab, 0).reshape(T, nb)
    qa = i8_field(ab, 4, QK_K).astype(np.float32).reshape(T, n)
    bs = ab[:, 260:292].view("<i2").astype(np.float32).reshape(T, nb * 16)
    y = np.empty((T, out), np.float32)
    repacked = repack and out % 8 == 0  # ggml_repack_get_optimal_repack_type: else the weight stays plain (vec_dot)
    n_gemm = T - T % 4 if repacked else 0  # forward_mul_mat_one_chunk: gemm on nrows - nrows % 4 rows
    # output rows per chunk: the decoded weight (4 bytes an element) and the float64 (8 lanes, T, rows) temporaries
    rows = max(8, _CHUNK_BYTES // max(4 * n, (8 if repacked else 64) * T))
    with np.errstate(over="ignore", invalid="ignore"):  # inf / nan propagate as in ggml
        for o0 in range(0, out, rows):
            sq, m16, dw, mw = parts(w[o0 : o0 + rows].reshape(-1, type_size))
            sq, m16 = sq.reshape(-1, n), m16.reshape(-1, nb * 16)
            dw, mw = dw.reshape(-1, nb), mw.reshape(-1, nb)
            cols = slice(o0, o0 + sq.shape[0])
            if not repacked:
                y[:, cols] = _vec_dot(qa, bs, da, sq, m16, dw, mw, q4_k=piece == 64)
                continue
            if n_gemm:  # ggml_gemm_*_8x8_q8_K: one FMA per sb iteration
                y[:n_gemm, cols] = _kernel(qa[:n_gemm], bs[:n_gemm], da[:n_gemm], sq, m16, dw, mw, piece)
            if n_gemm < T:  # ggml_gemv_*_8x8_q8_K: integer sums over the super-block, then one FMA
                y[n_gemm:, cols] = _kernel(qa[n_gemm:], bs[n_gemm:], da[n_gemm:], sq, m16, dw, mw, QK_K)
    return y


def matmul_q4_k(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Q4_K weight rows times Q8_K activation rows as llama.cpp's CPU backend computes them: u8 (out, row_bytes),
    u8 (T, act_row_bytes) -> f32 (T, out). out % 8 == 0: the repacked q4_K_8x8_q8_K gemm/gemv (AVX2 machines);
    otherwise the plain `ggml_vec_dot_q4_K_q8_K`."""
    return _matmul(w, a, _q4_k_parts, 144, piece=64)


def matmul_q2_k(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Q2_K weight rows times Q8_K activation rows: out % 8 == 0, the repacked q2_K_8x8_q8_K gemm/gemv (chosen
    on AVX-512 machines); otherwise the plain `ggml_vec_dot_q2_K_q8_K`."""
    return _matmul(w, a, _q2_k_parts, 84, piece=128)


def vec_dot_q2_k(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """`matmul_q2_k` on an AVX2 build, which keeps Q2_K weights plain: `ggml_vec_dot_q2_K_q8_K` for any shape."""
    return _matmul(w, a, _q2_k_parts, 84, piece=128, repack=False)


KERNELS: dict[GGMLType, Callable] = {GGMLType.Q4_K: matmul_q4_k, GGMLType.Q2_K: matmul_q2_k}
