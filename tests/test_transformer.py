"""The reference forward pass: its laws (prefill = decode, split = whole), its pieces, and its errors."""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from conformance.fixtures import TinyLlama, fixture_path, write_tiny_llama
from ggufpy import ops
from ggufpy.kvcache import ContextLengthError

TOKENS = np.array([5, 77, 200, 3, 150, 42, 9, 260, 11, 99, 1, 0, 180, 64, 33, 7], dtype=np.int64)


def test_prefill_equals_incremental_decode(tiny_llama):
    full = tiny_llama.logits(TOKENS)
    for k in (1, 5):
        cache = tiny_llama.new_cache()
        steps = [tiny_llama.forward(TOKENS[: len(TOKENS) - k], 0, cache)]
        for t in range(len(TOKENS) - k, len(TOKENS)):
            steps.append(tiny_llama.forward(TOKENS[t : t + 1], t, cache))
        inc = np.concatenate(steps)
        np.testing.assert_allclose(inc, full, rtol=0, atol=2e-5 * np.abs(full).max())


@pytest.mark.parametrize("k", [1, 2])
def test_layer_split_equals_whole_bit_for_bit(tiny_llama, k):
    n = tiny_llama.config.n_layers
    whole = tiny_llama.forward(TOKENS, 0, tiny_llama.new_cache())
    cache = tiny_llama.new_cache()
    hidden = tiny_llama.forward(TOKENS, 0, cache, layers=range(0, k))
    assert hidden.shape == (len(TOKENS), tiny_llama.config.dim)
    split = tiny_llama.forward(hidden, 0, cache, layers=range(k, n))
    assert np.array_equal(split, whole)
    # and one decode step through both halves
    nxt = np.array([17])
    whole_step = tiny_llama.forward(nxt, len(TOKENS), _filled(tiny_llama))
    h = tiny_llama.forward(nxt, len(TOKENS), cache, layers=range(0, k))
    assert np.array_equal(tiny_llama.forward(h, len(TOKENS), cache, layers=range(k, n)), whole_step)


def _filled(model):
    cache = model.new_cache()
    model.forward(TOKENS, 0, cache)
    return cache


def test_shard_model_maps_only_its_layers(tiny_llama_path):
    shard = ggufpy.load(tiny_llama_path, layers=range(1, 3), tokenizer=False)
    assert sorted(shard.weights.layers) == [1, 2]
    whole = ggufpy.load(tiny_llama_path, tokenizer=False)
    cache = whole.new_cache()
    h = whole.forward(TOKENS, 0, cache, layers=range(0, 1))
    shard_cache = shard.new_cache()
    assert shard_cache.layers == range(1, 3)
    assert np.array_equal(shard.forward(h, 0, shard_cache), whole.logits(TOKENS))
    with pytest.raises(ValueError, match="not a contiguous part"):
        shard.forward(TOKENS, 0, shard.new_cache(), layers=range(0, 3))


def test_independent_caches_do_not_interfere(tiny_llama):
    a, b = tiny_llama.new_cache(), tiny_llama.new_cache()
    la = tiny_llama.forward(TOKENS[:6], 0, a)
    tiny_llama.forward(TOKENS[6:], 0, b)
    la2 = tiny_llama.forward(TOKENS[6:8], 6, a)
    ref = tiny_llama.logits(TOKENS[:8])
    np.testing.assert_allclose(np.concatenate([la, la2]), ref, atol=2e-5 * np.abs(ref).max())


def test_context_and_cache_limits_are_clear_errors(tiny_llama):
    with pytest.raises(ContextLengthError, match="KV cache of 8"):
        tiny_llama.forward(TOKENS, 0, tiny_llama.new_cache(capacity=8))
    with pytest.raises(ContextLengthError, match="context length 256"):
        tiny_llama.new_cache(capacity=1000)
    cache = tiny_llama.new_cache()
    with pytest.raises(ValueError, match=r"position 3 is not in 0\.\.0"):
        tiny_llama.forward(TOKENS[:1], 3, cache)


def test_tied_output_and_rope_freqs(tmp_path):
    path = write_tiny_llama(tmp_path / "tied.gguf", TinyLlama(tied_output=True, rope_freqs=True, n_layers=1))
    m = ggufpy.load(path, tokenizer=False)
    assert m.weights.output is m.weights.token_embd
    assert m.weights.rope_freqs is not None and m.weights.rope_freqs.shape == (m.config.head_dim // 2,)
    assert m.logits(TOKENS[:4]).shape == (4, m.config.vocab_size)


def test_unknown_architecture_lists_supported(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba9")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ggufpy.GGUFError, match=r"'mamba9' is not supported; supported architectures: .*llama"):
        ggufpy.load(tmp_path / "x.gguf")


def test_forward_matches_a_naive_float64_implementation(tiny_llama_path):
    """An independent, loop-based float64 transcription of the Llama block, written from the paper's equations."""
    m = ggufpy.load(tiny_llama_path, tokenizer=False)
    cfg, f = m.config, m.file
    T = 6
    W = {name: f.dequantize(name).astype(np.float64) for name in f.tensors}
    h = W["token_embd.weight"][TOKENS[:T]]
    E, H, G = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w

    def rot(x, p):  # x (heads, E); adjacent pairs, as llama's "norm" rope
        out = x.copy()
        for i in range(E // 2):
            a = p * cfg.rope_theta ** (-2 * i / E)
            c, s = np.cos(a), np.sin(a)
            out[:, 2 * i] = x[:, 2 * i] * c - x[:, 2 * i + 1] * s
            out[:, 2 * i + 1] = x[:, 2 * i] * s + x[:, 2 * i + 1] * c
        return out

    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        x = norm(h, W[p + "attn_norm.weight"])
        q = np.stack([rot((x[t] @ W[p + "attn_q.weight"].T).reshape(H, E), t) for t in range(T)])
        k = np.stack([rot((x[t] @ W[p + "attn_k.weight"].T).reshape(G, E), t) for t in range(T)])
        v = (x @ W[p + "attn_v.weight"].T).reshape(T, G, E)
        out = np.zeros((T, H, E))
        for t in range(T):
            for hh in range(H):
                g = hh // (H // G)
                s = np.array([q[t, hh] @ k[u, g] for u in range(t + 1)]) / np.sqrt(E)
                pr = np.exp(s - s.max())
                pr /= pr.sum()
                out[t, hh] = pr @ v[: t + 1, g]
        h = h + out.reshape(T, H * E) @ W[p + "attn_output.weight"].T
        x = norm(h, W[p + "ffn_norm.weight"])
        gate = x @ W[p + "ffn_gate.weight"].T
        h = h + ((gate / (1 + np.exp(-gate))) * (x @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    ref = norm(h, W["output_norm.weight"]) @ W["output.weight"].T
    got = m.logits(TOKENS[:T])
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_rope_neox_is_norm_on_a_permuted_head():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    cos, sin = ops.rope_angles(np.arange(3), 8, 10000.0)
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])  # adjacent pairs -> halves
    np.testing.assert_allclose(ops.rope(x[..., perm], cos, sin, "neox"), ops.rope(x, cos, sin, "norm")[..., perm])


def test_rope_freq_factors_and_linear_scaling_divide_the_angles():
    pos = np.arange(5)
    factors = np.array([1.0, 2.0, 4.0, 8.0])
    c1, s1 = ops.rope_angles(pos, 8, 500.0, freq_scale=0.25, freq_factors=factors)
    inv = 500.0 ** (-np.arange(0, 8, 2) / 8) / factors
    np.testing.assert_allclose(np.arctan2(s1, c1), np.outer(pos * 0.25, inv), atol=1e-6)


def test_rms_norm_matches_definition():
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 64, dtype=np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6), ref, rtol=1e-6)


def test_numpy_backend_without_room_in_its_cache_computes_the_same_products(tiny_llama_path):
    """A weight that does not fit the dequantized-weight cache is dequantized tile by tile for each product
    (and decode products run BLAS on one thread): the same logits as with every weight cached."""
    from ggufpy import backend as backend_module

    tokens = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    cached = ggufpy.load(tiny_llama_path, backend="numpy", cache_bytes=1 << 30, tokenizer=False)
    tiled = ggufpy.load(tiny_llama_path, backend="numpy", cache_bytes=0, tokenizer=False)
    old, backend_module.TILE_BYTES = backend_module.TILE_BYTES, 4 * 32 * 5  # tiles of 5 rows: many of them
    try:
        got = tiled.logits(tokens)
    finally:
        backend_module.TILE_BYTES = old
    want = cached.logits(tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert tiled.backend._used == 0 and cached.backend._used > 0


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q4_k", "q5_k", "q6_k", "q2_k"])
def test_numpy_backend_tiles_in_plane_order_give_the_cached_logits(name):
    """Uncached weights of the types in `quants.planes` are dequantized in plane order with permuted
    activations (the others through the reference dequantizer): prompt and decode logits of each type's
    conformance fixture equal, up to f32 summation order, those with every weight cached."""
    from ggufpy import backend as backend_module

    tokens = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    logits = {}
    old = backend_module.TILE_BYTES
    for cache_bytes in (1 << 30, 0):
        model = ggufpy.load(fixture_path(name), backend="numpy", cache_bytes=cache_bytes, tokenizer=False)
        backend_module.TILE_BYTES = 4 * 256 * 3  # a few rows per tile: many tiles
        try:
            cache = model.new_cache(capacity=16)
            steps = [model.forward(tokens, 0, cache)]  # (8, V): a prefill
            steps += [model.forward(np.array([t]), 8 + i, cache) for i, t in enumerate([7, 2])]  # decode
        finally:
            backend_module.TILE_BYTES = old
        logits[cache_bytes] = np.concatenate(steps)
        assert (model.backend._used > 0) == (cache_bytes > 0)
    want, got = logits[1 << 30], logits[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# -- non-finite output is found and named (issue 11) ----------------------------------------------------------


def _with_weight(path, name: str, edit) -> None:
    """Rewrite the tiny model with `edit(values)` applied to the F32 tensor `name`."""
    from tests.hostile.model_craft import base

    m = base("llama").copy()
    _, t, _, data = m.tensor(name)
    values = np.frombuffer(data, np.float32).copy()
    edit(values)
    m.retype(name, t, values.tobytes())
    m.write(path)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_check_finite_names_the_first_non_finite_tensor_and_its_weight(tmp_path, backend):
    """A NaN weight made every logit NaN and greedy decoding emit token 0 (EOS) in silence."""
    from ggufpy.diagnose import NonFiniteLogitsError, check_finite

    if backend == "numba":
        pytest.importorskip("numba")
    path = tmp_path / "nan.gguf"
    _with_weight(path, "blk.1.ffn_up.weight", lambda v: v.__setitem__(17, np.nan))
    model = ggufpy.load(path, backend=backend)
    tokens = [5, 77, 200]
    cache = model.new_cache()
    model.forward(np.array(tokens[:2]), 0, cache)
    row = model.forward(np.array(tokens[2:]), 2, cache)[-1]  # decode: the path generation takes
    assert np.isnan(row).all()
    with pytest.raises(NonFiniteLogitsError) as info:
        check_finite(model, row, tokens)
    e = info.value
    assert (e.tensor, e.layer, e.weight) == ("ffn_out-1", 1, "blk.1.ffn_up.weight")
    assert "the first non-finite tensor is 'ffn_out-1' (layer 1, position 0)" in str(e)
    assert check_finite(model, np.zeros_like(row), tokens) is None  # a finite row: nothing is rerun


def test_check_finite_blames_the_embedding_row_of_a_token(tmp_path):
    from ggufpy.diagnose import NonFiniteLogitsError, check_finite

    path = tmp_path / "embd.gguf"
    dim = 32
    _with_weight(path, "token_embd.weight", lambda v: v.__setitem__(200 * dim + 3, np.inf))
    model = ggufpy.load(path, backend="numpy")
    head_only = model.logits([5, 6])[-1]  # the head is tied: token 200's logit is the only non-finite one
    assert np.flatnonzero(~np.isfinite(head_only)).tolist() == [200]
    with pytest.raises(NonFiniteLogitsError, match=r"'result_output' \(the output head.*'token_embd\.weight'"):
        check_finite(model, head_only, [5, 6])
    logits = model.logits([5, 200])
    with pytest.raises(NonFiniteLogitsError, match=r"position 1.*'token_embd\.weight' holds NaN/inf") as info:
        check_finite(model, logits[-1], [5, 200])
    assert (info.value.tensor, info.value.layer) == ("attn_norm-0", 0)


def test_check_finite_without_a_bad_weight_says_so(tmp_path):
    from ggufpy.diagnose import NonFiniteLogitsError, check_finite

    path = tmp_path / "overflow.gguf"
    _with_weight(path, "blk.0.ffn_down.weight", lambda v: v.fill(3e38))  # finite, but sums overflow
    model = ggufpy.load(path, backend="numpy")
    logits = model.logits([5, 77])
    assert not np.isfinite(logits[-1]).all()
    with pytest.raises(NonFiniteLogitsError, match="no weight of that step holds NaN/inf") as info:
        check_finite(model, logits[-1], [5, 77])
    assert info.value.weight is None and info.value.layer is not None
