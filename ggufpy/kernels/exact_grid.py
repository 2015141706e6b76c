"""The exact numerics' decode kernels for IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M:
f32 activations times the blocks as stored, each block decoded in registers (`exact_grid_ir.exact_dot`).

    KERNELS[type](q u8[G, 64, row bytes], xv f32[T, cols], out f32[T, G*64], threads)

One parallel task per group of 64 weight rows (as `rawblocks._matvec`); one kernel per type, so numba compiles
only those a model's types call. The tables are module globals, which numba freezes into the kernels.
"""

from __future__ import annotations

import numpy as np

from ..constants import GGMLType
from ._numba import DISABLED, jit, prange, use_threads
from .exact_grid_decode import F32_GRIDS, SIGN_MASKS
from .exact_grid_ir import STAGE_FLOATS, exact_dot

__all__ = ["KERNELS"]

_EVEN, _FULL = SIGN_MASKS["even"], SIGN_MASKS["full"]
_G_IQ2_XXS, _G_IQ2_XS, _G_IQ2_S = F32_GRIDS["IQ2_XXS"], F32_GRIDS["IQ2_XS"], F32_GRIDS["IQ2_S"]
_G_IQ3_XXS, _G_IQ3_S, _G_IQ1 = F32_GRIDS["IQ3_XXS"], F32_GRIDS["IQ3_S"], F32_GRIDS["IQ1_S"]
_IQ2_XXS, _IQ2_XS, _IQ2_S = exact_dot("IQ2_XXS"), exact_dot("IQ2_XS"), exact_dot("IQ2_S")
_IQ3_XXS, _IQ3_S = exact_dot("IQ3_XXS"), exact_dot("IQ3_S")
_IQ1_S, _IQ1_M = exact_dot("IQ1_S"), exact_dot("IQ1_M")


@jit(inline=True)
def _scratch(nb):
    """The staged row (`exact_dot`'s buf), 32-byte aligned for its vector stores."""
    raw = np.empty(STAGE_FLOATS * nb + 8, np.float32)
    skip = (-raw.ctypes.data // 4) % 8
    return raw[skip : skip + STAGE_FLOATS * nb]


def _matvec(dot, grid, signs):
    """One type's kernel: `dot` and its tables are closure constants, which numba freezes into the kernel."""

    @jit(parallel=True)
    def kernel(nt, q, xv, out):
        previous = use_threads(nt)
        nb = xv.shape[1] // 256
        for g in prange(q.shape[0] // 64):
            buf = _scratch(nb)
            for r in range(64 * g, 64 * g + 64):
                dot(q, r, xv, nb, out, grid, signs, buf)
        use_threads(previous)

    return kernel


def _driver(kernel):
    def run(q: np.ndarray, xv: np.ndarray, out: np.ndarray, threads: int) -> None:
        rows = q.reshape(-1, q.shape[2])  # (G * 64, row bytes): one weight row per index
        xv = np.ascontiguousarray(xv, dtype=np.float32)
        if out.flags.c_contiguous:
            kernel(threads, rows, xv, out)
        else:
            dense = np.empty(out.shape, np.float32)
            kernel(threads, rows, xv, dense)
            out[...] = dense

    return run


# Without the JIT (NUMBA_DISABLE_JIT) the intrinsics cannot run: `rawblocks._matvec` computes these types then.
KERNELS: dict = (
    {}
    if DISABLED
    else {
        GGMLType.IQ2_XXS: _driver(_matvec(_IQ2_XXS, _G_IQ2_XXS, _EVEN)),
        GGMLType.IQ2_XS: _driver(_matvec(_IQ2_XS, _G_IQ2_XS, _EVEN)),
        GGMLType.IQ2_S: _driver(_matvec(_IQ2_S, _G_IQ2_S, _FULL)),
        GGMLType.IQ3_XXS: _driver(_matvec(_IQ3_XXS, _G_IQ3_XXS, _EVEN)),
        GGMLType.IQ3_S: _driver(_matvec(_IQ3_S, _G_IQ3_S, _FULL)),
        GGMLType.IQ1_S: _driver(_matvec(_IQ1_S, _G_IQ1, _FULL)),
        GGMLType.IQ1_M: _driver(_matvec(_IQ1_M, _G_IQ1, _FULL)),
    }
)
"""GGML type -> kernel(q u8[G, 64, row bytes], xv f32[T, cols], out f32[T, G*64], threads)."""
