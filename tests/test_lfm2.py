"""lfm2 (Liquid LFM2, issue 13): short-conv layers (`ggufpy.shortconv`) beside attention layers with Q/K norms, in
the hybrid machinery (`ggufpy.hybrid`, a `HybridState` per sequence).

The bit-exact comparison with llama.cpp is the conformance golden `lfm2_f32` (tests/test_conformance.py); here: the
config and its strictness, the conv's ggml order (live, for several conv lengths), another layer layout against
llama.cpp live, the state (continuing, restarting, failing, growing, its size), the transformer's laws (incremental
decode, shards, batch rows, both backends), the CLI, and LFM2's pre-tokenizer.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import ggufpy
from conformance import fixtures as fx
from conformance.fixtures_lfm2 import LFM2, write_tiny_lfm2
from ggufpy import shortconv as sc
from ggufpy.config import config_from_metadata
from ggufpy.errors import GGUFMetadataError, GGUFUnsupportedError
from ggufpy.quants.x86.simd import fma
from ggufpy.state import HybridState

NAME = "lfm2_f32"
PATH = fx.fixture_path(NAME)
D = LFM2.dim


@pytest.fixture(scope="module")
def model():
    return ggufpy.load(PATH, backend="numpy", tokenizer=False)


@pytest.fixture(scope="module")
def metadata():
    with ggufpy.open(PATH) as f:
        return dict(f.metadata), f.tensors["token_embd.weight"].shape[0]


def fx_tokens() -> np.ndarray:
    from conformance.record import fixture_tokens

    return np.asarray(fixture_tokens())


def live_reference(path, name: str):
    pytest.importorskip("llama_cpp")
    from conformance.compare import Reference

    return Reference.from_llamacpp(path, fx_tokens(), 16, name=name)


# -- config ------------------------------------------------------------------------------------------------------


def test_config_reads_the_layer_kinds_and_the_conv(model):
    cfg = model.config
    assert cfg.arch.name == "lfm2" and cfg.arch.rope_style == "neox" and cfg.arch.mixer == "hybrid"
    assert cfg.recurrent == sc.ShortConvConfig(l_cache=3, dim=D, recurrent=(True, True, False, True))
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim) == (4, 2, 8, 8)  # head_count_kv's non-zero entry
    w = model.weights
    for i in (0, 1, 3):
        m = w.layers[i].mixer
        assert isinstance(m, sc.ShortConvWeights) and w.layers[i].attn_q is None
        assert m.shortconv_in_proj.shape == (3 * D, D) and m.shortconv_conv.shape == (D, 3)
    assert w.layers[2].mixer is None and w.layers[2].attn_q_norm.shape == (8,) and w.layers[2].attn_k.shape == (16, D)
    with ggufpy.open(PATH) as f:  # the final norm is token_embd_norm; the head is tied
        assert "output_norm.weight" not in f.tensors and "output.weight" not in f.tensors
        np.testing.assert_array_equal(w.output_norm, f.dequantize("token_embd_norm.weight"))
    assert w.output is w.token_embd


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"lfm2.shortconv.l_cache": None}, GGUFMetadataError, "lfm2.shortconv.l_cache is required"),
        ({"lfm2.shortconv.l_cache": 1}, GGUFMetadataError, "must be an integer > 1"),
        ({"lfm2.attention.head_count_kv": [0, 0, 2]}, GGUFMetadataError, "one entry per layer (4)"),
        ({"lfm2.attention.head_count_kv": [0, 1, 2, 0]}, GGUFMetadataError, "the same KV head count"),
        ({"lfm2.attention.head_count_kv": [0, 0, 3, 0]}, GGUFMetadataError, "must divide lfm2.attention.head_count"),
        ({"lfm2.attention.sliding_window": 64}, GGUFUnsupportedError, "sliding-window attention is not supported"),
        ({"lfm2.attention.head_count_kv": [0, -1, 2, 0]}, GGUFMetadataError, "an array of integers >= 0"),
        ({"lfm2.attention.head_count_kv": ["a", 0, 2, 0]}, GGUFMetadataError, "must be an integer array"),
    ],
)
def test_config_refuses_inconsistent_hparams(metadata, change, error, words):
    md, vocab = metadata
    md = {k: v for k, v in {**md, **change}.items() if v is not None}
    with pytest.raises(error) as info:
        config_from_metadata(md, vocab, source="lfm2.gguf")
    assert words in str(info.value) and "lfm2.gguf" in str(info.value)


def test_a_single_kv_head_count_means_attention_everywhere(metadata):
    md, vocab = metadata
    cfg = config_from_metadata({**md, "lfm2.attention.head_count_kv": 2}, vocab)
    assert cfg.recurrent.recurrent == (False,) * 4 and cfg.n_kv_heads == 2


# -- the conv in ggml's order ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("L", [2, 3, 4, 5, 8, 9])
def test_the_conv_replay_groups_four_taps_then_contracts_the_rest(L):
    """`ssm_conv_ggml` on random data: the first L - L % 4 taps as rounded products added in order (=
    `deltanet.conv1d`), the last L % 4 as FMAs; for L = 3 (LFM2) an FMA chain from 0, which differs from conv1d."""
    rng = np.random.default_rng(L)
    x, w = rng.standard_normal((L - 1 + 64, 16)).astype(np.float32), rng.standard_normal((16, L)).astype(np.float32)
    body = L - L % 4
    want = np.zeros((64, 16), np.float32)
    for k in range(body):
        want = want + x[k : k + 64] * w[:, k]
    for k in range(body, L):
        want = fma(x[k : k + 64], w[:, k], want)
    got = sc.ssm_conv_ggml(x, w)
    assert np.array_equal(got, want)
    if L % 4 == 0:
        assert np.array_equal(got, sc.conv1d(x, w))
    if L == 3:
        assert not np.array_equal(got, sc.conv1d(x, w))  # the FMAs matter: the test would see conv1d's rounding
    np.testing.assert_allclose(got, sc.conv1d(x, w), rtol=1e-5, atol=1e-5)  # the exact mode's conv


@pytest.mark.parametrize("L", [3, 4, 6])
def test_the_conv_is_llamacpps_live(tmp_path, L):
    """Layer 0's conv output on llama.cpp's own in_proj output, bit for bit (the rule above, measured on its build)."""
    pytest.importorskip("llama_cpp")
    from conformance.llamacpp import LlamaCpp

    path = write_tiny_lfm2(tmp_path / f"l{L}.gguf", replace(LFM2, l_cache=L))
    tokens = fx_tokens()
    with LlamaCpp(path) as lc:
        _, t = lc.run(tokens, capture=lambda n: n.startswith("model.layers.{}.conv.") and n.endswith("-0"))
    w = ggufpy.load(path, backend="numpy", tokenizer=False).weights.layers[0].mixer
    bcx = t["model.layers.{}.conv.in_proj-0"]  # (T, 3D)
    conv_input = np.concatenate([np.zeros((L - 1, D), np.float32), bcx[:, :D] * bcx[:, 2 * D :]])
    assert np.array_equal(sc.ssm_conv_ggml(conv_input, w.shortconv_conv), t["model.layers.{}.conv.conv-0"])


LAYOUT = replace(LFM2, seed=551, conv_layers=(1, 2), l_cache=5, n_heads=2, n_kv_heads=1)


def test_another_layout_is_llamacpps_live(tmp_path):
    """Attention first, two conv layers then attention, l_cache 5 (a 4-input state; the conv's FMA tail on one tap),
    2 heads of 16 over 1 KV head: bit for bit with llama.cpp at every layer and in the greedy tokens."""
    from conformance.compare import bit_differences, greedy
    from conformance.llamacpp import host_isa
    from ggufpy.numerics import LLAMACPP_MODES

    path = write_tiny_lfm2(tmp_path / "layout.gguf", LAYOUT)
    ref = live_reference(path, "layout")
    m = ggufpy.load(path, backend="numpy", tokenizer=False, numerics=LLAMACPP_MODES[host_isa()])
    assert m.config.recurrent.recurrent == (False, True, True, False)
    diffs = bit_differences(m, ref)
    assert set(diffs) == {"l_out-0", "l_out-1", "l_out-2", "l_out-3", "result_norm", "result_output"}, diffs
    assert not any(diffs.values()), diffs
    assert greedy(m, ref.tokens, 16) == list(ref.continuation)


@pytest.mark.parametrize("kind", ["q8_0", "q4_k"])
def test_quantized_files_are_llamacpps_live(tmp_path, kind):
    """Every product through llama.cpp's integer kernels (in_proj's 3D rows of Q8_0, or Q4_K with a Q6_K
    embedding, as LFM2's Q4_K_M files): bit for bit at every layer and in the greedy tokens."""
    from conformance.compare import bit_differences, greedy
    from conformance.llamacpp import host_isa
    from ggufpy.constants import GGMLType as T
    from ggufpy.numerics import LLAMACPP_MODES

    q4_k = {"embd": T.Q6_K, "output": T.Q6_K, "attn": T.Q4_K, "ffn": T.Q4_K}
    types = dict.fromkeys(q4_k, T.Q8_0) if kind == "q8_0" else q4_k
    path = write_tiny_lfm2(tmp_path / f"{kind}.gguf", replace(LFM2, dim=256, hidden_dim=256, seed=552, types=types))
    ref = live_reference(path, kind)
    m = ggufpy.load(path, backend="numpy", tokenizer=False, numerics=LLAMACPP_MODES[host_isa()])
    diffs = bit_differences(m, ref)
    assert len(diffs) == 6 and not any(diffs.values()), diffs
    assert greedy(m, ref.tokens, 16) == list(ref.continuation)


# -- the state -------------------------------------------------------------------------------------------------------


def test_the_state_holds_the_last_inputs_of_each_conv_layer(model):
    tokens = fx_tokens()[:9]
    cache = model.new_cache(capacity=16)
    trace = {}
    model.forward(tokens, 0, cache, trace=trace)
    assert isinstance(cache, HybridState) and cache.recurrent_layers == [0, 1, 3] and list(cache.kv.k) == [2]
    for i in (0, 1, 3):
        bcx = trace[f"model.layers.{{}}.conv.in_proj-{i}"]
        np.testing.assert_array_equal(cache.conv[i], (bcx[:, :D] * bcx[:, 2 * D :])[-2:])  # b * x of the last 2
        assert cache.ssm[i].shape == (0,)
    kv = 2 * 16 * 2 * 8 * 4  # k and v, 16 positions, 2 KV heads of 8 floats, one attention layer
    assert cache.nbytes == kv + 3 * 2 * D * 4


def test_state_continues_only_at_its_end_and_restarts_at_zero(model):
    tokens = fx_tokens()[:8]
    cache = model.new_cache(capacity=16)
    first = model.forward(tokens, 0, cache)
    with pytest.raises(ValueError, match="position 4: a recurrent state continues a sequence only at its end"):
        model.forward(tokens[4:], 4, cache)
    assert np.array_equal(model.forward(tokens, 0, cache), first)  # restarting at 0 ignores the old state
    cache.truncate(5)  # the conv state cannot drop positions: the sequence is cleared
    assert cache.length == 0 and not any(np.any(cache.conv[i]) for i in (0, 1, 3))
    assert np.array_equal(model.forward(tokens, 0, cache), first)


def test_a_failed_call_leaves_the_state_as_it_was(model):
    tokens = fx_tokens()[:10]
    cache, reference = model.new_cache(capacity=16), model.new_cache(capacity=16)
    model.forward(tokens[:6], 0, cache)
    model.forward(tokens[:6], 0, reference)
    before = {i: cache.conv[i].copy() for i in (0, 1, 3)}
    trace = _FailAt("l_out-3")  # after every conv layer ran
    with pytest.raises(RuntimeError, match="failed at l_out-3"):
        model.forward(tokens[6:], 6, cache, trace=trace)
    assert cache.length == 6 and all(np.array_equal(cache.conv[i], c) for i, c in before.items())
    assert np.array_equal(model.forward(tokens[6:], 6, cache), model.forward(tokens[6:], 6, reference))


class _FailAt(dict):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __setitem__(self, key, value):
        if key == self.name:
            raise RuntimeError(f"failed at {key}")
        super().__setitem__(key, value)


def test_state_resized_continues_identically(model):
    tokens = fx_tokens()[:6]
    small, reference = model.new_cache(capacity=6), model.new_cache(capacity=12)
    model.forward(tokens, 0, small)
    model.forward(tokens, 0, reference)
    grown = small.resized(12)
    assert grown.capacity == 12 and grown.length == 6
    assert np.array_equal(model.forward(np.array([9]), 6, grown), model.forward(np.array([9]), 6, reference))


# -- the transformer's laws ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("numerics", ["exact", "llamacpp"])
def test_incremental_decode_equals_prefill(numerics):
    """A prompt in pieces (prefill, more prompt, token by token past the conv's 2-input state) gives the logits of
    one prefill, up to the products' summation order (llama.cpp's kernels too sum differently for 1 and T rows)."""
    m = ggufpy.load(PATH, backend="numpy", tokenizer=False, numerics=numerics)
    tokens = fx_tokens()[:24]
    whole = m.logits(tokens)
    cache = m.new_cache(24)
    parts = [m.forward(tokens[:10], 0, cache), m.forward(tokens[10:16], 10, cache)]
    parts += [m.forward(tokens[i : i + 1], i, cache) for i in range(16, 24)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cut", [1, 2, 3])
@pytest.mark.parametrize("numerics", ["exact", "llamacpp"])
def test_shards_equal_the_whole_model(numerics, cut):
    """Layers [0, cut) then [cut, 4), each shard with its own state, then a decode step: bit for bit the whole
    model (cut 2: conv | attention, cut 3: attention | conv)."""
    whole = ggufpy.load(PATH, backend="numpy", tokenizer=False, numerics=numerics)
    first = ggufpy.load(PATH, backend="numpy", tokenizer=False, numerics=numerics, layers=range(0, cut))
    second = ggufpy.load(PATH, backend="numpy", tokenizer=False, numerics=numerics, layers=range(cut, 4))
    tokens = fx_tokens()[:12]
    ref_cache, a, b = whole.new_cache(16), first.new_cache(16), second.new_cache(16)
    assert np.array_equal(second.forward(first.forward(tokens, 0, a), 0, b), whole.forward(tokens, 0, ref_cache))
    step = second.forward(first.forward(np.array([5]), 12, a), 12, b)
    assert np.array_equal(step, whole.forward(np.array([5]), 12, ref_cache))


def test_decode_batch_rows_equal_single_decodes():
    m = ggufpy.load(PATH, backend="numpy", tokenizer=False, numerics="llamacpp-avx2")
    prompts = [[5, 9, 40, 7], [100, 3], [7, 8, 9, 10, 11]]
    caches, singles = [], []
    for p in prompts:
        c1, c2 = m.new_cache(16), m.new_cache(16)
        m.forward(np.array(p[:-1]), 0, c1)
        m.forward(np.array(p[:-1]), 0, c2)
        caches.append(c1)
        singles.append(m.forward(np.array(p[-1:]), len(p) - 1, c2)[0])
    batch = m.decode_batch([p[-1] for p in prompts], [len(p) - 1 for p in prompts], caches)
    np.testing.assert_array_equal(batch, np.stack(singles))


@pytest.mark.slow
def test_numba_backend_agrees_with_numpy(model):
    """No kernel of its own: the numba backend's products and attention, NumPy's conv."""
    pytest.importorskip("numba")
    tokens = fx_tokens()[:40]
    fast = ggufpy.load(PATH, backend="numba", tokenizer=False)
    np.testing.assert_allclose(fast.logits(tokens), model.logits(tokens), rtol=1e-4, atol=1e-4)
    cache, ref_cache = fast.new_cache(48), model.new_cache(48)
    fast.forward(tokens, 0, cache)
    model.forward(tokens, 0, ref_cache)
    np.testing.assert_allclose(
        fast.forward(np.array([7]), 40, cache), model.forward(np.array([7]), 40, ref_cache), rtol=1e-4, atol=1e-4
    )


def test_ggufpy_run_generates_the_greedy_tokens(capsys):
    from ggufpy.cli import main

    code = main(["run", "-m", str(PATH), "--backend", "numpy", "-p", "on the", "-n", "6", "--temp", "0"])
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


# -- the tokenizer: tokenizer.ggml.pre = "lfm2" ---------------------------------------------------------------------


def test_lfm2_pre_tokenizer_is_llama3s():
    """llama.cpp's llama-vocab.cpp lists "lfm2" with llama3's regex, ignore_merges and add_bos."""
    from ggufpy.tokenizer.pretokenizers import PRE_TOKENIZERS

    assert PRE_TOKENIZERS["lfm2"] == PRE_TOKENIZERS["llama3"]


def test_lfm2_pre_tokenizer_matches_llamacpp_live(tmp_path):
    pytest.importorskip("llama_cpp")
    from conformance.llamacpp import LlamaCpp

    path = write_tiny_lfm2(tmp_path / "pre.gguf", replace(LFM2, tokenizer_pre="lfm2"))
    tok = ggufpy.load(path, backend="numpy").tokenizer
    texts = ["Hello world", "I'm 12345 years old, isn't it?", "  spaces\n\nand\ttabs 3.14159", "ÀÉÎ üñí 日本 1,000,000"]
    with LlamaCpp(path) as lc:
        for text in texts:
            assert tok.encode(text) == lc.tokenize(text), text
            assert tok.encode(text, add_special=False) == lc.tokenize(text, add_special=False), text
