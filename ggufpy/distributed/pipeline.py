"""`RayPipeline`: a GGUF model split into layer ranges, one Ray actor per stage, used like a `Model`.

    pipe = RayPipeline("smollm2", address="ray://head:10001", stages=2)    # or ranges="0-14,15-29"
    print(pipe.generate("The capital of France is", max_tokens=16).text)   # pipelined, last stage samples
    logits = pipe.forward(ids, 0, pipe.new_cache())                        # the Model interface
    pipe.shutdown()

Every stage is an actor on its own node (placed by `plan.plan_stages`), mapping its own copy of the file: the
same path must hold the same file on every node. Hidden states go from stage to stage as Ray objects (the
driver passes each stage's result reference to the next; it never copies them itself).

Faults: a stage whose actor or node dies fails every request that had state on it (its KV caches are gone)
with `StageFailedError`, never a hang (every wait has a timeout) nor silent wrong text (a restarted stage
refuses positions it does not hold). Ray restarts the actor (`max_restarts`), on another node if its node is
gone, and `__init__` maps the file again; later requests run on the restored stage.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
import weakref

import numpy as np

from ..kvcache import ContextLengthError
from .plan import MB, NUMPY_CACHE_BYTES, Node, PlanError, StagePlan, parse_ranges, plan_stages
from .stage import Stage

DEFAULT_CONTEXT = 4096  # positions per sequence unless asked (as Model.new_cache)
STEP_TIMEOUT = 300.0  # seconds one pipeline step may take before its requests fail (a busy 2-core CI machine)
RETRY_WAIT = 0.5  # seconds between asks of a stage that Ray is restarting
LOAD_TIMEOUT = 900.0  # seconds for every stage to map its file and, with numba, compile its kernels


class StageFailedError(RuntimeError):
    """A stage's actor or node died (or did not answer in time): the requests with state on it are lost."""


def cluster_nodes(ray) -> list[Node]:
    """The alive nodes and the memory each offers Ray (its `memory` resource), for placement."""
    return [
        Node(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get("memory", 0)))
        for n in ray.nodes()
        if n.get("Alive")
    ]


class RemoteCache:
    """The driver's handle on one sequence's KV caches, which live in the stages (one per stage).

    Has what callers of `Model.forward` use of a `KVCache`: `length`, `capacity`, `advance`, `truncate`.
    Shrinking it forgets positions on the stages at the next step; dropping it releases them.
    """

    def __init__(self, pipeline: RayPipeline, capacity: int):
        self.id = f"c{next(_ids)}-{uuid.uuid4().hex[:8]}"
        self.capacity = capacity
        self.length = 0
        self._finalizer = weakref.finalize(self, pipeline.release_remote, [self.id])

    def advance(self, end: int) -> None:
        self.length = end

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def release(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        return f"RemoteCache({self.id}, length={self.length}, capacity={self.capacity})"


_ids = itertools.count()


class RayPipeline:
    """Stages of a GGUF model on a Ray cluster; see the module docstring.

    `model`: a file path or packaged name (the same file on every node). `address`: Ray's (`ray://host:10001`,
    `host:6379`, "auto"); None uses the running Ray connection or starts a local one. `stages` / `ranges`
    ("0-14,15-29", inclusive): the split, default one stage per node, layers in proportion to node memory.
    `ctx_size` positions per sequence, `max_sequences` held at once (both enter the memory estimate).
    `hidden_dtype="float16"` halves the bytes per hop but is not bit-identical to the whole model.
    """

    def __init__(
        self,
        model=None,
        *,
        address: str | None = None,
        stages: int | None = None,
        ranges: str | list[range] | None = None,
        backend: str = "numpy",
        numerics: str = "exact",
        ctx_size: int | None = None,
        max_sequences: int = 8,
        hidden_dtype: str = "float32",
        num_cpus: float = 1,
        max_restarts: int = 3,
        step_timeout: float = STEP_TIMEOUT,
        load_timeout: float = LOAD_TIMEOUT,
        warmup: bool = True,
        one_blas_thread: bool = False,
        backend_options: dict | None = None,
    ):
        import ray

        if hidden_dtype not in ("float32", "float16"):
            raise ValueError(f"hidden_dtype must be 'float32' or 'float16', got {hidden_dtype!r}")
        self._ray = ray
        self._generator, self.stages = None, []
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # the stages' logs stay on their nodes: stdout is the generated text (`ggufpy run`), errors come back
            # as exceptions
            ray.init(address=address, logging_level="warning", log_to_driver=False)
        try:
            self._setup(
                model, stages, ranges, backend, numerics, ctx_size, max_sequences, hidden_dtype, backend_options
            )
            start = (backend, numerics, num_cpus, max_restarts, one_blas_thread, dict(backend_options or {}))
            self.step_timeout, self.load_timeout, self._warmup = step_timeout, load_timeout, warmup
            self.stages = [self._start(s, *start) for s in self.plan]
            self.stage_info = self._wait_ready(self.load_timeout)
        except BaseException:  # a refused plan or a stage that did not start: nothing stays behind
            self.shutdown()
            raise

    def _setup(self, model, stages, ranges, backend, numerics, ctx_size, max_sequences, hidden_dtype, options):
        """Read the file's header and tokenizer, and plan the stages on the cluster's nodes."""
        from ..loading import file_config, resolve_model_path
        from ..numerics import numerics_mode
        from ..reader import open as open_gguf
        from ..tokenizer import load_tokenizer

        self.path = str(resolve_model_path(model).resolve())
        with open_gguf(self.path) as f:
            self.config = file_config(f)
            tensors = dict(f.tensors)
        self.tokenizer = load_tokenizer(self.path)
        self.numerics = numerics_mode(numerics)
        self.layers = range(self.config.n_layers)
        self.file = None  # the file is mapped by the stages, not here (`Model.file`)
        self.ctx_size = min(ctx_size or DEFAULT_CONTEXT, self.config.context_length)
        self.max_sequences = max_sequences
        self.hidden_dtype = hidden_dtype
        if isinstance(ranges, str):
            ranges = parse_ranges(ranges, self.config.n_layers)
        self.plan: list[StagePlan] = plan_stages(
            tensors,
            self.config,
            cluster_nodes(self._ray),
            stages=stages,
            ranges=ranges,
            context=self.ctx_size,
            sequences=max_sequences,
            backend=backend,
            kv_itemsize=self.numerics.kv_dtype.itemsize,
            cache_bytes=(options or {}).get("cache_bytes", NUMPY_CACHE_BYTES),
        )
        self.backend_name = backend
        self.restored = 0  # stages found restarted after a failure
        self._lock = threading.Lock()
        self._restoring = threading.Lock()

    def _start(self, s: StagePlan, backend, numerics, num_cpus, max_restarts, one_blas_thread, options):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = self._ray.remote(Stage).options(
            name=f"ggufpy-stage{s.index}-{uuid.uuid4().hex[:8]}",
            num_cpus=num_cpus,
            memory=s.estimate.total,  # Ray's memory accounting: a restart goes only where the stage fits
            max_restarts=max_restarts,
            max_task_retries=0,  # a step retried on a restarted stage would lack its KV cache: fail it instead
            # soft: if the node dies, Ray may restart the stage on another node that has the memory
            scheduling_strategy=NodeAffinitySchedulingStrategy(s.node.node_id, soft=True),
        )
        return actor.remote(
            self.path,
            s.layers.start,
            s.layers.stop,
            backend=backend,
            numerics=numerics,
            hidden_dtype=self.hidden_dtype,
            one_blas_thread=one_blas_thread,
            backend_options=options,
        )

    def _wait_ready(self, timeout: float) -> list[dict]:
        """Each stage's `info()` once it has loaded (and warmed up); raises `StageFailedError` past `timeout`."""
        ray = self._ray
        deadline = time.monotonic() + timeout
        try:
            if self._warmup:
                self._ask_all("warmup", deadline)
            return self._ask_all("info", deadline)
        except ray.exceptions.GetTimeoutError:
            raise StageFailedError(
                f"the stages were not ready within {timeout:.0f} s (still loading, or an actor waits for a node "
                "with its num_cpus and memory free: `ray status` shows pending demands): "
                + "; ".join(s.describe() for s in self.plan)
            ) from None
        except ray.exceptions.RayError as e:
            raise StageFailedError(f"a stage failed to start: {_first_line(e)}") from None

    def _ask_all(self, method: str, deadline: float) -> list:
        """`method()` of every stage; a stage Ray is restarting is asked again until `deadline` (monotonic)."""
        ray = self._ray
        while True:
            try:
                refs = [getattr(st, method).remote() for st in self.stages]
                return ray.get(refs, timeout=max(deadline - time.monotonic(), 0.1))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise ray.exceptions.GetTimeoutError("a stage was still restarting at the deadline") from None
                time.sleep(RETRY_WAIT)

    # -- the Model interface (tokens in, logits out; `generation.generate` and the server's scheduler) --------
    def new_cache(self, capacity: int | None = None) -> RemoteCache:
        capacity = capacity or self.ctx_size
        if capacity > self.config.context_length:
            context = self.config.context_length
            raise ContextLengthError(f"capacity {capacity} exceeds the model's context length {context}")
        return RemoteCache(self, capacity)

    def forward(self, x, pos: int, cache: RemoteCache, layers=None, last_only: bool = False) -> np.ndarray:
        """Token ids (T,) at positions pos..pos+T-1 of `cache`'s sequence, through every stage: logits (T, V),
        or (1, V) when `last_only`. Bit for bit `Model.forward` of the whole model."""
        if layers is not None and layers != self.layers:
            raise ValueError(f"a RayPipeline runs all its layers {self.layers}, not {layers}")
        ids = np.asarray(x, dtype=np.int64)
        if not 0 <= pos <= cache.length:
            raise ValueError(f"position {pos} is not in 0..{cache.length}: the cache holds {cache.length} positions")
        if pos + len(ids) > cache.capacity:
            raise ContextLengthError(f"{pos + len(ids)} positions do not fit in a cache of {cache.capacity}")
        ref = self.chain_prefill(cache.id, ids, pos, cache.capacity, last_only)
        out = self.get(ref[-1], [cache.id])
        cache.advance(pos + len(ids))
        return out

    def decode_batch(self, tokens, positions, caches: list[RemoteCache]) -> np.ndarray:
        """One token for each of B sequences, batched in every stage: logits (B, V), row b bit for bit the
        sequence decoded alone (`Model.decode_batch`)."""
        ids = np.asarray(tokens, dtype=np.int64)
        positions = [int(p) for p in positions]
        for pos, cache in zip(positions, caches, strict=True):
            if pos + 1 > cache.capacity:
                raise ContextLengthError(f"position {pos} does not fit in a cache of {cache.capacity}")
        rids = [c.id for c in caches]
        out = self.get(self.chain_decode(rids, ids, positions)[-1], rids)
        for pos, cache in zip(positions, caches, strict=True):
            cache.advance(pos + 1)
        return out

    def logits(self, tokens) -> np.ndarray:
        """Logits (T, V) at every position of a fresh sequence of token ids."""
        tokens = np.asarray(tokens, dtype=np.int64)
        cache = self.new_cache(capacity=max(len(tokens), 1))
        try:
            return self.forward(tokens, 0, cache)
        finally:
            cache.release()

    # -- pipelined generation (the last stage samples) ------------------------------------------------------
    def submit(self, prompt, *, max_tokens: int = 256, sampling=None, stop=()):
        """Start a generation now and return its `RayGeneration` (an iterator of `GenerationChunk`, `.result`
        once exhausted). Requests submitted together run as micro-batches through the stages at once."""
        from .microbatch import MicroBatcher

        with self._lock:
            if self._generator is None:
                self._generator = MicroBatcher(self)
        return self._generator.submit(prompt, max_tokens=max_tokens, sampling=sampling, stop=stop)

    def stream(self, prompt, *, max_tokens: int = 256, sampling=None, stop=()):
        """`submit`, for `for chunk in pipe.stream(...)`."""
        return self.submit(prompt, max_tokens=max_tokens, sampling=sampling, stop=stop)

    def generate(self, prompt, *, max_tokens: int = 256, sampling=None, stop=()):
        """The finished `GenerationResult` of `prompt` (text or token ids)."""
        gen = self.submit(prompt, max_tokens=max_tokens, sampling=sampling, stop=stop)
        for _ in gen:
            pass
        return gen.result

    # -- steps through the stages ---------------------------------------------------------------------------
    def chain_prefill(self, rid: str, ids: np.ndarray, pos: int, capacity: int, last_only: bool, **sample) -> list:
        """Submit one prefill through every stage; the result references, stage by stage."""
        refs, x = [], ids
        for j, st in enumerate(self.stages):
            extra = sample if j == len(self.stages) - 1 else {}
            x = st.prefill.remote(rid, x, pos, capacity, last_only, **extra)
            refs.append(x)
        return refs

    def chain_decode(self, rids: list[str], ids: np.ndarray, positions: list[int]) -> list:
        refs, x = [], ids
        for st in self.stages:
            x = st.decode.remote(rids, x, positions)
            refs.append(x)
        return refs

    def get(self, ref, rids: list[str]):
        """`ray.get` with the step timeout; a stage failure becomes `StageFailedError` (the stage is then
        waited for, restarted by Ray), an error raised inside a stage is re-raised as itself."""
        ray = self._ray
        try:
            return ray.get(ref, timeout=self.step_timeout)
        except ray.exceptions.RayTaskError as e:  # raised by the stage's own code: the request's fault
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, Exception) else e) from None
        except ray.exceptions.GetTimeoutError:
            raise StageFailedError(
                f"requests {rids}: the pipeline did not answer within {self.step_timeout:.0f} s"
            ) from None
        except ray.exceptions.RayError as e:
            message = self.failure(e, rids)
            self.restore()
            raise StageFailedError(message) from None

    def failure(self, error: Exception, rids: list[str]) -> str:
        """What to tell the requests `rids` that a stage failure killed."""
        return (
            f"{_first_line(error).rstrip('.')}. Requests {rids} lost their KV caches on it and were stopped; Ray "
            "restarts the stage (the file mapped anew): start them again"
        )

    def restore(self) -> int:
        """Wait for every stage to answer again (Ray restarts dead ones, mapping the file anew); returns how
        many restarted. Raises `StageFailedError` if one is not back within the load timeout."""
        with self._restoring:  # the driver thread and a Model-interface caller may both see the failure
            before = [i["pid"] for i in self.stage_info]
            self.stage_info = self._wait_ready(self.load_timeout)
            n = sum(i["pid"] != pid for i, pid in zip(self.stage_info, before, strict=True))
            self.restored += n
            return n

    def release_remote(self, rids: list[str]) -> None:
        """Drop requests' state on every stage (fire and forget: ordered after their steps on each actor)."""
        try:
            if self._ray.is_initialized():
                for st in self.stages:
                    st.release.remote(rids)
        except Exception:  # at interpreter exit, or after shutdown: nothing left to release
            pass

    def info(self) -> list[dict]:
        """Each stage's pid, layers, memory (MB) and requests held, with its plan."""
        infos = self._ask_all("info", time.monotonic() + self.load_timeout)
        return [
            {**i, "node": s.node.address, "estimate_mb": s.estimate.total / MB}
            for s, i in zip(self.plan, infos, strict=True)
        ]

    def shutdown(self) -> None:
        """Fail what is still running, and end every stage actor."""
        gen, self._generator = self._generator, None
        if gen is not None:
            gen.stop()
        for st in getattr(self, "stages", []):
            try:
                self._ray.kill(st, no_restart=True)
            except Exception:  # already gone
                pass
        self.stages = []
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()

    def __enter__(self) -> RayPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"RayPipeline({os.path.basename(self.path)}, " + "; ".join(s.describe() for s in self.plan) + ")"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["PlanError", "RayPipeline", "RemoteCache", "StageFailedError", "cluster_nodes"]
