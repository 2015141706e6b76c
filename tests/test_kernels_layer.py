"""`ggufpy.kernels.layer.decode_block`: one compiled call per decode block, bit-identical to `Model.block`.

Each test loads the same model twice, one with the fused block switched off (`Model.decode_block = None`) and
one as the transformer runs it, runs a 5-token prefill and 8 decode steps on both, and requires equal logits
and KV caches (`np.array_equal`).
"""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from conformance.fixtures import ROLES, TinyLlama, write_tiny_llama
from ggufpy.constants import GGMLType
from ggufpy.kernels import layer
from ggufpy.kernels._numba import DISABLED
from ggufpy.quants import quant_type
from tests.models import gemma3_path, smollm2_path

PROMPT = [5, 17, 3, 42, 9]
N_DECODE = 8


@pytest.fixture(autouse=True)
def compile_in_foreground(monkeypatch):
    """The first decode_block call compiles the block before returning (not on a background thread), so that
    every decode block goes through the fused call; `test_background_switch` covers the background path."""
    monkeypatch.setattr(layer, "BACKGROUND", False)


def plain(model):
    """`model` without the fused decode block: every block through `Model.block`."""
    model.decode_block = None
    return model


def counted(model, calls: list):
    """`model` with its backend's fused decode block (as the transformer calls it), recording the layers it
    computed (those where it did not return None)."""
    fused = model.decode_block

    def decode_block(config, w, i, h, pos, cos, sin, cache):
        out = fused(config, w, i, h, pos, cos, sin, cache)
        if out is not None:
            calls.append(i)
        return out

    model.decode_block = decode_block
    return model


def decode(model, prompt=PROMPT, n=N_DECODE):
    cache = model.new_cache(capacity=len(prompt) + n + 3)
    logits = [model.forward(np.asarray(prompt), 0, cache)]
    for t in range(n):
        logits.append(model.forward(np.asarray([prompt[t % len(prompt)] + t]), len(prompt) + t, cache))
    return logits, cache


def assert_same(path, threads=2, prompt=PROMPT):
    ref = plain(ggufpy.load(path, backend="numba", tokenizer=False, threads=threads))
    calls: list[int] = []
    fast = counted(ggufpy.load(path, backend="numba", tokenizer=False, threads=threads), calls)
    la, ca = decode(ref, prompt)
    lb, cb = decode(fast, prompt)
    assert len(calls) == N_DECODE * ref.config.n_layers  # every decode block went through the fused call
    for step, (a, b) in enumerate(zip(la, lb, strict=True)):
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"
    for i in ca.layers:
        assert np.array_equal(ca.k[i], cb.k[i]), f"K of layer {i}"
        assert np.array_equal(ca.v[i], cb.v[i]), f"V of layer {i}"
    assert ca.length == cb.length


def needs_ggml(types: dict) -> bool:
    """Whether writing these weights takes ggml's quantizer (llama-cpp-python): ggufpy quantizes only the
    32-element types itself (`conformance.fixtures._quantize`)."""
    return any(quant_type(t).quantize_blocks is None for t in types.values())


def uniform(t: GGMLType) -> dict:
    return dict.fromkeys(ROLES, t)


WIDE = TinyLlama(dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2)
# K/V of 32 rows: half a group, so the stacked Q/K/V has padded groups in the middle
NARROW = TinyLlama(dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=1)

CASES = {
    "Q4_0": (WIDE, uniform(GGMLType.Q4_0)),
    "Q4_1": (WIDE, uniform(GGMLType.Q4_1)),
    "Q8_0": (WIDE, uniform(GGMLType.Q8_0)),
    "Q4_K": (WIDE, uniform(GGMLType.Q4_K)),
    "Q6_K": (WIDE, uniform(GGMLType.Q6_K)),
    "Q5_K": (WIDE, uniform(GGMLType.Q5_K)),
    # mixes: V and ffn_down in other families than the rest (partial stacks: 2 Q/K/V products)
    "Q4_K+Q6_K": (WIDE, {**uniform(GGMLType.Q4_K), "attn_v": GGMLType.Q6_K, "ffn_down": GGMLType.Q6_K}),
    "Q4_0+Q8_0": (NARROW, {**uniform(GGMLType.Q4_0), "attn_v": GGMLType.Q8_0, "ffn_up": GGMLType.Q8_0}),
    "Q5_0/narrow": (NARROW, uniform(GGMLType.Q5_0)),
    # all three families in one layer, Q/K/V as three separate products
    "three": (
        WIDE,
        {
            **uniform(GGMLType.Q4_K),
            "attn_k": GGMLType.Q6_K,
            "attn_v": GGMLType.Q8_0,
            "attn_output": GGMLType.Q6_K,
            "ffn_gate": GGMLType.Q8_0,
            "ffn_down": GGMLType.Q4_1,
        },
    ),
}


# with NUMBA_DISABLE_JIT=1 (plain Python kernels, slow) one narrow mixed case covers the code paths
SLOW = set() if not DISABLED else set(CASES) - {"Q4_0+Q8_0"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layer")


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_models_bit_identical(tiny_dir, name):
    if name in SLOW:
        pytest.skip("plain Python kernels (NUMBA_DISABLE_JIT): covered by the other cases")
    spec, types = CASES[name]
    if needs_ggml(types):  # k-quant fixtures are quantized by ggml's own quantizer
        pytest.importorskip("llama_cpp", reason="writing k-quant weights needs ggml's quantizer")
    types = {**types, "embd": GGMLType.Q8_0, "output": GGMLType.Q8_0}
    path = write_tiny_llama(tiny_dir / f"{name.replace('/', '_')}.gguf", TinyLlama(**{**vars(spec), "types": types}))
    assert_same(path)


def test_one_thread(tiny_dir):
    if DISABLED:
        pytest.skip("plain Python kernels (NUMBA_DISABLE_JIT): threads do not apply")
    spec, types = CASES["three"]
    if needs_ggml(types):
        pytest.importorskip("llama_cpp", reason="writing k-quant weights needs ggml's quantizer")
    path = write_tiny_llama(tiny_dir / "one-thread.gguf", TinyLlama(**{**vars(spec), "types": types}))
    assert_same(path, threads=1)


def test_smollm2_bit_identical():
    if DISABLED:
        pytest.skip("SmolLM2 in plain Python kernels (NUMBA_DISABLE_JIT) takes minutes")
    assert_same(smollm2_path())


def test_falls_back(tiny_dir):
    spec, types = CASES["Q4_0"]
    path = write_tiny_llama(tiny_dir / "fallback.gguf", TinyLlama(**{**vars(spec), "types": types}))
    model = ggufpy.load(path, backend="numba", tokenizer=False)
    cfg, w = model.config, model.weights.layers[0]
    assert layer.can_fuse(cfg, w, model.backend)
    cache = model.new_cache(capacity=8)
    cos, sin = model.numerics.rope_angles(np.arange(2), cfg.rope_dim, *cfg.rope(0))
    h = np.ones((2, cfg.dim), np.float32)
    assert layer.decode_block(model.backend, cfg, w, 0, h, 0, cos, sin, cache) is None  # T > 1
    assert not cache.k[0].any()
    # other numerics, other backends
    other = ggufpy.load(path, backend="numba", tokenizer=False, numerics="llamacpp")
    assert not layer.can_fuse(other.config, other.weights.layers[0], other.backend)
    numpy_model = ggufpy.load(path, backend="numpy", tokenizer=False)
    assert not layer.can_fuse(numpy_model.config, numpy_model.weights.layers[0], numpy_model.backend)
    # float weights are not packed
    floats = write_tiny_llama(tiny_dir / "f32.gguf", TinyLlama(**{**vars(spec), "types": uniform(GGMLType.F32)}))
    f32 = ggufpy.load(floats, backend="numba", tokenizer=False)
    assert not layer.can_fuse(f32.config, f32.weights.layers[0], f32.backend)
    assert (
        layer.decode_block(
            f32.backend, f32.config, f32.weights.layers[0], 0, h[:1], 0, cos[:1], sin[:1], f32.new_cache(capacity=4)
        )
        is None
    )


@pytest.mark.parametrize("arch", ["gemma3", "qwen3", "gemma"])
def test_optional_steps_bit_identical(tiny_dir, arch):
    """Q/K norms per head (qwen3, gemma3), Q scaled after RoPE and GELU (gemma, gemma3), post-norms and a
    sliding window on the local layers (gemma3: 2 of its 7 layers are global; the window of 4 is shorter than
    the decode, so it cuts keys off) all go through the fused call, bit for bit `Model.block`."""
    if DISABLED:
        pytest.skip("plain Python kernels (NUMBA_DISABLE_JIT): covered by the llama cases")
    gemma3 = arch == "gemma3"
    spec = TinyLlama(
        arch=arch,
        dim=256,
        hidden_dim=512,
        n_layers=7 if gemma3 else 2,
        n_heads=4,
        n_kv_heads=2,
        tied_output=True,
        sliding_window=4 if gemma3 else None,
        types={**uniform(GGMLType.Q4_0), "attn_v": GGMLType.Q8_0, "embd": GGMLType.Q8_0},
    )
    path = write_tiny_llama(tiny_dir / f"{arch}.gguf", spec)
    model = ggufpy.load(path, backend="numba", tokenizer=False)
    assert layer.can_fuse(model.config, model.weights.layers[0], model.backend)
    if gemma3:
        assert [model.config.window(i) for i in range(7)] == [4] * 5 + [None] + [4]
    assert_same(path)


def test_gemma3_bit_identical():
    if DISABLED:
        pytest.skip("Gemma 3 in plain Python kernels (NUMBA_DISABLE_JIT) takes minutes")
    assert_same(gemma3_path())


def test_background_switch(tiny_dir, monkeypatch):
    """While the block compiles in the background the layers run through `Model.block`, then through the
    fused call: the switch in mid-decode changes no value. Readiness is scripted here (the first 6 calls say
    "not yet"), so the test does not depend on how fast the compile is."""
    if DISABLED:
        pytest.skip("plain Python kernels (NUMBA_DISABLE_JIT): nothing to compile")
    monkeypatch.setattr(layer, "BACKGROUND", True)
    real = layer.compiled_in_background
    asked = []

    def scripted(kernel, args, wait=False):
        asked.append(kernel)
        return len(asked) > 6 and real(kernel, args, wait=True)

    monkeypatch.setattr(layer, "compiled_in_background", scripted)
    spec, types = CASES["Q4_0+Q8_0"]
    path = write_tiny_llama(tiny_dir / "switch.gguf", TinyLlama(**{**vars(spec), "types": types}))
    ref = plain(ggufpy.load(path, backend="numba", tokenizer=False))
    calls: list[int] = []
    fast = counted(ggufpy.load(path, backend="numba", tokenizer=False), calls)
    la, ca = decode(ref)
    lb, cb = decode(fast)
    n_layers = ref.config.n_layers
    assert 0 < len(calls) < N_DECODE * n_layers  # some decode blocks unfused, the later ones fused
    assert calls == list(range(n_layers)) * (len(calls) // n_layers)
    for step, (a, b) in enumerate(zip(la, lb, strict=True)):
        assert np.array_equal(a, b), f"step {step}"
    for i in ca.layers:
        assert np.array_equal(ca.k[i], cb.k[i]) and np.array_equal(ca.v[i], cb.v[i])
