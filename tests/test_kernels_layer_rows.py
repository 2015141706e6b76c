"""`ggufpy.kernels.layer_rows.decode_rows`: one compiled call per block of a batched pass, bit-identical to
`Model.block_rows` (so a batched row stays bit for bit its sequence decoded alone).

Each test runs the same passes on two loads of one model, one with the fused rows block switched off
(`Model.decode_rows = None`: every block through `block_rows`) and one with it, and requires equal logits
and KV caches (`np.array_equal`): prompt chunks of different lengths in one pass (several rows of one cache),
then decode steps of B = 3 and 8 sequences at mixed positions.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import ggufpy
from conformance.fixtures import TinyLlama, write_tiny_llama
from ggufpy.constants import GGMLType
from ggufpy.kernels import layer_rows
from ggufpy.kernels._numba import DISABLED
from tests.models import smollm2_path
from tests.test_kernels_layer import CASES, needs_ggml, uniform

pytestmark = pytest.mark.skipif(DISABLED, reason="plain Python kernels (NUMBA_DISABLE_JIT): nothing is fused")

PROMPTS = [[1, 2, 3], [7], [100, 200, 300, 400, 500, 600, 700], [42, 43], [9, 8, 7, 6, 5], [11] * 11, [5, 4], [600]]
STEPS = 3


@pytest.fixture(autouse=True)
def compile_in_foreground(monkeypatch):
    """The first call compiles the block before returning, so that every block goes through the fused call;
    `test_background_switch` covers the background path."""
    monkeypatch.setattr(layer_rows, "BACKGROUND", False)


def load(path, fused: bool, calls: list | None = None, **kwargs):
    """`path` on the numba backend with the fused rows block off, or on and counting the layers it computed
    (the backend's own `decode_rows` if it has one, else `layer_rows.decode_rows` on it)."""
    model = ggufpy.load(path, backend="numba", tokenizer=False, **kwargs)
    if not fused:
        model.decode_rows = None
        return model
    inner = model.decode_rows or functools.partial(layer_rows.decode_rows, model.backend)

    def decode_rows(*args):
        out = inner(*args)
        if out is not None and calls is not None:
            calls.append(args[2])
        return out

    model.decode_rows = decode_rows
    return model


def passes(model, sizes=(3, 8), steps=STEPS, seed=0):
    """Logits of every pass and the caches: for each B, B sequences' prompts in one `prefill_batch` pass of
    chunks, then `steps` decode steps; each B on fresh caches, the sequences in a shuffled order."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    out, all_caches = [], []
    for B in sizes:
        order = rng.permutation(len(PROMPTS))[:B]
        caches = [model.new_cache(capacity=24) for _ in order]
        chunks = [np.asarray(PROMPTS[j]) % vocab for j in order]
        out.append(model.prefill_batch(chunks, [0] * B, caches))
        for step in range(steps):
            tokens = (np.argmax(out[-1], axis=1) + step) % vocab
            out.append(model.decode_batch(tokens, [c.length for c in caches], caches))
        all_caches += caches
    return out, all_caches


def assert_same(path, sizes=(3, 8), **kwargs):
    calls: list[int] = []
    ref, fast = load(path, False, **kwargs), load(path, True, calls, **kwargs)
    la, ca = passes(ref, sizes)
    lb, cb = passes(fast, sizes)
    n_layers = ref.config.n_layers
    assert calls == list(range(n_layers)) * (len(sizes) * (1 + STEPS))  # every block of every pass fused
    for n, (a, b) in enumerate(zip(la, lb, strict=True)):
        assert np.array_equal(a, b), f"pass {n}: max |diff| {np.abs(a - b).max()}"
    for x, y in zip(ca, cb, strict=True):
        assert x.length == y.length
        for i in x.layers:
            assert np.array_equal(x.k[i], y.k[i]), f"K of layer {i}"
            assert np.array_equal(x.v[i], y.v[i]), f"V of layer {i}"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layer_rows")


def tiny(tiny_dir, name: str):
    spec, types = CASES[name]
    if needs_ggml(types):  # k-quant fixtures are quantized by ggml's own quantizer
        pytest.importorskip("llama_cpp", reason="writing k-quant weights needs ggml's quantizer")
    types = {**types, "embd": GGMLType.Q8_0, "output": GGMLType.Q8_0}
    path = tiny_dir / f"{name.replace('/', '_')}.gguf"
    if not path.exists():
        write_tiny_llama(path, TinyLlama(**{**vars(spec), "types": types}))
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_models_bit_identical(tiny_dir, name):
    assert_same(tiny(tiny_dir, name))


def test_one_thread(tiny_dir):
    assert_same(tiny(tiny_dir, "Q4_0+Q8_0"), threads=1)


def test_smollm2_bit_identical():
    assert_same(smollm2_path())


def test_smollm2_rows_equal_alone():
    """The fused rows of one decode step equal each sequence decoded alone (the one-token forward pass)."""
    model = load(smollm2_path(), True)
    caches = [model.new_cache(capacity=24) for _ in PROMPTS]
    for prompt, cache in zip(PROMPTS, caches, strict=True):
        model.forward(np.asarray(prompt), 0, cache)
    alone = [model.new_cache(capacity=24) for _ in PROMPTS]
    for prompt, cache in zip(PROMPTS, alone, strict=True):
        model.forward(np.asarray(prompt), 0, cache)
    tokens = np.arange(len(PROMPTS)) + 30
    logits = model.decode_batch(tokens, [c.length for c in caches], caches)
    for b, cache in enumerate(alone):
        expected = model.forward(tokens[b : b + 1], cache.length, cache)
        assert np.array_equal(logits[b], expected[0]), f"row {b}"


def test_one_row(tiny_dir):
    """N = 1 (a model's one-row pass takes `forward` instead): the call itself equals `block_rows`."""
    model = load(tiny(tiny_dir, "Q4_0"), True)
    cfg, w = model.config, model.weights.layers[0]
    caches = [model.new_cache(capacity=8), model.new_cache(capacity=8)]
    for cache in caches:
        model.forward(np.asarray([3, 4, 5]), 0, cache)
    h = np.random.default_rng(1).standard_normal((1, cfg.dim)).astype(np.float32)
    cos, sin = model._angles({}, 0, [np.arange(3, 4)])
    expected = model.block_rows(h, 0, [3], cos, sin, caches[:1])
    got = layer_rows.decode_rows(model.backend, cfg, w, 0, h, [3], cos, sin, caches[1:])
    assert np.array_equal(got, expected)
    assert np.array_equal(caches[0].k[0], caches[1].k[0]) and np.array_equal(caches[0].v[0], caches[1].v[0])


def test_falls_back(tiny_dir):
    """Outside the scope the call returns None and writes nothing: other numerics, the NumPy backend, float
    weights, a Q8_0 KV cache."""
    path = tiny(tiny_dir, "Q4_0")
    h = np.ones((2, 256), np.float32)

    def fused(model, caches):
        cos, sin = model._angles({}, 0, [np.arange(0, 1)] * len(caches))
        w = model.weights.layers[0]
        return layer_rows.decode_rows(model.backend, model.config, w, 0, h, [0, 0], cos, sin, caches)

    exact = load(path, True)
    assert fused(exact, [exact.new_cache(capacity=4) for _ in range(2)]) is not None
    q8 = [exact.new_cache(capacity=4, kv_type="q8_0") for _ in range(2)]
    assert fused(exact, q8) is None and not any(c.k[0].any() for c in q8)
    other = ggufpy.load(path, backend="numba", tokenizer=False, numerics="llamacpp")
    caches = [other.new_cache(capacity=4) for _ in range(2)]
    assert fused(other, caches) is None and not any(c.k[0].any() for c in caches)
    numpy_model = ggufpy.load(path, backend="numpy", tokenizer=False)
    assert fused(numpy_model, [numpy_model.new_cache(capacity=4) for _ in range(2)]) is None
    spec = CASES["Q4_0"][0]
    floats = write_tiny_llama(tiny_dir / "f32.gguf", TinyLlama(**{**vars(spec), "types": uniform(GGMLType.F32)}))
    f32 = ggufpy.load(floats, backend="numba", tokenizer=False)
    assert fused(f32, [f32.new_cache(capacity=4) for _ in range(2)]) is None


def optional_steps_model(tiny_dir, arch: str):
    """A gemma3 (Q/K norms, Q scaling, GELU, post-norms; a window of 4 on 6 of its 7 layers, shorter than the
    prompts), qwen3 (Q/K norms) or gemma (Q scaling, GELU) fixture."""
    gemma3 = arch == "gemma3"
    spec = TinyLlama(
        arch=arch, dim=256, hidden_dim=512, n_layers=7 if gemma3 else 2, n_heads=4, n_kv_heads=2, tied_output=True,
        sliding_window=4 if gemma3 else None,
        types={**uniform(GGMLType.Q4_0), "attn_v": GGMLType.Q8_0, "embd": GGMLType.Q8_0},
    )  # fmt: skip
    return write_tiny_llama(tiny_dir / f"{arch}.gguf", spec)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3", "gemma"])
def test_optional_steps_bit_identical(tiny_dir, arch):
    assert_same(optional_steps_model(tiny_dir, arch))


def test_gemma3_rows_equal_alone(tiny_dir):
    """With the optional steps a batched row still equals its sequence decoded alone (the one-row fused block,
    `layer.py`, in `forward`), windows included."""
    model = load(optional_steps_model(tiny_dir, "gemma3"), True)
    vocab = model.config.vocab_size
    caches = [model.new_cache(capacity=24) for _ in PROMPTS]
    alone = [model.new_cache(capacity=24) for _ in PROMPTS]
    for prompt, cache, single in zip(PROMPTS, caches, alone, strict=True):
        model.forward(np.asarray(prompt) % vocab, 0, cache)
        model.forward(np.asarray(prompt) % vocab, 0, single)
    tokens = (np.arange(len(PROMPTS)) + 30) % vocab
    logits = model.decode_batch(tokens, [c.length for c in caches], caches)
    for b, cache in enumerate(alone):
        expected = model.forward(tokens[b : b + 1], cache.length, cache)
        assert np.array_equal(logits[b], expected[0]), f"row {b}"


def test_background_switch(tiny_dir, monkeypatch):
    """While the block compiles in the background the layers run through `block_rows`, then through the
    fused call: the switch in mid-pass changes no value. Readiness is scripted (the first 5 calls say "not
    yet"), so the test does not depend on how fast the compile is."""
    monkeypatch.setattr(layer_rows, "BACKGROUND", True)
    real = layer_rows.compiled_in_background
    asked = []

    def scripted(kernel, args, wait=False):
        asked.append(kernel)
        return len(asked) > 5 and real(kernel, args, wait=True)

    monkeypatch.setattr(layer_rows, "compiled_in_background", scripted)
    path = tiny(tiny_dir, "Q4_0+Q8_0")
    calls: list[int] = []
    ref, fast = load(path, False), load(path, True, calls)
    la, ca = passes(ref, sizes=(3,))
    lb, cb = passes(fast, sizes=(3,))
    n_layers = ref.config.n_layers
    assert 0 < len(calls) < (1 + STEPS) * n_layers  # some blocks through block_rows, the later ones fused
    for n, (a, b) in enumerate(zip(la, lb, strict=True)):
        assert np.array_equal(a, b), f"pass {n}"
    for x, y in zip(ca, cb, strict=True):
        assert all(np.array_equal(x.k[i], y.k[i]) and np.array_equal(x.v[i], y.v[i]) for i in x.layers)
