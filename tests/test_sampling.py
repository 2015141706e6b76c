"""Samplers on known distributions, hand-computed penalties and properties of the filter chain."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ggufpy.sampling import (
    Sampler,
    SamplingParams,
    apply_logit_bias,
    apply_penalties,
    apply_temperature,
    greedy,
    min_p,
    penalty_window,
    sample_categorical,
    softmax,
    top_k,
    top_p,
)

NEG_INF = np.float32(-np.inf)


def kept(x: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(x)).tolist())


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# A fixed distribution: 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (shuffled so order != id).
PROBS = np.array([0.1, 0.4, 0.04, 0.25, 0.06, 0.15])
LOGITS = logits_of(PROBS)


# --- top_k -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_the_k_largest(k):
    out = top_k(LOGITS, k)
    assert kept(out) == set(np.argsort(-PROBS)[:k].tolist())
    np.testing.assert_array_equal(out[list(kept(out))], LOGITS[list(kept(out))])


def test_top_k_disabled_and_oversized_are_no_ops():
    for k in (0, -1, 6, 100):
        np.testing.assert_array_equal(top_k(LOGITS, k), LOGITS)


def test_top_k_ties_keep_exactly_k_lowest_ids():
    x = np.array([1.0, 3.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32)
    assert kept(top_k(x, 3)) == {1, 2, 3}


def test_filters_do_not_modify_their_input():
    x = LOGITS.copy()
    for f in (lambda v: top_k(v, 2), lambda v: top_p(v, 0.5), lambda v: min_p(v, 0.3)):
        f(x)
    apply_penalties(x, [1, 1, 3], 1.3, 0.5, 0.5)
    apply_logit_bias(x, {0: 1.0})
    np.testing.assert_array_equal(x, LOGITS)


# --- top_p -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p, expected",
    [
        (0.0, {1}),  # the top token is always kept
        (0.39, {1}),  # 0.4 alone reaches 0.39
        (0.41, {1, 3}),  # 0.65
        (0.65, {1, 3}),
        (0.66, {1, 3, 5}),  # 0.80
        (0.9, {1, 3, 5, 0}),  # 0.90
        (0.95, {1, 3, 5, 0, 4}),  # 0.96
        (0.99, {1, 3, 5, 0, 4, 2}),
    ],
)
def test_top_p_keeps_minimal_prefix_with_mass_at_least_p(p, expected):
    assert kept(top_p(LOGITS, p)) == expected


def test_top_p_one_is_no_op():
    np.testing.assert_array_equal(top_p(LOGITS, 1.0), LOGITS)


def test_top_p_renormalises_over_already_filtered_candidates():
    # After top_k=2 the survivors have 0.4/0.65 = 0.615 and 0.25/0.65 = 0.385 of the mass, so p=0.5 needs
    # one token there but two on the full distribution (0.4 < 0.5).
    assert kept(top_p(LOGITS, 0.5)) == {1, 3}
    assert kept(top_p(top_k(LOGITS, 2), 0.5)) == {1}
    assert kept(top_p(top_k(LOGITS, 2), 0.62)) == {1, 3}


# --- min_p -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p, expected",
    [
        (0.5, {1, 3}),  # threshold 0.2: 0.4, 0.25
        (0.25, {1, 3, 5, 0}),  # threshold 0.1: 0.1 is kept (>=)
        (0.26, {1, 3, 5}),
        (0.1, {1, 3, 5, 0, 4, 2}),  # threshold 0.04
        (1.0, {1}),
    ],
)
def test_min_p_threshold_is_relative_to_the_max_probability(p, expected):
    assert kept(min_p(LOGITS, p)) == expected


def test_min_p_zero_is_no_op():
    np.testing.assert_array_equal(min_p(LOGITS, 0.0), LOGITS)


# --- temperature -----------------------------------------------------------------------------------


def test_temperature_scales_logits_and_entropy():
    np.testing.assert_allclose(apply_temperature(LOGITS, 2.0), LOGITS / 2, rtol=1e-6)
    h = [entropy(softmax(apply_temperature(LOGITS, t))) for t in (0.25, 0.5, 1.0, 2.0, 8.0)]
    assert h == sorted(h) and h[0] < h[-1]
    assert entropy(softmax(apply_temperature(LOGITS, 1.0))) == pytest.approx(entropy(PROBS), rel=1e-5)
    assert entropy(softmax(apply_temperature(LOGITS, 1e4))) == pytest.approx(np.log(6), rel=1e-3)


def test_zero_temperature_keeps_only_the_argmax():
    assert kept(apply_temperature(LOGITS, 0.0)) == {1}
    assert kept(apply_temperature(LOGITS, -1.0)) == {1}


# --- penalties and bias ----------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x = np.array([2.0, -2.0, 1.0, 0.0, 3.0], dtype=np.float32)
    out = apply_penalties(x, [0, 1, 1, 3], repetition_penalty=2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 0.0, 3.0])


def test_presence_and_frequency_penalties_follow_openai():
    x = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    # counts: token 0 x3, token 1 x1, token 3 x2
    out = apply_penalties(x, [0, 1, 0, 3, 0, 3], presence_penalty=0.5, frequency_penalty=0.25)
    np.testing.assert_allclose(out, [2.0 - 0.75 - 0.5, -2.0 - 0.25 - 0.5, 1.0, 0.5 - 0.5 - 0.5])


def test_all_penalties_combined_hand_computed():
    x = np.array([3.0, -1.0, 0.5], dtype=np.float32)
    out = apply_penalties(x, [0, 0, 1], repetition_penalty=1.5, presence_penalty=0.1, frequency_penalty=0.2)
    np.testing.assert_allclose(out, [3.0 / 1.5 - 0.4 - 0.1, -1.0 * 1.5 - 0.2 - 0.1, 0.5], rtol=1e-6)


def test_penalties_reject_out_of_vocab_ids():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_penalties(LOGITS, [6], repetition_penalty=1.1)


def test_penalty_window():
    h = list(range(10))
    assert list(penalty_window(h, 3)) == [7, 8, 9]
    assert list(penalty_window(h, 0)) == []
    assert list(penalty_window(h, -1)) == h
    assert list(penalty_window(h, 64)) == h


def test_logit_bias_adds_and_bans():
    out = apply_logit_bias(LOGITS, {0: 1.5, 1: float("-inf")})
    assert out[0] == pytest.approx(LOGITS[0] + 1.5)
    assert out[1] == NEG_INF
    np.testing.assert_array_equal(out[2:], LOGITS[2:])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_logit_bias(LOGITS, {99: 1.0})


# --- drawing ---------------------------------------------------------------------------------------


def test_greedy_picks_argmax_and_lowest_id_on_ties():
    assert greedy(LOGITS) == 1
    assert greedy(np.array([1.0, 5.0, 5.0], dtype=np.float32)) == 1


def test_categorical_never_draws_masked_tokens():
    rng = np.random.default_rng(0)
    x = top_k(LOGITS, 2)
    draws = {sample_categorical(x, rng) for _ in range(500)}
    assert draws == {1, 3}


def test_empirical_frequencies_match_softmax():
    """20k draws at temperature 1 with no filters: chi-square against the softmax probabilities."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    sampler = Sampler(params)
    n = 20_000
    counts = np.bincount([sampler(LOGITS) for _ in range(n)], minlength=6)
    expected = n * PROBS
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: P(chi2 > 20.5) ~ 0.001.
    assert chi2 < 20.5, (counts, expected)


def test_empirical_frequencies_match_the_filtered_distribution():
    sampler = Sampler(SamplingParams(temperature=0.5, top_k=3, top_p=1.0, min_p=0.0, seed=7))
    target = sampler.probs(LOGITS)
    expected_support = {1, 3, 5}
    assert kept(np.where(target > 0, 0.0, -np.inf)) == expected_support
    p = PROBS[[1, 3, 5]] ** 2  # temperature 0.5 squares the probabilities
    np.testing.assert_allclose(target[[1, 3, 5]], p / p.sum(), rtol=1e-5)
    n = 20_000
    counts = np.bincount([sampler(LOGITS) for _ in range(n)], minlength=6)
    assert set(np.flatnonzero(counts).tolist()) == expected_support
    np.testing.assert_allclose(counts / n, target, atol=0.015)


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a, b = Sampler(params), Sampler(params)
    seq_a = [a(LOGITS) for _ in range(200)]
    assert seq_a == [b(LOGITS) for _ in range(200)]
    assert len(set(seq_a)) > 1
    c = Sampler(dataclasses.replace(params, seed=43))
    assert seq_a != [c(LOGITS) for _ in range(200)]


def test_sampler_accepts_an_explicit_generator():
    params = SamplingParams(temperature=1.0, seed=None)
    a = Sampler(params, rng=np.random.default_rng(5))
    b = Sampler(params, rng=np.random.default_rng(5))
    assert [a(LOGITS) for _ in range(50)] == [b(LOGITS) for _ in range(50)]


def test_zero_temperature_is_greedy_after_penalties_and_bias():
    s = Sampler(SamplingParams.greedy())
    assert s(LOGITS) == 1
    assert Sampler(SamplingParams.greedy(logit_bias={1: -10.0}))(LOGITS) == 3
    # A strong repetition penalty on token 1 (in the window) moves the arg-max to token 3.
    rep = Sampler(SamplingParams.greedy(repetition_penalty=5.0, penalty_last_n=2))
    assert rep(LOGITS, [1]) == 3
    assert rep(LOGITS, [1, 0, 0]) == 1  # token 1 fell out of the 2-token window


def test_default_params_are_llama_cpp_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.penalty_last_n) == (0.8, 40, 0.95, 0.05, 64)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    hash(p)  # frozen and hashable even with the mapping field


def test_chain_order_penalties_before_top_k():
    # Penalising token 1 first lets token 2 into the top-2; if top_k ran first it would be {1, 3}.
    x = np.array([0.0, 5.0, 3.0, 4.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, presence_penalty=10.0))
    assert kept(s.filter(x, [1])) == {2, 3}


def test_bad_logits_shape_is_reported():
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        top_k(np.zeros((2, 3), dtype=np.float32), 1)


# --- properties ------------------------------------------------------------------------------------

finite_logits = arrays(
    np.float32,
    st.integers(1, 64),
    elements=st.floats(-30, 30, width=32),
)


@settings(max_examples=150, deadline=None)
@given(
    x=finite_logits,
    k=st.integers(-1, 70),
    p=st.floats(0.0, 1.0),
    mp=st.floats(0.0, 1.0),
    temperature=st.floats(0.05, 5.0),
)
def test_chain_keeps_a_nonempty_set_containing_the_argmax(x, k, p, mp, temperature):
    s = Sampler(SamplingParams(temperature=temperature, top_k=k, top_p=p, min_p=mp, seed=0))
    out = s.filter(x)
    assert kept(out)
    assert np.isfinite(out[greedy(x)])
    if k > 0:
        assert len(kept(out)) <= k
    token = s(x)
    assert np.isfinite(out[token])
    probs = s.probs(x)
    assert probs.sum() == pytest.approx(1.0)


@settings(max_examples=150, deadline=None)
@given(x=finite_logits, k=st.integers(1, 70))
def test_top_k_keeps_min_k_vocab_and_every_kept_logit_beats_every_dropped(x, k):
    out = top_k(x, k)
    keep = kept(out)
    assert len(keep) == min(k, x.shape[0])
    drop = set(range(x.shape[0])) - keep
    if drop:
        assert min(x[list(keep)]) >= max(x[list(drop)])


@settings(max_examples=150, deadline=None)
@given(x=finite_logits, p=st.floats(0.0, 0.999))
def test_top_p_kept_mass_reaches_p_and_is_minimal(x, p):
    probs = softmax(x)
    keep = sorted(kept(top_p(x, p)), key=lambda i: -probs[i])
    mass = probs[keep].sum()
    assert mass >= p - 1e-9
    # Dropping the least probable kept token must fall below p (minimality), unless only one is kept.
    if len(keep) > 1:
        assert mass - probs[keep[-1]] < p + 1e-9


@settings(max_examples=100, deadline=None)
@given(x=finite_logits, mp=st.floats(0.001, 1.0))
def test_min_p_kept_tokens_are_exactly_those_above_the_threshold(x, mp):
    probs = softmax(x)
    keep = kept(min_p(x, mp))
    # float32 thresholding: allow a small band around the boundary.
    for i in range(x.shape[0]):
        ratio = probs[i] / probs.max()
        if ratio >= mp * (1 + 1e-4):
            assert i in keep
        elif ratio < mp * (1 - 1e-4):
            assert i not in keep


# -- hostile settings and non-finite logits (issue 11) ---------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("temperature", float("nan"), "a finite number >= 0"),
        ("temperature", float("inf"), "a finite number >= 0"),
        ("temperature", -0.5, "a finite number >= 0"),
        ("top_k", 1.5, "an integer >= -1"),
        ("top_k", True, "an integer >= -1"),
        ("top_k", -2, "an integer >= -1"),
        ("top_p", 1.5, "a number in [0, 1]"),
        ("top_p", float("nan"), "a number in [0, 1]"),
        ("min_p", -0.1, "a number in [0, 1]"),
        ("repetition_penalty", 0.0, "a finite number > 0"),
        ("presence_penalty", float("inf"), "a finite number"),
        ("frequency_penalty", float("nan"), "a finite number"),
        ("penalty_last_n", -2, "an integer >= -1"),
        ("seed", -1, "None or an integer >= 0"),
        ("seed", 1.0, "None or an integer >= 0"),
    ],
)
def test_sampling_params_refuse_values_out_of_range(field, value, rule):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(f"SamplingParams.{field} = {value!r}: must be {rule}")


@pytest.mark.parametrize("bias", [{0: float("nan")}, {0: float("inf")}, {-1: 1.0}, {"a": 1.0}, {0: "1"}])
def test_sampling_params_refuse_bad_logit_bias(bias):
    with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias\[.*\] = .*: must map a token id"):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={3: float("-inf"), 4: 2}).logit_bias == {3: float("-inf"), 4: 2}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_are_reported_as_such_not_as_filtered_out(bad, temperature):
    """All-NaN logits used to give token 0 (greedy) or "all logits are -inf" (sampling)."""
    x = np.zeros(8, np.float32)
    x[[0, 5]] = bad
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=0))
    with pytest.raises(ValueError, match=r"the logits are not finite: 2 of 8 are NaN or \+inf \(first: token 0") as e:
        sampler(x)
    assert "-inf" not in str(e.value)
    with pytest.raises(ValueError, match="not finite"):
        greedy(np.full(4, np.nan, np.float32))
    with pytest.raises(ValueError, match="not finite"):
        sample_categorical(np.full(4, np.nan), np.random.default_rng(0))
    assert sample_categorical(np.array([-np.inf, 0.0, -np.inf]), np.random.default_rng(0)) == 1  # -inf is fine
