"""llama.cpp's x86 CPU matmul, bit for bit: for each weight type, the kernel that runs, replayed in NumPy.

`ggufpy.quants.vecdot` quantizes activations exactly as ggml does; what remains between its products and
llama.cpp's is the order of the f32 operations inside ggml's SIMD kernels (lanes, FMAs per block, a
horizontal-sum tree), and that order differs from kernel to kernel. Each module here follows one family of
kernels of the build the conformance goldens were recorded with (llama-cpp-python 0.3.36, ggml 0.25.3, gcc 12,
`-march=native` on an AVX-512 + VNNI CPU, weight repacking on):

    legacy      Q4_1, Q5_1 . Q8_1           arch/x86/quants.c `ggml_vec_dot_q4_1_q8_1` / `_q5_1_q8_1`
    tiled       k-quants, IQ4_XS (T >= 8)   tiled/tiled-kernel.cpp, for weights that are not repacked
    iquants     IQ4_XS . Q8_K (T < 8)       arch/x86/quants.c `ggml_vec_dot_iq4_xs_q8_K`
    kquants     Q3_K, Q5_K, Q6_K (T < 8)    arch/x86/quants.c `ggml_vec_dot_q{3,5,6}_K_q8_K`
    repack      Q4_K, Q2_K                  repack.cpp 8x8 gemm/gemv (out % 8 == 0), else vec_dot
    repack_q8_0 Q4_0, IQ4_NL                repack.cpp 8x8 gemm/gemv (out % 8 == 0), else tinyBLAS / vec_dot
    llamafile   Q8_0, Q5_0                  llamafile/sgemm.cpp tinyBLAS (T >= 2), else vec_dot
    floats      F32, F16, BF16              llamafile/sgemm.cpp tinyBLAS (T >= 2, shapes permitting), else vec_dot

Every function takes the weight's GGUF rows u8 (out, row_bytes) and the activation rows in what the kernel
reads (`activations`), and returns f32 (T, out). Other builds (AVX2 only, ARM, flash attention...) round
elsewhere; `ggufpy.quants.vecdot.linear` with `order="exact"` gives the value they all approximate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...constants import GGMLType
from . import floats, iquants, kquants, legacy, llamafile, repack, repack_q8_0, tiled

__all__ = ["FLOAT_TYPES", "KERNELS", "activations_for", "matmul"]

KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    **legacy.KERNELS,
    **iquants.KERNELS,
    **kquants.KERNELS,
    **repack.KERNELS,
    **repack_q8_0.KERNELS,
    **llamafile.KERNELS,
    **floats.KERNELS,
}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def activations_for(x: np.ndarray, w_type: GGMLType, quantize: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """What the kernel of a `w_type` weight reads: f32 / f16 / bf16 bits for float weights
    (`floats.float_activations`), else `quantize(x)`, the rows in the weight's vec_dot type."""
    if w_type in FLOAT_TYPES:
        return floats.float_activations(x, w_type)
    return quantize(x)


def kernel_for(w_type: GGMLType, out: int, T: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The emulation of what ggml-cpu.c `ggml_compute_forward_mul_mat` runs for a weight of `out` rows and T
    activation rows: the tiled k-quant kernel takes T >= 8 rows of weights that were not repacked (Q4_K and
    Q2_K are repacked when out % 8 == 0); the type's own entry otherwise."""
    t = GGMLType(w_type)
    repacked = t in (GGMLType.Q4_K, GGMLType.Q2_K) and out % 8 == 0
    if t in tiled.KERNELS and T >= tiled.TILED_MIN_BATCH and not repacked:
        return tiled.KERNELS[t]
    return KERNELS[t]


def matmul(w: np.ndarray, w_type: GGMLType, a: np.ndarray) -> np.ndarray:
    """w u8 (out, row_bytes) GGUF rows of `w_type` times activation rows `a` (from `activations_for`):
    y f32 (T, out) as llama.cpp's x86 CPU backend computes it."""
    return kernel_for(w_type, w.shape[0], a.shape[0])(np.ascontiguousarray(w), a)
