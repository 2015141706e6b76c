"""Pipelined generation: many requests in flight through the stages at once, as micro-batches.

One driver thread keeps up to `len(stages)` micro-batches in flight, so that while stage 1 computes one batch,
stage 0 already computes the next (Ray runs each actor's calls in the order they were submitted, so one
micro-batch's steps never overtake another's on a stage). A micro-batch is either one request's prompt (its
prefill) or a decode step of up to ceil(active / stages) requests, batched on every stage (`stage.decode_rows`,
each row bit for bit the request decoded alone). The last stage samples with the request's own `Sampler`
(its seeded generator and the token history live there), so a step returns token ids, not logits.

Text, stop strings and finish reasons are `ggufpy.generation`'s (`IncrementalDecoder`, `split_at_stop`), so a
request's text and tokens equal `generation.generate` on the whole model in one process.
"""

from __future__ import annotations

import collections
import itertools
import math
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from ..generation import GenerationChunk, GenerationResult, IncrementalDecoder, split_at_stop
from ..sampling import Sampler, SamplingParams
from .pipeline import StageFailedError

POLL = 0.05  # seconds between checks of the step deadlines while waiting for results
_DONE = object()


class RayGeneration(Iterator[GenerationChunk]):
    """One request's chunks as they come; `.result` (a `GenerationResult`) once exhausted. A failure of the
    pipeline raises `StageFailedError` (or the stage's own error) from `next()`."""

    def __init__(self, request: _Request, wait: float):
        self._request, self._wait = request, wait
        self._result: GenerationResult | None = None

    @property
    def id(self) -> str:
        return self._request.id

    def __iter__(self) -> RayGeneration:
        return self

    def __next__(self) -> GenerationChunk:
        if self._result is not None:
            raise StopIteration
        try:
            item = self._request.events.get(timeout=self._wait)
        except queue.Empty:
            raise StageFailedError(f"request {self.id}: no answer from the pipeline in {self._wait:.0f} s") from None
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, GenerationResult):
            self._result = item
            raise StopIteration
        return item

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("generation has not finished: iterate the RayGeneration to the end first")
        return self._result


class _Request:
    """A request's driver-side state: prompt, position, text decoding; the KV caches live in the stages."""

    def __init__(self, rid: str, prompt: list[int], max_tokens: int, sampler: Sampler, stop, tokenizer, capacity):
        self.id, self.prompt, self.max_tokens, self.sampler, self.stop = rid, prompt, max_tokens, sampler, stop
        self.capacity = capacity
        self.events: queue.Queue = queue.Queue()
        self.decoder = IncrementalDecoder(tokenizer, prompt)
        self.pending, self.emitted, self.generated = "", [], []
        self.pos = 0  # where the next fed token goes
        self.next_token: int | None = None
        self.last_text_token = -1
        self.finished = False
        self.t0 = time.perf_counter()
        self.prefill_s = 0.0


class MicroBatcher:
    """The driver thread of a `RayPipeline`'s generations (started on the first `submit`)."""

    def __init__(self, pipeline):
        self.pipe = pipeline
        self.eog = frozenset(pipeline.tokenizer.eog_ids)
        self._new: collections.deque[_Request] = collections.deque()
        self._waiting: collections.deque[_Request] = collections.deque()  # not prefilled yet
        self._ready: collections.deque[_Request] = collections.deque()  # a token to feed
        self._inflight: dict = {}  # final ref -> (kind, requests, stage refs, deadline)
        self._active: set[_Request] = set()  # every request holding state on the stages
        self._wake = threading.Condition()
        self._running = True
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="ggufpy-ray-microbatch", daemon=True)
        self._thread.start()

    def submit(self, prompt, *, max_tokens: int, sampling, stop: Sequence[str]) -> RayGeneration:
        tok = self.pipe.tokenizer
        ids = tok.encode(prompt, add_special=True) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty: generation needs at least one prompt token (e.g. BOS)")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if len(ids) + 1 > self.pipe.ctx_size:
            raise ValueError(f"the prompt has {len(ids)} tokens; a sequence holds {self.pipe.ctx_size} (ctx_size)")
        sampler = sampling if isinstance(sampling, Sampler) else Sampler(sampling or SamplingParams())
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        req = _Request(f"g{next(self._ids)}-{id(self):x}", ids, max_tokens, sampler, stop, tok, self.pipe.ctx_size)
        if max_tokens == 0:  # as generation.generate: nothing to compute
            req.finished = True
            req.events.put(GenerationResult("", (), "length", len(ids), 0, 0.0, 0.0))
            return RayGeneration(req, wait=0.0)
        with self._wake:
            if not self._running:
                raise StageFailedError("the pipeline is shut down")
            self._new.append(req)
            self._wake.notify()
        return RayGeneration(req, wait=self.pipe.step_timeout * 2 + self.pipe.load_timeout)

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        self._thread.join(30)

    # -- the driver thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    if not self._running:
                        break
                    self._waiting.extend(self._new)
                    self._new.clear()
                    if not (self._waiting or self._ready or self._inflight):
                        self._wake.wait(POLL)
                        continue
                self._launch()
                self._collect()
        except BaseException as e:  # a bug here must not leave clients waiting forever
            self._fail(list(self._active | set(self._waiting) | set(self._new)), StageFailedError(f"driver: {e!r}"))
            raise
        self._fail(list(self._active | set(self._waiting) | set(self._new)), StageFailedError("the pipeline shut down"))

    def _launch(self) -> None:
        """Fill the pipeline: up to one micro-batch in flight per stage."""
        pipe, depth = self.pipe, len(self.pipe.stages)
        while len(self._inflight) < depth:
            if self._waiting and len(self._active) < pipe.max_sequences:
                req = self._waiting.popleft()
                self._active.add(req)
                ids = np.asarray(req.prompt, dtype=np.int64)
                sample = {"sampler": req.sampler, "history": req.prompt}
                refs = pipe.chain_prefill(req.id, ids, 0, req.capacity, True, **sample)
                self._inflight[refs[-1]] = ("prefill", [req], refs, time.monotonic() + pipe.step_timeout)
            elif self._ready:
                decoding = len(self._ready) + sum(len(v[1]) for v in self._inflight.values() if v[0] == "decode")
                batch = [self._ready.popleft() for _ in range(min(len(self._ready), math.ceil(decoding / depth)))]
                tokens = np.asarray([r.next_token for r in batch], dtype=np.int64)
                refs = pipe.chain_decode([r.id for r in batch], tokens, [r.pos for r in batch])
                self._inflight[refs[-1]] = ("decode", batch, refs, time.monotonic() + pipe.step_timeout)
            else:
                return

    def _collect(self) -> None:
        ray = self.pipe._ray
        done, _ = ray.wait(list(self._inflight), num_returns=1, timeout=POLL)
        for ref in done:
            kind, reqs, refs, _deadline = self._inflight.pop(ref)
            try:
                tokens = ray.get(ref, timeout=self.pipe.step_timeout)
            except ray.exceptions.RayTaskError as e:  # the stage refused these requests (their own fault)
                cause = getattr(e, "cause", None)
                self._fail(reqs, cause if isinstance(cause, Exception) else e)
                continue
            except ray.exceptions.RayError as e:  # a stage died: everything it held is lost
                self._stage_failed(e, refs, reqs)
                continue
            for req, token in zip(reqs, tokens.tolist(), strict=True):
                if not req.finished:
                    self._sampled(req, int(token), kind)
        now = time.monotonic()
        for ref, (_kind, reqs, _refs, deadline) in list(self._inflight.items()):
            if now > deadline:  # slow, not dead: fail these requests only; the others' state is untouched
                del self._inflight[ref]
                wait = self.pipe.step_timeout
                self._fail(reqs, StageFailedError(f"requests {[r.id for r in reqs]}: no answer within {wait:.0f} s"))

    def _stage_failed(self, error: Exception, refs: list, reqs: list[_Request]) -> None:
        ray = self.pipe._ray
        which = ""
        for j, r in enumerate(refs):  # the first stage whose result is an error is the one that failed
            try:
                ray.get(r, timeout=1.0)
            except Exception:
                s = self.pipe.plan[j]
                which = f"stage {j} (layers {s.first_layer}..{s.last_layer}, placed on {s.node.address}) failed: "
                break
        lost = [r for r in self._active if not r.finished]
        message = (which or "a stage failed: ") + self.pipe.failure(error, sorted(r.id for r in lost))
        self._inflight.clear()  # their results are errors too, or steps of the lost requests
        self._fail(lost, StageFailedError(message))
        try:
            self.pipe.restore()
        except StageFailedError as e:  # not back: the waiting requests cannot run either
            self._fail(list(self._waiting), e)

    def _sampled(self, req: _Request, token: int, kind: str) -> None:
        """A token the last stage sampled for `req`: report its text and finish the request or feed it back."""
        if kind == "prefill":
            req.prefill_s = time.perf_counter() - req.t0
            req.pos = len(req.prompt)
        else:
            req.pos += 1
        req.generated.append(token)
        if token in self.eog:
            return self._finish(req, "eog")
        req.last_text_token = token
        out, req.pending, stopped = split_at_stop(req.pending + req.decoder.push(token), req.stop)
        if out:
            req.emitted.append(out)
            req.events.put(GenerationChunk(out, token))
        if stopped:
            return self._finish(req, "stop")
        if len(req.generated) >= req.max_tokens or req.pos + 1 > req.capacity:
            return self._finish(req, "length")
        req.next_token = token
        self._ready.append(req)

    def _finish(self, req: _Request, reason: str) -> None:
        if reason != "stop":  # as generation.generate: held-back text is ordinary text unless it completes a stop
            rest, keep, stopped = split_at_stop(req.pending + req.decoder.flush(), req.stop)
            reason = "stop" if stopped else reason
            if rest + keep:
                req.emitted.append(rest + keep)
                req.events.put(GenerationChunk(rest + keep, req.last_text_token))
        self._release(req)
        total = time.perf_counter() - req.t0
        req.events.put(
            GenerationResult(
                text="".join(req.emitted),
                token_ids=tuple(req.generated),
                finish_reason=reason,
                prompt_tokens=len(req.prompt),
                completion_tokens=len(req.generated),
                prefill_seconds=req.prefill_s,
                decode_seconds=total - req.prefill_s,
            )
        )

    def _fail(self, reqs: list[_Request], error: BaseException) -> None:
        for req in reqs:
            if not req.finished:
                self._release(req)
                req.events.put(error)
        for q in (self._waiting, self._ready):
            for req in [r for r in q if r.finished]:
                q.remove(req)

    def _release(self, req: _Request) -> None:
        req.finished = True
        self._active.discard(req)
        self.pipe.release_remote([req.id])
