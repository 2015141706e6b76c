"""Token samplers: small pure functions ``logits -> logits`` composed into a chain.

Every filter takes a float32 logits vector ``(vocab,)`` and returns a new one in which the rejected tokens are
set to ``-inf``; nothing is modified in place. A `Sampler` runs the chain in llama.cpp's default order and
draws a token with its own explicit ``np.random.Generator``.

The default chain follows llama.cpp ``common/sampling.cpp`` (``common_sampler_init``): logit bias first, then
the order of ``common_params_sampling::samplers`` in ``common/common.h`` restricted to the samplers we implement,

    logit_bias -> penalties -> top_k -> top_p -> min_p -> temperature -> dist

(llama.cpp's DRY, top-n-sigma, typical-p and XTC sit between these and are disabled by default). Each filter
mirrors its ``llama_sampler_*_apply`` in ``src/llama-sampler.cpp``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

Logits = np.ndarray  # float32 (vocab,)
LogitsFilter = Callable[[Logits], Logits]


def _check_logits(logits: Logits) -> np.ndarray:
    """Return a float32 copy of a 1-D logits vector, or raise with the offending shape."""
    x = np.array(logits, dtype=np.float32, copy=True)
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"logits must be a non-empty 1-D vector (vocab,), got shape {x.shape}")
    return x


def _check_logits_shape(logits: Logits) -> np.ndarray:
    """`_check_logits` without the copy: the logits as an array, or raise with the offending shape."""
    x = np.asarray(logits)
    if x.ndim != 1 or x.shape[0] == 0 or not np.issubdtype(x.dtype, np.floating):
        return _check_logits(x)  # (a copy that raises on a bad shape, or casts other dtypes to float32)
    return x


def softmax(logits: Logits) -> np.ndarray:
    """Probabilities (float64, sums to 1) of a logits vector; ``-inf`` entries get probability 0."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - np.max(x))
    return e / e.sum()


def apply_temperature(logits: Logits, temperature: float) -> Logits:
    """Divide the logits by ``temperature``.

    ``temperature <= 0`` keeps only the arg-max token (everything else becomes ``-inf``), as llama.cpp's
    ``llama_sampler_temp_impl`` does, so a following draw is greedy.
    """
    x = _check_logits(logits)
    if temperature <= 0.0:
        return _keep(x, np.array([greedy(x)]))
    return (x / np.float32(temperature)).astype(np.float32)


def _keep(x: np.ndarray, keep_ids: np.ndarray) -> np.ndarray:
    """Copy of ``x`` with every entry outside ``keep_ids`` set to ``-inf``."""
    out = np.full_like(x, -np.inf)
    out[keep_ids] = x[keep_ids]
    return out


def top_k(logits: Logits, k: int) -> Logits:
    """Keep the ``k`` highest logits (exactly ``k``; ties at the boundary are broken by lower token id).

    ``k <= 0`` or ``k >= vocab`` is a no-op, as in llama.cpp ``llama_sampler_top_k_impl``.
    """
    x = _check_logits(logits)
    if k <= 0 or k >= x.shape[0]:
        return x
    # argpartition is O(vocab); a stable sort of the k survivors then fixes which tied ids are kept.
    part = np.argpartition(-x, k - 1)
    threshold = x[part[k - 1]]
    above = np.flatnonzero(x > threshold)
    ties = np.flatnonzero(x == threshold)[: k - above.shape[0]]
    return _keep(x, np.concatenate([above, ties]))


def top_p(logits: Logits, p: float) -> Logits:
    """Nucleus filter: keep the smallest set of most probable tokens whose probability mass is ``>= p``.

    Probabilities are the softmax of the current (already filtered) logits, as in llama.cpp
    ``llama_sampler_top_p_apply``. ``p >= 1`` is a no-op; the most probable token is always kept.
    """
    x = _check_logits(logits)
    if p >= 1.0:
        return x
    alive = np.flatnonzero(x > -np.inf)
    if alive.shape[0] <= 1:
        return x
    # Ordered by logit, not by probability, as llama.cpp sorts: logits that differ by less than exp() can
    # resolve still rank the arg-max first, so it is always kept.
    order = np.argsort(-x[alive], kind="stable")  # descending, lower id first among ties
    cum = np.cumsum(softmax(x[alive])[order])
    # First position where the running mass reaches p; +1 because that token itself is included.
    n_keep = min(int(np.searchsorted(cum, p, side="left")) + 1, alive.shape[0])
    return _keep(x, alive[order[:n_keep]])


def min_p(logits: Logits, p: float) -> Logits:
    """Keep tokens whose probability is at least ``p`` times the probability of the most likely token.

    Done in logit space, ``logit >= max_logit + log(p)``, like llama.cpp ``llama_sampler_min_p_apply``.
    ``p <= 0`` is a no-op.
    """
    x = _check_logits(logits)
    if p <= 0.0:
        return x
    threshold = np.max(x) + np.float32(np.log(p))
    return np.where(x >= threshold, x, np.float32(-np.inf)).astype(np.float32)


def apply_penalties(
    logits: Logits,
    recent_token_ids: Sequence[int],
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> Logits:
    """Penalise tokens that occur in ``recent_token_ids`` (the caller chooses the window).

    For each distinct recent token with ``count`` occurrences, as llama.cpp ``llama_sampler_penalties_apply``:
    the repetition penalty divides a positive logit and multiplies a non-positive one (dividing a negative
    logit would make the token *more* likely), then ``count * frequency_penalty + presence_penalty`` is
    subtracted (OpenAI's definition).
    """
    return _penalize(_check_logits(logits), recent_token_ids, repetition_penalty, presence_penalty, frequency_penalty)


def _penalize(x: np.ndarray, recent_token_ids, repetition_penalty, presence_penalty, frequency_penalty) -> np.ndarray:
    """`apply_penalties` in place on float32 logits ``x``; returns ``x``."""
    if repetition_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0:
        return x
    counts = Counter(int(t) for t in recent_token_ids)
    if not counts:
        return x
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
    bad = ids[(ids < 0) | (ids >= x.shape[0])]
    if bad.size:
        raise ValueError(f"recent token id {int(bad[0])} is outside the vocabulary [0, {x.shape[0]})")
    vals = x[ids]
    vals = np.where(vals <= 0, vals * np.float32(repetition_penalty), vals / np.float32(repetition_penalty))
    x[ids] = vals - n * np.float32(frequency_penalty) - np.float32(presence_penalty)
    return x


def apply_logit_bias(logits: Logits, bias: Mapping[int, float] | None) -> Logits:
    """Add ``bias[token_id]`` to each listed token's logit (``-inf`` bans a token)."""
    return _bias(_check_logits(logits), bias)


def _bias(x: np.ndarray, bias: Mapping[int, float] | None) -> np.ndarray:
    """`apply_logit_bias` in place on float32 logits ``x``; returns ``x``."""
    for token_id, b in (bias or {}).items():
        if not 0 <= token_id < x.shape[0]:
            raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {x.shape[0]})")
        x[token_id] += np.float32(b)
    return x


def _check_drawable(x: np.ndarray) -> None:
    """NaN or +inf logits have no distribution to draw from (and NaN would win an arg-max): say so, naming the
    first such token, rather than draw token 0 or report the tokens as filtered out."""
    if np.max(x) < np.inf:  # NaN anywhere makes the max NaN, and NaN < inf is False: one pass when all is well
        return
    bad = np.isnan(x) | (x == np.inf)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"the logits are not finite: {int(bad.sum())} of {x.shape[0]} are NaN or +inf (first: token {i} = "
            f"{x[i]}); the model's output is broken (see ggufpy.diagnose)"
        )


def greedy(logits: Logits) -> int:
    """The arg-max token id (the lowest id among ties, as llama.cpp's greedy sampler)."""
    x = np.asarray(logits)
    _check_drawable(x)
    return int(np.argmax(x))


def sample_categorical(logits: Logits, rng: np.random.Generator) -> int:
    """Draw one token id from ``softmax(logits)``; ``-inf`` tokens are never drawn.

    Exactly one uniform number is consumed per call, whatever the logits, so a seeded run stays reproducible
    when the filters change how many candidates survive (llama.cpp ``llama_sampler_dist_apply`` does the same).
    """
    x = np.asarray(logits, dtype=np.float64)
    alive = np.flatnonzero(x > -np.inf)
    u = rng.random()
    _check_drawable(x)
    if alive.shape[0] == 0:
        raise ValueError("every token was filtered out (all logits are -inf); nothing to sample")
    cum = np.cumsum(np.exp(x[alive] - np.max(x[alive])))
    # Strictly greater, so a token whose probability underflowed to 0 can never be chosen.
    j = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return int(alive[min(j, alive.shape[0] - 1)])


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _finite(v) -> bool:
    return _is_number(v) and bool(np.isfinite(v))


@dataclass(frozen=True)
class _Rule:
    text: str
    ok: Callable[[object], bool]


# SamplingParams field -> its range: a NaN temperature would otherwise turn every logit into NaN
_PARAM_RULES = {
    "temperature": _Rule("a finite number >= 0 (0 is greedy)", lambda v: _finite(v) and v >= 0),
    "top_k": _Rule("an integer >= -1 (0 and -1 disable it)", lambda v: _is_int(v) and v >= -1),
    "top_p": _Rule("a number in [0, 1] (1 disables it)", lambda v: _finite(v) and 0 <= v <= 1),
    "min_p": _Rule("a number in [0, 1] (0 disables it)", lambda v: _finite(v) and 0 <= v <= 1),
    "repetition_penalty": _Rule("a finite number > 0 (1 disables it)", lambda v: _finite(v) and v > 0),
    "presence_penalty": _Rule("a finite number", _finite),
    "frequency_penalty": _Rule("a finite number", _finite),
    "penalty_last_n": _Rule("an integer >= -1 (-1: the whole history, 0: none)", lambda v: _is_int(v) and v >= -1),
    "seed": _Rule("None or an integer >= 0", lambda v: v is None or (_is_int(v) and v >= 0)),
}


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; the defaults are llama.cpp's ``common_params_sampling`` defaults.

    ``temperature == 0`` means greedy decoding. ``top_k`` 0 (or -1), ``top_p == 1`` and ``min_p == 0`` disable
    their filter. ``penalty_last_n`` is the window of most recent tokens the penalties look at (0 disables
    them, -1 means the whole history). ``seed=None`` draws fresh OS entropy. Every field is checked on
    construction (`_PARAM_RULES`): a value out of range raises ValueError naming the field and the rule.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    seed: int | None = None

    def __post_init__(self):
        for name, rule in _PARAM_RULES.items():
            value = getattr(self, name)
            if not rule.ok(value):
                raise ValueError(f"SamplingParams.{name} = {value!r}: must be {rule.text}")
        for token_id, bias in (self.logit_bias or {}).items():
            if not _is_int(token_id) or token_id < 0 or not _is_number(bias) or np.isnan(bias) or bias == np.inf:
                raise ValueError(
                    f"SamplingParams.logit_bias[{token_id!r}] = {bias!r}: must map a token id (int >= 0) to a "
                    "finite number or -inf (which bans the token)"
                )

    @classmethod
    def greedy(cls, **overrides) -> SamplingParams:
        """Deterministic arg-max decoding (penalties and logit bias still apply)."""
        return cls(**{"temperature": 0.0, **overrides})


def penalty_window(history: Sequence[int], last_n: int) -> Sequence[int]:
    """The most recent ``last_n`` tokens of ``history`` (all of them for -1, none for 0)."""
    if last_n == 0:
        return ()
    if last_n < 0:
        return history
    return history[-last_n:]


class Sampler:
    """A `SamplingParams` bound to its own random generator: ``sampler(logits, history) -> token id``.

    ``history`` is every token before the one being sampled (prompt and generated, as llama.cpp's completion
    tool feeds the prompt to ``common_sampler_accept``); the penalties look at its last ``penalty_last_n``.
    """

    def __init__(self, params: SamplingParams | None = None, rng: np.random.Generator | None = None):
        self.params = params if params is not None else SamplingParams()
        self.rng = rng if rng is not None else np.random.default_rng(self.params.seed)
        self._scratch: np.ndarray | None = None  # the greedy path's logits copy, reused from call to call

    def filter(self, logits: Logits, history: Sequence[int] = ()) -> Logits:
        """The logits after every filter of the chain, ready for the draw (rejected tokens are ``-inf``)."""
        p = self.params
        x = self._penalized(logits, history)
        if p.temperature <= 0.0:
            return apply_temperature(x, 0.0)
        x = top_k(x, p.top_k)
        x = top_p(x, p.top_p)
        x = min_p(x, p.min_p)
        return apply_temperature(x, p.temperature)

    def _penalized(self, logits: Logits, history: Sequence[int]) -> Logits:
        """The logits after the logit bias and the penalties (the filters that apply at any temperature)."""
        p = self.params
        x = apply_logit_bias(logits, p.logit_bias)
        window = penalty_window(history, p.penalty_last_n)
        return apply_penalties(x, window, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)

    def probs(self, logits: Logits, history: Sequence[int] = ()) -> np.ndarray:
        """The distribution the next token is drawn from (float64, zero for rejected tokens)."""
        return softmax(self.filter(logits, history))

    def __call__(self, logits: Logits, history: Sequence[int] = ()) -> int:
        """Sample the next token id from ``logits`` (vocab,) given the preceding tokens ``history``."""
        if self.params.temperature > 0.0:
            return sample_categorical(self.filter(logits, history), self.rng)
        # greedy: the arg-max of the biased, penalized logits (what `filter` masks everything else around), in
        # a buffer kept from the last call: a fresh 200 KB-1 MB copy page-faults (~0.1 ms of a server step's
        # ~3 ms per row, for each of the bias and the penalties)
        x = _check_logits_shape(logits)
        if self._scratch is None or self._scratch.shape != x.shape:
            self._scratch = np.empty(x.shape, np.float32)
        np.copyto(self._scratch, x, casting="same_kind")
        p = self.params
        window = penalty_window(history, p.penalty_last_n)
        _bias(self._scratch, p.logit_bias)
        _penalize(self._scratch, window, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        return greedy(self._scratch)
