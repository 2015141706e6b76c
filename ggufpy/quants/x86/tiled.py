"""Bit-exact NumPy emulation of ggml's "tiled" K-quant matmul (ggml-cpu/tiled/), the AVX512-VNNI microkernel.

`ggml_compute_forward_mul_mat` (ggml-cpu.c) first offers every mul_mat to `ggml_compute_forward_mul_mat_tiled`
(tiled/tiled.cpp). It takes the op when the environment variable GGML_CPU_TILED_MM is unset or non-zero, the
weight is not in a repacked buffer (`src0->extra == NULL`), the weight type is Q6_K, Q5_K, Q4_K, Q3_K, Q2_K,
IQ4_XS or an IQ1/IQ2/IQ3 type (the IQ2 and IQ3 ones emulated here; `iqgrid.py`) and the activation has T >= 8 rows
(`ggml_tiled_min_batch`).
For T < 8 the stock vec_dot path runs (ggufpy/quants/x86/kquants.py, iquants.py, repack.py).

Activations: the tiled driver (`ggml_compute_forward_mul_mat_tiled_driver`) converts them with the same
`from_float` as the stock driver, `quantize_row_q8_K` = `quantize_row_q8_K_ref` on x86 (each thread converts a
range of whole 256-blocks of every row, and Q8_K blocks are independent), so `a` is exactly what
`ggufpy.quants.vecdot.quantize_activations(x, GGMLType.Q8_K)` returns. The kernel reads the block's f32 d, the
256 int8 quants and the 16 int16 bsums.

Kernel: tiled/tiled-kernel.cpp `tiled_run_micro_vnni_8x16` (the `__AVX512VNNI__ && __AVX512VL__ &&
__AVX512DQ__` branch of `tiled_run_microtile`, compiled in this build), called once per 256-element super-block
("slab") for each 16x16 (weight rows x activation rows) microtile. Per (activation row t, weight row o) and
super-block b, with the weight unpacked by `tiled_unpack_src0` into unsigned codes c (code = quant + BIAS):

    s1 = sum_s sc_s * (sum_{e in s} c_e q_e - BIAS * bsum_s)     int32, exact (dpbusd, mullo, add)
    s2 = sum_s m_s * bsum_s                                       int32, exact (types with a min only)
    p  = fl(f32(s1) * d_w)                                        vcvtdq2ps (rounds), vmulps
    p  = fl(p - dmin_w * f32(s2))                                 vfnmadd132ps, one rounding (min types)
    y  = fl(p * d_a + y)                                          vfmadd213ps, one rounding; y starts at 0

d_w, dmin_w are the weight block's fp16 d/dmin (exact in f32), d_a the Q8_K block's f32 d. bsum_s is the sum of
the Q8_K bsums of sub-block s (one for 16-element sub-blocks, two for 32-element ones). GCC contracted
`_mm512_add_ps(buf, _mm512_mul_ps(result, d1))` into one FMA (checked in the installed libggml-cpu.so: the
epilogue is vcvtdq2ps, vmulps, [vfnmadd132ps,] vfmadd213ps for every instantiation, standard and narrow).

    type    sub-block  BIAS  min   code c                    |s1| bound (int32 never wraps)
    Q2_K       16        0   yes   2-bit q                   16 * 16 * 3*15 * 127    < 2^22
    Q3_K       16        4   no    3-bit q + 4 (0..7)        16 * 16 * 4*32 * 127    < 2^23
    Q4_K       32        0   yes   4-bit q                    8 * 32 * 15*63 * 127   < 2^25
    Q5_K       32        0   yes   5-bit q                    8 * 32 * 31*63 * 127   < 2^26
    Q6_K       16       32   no    6-bit q + 32 (0..63)      16 * 16 * 32*128 * 127  < 2^28
    IQ4_XS     32      128   no    kvalue + 128 (1..241)      8 * 32 * 127*32 * 127  < 2^27

Order of the float operations: the per-element accumulator y lives in the window buffer `ws->acc` (zeroed once
per 256x256 output window, which always spans the whole K) and receives one FMA per super-block in increasing
order, on both the standard path (K stepped one slab at a time) and the narrow path (T-window <= 16: several
slabs unpacked at once, still one microtile call per slab in order). Tiling, T, the number of output rows and
the thread count (which only changes how the output is split into chunks) therefore do not change any
element's arithmetic; `tiled_store_window` copies y out unchanged.

The integer sums are computed as float64 matmuls: every product and partial sum is an integer below 2^53, so
BLAS gets them exactly in any order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ...constants import GGMLType
from ..fields import f16_field, f32_field, i8_field, nibbles, u16_field
from ..kquants import _q3_k_scales, k4_scales_mins
from .iqgrid import GRID_TYPES
from .iquants import _iq4_xs_scaled_quants
from .kquants import _q3_k_ints, _q5_k_ints, _q6_k_ints
from .repack import _q2_k_parts, _q4_k_parts
from .simd import fma

__all__ = [
    "KERNELS",
    "TILED_MIN_BATCH",
    "matmul_iq4_xs",
    "matmul_q2_k",
    "matmul_q3_k",
    "matmul_q4_k",
    "matmul_q5_k",
    "matmul_q6_k",
    "matmul_tiled",
]

QK_K = 256
TILED_MIN_BATCH = 8  # tiled.cpp `ggml_tiled_min_batch`: the tiled path runs for T >= 8 activation rows
_Q8K_BYTES = 292  # block_q8_K: f32 d, i8 qs[256], i16 bsums[16]
_CHUNK_BYTES = 12 << 20  # bound on the decoded weights of one chunk of output rows and on each f64 temporary
_GEMM_CELLS = 4 * 65536  # OpenBLAS interface/gemm.c: M*N*K below 4 * SMP_THRESHOLD_MIN runs single-threaded


class _Weights(NamedTuple):
    """One super-block column of weight rows, as `tiled_unpack_src0` leaves it in the tile (n = rows):
    cq (n, 256) sc_s * code_e in element order; corr (n, 16) -BIAS * sc per 16 elements (multiplies the bsums)
    or None for BIAS = 0; d (n,) fp16 d; m16 (n, 16) min per 16 elements and dmin (n,), or None."""

    cq: np.ndarray
    corr: np.ndarray | None
    d: np.ndarray
    m16: np.ndarray | None = None
    dmin: np.ndarray | None = None


# -- tiled.cpp `tiled_unpack_src0`: every type's codes are in the standard element order (checked against
#    dequantize_row_*), so the project's decoders are reused; only the BIAS offset of the codes is added back.


def _q2_k(blocks: np.ndarray) -> _Weights:
    sq, m16, d, dmin = _q2_k_parts(blocks)  # sc & 15 times the 2-bit code; min = sc >> 4, per 16 elements
    return _Weights(sq, None, d, m16, dmin)


def _q3_k(blocks: np.ndarray) -> _Weights:
    # unpack: code = low 2 bits | hmask bit << 2 (0..7), scale = 6-bit s - 32; BIAS = 4, so the kernel's
    # sc * (code - 4) is the vec_dot's sc * (q_low - 4 * !hbit)
    sc16 = _q3_k_scales(blocks[:, 96:108]).astype(np.float32)  # (n, 16), sub-block e // 16
    cq = _q3_k_ints(blocks).astype(np.float32) + 4 * np.repeat(sc16, 16, axis=1)
    return _Weights(cq, -4 * sc16, f16_field(blocks, 108)[:, 0])


def _q4_k(blocks: np.ndarray) -> _Weights:
    sq, m16, d, dmin = _q4_k_parts(blocks)
    return _Weights(sq, None, d, m16, dmin)


def _q5_k(blocks: np.ndarray) -> _Weights:
    m = k4_scales_mins(blocks[:, 4:16])[1].astype(np.float32)  # (n, 8): one min per 32 = two bsums
    cq = _q5_k_ints(blocks).astype(np.float32)
    return _Weights(cq, None, f16_field(blocks, 0)[:, 0], np.repeat(m, 2, axis=1), f16_field(blocks, 2)[:, 0])


def _q6_k(blocks: np.ndarray) -> _Weights:
    cq, sc = _q6_k_ints(blocks)  # sc * unsigned 6-bit code (BIAS = 32 is the vec_dot's -32), int8 scale per 16
    return _Weights(cq.astype(np.float32), -32 * sc.astype(np.float32), f16_field(blocks, 208)[:, 0])


def _iq4_xs_ls(blocks: np.ndarray) -> np.ndarray:
    """The eight signed sub-block scales ls - 32 of block_iq4_xs rows: u8 (n, 136) -> f32 (n, 8)."""
    n = blocks.shape[0]
    low = nibbles(blocks[:, 4:8]).transpose(0, 2, 1).reshape(n, 8)  # nibble s % 2 of scales_l[s // 2]
    high = (u16_field(blocks, 2) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # bits 2s, 2s+1 of scales_h
    return (low.astype(np.float32) + 16 * high.astype(np.float32)) - 32


def _iq4_xs(blocks: np.ndarray) -> _Weights:
    # unpack: code = kvalues_iq4nl[q] + 128 (the `lut`, so dpbusd sees unsigned bytes), BIAS = 128
    ls = _iq4_xs_ls(blocks)
    cq = _iq4_xs_scaled_quants(blocks) + 128 * np.repeat(ls, 32, axis=1)  # ls * (kvalue + 128), exact
    return _Weights(cq, -128 * np.repeat(ls, 2, axis=1), f16_field(blocks, 0)[:, 0])


def _grid(ggml_type: GGMLType) -> Callable[[np.ndarray], _Weights]:
    # unpack: code = signed grid value + 128 with the activation pre-biased (ACTBIAS), both offsets cancelling
    # in the integers; scale 2 ls + 1 per 32 elements, d times the type's power-of-two constant (`iqgrid.py`)
    gt = GRID_TYPES[ggml_type]

    def unpack(blocks: np.ndarray) -> _Weights:
        d, sc, w = gt.ints(blocks)
        return _Weights(np.repeat(sc.astype(np.float32), gt.sub, axis=1) * w, None, d * np.float32(gt.c))

    return unpack


_TYPES: dict[GGMLType, tuple[int, Callable[[np.ndarray], _Weights]]] = {
    GGMLType.Q2_K: (84, _q2_k),
    GGMLType.Q3_K: (110, _q3_k),
    GGMLType.Q4_K: (144, _q4_k),
    GGMLType.Q5_K: (176, _q5_k),
    GGMLType.Q6_K: (210, _q6_k),
    GGMLType.IQ4_XS: (136, _iq4_xs),
    **{t: (gt.type_size, _grid(t)) for t, gt in GRID_TYPES.items()},
}


# -- the microkernel's arithmetic, vectorized over (T, rows) ------------------------------------------------------


def _tiled(w: np.ndarray, a: np.ndarray, type_size: int, unpack: Callable[[np.ndarray], _Weights]) -> np.ndarray:
    """The float sequence of the module docstring for every (T, out) element, by chunks of output rows."""
    w = np.ascontiguousarray(w, np.uint8)
    a = np.ascontiguousarray(a, np.uint8)
    if w.ndim != 2 or a.ndim != 2 or w.shape[1] % type_size or a.shape[1] % _Q8K_BYTES:
        raise ValueError(f"expected u8 weight rows of {type_size}-byte blocks and Q8_K activation rows")
    out, nb, T = w.shape[0], w.shape[1] // type_size, a.shape[0]
    if a.shape[1] != nb * _Q8K_BYTES:
        raise ValueError(f"weight rows hold {nb} super-blocks but activation rows {a.shape[1] // _Q8K_BYTES}")
    y = np.empty((T, out), np.float32)
    if T == 0 or out == 0 or nb == 0:
        y[:] = 0
        return y
    ab = a.reshape(T * nb, _Q8K_BYTES)
    d_a = f32_field(ab, 0).reshape(T, nb)  # src1.d: the block's f32 d
    # [q_e (256), bsums (16)] per block: s1 = this . [cq, corr] covers the dpbusd sums and the BIAS correction
    act = np.concatenate([i8_field(ab, 4, QK_K), ab[:, 260:292].view("<i2")], axis=1).astype(np.float64)
    act = np.ascontiguousarray(act.reshape(T, nb, QK_K + 16).transpose(1, 0, 2))  # (nb, T, 272)
    step = max(1, min(_CHUNK_BYTES // (4 * nb * (QK_K + 32)), _CHUNK_BYTES // (8 * T)))
    with np.errstate(over="ignore", invalid="ignore"):  # inf / nan propagate as in ggml
        for lo in range(0, out, step):
            hi = min(out, lo + step)
            rows = hi - lo
            wt = unpack(w[lo:hi].reshape(rows * nb, type_size))
            cq = wt.cq.reshape(rows, nb, QK_K)
            corr = None if wt.corr is None else wt.corr.reshape(rows, nb, 16)
            d_w = wt.d.reshape(rows, nb)
            acc = np.zeros((T, rows), np.float32)  # ws->acc, zeroed per window (memset)
            for b in range(nb):
                if corr is None:  # BIAS = 0
                    s1 = _int_matmul(act[b, :, :QK_K], cq[:, b])
                else:
                    s1 = _int_matmul(act[b], np.concatenate([cq[:, b], corr[:, b]], axis=1))
                # _mm512_cvtepi32_ps: round-to-nearest-even of the exact integer (f64 -> f32 rounds once)
                p = s1.astype(np.float32) * d_w[None, :, b]  # _mm512_mul_ps(f1, set1(d0))
                if wt.m16 is not None:
                    # |s2| <= 8 * 63 * 2 * 16 * 127 < 2^24: exact in f32 and in the conversion
                    s2 = _int_matmul(act[b, :, QK_K:], wt.m16.reshape(rows, nb, 16)[:, b]).astype(np.float32)
                    # _mm512_fnmadd_ps(set1(dmin), f2, result) = -(dmin * f2) + result, one rounding
                    p = fma(-wt.dmin.reshape(rows, nb)[None, :, b], s2, p)
                # buf += result * d1: contracted by GCC into vfmadd213ps
                acc = fma(p, d_a[:, b, None], acc)
            y[:, lo:hi] = acc
    return y


def _int_matmul(act: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """act f64 (T, K) @ wt (rows, K).T -> f64 (T, rows), exact (integer products and sums below 2^53).

    Split into GEMMs of at most _GEMM_CELLS multiply-adds, which OpenBLAS runs on the calling thread: on a busy
    machine its thread pool, woken for every block's GEMM, made this 5-10x slower (as in x86/kquants.py)."""
    T, K = act.shape
    rows = wt.shape[0]
    cols = max(1, _GEMM_CELLS // max(1, T * K))
    if rows <= cols:
        return act @ wt.T.astype(np.float64)
    n = -(-rows // cols)
    w64 = np.zeros((n * cols, K), np.float64)  # zero rows pad to whole GEMMs
    w64[:rows] = wt
    parts = np.matmul(act, w64.reshape(n, cols, K).transpose(0, 2, 1))  # (n, T, cols), one GEMM each
    return parts.transpose(1, 0, 2).reshape(T, n * cols)[:, :rows]


def _kernel(ggml_type: GGMLType) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    type_size, unpack = _TYPES[ggml_type]

    def matmul(w: np.ndarray, a: np.ndarray) -> np.ndarray:
        return _tiled(w, a, type_size, unpack)

    matmul.__name__ = matmul.__qualname__ = f"matmul_{ggml_type.name.lower()}"
    matmul.__doc__ = (
        f"{ggml_type.name} weight rows u8 (out, row_bytes) times Q8_K activation rows u8 (T, act_row_bytes)\n"
        "(`quantize_activations(x, GGMLType.Q8_K)`) -> f32 (T, out), as ggml's tiled VNNI matmul computes it.\n"
        f"llama.cpp runs this kernel for T >= {TILED_MIN_BATCH} when the weight is not repacked; the function\n"
        "itself computes the tiled arithmetic for any T (what GGML_CPU_TILED_MM_FORCE=1 would give)."
    )
    return matmul


matmul_q2_k = _kernel(GGMLType.Q2_K)
matmul_q3_k = _kernel(GGMLType.Q3_K)
matmul_q4_k = _kernel(GGMLType.Q4_K)
matmul_q5_k = _kernel(GGMLType.Q5_K)
matmul_q6_k = _kernel(GGMLType.Q6_K)
matmul_iq4_xs = _kernel(GGMLType.IQ4_XS)


def matmul_tiled(w: np.ndarray, a: np.ndarray, w_type: GGMLType) -> np.ndarray:
    """w: u8 (out, w_row_bytes) GGUF weight rows of `w_type` (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or IQ4_XS);
    a: u8 (T, a_row_bytes) activation rows quantized to Q8_K (`quantize_activations(x, GGMLType.Q8_K)`: the
    tiled driver quantizes with the same `quantize_row_q8_K`, so these are its bytes).
    Returns y f32 (T, out), bit-identical to ggml's tiled mul_mat (tiled.cpp, VNNI microkernel).

    It emulates the tiled kernel for every T; llama.cpp only runs it for T >= TILED_MIN_BATCH (8) and a weight
    that is not repacked, so the caller dispatches T < 8 to the vec_dot emulations."""
    return KERNELS[GGMLType(w_type)](w, a)


KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    GGMLType.Q2_K: matmul_q2_k,
    GGMLType.Q3_K: matmul_q3_k,
    GGMLType.Q4_K: matmul_q4_k,
    GGMLType.Q5_K: matmul_q5_k,
    GGMLType.Q6_K: matmul_q6_k,
    GGMLType.IQ4_XS: matmul_iq4_xs,
    **{t: _kernel(t) for t in GRID_TYPES},
}
