"""A pipeline stage: one layer range of a model, its own mapped file, the KV caches of its requests.

`Stage` is a plain class (testable without Ray); `ggufpy.distributed.pipeline` runs each one as a Ray actor on
its node. Ray restarts a dead actor by calling `__init__` again, which maps the file anew; a restarted stage
holds no caches, so a request that continues on it is refused by position (`StageStateError`) instead of
being computed on an empty cache.

Data between stages (B sequences, T new positions, D dim, V vocab):

    first stage   takes token ids (T,) (prefill) or (B,) (decode)
    others        take hidden states (T, D) or (B, D), float32 (or float16 on the wire: `hidden_dtype`)
    not last      returns hidden states in `hidden_dtype`
    last          returns logits (T or 1, V) / (B, V) float32, or sampled token ids when the request's
                  sampler lives here (`prefill(..., sampler=)`): 4 bytes back per token instead of 4 V
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from ..kvcache import KVCache
from ..sampling import Sampler
from ..transformer import Model, linears_rows


class StageStateError(RuntimeError):
    """A step for a request this stage holds no (or other) positions for: the stage restarted, or the
    request was released."""


def decode_rows(model: Model, x: np.ndarray, positions: list[int], caches: list[KVCache]) -> np.ndarray:
    """One decode step of B sequences through `model`'s layer range: `Model.decode_batch` for any range.

    x: token ids (B,) when the range starts at layer 0, else hidden states (B, D). Returns hidden states (B, D),
    or logits (B, V) when it ends at the last layer. The same steps as `decode_batch` in the same order (its
    per-row angles, `block_rows`, the head's norm, `linears_rows`, the head per row), so row b is bit for bit
    the one-token `forward` of that sequence alone (tests/test_ray_stage.py checks it against the whole model).
    A `layers=` argument on `Model.decode_batch` would make this a call (docs/distributed.md).
    """
    if model.file is not None:  # as in `forward`: a changed mapped file raises instead of faulting
        model.file.check()
    for pos, cache in zip(positions, caches, strict=True):
        cache.check(pos, 1)
    h = model.embed(np.asarray(x)) if model.layers.start == 0 else np.asarray(x, dtype=np.float32)  # (B, D)
    angles = {}  # RoPE parameters -> (cos, sin), each (B, R/2): row b at positions[b]
    for i in model.layers:
        cos, sin = model._angles(angles, i, [np.arange(p, p + 1) for p in positions])
        h = model.block_rows(h, i, positions, cos, sin, caches)
    for pos, cache in zip(positions, caches, strict=True):
        cache.advance(pos + 1)
    if model.layers.stop < model.config.n_layers:
        return h
    h = model._pre_norm(h, model.weights.output_norm)
    (logits,) = linears_rows(model.backend, h, (model.weights.output,))  # (B, V)
    # the head row by row, as decode_batch: a vectorized tanh (softcap) may round a row differently
    return np.concatenate([model.head(row[None]) for row in logits])


class _Request:
    """What a stage keeps for one request: its KV cache and, on the last stage, its sampler and history."""

    def __init__(self, cache: KVCache, sampler: Sampler | None, history: list[int]):
        self.cache, self.sampler, self.history = cache, sampler, history


class Stage:
    """Layers `start..stop-1` of the GGUF file at `path`, loaded in this process (`ggufpy.load(layers=)`)."""

    def __init__(
        self,
        path: str,
        start: int,
        stop: int,
        *,
        backend: str = "numpy",
        numerics: str = "exact",
        hidden_dtype: str = "float32",
        one_blas_thread: bool = False,
        backend_options: dict | None = None,
    ):
        from ..loading import load

        t0 = time.perf_counter()
        self.model = load(
            path,
            backend=backend,
            layers=range(start, stop),
            tokenizer=start == 0,
            numerics=numerics,
            **(backend_options or {}),
        )
        self.load_seconds = time.perf_counter() - t0
        self.hidden_dtype = np.dtype(hidden_dtype)
        self.one_blas_thread = one_blas_thread
        self.requests: dict[str, _Request] = {}
        self.started = time.time()
        self.busy_seconds, self.steps = 0.0, 0  # time spent computing steps, and how many

    @property
    def is_first(self) -> bool:
        return self.model.layers.start == 0

    @property
    def is_last(self) -> bool:
        return self.model.layers.stop == self.model.config.n_layers

    # -- steps ----------------------------------------------------------------------------------------
    def prefill(
        self,
        rid: str,
        x,
        pos: int,
        capacity: int,
        last_only: bool = True,
        sampler: Sampler | None = None,
        history=None,
    ):
        """The next T positions of request `rid` from `pos` (0 starts it afresh with a cache of `capacity`;
        a lower `pos` than held forgets the rest, as `KVCache.truncate`). See the module for what it returns."""
        with self._blas(), self._timed():
            if pos == 0:
                self.requests[rid] = _Request(self.model.new_cache(capacity=capacity), None, [])
            req = self._held(rid, pos)
            req.cache.truncate(pos)
            if sampler is not None:
                req.sampler, req.history = sampler, [int(t) for t in history]
            out = self.model.forward(self._input(x), pos, req.cache, last_only=last_only)
            return self._output(out, [req] if sampler is not None else None)

    def decode(self, rids: list[str], x, positions: list[int]):
        """One token for each of the B requests `rids`, batched (`decode_rows`)."""
        with self._blas(), self._timed():
            reqs = [self._held(rid, pos) for rid, pos in zip(rids, positions, strict=True)]
            for req, pos in zip(reqs, positions, strict=True):
                req.cache.truncate(pos)
            out = decode_rows(self.model, self._input(x), list(positions), [r.cache for r in reqs])
            sampling = self.is_last and all(r.sampler is not None for r in reqs)
            return self._output(out, reqs if sampling else None)

    def echo(self, x):
        """x unchanged: what one hop costs without any compute (scripts/bench_ray.py)."""
        return x

    def _held(self, rid: str, pos: int) -> _Request:
        req = self.requests.get(rid)
        where = f"stage layers {self.model.layers.start}..{self.model.layers.stop - 1} (pid {os.getpid()})"
        if req is None:
            raise StageStateError(
                f"request {rid!r} continues at position {pos} but {where} holds no positions for it "
                "(the stage restarted since the request started, or the request was released)"
            )
        if pos > req.cache.length:
            raise StageStateError(f"request {rid!r}: position {pos} is past the {req.cache.length} held by {where}")
        return req

    def _input(self, x) -> np.ndarray:
        x = np.asarray(x)
        return x if self.is_first else x.astype(np.float32)  # a float16 wire widens exactly back to float32

    def _output(self, out: np.ndarray, sampling: list[_Request] | None):
        if not self.is_last:
            return out.astype(self.hidden_dtype, copy=False)
        if sampling is None:
            return np.asarray(out, dtype=np.float32)
        tokens = []
        for req, row in zip(sampling, out[-len(sampling) :], strict=True):  # prefill: its last row
            token = req.sampler(row, req.history)
            req.history.append(token)
            tokens.append(token)
        return np.asarray(tokens, dtype=np.int64)

    @contextlib.contextmanager
    def _timed(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.busy_seconds += time.perf_counter() - t0
            self.steps += 1

    def _blas(self):
        from ..backend import one_blas_thread

        return one_blas_thread() if self.one_blas_thread else contextlib.nullcontext()

    # -- housekeeping ---------------------------------------------------------------------------------
    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.requests.pop(rid, None)

    def warmup(self) -> float:
        """Run a short prefill and a decode step on a scratch request (numba compiles its kernels on first use);
        returns the seconds."""
        t0 = time.perf_counter()
        cfg = self.model.config
        x = np.zeros(2, np.int64) if self.is_first else np.zeros((2, cfg.dim), np.float32)
        self.prefill("__warmup__", x, 0, 4, last_only=True)
        self.decode(["__warmup__"], x[:1], [2])
        self.release(["__warmup__"])
        return time.perf_counter() - t0

    def tokenizer(self):
        return self.model.tokenizer

    def info(self) -> dict:
        """Where this stage runs and what it holds: pid, layers, memory (MB), requests."""
        return {
            "pid": os.getpid(),
            "started": self.started,
            "layers": (self.model.layers.start, self.model.layers.stop),
            "load_seconds": self.load_seconds,
            "busy_seconds": self.busy_seconds,
            "steps": self.steps,
            "requests": len(self.requests),
            "kv_bytes": sum(r.cache.nbytes for r in self.requests.values()),
            **memory_status(),
        }


def memory_status() -> dict[str, int]:
    """This process's resident memory in MB from /proc (Linux): VmRSS, VmHWM, RssAnon, RssFile, and `gguf`, the
    resident pages of mapped .gguf files (empty off Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) // 1024
        gguf, mapping = 0, ""
        with open("/proc/self/smaps") as f:
            for line in f:
                parts = line.split()
                if parts and "-" in parts[0] and len(parts) >= 5:
                    mapping = parts[5] if len(parts) > 5 else ""
                elif parts and parts[0] == "Rss:" and mapping.endswith(".gguf"):
                    gguf += int(parts[1])
        out["gguf"] = gguf // 1024
    except OSError:
        pass
    return out
