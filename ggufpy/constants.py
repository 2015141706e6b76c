"""GGUF and GGML enumerations and well-known metadata keys.

Values follow llama.cpp's `ggml/include/ggml.h` (enum ggml_type) and `gguf-py/gguf/constants.py`.
"""

from __future__ import annotations

from enum import IntEnum

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian u32
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # tensor names are < 64 bytes (ggml.h GGML_MAX_NAME)

# Limits on what a GGUF header may ask the reader to build (see docs/security.md). Each is far above every real
# model (Gemma 3's 262,144-token vocabulary is a 4.4 MB string array, the largest headers are ~20 MB, templates
# are tens of KB) and bounds the reader's memory and time on a crafted or sparse file. llama.cpp's gguf.cpp caps
# strings and array counts at 2**30; ggufpy is tighter because it builds Python objects.
GGUF_MAX_HEADER_BYTES = 256 * 2**20  # metadata and tensor infos end in the first 256 MiB (< 2**31: int32 offsets)
GGUF_MAX_STRING_BYTES = 64 * 2**20  # one string: a key, a value or an array element
GGUF_MAX_ARRAY_LEN = 2**24  # elements of one metadata array (16,777,216; vocabularies are < 300k)
GGUF_MAX_KV = 2**16  # metadata key-value pairs in one file (real models: < 100)
GGUF_MAX_TENSORS = 2**16  # tensor infos in one file (real models: < 3,000)
GGUF_MAX_ARRAY_DEPTH = 2  # an array of arrays is read; deeper nesting is refused (gguf.cpp reads no nesting)
GGUF_MAX_NESTED_ARRAYS = 2**16  # inner arrays of arrays-of-arrays in one file (each becomes a Python object)


class GGMLType(IntEnum):
    """Tensor data types. Ids 4, 5, 31-33 and 36-38 were removed from ggml and are rejected."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


# (elements per block, bytes per block) for every type a file may name, including those ggufpy cannot
# dequantize yet: the reader must size every tensor to check bounds. From ggml.c `type_traits`.
GGML_BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
    GGMLType.NVFP4: (64, 36),
    GGMLType.Q1_0: (128, 18),
}


class GGUFValueType(IntEnum):
    """Metadata value types (gguf.h enum gguf_type)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12
