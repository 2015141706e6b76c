"""glm4moe (issue 13, GLM-4.5 / 4.5-Air / 4.6): the attention block with partial neox RoPE, Q/K/V biases and optional
Q/K norms, deepseek2's routing (sigmoid by default) with a shared expert and leading dense layers, and the MTP
blocks at the end of the file, which llama.cpp loads and never runs.

The bit-exact comparison with llama.cpp is the conformance golden `glm4moe_f32` (tests/test_conformance.py); here:
the config and its strictness, the routing steps, the MTP block skipped, the 4.5-Air layout (no Q/K norms) against
llama.cpp live, and the transformer's laws (incremental decode, batch rows, shards, both backends) on the fixture.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import ggufpy
from conformance import fixtures as fx
from conformance.fixtures_glm4moe import GLM4MOE, write_tiny_glm4moe
from ggufpy import moe
from ggufpy.config import config_from_metadata
from ggufpy.errors import GGUFMetadataError, GGUFUnsupportedError

NAME = "glm4moe_f32"
PATH = fx.fixture_path(NAME)


@pytest.fixture(scope="module")
def model():
    return ggufpy.load(PATH, backend="numpy", tokenizer=False)


@pytest.fixture(scope="module")
def metadata():
    with ggufpy.open(PATH) as f:
        return dict(f.metadata), f.tensors["token_embd.weight"].shape[0]


def fx_tokens() -> np.ndarray:
    from conformance.record import fixture_tokens

    return fixture_tokens()


# -- config ------------------------------------------------------------------------------------------------------


def test_config_reads_the_block_and_routing_hparams(model):
    cfg = model.config
    assert (cfg.n_layers, cfg.nextn_layers) == (3, 1)  # block_count 4: the last one is the MTP block
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim) == (4, 2, 16, 8)  # RoPE on half of each head
    assert cfg.arch.rope_style == "neox" and cfg.arch.ffn_norm_name == "post_attention_norm"
    assert cfg.leading_dense == 1 and [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_hidden_dim, cfg.shared_hidden_dim) == (8, 3, 8, 8)
    r = cfg.routing
    assert (r.gating, r.norm_weights, r.weights_scale, r.groups) == ("sigmoid_probs", True, 2.5, 0)
    w = model.weights.layers[1]
    assert w.ffn_exp_probs_b.shape == (8,) and w.attn_q_bias.shape == (64,) and w.attn_k_norm.shape == (16,)
    assert model.weights.layers[0].ffn_gate is not None and model.weights.layers[0].ffn_gate_inp is None


@pytest.mark.parametrize(
    "change, words",
    [
        ({"glm4moe.nextn_predict_layers": 4}, "must be < glm4moe.block_count = 4"),
        ({"glm4moe.expert_gating_func": 4}, "sqrt_softplus"),
        ({"glm4moe.leading_dense_block_count": 4}, "<= block_count = 3"),  # 3 blocks run, the MTP one aside
        ({"glm4moe.expert_shared_count": None}, "expert_shared_count is required"),
        ({"glm4moe.expert_count": None}, "expert_count is required"),
        ({"glm4moe.expert_used_count": 9}, "must be <= expert_count = 8"),
        ({"glm4moe.rope.dimension_count": 18}, "must be even and <= the head size 16"),
        ({"glm4moe.attention.head_count_kv": 3}, "must divide glm4moe.attention.head_count = 4"),
    ],
)
def test_config_refuses_inconsistent_hparams(metadata, change, words):
    md, vocab = metadata
    md = {k: v for k, v in {**md, **change}.items() if v is not None}
    with pytest.raises(GGUFMetadataError) as info:
        config_from_metadata(md, vocab, source="glm.gguf")
    assert words in str(info.value) and "glm.gguf" in str(info.value)


def test_unset_gating_func_means_sigmoid_and_the_key_still_rules(metadata):
    """glm4moe's loader falls back to sigmoid where deepseek2's falls back to softmax (the fixture has no key;
    deepseek2's fallback: tests/test_deepseek2.py)."""
    md, vocab = metadata
    assert "glm4moe.expert_gating_func" not in md
    assert config_from_metadata(md, vocab).routing.gating == "sigmoid_probs"
    assert config_from_metadata({**md, "glm4moe.expert_gating_func": 1}, vocab).routing.gating == "softmax"


# -- routing -----------------------------------------------------------------------------------------------------


def test_the_fixture_routes_on_the_biased_sigmoid_and_weights_sum_to_the_scale(model):
    """On the fixture's own router inputs: exp_probs_b changes some tokens' experts (the golden would catch it
    missing), and the chosen weights are the unbiased sigmoids normed to sum 1, times 2.5."""
    trace = {}
    tokens = np.asarray(fx_tokens(), np.int64)
    model.forward(tokens, 0, model.new_cache(len(tokens)), trace=trace)
    rule, changed = model.config.routing, 0
    for i in (1, 2):
        w = model.weights.layers[i]
        logits = model.backend.linear(trace[f"ffn_norm-{i}"], w.ffn_gate_inp)  # (T, X)
        chosen, weights = moe.route(logits, rule, 3, moe.softmax_exact, probs_bias=w.ffn_exp_probs_b)
        plain, _ = moe.route(logits, rule, 3, moe.softmax_exact)
        changed += int((np.sort(chosen, 1) != np.sort(plain, 1)).any(1).sum())
        np.testing.assert_allclose(weights.sum(1), 2.5, rtol=1e-5)
        p = 1 / (1 + np.exp(-np.take_along_axis(logits.astype(np.float64), chosen, 1)))
        np.testing.assert_allclose(weights, 2.5 * p / p.sum(1, keepdims=True), rtol=1e-5)
    assert changed > 0


# -- the MTP block ---------------------------------------------------------------------------------------------------


def test_the_mtp_block_is_never_run(model, tmp_path):
    """Only blocks 0-2 are loaded (llama.cpp's golden has l_out-0..2 only), and the same file with the MTP block's
    weights 100 times larger (the same random draws) gives the same logits bit for bit."""
    assert sorted(model.weights.layers) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"within 0\.\.3"):
        ggufpy.load(PATH, backend="numpy", tokenizer=False, layers=range(0, 4))
    loud = ggufpy.load(
        write_tiny_glm4moe(tmp_path / "loud.gguf", replace(GLM4MOE, nextn_scale=100.0)),
        backend="numpy",
        tokenizer=False,
    )
    tokens = fx_tokens()[:24]
    np.testing.assert_array_equal(loud.logits(tokens), model.logits(tokens))


# -- GLM-4.5-Air: no Q/K norms -----------------------------------------------------------------------------------


AIR = replace(GLM4MOE, seed=541, qk_norm=False, weights_scale=1.0, gating_func=2)


def test_the_air_layout_without_qk_norms_is_llamacpps_live(tmp_path):
    """GLM-4.5-Air has no attn_q_norm / attn_k_norm (llama.cpp: TENSOR_NOT_REQUIRED), routed_scaling_factor 1 and,
    here, expert_gating_func written: bit for bit with llama.cpp at every layer and in the greedy tokens (live)."""
    pytest.importorskip("llama_cpp")
    from conformance.compare import Reference, bit_differences, greedy
    from conformance.llamacpp import host_isa
    from ggufpy.numerics import LLAMACPP_MODES

    path = write_tiny_glm4moe(tmp_path / "air.gguf", AIR)
    ref = Reference.from_llamacpp(path, fx_tokens(), 16, name="air")
    model = ggufpy.load(path, backend="numpy", tokenizer=False, numerics=LLAMACPP_MODES[host_isa()])
    assert model.weights.layers[1].attn_q_norm is None and model.config.routing.weights_scale == 1.0
    diffs = bit_differences(model, ref)
    assert set(diffs) == {"l_out-0", "l_out-1", "l_out-2", "result_norm", "result_output"}, diffs
    assert not any(diffs.values()), diffs
    assert greedy(model, ref.tokens, 16) == list(ref.continuation)


def test_the_air_layout_loads_without_qk_norms(tmp_path):
    path = write_tiny_glm4moe(tmp_path / "air.gguf", AIR)
    model = ggufpy.load(path, backend="numpy", tokenizer=False)
    assert all(w.attn_q_norm is None and w.attn_k_norm is None for w in model.weights.layers.values())
    assert np.isfinite(model.logits(fx_tokens()[:8])).all()


# -- the transformer's laws ----------------------------------------------------------------------------------------


def test_incremental_decode_equals_prefill(model):
    tokens = fx_tokens()[:24]
    full = model.logits(tokens)
    cache = model.new_cache(24)
    steps = [model.forward(tokens[:16], 0, cache)[-1]]
    steps += [model.forward(tokens[i : i + 1], i, cache)[0] for i in range(16, 24)]
    np.testing.assert_allclose(np.stack(steps), full[15:], rtol=1e-4, atol=1e-4)


def test_decode_batch_rows_equal_single_decodes():
    m = ggufpy.load(PATH, backend="numpy", tokenizer=False, numerics="llamacpp-avx2")
    prompts = [[5, 9, 40], [100, 3], [7, 8, 9, 10]]
    caches, singles = [], []
    for p in prompts:
        c1, c2 = m.new_cache(16), m.new_cache(16)
        m.forward(np.array(p[:-1]), 0, c1)
        m.forward(np.array(p[:-1]), 0, c2)
        caches.append(c1)
        singles.append(m.forward(np.array(p[-1:]), len(p) - 1, c2)[0])
    batch = m.decode_batch([p[-1] for p in prompts], [len(p) - 1 for p in prompts], caches)
    np.testing.assert_array_equal(batch, np.stack(singles))


def test_shards_equal_the_whole_model(model):
    tokens = fx_tokens()[:20]
    whole = model.logits(tokens)
    first, second = model.new_cache(20, layers=range(0, 2)), model.new_cache(20, layers=range(2, 3))
    h = model.forward(tokens, 0, first, layers=range(0, 2))
    np.testing.assert_array_equal(model.forward(h, 0, second, layers=range(2, 3)), whole)


def test_numba_backend_agrees_with_numpy(model):
    pytest.importorskip("numba")
    tokens = fx_tokens()[:40]
    numba_logits = ggufpy.load(PATH, backend="numba", tokenizer=False).logits(tokens)
    np.testing.assert_allclose(numba_logits, model.logits(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_ggufpy_run_generates_the_greedy_tokens(backend, capsys):
    if backend == "numba":
        pytest.importorskip("numba")
    from ggufpy.cli import main

    # "on the": six greedy tokens before any <|im_end|> (which ends the run)
    code = main(["run", "-m", str(PATH), "--backend", backend, "-p", "on the", "-n", "6", "--temp", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    ref = ggufpy.load(PATH, backend="numpy")
    ids = ref.tokenizer.encode("on the")
    cache = ref.new_cache(32)
    logits, greedy = ref.forward(np.array(ids), 0, cache)[-1], []
    for i in range(6):
        greedy.append(int(np.argmax(logits)))
        logits = ref.forward(np.array(greedy[-1:]), len(ids) + i, cache)[0]
    assert ref.tokenizer.decode(greedy) in out


def test_multi_section_rope_is_refused(metadata):
    """GLM-4.5V's M-RoPE (`rope.dimension_sections`) is ggml_rope_multi in llama.cpp: refused, not run as plain RoPE."""
    md, vocab = metadata
    with pytest.raises(GGUFUnsupportedError, match=r"glm4moe\.rope\.dimension_sections = \[8, 12, 12, 0\]"):
        config_from_metadata({**md, "glm4moe.rope.dimension_sections": [8, 12, 12, 0]}, vocab, "glm.gguf")
    config_from_metadata({**md, "glm4moe.rope.dimension_sections": [0, 0, 0, 0]}, vocab, "glm.gguf")  # none: plain
