"""Errors raised by ggufpy. Every malformed file raises a `GGUFError` subclass."""

from __future__ import annotations


class GGUFError(ValueError):
    """A GGUF file is malformed or unsupported.

    The message names the file, the field, the offending value and the rule it breaks.
    """


class GGUFFormatError(GGUFError):
    """The bytes do not follow the GGUF format (bad magic, truncation, bad lengths...)."""


class GGUFUnsupportedError(GGUFError):
    """The file is valid GGUF but uses something ggufpy does not support (version, quant type...)."""


class GGUFMetadataError(GGUFError):
    """A metadata value the model or tokenizer reads is missing, of the wrong type, or out of its range
    (see `ggufpy.schema`, the table of every key read)."""
