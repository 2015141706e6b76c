"""deepseek2 (issue 13): multi-head latent attention and DeepSeek's routed + shared experts, wired into Model.

The bit-exact comparison with llama.cpp is the conformance golden `deepseek2_f32` (tests/test_conformance.py);
here: the config and its strictness, the router's steps, the two attention layouts agreeing, the latent K-only
cache, and the transformer's laws (incremental decode, batch rows, shards) on the fixture.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import ggufpy
from conformance import fixtures as fx
from conformance.compare import Reference, bit_differences, greedy
from conformance.fixtures_deepseek import DEEPSEEK2_KV_B, write_tiny_deepseek2
from ggufpy import moe
from ggufpy.arch import MoE
from ggufpy.config import config_from_metadata
from ggufpy.errors import GGUFMetadataError, GGUFUnsupportedError
from ggufpy.numerics import llamacpp_mode

NAME = "deepseek2_f32"
PATH = fx.fixture_path(NAME)


@pytest.fixture(scope="module")
def model():
    return ggufpy.load(PATH, backend="numpy", tokenizer=False)


@pytest.fixture(scope="module")
def metadata():
    with ggufpy.open(PATH) as f:
        return dict(f.metadata), f.tensors["token_embd.weight"].shape[0]


# -- config ------------------------------------------------------------------------------------------------------


def test_config_reads_the_mla_and_routing_hparams(model):
    cfg = model.config
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.key_dim, m.value_dim, m.rope_dim) == (16, 16, 16, 8, 8)
    assert m.absorbed and m.nope_dim == 8
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.value_dim) == (1, 16 + 8, 0)  # the latent cache row, keys only
    assert cfg.leading_dense == 1 and [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_hidden_dim, cfg.shared_hidden_dim) == (8, 3, 8, 2 * 8)
    r = cfg.routing
    assert (r.gating, r.norm_weights, r.weights_scale, r.groups, r.groups_used) == ("sigmoid_probs", True, 2.5, 4, 2)
    assert r.probs_bias and model.weights.layers[1].ffn_exp_probs_b.shape == (8,)


def test_yarn_log_multiplier_is_divided_by_point_one_for_deepseek2(model):
    """[TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: the file's 0.0707 is mscale_all_dim 0.707 (the loader's / 0.1f). With
    mscale == mscale_all_dim the context's attention factor is 1 / (1 + 0.1 ln 4), and the KQ scale gets
    (1 + 0.1 * 0.707 * ln 4)^2 / sqrt(Dn + Dr). Read undivided, the scale would be (1 + 0.00707 ln 4)^2 / 4."""
    s = model.config.rope_scaling
    assert s.log_mul == pytest.approx(0.707, rel=1e-6)
    assert s.attn_factor == pytest.approx(1 / (1 + 0.1 * math.log(4)), rel=1e-6)
    assert model.config.mla.kq_scale == pytest.approx((1 + 0.1 * 0.707 * math.log(4)) ** 2 / 4, rel=1e-6)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"deepseek2.attention.value_length_mla": None}, GGUFMetadataError, "value_length_mla"),
        ({"deepseek2.attention.head_count_kv": 4}, GGUFMetadataError, "must be 1"),
        ({"deepseek2.attention.key_length": 20}, GGUFMetadataError, "kv_lora_rank + rope dims = 24"),
        ({"deepseek2.attention.key_length_mla": 8}, GGUFMetadataError, "must exceed the 8 rotated dims"),
        ({"deepseek2.attention.kv_lora_rank": None}, GGUFMetadataError, "kv_lora_rank is required"),
        ({"deepseek2.expert_gating_func": 4}, GGUFMetadataError, "sqrt_softplus"),
        ({"deepseek2.expert_group_count": 3}, GGUFMetadataError, "must divide expert_count = 8"),
        ({"deepseek2.expert_group_used_count": 4}, GGUFMetadataError, "[1, expert_group_count = 4)"),
        ({"deepseek2.leading_dense_block_count": 4}, GGUFMetadataError, "<= block_count = 3"),
        ({"deepseek2.expert_shared_count": None}, GGUFMetadataError, "expert_shared_count is required"),
        ({"deepseek2.attention.temperature_scale": 0.1}, GGUFUnsupportedError, "temperature_scale"),
    ],
)
def test_config_refuses_inconsistent_hparams(metadata, change, error, words):
    md, vocab = metadata
    md = {**md, **change}
    md = {k: v for k, v in md.items() if v is not None}
    with pytest.raises(error) as info:
        config_from_metadata(md, vocab, source="ds.gguf")
    assert words in str(info.value) and "ds.gguf" in str(info.value)


def test_gating_func_zero_means_softmax(metadata):
    """DeepSeek V2 files predate expert_gating_func: llama.cpp's loader falls back to softmax."""
    md, vocab = metadata
    md = {k: v for k, v in md.items() if k != "deepseek2.expert_gating_func"}
    assert config_from_metadata(md, vocab).routing.gating == "softmax"


# -- routing -----------------------------------------------------------------------------------------------------


def test_sigmoid_routing_chooses_on_the_biased_scores_and_weights_by_the_unbiased():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 5.0], np.float32)
    rule = MoE(gating="sigmoid_probs", norm_weights=True, weights_scale=2.5)
    chosen, weights = moe.route(logits, rule, 2, moe.softmax_exact, probs_bias=bias)
    np.testing.assert_array_equal(chosen, [[3, 0]])
    p = 1 / (1 + np.exp(-np.array([-1.0, 2.0])))
    np.testing.assert_allclose(weights, [p / p.sum() * 2.5], rtol=1e-6)
    chosen, _ = moe.route(logits, rule, 2, moe.softmax_exact)  # without the bias: the two largest
    np.testing.assert_array_equal(chosen, [[0, 1]])


def test_expert_groups_keep_the_groups_with_the_best_two_scores():
    """Groups of 2: sums 0.95, 1.0, 0.8, 0.6. The best two groups are 1 and 0, so expert 4 (0.8, the second best
    score) is out and the top 3 are experts 0, 2, 3."""
    scores = np.array([[0.9, 0.05, 0.5, 0.5, 0.8, 0.0, 0.3, 0.3]], np.float32)
    masked = moe.best_groups(scores, 4, 2)
    np.testing.assert_array_equal(masked[0, :4], scores[0, :4])
    assert np.isneginf(masked[0, 4:]).all()
    chosen, _ = moe.route(scores, MoE(gating="softmax_weight", groups=4, groups_used=2), 3, moe.softmax_exact)
    np.testing.assert_array_equal(np.sort(chosen), [[0, 2, 3]])


def test_the_fixture_exercises_the_bias_and_the_groups(model):
    """On the fixture's own router inputs, the selection bias and the group limit each change some tokens'
    experts: the golden would catch either one missing."""
    trace = {}
    tokens = np.asarray(fx_tokens(), np.int64)
    model.forward(tokens, 0, model.new_cache(len(tokens)), trace=trace)
    rule, changed = model.config.routing, {"bias": 0, "groups": 0}
    for i in (1, 2):
        w = model.weights.layers[i]
        logits = model.backend.linear(trace[f"ffn_norm-{i}"], w.ffn_gate_inp)
        base, _ = moe.route(logits, rule, 3, moe.softmax_exact, probs_bias=w.ffn_exp_probs_b)
        for what, (r, b) in {"bias": (rule, None), "groups": (replace(rule, groups=0), w.ffn_exp_probs_b)}.items():
            other, _ = moe.route(logits, r, 3, moe.softmax_exact, probs_bias=b)
            changed[what] += int((np.sort(base, 1) != np.sort(other, 1)).any(1).sum())
    assert changed["bias"] > 0 and changed["groups"] > 0, changed


def fx_tokens() -> np.ndarray:
    from conformance.record import fixture_tokens

    return fixture_tokens()


# -- the attention and its cache -----------------------------------------------------------------------------------


def test_the_cache_holds_the_latent_rows_only(model):
    cache = model.new_cache(32)
    assert cache.k[0].shape == (32, 1, 16 + 8) and cache.v[0].shape == (32, 1, 0)
    assert cache.nbytes == 3 * 32 * 24 * 4  # f32 in exact numerics: no V cache at all
    model.forward(np.arange(3, 13), 0, cache)
    grown = cache.resized(64)
    assert grown.v[0].shape == (64, 1, 0) and np.array_equal(grown.k[2][:10], cache.k[2][:10])


def test_the_single_attn_kv_b_layout_gives_the_same_model(model, tmp_path):
    """The older files' attn_kv_b (decompressed heads, a per-head cache of Dn + Dr keys and Dv values) and the
    split attn_k_b / attn_v_b (the latent cache) hold the same weights: the same logits up to rounding."""
    path = write_tiny_deepseek2(tmp_path / "kv_b.gguf", DEEPSEEK2_KV_B)
    old = ggufpy.load(path, backend="numpy", tokenizer=False)
    assert not old.config.mla.absorbed and old.config.value_dim == 8
    cache = old.new_cache(40)
    assert cache.k[0].shape == (40, 4, 16) and cache.v[0].shape == (40, 4, 8)
    tokens = fx_tokens()[:40]
    a, b = model.logits(tokens), old.logits(tokens)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    assert np.abs(a).max() > 4  # not trivially small logits


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


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_ggufpy_run_generates_the_greedy_tokens(backend, capsys):
    """Both backends (numba's products; the MLA mixer's attention and routing are the NumPy reference's)."""
    if backend == "numba":
        pytest.importorskip("numba")
    from ggufpy.cli import main

    code = main(["run", "-m", str(PATH), "--backend", backend, "-p", "the", "-n", "6", "--temp", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    ref = ggufpy.load(PATH, backend="numpy")
    ids = ref.tokenizer.encode("the")
    cache = ref.new_cache(32)
    logits, greedy = ref.forward(np.array(ids), 0, cache)[-1], []
    for i in range(6):
        greedy.append(int(np.argmax(logits)))
        logits = ref.forward(np.array(greedy[-1:]), len(ids) + i, cache)[0]
    assert ref.tokenizer.decode(greedy) in out


# the older layout's golden, small (32 tokens, 4 greedy ones): the conformance catalogue holds one fixture per
# architecture, and this one is written from its spec by the test (tests/data/deepseek2/manifest.json has its sha256)
KV_B_DIR = Path(__file__).parent / "data" / "deepseek2"
KV_B_SPEC = replace(DEEPSEEK2_KV_B, seed=532)


def record_kv_b_golden(path: Path, directory: Path) -> Reference:
    """llama.cpp on the attn_kv_b fixture at `path`: its logits, l_out-N, result_norm and greedy tokens, saved in
    `directory` as a `Reference` named kv_b."""
    from conformance.llamacpp import versions

    ref = Reference.from_llamacpp(path, fx_tokens()[:32], 4, name="kv_b")
    directory.mkdir(parents=True, exist_ok=True)
    ref.save(directory / "kv_b.npz")
    meta = {"file": "kv_b.npz", "sha256": fx.sha256(path), "n_tokens": 32, "llama_cpp": versions()}
    (directory / "manifest.json").write_text(json.dumps({"kv_b": meta}, indent=1) + "\n")
    return Reference.load("kv_b", directory)


def test_the_kv_b_layout_is_bit_exact_with_llamacpps_golden(tmp_path):
    """llama.cpp 0.3.36 still loads attn_kv_b files (its non-MLA path, an MHA cache): the llamacpp numerics of the
    build that recorded the golden equal it bit for bit at every layer, in the logits and the greedy tokens."""
    ref = Reference.load("kv_b", KV_B_DIR)
    path = write_tiny_deepseek2(tmp_path / "kv_b.gguf", KV_B_SPEC)
    assert fx.sha256(path) == ref.meta["sha256"]
    m = ggufpy.load(
        path, backend="numpy", tokenizer=False, numerics=llamacpp_mode(ref.meta["llama_cpp"]["system_info"])
    )
    diffs = bit_differences(m, ref)
    assert set(diffs) >= {"l_out-0", "l_out-2", "result_norm", "result_output"}
    assert not any(diffs.values()), diffs
    assert greedy(m, ref.tokens, len(ref.continuation)) == ref.continuation.tolist()


def test_the_kv_b_golden_is_llamacpps(tmp_path):
    """The committed golden is what the installed llama.cpp computes (live; skips without it, or on another build)."""
    from conformance import llamacpp

    if not llamacpp.available():
        pytest.skip("llama-cpp-python is not installed (pip install 'ggufpy[conformance]')")
    committed = Reference.load("kv_b", KV_B_DIR)
    if llamacpp.versions() != committed.meta["llama_cpp"]:
        pytest.skip("the golden was recorded by another llama.cpp build")
    fresh = record_kv_b_golden(write_tiny_deepseek2(tmp_path / "kv_b.gguf", KV_B_SPEC), tmp_path / "golden")
    np.testing.assert_array_equal(fresh.logits.full, committed.logits.full)
    for name, value in committed.tensors.items():
        np.testing.assert_array_equal(fresh.tensors[name], value)
    np.testing.assert_array_equal(fresh.continuation, committed.continuation)
