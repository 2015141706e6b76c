"""The shard engine: one contiguous range of a model's layers, serving many requests at once.

A shard is a GGUF file plus an inclusive layer range `start_layer..end_layer` (exo's convention). Loading it
maps only its own layers' tensors (plus the embeddings on the first shard and the head on the last), so its
resident memory grows with its share of the layers. Chained shards compute exactly what the whole model does,
bit for bit: the residual stream crosses each boundary as float32, unchanged.

Data contract at the boundaries (batch of one; T = new positions, D = dim, V = vocab_size):

    shard position   takes                              returns
    first            token ids (1, T), any integer      hidden (1, T, D) float32
    middle           hidden (1, T, D) float32           hidden (1, T, D) float32
    last             hidden (1, T, D) float32           logits (1, T, V) float32, every position
    whole model      token ids (1, T)                   logits (1, T, V) float32

Each request id has its own KV cache, kept in an LRU of `max_requests` entries. A request's position is
implicit: it is the number of positions its cache holds, so a prompt (T tokens) and each decode step (T = 1)
are the same call. A caller that knows where its input starts passes `position=`: a request this shard does
not hold (evicted, released, or never started) is then refused when the position is not 0, however long ago
it was evicted, and a held one when the position is not its length. Nothing here is specific to exo:
`ggufpy.exo` and `ggufpy.hf` adapt this core.

    first = ShardEngine.load("model.gguf", 0, 14)
    last = ShardEngine.load("model.gguf", 15, 29)
    logits = last.forward("req-1", first.forward("req-1", np.array([[1, 2, 3]])))   # (1, 3, V)
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from .checks import check_request_id, check_token_ids, is_int
from .config import ModelConfig
from .kvcache import ContextLengthError, KVCache
from .transformer import Model

__all__ = [
    "DEFAULT_MAX_REQUESTS",
    "EvictedRequestError",
    "RequestCaches",
    "RequestPositionError",
    "Shard",
    "ShardEngine",
    "cache_with_room",
    "read_config",
]

DEFAULT_MAX_REQUESTS = 4  # concurrent sequences whose KV caches stay resident (exo's own engines keep 2)
INITIAL_CACHE_POSITIONS = 256  # a request's cache starts this long and doubles when it fills up
_EVICTED_MEMORY = 1024  # how many evicted request ids are remembered, to refuse their continuation


@dataclass(frozen=True)
class Shard:
    """A model and an inclusive range of its layers, with exo's field names (`exo/inference/shard.py`).

    `model_id` names the model (a path, or a name an adapter resolves); `n_layers` is the whole model's count.
    """

    model_id: str
    start_layer: int
    end_layer: int  # inclusive
    n_layers: int

    def __post_init__(self):
        if not 0 <= self.start_layer <= self.end_layer < self.n_layers:
            raise ValueError(
                f"shard layers {self.start_layer}..{self.end_layer} (inclusive) are not a non-empty range "
                f"within 0..{self.n_layers - 1} of model {self.model_id!r}"
            )

    @classmethod
    def of(cls, shard: Any) -> Shard:
        """Any object with `model_id`, `start_layer`, `end_layer` and `n_layers` (exo's `Shard`, a namedtuple...)."""
        if isinstance(shard, Shard):
            return shard
        try:
            fields = shard.model_id, shard.start_layer, shard.end_layer, shard.n_layers
        except AttributeError as e:
            raise TypeError(
                f"a shard needs model_id, start_layer, end_layer and n_layers; {type(shard).__name__} has no {e.name}"
            ) from None
        model_id, *layers = fields
        for name, value in zip(("start_layer", "end_layer", "n_layers"), layers, strict=True):
            if not is_int(value):  # int() would truncate 1.7 or parse "3" silently
                raise TypeError(f"shard {name} must be an integer, got {value!r} ({type(value).__name__})")
        return cls(str(model_id), *(int(v) for v in layers))

    @property
    def layers(self) -> range:
        """The layers as the half-open range `ggufpy.load` and `Model.forward` take."""
        return range(self.start_layer, self.end_layer + 1)

    def is_first_layer(self) -> bool:
        return self.start_layer == 0

    def is_last_layer(self) -> bool:
        return self.end_layer == self.n_layers - 1

    def get_layer_count(self) -> int:
        return self.end_layer - self.start_layer + 1


class EvictedRequestError(KeyError):
    """A request continued after the LRU had dropped its KV cache: its earlier positions are gone."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


class RequestPositionError(ValueError):
    """The caller's position for a request is not the number of positions this shard holds for it."""


class RequestCaches:
    """KV caches by request id, least recently used first; at most `max_requests` are kept.

    Evicted ids are remembered (the last 1024), so that a continuation of an evicted request raises
    `EvictedRequestError` instead of silently restarting at position 0 even when the caller gives no
    position; a caller that gives one is checked exactly, whenever the eviction happened (`ShardEngine.forward`).
    """

    def __init__(self, max_requests: int = DEFAULT_MAX_REQUESTS):
        if not is_int(max_requests) or max_requests < 1:
            raise ValueError(f"max_requests must be an integer of at least 1, got {max_requests!r}")
        self.max_requests = max_requests
        self._caches: OrderedDict[str, KVCache] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def get(self, request_id: str) -> KVCache | None:
        """The request's cache (now the most recently used), or None for a new request."""
        if request_id in self._evicted:
            raise self.evicted(request_id, "was evicted from this shard's KV caches")
        cache = self._caches.get(request_id)
        if cache is not None:
            self._caches.move_to_end(request_id)
        return cache

    def put(self, request_id: str, cache: KVCache) -> None:
        """Store (or replace) the request's cache, evicting the least recently used beyond `max_requests`."""
        self._evicted.pop(request_id, None)
        self._caches[request_id] = cache
        self._caches.move_to_end(request_id)
        while len(self._caches) > self.max_requests:
            old, _ = self._caches.popitem(last=False)
            self.forget(old)

    def forget(self, request_id: str) -> None:
        """Drop the request's cache but remember the id, so that its continuation is refused."""
        self._caches.pop(request_id, None)
        self._evicted[request_id] = None
        self._evicted.move_to_end(request_id)
        if len(self._evicted) > _EVICTED_MEMORY:
            self._evicted.popitem(last=False)

    def release(self, request_id: str) -> None:
        """Forget a finished request (its id may then start a new sequence)."""
        self._caches.pop(request_id, None)
        self._evicted.pop(request_id, None)

    def clear(self) -> None:
        self._caches.clear()
        self._evicted.clear()

    def evicted(self, request_id: str, what: str) -> EvictedRequestError:
        return EvictedRequestError(
            f"request {request_id!r} {what} (max_requests={self.max_requests}): its earlier positions are "
            "gone; restart it with a new prompt, or raise max_requests"
        )

    def length(self, request_id: str) -> int:
        """Positions held for `request_id` (0 when it has no cache), without touching the LRU order."""
        cache = self._caches.get(request_id)
        return 0 if cache is None else cache.length

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._caches

    def __len__(self) -> int:
        return len(self._caches)

    def ids(self) -> list[str]:
        """Request ids, least recently used first."""
        return list(self._caches)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._caches.values())


class ShardEngine:
    """A loaded shard (`Model` restricted to some layers) and the KV caches of its requests.

    Not thread-safe: call it from one thread (the exo adapter runs it in a one-thread executor).
    """

    def __init__(self, model: Model, max_requests: int = DEFAULT_MAX_REQUESTS):
        self.model = model
        self.caches = RequestCaches(max_requests)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None,
        start_layer: int = 0,
        end_layer: int | None = None,
        *,
        backend: str = "numpy",
        numerics: str = "exact",
        max_requests: int = DEFAULT_MAX_REQUESTS,
        tokenizer: bool = True,
        **backend_options,
    ) -> ShardEngine:
        """Load layers `start_layer..end_layer` (inclusive; None = the last layer) of the GGUF file at `path`.

        `path` is anything `ggufpy.load` takes (a file, a packaged model name, None for the default model).
        """
        from .loading import load

        if end_layer is None:
            end_layer = read_config(path).n_layers - 1
        _check_layer_range(start_layer, end_layer)
        model = load(
            path,
            backend=backend,
            layers=range(start_layer, end_layer + 1),
            tokenizer=tokenizer,
            numerics=numerics,
            **backend_options,
        )
        return cls(model, max_requests=max_requests)

    @classmethod
    def view(
        cls, model: Model, start_layer: int, end_layer: int, max_requests: int = DEFAULT_MAX_REQUESTS
    ) -> ShardEngine:
        """Layers `start_layer..end_layer` (inclusive) of an already loaded model, sharing its weights and
        backend (and so the backend's dequantized-weight cache): several shards served by one process."""
        _check_layer_range(start_layer, end_layer)
        layers = range(start_layer, end_layer + 1)
        if not (model.layers.start <= layers.start < layers.stop <= model.layers.stop):
            raise ValueError(f"layers {start_layer}..{end_layer} are not within the model's {model.layers}")
        part = Model(
            model.config,
            model.weights,
            model.backend,
            tokenizer=model.tokenizer,
            layers=layers,
            file=model.file,
            numerics=model.numerics,
        )
        return cls(part, max_requests=max_requests)

    # -- where this shard sits ----------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def layers(self) -> range:
        return self.model.layers

    @property
    def start_layer(self) -> int:
        return self.layers.start

    @property
    def end_layer(self) -> int:
        """The last layer of the shard (inclusive)."""
        return self.layers.stop - 1

    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    @property
    def is_first(self) -> bool:
        return self.layers.start == 0

    @property
    def is_last(self) -> bool:
        return self.layers.stop == self.config.n_layers

    # -- requests -----------------------------------------------------------------------------------------
    def forward(
        self, request_id: str, x: np.ndarray, new_sequence: bool = False, position: int | None = None
    ) -> np.ndarray:
        """Run this shard's layers on the next T positions of `request_id` (see the module's data contract).

        The positions follow those already in the request's cache; `new_sequence` drops them first (a new
        prompt under a reused id). `position`, when given, is where the caller expects x to start: 0 for a
        new request; a request this shard does not hold with a position above 0 raises `EvictedRequestError`
        (its cache was evicted or released, however long ago), a held one whose length differs raises
        `RequestPositionError`. A failed call leaves the request's cache as it was.
        """
        check_request_id(request_id)
        x = self.check_input(x)
        T = x.shape[0]
        if position is not None:
            if not is_int(position) or position < 0:
                raise ValueError(f"position must be an integer >= 0, got {position!r}")
            if new_sequence and position != 0:
                raise ValueError(f"a new sequence starts at position 0, not {position}")
        if new_sequence:
            self.caches.release(request_id)
        if position is not None:
            self._check_position(request_id, position)
        cache = self._cache_with_room(request_id, T)
        pos = cache.length
        out = self.model.forward(x, pos, cache)  # (T, D) hidden or (T, V) logits
        self.caches.put(request_id, cache)
        return np.asarray(out, dtype=np.float32)[None]  # (1, T, D) or (1, T, V)

    def position(self, request_id: str) -> int:
        """How many positions of `request_id` this shard holds (0 for an unknown request)."""
        return self.caches.length(request_id)

    def room(self, request_id: str) -> int:
        """How many more positions `request_id` may take before the model's context length."""
        return self.config.context_length - self.position(request_id)

    def _check_position(self, request_id: str, position: int) -> None:
        if request_id not in self.caches:
            if position > 0:
                raise self.caches.evicted(
                    request_id, f"continues at position {position} but this shard holds no positions for it"
                )
            self.caches.release(request_id)  # position 0 says a new request: an old eviction does not matter
            return
        held = self.caches.length(request_id)
        if position != held:
            raise RequestPositionError(
                f"request {request_id!r}: the input starts at position {position} but this shard holds {held} "
                "positions for it (a lost or repeated step, or two callers sharing the id)"
            )

    def release(self, request_id: str) -> None:
        """Drop a finished request's KV cache."""
        self.caches.release(request_id)

    def clear(self) -> None:
        """Drop every request's KV cache."""
        self.caches.clear()

    def check_input(self, x: np.ndarray) -> np.ndarray:
        """x without its batch dimension: ids (T,) on the first shard, hidden states (T, D) float32 elsewhere."""
        x = np.asarray(x)
        where = f"shard layers {self.start_layer}..{self.end_layer} of {self.n_layers}"
        if self.is_first:
            if x.ndim != 2 or x.shape[0] != 1 or x.shape[1] == 0 or not np.issubdtype(x.dtype, np.integer):
                raise ValueError(
                    f"{where} starts at layer 0: it takes token ids of shape (1, T) with an integer dtype, "
                    f"got {x.dtype} {x.shape}"
                )
            check_token_ids(x, self.config.vocab_size)
            return x[0]  # (T,)
        D = self.config.dim
        # exactly float32: a float16/bfloat16 sender has already lost what the whole model would keep
        if x.ndim != 3 or x.shape[0] != 1 or x.shape[1] == 0 or x.shape[2] != D or x.dtype != np.float32:
            raise ValueError(f"{where} takes hidden states of shape (1, T, {D}) float32, got {x.dtype} {x.shape}")
        if not np.isfinite(x).all():
            bad = np.argwhere(~np.isfinite(x))[0].tolist()
            raise ValueError(f"{where}: the hidden states are not finite (at index {bad}: {x[tuple(bad)]})")
        return x[0]  # (T, D)

    def _cache_with_room(self, request_id: str, n_new: int) -> KVCache:
        """The request's cache (a new one for a new request), with room for `n_new` more positions."""
        return cache_with_room(self.model, self.caches.get(request_id), n_new, f"request {request_id!r}")

    def __repr__(self) -> str:
        return (
            f"ShardEngine(layers {self.start_layer}..{self.end_layer} of {self.n_layers}, "
            f"requests={len(self.caches)}/{self.caches.max_requests}, backend={self.model.backend.name}, "
            f"numerics={self.model.numerics.name})"
        )


def _check_layer_range(start_layer: Any, end_layer: Any) -> None:
    for name, value in (("start_layer", start_layer), ("end_layer", end_layer)):
        if not is_int(value):
            raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if end_layer < start_layer:
        raise ValueError(f"end_layer {end_layer} is before start_layer {start_layer} (the range is inclusive)")


def read_config(path: str | os.PathLike | None) -> ModelConfig:
    """The `ModelConfig` of a GGUF file, checked as `ggufpy.load` checks it (the same errors), without
    mapping any weights."""
    from .loading import file_config, resolve_model_path
    from .reader import open as open_gguf

    with open_gguf(resolve_model_path(path)) as f:
        return file_config(f)


def cache_with_room(model: Model, cache: KVCache | None, n_new: int, what: str = "the sequence") -> KVCache:
    """`cache` (a new one when None), grown if it cannot take `n_new` more positions.

    Caches start at INITIAL_CACHE_POSITIONS and double, up to the model's context length; growing copies
    the filled positions into a new cache, so the values (and the results) are those of a preallocated one.
    """
    length = 0 if cache is None else cache.length
    need = length + n_new
    context = model.config.context_length
    if need > context:
        raise ContextLengthError(
            f"{what}: {length} positions held plus {n_new} new exceed the model's context length {context}"
        )
    if cache is not None and need <= cache.capacity:
        return cache
    capacity = min(context, max(need, INITIAL_CACHE_POSITIONS, 2 * (cache.capacity if cache else 0)))
    # a KV cache or a hybrid model's state (`state.HybridState`): each knows how to copy itself
    return model.new_cache(capacity=capacity) if cache is None else cache.resized(capacity)
