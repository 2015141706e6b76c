"""gpt-oss end to end (issue 13): attention sinks, the attn_output bias, post_attention_norm as the FFN's norm,
alternating sliding-window / full layers and YaRN, on the `gpt_oss_f32` fixture against its llama.cpp golden.
The MoE feed-forward itself is tests/test_moe.py's; the bit-exact golden run is tests/test_conformance.py's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import ggufpy
from conformance import fixtures as fx
from conformance.compare import Reference, bit_differences
from ggufpy import ops
from ggufpy.cli import main
from ggufpy.numerics import NUMERICS, attention_ggml, llamacpp_mode
from ggufpy.quants.x86 import attention as x86

NAME = "gpt_oss_f32"


@pytest.fixture(scope="module")
def path():
    return fx.fixture_path(NAME)


@pytest.fixture(scope="module")
def ref():
    return Reference.load(NAME)


def _sink_reference(q, k, v, start, scale, window, sinks):
    """The sink as an extra key column with a zero value: softmax over [scores, sink], the column dropped."""
    T, H, E = q.shape
    S, G, _ = k.shape
    out = np.zeros((T, H, E))
    for h in range(H):
        g = h // (H // G)
        for t in range(T):
            p = start + t
            seen = [s for s in range(S) if s <= p and (window is None or p - s < window)]
            logits = np.array([q[t, h] @ k[s, g] * scale for s in seen] + [sinks[h]], np.float64)
            e = np.exp(logits - logits.max())
            out[t, h] = (e[:-1] / e.sum()) @ v[seen, g]
    return out.reshape(T, H * E)


@pytest.mark.parametrize("window", [None, 3])
def test_attention_sinks_are_a_value_less_logit_per_head(window):
    rng = np.random.default_rng(0)
    T, S, H, G, E = 4, 7, 4, 2, 8
    q, k, v = rng.standard_normal((T, H, E)), rng.standard_normal((S, G, E)), rng.standard_normal((S, G, E))
    q, k, v = (a.astype(np.float32) for a in (q, k, v))
    sinks = np.array([-1.0, 0.5, 3.0, 8.0], np.float32)  # the last one beats every score: the max is the sink
    want = _sink_reference(q, k, v, S - T, 0.35, window, sinks)
    extra = {} if window is None else {"window": window}
    got = ops.attention(q, k, v, S - T, 0.35, sinks=sinks, **extra)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plain = ops.attention(q, k, v, S - T, 0.35, **extra)
    assert np.abs(got - plain).max() > 0.1  # the sinks take probability mass
    np.testing.assert_array_equal(ops.attention(q, k, v, S - T, 0.35, sinks=np.full(H, -np.inf), **extra), plain)
    # llama.cpp's roundings (f16 Q, K, V and probabilities), generic and replayed on both x86 builds
    for f in (attention_ggml, *(lambda *a, isa=i, **kw: x86.attention(*a, isa=isa, **kw) for i in x86._HSUM)):
        np.testing.assert_allclose(f(q, k, v, S - T, 0.35, sinks=sinks, **extra), want, rtol=0, atol=3e-3)


def test_soft_max_ext_sink_is_ggmls_max_and_libm_expf():
    """ops.cpp soft_max with sinks: max = MAX(max, sink), then sum += (double) expf(sink - max)."""
    rng = np.random.default_rng(1)
    kq = rng.standard_normal((3, 256)).astype(np.float32)
    mask = np.where(np.arange(256) < 40, 0, -np.inf).astype(np.float32)
    for sink in (np.float32(-0.7), np.float32(9.0)):
        got = x86.soft_max_ext(kq, mask, 0.25, "avx2", sink=sink)
        w = kq * np.float32(0.25) + mask
        mx = np.maximum(w.max(-1), sink)
        e, total = x86.vec_soft_max_f32(w, mx, "avx2")
        total = total + np.array([x86._expf(float(sink - m)) for m in mx])
        np.testing.assert_array_equal(got, e * (1.0 / total).astype(np.float32)[:, None])
        assert got.sum(-1).max() < 1  # the sink's share is missing from every row


def test_the_config_and_weights_read_gpt_oss_from_the_file(path):
    model = ggufpy.load(path, backend="numpy", tokenizer=False)
    cfg, w = model.config, model.weights.layers
    assert cfg.arch.name == "gpt-oss" and not cfg.fused_block(0)
    assert [cfg.window(i) for i in range(cfg.n_layers)] == [32, None]  # set_swa_pattern(2): even layers local
    assert cfg.rope_scaling.type == "yarn" and cfg.rope_scaling.orig_ctx == 4096
    assert cfg.rope_ext(0) == cfg.rope_ext(1) is not None  # the same YaRN rotation on both kinds of layer
    assert w[0].attn_sinks.shape == (cfg.n_heads,) and w[0].attn_output_bias.shape == (cfg.dim,)
    with ggufpy.open(path) as f:  # the FFN's pre-norm is the tensor named post_attention_norm
        np.testing.assert_array_equal(w[1].ffn_norm, f.dequantize("blk.1.post_attention_norm.weight"))
    assert w[1].post_attention_norm is None


def _without(model, **fields):
    layers = {i: replace(w, **fields) for i, w in model.weights.layers.items()}
    model.weights = replace(model.weights, layers=layers)
    return model


def test_every_gpt_oss_feature_moves_the_logits_away_from_llamacpp(path, ref):
    """The exact numerics are close to the golden; without the sinks, the output bias or the window, far."""
    tokens = ref.tokens

    def error(model):
        return float(np.abs(model.logits(tokens) - ref.logits.full).max())

    base = error(ggufpy.load(path, backend="numpy", tokenizer=False))
    assert base < 0.1
    for fields in ({"attn_sinks": None}, {"attn_output_bias": None}):
        assert error(_without(ggufpy.load(path, backend="numpy", tokenizer=False), **fields)) > 10 * base, fields
    model = ggufpy.load(path, backend="numpy", tokenizer=False)
    model.config = replace(model.config, sliding_window=None)
    assert error(model) > 10 * base


def test_llamacpp_numerics_are_bit_exact_past_the_window(path, ref):
    """Every l_out, the final norm and the logits equal llama.cpp's over 128 tokens (4 windows)."""
    mode = llamacpp_mode(ref.meta["llama_cpp"]["system_info"])
    model = ggufpy.load(path, backend="numpy", tokenizer=False, numerics=mode)
    assert len(ref.tokens) > 3 * model.config.sliding_window
    diffs = bit_differences(model, ref)
    assert set(diffs) == {"l_out-0", "l_out-1", "result_norm", "result_output"} and not any(diffs.values()), diffs
    no_sinks = bit_differences(_without(model, attn_sinks=None), ref)
    assert no_sinks["l_out-0"] > 0


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_decode_matches_prefill_and_batch_rows_match_single_decodes(path, backend):
    if backend == "numba":
        pytest.importorskip("numba")
    model = ggufpy.load(path, backend=backend, tokenizer=False)
    tokens = np.random.default_rng(5).integers(3, 269, 44)  # past the 32-token window
    full = model.logits(tokens)
    cache = model.new_cache(48)
    steps = [model.forward(tokens[:36], 0, cache)[-1]]
    steps += [model.forward(tokens[i : i + 1], i, cache)[0] for i in range(36, 44)]
    np.testing.assert_allclose(np.stack(steps), full[35:], rtol=1e-4, atol=1e-4)
    prompts = [tokens[:40], tokens[3:10], tokens[:35]]
    caches, singles = [], []
    for p in prompts:
        c1, c2 = model.new_cache(48), model.new_cache(48)
        model.forward(p[:-1], 0, c1)
        model.forward(p[:-1], 0, c2)
        caches.append(c1)
        singles.append(model.forward(p[-1:], len(p) - 1, c2)[0])
    batch = model.decode_batch([p[-1] for p in prompts], [len(p) - 1 for p in prompts], caches)
    np.testing.assert_array_equal(batch, np.stack(singles))


def test_numba_backend_agrees_with_numpy(path):
    pytest.importorskip("numba")
    tokens = np.random.default_rng(6).integers(3, 269, 40)
    numpy_logits = ggufpy.load(path, backend="numpy", tokenizer=False).logits(tokens)
    numba_logits = ggufpy.load(path, backend="numba", tokenizer=False).logits(tokens)
    np.testing.assert_allclose(numba_logits, numpy_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_ggufpy_run_generates(path, backend, capsys):
    if backend == "numba":
        pytest.importorskip("numba")
    argv = ["run", "-m", str(path), "-p", "the cat sat on the mat", "--max-tokens", "6", "--temp", "0"]
    assert main([*argv, "--backend", backend]) == 0
    out = capsys.readouterr().out
    assert out.strip()


def test_llamacpp_numerics_run_on_both_backends(path, ref):
    """The numba backend with the llamacpp numerics runs the replayed attention for the sink layers."""
    pytest.importorskip("numba")
    mode = llamacpp_mode(ref.meta["llama_cpp"]["system_info"])
    model = ggufpy.load(path, backend="numba", tokenizer=False, numerics=mode)
    assert model.numerics is NUMERICS[mode]
    logits = model.logits(ref.tokens[:40])
    np.testing.assert_allclose(logits, ref.logits.full[:40], rtol=0, atol=0.05)


def test_more_heads_than_dim_and_three_layers_are_llamacpps_live(tmp_path):
    """gpt-oss-20b's shape in small: Q wider than dim (64 heads of 64 over 2880 there; 4 of 24 over 32 here), two
    query heads per KV group each with its own sink, local / global / local layers: bit for bit with llama.cpp,
    the greedy continuation too (live: needs llama-cpp-python)."""
    pytest.importorskip("llama_cpp")
    from conformance.compare import greedy
    from conformance.fixtures_moe import GPT_OSS, write_tiny_moe
    from conformance.llamacpp import host_isa
    from conformance.record import fixture_tokens
    from ggufpy.numerics import LLAMACPP_MODES

    spec = replace(GPT_OSS, seed=507, key_length=24, n_heads=4, n_kv_heads=2, sliding_window=20, n_layers=3)
    path = write_tiny_moe(tmp_path / "gpt-oss.gguf", spec)
    ref = Reference.from_llamacpp(path, fixture_tokens(), 16, name="gpt-oss")
    model = ggufpy.load(path, backend="numpy", tokenizer=False, numerics=LLAMACPP_MODES[host_isa()])
    assert model.config.q_dim > model.config.dim and [model.config.window(i) for i in range(3)] == [20, None, 20]
    diffs = bit_differences(model, ref)
    assert len(diffs) == spec.n_layers + 2 and not any(diffs.values()), diffs
    assert greedy(model, ref.tokens, 16) == list(ref.continuation)
