"""ggufpy: a pure-NumPy reference interpreter for GGUF models, with optional numba kernels."""

import os

# OpenBLAS's worker threads spin for 2^28 cycles (~0.1 s) after each BLAS call before they sleep. After a BLAS
# prefill that spinning takes a core from the numba decode kernels: the first 5 tokens on 2 cores took 20-30 ms
# instead of 9. 2^4 cycles lets them sleep at once. OpenBLAS reads this when NumPy loads it, so it applies only
# when ggufpy is imported before NumPy (the CLI, the bench); a value the user set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from .constants import GGMLType, GGUFValueType
from .errors import GGUFError, GGUFFormatError, GGUFMetadataError, GGUFUnsupportedError
from .loading import load
from .packaged import resolve as _resolve_model
from .reader import GGUFFile, TensorInfo
from .reader import open as _open_file
from .tokenizer import Tokenizer, load_tokenizer
from .transformer import Model

__version__ = "0.1.0"


def open(path: str | os.PathLike | None = None, *, mmap: bool = True) -> GGUFFile:
    """Open a GGUF file, or a packaged model by name or alias ("smollm2", "gemma-3-270m"; None = the default).

    The metadata and tensor table are parsed; tensor data stays memory-mapped (or, with `mmap=False`, is read
    into memory so that nothing can fault if the file changes). See `ggufpy.reader.open`.
    """
    return _open_file(_resolve_model(path), mmap=mmap)


__all__ = [
    "GGMLType",
    "GGUFError",
    "GGUFFile",
    "GGUFFormatError",
    "GGUFMetadataError",
    "GGUFUnsupportedError",
    "GGUFValueType",
    "Model",
    "TensorInfo",
    "Tokenizer",
    "__version__",
    "load",
    "load_tokenizer",
    "open",
]
