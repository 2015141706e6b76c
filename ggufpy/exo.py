"""exo adapter: `GGUFInferenceEngine`, a CPU engine for exo nodes that runs any layer range of a GGUF model.

It implements the inference-engine interface of the 2024-2025 exo codebase (`exo/inference/inference_engine.py`
and `exo/inference/shard.py` up to exo commit 5f18fae, the last before the legacy tree was removed):

    engine = GGUFInferenceEngine(shard_downloader=None)
    shard = Shard("smollm2", 0, 14, 30)                       # exo's Shard: inclusive end layer
    hidden, state = await engine.infer_prompt("req", shard, prompt)    # (1, T, 576) float32
    ...                                                       # the last shard returns logits (1, T, vocab)
    token = await engine.sample(logits, temp=0.0)             # (1,) int64, fed back as token.reshape(1, -1)

When exo is importable the class subclasses exo's `InferenceEngine` ABC; otherwise it stands alone with the same
async methods. All model and tokenizer work runs in the engine's one-thread executor, never in the event loop
(exo's rule: https://github.com/exo-explore/exo/issues/325). The compute core is `ggufpy.shard.ShardEngine`.

A shard's `model_id` resolves to a local GGUF file (`resolve_model`): a path to a file or a folder, a name in
one of the engine's models folders, or a packaged default model ("smollm2", "gemma3"). `install_into_exo`
registers the engine with an exo checkout, and `python -m ggufpy.exo` starts an exo node with it (docs/exo.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .checks import check_request_id, is_real
from .exo_models import PACKAGED_MODEL_IDS, available_models, gguf_in_folder, resolve_model
from .exo_models import n_layers as _n_layers
from .hf import HFStyleTokenizer
from .kvcache import ContextLengthError
from .sampling import Sampler, SamplingParams
from .shard import DEFAULT_MAX_REQUESTS, RequestCaches, Shard, ShardEngine

try:  # the legacy exo tree (before exo commit 0fcee7083); its engines subclass this ABC
    from exo.inference.inference_engine import InferenceEngine as _ExoInferenceEngine

    EXO_AVAILABLE = True
except ImportError:
    _ExoInferenceEngine = object
    EXO_AVAILABLE = False

__all__ = [
    "ENGINE_NAME",
    "EXO_AVAILABLE",
    "PACKAGED_MODEL_IDS",
    "GGUFInferenceEngine",
    "RequestInFlightError",
    "available_models",
    "install_into_exo",
    "resolve_model",
]

ENGINE_NAME = "gguf"  # exo's `--inference-engine gguf`

# -- the engine ------------------------------------------------------------------------------------------


class RequestInFlightError(RuntimeError):
    """A call for a request id arrived while another call for the same id was running: two callers share
    the id, and their positions would interleave in one KV cache."""


class GGUFInferenceEngine(_ExoInferenceEngine):
    """exo's inference-engine interface over `ggufpy.shard.ShardEngine`.

    Holds one shard at a time, as exo's own engines do: a different shard (re)loads the model (memory-mapped,
    so this is cheap) and drops the KV caches. Keyword options: `models_dir` (one folder or several) where
    model ids are looked up; `backend` (default: numba when installed, else numpy), `numerics` and backend
    options as for `ggufpy.load`; `max_requests`, the KV-cache LRU size; `seed` for `sample` with temp > 0.

    Requests are checked, since exo's protocol carries no positions: a second call for a request id while
    one runs raises `RequestInFlightError`; a single token for a request the first shard does not hold (a
    decode step after eviction, a shard switch or a restart) raises `EvictedRequestError`, as does any step
    of a request dropped by a shard switch; a request that fills the context ends with EOS (`infer_tensor`).
    """

    def __init__(
        self,
        shard_downloader: Any = None,
        *,
        models_dir: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        backend: str | None = None,
        numerics: str = "exact",
        max_requests: int = DEFAULT_MAX_REQUESTS,
        seed: int | None = None,
        **backend_options: Any,
    ):
        self.shard = None  # the shard object exo passed in, as exo's engines keep it
        self.shard_downloader = shard_downloader
        if models_dir is None:
            models_dir = ()
        elif isinstance(models_dir, (str, os.PathLike)):
            models_dir = (models_dir,)
        self.models_dirs = tuple(Path(d) for d in models_dir)
        self.backend = backend
        self.numerics = numerics
        self.max_requests = RequestCaches(max_requests).max_requests  # checked now, not at the first shard
        self.backend_options = backend_options
        self.rng = np.random.default_rng(seed)
        self.engine: ShardEngine | None = None
        self.tokenizer: HFStyleTokenizer | None = None
        self.model_path: Path | None = None
        self.session: dict[str, Any] = {}  # exo's ABC shares one class-level dict; each engine gets its own
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ggufpy-exo")
        self._shard_lock = asyncio.Lock()
        self._in_flight: set[str] = set()  # request ids with an infer_* call running

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    @contextlib.contextmanager
    def _claim(self, request_id: str):
        """Mark `request_id` in flight for one call; a second call meanwhile is refused, not interleaved.

        Claimed before the call's first await, so two tasks started together (asyncio.gather) always collide.
        """
        check_request_id(request_id)
        if request_id in self._in_flight:
            raise RequestInFlightError(
                f"request {request_id!r} already has a call running on this engine: two prompts or callers "
                "share the id, and their positions would mix in one KV cache; give each request its own id"
            )
        self._in_flight.add(request_id)
        try:
            yield
        finally:
            self._in_flight.discard(request_id)

    # -- shards -------------------------------------------------------------------------------------------
    async def ensure_shard(self, shard: Any) -> None:
        """Load `shard` (any object with exo's Shard fields) unless it is the one loaded."""
        wanted = Shard.of(shard)
        async with self._shard_lock:
            if self.engine is not None and Shard.of(self.shard) == wanted:
                return
            path = await self._model_file(wanted)
            self._switch(shard, await self._run(self._load, path, wanted), path)

    async def load_checkpoint(self, shard: Any, path: str) -> None:
        """Serve `shard`'s layers from the GGUF file at `path` (a GGUF file is this engine's checkpoint)."""
        wanted = Shard.of(shard)
        async with self._shard_lock:
            path = Path(path)
            self._switch(shard, await self._run(self._load, path, wanted), path)

    async def save_checkpoint(self, shard: Any, path: str) -> None:
        raise NotImplementedError("ggufpy runs inference only: its GGUF weights are read-only, nothing to save")

    async def _model_file(self, shard: Shard) -> Path:
        try:
            return resolve_model(shard.model_id, self.models_dirs)
        except FileNotFoundError:
            if self.shard_downloader is None:
                raise
        where = Path(await self.shard_downloader.ensure_shard(shard, type(self).__name__))
        return where if where.is_file() else gguf_in_folder(where)

    def _load(self, path: Path, shard: Shard) -> ShardEngine:
        from .backend import default_backend

        n_layers = _n_layers(path)
        if n_layers != shard.n_layers:
            raise ValueError(f"{path} has {n_layers} layers but the shard {shard} says n_layers={shard.n_layers}")
        return ShardEngine.load(
            path,
            shard.start_layer,
            shard.end_layer,
            backend=self.backend or default_backend(),
            numerics=self.numerics,
            max_requests=self.max_requests,
            **self.backend_options,
        )

    def _switch(self, shard: Any, engine: ShardEngine, path: Path) -> None:
        if self.tokenizer is None or path != self.model_path:
            self.tokenizer = HFStyleTokenizer(engine.tokenizer, engine.config.context_length)
        if self.engine is not None:  # their positions stay behind: a continuation must not restart at 0
            for request_id in self.engine.caches.ids():
                engine.caches.forget(request_id)
        self.engine, self.shard, self.model_path = engine, shard, path

    # -- tokens -------------------------------------------------------------------------------------------
    async def encode(self, shard: Any, prompt: str) -> np.ndarray:
        """Token ids (T,) int64 of a prompt string, special tokens parsed (exo passes chat-templated text).

        BOS is added when the model wants one and the text does not already start with it, as llama.cpp's
        chat path does (HF tokenizers would add a second one).
        """
        await self.ensure_shard(shard)
        return np.asarray(await self._run(self._encode, prompt), dtype=np.int64)

    def _encode(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str, got {type(prompt).__name__}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates, e.g. from bytes decoded with surrogateescape
            raise ValueError(
                f"the prompt is not valid Unicode: {prompt[e.start : e.end]!r} at index {e.start} is a lone "
                "surrogate; decode bytes with errors='replace' or 'strict' first"
            ) from None
        tok = self.engine.tokenizer
        bos = tok.piece(tok.bos_id) if tok.bos_id is not None else None
        add_special = not (bos and prompt.startswith(bos))
        return tok.encode(prompt, add_special=add_special, parse_special=True)

    async def decode(self, shard: Any, tokens: Any) -> str:
        """Text of token ids (any shape), special tokens rendered as an HF tokenizer's `decode` does."""
        await self.ensure_shard(shard)
        ids = np.asarray(tokens)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):  # decode would truncate 1.7 to 1
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        return await self._run(self.tokenizer.decode, ids)

    async def sample(self, x: np.ndarray, temp: float = 0.0, top_p: float = 1.0) -> np.ndarray:
        """The next token (1,) int64 from the last position of logits x (1, T, vocab); temp 0 is greedy.

        Temperature and top-p go through ggufpy's sampler chain (`ggufpy.sampling`, llama.cpp's order) with
        the engine's own random generator.
        """
        return await self._run(self._sample, x, temp, top_p)

    def _sample(self, x: np.ndarray, temp: float, top_p: float) -> np.ndarray:
        if not (is_real(temp) and math.isfinite(temp) and temp >= 0):
            raise ValueError(f"temp must be a finite number >= 0 (0 is greedy), got {temp!r}")
        if not (is_real(top_p) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        logits = np.asarray(x)
        vocab = self.engine.config.vocab_size if self.engine is not None else None
        if logits.ndim == 0 or logits.size == 0 or not np.issubdtype(logits.dtype, np.floating):
            raise ValueError(f"sample takes logits (1, T, vocab) float32, got {logits.dtype} {logits.shape}")
        if vocab is not None and logits.shape[-1] != vocab:
            raise ValueError(
                f"sample takes the last shard's logits (1, T, {vocab}); got {logits.shape}, whose last axis is "
                "not the vocabulary (hidden states?)"
            )
        last = logits.reshape(-1, logits.shape[-1])[-1].astype(np.float32)  # x[:, -1, :] of (1, T, V)
        if np.isnan(last).any():
            raise ValueError(f"the logits to sample from hold NaN (at token {int(np.flatnonzero(np.isnan(last))[0])})")
        params = SamplingParams(temperature=temp, top_k=0, top_p=top_p, min_p=0.0)
        return np.array([Sampler(params, self.rng)(last)], dtype=np.int64)

    # -- inference ----------------------------------------------------------------------------------------
    async def infer_tensor(
        self, request_id: str, shard: Any, input_data: np.ndarray, inference_state: dict | None = None
    ) -> tuple[np.ndarray, dict | None]:
        """Run the shard on the request's next positions: token ids (1, T) on the first shard, hidden states
        (1, T, dim) elsewhere; returns hidden states (1, T, dim), or logits (1, T, vocab) on the last shard,
        float32. `inference_state` passes through unchanged (ggufpy keeps its state in the KV caches).

        A request that has filled the model's context ends as exo ends requests: the last shard returns logits
        whose only finite entry is the EOS token, the other shards pass the hidden states through."""
        with self._claim(request_id):
            await self.ensure_shard(shard)
            out = await self._run(self._forward, request_id, input_data, False)
        return out, inference_state

    async def infer_prompt(
        self, request_id: str, shard: Any, prompt: str, inference_state: dict | None = None
    ) -> tuple[np.ndarray, dict | None]:
        """exo's `infer_prompt` (encode, then `infer_tensor` on (1, T)), starting the request afresh."""
        with self._claim(request_id):
            tokens = await self.encode(shard, prompt)
            out = await self._run(self._forward, request_id, tokens.reshape(1, -1), True)
        return out, inference_state

    def _forward(self, request_id: str, x: Any, new_sequence: bool) -> np.ndarray:
        engine = self.engine
        x = np.asarray(x)
        held = request_id in engine.caches
        T = x.shape[1] if x.ndim >= 2 else 0
        if new_sequence or T == 0:
            return engine.forward(request_id, x, new_sequence)
        if engine.is_first and not held and T == 1:
            # exo's node feeds a sampled token back to the first shard; a request starts with infer_prompt
            raise engine.caches.evicted(
                request_id, "continues with one sampled token but this shard holds no positions for it"
            )
        if held and T > engine.room(request_id):
            return self._end_of_context(request_id, x)
        return engine.forward(request_id, x)

    def _end_of_context(self, request_id: str, x: np.ndarray) -> np.ndarray:
        """What a shard returns for a request with no room left: exo stops a request at the EOS token only."""
        engine = self.engine
        x = engine.check_input(x)  # a malformed input is still an error, even with no room left
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ContextLengthError(
                f"request {request_id!r} filled the context length {engine.config.context_length} and the model "
                "has no EOS token to end it with"
            )
        T = x.shape[0]
        if engine.is_last:
            logits = np.full((1, T, engine.config.vocab_size), -np.inf, np.float32)
            logits[:, :, eos] = 0.0
            return logits
        if engine.is_first:
            return np.zeros((1, T, engine.config.dim), np.float32)
        return x[None]

    async def evaluate(self, *args, **kwargs):
        raise NotImplementedError("ggufpy runs inference only: no evaluate (training loss) support")

    async def train(self, *args, **kwargs):
        raise NotImplementedError("ggufpy runs inference only: no training support")

    async def save_session(self, key: str, value: Any) -> None:
        self.session[key] = value

    async def clear_session(self) -> None:
        self.session.clear()

    async def cleanup(self) -> None:
        self.executor.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"GGUFInferenceEngine(shard={self.shard}, engine={self.engine})"


# -- exo integration -------------------------------------------------------------------------------------


def install_into_exo(models_dirs: Iterable[str | os.PathLike] = (), **engine_options: Any) -> list[str]:
    """Register `GGUFInferenceEngine` with the legacy exo tree in this process; returns the model ids added.

    - `get_inference_engine("gguf", downloader)` builds the engine (with `models_dirs` and `engine_options`),
      in `exo.inference.inference_engine` and in `exo.orchestration.node`, which imported it by name; the
      node reports "gguf" as its engine, so its engine re-selection on topology changes keeps this engine;
    - each available GGUF model gets a model card (`exo.models.model_cards`, layer count from the file), so
      `build_base_shard` and the API's model list accept it;
    - `resolve_tokenizer` returns the engine's tokenizer for those models (the API renders chat prompts with it).
    Call it before `exo.main` is imported: that module reads these names when it is imported.
    """
    import exo.inference.inference_engine as exo_engines
    import exo.inference.tokenizers as exo_tokenizers
    import exo.models as exo_models

    models_dirs = tuple(models_dirs)
    original_engine = exo_engines.get_inference_engine

    def get_inference_engine(name: str, shard_downloader: Any):
        if name == ENGINE_NAME:
            return GGUFInferenceEngine(shard_downloader, models_dir=models_dirs, **engine_options)
        return original_engine(name, shard_downloader)

    exo_engines.get_inference_engine = get_inference_engine
    exo_engines.inference_engine_classes[ENGINE_NAME] = GGUFInferenceEngine.__name__

    original_tokenizer = exo_tokenizers.resolve_tokenizer

    async def resolve_tokenizer(repo_id):
        try:
            path = resolve_model(str(repo_id), models_dirs)
        except FileNotFoundError:
            return await original_tokenizer(repo_id)
        from .tokenizer import load_tokenizer

        return HFStyleTokenizer(load_tokenizer(path))

    exo_tokenizers.resolve_tokenizer = resolve_tokenizer

    added = []
    for model_id, path in available_models(models_dirs).items():
        card = exo_models.model_cards.setdefault(model_id, {"layers": _n_layers(path), "repo": {}})
        card["repo"][GGUFInferenceEngine.__name__] = model_id
        exo_models.pretty_name.setdefault(model_id, f"{model_id} (GGUF)")
        added.append(model_id)

    from exo.orchestration import node as exo_node

    exo_node.get_inference_engine = get_inference_engine
    original_supported = exo_node.Node.get_supported_inference_engines

    def get_supported_inference_engines(node) -> list[str]:
        if isinstance(node.inference_engine, GGUFInferenceEngine):
            return [ENGINE_NAME]
        return original_supported(node)

    exo_node.Node.get_supported_inference_engines = get_supported_inference_engines
    for module in ("exo.api.chatgpt_api", "exo.main"):  # modules that imported resolve_tokenizer by name
        if module in sys.modules:
            sys.modules[module].resolve_tokenizer = resolve_tokenizer
    return added


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m ggufpy.exo [--models-dir DIR]... [--backend B] [--numerics N] [exo's own options]`.

    Starts an exo node (legacy exo, installed in this environment) that serves GGUF models with this engine.
    exo's downloads folder ($EXO_HOME/downloads, default ~/.cache/exo/downloads) is searched after the
    given folders.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ggufpy.exo", description=main.__doc__)
    parser.add_argument("--models-dir", action="append", default=[], help="folder of GGUF models (repeatable)")
    parser.add_argument("--backend", default=None, help="numpy or numba (default: numba when installed)")
    parser.add_argument("--numerics", default="exact", help="exact or llamacpp")
    parser.add_argument("--max-requests", type=int, default=DEFAULT_MAX_REQUESTS, help="KV caches kept (LRU)")
    ours, exo_args = parser.parse_known_args(argv)
    if not EXO_AVAILABLE:
        raise SystemExit("exo is not importable: install the legacy exo tree (before exo commit 0fcee7083)")
    exo_home = Path(os.environ.get("EXO_HOME", Path.home() / ".cache" / "exo"))
    models = [*ours.models_dir, exo_home / "downloads"]
    install_into_exo(models, backend=ours.backend, numerics=ours.numerics, max_requests=ours.max_requests)
    if "--inference-engine" not in exo_args:
        exo_args += ["--inference-engine", ENGINE_NAME]
    sys.argv = ["exo", *exo_args]
    import exo.main  # parses sys.argv and builds the node when imported

    exo.main.run()


if __name__ == "__main__":
    main()
