"""numba kernels: dequantization, fused quantized matrix-vector products, attention.

Everything here is optional. `AVAILABLE` says whether numba imports (`JIT_DISABLED`: it does, but
NUMBA_DISABLE_JIT=1 makes its kernels plain Python); without it this package still imports and the NumPy
reference (`ggufpy.quants`, `ggufpy.backend.NumpyBackend`) does all the work.

    from ggufpy.kernels import AVAILABLE, NumbaBackend   # NumbaBackend raises ImportError without numba

Modules: `_numba` (the one numba import), `dequant` (per-type dequantizers, bit-identical to the reference),
`layout` (load-time repacking into row-interleaved groups), `activations` (ggml's Q8_0/Q8_1/Q8_K activation
quantizers), `matvec` (fused kernels), `attention`, `ops` (RMSNorm, RoPE, activations), `backend`
(`NumbaBackend`), `bench` (timing helpers). Design and measurements: docs/kernels.md.
"""

from __future__ import annotations

try:
    from . import _numba
except ImportError as e:  # numba missing or broken: the NumPy backend still works
    AVAILABLE = False
    IMPORT_ERROR: ImportError | None = e
    JIT_DISABLED = False
else:
    AVAILABLE = True
    IMPORT_ERROR = None
    JIT_DISABLED = _numba.DISABLED  # NUMBA_DISABLE_JIT=1: the kernels run as plain Python

__all__ = ["AVAILABLE", "IMPORT_ERROR", "JIT_DISABLED", "NumbaBackend"]


def __getattr__(name: str):
    if name == "NumbaBackend":
        if not AVAILABLE:
            raise ImportError(f"the numba backend needs numba, which failed to import: {IMPORT_ERROR}")
        from .backend import NumbaBackend

        return NumbaBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
