"""Bit-exact NumPy emulation of ggml's x86 AVX2 dot products of Q3_K, Q5_K and Q6_K weights with Q8_K activations.

Follows llama.cpp `ggml/src/ggml-cpu/arch/x86/quants.c`, the `#if defined __AVX2__` branch of
`ggml_vec_dot_q3_K_q8_K`, `ggml_vec_dot_q5_K_q8_K` and `ggml_vec_dot_q6_K_q8_K` (these three kernels have no
`__AVX512F__` branch, so an AVX-512 build runs the AVX2 code). On x86 llama.cpp's mul_mat reaches them for every
row: `ggml_repack_get_optimal_repack_type` (ggml-cpu/repack.cpp) repacks Q5_K/Q6_K only for ARM NEON and never
Q3_K, and tinyBLAS (llamafile/sgemm.cpp `llamafile_sgemm`) has no k-quant case.

Float operations, per output element (weight row . activation row of nb super-blocks of 256):

    acc[0..7] = 0                                         8 f32 lanes of a __m256
    for each super-block i:
        d = f32(y[i].d * fp16(x[i].d))                    scalar f32 product
        sumi[k] = exact int32 per lane k (see below)      integer SIMD arithmetic, no rounding
        acc[k] = fma(d, f32(sumi[k]), acc[k])             _mm256_fmadd_ps, one rounding; cvtepi32_ps rounds too
        Q5_K only: summs = fma(dmin, f32(m), summs)       scalar `summs += dmin * m`, contracted by GCC into
                                                          vfmadd231ss (checked in libggml-cpu.so); dmin =
                                                          f32(-y[i].d * fp16(x[i].dmin)), m = sum of mins *
                                                          bsums (exact int)
    result = hsum_float_8(acc)          (+ summs for Q5_K, one f32 add)

Lane k of `sumi` is the 32-bit lane k of the 256-bit integer accumulator: `_mm256_maddubs_epi16` and
`_mm256_madd_epi16` add adjacent pairs without crossing lanes, so lane k collects bytes 4k..4k+3 of every
32-element chunk of the super-block: element e goes to lane (e % 32) // 4. Q6_K's kernel multiplies the
unsigned 6-bit quants and subtracts 32 * (bsums . scales) per lane afterwards, where lane k holds the
16-element groups 2k and 2k+1 (a different element set), so its lanes are reproduced with that split.

The integer lane sums are computed as float64 matmuls: every product and partial sum is an integer below
2^53, so BLAS evaluates them exactly in any order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from ..fields import f16_field, f32_field, i8_field, nibbles
from ..kquants import _q3_k_scales, _two_bit_planes, k4_scales_mins
from .simd import fma, hsum_float_8

__all__ = ["KERNELS", "matmul_q3_k", "matmul_q5_k", "matmul_q6_k"]

QK_K = 256
_Q8K_BYTES = 292  # block_q8_K: d f32, qs i8[256], bsums i16[16]
_LANES = 8
_CHUNK_BYTES = 32 << 20  # bound on the largest float64 temporary
_GEMM_CELLS = 4 * 65536  # OpenBLAS interface/gemm.c: M*N*K <= 4 * SMP_THRESHOLD_MIN runs single-threaded


def _lanes(v: np.ndarray) -> np.ndarray:
    """(..., 256) in element order -> (..., 8 lanes, 32): lane k holds elements 32c + 4k + r, ordered (c, r)."""
    return np.swapaxes(v.reshape(*v.shape[:-1], 8, _LANES, 4), -3, -2).reshape(*v.shape[:-1], _LANES, 32)


# ---------------------------------------------------------------------------------------------------------------
# Integer weights per super-block, in element order (the layouts are documented in ggufpy/quants/kquants.py)


def _q3_k_ints(blocks: np.ndarray) -> np.ndarray:
    """block_q3_K u8[n, 110] -> i32[n, 256] = (s - 32) * (q_low - 4 * !hbit): what the AVX2 kernel multiplies
    into its lanes (maddubs of the low bits minus maddubs of the 4s, then madd with the scales)."""
    n = blocks.shape[0]
    hmask = blocks[:, 0:32].reshape(n, 1, 1, 2, 16)  # [k, l]
    bit = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1, 1)  # 4h + j
    q = _two_bit_planes(blocks[:, 32:96]).astype(np.int32) - ((((hmask >> bit) & 1) ^ 1) << 2)  # [n, h, j, k, l]
    sc = _q3_k_scales(blocks[:, 96:108]).astype(np.int32).reshape(n, 2, 4, 2, 1)  # sub-block 8h + 2j + k
    return (sc * q).reshape(n, QK_K)


def _q5_k_ints(blocks: np.ndarray) -> np.ndarray:
    """block_q5_K u8[n, 176] -> sc * q i32[n, 256] in element order (q = 5-bit, 0..31; the mins go through bsums)."""
    n = blocks.shape[0]
    sc, _ = k4_scales_mins(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(n, 1, 1, 32)
    bit = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)  # 2c + t
    q = nibbles(blocks[:, 48:176].reshape(n, 4, 32)) | (((qh >> bit) & 1) << 4)  # [n, c, t, l]: 64c + 32t + l
    return (sc.astype(np.int32).reshape(n, 4, 2, 1) * q).reshape(n, QK_K)


def _q6_k_ints(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_q6_K u8[n, 210] -> (sc * q_unsigned i32[n, 256] in element order (q in 0..63, the -32 is applied
    later through bsums, as the kernel does), scales i32[n, 16])."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 2, 32)  # [n, h, 1, s, l]
    low = ((ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)) & 0x0F).reshape(n, 2, 4, 32)  # r = 2*nib + s
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3  # [n, h, r, l]
    q = (low | (high << 4)).astype(np.int32).reshape(n, 2, 4, 2, 16)  # element 128h + 32r + 16(l//16) + l%16
    sc = i8_field(blocks, 192, 16).astype(np.int32)
    return (sc.reshape(n, 2, 4, 2, 1) * q).reshape(n, QK_K), sc


# ---------------------------------------------------------------------------------------------------------------
# The shared driver


def _decode_q8k(a: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """u8 (T, nb * 292) -> (d f32 (T, nb), qs i32 (T, nb, 256), bsums i32 (T, nb, 16))."""
    T = a.shape[0]
    b = np.ascontiguousarray(a, np.uint8).reshape(T * nb, _Q8K_BYTES)
    d = f32_field(b, 0).reshape(T, nb)
    qs = i8_field(b, 4, QK_K).astype(np.int32).reshape(T, nb, QK_K)
    bsums = b[:, 260:292].view("<i2").astype(np.int32).reshape(T, nb, 16)
    return d, qs, bsums


def _matmul(
    w: np.ndarray,
    a: np.ndarray,
    type_size: int,
    d_offset: int,
    weight_lanes: Callable[[np.ndarray], np.ndarray],
    act_lanes: np.ndarray,
    mins: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
) -> np.ndarray:
    """The AVX2 k-quant loop over super-blocks, vectorized over (T, out).

    d_offset: byte offset of the weight block's fp16 d.
    weight_lanes(blocks u8[rows, type_size]) -> f64 (8, K, rows): each lane's integer weight terms.
    act_lanes: f64 (nb, 8, T, K), the matching activation terms, so that sumi = act_lanes[b] @ weight_lanes.
    mins (Q5_K): blocks -> (fp16 dmin f32 (rows,), mins i32 (rows, 8)); the activations' pair sums of bsums
    come from `a` here.
    """
    w = np.ascontiguousarray(w, np.uint8)
    out_rows = w.shape[0]
    nb = w.shape[1] // type_size
    T = a.shape[0]
    K = act_lanes.shape[-1]
    d_a, _, bsums = _decode_q8k(a, nb)
    # Q5_K's q8s: _mm_hadd_epi16 of the bsums -> sums of the pairs (2j, 2j+1), one per 32-element sub-block
    bsum_pairs = bsums.reshape(T, nb, 8, 2).sum(-1, dtype=np.int64) if mins is not None else None
    y = np.empty((T, out_rows), np.float32)
    step = max(1, _CHUNK_BYTES // (8 * _LANES * (T + K)))
    for lo in range(0, out_rows, step):
        hi = min(out_rows, lo + step)
        rows = hi - lo
        acc = np.zeros((_LANES, T, rows), np.float32)
        summs = np.zeros((T, rows), np.float32)
        for i in range(nb):
            blocks = w[lo:hi, i * type_size : (i + 1) * type_size]
            # d = y[i].d * GGML_CPU_FP16_TO_FP32(x[i].d): one f32 product (fp16 -> f32 is exact)
            d = d_a[:, i, None] * f16_field(blocks, d_offset)[:, 0]  # (T, rows)
            sumi = _lane_sums(act_lanes[i], weight_lanes(blocks))  # (8, T, rows): exact integers in f64
            # _mm256_cvtepi32_ps rounds each lane to f32 (nearest even: the same as f64 -> f32 of the integer)
            acc = fma(d, sumi.astype(np.float32), acc)
            if mins is not None:
                dmin_w, m = mins(blocks)
                # dmin = -y[i].d * fp16(dmin): negating first or last gives the same f32 product
                dmin = -d_a[:, i, None] * dmin_w  # (T, rows)
                # integer matmul (NumPy's own loop, no BLAS threads); |msum| < 8 * 63 * 4064 < 2^24: exact in f32
                msum = (bsum_pairs[:, i] @ m.T.astype(np.int64)).astype(np.float32)
                # `summs += dmin * hsum`: GCC contracts this (-ffp-contract=fast) into one FMA
                summs = fma(dmin, msum, summs)
        res = hsum_float_8(np.moveaxis(acc, 0, -1))  # (T, rows)
        y[:, lo:hi] = res + summs if mins is not None else res
    return y


def _lane_sums(act: np.ndarray, wl: np.ndarray) -> np.ndarray:
    """act (8, T, K) @ wl (8, K, rows) -> (8, T, rows) in float64 (exact: integers below 2^53).

    Split into GEMMs of at most _GEMM_CELLS multiply-adds: OpenBLAS runs those on one thread, which keeps the
    many small GEMMs of this loop from waking its thread pool each time (on a busy 2-core machine one
    threaded GEMM per block took ~100 ms, the split ones take ~20 ms in all). Any split is exact."""
    _, T, K = act.shape
    rows = wl.shape[-1]
    cols = max(1, _GEMM_CELLS // max(1, T * K))
    if rows <= cols:
        return np.matmul(act, wl)
    n = -(-rows // cols)
    if n * cols != rows:  # pad with zero weights to whole GEMMs
        wl = np.concatenate([wl, np.zeros((_LANES, K, n * cols - rows))], axis=-1)
    parts = np.matmul(act[:, None], wl.reshape(_LANES, K, n, cols).transpose(0, 2, 1, 3))  # (8, n, T, cols)
    return parts.transpose(0, 2, 1, 3).reshape(_LANES, T, n * cols)[:, :, :rows]


def _check(w: np.ndarray, a: np.ndarray, type_size: int) -> int:
    if w.ndim != 2 or a.ndim != 2 or w.shape[1] % type_size or a.shape[1] % _Q8K_BYTES:
        raise ValueError(f"expected u8 weight rows of {type_size}-byte blocks and Q8_K activation rows")
    nb = w.shape[1] // type_size
    if a.shape[1] != nb * _Q8K_BYTES:
        raise ValueError(f"weight rows hold {nb} super-blocks but activation rows {a.shape[1] // _Q8K_BYTES}")
    return nb


def matmul_q3_k(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Q3_K weights (out, nb*110) u8 times Q8_K activations (T, nb*292) u8 -> (T, out) f32, as
    arch/x86/quants.c `ggml_vec_dot_q3_K_q8_K` (__AVX2__ branch) computes each element."""
    nb = _check(w, a, 110)
    _, qs, _ = _decode_q8k(a, nb)
    act = np.ascontiguousarray(np.moveaxis(_lanes(qs), 0, 2), np.float64)  # (nb, 8, T, 32)

    def weight_lanes(blocks):
        return np.moveaxis(_lanes(_q3_k_ints(blocks)), 0, -1).astype(np.float64)  # (8, 32, rows)

    return _matmul(w, a, 110, 108, weight_lanes, act)


def matmul_q5_k(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Q5_K weights (out, nb*176) u8 times Q8_K activations (T, nb*292) u8 -> (T, out) f32, as
    arch/x86/quants.c `ggml_vec_dot_q5_K_q8_K` (__AVX2__ branch) computes each element."""
    nb = _check(w, a, 176)
    _, qs, _ = _decode_q8k(a, nb)
    act = np.ascontiguousarray(np.moveaxis(_lanes(qs), 0, 2), np.float64)  # (nb, 8, T, 32)

    def weight_lanes(blocks):
        return np.moveaxis(_lanes(_q5_k_ints(blocks)), 0, -1).astype(np.float64)  # (8, 32, rows)

    def mins(blocks):
        return f16_field(blocks, 2)[:, 0], k4_scales_mins(blocks[:, 4:16])[1]

    return _matmul(w, a, 176, 0, weight_lanes, act, mins)


def matmul_q6_k(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Q6_K weights (out, nb*210) u8 times Q8_K activations (T, nb*292) u8 -> (T, out) f32, as
    arch/x86/quants.c `ggml_vec_dot_q6_K_q8_K` (__AVX2__ branch) computes each element."""
    nb = _check(w, a, 210)
    T = a.shape[0]
    _, qs, bsums = _decode_q8k(a, nb)
    # lane k: 32 products sc * q_unsigned * q8, then q8sclsub = 32 * (bsums[2k] sc[2k] + bsums[2k+1] sc[2k+1])
    # (_mm256_madd_epi16(q8sums, scales_16) << 5) is subtracted: two more terms per lane, bsums times -32 sc
    act = np.concatenate([_lanes(qs), bsums.reshape(T, nb, _LANES, 2)], axis=-1)  # (T, nb, 8, 34)
    act = np.ascontiguousarray(np.moveaxis(act, 0, 2), np.float64)  # (nb, 8, T, 34)

    def weight_lanes(blocks):
        ints, sc = _q6_k_ints(blocks)
        lanes = np.concatenate([_lanes(ints), -32 * sc.reshape(-1, _LANES, 2)], axis=-1)  # (rows, 8, 34)
        return np.moveaxis(lanes, 0, -1).astype(np.float64)  # (8, 34, rows)

    return _matmul(w, a, 210, 208, weight_lanes, act)


KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    GGMLType.Q3_K: matmul_q3_k,
    GGMLType.Q5_K: matmul_q5_k,
    GGMLType.Q6_K: matmul_q6_k,
}
