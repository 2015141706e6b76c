"""`ggufpy.kernels.layer_ggml.decode_block`: one compiled call per decode block in the llamacpp numerics (ggml's
integer products), bit-identical to `Model.block`.

As tests/test_kernels_layer.py: the same model loaded twice, the fused block switched off in one, a 5-token
prefill and 8 decode steps on both, equal logits and KV caches (`np.array_equal`), and every decode block of
the second went through the fused call. Gemma-style blocks (Q/K norms, Q scaling, GELU, post-norms, windows):
synthetic gemma/gemma2/gemma3/qwen3 layers and Gemma 3 270M.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ggufpy
from conformance.fixtures import ROLES, TinyLlama, fixture_path, write_tiny_llama
from ggufpy.constants import GGMLType
from ggufpy.kernels import int8dot, layer_ggml, layer_ggml_steps
from ggufpy.kernels._numba import DISABLED
from ggufpy.numerics import gelu_tanh_ggml
from ggufpy.quants import quant_type
from tests.models import gemma3_path, smollm2_path

if DISABLED or not int8dot.AVAILABLE:
    pytest.skip("the integer kernels need numba and AVX2", allow_module_level=True)

PROMPT = [5, 17, 3, 42, 9]
N_DECODE = 8
MODES = ["llamacpp", "llamacpp-avx2"]


@pytest.fixture(autouse=True)
def compile_in_foreground(monkeypatch):
    """The first decode_block call compiles the block before returning, so that every decode block goes
    through the fused call; `test_background_switch` covers the background path."""
    monkeypatch.setattr(layer_ggml, "BACKGROUND", False)


def load(path, mode, threads=2):
    return ggufpy.load(path, backend="numba", numerics=mode, tokenizer=False, threads=threads)


def counted(model, calls: list):
    """`model` whose fused decode block records the layers it computed (where it did not return None)."""
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


def assert_same(ref, fast, calls, fused_layers=None):
    """`ref` (fused block off) and `fast` (counted) decode alike, and `fast` fused every decode block."""
    la, ca = decode(ref)
    lb, cb = decode(fast)
    n_layers = ref.config.n_layers if fused_layers is None else fused_layers
    assert len(calls) == N_DECODE * n_layers, calls
    if fused_layers is None:  # every layer of every decode step, in order
        assert calls == list(range(n_layers)) * N_DECODE, calls
    for step, (a, b) in enumerate(zip(la, lb, strict=True)):
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"
    for i in ca.layers:
        assert np.array_equal(ca.k[i].view(np.uint16), cb.k[i].view(np.uint16)), f"K of layer {i}"
        assert np.array_equal(ca.v[i].view(np.uint16), cb.v[i].view(np.uint16)), f"V of layer {i}"
    assert ca.length == cb.length


def assert_file_same(path, mode="llamacpp", threads=2):
    ref = load(path, mode, threads)
    ref.decode_block = None
    calls: list[int] = []
    assert_same(ref, counted(load(path, mode, threads), calls), calls)


# The committed fixtures (conformance/fixtures.py: dim 64-256, every layer in one type): each activation format
# (Q8_0, Q8_1, Q8_K) and kernel family, the eight-row group copies (Q4_0, Q4_K, Q8_0, MXFP4) and the GGUF rows.
FIXTURES = ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "tq2_0", "iq2_xxs", "mxfp4", "nvfp4", "q1_0", "q4_k_m"]
MORE = ["q5_0", "q5_1", "q5_k", "q3_k", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0"]


@pytest.mark.parametrize("name", FIXTURES + [pytest.param(n, marks=pytest.mark.slow) for n in MORE] + ["smollm2_mix"])
def test_fixtures_bit_identical(name):
    assert_file_same(fixture_path(name))


@pytest.mark.parametrize("name", ["q4_k_m", "iq1_m", "mxfp4"])
def test_fixtures_avx2(name):
    assert_file_same(fixture_path(name), "llamacpp-avx2")


def test_one_thread():
    assert_file_same(fixture_path("q4_k_m"), threads=1)


def _mix_types() -> dict:
    """One layer of five kernel families, all three activation formats on the Q/K/V input (Q4_K: Q8_K, MXFP4:
    Q8_0, Q4_1: Q8_1), a Q8_1 and a Q8_0 type on one more input each."""
    return {
        **dict.fromkeys(ROLES, GGMLType.Q8_0),
        "attn_q": GGMLType.Q4_K,
        "attn_k": GGMLType.MXFP4,
        "attn_v": GGMLType.Q4_1,
        "attn_output": GGMLType.Q5_1,
        "ffn_gate": GGMLType.IQ2_XXS,
        "ffn_up": GGMLType.NVFP4,
        "ffn_down": GGMLType.TQ2_0,
    }


def test_mixed_layer(tmp_path):
    from ggufpy.kernels import int8ir_fp4

    types = _mix_types()
    if any(quant_type(t).quantize_blocks is None for t in types.values()):
        pytest.importorskip("llama_cpp", reason="writing k-quant and IQ weights needs ggml's quantizer")
    # 8 heads of 36, one KV head: K/V of 36 rows (MXFP4's vec_dot, not its eight-row groups), Q and O 288 wide
    spec = TinyLlama(dim=256, hidden_dim=512, n_layers=2, n_heads=8, n_kv_heads=1, key_length=36, types=types)
    path = write_tiny_llama(tmp_path / "mix.gguf", spec)
    model = load(path, "llamacpp")
    assert model.backend.int8_weight(model.weights.layers[0].attn_k).kernel is int8ir_fp4.mxfp4_kernel
    assert_file_same(path)


def test_sliding_window():
    """Layers with a window (a window of 3 on every other layer, put into the config): the attention masks them."""
    path = fixture_path("q4_0")
    models = [load(path, "llamacpp") for _ in range(2)]
    for m in models:
        cfg = m.config
        m.config = dataclasses.replace(cfg, sliding_window=3, arch=dataclasses.replace(cfg.arch, swa_pattern=2))
    assert models[0].config.window(0) == 3 and models[0].config.window(1) is None
    models[0].decode_block = None
    calls: list[int] = []
    assert_same(models[0], counted(models[1], calls), calls)


@pytest.mark.parametrize("mode", MODES)
def test_smollm2_bit_identical(mode):
    assert_file_same(smollm2_path(), mode)


# -- Gemma-style blocks: Q/K norms per head, Q scaling, GELU, post-norms, sliding windows ---------------------------


def gemma_like(directory, arch: str, attn_softcap: float | None = None):
    """A synthetic `arch` model (Q4_0, V in Q8_0: Q8_0 activations; Q4_1 down: Q8_1 ones): gemma3 (Q/K norms
    per head, Q scaling, GELU, post-norms; a window of 4 on 6 of its 7 layers, over 13 positions), gemma2
    (post-norms, Q scaling, GELU, a window of 4 on every other layer, a final softcap; `attn_softcap` on the
    attention), gemma (Q scaling, GELU), qwen3 (Q/K norms per head, SiLU)."""
    windowed = arch in ("gemma2", "gemma3")
    spec = TinyLlama(
        arch=arch, dim=256, hidden_dim=512, n_layers=7 if arch == "gemma3" else 4 if arch == "gemma2" else 2,
        n_heads=4, n_kv_heads=2, tied_output=arch.startswith("gemma"), sliding_window=4 if windowed else None,
        attn_softcap=attn_softcap, final_softcap=8.0 if arch == "gemma2" else None,
        types={**dict.fromkeys(ROLES, GGMLType.Q4_0), "attn_v": GGMLType.Q8_0, "ffn_down": GGMLType.Q4_1,
               "embd": GGMLType.Q8_0, "output": GGMLType.Q8_0},
    )  # fmt: skip
    name = f"{arch}{'_softcap' if attn_softcap else ''}.gguf"
    path = directory / name
    return path if path.exists() else write_tiny_llama(path, spec)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layer_ggml_gemma")


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "gemma", "qwen3"])
@pytest.mark.parametrize("mode", MODES)
def test_gemma_steps_bit_identical(gemma_dir, arch, mode):
    """Each optional step goes through the fused call, bit for bit `Model.block`: the windows (gemma3: layers
    0-4 and 6; gemma2: 0 and 2) cut keys off during the 13 positions."""
    path = gemma_like(gemma_dir, arch)
    model = load(path, mode)
    cfg, w = model.config, model.weights.layers[0]
    assert layer_ggml.can_fuse(cfg, w, model.backend)
    assert (w.attn_q_norm is not None) == (arch in ("gemma3", "qwen3"))
    assert (w.post_ffw_norm is not None) == (arch in ("gemma2", "gemma3"))
    assert cfg.arch.scale_q == arch.startswith("gemma")
    if arch == "gemma3":
        assert [cfg.window(i) for i in range(7)] == [4] * 5 + [None, 4]
    silu = {"llamacpp": layer_ggml_steps.ACT_PLAIN, "llamacpp-avx2": layer_ggml_steps.ACT_LANES}[mode]
    kind = layer_ggml_steps.ACT_TABLE if cfg.arch.activation == "gelu_tanh" else silu  # the activation's kernel
    assert layer_ggml.fused_layer(model.backend, cfg, w).dims[4] == kind
    assert_file_same(path, mode)


def test_gemma2_attention_softcap_falls_back(gemma_dir):
    """An attention softcap (gemma2's files) has no compiled x86 kernel: `Model.block` runs those layers."""
    path = gemma_like(gemma_dir, "gemma2", attn_softcap=5.0)
    model = load(path, "llamacpp-avx2")
    assert model.config.attn_softcap == 5.0
    assert not layer_ggml.can_fuse(model.config, model.weights.layers[0], model.backend)
    calls: list[int] = []
    decode(counted(model, calls), n=2)
    assert calls == []


def test_gelu_matches_numerics():
    """The fused blocks' GELU (`layer_ggml_steps.gelu_ggml`) equals the numerics' NumPy `gelu_tanh_ggml` bit for bit:
    every f16 value, random f32 values around the table's range, its ends, infinities and NaNs."""
    rng = np.random.default_rng(1)
    every_f16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    ends = np.float32([-10, 10, 9.999999, -9.999999, 10.000001, -10.000001, 65504, 65520, -65520, 1e-8, -1e-8])
    ends = np.concatenate([ends, np.float32([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0])])
    normal = (rng.standard_normal(50_000) * 3).astype(np.float32)
    x = np.concatenate([ends, every_f16, rng.uniform(-12, 12, 100_000).astype(np.float32), normal])
    x = x[: len(x) // 64 * 64].reshape(-1, 64)  # rows of 64
    with np.errstate(invalid="ignore"):
        expected = gelu_tanh_ggml(x)
    got = layer_ggml_steps.gelu_ggml(x)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("mode", MODES)
def test_prefill_gelu_compiled_matches_numpy_backend(gemma_dir, mode):
    """Outside the fused block (a prefill, the batched rows' unfused layers) `Model.feed_forward` runs the compiled
    GELU (`NumbaBackend.compiled`), one call on all rows: logits equal the NumPy backend's, bit for bit."""
    path = gemma_like(gemma_dir, "gemma3")
    model = load(path, mode)
    assert model.compiled[gelu_tanh_ggml] is layer_ggml_steps.gelu_ggml
    assert layer_ggml_steps.gelu_ggml in model.backend.row_invariant
    ids = np.array([5, 60, 7, 200, 31, 9, 17, 4, 88, 3, 11, 12, 13])  # 13 positions: windows of 4 cut keys off
    ref = ggufpy.load(path, backend="numpy", numerics=mode, tokenizer=False).logits(ids)
    got = model.logits(ids)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"max |diff| {np.abs(got - ref).max()}"


@pytest.mark.parametrize("threads", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_gemma3_bit_identical(threads):
    """Gemma 3 270M (Q5_0, Q8_0, Q4_K, Q6_K; Q/K norms, Q scaling, GELU, post-norms, a window of 512 on 15 of
    its 18 layers): every decode block through the fused call, bit for bit `Model.block`."""
    assert_file_same(gemma3_path(), "llamacpp-avx2", threads)


@pytest.mark.slow
def test_gemma3_bit_identical_avx512_replay():
    assert_file_same(gemma3_path(), "llamacpp")


def test_every_integer_type_resolves():
    """Every type with an integer kernel gets a fused product: a jitted kernel and its argument family (Q8_K
    activations: q, d, bsums; Q8_0 / Q8_1: q, d, s, asum, or q, d, asum behind the FP4 wrappers), for weights
    as stored (12 rows) and as eight-row groups (8 rows)."""
    from tests.test_kernels_int8 import random_weight

    steps = layer_ggml_steps
    rng = np.random.default_rng(3)
    seen = set()
    for t, (fmt, _size, block) in int8dot.INT8_TYPES.items():
        for rows in (8, 12):
            iw = int8dot.weight(random_weight(t, rows, max(256, block), rng))
            if iw is None:  # Q4_K of 12 rows: the f32-lane kernels
                assert t == GGMLType.Q4_K and rows % 8
                continue
            kernel, family, args = steps._product_kernel(iw)
            assert kernel.py_func is not None
            assert (family == steps.FAM_K) == (fmt == int8dot.Q8_K), t
            assert len(args) == {steps.FAM_K: 3, steps.FAM_Q0: 4, steps.FAM_ASUM: 3}[family]
            seen.add(family)
    assert seen == {steps.FAM_K, steps.FAM_Q0, steps.FAM_ASUM}


def test_f16_bits_match_numpy():
    """The cache write's f32 -> f16 bits equal NumPy's `astype(np.float16)` (what `cache.update` stores): normal,
    subnormal, overflowing, tied and NaN values."""
    from numba import njit

    @njit
    def convert(x, out):
        for i in range(x.size):
            out[i] = layer_ggml_steps._f16_bits(x[i])

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFF802000, 0x7FC00000, 0x7FFFFFFF, 0x7F801FFF]
    ties = [0x3F801000, 0x3F803000, 0x33000000, 0x33000001, 0x387FE000, 0x38800000, 0x477FF000, 0x477FEFFF]
    x = np.concatenate([bits, np.array(special + ties, np.uint32)]).view(np.float32)
    x = np.concatenate([x, (x.view(np.uint32) & 0x8FFFFFFF).view(np.float32)])  # and many more small magnitudes
    out = np.empty(x.size, np.uint16)
    convert(x, out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out, x.astype(np.float16).view(np.uint16))


def test_falls_back():
    """Outside the scope: nothing computed, nothing written."""
    path = fixture_path("q4_k")  # heads of 64: a Q8_0 cache takes them
    exact = ggufpy.load(path, backend="numba", tokenizer=False)
    assert not layer_ggml.can_fuse(exact.config, exact.weights.layers[0], exact.backend)
    model = load(path, "llamacpp")
    cfg, w = model.config, model.weights.layers[0]
    assert layer_ggml.can_fuse(cfg, w, model.backend)
    cos, sin = model.numerics.rope_angles(np.arange(2), cfg.rope_dim, *cfg.rope(0))
    h = np.ones((2, cfg.dim), np.float32)
    cache = model.new_cache(capacity=8)
    assert layer_ggml.decode_block(model.backend, cfg, w, 0, h, 0, cos, sin, cache) is None  # T > 1
    q8 = model.new_cache(capacity=8, kv_type="q8_0")
    assert layer_ggml.decode_block(model.backend, cfg, w, 0, h[:1], 0, cos[:1], sin[:1], q8) is None
    assert not cache.k[0].any() and not q8.k[0].any()
    # a type without an integer kernel (IQ4_NL: the f32-lane kernels), float weights, the NumPy backend
    for name in ("iq4_nl", "f16"):
        other = load(fixture_path(name), "llamacpp")
        assert not layer_ggml.can_fuse(other.config, other.weights.layers[0], other.backend)
    numpy_model = ggufpy.load(path, backend="numpy", numerics="llamacpp", tokenizer=False)
    assert not layer_ggml.can_fuse(numpy_model.config, numpy_model.weights.layers[0], numpy_model.backend)
    # int8=False: the f32-lane kernels
    off = load(path, "llamacpp")
    off.backend.int8 = False
    assert not layer_ggml.can_fuse(off.config, off.weights.layers[0], off.backend)


def test_background_switch(monkeypatch):
    """While the block compiles in the background the layers run through `Model.block`, then through the fused
    call: the switch in mid-decode changes no value (readiness scripted: the first 6 calls say "not yet")."""
    monkeypatch.setattr(layer_ggml, "BACKGROUND", True)
    real = layer_ggml.compiled_in_background
    asked = []

    def scripted(kernel, args, wait=False):
        asked.append(kernel)
        return len(asked) > 6 and real(kernel, args, wait=True)

    monkeypatch.setattr(layer_ggml, "compiled_in_background", scripted)
    path = fixture_path("tq2_0")
    ref = load(path, "llamacpp")
    ref.decode_block = None
    calls: list[int] = []
    fast = counted(load(path, "llamacpp"), calls)
    la, ca = decode(ref)
    lb, cb = decode(fast)
    n_layers = ref.config.n_layers
    assert 0 < len(calls) < N_DECODE * n_layers
    for step, (a, b) in enumerate(zip(la, lb, strict=True)):
        assert np.array_equal(a, b), f"step {step}"
    for i in ca.layers:
        assert np.array_equal(ca.k[i], cb.k[i]) and np.array_equal(ca.v[i], cb.v[i])
