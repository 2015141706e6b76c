"""The slot scheduler: continuous batching of generation requests on one model, in one thread.

    scheduler = Scheduler(model, parallel=4, ctx_size=2048)
    scheduler.start()
    job = scheduler.submit(Job(prompt_ids, max_tokens=64, sampler=Sampler(params), stop=("\\n",)), on_event)

The thread owns the model. Each step it
1. admits waiting jobs into free slots (a slot is a KV cache of `ctx_size` positions and the job's state),
   with the longest matching prefix of a finished request's cache, or a copy of a running one's, when its
   prompt starts like that one's; a job whose prompt shares more with a prompt still being prefilled waits
   for those positions and copies them (`n` choices of one prompt prefill it once);
2. decodes one token for every slot past its prompt, and prefills up to `prefill_chunk` prompt tokens (the
   slots' prompts in turn), all in one `Model.prefill_batch` pass: one pass over the weights for all of those
   rows, each bit-identical to that token decoded alone (batch invariance); a long prompt delays the others
   by one chunk of rows per step, not by its whole length.
A job whose client went away (`Job.cancel`) or that finished frees its slot before the next step.

Determinism: every prompt row and every later token is computed as that token decoded alone (so it does not
matter how prompts are cut between steps, nor what else is in the pass), and a job's sampler has its own
seeded generator: so at temperature 0, or with a seed, a response is token for token the same whatever else
is running, and a reused cache prefix holds exactly the values a fresh prefill computes. Models other than
`Model` (`RayPipeline`, wrappers) have no `prefill_batch`: their prompts are prefilled one chunk of one slot
per step (`forward`, chunk boundaries at multiples of `prefill_chunk` from position 0, so they depend only on
the prompt; only whole chunks are reused), and they decode with `decode_batch`.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import one_blas_thread
from ..generation import IncrementalDecoder, split_at_stop
from ..kvcache import ContextLengthError
from ..sampling import Sampler, softmax
from ..transformer import Model

PREFILL_CHUNK = 64  # prompt tokens per prefill step: another slot waits at most one chunk for its next token
IDLE_WAIT = 0.05  # seconds the thread sleeps when there is nothing to do (woken early by a new job)


@dataclass
class Event:
    """What a job reports to its client: a piece of text (`kind="text"`), the end (`"done"`, with
    `finish_reason` and the usage counts) or a failure (`"error"`, with `message`). `special`: the text is one
    special token's, alone in its event (jobs with `Job.specials`)."""

    kind: str
    text: str = ""
    special: bool = False
    token: int = -1
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    message: str = ""


@dataclass
class Job:
    """One generation request: prompt token ids, at most `max_tokens` new tokens, a sampler with its own
    generator, stop strings, and how many top log-probabilities to report per token (None: none)."""

    prompt: Sequence[int]
    max_tokens: int
    sampler: Sampler
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    cache_prompt: bool = True  # may reuse (and leave behind) a cached prompt prefix (llama.cpp's `cache_prompt`)
    constraint: Any = None  # a `constrain.Constraint`: the grammar its tokens must follow (structured output)
    specials: bool = False  # each special token's text in an event of its own (readers of harmony's tags)
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop this job at the next step and free its slot (the client went away)."""
        self.cancelled.set()


class _Slot:
    """A running job: its cache, how far its prompt is in, and its text state."""

    def __init__(self, job: Job, cache, emit: Callable[[Event], None], tokenizer):
        self.job, self.cache, self.emit = job, cache, emit
        self.prefilled = 0  # prompt tokens already in the cache
        self.cached = 0  # of which were reused from an earlier request's cache
        self.history = list(job.prompt)  # prompt then generated tokens (what the penalties look at)
        self.generated = 0
        self.next_token: int | None = None  # sampled, not yet in the cache
        self.decoder = IncrementalDecoder(tokenizer, job.prompt)
        self.pending = ""  # text held back because it could start a stop string
        # a slot waiting for another slot's prompt prefill: it copies positions 0..share-1 once they are computed
        self.source: _Slot | None = None
        self.share = 0


class Metrics:
    """Counters for /metrics (read without a lock: each is one int or float assignment)."""

    def __init__(self):
        self.requests_total = 0
        self.requests_finished = collections.Counter()  # finish reason -> count
        self.prompt_tokens_total = 0
        self.completion_tokens_total = 0
        self.decode_steps_total = 0
        self.decode_tokens_total = 0
        self.decode_seconds_total = 0.0
        self.prefill_tokens_total = 0
        self.prefill_seconds_total = 0.0
        self.last_decode_tokens_per_second = 0.0
        self.slots_busy = 0
        self.queue_length = 0


class Scheduler:
    """`parallel` slots over one model, run by one thread (`start`/`stop`). Thread-safe: `submit`, `cancel`,
    `run_exclusive` may be called from any thread."""

    def __init__(self, model, parallel: int = 4, ctx_size: int = 2048, prefill_chunk: int = PREFILL_CHUNK):
        if parallel < 1:
            raise ValueError(f"parallel = {parallel}: need at least one slot")
        if not 1 <= ctx_size <= model.config.context_length:
            raise ValueError(f"ctx_size = {ctx_size}: must be in 1..{model.config.context_length} (the model's)")
        self.model, self.parallel, self.ctx_size, self.prefill_chunk = model, parallel, ctx_size, prefill_chunk
        self.tokenizer = model.tokenizer
        self.eog = frozenset(self.tokenizer.eog_ids)
        self.specials = frozenset(self.tokenizer.vocab.special_tokens)  # control, user-defined, unknown
        self.metrics = Metrics()
        self._waiting: collections.deque[tuple[Job, Callable]] = collections.deque()
        self._exclusive: collections.deque[tuple[Callable, Future]] = collections.deque()
        self._slots: list[_Slot] = []
        # (ids of the cached positions, KV cache, prompt length) of finished requests, oldest first
        self._cached: list[tuple[list[int], object, int]] = []
        self.cached_prompts = parallel  # how many finished requests' caches are kept for reuse
        self._turn = 0  # which prefilling slot goes next
        # prompts and decode in one `prefill_batch` pass: on a `Model` whose layers all allow it
        self.rows_prefill = isinstance(model, Model) and model.rows_prefill
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None

    # -- the client side -------------------------------------------------------------------------------------
    def submit(self, job: Job, emit: Callable[[Event], None]) -> Job:
        """Queue `job`; `emit(event)` is called from the scheduler thread for each of its events."""
        if len(job.prompt) + 1 > self.ctx_size:
            raise ContextLengthError(
                f"the prompt has {len(job.prompt)} tokens; the context holds {self.ctx_size} (--ctx-size), "
                f"so at most {self.ctx_size - 1} prompt tokens fit with one generated token"
            )
        with self._wake:
            self._waiting.append((job, emit))
            self.metrics.requests_total += 1
            self.metrics.queue_length = len(self._waiting)
            self._wake.notify()
        return job

    def run_exclusive(self, fn: Callable[[Any], Any]) -> Future:
        """Run `fn(model)` on the scheduler thread between two steps (the model is not shared between threads)."""
        future: Future = Future()
        with self._wake:
            self._exclusive.append((fn, future))
            self._wake.notify()
        return future

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="ggufpy-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def idle(self) -> bool:
        return not self._slots and not self._waiting

    # -- the scheduler thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                if not self._running:
                    break
                if not (self._slots or self._waiting or self._exclusive):
                    self._wake.wait(IDLE_WAIT)
                    continue
                self._resolve()  # before admitting: a finished source's cache goes to its followers first
                admitted = self._admit()
                exclusive = list(self._exclusive)
                self._exclusive.clear()
            for fn, future in exclusive:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.model))
                    except Exception as e:  # reported to the caller, never kills the loop
                        future.set_exception(e)
            for slot in admitted:
                self._slots.append(slot)
            self._drop_cancelled()
            if self.rows_prefill:  # prompt rows and decode rows in one pass
                self._pass_rows()
            else:  # a model without `prefill_batch`: one prompt chunk, then the decode step
                self._prefill_one()
                self._decode_all()
            self.metrics.slots_busy = len(self._slots)
        for slot in self._slots:  # shutting down: tell the clients
            self._finish(slot, "error", "the server is shutting down")

    def _admit(self) -> list[_Slot]:
        admitted: list[_Slot] = []
        while self._waiting and len(self._slots) + len(admitted) < self.parallel:
            job, emit = self._waiting.popleft()
            if job.cancelled.is_set():
                continue
            found = self._found(job.prompt) if job.cache_prompt else None
            slot = _Slot(job, None, emit, self.tokenizer)
            slot.source, slot.share = self._source(job, self._slots + admitted, found[2] if found else 0)
            if slot.source is None:
                self._start(slot, found)
            admitted.append(slot)
        self.metrics.queue_length = len(self._waiting)
        return admitted

    def _source(self, job: Job, slots: list[_Slot], reused: int) -> tuple[_Slot | None, int]:
        """(a slot whose prompt prefill will compute more of `job`'s prompt than the `reused` positions found
        now, how many positions `job` will copy from it), or (None, 0). Only in rows passes (every position is
        its token computed alone, so a copy is what `job` would compute)."""
        if not (self.rows_prefill and job.cache_prompt):
            return None, 0
        best, share = None, reused
        for s in slots:
            if s.source is None and s.job.cache_prompt and s.prefilled < len(s.job.prompt):
                n = min(_common(s.job.prompt, job.prompt), len(job.prompt) - 1)
                if n > max(share, s.prefilled if s.cache is not None else 0):  # positions still to be computed
                    best, share = s, n
        return best, share

    def _resolve(self) -> None:
        """Give each waiting slot its copied prefix once its source computed it (or went away)."""
        for slot in self._slots:
            source = slot.source
            if source is None or (source.cache is not None and source.cache.length < slot.share):
                continue
            slot.source = None
            self._start(slot, self._found(slot.job.prompt))  # the source's cache, running or just finished

    def _found(self, prompt: Sequence[int]) -> tuple[str, object, int] | None:
        """The longest reusable prefix for `prompt`: ("finished", index into the finished requests' caches,
        positions) or ("running", slot, positions), or None.

        A position is kept only where the cache holds bit for bit what a fresh prefill of `prompt` computes.
        With `prefill_batch` every position (prompt or generated) is its token computed alone, so the whole
        common prefix of ids is kept, generated tokens included (a multi-turn chat's earlier answer), and a
        running slot's computed positions can be copied. Without it, prompts are prefilled in chunks from
        position 0, so only whole chunks inside both prompts are kept, and only from finished requests. At
        least one prompt token is left to prefill, for the first logits."""
        found = None
        for i, (ids, _cache, prompt_len) in enumerate(self._cached):
            n = min(_common(ids, prompt), len(prompt) - 1)
            if not self.rows_prefill:
                n = min(n, prompt_len) // self.prefill_chunk * self.prefill_chunk
            if n > (found[2] if found else 0):
                found = ("finished", i, n)
        for s in self._slots if self.rows_prefill else ():
            if s.cache is not None and s.job.cache_prompt:
                n = min(_common(s.history[: s.cache.length], prompt), len(prompt) - 1)
                if n > (found[2] if found else 0):
                    found = ("running", s, n)
        return found

    def _start(self, slot: _Slot, found: tuple[str, object, int] | None) -> None:
        """Give `slot` its cache: a new one, or `found`'s (`_found`) cut to the shared prefix."""
        if found is None:
            slot.cache = self.model.new_cache(capacity=self.ctx_size)
            return
        kind, ref, keep = found
        # a finished request's cache is taken; a running slot's is copied (it goes on writing its own)
        cache = self._cached.pop(ref)[1] if kind == "finished" else ref.cache.resized(self.ctx_size)
        cache.truncate(keep)  # forget the rest: later writes overwrite it, attention reads only 0..keep-1
        slot.cache = cache
        slot.prefilled = slot.cached = cache.length  # a recurrent state is kept whole or not at all (0)

    def _remember(self, slot: _Slot) -> None:
        """Keep a finished request's cache, with the ids of the positions in it (its prompt, then the tokens it
        generated and fed back), for a later request that starts with the same ids."""
        if slot.job.cache_prompt and slot.cache is not None and slot.cache.length > 0:
            self._cached.append((slot.history[: slot.cache.length], slot.cache, len(slot.job.prompt)))
            while len(self._cached) > self.cached_prompts:
                self._cached.pop(0)  # the least recently finished

    def _drop_cancelled(self) -> None:
        for slot in [s for s in self._slots if s.job.cancelled.is_set()]:
            self._finish(slot, "cancelled")

    def _prefill_one(self) -> None:
        filling = [s for s in self._slots if s.source is None and s.prefilled < len(s.job.prompt)]
        if not filling:
            return
        slot = filling[self._turn % len(filling)]
        self._turn += 1
        start = slot.prefilled
        chunk = np.asarray(slot.job.prompt[start : start + self.prefill_chunk], dtype=np.int64)
        t0 = time.perf_counter()
        try:
            # one BLAS thread: measured on this 2-core machine under load, a 37-token SmolLM2 prefill took
            # 13-18 s with OpenBLAS's 2 threads and 1.9 s with one (`one_blas_thread` says why)
            with one_blas_thread():
                logits = self.model.forward(chunk, start, slot.cache, last_only=True)[-1]
        except Exception as e:
            self._finish(slot, "error", f"prefill failed: {e}")
            return
        self.metrics.prefill_tokens_total += len(chunk)
        self.metrics.prefill_seconds_total += time.perf_counter() - t0
        slot.prefilled += len(chunk)
        if slot.prefilled == len(slot.job.prompt):
            self._sampled(slot, logits)

    def _pass_rows(self) -> None:
        """One `prefill_batch` pass: the next token of every decoding slot, and behind them at most
        `prefill_chunk` prompt tokens of prefilling slots (starting with a different slot each step).

        Prompts take this path whatever their length (not BLAS chunks through `forward`): each row is then its
        token computed alone, which makes any cached prefix reusable (`_found`). Measured on SmolLM2 Q4_1, one
        thread: a 64-token prompt 0.49-0.56 s as rows against 0.57-0.69 s as one BLAS chunk; 64 tokens at
        positions 448-511 0.63-0.73 s against 0.49-0.59 s."""
        ready = [s for s in self._slots if s.next_token is not None]
        chunks = [[s.next_token] for s in ready]
        budget = self.prefill_chunk
        filling = [s for s in self._slots if s.source is None and s.prefilled < len(s.job.prompt)]
        if filling:
            k = self._turn % len(filling)
            filling = filling[k:] + filling[:k]  # a long prompt does not hold the budget for the others
            self._turn += 1
        for s in filling:
            if budget > 0:
                chunks.append(s.job.prompt[s.prefilled : s.prefilled + budget])
                budget -= len(chunks[-1])
                ready.append(s)
        if not ready:
            return
        t0 = time.perf_counter()
        try:
            logits = self.model.prefill_batch(chunks, [s.cache.length for s in ready], [s.cache for s in ready])
        except Exception as e:  # a bug, not a client error: fail these jobs, keep serving
            for s in ready:
                self._finish(s, "error", f"decode failed: {e}")
            return
        dt = time.perf_counter() - t0
        decoding = sum(s.next_token is not None for s in ready)
        rows = sum(map(len, chunks))
        if decoding:  # the pass's time shared between decode and prefill by their rows
            self.metrics.decode_steps_total += 1
            self.metrics.decode_tokens_total += decoding
            self.metrics.decode_seconds_total += dt * decoding / rows
            self.metrics.last_decode_tokens_per_second = decoding / dt if dt > 0 else 0.0
        self.metrics.prefill_tokens_total += rows - decoding
        self.metrics.prefill_seconds_total += dt * (rows - decoding) / rows
        for slot, chunk, row in zip(ready, chunks, logits, strict=True):
            if slot.next_token is not None:
                slot.next_token = None
                self._sampled(slot, row)
                continue
            slot.prefilled += len(chunk)
            if slot.prefilled == len(slot.job.prompt):
                self._sampled(slot, row)

    def _decode_all(self) -> None:
        ready = [s for s in self._slots if s.next_token is not None]
        if not ready:
            return
        t0 = time.perf_counter()
        tokens = np.asarray([s.next_token for s in ready], dtype=np.int64)
        try:
            logits = self.model.decode_batch(tokens, [s.cache.length for s in ready], [s.cache for s in ready])
        except Exception as e:  # a bug, not a client error: fail these jobs, keep serving
            for s in ready:
                self._finish(s, "error", f"decode failed: {e}")
            return
        dt = time.perf_counter() - t0
        self.metrics.decode_steps_total += 1
        self.metrics.decode_tokens_total += len(ready)
        self.metrics.decode_seconds_total += dt
        self.metrics.last_decode_tokens_per_second = len(ready) / dt if dt > 0 else 0.0
        for slot, row in zip(ready, logits, strict=True):
            slot.next_token = None
            self._sampled(slot, row)

    def _sampled(self, slot: _Slot, logits: np.ndarray) -> None:
        """Draw the next token from `logits`, report it, and finish the job or queue the token for decode."""
        job = slot.job
        try:
            if job.constraint is not None:  # this row's own grammar: the other rows are untouched
                logits = job.constraint.apply(logits)
            token = job.sampler(logits, slot.history)
            if job.constraint is not None and token not in self.eog:
                job.constraint.advance(token)
        except ValueError as e:
            self._finish(slot, "error", str(e))
            return
        logprob = top = None
        if job.logprobs is not None:
            lp = np.log(np.maximum(softmax(logits), 1e-300))
            logprob = float(lp[token])
            if job.logprobs > 0:
                best = np.argsort(-lp, kind="stable")[: job.logprobs]
                top = [(int(i), float(lp[i])) for i in best]
        slot.history.append(token)
        slot.generated += 1
        if token in self.eog:
            self._finish(slot, "stop")
            return
        if job.specials and token in self.specials:
            stopped = self._special(slot, token, logprob, top)
        else:
            text, slot.pending, stopped = split_at_stop(slot.pending + slot.decoder.push(token), job.stop)
            slot.emit(Event("text", text=text, token=token, logprob=logprob, top_logprobs=top))
        if stopped:
            self._finish(slot, "stop", flush=False)
        elif job.constraint is not None and job.constraint.finished:  # the grammar admits nothing more
            self._finish(slot, "stop")
        elif slot.generated >= job.max_tokens or slot.cache.length + 1 > slot.cache.capacity:
            self._finish(slot, "length")
        else:
            slot.next_token = token

    def _special(self, slot: _Slot, token: int, logprob, top) -> bool:
        """Report special token `token` as an event of its own, after the text before it (all of it: a stop
        string is matched in the text between special tokens). True when that text held a stop string."""
        text, keep, stopped = split_at_stop(slot.pending + slot.decoder.flush(), slot.job.stop)
        slot.pending, before = "", text if stopped else text + keep
        if before:
            slot.emit(Event("text", text=before))
        if stopped:
            return True
        slot.decoder = IncrementalDecoder(self.tokenizer, [token])  # the text after it decodes as after it
        piece = self.tokenizer.decode([token])
        slot.emit(Event("text", text=piece, token=token, logprob=logprob, top_logprobs=top, special=True))
        return False

    def _finish(self, slot: _Slot, reason: str, message: str = "", flush: bool = True) -> None:
        if slot in self._slots:
            self._slots.remove(slot)
        if reason in ("stop", "length") and flush:  # the held-back text: ordinary text unless it completes a stop
            rest, keep, stopped = split_at_stop(slot.pending + slot.decoder.flush(), slot.job.stop)
            text = rest if stopped else rest + keep
            reason = "stop" if stopped else reason
            if text:
                slot.emit(Event("text", text=text))
        self.metrics.requests_finished[reason] += 1
        self.metrics.prompt_tokens_total += len(slot.job.prompt)
        self.metrics.completion_tokens_total += slot.generated
        kind = "error" if reason == "error" else "done"
        slot.emit(
            Event(
                kind,
                finish_reason=reason,
                prompt_tokens=len(slot.job.prompt),
                completion_tokens=slot.generated,
                cached_tokens=slot.cached,
                message=message,
            )
        )
        if reason in ("stop", "length") and slot.prefilled == len(slot.job.prompt):
            self._remember(slot)
        slot.cache = None  # the slot lets go of the KV memory now, not when the client lets go of the job


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of two id sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
