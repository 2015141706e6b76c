"""Three ways (issue 13): ggufpy, llama.cpp and transformers on the same weights (conformance/threeway.py).

Each golden is a tiny transformers model with seeded random weights, converted by llama.cpp's own
convert_hf_to_gguf.py (tests/data/threeway/NAME.gguf), with transformers' logits and llama.cpp's on 48 token ids
(NAME.npz). Without torch, ggufpy is compared with both; with torch and the converter at hand, the live tests
rebuild the whole chain.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from conformance import threeway as tw
from ggufpy.errors import GGUFMetadataError
from ggufpy.numerics import llamacpp_mode

pytestmark = pytest.mark.conformance

NAMES = tw.golden_names()

# What transformers and llama.cpp (and so ggufpy) are known to disagree on, with the evidence in a test below.
# gpt-oss: llama.cpp rounds YaRN's correction range to whole pairs (ggml.c `ggml_rope_yarn_corr_dims`: floorf /
# ceilf); gpt-oss's config says `truncate: false`, and transformers and OpenAI's reference keep it fractional.
YARN_ROUNDED = {"gpt-oss"}
# LongRoPE: transformers picks the short or long factors by the sequence's length, llama.cpp by its context size
# (n_ctx), ggufpy by the model's context length: on a prompt shorter than the original context they part.
FACTORS_BY_LENGTH = {"phi3"}
# Files of llama.cpp's converter that llama.cpp loads and ggufpy refuses (remove an entry once ggufpy reads it):
# phi4: `phi3.attention.sliding_window` 0, written for Phi-4 (`sliding_window` null); schema.py wants >= 1.
# qwen2moe: `ffn_gate_inp_shexp` stored as HF's (1, D) Linear; weights.py wants exactly (D,), where llama.cpp's
# `check_tensor_dims` lets missing dims count as 1.
REFUSED: dict[str, str] = {}  # converted files ggufpy refuses (was: phi4's sliding_window 0, qwen2moe's (1, D))


def _case(name: str):
    marks = []
    if name in REFUSED:
        marks.append(pytest.mark.xfail(raises=GGUFMetadataError, strict=True, reason=REFUSED[name]))
    return pytest.param(name, marks=marks)


def _agreeing(names):
    return [_case(n) for n in names if n not in YARN_ROUNDED]


def _ggufpy(golden: tw.Golden, **kw) -> np.ndarray:
    return tw.ggufpy_logits(golden.path, golden.tokens, **kw)


def test_the_goldens_cover_the_required_architectures():
    assert {"qwen3moe", "gpt-oss", "phi3"} <= set(NAMES)
    for name in NAMES:
        g = tw.load_golden(name)
        assert g.path.stat().st_size <= 300_000 and g.transformers.shape == (tw.N_TOKENS, tw.VOCAB)
        assert g.transformers_short.shape == (tw.N_SHORT, tw.VOCAB)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("name", _agreeing(NAMES))
def test_ggufpy_matches_transformers(name, backend):
    """The exact numerics against the architecture's own implementation: f32 against f32, summation order aside."""
    g = tw.load_golden(name)
    s = tw.stats(_ggufpy(g, backend=backend), g.transformers)
    assert s["nmse"] <= tw.MAX_NMSE and s["max_abs"] <= tw.MAX_ABS and s["top1"] == 1.0, s


@pytest.mark.parametrize("name", [n for n in NAMES if n not in YARN_ROUNDED])
def test_llamacpp_matches_transformers(name):
    """llama.cpp itself, within its f16 KV cache's rounding (NMSE ~1e-7): the converter read the model right."""
    g = tw.load_golden(name)
    s = tw.stats(g.llamacpp, g.transformers)
    assert s["nmse"] <= 1e-6 and s["top1"] == 1.0, s


@pytest.mark.parametrize("name", [_case(n) for n in NAMES])
def test_llamacpp_numerics_are_bit_exact_on_converted_files(name):
    """The converter's files (not the fixtures' writer): ggufpy's replay of the recording build, bit for bit."""
    g = tw.load_golden(name)
    ours = _ggufpy(g, numerics=llamacpp_mode(g.versions["llamacpp"]["system_info"]))
    assert np.array_equal(ours, g.llamacpp), tw.stats(ours, g.llamacpp)


@pytest.mark.parametrize("name", [_case(n) for n in NAMES if n not in FACTORS_BY_LENGTH | YARN_ROUNDED])
def test_ggufpy_matches_transformers_on_a_short_prompt(name):
    """The first N_SHORT tokens alone: what a causal model computes for them does not depend on what follows."""
    g = tw.load_golden(name)
    s = tw.stats(tw.ggufpy_logits(g.path, g.tokens[: tw.N_SHORT]), g.transformers_short)
    assert s["nmse"] <= tw.MAX_NMSE and s["max_abs"] <= tw.MAX_ABS, s


@pytest.mark.parametrize("name", sorted(FACTORS_BY_LENGTH & set(NAMES)))
def test_longrope_factors_follow_the_context_not_the_prompt(name, monkeypatch):
    """phi3's original context is 32: transformers runs the 24-token prompt with the short factors, ggufpy (like
    llama.cpp at n_ctx 512) with the long ones; told to take the short ones, ggufpy agrees with transformers."""
    g = tw.load_golden(name)
    short = g.tokens[: tw.N_SHORT]
    assert tw.stats(tw.ggufpy_logits(g.path, short), g.transformers_short)["nmse"] > 1e-6
    monkeypatch.setattr("ggufpy.config.ModelConfig.long_factors", lambda self: False)
    s = tw.stats(tw.ggufpy_logits(g.path, short), g.transformers_short)
    assert s["nmse"] <= tw.MAX_NMSE and s["max_abs"] <= tw.MAX_ABS, s


@pytest.mark.parametrize("name", sorted(YARN_ROUNDED & set(NAMES)))
def test_yarn_rounding_is_the_whole_gpt_oss_difference(name, monkeypatch):
    """ggufpy follows llama.cpp and both part from transformers by NMSE ~2e-5; with the correction range left
    fractional (transformers' `truncate: false`) ggufpy agrees with transformers like every other case."""
    g = tw.load_golden(name)
    rounded = tw.stats(_ggufpy(g), g.transformers)
    assert 1e-6 < rounded["nmse"] < 1e-3, rounded
    assert 1e-6 < tw.stats(g.llamacpp, g.transformers)["nmse"] < 1e-3

    def fractional(rope_dim, orig_ctx, theta, beta_fast, beta_slow):
        def dim(n_rot):
            return rope_dim * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

        return max(0.0, dim(beta_fast)), min(rope_dim - 1.0, dim(beta_slow))

    monkeypatch.setattr("ggufpy.config.yarn_corr_dims", fractional)
    s = tw.stats(_ggufpy(g), g.transformers)
    assert s["nmse"] <= tw.MAX_NMSE and s["max_abs"] <= tw.MAX_ABS, s


# -- live: the whole chain, when torch and the converter are here ---------------------------------------------
def _live_skip() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "needs torch (pip install 'ggufpy[threeway]')"
    if tw.converter_dir(fetch=False) is None:
        return f"needs the converter in {tw.CONVERTER_CACHE} (python -m conformance.threeway fetches it)"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_live_rebuild_reproduces_the_golden(name, tmp_path):
    """Same seed, same converter: the same GGUF bytes and the same transformers logits as recorded."""
    if (why := _live_skip()) is not None:
        pytest.skip(why)
    result, path = tw.run_live(name, tmp_path, tw.converter_dir(fetch=False))
    g = tw.load_golden(name)
    assert path.read_bytes() == g.path.read_bytes()
    assert tw.stats(result.transformers, g.transformers)["nmse"] <= 1e-12
