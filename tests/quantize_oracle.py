"""llama.cpp's quantizer through llama-cpp-python, for tests/test_quantize_model.py and its golden recorder.

`llama_quantize` runs `llama_model_quantize` (what llama-quantize runs), optionally with an importance matrix;
`llama_types` runs it as a dry run and reads the type chosen for each tensor from its log.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np

from ggufpy.workbench.imatrix_file import ImatrixFile
from ggufpy.workbench.mixes import ALIASES, FTYPES

_LOG_LINE = re.compile(
    r"\]\s+(\S+)\s+- \[[^\]]*\], type =\s+(\w+), (?:size =\s+[\d.]+ MiB(?: ->\s+[\d.]+ MiB \((\w+)\))?)"
)


def _params(mix: str, dry_run: bool = False):
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = FTYPES[ALIASES.get(mix, mix)].value
    p.allow_requantize = True
    p.nthread = 1
    p.dry_run = dry_run
    return p


def llama_quantize(src: Path, dst: Path, mix: str, imatrix: ImatrixFile | None = None) -> Path:
    """llama_model_quantize(src, dst, mix) with --allow-requantize; the imatrix's values as llama-quantize
    passes them (sums / counts). Raises if llama.cpp reports a failure."""
    import llama_cpp

    p = _params(mix)
    keep = []
    if imatrix is not None:
        rows = (llama_cpp.llama_model_imatrix_data * (len(imatrix.entries) + 1))()
        for i, name in enumerate(sorted(imatrix.entries)):
            values = np.ascontiguousarray(imatrix.entries[name].values(), np.float32)
            keep.append(values)
            rows[i].name = name.encode()
            rows[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            rows[i].size = values.size
        p.imatrix = ctypes.cast(rows, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(rows)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {mix}) failed with {rc}")
    return dst


def llama_types(src: Path, mix: str) -> dict[str, str]:
    """The ggml type llama.cpp chooses for every tensor of `src` under `mix` (a dry run; parsed from its log)."""
    import llama_cpp

    chunks: list[str] = []

    @llama_cpp.llama_log_callback
    def on_log(level, text, user_data):
        chunks.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(on_log, ctypes.c_void_p())
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), b"/dev/null", ctypes.byref(_params(mix, dry_run=True)))
    finally:
        llama_cpp.llama_log_set(ctypes.cast(None, llama_cpp.llama_log_callback), ctypes.c_void_p())
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize dry run of {src} to {mix} failed with {rc}")
    found = {m.group(1): (m.group(3) or m.group(2)).upper() for m in _LOG_LINE.finditer("".join(chunks))}
    if not found:
        raise RuntimeError("no per-tensor lines in llama.cpp's dry-run log")
    return found
