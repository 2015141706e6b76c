"""Bit-exact emulation of llama.cpp's x86 matmul for the grid types (Q8_K activations): IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S, IQ1_S and IQ1_M (whose vec_dots add their delta term apart: `vec_dot_iq1_s`, `vec_dot_iq1_m`).

Two kernels, chosen by the number of activation rows T (ggml-cpu.c `ggml_compute_forward_mul_mat`: the tiled
driver takes T >= 8, `tiled.TILED_MIN_BATCH`; the weight is never repacked): which is why llama.cpp's logits
for these types change with how a prompt is split into ubatches (a 7-token batch runs vec_dot, 13 tokens the
tiled kernel, and the two round differently).

- T < 8: the type's `ggml_vec_dot_*_q8_K` (arch/x86/quants.c, `__AVX2__` branch, the only x86 SIMD one). Per
  super-block, 32-bit lane L (L = 0..7) holds the exact integer
      I_L = sum over the eight 32-element chunks s of sc(s, L) * sum_{e in s, (e % 32) // 4 == L} w_e q_e
  (sc = 2 ls + 1 of the chunk; with 16-element scales (IQ2_XS, IQ2_S) that of its first half for lanes 0-3, of
  its second half for lanes 4-7)
  (w = signed grid value: `maddubs` of the grid bytes with the sign-adjusted q8, `madd` with the scale), then
      acc[L] = fma(fl(fp16(d_w) * d_a), float(I_L), acc[L]);   y = c * hsum_float_8(acc)
  with c = 0.125f (IQ2_*), 0.25f (IQ3_XXS) or 1 (IQ3_S).
- T >= 8: the tiled kernel (`tiled.py`: per super-block p = fl(float(s1) * c * d_w), acc = fma(p, d_a, acc))
  with s1 = sum over sub-blocks of (2 ls + 1) * sum w_e q_e. The unpack's BIAS of 128 and its activation pre-bias
  cancel exactly in the integers; c is a power of two, which scales every rounding alike (checked: c on d_w).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ...constants import GGMLType
from ..fields import f16_field, f32_field, i8_field, u16_field, u32_field
from ..iqgrid import parts_iq1_m, parts_iq1_s, parts_iq2_s, parts_iq2_xs, parts_iq2_xxs, parts_iq3_s, parts_iq3_xxs
from .llamafile import FmaAccumulator, rows_per_chunk
from .simd import fma, hsum_float_8

__all__ = ["GRID_TYPES", "KERNELS", "GridType", "vec_dot"]

QK_K = 256
_Q8K_BYTES = 292
_F32 = np.float32


def iq2_xxs_ints(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_iq2_xxs u8 (n, 66) -> (d f32 (n,), sc int32 (n, 8) = 2 ls + 1 per 32 elements, w int8 (n, 256)
    signed grid values in element order): the integers both kernels multiply."""
    n = blocks.shape[0]
    a1 = u32_field(blocks, 2, 16).reshape(n, 8, 2)[:, :, 1]
    _, w = parts_iq2_xxs(blocks)
    return f16_field(blocks, 0)[:, 0], (2 * (a1 >> 28) + 1).astype(np.int32), w.reshape(n, QK_K)


def iq3_xxs_ints(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_iq3_xxs u8 (n, 98) -> (d, sc = 2 ls + 1 (n, 8), w int8 (n, 256)), as `iq2_xxs_ints`."""
    n = blocks.shape[0]
    ss = u32_field(blocks, 66, 8)  # per sub-block: four 7-bit sign indices | ls << 28
    _, w = parts_iq3_xxs(blocks)
    return f16_field(blocks, 0)[:, 0], (2 * (ss >> 28) + 1).astype(np.int32), w.reshape(n, QK_K)


def iq3_s_ints(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_iq3_s u8 (n, 110) -> (d, sc = 2 s + 1 (n, 8) from the scale nibbles (low first), w (n, 256))."""
    n = blocks.shape[0]
    nib = np.stack([blocks[:, 106:110] & 15, blocks[:, 106:110] >> 4], axis=-1).reshape(n, 8)
    _, w = parts_iq3_s(blocks)
    return f16_field(blocks, 0)[:, 0], 2 * nib.astype(np.int32) + 1, w.reshape(n, QK_K)


def _nibble_sc(b: np.ndarray) -> np.ndarray:
    """Scale nibbles u8 (n, k), low first -> 2 s + 1 int32 (n, 2k)."""
    return 2 * np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1).astype(np.int32) + 1


def iq2_xs_ints(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_iq2_xs u8 (n, 74) -> (d, sc = 2 s + 1 per 16 elements (n, 16), w (n, 256))."""
    _, w = parts_iq2_xs(blocks)
    return f16_field(blocks, 0)[:, 0], _nibble_sc(blocks[:, 66:74]), w.reshape(blocks.shape[0], QK_K)


def iq2_s_ints(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_iq2_s u8 (n, 82) -> (d, sc = 2 s + 1 per 16 elements (n, 16), w (n, 256))."""
    _, w = parts_iq2_s(blocks)
    return f16_field(blocks, 0)[:, 0], _nibble_sc(blocks[:, 74:82]), w.reshape(blocks.shape[0], QK_K)


def iq1_s_ints(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_iq1_s u8 (n, 50) -> (d, sc = 2 s + 1 (n, 8), v = 8 * (grid + delta) int8 (n, 256)): the tiled
    unpack's integers (delta = +-1/8, so 8 * value is an integer)."""
    _, v = parts_iq1_s(blocks)
    qh = u16_field(blocks, 34, 8)
    return f16_field(blocks, 0)[:, 0], (2 * ((qh >> 12) & 7) + 1).astype(np.int32), v.reshape(blocks.shape[0], QK_K)


def _iq1_m_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """block_iq1_m u8 (n, 56) -> (d f32 (n,), sc = 2 s + 1 per 16 elements (n, 16), v = 8 * (grid + delta)
    int8 (n, 256), delta sign +-1 int8 (n, 256))."""
    n = blocks.shape[0]
    _, v = parts_iq1_m(blocks)
    sc16 = u16_field(blocks, 48, 4)
    d = (((sc16 >> 12) << (4 * np.arange(4, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)).view(np.float16)
    s = (sc16[:, :, None] >> (3 * np.arange(4, dtype=np.uint16))) & 7
    qh = np.stack([blocks[:, 32:48] & 15, blocks[:, 32:48] >> 4], axis=-1).reshape(n, 32)  # per 8 elements
    delta = np.where((qh >> 3) != 0, np.int8(-1), np.int8(1)).repeat(8, axis=1)
    sc = 2 * s.reshape(n, 16).astype(np.int32) + 1
    return d.astype(np.float32), sc, v.reshape(n, QK_K), delta


def iq1_m_ints(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_iq1_m -> (d, sc per 16 elements, v = 8 * (grid + delta)): the tiled unpack's integers."""
    d, sc, v, _ = _iq1_m_parts(blocks)
    return d, sc, v


class GridType(NamedTuple):
    type_size: int
    ints: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]  # blocks -> (d, sc, w)
    c: float  # the kernels' constant factor (the dequantizer's 0.25 * (0.5 + ls) = 0.125 * (2 ls + 1), ...)
    sub: int = 32  # elements per integer scale


GRID_TYPES = {
    GGMLType.IQ2_XXS: GridType(66, iq2_xxs_ints, 0.125),
    GGMLType.IQ3_XXS: GridType(98, iq3_xxs_ints, 0.25),
    GGMLType.IQ3_S: GridType(110, iq3_s_ints, 1.0),
    GGMLType.IQ2_XS: GridType(74, iq2_xs_ints, 0.125, sub=16),
    GGMLType.IQ2_S: GridType(82, iq2_s_ints, 0.125, sub=16),
    GGMLType.IQ1_S: GridType(50, iq1_s_ints, 0.125),  # tiled only: its vec_dot adds the delta apart (`vec_dot_iq1_s`)
    GGMLType.IQ1_M: GridType(56, iq1_m_ints, 0.125, sub=16),  # tiled only, as IQ1_S (`vec_dot_iq1_m`)
}


def _vec_dot_kernel(d_w, sc, w, d_a, q_a, c) -> np.ndarray:
    """d_w f32 (O, nb), sc (O, nb, 8 or 16), w int8 (O, nb, 256), d_a f32 (T, nb), q_a int8 (T, nb, 256) ->
    (T, O). With 16-element scales, lanes 0-3 of 32-element chunk s take scale 2s and lanes 4-7 scale 2s + 1
    (`get_scale_shuffle_k4`)."""
    T, nb, _ = q_a.shape
    O = w.shape[0]
    # lane L of sub-block s: elements 32s + 4L .. 32s + 4L + 3
    A = q_a.reshape(T, nb, 8, 8, 4).transpose(1, 2, 3, 0, 4).astype(np.float64)  # (nb, s, L, T, 4)
    W = w.reshape(O, nb, 8, 8, 4).transpose(1, 2, 3, 4, 0).astype(np.float64)  # (nb, s, L, 4, O)
    acc = FmaAccumulator((8, T, O), subnormals=False)
    for b in range(nb):
        per_sub = np.matmul(A[b], W[b])  # (s, L, T, O) exact integers
        scl = sc[:, b].astype(np.float64)  # (O, 8 or 16) -> (O, s, L)
        scl = (
            np.repeat(scl, 8, axis=1).reshape(O, 8, 8)
            if scl.shape[1] == 8
            else np.repeat(scl, 4, axis=1).reshape(O, 8, 8)
        )
        lanes = np.einsum("slto,osl->lto", per_sub, scl)  # exact (|I| < 2^24)
        acc.add((d_a[:, b, None] * d_w[None, :, b]).astype(_F32), lanes)
    return _F32(c) * hsum_float_8(np.moveaxis(acc.acc, 0, -1))


def vec_dot(w: np.ndarray, a: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """Grid-type weight rows u8 (out, nb*type_size) times Q8_K activation rows u8 (T, nb*292) -> f32 (T, out),
    as the type's `ggml_vec_dot_*_q8_K` (AVX2) computes every element (what llama.cpp runs for T < 8)."""
    gt = GRID_TYPES[ggml_type]
    w = np.ascontiguousarray(w, np.uint8)
    a = np.ascontiguousarray(a, np.uint8)
    T, nb = a.shape[0], a.shape[1] // _Q8K_BYTES
    if a.shape[1] != nb * _Q8K_BYTES or w.ndim != 2 or w.shape[1] != nb * gt.type_size:
        raise ValueError(f"{ggml_type.name} weight rows {w.shape} and Q8_K activation rows {a.shape} do not match")
    ab = a.reshape(T * nb, _Q8K_BYTES)
    d_a, q_a = f32_field(ab, 0).reshape(T, nb), i8_field(ab, 4, QK_K).reshape(T, nb, QK_K)
    out = w.shape[0]
    y = np.empty((T, out), _F32)
    step = rows_per_chunk(nb * QK_K * 8 * max(T, 4))
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, out, step):
            rows = w[lo : lo + step]
            d, sc, wv = gt.ints(rows.reshape(-1, gt.type_size))
            n = rows.shape[0]
            y[:, lo : lo + step] = _vec_dot_kernel(
                d.reshape(n, nb), sc.reshape(n, nb, -1), wv.reshape(n, nb, QK_K), d_a, q_a, gt.c
            )
    return y


def vec_dot_iq1_s(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """IQ1_S rows u8 (out, nb*50) times Q8_K rows u8 (T, nb*292) -> f32 (T, out) as `ggml_vec_dot_iq1_s_q8_K`
    (AVX2): the grid part as the other grid types (lanes of (2 s + 1) * grid * q, one FMA per super-block with
    d = fl(d_a * fp16(d_w))); the delta part as a scalar, accum1 = fma(d, sumi1, accum1) with
    sumi1 = sum_s (+-1) (2 s + 1) (bsum_2s + bsum_2s+1); y = hsum_float_8(acc) + 0.125f * accum1."""
    w = np.ascontiguousarray(w, np.uint8)
    a = np.ascontiguousarray(a, np.uint8)
    T, nb = a.shape[0], a.shape[1] // _Q8K_BYTES
    if a.shape[1] != nb * _Q8K_BYTES or w.ndim != 2 or w.shape[1] != nb * 50:
        raise ValueError(f"IQ1_S weight rows {w.shape} and Q8_K activation rows {a.shape} do not match")
    ab = a.reshape(T * nb, _Q8K_BYTES)
    d_a, q_a = f32_field(ab, 0).reshape(T, nb), i8_field(ab, 4, QK_K).reshape(T, nb, QK_K)
    bs32 = q_a.reshape(T, nb, 8, 32).sum(axis=-1, dtype=np.int64).astype(np.float64)  # (T, nb, s)
    out = w.shape[0]
    y = np.empty((T, out), _F32)
    step = rows_per_chunk(nb * QK_K * 8 * max(T, 4))
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, out, step):
            blocks = w[lo : lo + step].reshape(-1, 50)
            n = blocks.shape[0] // nb
            d, sc, v = iq1_s_ints(blocks)
            qh = u16_field(blocks, 34, 8).reshape(n, nb, 8)
            sign = np.where(qh >> 15, -1.0, 1.0)  # (n, nb, s)
            g = (v.astype(np.int16) - np.where(qh >> 15, -1, 1).reshape(-1, 8).repeat(32, axis=1)) // 8
            grid = _vec_dot_kernel(
                d.reshape(n, nb), sc.reshape(n, nb, 8), g.astype(np.int8).reshape(n, nb, QK_K), d_a, q_a, 1.0
            )  # hsum_float_8(acc)
            acc1 = np.zeros((T, n), _F32)
            for b in range(nb):
                sumi1 = bs32[:, b] @ (sign[:, b] * sc.reshape(n, nb, 8)[:, b]).T  # (T, n) exact integers
                db = (d_a[:, b, None] * d.reshape(n, nb)[None, :, b]).astype(_F32)
                acc1 = fma(db, sumi1.astype(_F32), acc1)
            y[:, lo : lo + step] = grid + _F32(0.125) * acc1
    return y


def vec_dot_iq1_m(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """IQ1_M rows u8 (out, nb*56) times Q8_K rows u8 (T, nb*292) -> f32 (T, out) as `ggml_vec_dot_iq1_m_q8_K`
    (AVX2): two lane accumulators with d = fl(d_a * fp16(d_w)), accum1 = fma(d, float(I_L), accum1) of the grid
    sums and accum2 = fma(d, float(J_L), accum2) of the +-1 delta sums (both with 16-element scales 2 s + 1,
    laid out as IQ2_S's); y = hsum_float_8(accum1) + 0.125f * hsum_float_8(accum2)."""
    w = np.ascontiguousarray(w, np.uint8)
    a = np.ascontiguousarray(a, np.uint8)
    T, nb = a.shape[0], a.shape[1] // _Q8K_BYTES
    if a.shape[1] != nb * _Q8K_BYTES or w.ndim != 2 or w.shape[1] != nb * 56:
        raise ValueError(f"IQ1_M weight rows {w.shape} and Q8_K activation rows {a.shape} do not match")
    ab = a.reshape(T * nb, _Q8K_BYTES)
    d_a, q_a = f32_field(ab, 0).reshape(T, nb), i8_field(ab, 4, QK_K).reshape(T, nb, QK_K)
    out = w.shape[0]
    y = np.empty((T, out), _F32)
    step = rows_per_chunk(nb * QK_K * 8 * max(T, 4))
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, out, step):
            blocks = w[lo : lo + step].reshape(-1, 56)
            n = blocks.shape[0] // nb
            d, sc, v, delta = _iq1_m_parts(blocks)
            g = (v.astype(np.int16) - delta) // 8
            args = (d.reshape(n, nb), sc.reshape(n, nb, 16))
            grid = _vec_dot_kernel(*args, g.astype(np.int8).reshape(n, nb, QK_K), d_a, q_a, 1.0)
            dsum = _vec_dot_kernel(*args, delta.reshape(n, nb, QK_K), d_a, q_a, 1.0)
            y[:, lo : lo + step] = grid + _F32(0.125) * dsum
    return y


KERNELS = {t: functools.partial(vec_dot, ggml_type=t) for t in GRID_TYPES}
KERNELS[GGMLType.IQ1_S] = vec_dot_iq1_s
KERNELS[GGMLType.IQ1_M] = vec_dot_iq1_m
