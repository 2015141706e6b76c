"""Record llama.cpp's quantizer on the packaged models and a synthetic one, for tests/test_quantize_model.py.

    .venv/bin/python tests/data/quantize/record.py     # needs llama-cpp-python and the packaged models

Writes `goldens.json` here: for SmolLM2 and Gemma 3, the type llama.cpp gives each tensor under every mix
(`llama_model_quantize` dry runs, read from its log), in llama.cpp's tensor order; for the synthetic model of
`tests.test_quantize_model.synthetic_model`, the sha256 of its input file and, per mix (with and without an
importance matrix), the sha256 of every tensor llama.cpp writes and of the whole file.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))

from tests import models  # noqa: E402
from tests.quantize_oracle import llama_quantize, llama_types  # noqa: E402
from tests.test_quantize_model import (  # noqa: E402
    MIXES,
    SYNTHETIC_IMATRIX_MIXES,
    SYNTHETIC_MIXES,
    file_digests,
    synthetic_imatrix,
    synthetic_model,
)


def main() -> Path:
    out = {"types": {}, "synthetic": {}}
    for model in ("smollm2", "gemma3"):
        src = getattr(models, f"{model}_path")()
        out["types"][model] = {mix: llama_types(src, mix) for mix in MIXES}
    with tempfile.TemporaryDirectory() as tmp:
        src = synthetic_model(Path(tmp))
        out["synthetic"]["input_sha256"] = hashlib.sha256(src.read_bytes()).hexdigest()
        im = synthetic_imatrix(src)
        for mix, imatrix in [(m, None) for m in SYNTHETIC_MIXES] + [(m, im) for m in SYNTHETIC_IMATRIX_MIXES]:
            dst = llama_quantize(src, Path(tmp) / f"{mix}.gguf", mix, imatrix)
            key = mix + ("+imatrix" if imatrix else "")
            out["synthetic"][key] = file_digests(dst)
    import llama_cpp

    out["source"] = f"llama-cpp-python {llama_cpp.__version__}"
    path = HERE / "goldens.json"
    path.write_text(json.dumps(out, indent=0, sort_keys=False) + "\n")
    return path


if __name__ == "__main__":
    print(main())
