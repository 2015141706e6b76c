"""The exact numerics' decode kernels for TQ1_0, TQ2_0, MXFP4, NVFP4 and Q1_0: f32 activations times the blocks
as stored, decoded in registers (`exact_lowbit_ir.py`: codes to f32 weights through `vpermps` tables, then FMA;
MXFP4 and NVFP4 in `exact_fp4_ir.py`: integer kvalues through `vpshufb`, the scale applied per 32-element sum).

`rawblocks.matvec` calls `KERNELS[type](q, xv, out, threads)` in the exact numerics for these types. Tasks are
groups of 64 weight rows (`prange`, as `rawblocks._matvec`). One activation row (decode): weight rows decoded
and dotted in one pass, two side by side (`row_dot`). More rows: each pair of weight rows decoded once
into an L1 scratch (`row_decode`), then dotted with the activation rows three at a time (`scratch_dot(2, 3)`; the
rest two or one at a time), every activation row with the same chunks, accumulators and order as `row_dot`: a row
in a batch is bit for bit the row alone (the server's batched decode relies on it;
tests/test_kernels_exact_lowbit.py). TQ2_0's activations are first put in its chunks' order (`strided`), MXFP4's
and NVFP4's in theirs (`permuted`); their scratch also holds the lane scales (`_matvec_fp4`).
"""

from __future__ import annotations

import numpy as np

from . import exact_fp4_ir as fp4
from ._numba import jit, prange, use_threads
from .exact_lowbit_ir import FORMATS, KINDS, row_decode, row_dot, scratch_dot
from .int8dot import AVAILABLE

__all__ = ["KERNELS"]

ROWS_PER_DOT = 3  # activation rows per scratch pass: 2 x 3 x ACC accumulators + 4 weight vectors in 16 registers
_DOT1, _DOT2, _DOT3 = scratch_dot(2, 1), scratch_dot(2, 2), scratch_dot(2, 3)
_ROWS = row_dot(2)


@jit(parallel=True)
def _matvec(nt, kind, q, xv, out, nb):
    """out[t, r] = weight row r of q u8 (rows, row bytes) . xv[t], in tasks of 64 rows."""
    previous = use_threads(nt)
    T = xv.shape[0]
    for g in prange(q.shape[0] // 64):
        if T == 1:
            r = 64 * g
            while r < 64 * g + 64:  # 64 is a multiple of the rows per call
                r += _ROWS(kind, q, r, xv, 0, nb, out)
        else:
            w = np.empty((2, xv.shape[1]), np.float32)
            for r in range(64 * g, 64 * g + 64, 2):
                row_decode(kind, q, r, w, 0, nb)
                row_decode(kind, q, r + 1, w, 1, nb)
                t = 0
                while T - t >= ROWS_PER_DOT:
                    _DOT3(w, xv, t, out, r)
                    t += ROWS_PER_DOT
                if T - t == 2:
                    _DOT2(w, xv, t, out, r)
                elif T - t == 1:
                    _DOT1(w, xv, t, out, r)
    use_threads(previous)


FP4_ROWS = 2  # weight rows side by side for one activation row (1, 2 and 4 measured the same; 2 shares x loads)
_FP4_DOT1, _FP4_DOT2, _FP4_DOT3 = fp4.scratch_dot(2, 1), fp4.scratch_dot(2, 2), fp4.scratch_dot(2, 3)
_FP4_ROWS = fp4.row_dot(FP4_ROWS)


@jit(parallel=True)
def _matvec_fp4(nt, kind, q, xv, out, nb):
    """`_matvec` for MXFP4 / NVFP4 (`exact_fp4_ir`, xv `permuted`): the scratch holds two rows' weights and lane
    scales."""
    previous = use_threads(nt)
    T = xv.shape[0]
    for g in prange(q.shape[0] // 64):
        if T == 1:
            for r in range(64 * g, 64 * g + 64, FP4_ROWS):
                _FP4_ROWS(kind, q, r, xv, 0, nb, out)
        else:
            w = np.empty((2, xv.shape[1]), np.float32)
            s = np.empty((2, xv.shape[1] // 4), np.float32)
            for r in range(64 * g, 64 * g + 64, 2):
                fp4.row_decode(kind, q, r, w, s, 0, nb)
                fp4.row_decode(kind, q, r + 1, w, s, 1, nb)
                t = 0
                while T - t >= ROWS_PER_DOT:
                    _FP4_DOT3(kind, w, s, xv, t, out, r)
                    t += ROWS_PER_DOT
                if T - t == 2:
                    _FP4_DOT2(kind, w, s, xv, t, out, r)
                elif T - t == 1:
                    _FP4_DOT1(kind, w, s, xv, t, out, r)
    use_threads(previous)


@jit
def permuted(xv, order):
    """xv f32 (T, C) with per 32 elements the element order[p] at position p."""
    T, C = xv.shape
    xp = np.empty((T, C), np.float32)
    for t in range(T):
        for g in range(0, C, 32):
            for p in range(32):
                xp[t, g + p] = xv[t, g + order[p]]
    return xp


@jit
def strided(xv):
    """xv f32 (T, C) in the order of a strided format's chunks: per 32 elements, element 4i + s at 8s + i."""
    T, C = xv.shape
    xp = np.empty((T, C), np.float32)
    for t in range(T):
        for g in range(C // 32):
            for s in range(4):
                for i in range(8):
                    xp[t, 32 * g + 8 * s + i] = xv[t, 32 * g + 4 * i + s]
    return xp


def _kernel_fp4(ggml_type):
    f = fp4.FORMATS[ggml_type]
    kind = fp4.KINDS[ggml_type]

    def kernel(q: np.ndarray, xv: np.ndarray, out: np.ndarray, threads: int) -> None:
        """out f32 (T, G*64) = xv f32 (T, cols) times the weight whose file rows are q u8 (G, 64, row bytes)."""
        _matvec_fp4(threads, kind, q.reshape(-1, q.shape[2]), permuted(xv, f.order), out, xv.shape[1] // f.block_size)

    return kernel


def _kernel(ggml_type):
    f = FORMATS[ggml_type]
    kind = KINDS[ggml_type]

    def kernel(q: np.ndarray, xv: np.ndarray, out: np.ndarray, threads: int) -> None:
        """out f32 (T, G*64) = xv f32 (T, cols) times the weight whose file rows are q u8 (G, 64, row bytes)."""
        x = strided(xv) if f.strided else np.ascontiguousarray(xv)
        _matvec(threads, kind, q.reshape(-1, q.shape[2]), x, out, xv.shape[1] // f.block_size)

    return kernel


# The intrinsics need AVX2 (`vpermps`, `vpshufb`) and compiled code: otherwise rawblocks._matvec computes these types.
KERNELS: dict = {t: _kernel(t) for t in FORMATS} | {t: _kernel_fp4(t) for t in fp4.FORMATS} if AVAILABLE else {}
"""GGML type -> kernel(q u8[G, 64, row bytes], xv f32[T, cols], out f32[T, G*64], threads)."""
