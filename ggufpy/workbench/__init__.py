"""The quantization workbench (issue 17): llama.cpp's quantizer and its mixes, importance-matrix files.

`mixes` (which type each tensor gets), `quantize` (`quantize_model`, the file writer), `imatrix_file`
(llama.cpp's imatrix GGUF). The quantizers themselves are in `ggufpy.quants.rowquantizers`.
"""
