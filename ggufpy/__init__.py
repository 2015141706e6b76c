"""ggufpy: a pure-NumPy reference interpreter for GGUF models, with optional numba kernels."""

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
