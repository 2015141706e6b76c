"""Streaming text generation, independent of the model architecture.

``generate`` prefills the prompt in one forward call, then feeds one sampled token per step, and yields text
as soon as it is final: never half a UTF-8 character (byte-fallback tokens split them), never text that could
still turn out to be the start of a stop string.

    gen = generate(model, tokenizer, prompt_ids, sampling=SamplingParams(seed=0), stop=["\\n\\n"])
    for chunk in gen:
        print(chunk.text, end="", flush=True)
    print(gen.result.finish_reason, gen.result.completion_tokens)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from ggufpy.kvcache import ContextLengthError
from ggufpy.sampling import Sampler, SamplingParams

FinishReason = Literal["stop", "length", "eog"]

# Tokens of prompt context decoded before the generated ones, so that a tokenizer which drops the leading
# space of the first decoded piece (SentencePiece "▁") renders the first generated token as it reads in context.
_CONTEXT_TOKENS = 4
# A UTF-8 character is at most 4 bytes, so an incomplete character stalls the output for at most 3 byte tokens;
# a trailing U+FFFD that stalls it this long is a real one (or invalid bytes) and is released.
_MAX_STALLED_TOKENS = 8
_REPLACEMENT = "\ufffd"


@runtime_checkable
class LanguageModel(Protocol):
    """What `generate` needs from a model: a KV cache and a forward pass over token ids."""

    def new_cache(self) -> Any:
        """A fresh, empty KV cache."""
        ...

    def forward(self, x: np.ndarray, pos: int, cache: Any, layers=None, last_only: bool = False) -> np.ndarray:
        """Run token ids ``x`` (T,) placed at positions ``pos .. pos+T-1``, appending to ``cache``.

        Returns float32 logits (T, vocab), or (1, vocab) for the last position when ``last_only``.
        """
        ...


@runtime_checkable
class TokenizerLike(Protocol):
    """What `generate` needs from a tokenizer."""

    eog_ids: frozenset[int]  # end-of-generation token ids (eos, eot, ...)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences decode to U+FFFD."""
        ...


@dataclass(frozen=True)
class GenerationChunk:
    """A piece of final text and the id of the most recent token it includes."""

    text: str
    token_id: int


@dataclass(frozen=True)
class GenerationResult:
    """Everything a finished generation produced.

    ``text`` is the concatenation of the yielded chunks (the stop string and end-of-generation tokens are not
    part of it). ``token_ids`` are all the sampled tokens, including a final end-of-generation token or the
    tokens that spelled a stop string, so ``completion_tokens == len(token_ids)``. ``cached_tokens`` of the
    prompt were already in the cache passed to `generate` and were not computed again. ``finish_reason`` is
    "length" both at ``max_tokens`` and when the cache or the model's context is full.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prefill_seconds: float
    decode_seconds: float
    cached_tokens: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prompt tokens computed per second, cached ones not counted (0 when nothing was timed)."""
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens generated per second after the first one (which comes out of the prefill)."""
        n = self.completion_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of complete characters.

    Each `push` decodes only a short window: a few already released context ids, then the ids whose text is
    not final yet. Of the window's new text everything before a trailing U+FFFD (an incomplete UTF-8 sequence)
    is released. Once a token ends on a character boundary the window slides forward, so the cost per token
    stays O(1) however long the text gets (byte-level BPE tokens that straddle characters only delay the
    slide until the first token that does not).
    """

    def __init__(self, tokenizer: TokenizerLike, context_ids: Sequence[int] = ()):
        self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._start_window([int(t) for t in list(context_ids)[-_CONTEXT_TOKENS:]])

    def _start_window(self, context: list[int]) -> None:
        self._ids = context
        self._n_context = len(context)  # ids before this index are context, already released
        self._context_text = self._decode(context)
        self._sent = 0  # characters of the window's new text already released
        self._stalled = 0  # tokens pushed since the released text last grew

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self._ids.append(int(token_id))
        return self._release(force=False)

    def flush(self) -> str:
        """Release whatever is still held, incomplete characters included (as U+FFFD)."""
        return self._release(force=True)

    def _release(self, force: bool) -> str:
        if len(self._ids) == self._n_context:
            return ""
        full = self._decode(self._ids)
        new = full[_common_prefix_length(full, self._context_text) :]
        stable = new.rstrip(_REPLACEMENT)
        self._stalled = 0 if len(stable) > self._sent else self._stalled + 1
        at_boundary = len(stable) == len(new)
        if not (at_boundary or force or self._stalled >= _MAX_STALLED_TOKENS):
            out = stable[self._sent :]
            self._sent = max(self._sent, len(stable))
            return out
        out = new[self._sent :]
        # Every pending token is now text and becomes the next window's context; a context that ends inside a
        # character (forced release) would not decode as a prefix of what follows, so it is dropped.
        self._start_window(self._ids[self._n_context :] if at_boundary else [])
        return out


def _common_prefix_length(text: str, prefix: str) -> int:
    """``len(prefix)`` when ``text`` starts with it, else the length of their common prefix.

    Decoding is normally prefix-stable; llama.cpp's ``clean_spaces`` detokenizer pass is not (" ." -> "."
    across the context boundary). Text already released cannot be taken back, so the new text then starts
    where the two diverge, as if rendered piece by piece, and nothing is lost.
    """
    if text.startswith(prefix):
        return len(prefix)
    pairs = enumerate(zip(text, prefix, strict=False))
    return next((i for i, (a, b) in pairs if a != b), min(len(text), len(prefix)))


def _stop_holdback(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def split_at_stop(pending: str, stop: Sequence[str]) -> tuple[str, str, bool]:
    """Split not-yet-emitted text into (text to emit, text to keep holding, whether a stop string matched).

    On a match the text is cut at the start of the stop string that completes first (earliest end, then
    earliest start): that is all a stream can know when it happens, so the cut does not depend on how the
    text arrived in pieces. Otherwise the longest tail that could still grow into a stop string is held back.
    """
    hits = [(i + len(s), i) for s in stop if s and (i := pending.find(s)) >= 0]
    if hits:
        return pending[: min(hits)[1]], "", True
    h = _stop_holdback(pending, [s for s in stop if s])
    return pending[: len(pending) - h], pending[len(pending) - h :], False


class Generation(Iterator[GenerationChunk]):
    """An iterator of `GenerationChunk`; once exhausted, ``.result`` holds the `GenerationResult`.

    Created by `generate`. Nothing runs until the first ``next()``; breaking out of the loop early leaves
    ``.result`` unset (use `generate_text` or exhaust the iterator).

    ``cache`` is the KV cache the generation wrote; ``cache_ids`` are the tokens it holds (the prompt and every
    generated token but the last, which was sampled and never fed): pass both to the next `generate` call
    of a conversation to compute only what is new.
    """

    def __init__(
        self,
        model: LanguageModel,
        tokenizer: TokenizerLike,
        prompt_ids: Sequence[int],
        max_tokens: int,
        sampler: Sampler,
        stop: Sequence[str],
        cache: Any = None,
    ):
        self._result: GenerationResult | None = None
        prompt = [int(t) for t in prompt_ids]
        self.cache = cache
        self.cache_ids: list[int] = prompt[: cache.length] if cache is not None else []
        self._steps = self._run(model, tokenizer, prompt, max_tokens, sampler, tuple(stop))

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> GenerationChunk:
        return next(self._steps)

    @property
    def done(self) -> bool:
        """Whether generation has finished and `result` is available."""
        return self._result is not None

    @property
    def result(self) -> GenerationResult:
        """The final `GenerationResult`; raises `RuntimeError` before the iterator is exhausted."""
        if self._result is None:
            raise RuntimeError("generation has not finished: iterate the Generation to the end first")
        return self._result

    def _run(
        self,
        model: LanguageModel,
        tokenizer: TokenizerLike,
        prompt: list[int],
        max_tokens: int,
        sampler: Sampler,
        stop: tuple[str, ...],
    ) -> Iterator[GenerationChunk]:
        eog = frozenset(tokenizer.eog_ids)
        decoder = IncrementalDecoder(tokenizer, prompt)
        history = list(prompt)  # what the penalties look at: prompt then generated tokens
        generated: list[int] = []
        emitted: list[str] = []
        pending = ""  # final-looking text held back because it could start a stop string
        last_text_token = -1
        finish: FinishReason = "length"
        prefill_s = decode_s = 0.0

        cached = self.cache.length if self.cache is not None else 0
        if max_tokens > 0:
            if self.cache is None:
                self.cache = model.new_cache()
            cache = self.cache
            t0 = time.perf_counter()
            logits = model.forward(np.asarray(prompt[cached:], dtype=np.int64), cached, cache, last_only=True)[-1]
            self.cache_ids = list(prompt)
            token = sampler(_finite(model, logits, prompt), history)
            prefill_s = time.perf_counter() - t0
            while True:
                generated.append(token)
                history.append(token)
                if token in eog:
                    finish = "eog"
                    break
                last_text_token = token
                out, pending, stopped = split_at_stop(pending + decoder.push(token), stop)
                if out:
                    emitted.append(out)
                    yield GenerationChunk(out, token)
                if stopped:
                    finish = "stop"
                    break
                if len(generated) >= max_tokens:
                    break
                # Timed around the model and sampler only: the consumer's time between chunks is not ours.
                t0 = time.perf_counter()
                pos = len(history) - 1
                try:
                    logits = model.forward(np.asarray([token], dtype=np.int64), pos, cache, last_only=True)[-1]
                except ContextLengthError:
                    break  # the cache or the context is full: an ordinary end, as llama.cpp's and OpenAI's "length"
                self.cache_ids.append(token)
                token = sampler(_finite(model, logits, history), history)
                decode_s += time.perf_counter() - t0

        if finish != "stop":
            # The stream ended without completing a stop string: what was held back is ordinary text.
            rest, keep, stopped = split_at_stop(pending + decoder.flush(), stop)
            if stopped:
                finish = "stop"
            rest += keep
            if rest:
                emitted.append(rest)
                yield GenerationChunk(rest, last_text_token)

        self._result = GenerationResult(
            text="".join(emitted),
            token_ids=tuple(generated),
            finish_reason=finish,
            prompt_tokens=len(prompt),
            completion_tokens=len(generated),
            prefill_seconds=prefill_s,
            decode_seconds=decode_s,
            cached_tokens=cached,
        )


def _finite(model: LanguageModel, logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """``logits`` unless they hold NaN or +inf (or are all -inf: -inf alone is how a model rules a token out).

    Sampling NaN would silently give token 0, often EOS. `ggufpy.diagnose.check_finite` reruns the tokens with
    tracing and raises naming the first layer that went wrong; a model it cannot trace gets a plainer error.
    """
    if np.isfinite(logits).all() or not (
        np.isnan(logits).any() or np.isposinf(logits).any() or np.isneginf(logits).all()
    ):
        return logits
    try:
        from ggufpy.diagnose import NonFiniteLogitsError, check_finite
    except ImportError:  # an older tree without the diagnosis: still never sample from NaN
        NonFiniteLogitsError, check_finite = ValueError, None
    if check_finite is not None and hasattr(model, "layers"):
        check_finite(model, logits, list(tokens))
    bad = np.flatnonzero(~np.isfinite(logits))
    raise NonFiniteLogitsError(
        f"the model produced non-finite logits after {len(tokens)} tokens ({bad.size} of {logits.size} values, "
        f"first at token id {int(bad[0])}: {logits[bad[0]]}): its weights or hyperparameters are broken"
    )


def _as_sampler(sampling: SamplingParams | Sampler) -> Sampler:
    if isinstance(sampling, Sampler):
        return sampling
    if isinstance(sampling, SamplingParams):
        return Sampler(sampling)
    raise TypeError(f"sampling must be a SamplingParams or a Sampler, got {type(sampling).__name__}")


def generate(
    model: LanguageModel,
    tokenizer: TokenizerLike,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | Sampler,
    stop: Sequence[str] = (),
    cache: Any = None,
) -> Generation:
    """Stream a completion of ``prompt_ids``.

    Returns a `Generation`: iterate it for `GenerationChunk`s, then read ``.result``. Generation ends at an
    end-of-generation token (``finish_reason="eog"``, not emitted), when the text contains one of ``stop``
    (``"stop"``, the text is cut before the first stop string to complete), after ``max_tokens`` sampled
    tokens or when the cache is full (``"length"``).
    Passing a `SamplingParams` creates a fresh `Sampler` (seeded by ``params.seed``); pass a `Sampler` to
    continue its random stream.

    ``cache`` continues a sequence: its first ``cache.length`` positions must hold ``prompt_ids[:cache.length]``
    (as ``Generation.cache_ids`` of an earlier call, cut with `reuse_cache`); only the rest is computed. Without
    it a fresh ``model.new_cache()`` is used; pass ``model.new_cache(capacity=...)`` for a longer context.
    """
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token (e.g. BOS)")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if cache is not None and cache.length >= len(prompt_ids):
        raise ValueError(
            f"the cache holds {cache.length} positions and the prompt has {len(prompt_ids)} tokens: at least one "
            "prompt token must be new (cut the cache with reuse_cache)"
        )
    if isinstance(stop, str):
        stop = (stop,)
    return Generation(model, tokenizer, prompt_ids, max_tokens, _as_sampler(sampling), stop, cache)


def reuse_cache(cache: Any, cache_ids: Sequence[int], prompt_ids: Sequence[int]) -> int:
    """Cut ``cache`` (holding ``cache_ids``) to the longest prefix it shares with ``prompt_ids``; return its length.

    At least the last prompt token is left to compute, since its logits start the reply. This is llama.cpp's
    ``cache_prompt``: a chat template that renders earlier turns differently once a new one is added, or a
    reply that tokenizes differently as text, costs only the tokens from the first difference on.
    """
    n = 0
    for a, b in zip(cache_ids, prompt_ids, strict=False):
        if a != b:
            break
        n += 1
    n = min(n, len(prompt_ids) - 1, cache.length)
    cache.truncate(n)
    return cache.length  # a recurrent state cannot be cut back part way: it restarts at 0 (`state.HybridState`)


def generate_text(
    model: LanguageModel,
    tokenizer: TokenizerLike,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | Sampler,
    stop: Sequence[str] = (),
    cache: Any = None,
) -> GenerationResult:
    """Run `generate` to the end and return its `GenerationResult`."""
    gen = generate(model, tokenizer, prompt_ids, max_tokens=max_tokens, sampling=sampling, stop=stop, cache=cache)
    for _ in gen:
        pass
    return gen.result
