"""gemma4 (issue 13): per-layer head sizes, KV heads, widths and RoPE, shared-KV layers, V normed without weight,
no KQ scale, per-layer embeddings, the output scale and 26B-A4B's experts beside the dense MLP
(src/models/gemma4.cpp). The golden
(conformance/goldens/gemma4_f16.npz, recorded from llama.cpp 0.3.36 on this AVX2 machine) holds the block bit for
bit over 128 tokens, 8 windows of the local layers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import ggufpy
from conformance import fixtures as fx
from conformance.compare import Reference, bit_differences, end_to_end, nmse
from conformance.fixtures_gemma4 import GEMMA4_FIXTURES, write_tiny_gemma4
from ggufpy.config import config_from_metadata
from ggufpy.errors import GGUFMetadataError
from ggufpy.numerics import llamacpp_mode
from ggufpy.reader import open as open_gguf

NAME = "gemma4_f16"
SPEC = GEMMA4_FIXTURES[NAME]
PATH = fx.fixture_path(NAME)


@pytest.fixture(scope="module")
def ref():
    return Reference.load(NAME)


@pytest.fixture(scope="module")
def model():
    return ggufpy.load(PATH, backend="numpy", tokenizer=False)


def test_config_reads_the_per_layer_tables(model):
    cfg, g = model.config, model.config.gemma4
    assert g.local == SPEC.local == tuple(cfg.window(i) is not None for i in range(6))
    assert cfg.sliding_window == 16 and cfg.final_softcap == 10.0
    assert g.head_dim == (16, 32) * 3 and g.n_kv_heads == (1, 2) * 3 and g.n_heads == (2,) * 6
    assert g.rope_dim == (8, 32) * 3 and [cfg.rope(i)[0] for i in range(2)] == [10000.0, 1e6]
    assert g.hidden_dim == (32,) * 4 + (64,) * 2  # the shared-KV layers' double-wide MLP
    assert g.kv_layer == (0, 1, 2, 3, 2, 3) and g.per_layer_dim == 8
    assert [cfg.rope_freqs_on(i) for i in range(2)] == [False, True]
    w = model.weights.layers
    assert w[1].attn_v is None and w[0].attn_v is not None  # V is K on the global layers
    assert w[4].attn_k is None and w[5].attn_k_norm is None
    assert model.weights.per_layer_token_embd.shape == (269, 6 * 8)
    assert (g.n_experts, g.n_experts_used, g.expert_hidden_dim) == (4, 2, 16)
    assert [w[i].experts is not None for i in range(6)] == [False, False, True, True, False, False]
    assert w[2].experts.ffn_gate_up_exps.shape == (4, 32, 32) and w[2].experts.ffn_gate_exps is None
    assert w[3].experts.ffn_gate_exps.shape == (4, 16, 32) and w[3].experts.ffn_down_exps_scale.shape == (4,)


def test_rope_rotates_the_local_layers_partially_and_the_global_ones_proportionally(model):
    angles = {}
    cos, sin = model._angles(angles, 0, [np.arange(40)])
    assert cos.shape == (40, 4)  # rope.dimension_count_swa 8: 4 of the 8 pairs of a 16-dim head
    cos, sin = model._angles(angles, 1, [np.arange(40)])
    assert cos.shape == (40, 16) and np.abs(sin[1:, :4]).min() > 0
    assert np.abs(sin[:, 4:]).max() < 1e-20 and (cos[:, 4:] == 1).all()  # rope_freqs' 1e30: not rotated


def test_llamacpp_numerics_are_bit_exact(ref):
    """Every l_out, the final norm, the logits and the greedy continuation equal llama.cpp's over 128 tokens."""
    mode = llamacpp_mode(ref.meta["llama_cpp"]["system_info"])
    model = ggufpy.load(PATH, backend="numpy", tokenizer=False, numerics=mode)
    assert len(ref.tokens) > 4 * model.config.sliding_window
    diffs = bit_differences(model, ref)
    assert set(diffs) == {*(f"l_out-{i}" for i in range(6)), "result_norm", "result_output"}, diffs
    assert not any(diffs.values()), diffs
    e2e = end_to_end(model, ref, continuation=True)
    assert e2e["greedy_match"] == e2e["greedy_len"] == 16 and e2e["kl_max"] == 0


def test_exact_numerics_meet_the_thresholds(model, ref):
    """Exact mode: end to end within docs/conformance.md's F32 thresholds; each layer's output of the same run
    (teacher forcing cannot run a shared-KV layer or the per-layer inputs alone) within the per-layer one."""
    e2e = end_to_end(model, ref, continuation=True)
    assert e2e["top1"] >= 0.99 and e2e["kl_mean"] <= 1e-4 and e2e["greedy_match"] == 16, e2e
    trace = {}
    model.forward(np.asarray(ref.tokens, np.int64), 0, model.new_cache(len(ref.tokens)), trace=trace)
    assert max(nmse(trace[f"l_out-{i}"], ref.tensors[f"l_out-{i}"]) for i in range(6)) <= 1e-3
    assert np.abs(ref.logits.full).max() > 0.8 * SPEC.final_softcap  # the softcap bites


def _error(model, ref) -> float:
    return float(np.abs(model.logits(ref.tokens) - ref.logits.full).max())


def _layers(model, **fields):
    weights = replace(model.weights, layers={i: replace(w, **fields) for i, w in model.weights.layers.items()})
    return ggufpy.transformer.Model(model.config, weights, model.backend)


def test_every_gemma4_feature_moves_the_logits_away_from_llamacpp(model, ref):
    base = _error(model, ref)
    assert base < 0.1
    g = model.config.gemma4
    variants = {
        "no per-layer inputs": ggufpy.transformer.Model(
            replace(model.config, gemma4=replace(g, per_layer_dim=0)), model.weights, model.backend
        ),
        "no output scale": _layers(model, layer_output_scale=None),
        "no experts": _layers(model, experts=None),
        "no proportional RoPE": ggufpy.transformer.Model(
            model.config, replace(model.weights, rope_freqs=None), model.backend
        ),
        "no window": ggufpy.transformer.Model(replace(model.config, sliding_window=None), model.weights, model.backend),
        "own-layer rope everywhere": ggufpy.transformer.Model(
            replace(model.config, gemma4=replace(g, rope_dim=(16, 32) * 3)), model.weights, model.backend
        ),
    }
    for what, variant in variants.items():
        assert _error(variant, ref) > 10 * base, (what, _error(variant, ref), base)


def _rms(x, w=1.0):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + SPEC.norm_eps) * w


def _gelu(z):
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


@pytest.mark.parametrize("layer", [2, 3])  # gate and up fused, apart
def test_experts_beside_the_mlp_match_a_float64_reference(model, layer):
    """post_ffw_norm_1(mlp) + post_ffw_norm_2(sum_k w_k s_e down_e(gelu(gate_e x) * up_e x)), x = pre_ffw_norm_2(h),
    the router on rms_norm(h) / sqrt(D) * scale, softmax, the two best, their weights normalised."""
    w, D = model.weights.layers[layer], SPEC.dim
    e = w.experts
    rng = np.random.default_rng(layer)
    h, mlp = (rng.standard_normal((12, D)).astype(np.float32) * 3 for _ in range(2))
    got = ggufpy.gemma4.add_experts(model, mlp, h, w, rows=False)
    h64 = h.astype(np.float64)
    logits = (_rms(h64) / np.sqrt(D) * e.ffn_gate_inp_scale) @ e.ffn_gate_inp.dequantize().T
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    if e.ffn_gate_up_exps is not None:
        gate_up = np.stack([t.dequantize() for t in e.ffn_gate_up_exps.experts]).astype(np.float64)
        gate, up = gate_up[:, :16], gate_up[:, 16:]
    else:
        gate, up = (
            np.stack([t.dequantize() for t in s.experts]).astype(np.float64) for s in (e.ffn_gate_exps, e.ffn_up_exps)
        )
    down = np.stack([t.dequantize() for t in e.ffn_down_exps.experts]).astype(np.float64)
    x = _rms(h64, e.pre_ffw_norm_2)
    routed = np.zeros((12, D))
    for t in range(12):
        best = np.argsort(-probs[t])[:2]
        for k in best:
            weight = probs[t, k] / probs[t, best].sum()
            routed[t] += weight * e.ffn_down_exps_scale[k] * (down[k] @ (_gelu(gate[k] @ x[t]) * (up[k] @ x[t])))
    want = _rms(mlp.astype(np.float64), e.post_ffw_norm_1) + _rms(routed, e.post_ffw_norm_2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    alone = ggufpy.gemma4.add_experts(model, mlp[3:4], h[3:4], w, rows=False)
    np.testing.assert_array_equal(ggufpy.gemma4.add_experts(model, mlp, h, w, rows=True)[3:4], alone)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_decode_matches_prefill_and_batch_rows_match_single_decodes(backend):
    if backend == "numba":
        pytest.importorskip("numba")
    model = ggufpy.load(PATH, backend=backend, tokenizer=False)
    tokens = np.random.default_rng(5).integers(3, 269, 44)  # past the 16-token window
    full = model.logits(tokens)
    cache = model.new_cache(48)
    steps = [model.forward(tokens[:30], 0, cache)[-1]]
    steps += [model.forward(tokens[i : i + 1], i, cache)[0] for i in range(30, 44)]
    np.testing.assert_allclose(np.stack(steps), full[29:], rtol=1e-4, atol=1e-4)
    prompts = [tokens[:40], tokens[3:10], tokens[:21]]
    caches, singles = [], []
    for p in prompts:
        c1, c2 = model.new_cache(48), model.new_cache(48)
        model.forward(p[:-1], 0, c1)
        model.forward(p[:-1], 0, c2)
        caches.append(c1)
        singles.append(model.forward(p[-1:], len(p) - 1, c2)[0])
    batch = model.decode_batch([p[-1] for p in prompts], [len(p) - 1 for p in prompts], caches)
    np.testing.assert_array_equal(batch, np.stack(singles))


def test_numba_backend_agrees_with_numpy(model):
    pytest.importorskip("numba")
    tokens = np.random.default_rng(6).integers(3, 269, 40)
    numba_logits = ggufpy.load(PATH, backend="numba", tokenizer=False).logits(tokens)
    np.testing.assert_allclose(numba_logits, model.logits(tokens), rtol=1e-4, atol=1e-4)


def test_a_grown_cache_continues_the_sequence(model):
    tokens = np.random.default_rng(8).integers(3, 269, 24)
    cache = model.new_cache(20)
    model.forward(tokens[:20], 0, cache)
    grown = cache.resized(24)
    assert grown.k.keys() == {0, 1, 2, 3} and grown.k[1].shape == (24, 2, 32)  # no cache of the shared layers
    whole = model.new_cache(24)
    model.forward(tokens[:20], 0, whole)
    np.testing.assert_array_equal(model.forward(tokens[20:], 20, grown), model.forward(tokens[20:], 20, whole))


def test_layer_ranges_that_cannot_run_alone_are_refused():
    with pytest.raises(ValueError, match="layer 4 reads the KV cache of layer 2"):
        ggufpy.load(PATH, backend="numpy", tokenizer=False, layers=range(3, 6)).new_cache(8)
    shard = ggufpy.load(PATH, backend="numpy", tokenizer=False, layers=range(2, 6))
    with pytest.raises(ValueError, match="per-layer embeddings need the token ids"):
        shard.forward(np.zeros((3, SPEC.dim), np.float32), 0, shard.new_cache(8))


def test_split_equals_whole_without_per_layer_inputs_and_shared_kv(tmp_path):
    """31B / 26B-A4B's layout (no per-layer embeddings, no shared-KV layers): shards [0, 3) and [3, 6), each with
    its own cache, give the whole model's logits."""
    spec = replace(SPEC, per_layer_dim=0, shared_kv_layers=0, double_wide=False)
    path = write_tiny_gemma4(tmp_path / "g4.gguf", spec)
    whole = ggufpy.load(path, backend="numpy", tokenizer=False)
    assert whole.config.gemma4.kv_layer == tuple(range(6)) and whole.weights.per_layer_token_embd is None
    first, second = (ggufpy.load(path, backend="numpy", tokenizer=False, layers=r) for r in (range(0, 3), range(3, 6)))
    tokens = np.random.default_rng(9).integers(3, 269, 30)
    c1, c2 = first.new_cache(32), second.new_cache(32)
    split = second.forward(first.forward(tokens, 0, c1), 0, c2)
    np.testing.assert_array_equal(split, whole.logits(tokens))


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_ggufpy_run_generates_the_greedy_tokens(backend, capsys):
    if backend == "numba":
        pytest.importorskip("numba")
    from ggufpy.cli import main

    code = main(["run", "-m", str(PATH), "--backend", backend, "-p", "the cat", "-n", "6", "--temp", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    ref = ggufpy.load(PATH, backend="numpy")
    ids = ref.tokenizer.encode("the cat")
    cache = ref.new_cache(32)
    logits, greedy = ref.forward(np.array(ids), 0, cache)[-1], []
    for i in range(6):
        greedy.append(int(np.argmax(logits)))
        logits = ref.forward(np.array(greedy[-1:]), len(ids) + i, cache)[0]
    assert ref.tokenizer.decode(greedy) in out


# -- the metadata, checked strictly --------------------------------------------------------------------------


def _metadata() -> dict:
    with open_gguf(PATH) as f:
        return dict(f.metadata)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("gemma4.attention.sliding_window_pattern", [True, False] * 2, "one entry per layer"),
        ("gemma4.attention.sliding_window_pattern", [1, 0, 1, 0, 1, 0], "array of bools"),
        ("gemma4.attention.value_length_swa", 8, "must equal gemma4.attention.key_length_swa"),
        ("gemma4.attention.value_length", 16, "must equal the key length 32"),
        ("gemma4.attention.shared_kv_layers", 3, "the last two local then global"),
        ("gemma4.attention.shared_kv_layers", 5, "must leave >= 2 KV layers"),
        ("gemma4.attention.head_count_kv", [1, 2, 1], "one integer in"),
        ("gemma4.attention.head_count_kv", [1, 3, 1, 2, 1, 2], "layer 1: must divide 2"),
        ("gemma4.rope.dimension_count_swa", 32, "must be <= gemma4.attention.key_length_swa = 16"),
        ("gemma4.expert_used_count", 5, "must be in \\[1, gemma4.expert_count = 4\\]"),
        ("gemma4.expert_feed_forward_length", None, "expert_feed_forward_length is required"),
        ("gemma4.attention.key_length_swa", None, "key_length_swa is required"),
        ("gemma4.embedding_length_per_layer_input", None, "embedding_length_per_layer_input is required"),
        ("gemma4.attention.sliding_window_pattern", None, "sliding_window_pattern is required"),
    ],
)
def test_bad_metadata_is_refused_naming_the_key(key, value, message):
    md = _metadata()
    if value is None:
        del md[key]
    else:
        md[key] = value
    with pytest.raises(GGUFMetadataError, match=message):
        config_from_metadata(md, vocab_size=269, source="tiny.gguf")


def test_per_layer_arrays_feed_the_common_config():
    """head_count_kv and feed_forward_length arrays: layer 0's value is the config's n_kv_heads / hidden_dim
    (llama.cpp's hparams.n_head_kv() without a layer), each layer's in `gemma4`."""
    cfg = config_from_metadata(_metadata(), vocab_size=269)
    assert (cfg.n_kv_heads, cfg.hidden_dim, cfg.head_dim) == (1, 32, 32)
    md = {**_metadata(), "gemma4.feed_forward_length": 48, "gemma4.attention.head_count_kv": 2}
    g = config_from_metadata(md, vocab_size=269).gemma4
    assert g.hidden_dim == (48,) * 6 and g.n_kv_heads == (2,) * 6
