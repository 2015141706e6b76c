"""The grid types' integer kernels in the llamacpp numerics, on `int8ir_iqgrid`'s AVX2 intrinsics: IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M weight rows in parallel, each against every Q8_K activation row.

    KERNELS[type](nt, w, aq, ad, bsums, out)     out[t, r] = weight row r . activation row t, bit for bit the
                                                 replay of what llama.cpp runs (`ggufpy.quants.x86.kernel_for`)

    T = 1       vec_dot     `grid_dot`: the accumulators in registers             quants.x86.iqgrid
                            (IQ2_S: `int8grid_iq2s.iq2_s_dot`; IQ2_XS, IQ1_M, IQ1_S,
                            IQ3_S: `int8grid_decode.staged_dot`: the same values in
                            fewer instructions)
    T = 2..7    vec_dot     `grid_dot_rows`: each weight block decoded once       quants.x86.iqgrid
    T >= 8      tiled       `int8grid_tiles.grid_tiles`: each weight row decoded  quants.x86.tiled
                            once into a scratch, eight activation rows at a time

One kernel per type (as int8dot's): numba compiles only those a model's types call. The tables are module
globals, which numba freezes into the compiled kernels as constants.
"""

from __future__ import annotations

import numpy as np

from ..constants import GGMLType
from ..quants.x86.tiled import TILED_MIN_BATCH
from ._numba import jit, prange, use_threads
from .int8grid_iq1 import delta_sums, iq1_m_dot, iq1_s_dot
from .int8grid_iq2s import iq2_s_dot
from .int8grid_iq2xs import iq2_xs_dot
from .int8grid_iq3s import iq3_s_dot
from .int8grid_tiles import SCRATCH_PER_BLOCK, activation_tiles, grid_tiles
from .int8ir_iqgrid import GRIDS, KSIGNS, SIGNS, grid_dot, grid_dot_rows

__all__ = ["KERNELS"]

_G_IQ2_XXS, _G_IQ2_XS, _G_IQ2_S = GRIDS["IQ2_XXS"], GRIDS["IQ2_XS"], GRIDS["IQ2_S"]
_G_IQ3_XXS, _G_IQ3_S, _G_IQ1 = GRIDS["IQ3_XXS"], GRIDS["IQ3_S"], GRIDS["IQ1_S"]


def _intrinsics(name: str) -> tuple:
    return grid_dot(name), grid_dot_rows(name), grid_tiles(name)


CHUNK = 16  # weight rows per parallel task (each allocates one scratch)


@jit
def _chunks(rows):
    return (rows + CHUNK - 1) // CHUNK


_IQ2_XXS_1, _IQ2_XXS_N, _IQ2_XXS_TILES = _intrinsics("IQ2_XXS")
_, _IQ2_XS_N, _IQ2_XS_TILES = _intrinsics("IQ2_XS")  # T = 1: _IQ2_XS_DECODE
_IQ2_XS_DECODE = iq2_xs_dot()  # T = 1: `grid_dot`'s values in fewer instructions (int8grid_iq2xs)
_, _IQ2_S_N, _IQ2_S_TILES = _intrinsics("IQ2_S")  # T = 1: _IQ2_S_DECODE
_IQ2_S_DECODE = iq2_s_dot()  # T = 1: `grid_dot`'s values in fewer instructions (int8grid_iq2s)
_IQ3_XXS_1, _IQ3_XXS_N, _IQ3_XXS_TILES = _intrinsics("IQ3_XXS")
_, _IQ3_S_N, _IQ3_S_TILES = _intrinsics("IQ3_S")  # T = 1: _IQ3_S_DECODE
_IQ3_S_DECODE = iq3_s_dot()  # T = 1 (int8grid_iq3s)
_, _IQ1_S_N, _IQ1_S_TILES = _intrinsics("IQ1_S")  # T = 1: _IQ1_S_DECODE
_IQ1_S_DECODE = iq1_s_dot()  # T = 1 (int8grid_iq1)
_, _IQ1_M_N, _IQ1_M_TILES = _intrinsics("IQ1_M")  # T = 1: _IQ1_M_DECODE
_IQ1_M_DECODE = iq1_m_dot()  # T = 1 (int8grid_iq1)


@jit(parallel=True)
def _mv_iq2_xxs(nt, w, aq, ad, bsums, out):
    previous = use_threads(nt)
    T, nb = aq.shape[0], aq.shape[1] // 256
    if T >= TILED_MIN_BATCH:
        ab, adt = activation_tiles(aq, ad)
        for c in prange(_chunks(w.shape[0])):
            buf = np.empty(nb * SCRATCH_PER_BLOCK, np.uint8)
            for r in range(c * CHUNK, min(w.shape[0], (c + 1) * CHUNK)):
                _IQ2_XXS_TILES(w, r, ab, adt, T, nb, _G_IQ2_XXS, KSIGNS, buf, out)
    else:
        for r in prange(w.shape[0]):
            if T == 1:
                out[0, r] = _IQ2_XXS_1(w, r, aq, 0, ad, bsums, nb, _G_IQ2_XXS, KSIGNS)
            else:
                _IQ2_XXS_N(w, r, aq, T, ad, bsums, nb, _G_IQ2_XXS, KSIGNS, out)
    use_threads(previous)


@jit(parallel=True)
def _mv_iq2_xs(nt, w, aq, ad, bsums, out):
    previous = use_threads(nt)
    T, nb = aq.shape[0], aq.shape[1] // 256
    if T >= TILED_MIN_BATCH:
        ab, adt = activation_tiles(aq, ad)
        for c in prange(_chunks(w.shape[0])):
            buf = np.empty(nb * SCRATCH_PER_BLOCK, np.uint8)
            for r in range(c * CHUNK, min(w.shape[0], (c + 1) * CHUNK)):
                _IQ2_XS_TILES(w, r, ab, adt, T, nb, _G_IQ2_XS, KSIGNS, buf, out)
    else:
        for r in prange(w.shape[0]):
            if T == 1:
                out[0, r] = _IQ2_XS_DECODE(w, r, aq, 0, ad, bsums, nb, _G_IQ2_XS)
            else:
                _IQ2_XS_N(w, r, aq, T, ad, bsums, nb, _G_IQ2_XS, KSIGNS, out)
    use_threads(previous)


@jit(parallel=True)
def _mv_iq2_s(nt, w, aq, ad, bsums, out):
    previous = use_threads(nt)
    T, nb = aq.shape[0], aq.shape[1] // 256
    if T >= TILED_MIN_BATCH:
        ab, adt = activation_tiles(aq, ad)
        for c in prange(_chunks(w.shape[0])):
            buf = np.empty(nb * SCRATCH_PER_BLOCK, np.uint8)
            for r in range(c * CHUNK, min(w.shape[0], (c + 1) * CHUNK)):
                _IQ2_S_TILES(w, r, ab, adt, T, nb, _G_IQ2_S, SIGNS, buf, out)
    else:
        for r in prange(w.shape[0]):
            if T == 1:
                out[0, r] = _IQ2_S_DECODE(w, r, aq, 0, ad, nb, _G_IQ2_S)
            else:
                _IQ2_S_N(w, r, aq, T, ad, bsums, nb, _G_IQ2_S, SIGNS, out)
    use_threads(previous)


@jit(parallel=True)
def _mv_iq3_xxs(nt, w, aq, ad, bsums, out):
    previous = use_threads(nt)
    T, nb = aq.shape[0], aq.shape[1] // 256
    if T >= TILED_MIN_BATCH:
        ab, adt = activation_tiles(aq, ad)
        for c in prange(_chunks(w.shape[0])):
            buf = np.empty(nb * SCRATCH_PER_BLOCK, np.uint8)
            for r in range(c * CHUNK, min(w.shape[0], (c + 1) * CHUNK)):
                _IQ3_XXS_TILES(w, r, ab, adt, T, nb, _G_IQ3_XXS, KSIGNS, buf, out)
    else:
        for r in prange(w.shape[0]):
            if T == 1:
                out[0, r] = _IQ3_XXS_1(w, r, aq, 0, ad, bsums, nb, _G_IQ3_XXS, KSIGNS)
            else:
                _IQ3_XXS_N(w, r, aq, T, ad, bsums, nb, _G_IQ3_XXS, KSIGNS, out)
    use_threads(previous)


@jit(parallel=True)
def _mv_iq3_s(nt, w, aq, ad, bsums, out):
    previous = use_threads(nt)
    T, nb = aq.shape[0], aq.shape[1] // 256
    if T >= TILED_MIN_BATCH:
        ab, adt = activation_tiles(aq, ad)
        for c in prange(_chunks(w.shape[0])):
            buf = np.empty(nb * SCRATCH_PER_BLOCK, np.uint8)
            for r in range(c * CHUNK, min(w.shape[0], (c + 1) * CHUNK)):
                _IQ3_S_TILES(w, r, ab, adt, T, nb, _G_IQ3_S, SIGNS, buf, out)
    else:
        for r in prange(w.shape[0]):
            if T == 1:
                out[0, r] = _IQ3_S_DECODE(w, r, aq, 0, ad, bsums, nb, _G_IQ3_S)
            else:
                _IQ3_S_N(w, r, aq, T, ad, bsums, nb, _G_IQ3_S, SIGNS, out)
    use_threads(previous)


@jit(parallel=True)
def _mv_iq1_s(nt, w, aq, ad, bsums, out):
    previous = use_threads(nt)
    T, nb = aq.shape[0], aq.shape[1] // 256
    if T >= TILED_MIN_BATCH:
        ab, adt = activation_tiles(aq, ad)
        for c in prange(_chunks(w.shape[0])):
            buf = np.empty(nb * SCRATCH_PER_BLOCK, np.uint8)
            for r in range(c * CHUNK, min(w.shape[0], (c + 1) * CHUNK)):
                _IQ1_S_TILES(w, r, ab, adt, T, nb, _G_IQ1, SIGNS, buf, out)
    else:
        for r in prange(w.shape[0]):
            if T == 1:
                out[0, r] = _IQ1_S_DECODE(w, r, aq, 0, ad, bsums, nb, _G_IQ1)
            else:
                _IQ1_S_N(w, r, aq, T, ad, bsums, nb, _G_IQ1, SIGNS, out)
    use_threads(previous)


@jit(parallel=True)
def _mv_iq1_m(nt, w, aq, ad, bsums, out):
    previous = use_threads(nt)
    T, nb = aq.shape[0], aq.shape[1] // 256
    if T >= TILED_MIN_BATCH:
        ab, adt = activation_tiles(aq, ad)
        for c in prange(_chunks(w.shape[0])):
            buf = np.empty(nb * SCRATCH_PER_BLOCK, np.uint8)
            for r in range(c * CHUNK, min(w.shape[0], (c + 1) * CHUNK)):
                _IQ1_M_TILES(w, r, ab, adt, T, nb, _G_IQ1, SIGNS, buf, out)
    else:
        qd = delta_sums(aq, 0) if T == 1 else bsums  # T = 1: the delta part's activation sums (int8grid_iq1)
        for r in prange(w.shape[0]):
            if T == 1:
                out[0, r] = _IQ1_M_DECODE(w, r, aq, 0, ad, qd, nb, _G_IQ1)
            else:
                _IQ1_M_N(w, r, aq, T, ad, bsums, nb, _G_IQ1, SIGNS, out)
    use_threads(previous)


KERNELS = {
    GGMLType.IQ2_XXS: _mv_iq2_xxs,
    GGMLType.IQ2_XS: _mv_iq2_xs,
    GGMLType.IQ2_S: _mv_iq2_s,
    GGMLType.IQ3_XXS: _mv_iq3_xxs,
    GGMLType.IQ3_S: _mv_iq3_s,
    GGMLType.IQ1_S: _mv_iq1_s,
    GGMLType.IQ1_M: _mv_iq1_m,
}
"""GGML type -> kernel(nt, w, aq, ad, bsums, out), every T (`int8lowbit.KERNELS` dispatches here)."""
