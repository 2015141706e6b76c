"""Record goldens of ggml's IQ1/IQ2/IQ3 quantizers, with and without an importance matrix.

    .venv/bin/python tests/data/quants/record_iqgrid_quantizers.py     # needs llama-cpp-python (`conformance`)

Writes `iqgrid_quantizers.npz` here: `x` and `imatrix` (tests/test_quantize_iqgrid.py `golden_inputs`), and for
each type `chunk_<TYPE>_imatrix` (the bytes of `ggml_quantize_chunk` with the imatrix) and, for the types ggml
quantizes without one (IQ2_S, IQ3_XXS, IQ3_S, IQ1_M), `chunk_<TYPE>`. Recorded with glibc 2.36, whose qsort
(a stable merge sort here) orders the IQ1 quantizers' tied values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))

from tests.test_quantize_iqgrid import NO_IMATRIX, TYPES, golden_inputs  # noqa: E402
from tests.test_quantize_kquants import c_quantize_chunk  # noqa: E402


def main() -> Path:
    x, imatrix = golden_inputs()
    arrays = {"x": x, "imatrix": imatrix}
    for t in TYPES:
        arrays[f"chunk_{t.name}_imatrix"] = c_quantize_chunk(t, x, imatrix)
        if t in NO_IMATRIX:
            arrays[f"chunk_{t.name}"] = c_quantize_chunk(t, x, None)
    import llama_cpp

    arrays["source"] = np.array(f"llama-cpp-python {llama_cpp.__version__}")
    path = HERE / "iqgrid_quantizers.npz"
    np.savez_compressed(path, **arrays)
    return path


if __name__ == "__main__":
    print(main())
