"""ggufpy: a pure-NumPy reference interpreter for GGUF models, with optional numba kernels."""

import os

# OpenBLAS's worker threads spin for 2^28 cycles (~0.1 s) after each BLAS call before they sleep. After a BLAS
# prefill that spinning takes a core from the numba decode kernels: the first 5 tokens on 2 cores took 20-30 ms
# instead of 9. 2^4 cycles lets them sleep at once. OpenBLAS reads this when NumPy loads it, so it applies only
# when ggufpy is imported before NumPy (the CLI, the bench); a value the user set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from .constants import GGMLType, GGUFValueType
from .errors import GGUFError, GGUFFormatError, GGUFUnsupportedError
from .loading import load
from .reader import GGUFFile, TensorInfo, open
from .tokenizer import Tokenizer, load_tokenizer
from .transformer import Model

__version__ = "0.1.0"

__all__ = [
    "GGMLType",
    "GGUFError",
    "GGUFFile",
    "GGUFFormatError",
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
