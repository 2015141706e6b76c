"""Quant type registry and NumPy reference (de)quantization, bit-identical to llama.cpp's ggml.

    from ggufpy.quants import QUANT_TYPES, dequantize, quantize, quant_type

    w = dequantize(raw_bytes, GGMLType.Q4_K, (n_rows, n_cols))   # f32[n_rows, n_cols]

Modules: `registry` (records and lookup), `floats` (F32/F16/BF16 and the storage types I8/I16/I32/F64),
`legacy` (Q4_0..Q8_1), `kquants` (Q2_K..Q8_K), `iquants` (IQ4_NL, IQ4_XS), `iqgrid` (IQ1_S/M, IQ2_XXS/XS/S,
IQ3_XXS/S) with their tables in `grids`, `lowbit` (TQ1_0, TQ2_0, Q1_0, MXFP4, NVFP4), `quantizers` (reference
quantizers), `fields` (byte helpers).
"""

from .registry import QUANT_TYPES, QuantType, dequantize, quant_type, quantize

__all__ = ["QUANT_TYPES", "QuantType", "dequantize", "quant_type", "quantize"]
