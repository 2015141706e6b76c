"""Record goldens of ggml's k-quant / IQ4 / legacy quantizers, with and without an importance matrix.

    .venv/bin/python tests/data/quants/record_kquantizers.py     # needs llama-cpp-python (the `conformance` extra)

Writes `kquantizers.npz` here: `x` (rows: Gaussian, six decades of scale, quarter-step ties and the edge
cases of tests/test_quantize_kquants.py), `imatrix`, and for each type `chunk_<TYPE>` / `chunk_<TYPE>_imatrix`
(the bytes of `ggml_quantize_chunk`) and `ref_<TYPE>` (`quantize_row_<type>_ref`, from the second row on: the
IQ4_NL reference packs stale stack codes for an all-zero first block). tests/test_quantize_kquants.py compares
against them without llama-cpp-python.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))

from tests.test_quantize_kquants import (  # noqa: E402
    CHUNK_TYPES,
    REF_TYPES,
    c_quantize_chunk,
    c_quantize_ref,
    golden_inputs,
)


def main() -> Path:
    x, imatrix = golden_inputs()
    arrays = {"x": x, "imatrix": imatrix}
    for t in CHUNK_TYPES:
        arrays[f"chunk_{t.name}"] = c_quantize_chunk(t, x, None)
        arrays[f"chunk_{t.name}_imatrix"] = c_quantize_chunk(t, x, imatrix)
    for t in REF_TYPES:
        arrays[f"ref_{t.name}"] = c_quantize_ref(t, x[1:])
    import llama_cpp

    arrays["source"] = np.array(f"llama-cpp-python {llama_cpp.__version__}")
    path = HERE / "kquantizers.npz"
    np.savez_compressed(path, **arrays)
    return path


if __name__ == "__main__":
    print(main())
