"""ggufpy: a pure-NumPy reference interpreter for GGUF models, with optional numba kernels."""

from .constants import GGMLType, GGUFValueType
from .errors import GGUFError, GGUFFormatError, GGUFUnsupportedError
from .reader import GGUFFile, TensorInfo, open

__version__ = "0.1.0"

__all__ = [
    "GGMLType",
    "GGUFError",
    "GGUFFile",
    "GGUFFormatError",
    "GGUFUnsupportedError",
    "GGUFValueType",
    "TensorInfo",
    "__version__",
    "open",
]
