"""llama.cpp's x86 CPU matmul, bit for bit: for each weight type, the kernel that runs, replayed in NumPy.

`ggufpy.quants.vecdot` quantizes activations exactly as ggml does; what remains between its products and
llama.cpp's is the order of the f32 operations inside ggml's SIMD kernels (lanes, FMAs per block, a
horizontal-sum tree), and that order differs from kernel to kernel. Each module here follows one family of
kernels of the build the conformance goldens were recorded with (llama-cpp-python 0.3.36, ggml 0.25.3, gcc 12,
`-march=native` on an AVX-512 + VNNI CPU, weight repacking on):

    legacy      Q4_1, Q5_1 . Q8_1           arch/x86/quants.c `ggml_vec_dot_q4_1_q8_1` / `_q5_1_q8_1`
    tiled       k-quants, IQ2-IQ4          tiled/tiled-kernel.cpp (T >= 8), for weights that are not repacked
    iquants     IQ4_XS . Q8_K (T < 8)       arch/x86/quants.c `ggml_vec_dot_iq4_xs_q8_K`
    kquants     Q3_K, Q5_K, Q6_K (T < 8)    arch/x86/quants.c `ggml_vec_dot_q{3,5,6}_K_q8_K`
    repack      Q4_K, Q2_K                  repack.cpp 8x8 gemm/gemv (out % 8 == 0), else vec_dot
    repack_q8_0 Q4_0, IQ4_NL                repack.cpp 8x8 gemm/gemv (out % 8 == 0), else tinyBLAS / vec_dot
    llamafile   Q8_0, Q5_0                  llamafile/sgemm.cpp tinyBLAS (T >= 2), else vec_dot
    floats      F32, F16, BF16              llamafile/sgemm.cpp tinyBLAS (T >= 2, shapes permitting), else vec_dot
    mxfp4       MXFP4 . Q8_0                repack.cpp 8x8 gemm/gemv (out % 8 == 0), else vec_dot
    nvfp4       NVFP4 . Q8_0                arch/x86/quants.c `ggml_vec_dot_nvfp4_q8_0` (every shape)
    q1_0        Q1_0 . Q8_0                 arch/x86/quants.c `ggml_vec_dot_q1_0_q8_0` (every shape)
    ternary     TQ1_0, TQ2_0 . Q8_K         arch/x86/quants.c `ggml_vec_dot_tq{1,2}_0_q8_K` (every shape)
    iqgrid      IQ2_*, IQ3_* (T < 8)        arch/x86/quants.c `ggml_vec_dot_iq{2,3}_*_q8_K`; tiled from 8 rows

Every function takes the weight's GGUF rows u8 (out, row_bytes) and the activation rows in what the kernel
reads (`activations`), and returns f32 (T, out).

The AVX2 build (`isa="avx2"`: the same gcc and ggml on a CPU without AVX-512) runs the same families with
three differences: F32/F16/BF16 products are 8 lanes wide (`floats`), Q2_K weights are not repacked (vec_dot
below 8 rows, the tiled kernel from 8), and the tiled kernel's AVX2 microkernel replaces the VNNI one (integer
sums exact in both, the same float epilogue: `tiled` serves both). The integer dot products of the other
kernels (`maddubs` + `madd` instead of `dpbusd`) are exact on either. Other builds (ARM, flash attention...)
round elsewhere; `ggufpy.quants.vecdot.linear` with `order="exact"` gives the value they all approximate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from . import (
    floats,
    iqgrid,
    iquants,
    kquants,
    legacy,
    llamafile,
    mxfp4,
    nvfp4,
    q1_0,
    repack,
    repack_q8_0,
    ternary,
    tiled,
)

__all__ = ["FLOAT_TYPES", "KERNELS", "activations_for", "matmul"]

KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    **legacy.KERNELS,
    **iquants.KERNELS,
    **kquants.KERNELS,
    **repack.KERNELS,
    **repack_q8_0.KERNELS,
    **llamafile.KERNELS,
    **floats.KERNELS,
    **mxfp4.KERNELS,
    **nvfp4.KERNELS,
    **q1_0.KERNELS,
    **ternary.KERNELS,
    **iqgrid.KERNELS,
}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def activations_for(x: np.ndarray, w_type: GGMLType, quantize: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """What the kernel of a `w_type` weight reads: f32 / f16 / bf16 bits for float weights
    (`floats.float_activations`), else `quantize(x)`, the rows in the weight's vec_dot type."""
    if w_type in FLOAT_TYPES:
        return floats.float_activations(x, w_type)
    return quantize(x)


# Weight types repack.cpp `ggml_repack_get_optimal_repack_type` moves to an 8x8 layout (when out % 8 == 0), by build.
_K_REPACKED = {"avx512": (GGMLType.Q4_K, GGMLType.Q2_K), "avx2": (GGMLType.Q4_K,)}


def kernel_for(
    w_type: GGMLType, out: int, T: int, isa: str = "avx512"
) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The emulation of what ggml-cpu.c `ggml_compute_forward_mul_mat` runs, on the `isa` build
    (`simd.ISAS`), for a weight of `out` rows and T activation rows: the tiled k-quant kernel takes T >= 8 rows
    of weights that were not repacked (Q4_K, and on AVX-512 Q2_K, are repacked when out % 8 == 0); the type's
    own entry otherwise."""
    t = GGMLType(w_type)
    repacked = t in _K_REPACKED[isa] and out % 8 == 0
    if t in tiled.KERNELS and T >= tiled.TILED_MIN_BATCH and not repacked:
        return tiled.KERNELS[t]
    if t in FLOAT_TYPES:
        return functools.partial(floats.KERNELS[t], isa=isa)
    if t == GGMLType.Q2_K and not repacked:
        return repack.vec_dot_q2_k
    return KERNELS[t]


def matmul(w: np.ndarray, w_type: GGMLType, a: np.ndarray, isa: str = "avx512") -> np.ndarray:
    """w u8 (out, row_bytes) GGUF rows of `w_type` times activation rows `a` (from `activations_for`):
    y f32 (T, out) as llama.cpp's x86 CPU backend (the `isa` build) computes it."""
    return kernel_for(w_type, w.shape[0], a.shape[0], isa)(np.ascontiguousarray(w), a)
