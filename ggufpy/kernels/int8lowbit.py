"""Integer dot products for issue 12's types in the llamacpp numerics: ggml's AVX2 integer block dots with the
Q8_K / Q8_0 activations and its f32 steps in its order, as LLVM IR (`int8ir.py`'s helpers), one registry.

    KERNELS[type] = (activation format, block bytes, elements per block, kernel)   # registered by int8dot

The spec is the NumPy replay of the x86 kernel llama.cpp runs for the type and shape
(`ggufpy.quants.x86.kernel_for`), reproduced bit for bit (each module's tests compare with `np.array_equal`,
and live with llama.cpp's own mul_mat):

    type                        vec_dot  kernel replayed                                      module
    IQ2_XXS/XS/S, IQ3_XXS/S     Q8_K     T < 8: vec_dot, 8 lanes; T >= 8: the tiled kernel    int8grid (int8ir_iqgrid)
    IQ1_S, IQ1_M                Q8_K     as above, the delta term apart                       int8grid (int8ir_iqgrid)
    TQ1_0, TQ2_0                Q8_K     vec_dot (every shape)                                int8ir_ternary
    Q1_0                        Q8_0     vec_dot (every shape)                                int8ir_ternary
    MXFP4                       Q8_0     repacked 8x8 gemv/gemm (out % 8 == 0), else vec_dot  int8ir_fp4
    NVFP4                       Q8_0     vec_dot (every shape)                                int8ir_fp4

The weights stay the file's blocks (MXFP4 experts: copied once into eight-row groups of the same size,
`int8ir_fp4_x8`); each kernel decodes a block to int8 in registers (grid rows, `vpshufb` tables, shifts).
"""

from __future__ import annotations

from ..constants import GGMLType
from ..quants import quant_type
from .int8grid import KERNELS as GRID_KERNELS
from .int8ir_fp4 import KERNELS as FP4_KERNELS
from .int8ir_ternary import KERNELS as TERNARY_KERNELS

__all__ = ["KERNELS", "Q8_0", "Q8_K"]

Q8_0, Q8_K = "Q8_0", "Q8_K"  # activation formats, as int8dot names them


def _grid_entry(t: GGMLType) -> tuple:
    return (Q8_K, quant_type(t).type_size, 256, GRID_KERNELS[t])


KERNELS = {t: _grid_entry(t) for t in GRID_KERNELS} | FP4_KERNELS | TERNARY_KERNELS
"""GGML type -> (activation format, block bytes, elements per block, kernel): `int8dot.INT8_TYPES` entries."""
