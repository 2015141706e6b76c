"""Hybrid recurrent models in use: a sequence's `HybridState` (continuing, restarting, failing, growing), shards
(split == whole), batched decode, the CLI and the numba backend, on the fixtures of `conformance.fixtures_hybrid`."""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from conformance.fixtures_hybrid import TinyQwen35, build_hybrid_fixture, write_tiny_qwen35
from ggufpy.state import HybridState


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hybrid_state")
    return {"hybrid_f32": build_hybrid_fixture("hybrid_f32", directory)}


@pytest.mark.parametrize("numerics", ["exact", "llamacpp"])
def test_prefill_then_decode_continues_the_sequence(files, numerics):
    """A sequence run in pieces (prefill, more prompt, token by token) gives the logits of one prefill, up to
    the products' summation order (llama.cpp's kernels too sum differently for 1 and for T rows)."""
    model = ggufpy.load(files["hybrid_f32"], backend="numpy", numerics=numerics)
    tokens = np.random.default_rng(1).integers(3, 269, 24)
    whole = model.forward(tokens, 0, model.new_cache(capacity=24))
    cache = model.new_cache(capacity=24)
    parts = [model.forward(tokens[:10], 0, cache), model.forward(tokens[10:17], 10, cache)]
    parts += [model.forward(tokens[t : t + 1], t, cache) for t in range(17, 24)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("numerics", ["exact", "llamacpp"])
def test_split_equals_whole(files, numerics):
    """Layers [0, 2) then [2, 4), each with its own state (a DeltaNet and an attention layer on either side)."""
    whole = ggufpy.load(files["hybrid_f32"], backend="numpy", numerics=numerics)
    first = ggufpy.load(files["hybrid_f32"], backend="numpy", numerics=numerics, layers=range(0, 2))
    second = ggufpy.load(files["hybrid_f32"], backend="numpy", numerics=numerics, layers=range(2, 4))
    tokens = np.random.default_rng(2).integers(3, 269, 12)
    ref_cache, a, b = whole.new_cache(capacity=16), first.new_cache(capacity=16), second.new_cache(capacity=16)
    assert isinstance(a, HybridState) and a.recurrent_layers == [0] and list(a.kv.k) == [1]
    ref = whole.forward(tokens, 0, ref_cache)
    split = second.forward(first.forward(tokens, 0, a), 0, b)
    assert np.array_equal(split, ref)
    step = second.forward(first.forward(np.array([5]), 12, a), 12, b)  # and a decode step after it
    assert np.array_equal(step, whole.forward(np.array([5]), 12, ref_cache))


def test_decode_batch_rows_equal_single_decodes(files):
    model = ggufpy.load(files["hybrid_f32"], backend="numpy", numerics="llamacpp")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 269, n) for n in (5, 9)]
    batch_caches, single_caches = [], []
    for p in prompts:
        for caches in (batch_caches, single_caches):
            caches.append(model.new_cache(capacity=16))
            model.forward(p, 0, caches[-1])
    logits = model.decode_batch([7, 8], [5, 9], batch_caches)
    for b, (tok, pos) in enumerate([(7, 5), (8, 9)]):
        assert np.array_equal(logits[b], model.forward(np.array([tok]), pos, single_caches[b])[-1])
    for bc, sc in zip(batch_caches, single_caches, strict=True):
        assert all(np.array_equal(bc.ssm[i], sc.ssm[i]) and np.array_equal(bc.conv[i], sc.conv[i]) for i in (0, 2))


# -- the per-sequence state ---------------------------------------------------------------------------------


def test_state_continues_only_at_its_end_and_restarts_at_zero(files):
    model = ggufpy.load(files["hybrid_f32"], backend="numpy", numerics="exact")
    tokens = np.random.default_rng(4).integers(3, 269, 8)
    cache = model.new_cache(capacity=16)
    first = model.forward(tokens, 0, cache)
    assert cache.length == 8 and np.abs(cache.ssm[0]).max() > 0 and cache.conv[2].shape == (3, 512)
    with pytest.raises(ValueError, match="position 4: a recurrent state continues a sequence only at its end"):
        model.forward(tokens[4:], 4, cache)
    assert np.array_equal(model.forward(tokens, 0, cache), first)  # restarting at 0 ignores the old state
    cache.truncate(5)  # a recurrent state cannot drop positions: the sequence is cleared
    assert cache.length == 0 and not np.any(cache.ssm[0]) and not np.any(cache.conv[0])
    assert np.array_equal(model.forward(tokens, 0, cache), first)
    cache.truncate(8)  # keeping every position is allowed
    assert cache.length == 8


class _FailAt(dict):
    """A trace that raises when the forward pass records `name`: a call failing part way through the layers."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __setitem__(self, key, value):
        if key == self.name:
            raise RuntimeError(f"failed at {key}")
        super().__setitem__(key, value)


def test_a_failed_call_leaves_the_state_as_it_was(files):
    model = ggufpy.load(files["hybrid_f32"], backend="numpy", numerics="exact")
    tokens = np.random.default_rng(9).integers(3, 269, 10)
    cache, reference = model.new_cache(capacity=16), model.new_cache(capacity=16)
    model.forward(tokens[:6], 0, cache)
    model.forward(tokens[:6], 0, reference)
    before = {i: (cache.conv[i].copy(), cache.ssm[i].copy()) for i in (0, 2)}
    with pytest.raises(RuntimeError, match="failed at l_out-2"):  # after both DeltaNet layers ran
        model.forward(tokens[6:], 6, cache, trace=_FailAt("l_out-2"))
    assert cache.length == 6
    assert all(np.array_equal(cache.conv[i], c) and np.array_equal(cache.ssm[i], s) for i, (c, s) in before.items())
    assert np.array_equal(model.forward(tokens[6:], 6, cache), model.forward(tokens[6:], 6, reference))


def test_state_resized_continues_identically(files):
    model = ggufpy.load(files["hybrid_f32"], backend="numpy", numerics="exact")
    tokens = np.random.default_rng(5).integers(3, 269, 6)
    small = model.new_cache(capacity=6)
    model.forward(tokens, 0, small)
    with pytest.raises(ggufpy.ContextLengthError if hasattr(ggufpy, "ContextLengthError") else ValueError):
        model.forward(np.array([9]), 6, small)
    grown = small.resized(12)
    assert grown.capacity == 12 and grown.length == 6 and grown.nbytes > small.nbytes
    reference = model.new_cache(capacity=12)
    model.forward(tokens, 0, reference)
    assert np.array_equal(model.forward(np.array([9]), 6, grown), model.forward(np.array([9]), 6, reference))


def test_state_size_counts_every_layer_kind(files):
    model = ggufpy.load(files["hybrid_f32"], backend="numpy", numerics="exact")
    cache = model.new_cache(capacity=10)
    kv = 2 * 2 * 10 * 2 * 32 * 4  # k and v, 2 attention layers, 10 positions, 2 kv heads of 32 floats
    recurrent = 2 * (3 * 512 + 4 * 64 * 64) * 4  # 2 DeltaNet layers: conv (K-1, C) and state (B, S, S)
    assert cache.nbytes == kv + recurrent


def test_run_cli_generates_on_the_numpy_backend(files, capsys):
    from ggufpy.cli import main

    path = str(files["hybrid_f32"])
    assert main(["run", "-m", path, "-p", "hello world", "-n", "6", "--backend", "numpy", "--temp", "0"]) == 0
    out = capsys.readouterr()
    assert "generated 6 tokens" in out.out + out.err


def test_load_refuses_a_mixer_weight_the_backend_cannot_multiply_by(tmp_path):
    """The DeltaNet tensors are checked at load like the others (Q8_K: an activation format, no vec_dot)."""
    from ggufpy.constants import GGMLType
    from ggufpy.errors import GGUFUnsupportedError

    types = dict.fromkeys(("embd", "output", "attn", "ffn", "ssm"), GGMLType.F32) | {"ssm_out": GGMLType.Q8_K}
    path = write_tiny_qwen35(tmp_path / "q8k.gguf", TinyQwen35(hidden_dim=256, state_size=64, types=types))
    with pytest.raises(GGUFUnsupportedError, match=r"blk\.0\.ssm_out\.weight.*Q8_K.*cannot multiply by"):
        ggufpy.load(path, backend="numpy", numerics="llamacpp")


@pytest.mark.slow
def test_numba_backend_runs_the_hybrid_blocks(files):
    """The numba backend has no fused block for hybrid layers: `Model.block` runs them with its products and
    attention (the numba kernels compile on first use: tens of seconds)."""
    tokens = np.random.default_rng(8).integers(3, 269, 20)
    results = []
    for backend in ("numpy", "numba"):
        model = ggufpy.load(files["hybrid_f32"], backend=backend, numerics="exact")
        cache = model.new_cache(capacity=32)
        logits = model.forward(tokens, 0, cache)
        greedy = [int(np.argmax(logits[-1]))]
        for _ in range(7):
            greedy.append(int(np.argmax(model.forward(np.array(greedy[-1:]), cache.length, cache)[-1])))
        results.append((logits, greedy))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-4, atol=1e-4)
    assert results[1][1] == results[0][1]
