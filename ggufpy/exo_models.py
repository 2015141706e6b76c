"""Model ids as exo names them, resolved to local GGUF files (used by `ggufpy.exo`).

A shard's `model_id` is a path to a file or a folder, a name in one of the engine's models folders (exo's
download folders write "/" as "--"), or a packaged model ("smollm2", "gemma3"). See docs/exo.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from .shard import read_config

__all__ = ["PACKAGED_MODEL_IDS", "available_models", "gguf_in_folder", "n_layers", "resolve_model"]

# model ids that name a packaged model (`ggufpy.packaged`), lower case
PACKAGED_MODEL_IDS = {
    "smollm2": "smollm2",
    "smollm2-135m": "smollm2",
    "smollm2-135m-instruct": "smollm2",
    "huggingfacetb/smollm2-135m-instruct": "smollm2",
    "gemma3": "gemma3",
    "gemma3-270m": "gemma3",
    "gemma-3-270m": "gemma3",
    "gemma-3-270m-it": "gemma3",
}


def gguf_in_folder(folder: Path) -> Path:
    """The one model in `folder`: its single .gguf file, or the first part of a split model."""
    found = sorted(folder.glob("*.gguf"))
    firsts = [p for p in found if "-of-" not in p.stem or "-00001-of-" in p.stem]
    if len(firsts) == 1:
        return firsts[0]
    if not firsts:
        raise FileNotFoundError(f"{folder} holds no .gguf file")
    names = ", ".join(p.name for p in firsts)
    raise FileNotFoundError(f"{folder} holds several models ({names}): name the file in the model id")


def _as_file(candidate: Path) -> Path | None:
    if candidate.is_file():
        return candidate
    if candidate.is_dir():
        return gguf_in_folder(candidate)
    return None


def resolve_model(model_id: str | os.PathLike, models_dirs: Iterable[str | os.PathLike] = ()) -> Path:
    """The GGUF file an exo `model_id` names, tried in this order:

    1. a path to a .gguf file, or to a folder holding one model;
    2. in each models folder: `<id>`, `<id>.gguf`, and `<id>` with "/" written "--" (exo's download folders,
       e.g. `HuggingFaceTB--SmolLM2-135M-Instruct`), each a file or a folder;
    3. a packaged model: `PACKAGED_MODEL_IDS` ("smollm2", "gemma3" and their usual names).
    """
    model_id = str(model_id)
    found = _as_file(Path(model_id).expanduser())
    if found is not None:
        return found
    tried = [model_id]
    for folder in models_dirs:
        for name in dict.fromkeys([model_id, model_id + ".gguf", model_id.replace("/", "--")]):
            candidate = Path(folder).expanduser() / name
            tried.append(str(candidate))
            found = _as_file(candidate)
            if found is not None:
                return found
    packaged = PACKAGED_MODEL_IDS.get(model_id.lower())
    if packaged is not None:
        from .packaged import PACKAGED_MODELS

        return PACKAGED_MODELS[packaged]()
    raise FileNotFoundError(
        f"model id {model_id!r} names no GGUF file; tried {', '.join(tried)} and the packaged models "
        f"({', '.join(sorted(PACKAGED_MODEL_IDS))})"
    )


def available_models(models_dirs: Iterable[str | os.PathLike] = ()) -> dict[str, Path]:
    """Model id -> GGUF file for every model in the models folders (file stem or folder name) and every
    installed packaged model (under its short name)."""
    from .packaged import PACKAGED_MODELS, ModelNotInstalledError

    out: dict[str, Path] = {}
    for folder in models_dirs:
        folder = Path(folder).expanduser()
        for entry in sorted(folder.iterdir()) if folder.is_dir() else ():
            try:
                found = _as_file(entry)
            except FileNotFoundError:
                continue
            if found is not None and found.suffix == ".gguf":
                out.setdefault(entry.stem if entry.is_file() else entry.name, found)
    for name, lookup in PACKAGED_MODELS.items():
        try:
            out.setdefault(name, lookup())
        except (ModelNotInstalledError, OSError, ValueError):
            pass
    return out


def n_layers(path: Path) -> int:
    """The layer count of a GGUF file, checked as `ggufpy.load` checks its config."""
    return read_config(path).n_layers
