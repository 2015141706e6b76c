"""The compiled replays of llama.cpp's x86 attention and SiLU (`ggufpy.kernels.x86`) against the NumPy replays
they compile (`ggufpy.quants.x86`, themselves bit for bit with llama.cpp: tests/test_x86_*.py): equal bit for
bit on both builds, every kernel path (tinyBLAS and vec_dot, their leftovers, windows, GQA, an f16 cache), and
the numba backend's llamacpp numerics running them.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy import kernels
from ggufpy.numerics import NUMERICS
from ggufpy.quants.x86 import attention as replay
from ggufpy.quants.x86.unary import silu_rows as silu_replay

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"numba unavailable: {kernels.IMPORT_ERROR}")

if kernels.AVAILABLE:
    from ggufpy.kernels import x86
    from ggufpy.kernels._numba import DISABLED
    from ggufpy.kernels.backend import NumbaBackend
else:
    DISABLED = True

SETTINGS = settings(max_examples=4 if DISABLED else 30, deadline=None, suppress_health_check=list(HealthCheck))
ISAS = ["avx2", "avx512"]


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert not differ.any(), f"{differ.sum()} of {differ.size} differ, max |diff| {np.abs(got - want).max()}"


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1), n=st.sampled_from([1, 7, 8, 16, 23, 64, 576]), scale=st.sampled_from([1, 10, 60])
)
def test_silu_rows_is_the_replay(isa, seed, n, scale):
    x = (np.random.default_rng(seed).standard_normal((3, n)) * scale).astype(np.float32)
    assert_bitwise(x86.silu_rows(x, isa), silu_replay(x, isa))


def test_expf_array_is_the_c_librarys_expf():
    """The compiled expf the MoE feed-forward takes (swiglu_oai, sigmoid gates) is libm's, element by element."""
    from ggufpy.kernels.glue_ggml import expf_array
    from ggufpy.numerics import libm_expf

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((40, 501)) * 40).astype(np.float32)
    x[0, :9] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 88.72, 88.73, -103.9, -150.0]
    got, want = expf_array(x), libm_expf(x)
    assert got.shape == want.shape == x.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("isa", ISAS)
def test_silu_rows_special_values(isa):
    x = np.array(
        [[np.inf, -np.inf, np.nan, 0.0, -0.0, 88.8, -88.8, -104.0, 1e-40, -1e-40, 3e38, -3e38] * 3], np.float32
    )
    with np.errstate(all="ignore"):
        got, want = x86.silu_rows(x, isa), silu_replay(x, isa)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert_bitwise(np.nan_to_num(got), np.nan_to_num(want))


# (T, S, H, G, E, window): decode (vec_dot) and prefill (tinyBLAS); E not a multiple of the lanes (tinyBLAS
# declines, vec_dot's leftovers in double); S past 256 and 512 (n_kv padding), GQA and MHA, a sliding window.
SHAPES = [
    (1, 37, 4, 2, 64, None),
    (1, 600, 4, 1, 40, 50),
    (1, 300, 2, 2, 72, None),
    (2, 2, 2, 1, 8, None),
    (7, 300, 6, 2, 64, None),
    (16, 16, 9, 3, 48, None),
    (5, 600, 4, 4, 256, 100),
    (3, 20, 2, 1, 72, None),
    (4, 520, 2, 1, 24, None),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES if not DISABLED else SHAPES[:2], ids=str)
@pytest.mark.parametrize("f16_cache", [False, True])
def test_attention_is_the_replay(isa, shape, f16_cache):
    T, S, H, G, E, window = shape
    rng = np.random.default_rng(S * 31 + T)
    q = (rng.standard_normal((T, H, E)) * 2).astype(np.float32)
    k, v = ((rng.standard_normal((S, G, E)) * 2).astype(np.float32) for _ in range(2))
    if f16_cache:  # llama.cpp numerics' KV cache holds f16: read as stored
        k, v = k.astype(np.float16), v.astype(np.float16)
    scale = np.float32(1) / np.sqrt(np.float32(E))
    want = replay.attention(q, k, v, S - T, scale, window, isa=isa)
    for threads in (1, 2):
        assert_bitwise(x86.attention(q, k, v, S - T, scale, window, isa=isa, threads=threads), want)


@pytest.mark.parametrize("mode", ["llamacpp", "llamacpp-avx2"])
@pytest.mark.parametrize("T", [1, 5])
def test_backend_runs_the_compiled_replay(mode, T):
    """The numba backend's attention and SiLU in the llamacpp numerics are the numerics' own, bit for bit."""
    rng = np.random.default_rng(T)
    q = rng.standard_normal((T, 6, 32)).astype(np.float32)
    k, v = (rng.standard_normal((9, 2, 32)).astype(np.float16) for _ in range(2))
    nm = NUMERICS[mode]
    backend = NumbaBackend(nm)
    assert_bitwise(backend.attention(q, k, v, 9 - T, 0.25, window=4), nm.attention(q, k, v, 9 - T, 0.25, window=4))
    silu = nm.activations["silu"]
    x = rng.standard_normal((T, 100)).astype(np.float32) * 8
    assert_bitwise(backend.compiled[silu](x), silu(x))


# gpt-oss's sinks (`ggml_soft_max_add_sinks`): one logit per query head in the softmax's max and sum. Decode and
# prefill, a sliding window and none, GQA; the sinks span below, among and above the scores (above: the sink is
# the max and each exp is taken against it).
SINK_SHAPES = [
    (1, 37, 4, 2, 64, None),
    (1, 600, 8, 2, 64, 128),
    (1, 300, 2, 2, 72, None),
    (7, 300, 8, 2, 64, 128),
    (16, 16, 9, 3, 48, None),
    (5, 600, 4, 4, 64, 100),
]


def _sinks(rng, H: int) -> np.ndarray:
    sinks = (rng.standard_normal(H) * 4).astype(np.float32)
    sinks[0], sinks[-1] = 60.0, -60.0  # a sink far above every score, one whose exp vanishes
    return sinks


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SINK_SHAPES if not DISABLED else SINK_SHAPES[:2], ids=str)
@pytest.mark.parametrize("f16_cache", [False, True])
def test_attention_with_sinks_is_the_replay(isa, shape, f16_cache):
    T, S, H, G, E, window = shape
    rng = np.random.default_rng(S * 17 + T)
    q = (rng.standard_normal((T, H, E)) * 2).astype(np.float32)
    k, v = ((rng.standard_normal((S, G, E)) * 2).astype(np.float32) for _ in range(2))
    if f16_cache:
        k, v = k.astype(np.float16), v.astype(np.float16)
    sinks = _sinks(rng, H)
    scale = np.float32(1) / np.sqrt(np.float32(E))
    want = replay.attention(q, k, v, S - T, scale, window, isa=isa, sinks=sinks)
    assert not np.array_equal(want, replay.attention(q, k, v, S - T, scale, window, isa=isa))  # the sinks count
    for threads in (1, 2):
        assert_bitwise(x86.attention(q, k, v, S - T, scale, window, isa=isa, threads=threads, sinks=sinks), want)


@pytest.mark.parametrize("mode", ["llamacpp", "llamacpp-avx2", "exact"])
@pytest.mark.parametrize("T", [1, 5])
def test_backend_attention_with_sinks(mode, T):
    """Sinks reach the backend's attention: the compiled replay in the llamacpp numerics, the numerics' own
    function where the f32 kernel does not know them; bit for bit the numerics' attention either way."""
    rng = np.random.default_rng(T + 7)
    q = rng.standard_normal((T, 6, 32)).astype(np.float32)
    k, v = (rng.standard_normal((9, 2, 32)).astype(np.float16) for _ in range(2))
    if mode == "exact":
        k, v = k.astype(np.float32), v.astype(np.float32)
    sinks = _sinks(rng, 6)
    nm = NUMERICS[mode]
    got = NumbaBackend(nm).attention(q, k, v, 9 - T, 0.25, window=4, sinks=sinks)
    assert_bitwise(got, nm.attention(q, k, v, 9 - T, 0.25, window=4, sinks=sinks))


@pytest.mark.parametrize("mode", ["llamacpp", "llamacpp-avx2"])
def test_gpt_oss_sink_layers_run_the_compiled_replay(mode, monkeypatch):
    """gpt-oss on the numba backend (`gpt_oss_f32` fixture, sinks on every layer, sliding and full): its attention
    reaches the compiled replay with the sinks, prefill and decode, and the logits are those of the NumPy replay."""
    import ggufpy
    from conformance import fixtures as fx

    model = ggufpy.load(fx.fixture_path("gpt_oss_f32"), backend="numba", tokenizer=False, numerics=mode)
    tokens = np.arange(1, 49) * 5 % model.config.vocab_size

    def run() -> np.ndarray:
        cache = model.new_cache(capacity=len(tokens))
        logits = [model.forward(tokens[:40], 0, cache)]
        logits += [model.forward(tokens[i : i + 1], i, cache) for i in range(40, len(tokens))]
        return np.concatenate(logits)

    compiled, calls = x86.attention, []

    def counted(q, k, v, start, scale, window=None, isa="avx512", threads=None, sinks=None):
        calls.append(sinks is not None)
        return compiled(q, k, v, start, scale, window, isa, threads, sinks)

    monkeypatch.setattr(x86, "attention", counted)
    got = run()
    assert len(calls) == model.config.n_layers * (1 + 8) and all(calls)

    def replayed(q, k, v, start, scale, window=None, isa="avx512", threads=None, sinks=None):
        return replay.attention(q, k, v, start, scale, window, isa=isa, sinks=sinks)

    monkeypatch.setattr(x86, "attention", replayed)
    assert_bitwise(got, run())
