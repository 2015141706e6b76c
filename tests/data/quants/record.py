"""Record goldens from ggml's C library for the types gguf-py cannot decode (Q1_0) or only recently can (NVFP4).

    .venv/bin/python tests/data/quants/record.py        # needs llama-cpp-python (the `conformance` extra)
    .venv/bin/python tests/data/quants/record.py --lib path/to/libggml-base.so   # or any build of ggml-quants.c

Writes `<type>.npz` here: `blocks` (random bytes, NaN/inf scale bit patterns included) and `expected`, the
floats of ggml's `dequantize_row_<type>`; `x` (random rows over six decades) and `q`, the bytes of
`quantize_row_<type>_ref(x)`.
tests/test_quant_types_new.py compares against them without llama-cpp-python.
"""

from __future__ import annotations

import argparse
import ctypes
import os
from pathlib import Path

import numpy as np

from conformance import llamacpp

HERE = Path(__file__).parent
TYPES = {"q1_0": (128, 18), "nvfp4": (64, 36)}  # name -> (block size, type size), ggml-common.h
N_BLOCKS = 64


def _row_function(lib: ctypes.CDLL, name: str):
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    return fn


def record(lib: ctypes.CDLL, source: str, name: str, block_size: int, type_size: int) -> Path:
    rng = np.random.default_rng(sum(map(ord, name)))
    blocks = rng.integers(0, 256, (N_BLOCKS, type_size), dtype=np.uint8)
    n = N_BLOCKS * block_size
    expected = np.zeros(n, np.float32)
    _row_function(lib, f"dequantize_row_{name}")(blocks.ctypes.data, expected.ctypes.data, n)
    arrays = {"blocks": blocks, "expected": expected}
    arrays["source"] = np.array(source)
    x = (rng.standard_normal((64, block_size)) * np.geomspace(1e-3, 1e3, 64)[:, None]).astype(np.float32)
    x[0, ::7] = 0.0  # Q1_0: x >= 0 sets the bit, -0.0 included
    x[1, ::5] = -0.0
    q = np.zeros((64, type_size), np.uint8)
    _row_function(lib, f"quantize_row_{name}_ref")(x.ctypes.data, q.ctypes.data, x.size)
    arrays |= {"x": x, "q": q}
    path = HERE / f"{name}.npz"
    np.savez_compressed(path, **arrays)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lib", help="a shared library exporting ggml's (de)quantize_row_* (default: llama-cpp-python's)"
    )
    parser.add_argument("--source", help="what --lib was built from, stored with the goldens")
    args = parser.parse_args()
    if args.lib:
        lib, source = ctypes.CDLL(args.lib, mode=os.RTLD_LAZY), args.source or args.lib
    else:
        lib, source = llamacpp._ggml_base(), str(llamacpp.versions())
    for name, (block_size, type_size) in TYPES.items():
        print(record(lib, source, name, block_size, type_size))
