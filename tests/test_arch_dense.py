"""The dense architectures of issue 13 (mistral3, smollm3, granite, olmo2, phi3) and the pieces they brought:
RoPE scaling as data (YaRN, LongRoPE, the attention factor), NoPE layers, granite's multipliers, olmo2's
norms, phi3's fused tensors, and the block shared by `block` and `block_rows`.

The bit-exact comparisons with llama.cpp are the conformance goldens (tests/test_conformance.py); these are
the laws and the config, on the committed fixtures (conformance/fixtures/<arch>_f32.gguf).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest

import ggufpy
from conformance import fixtures as fx
from ggufpy import ops
from ggufpy.config import config_from_metadata
from ggufpy.errors import GGUFMetadataError
from ggufpy.kernels import AVAILABLE, JIT_DISABLED
from ggufpy.numerics import rope_angles_ggml

NEW = ["mistral3", "smollm3", "granite", "olmo2", "phi3", "exaone", "cohere2"]
LLAMA = {
    "general.architecture": "llama",
    "llama.context_length": 256,
    "llama.embedding_length": 64,
    "llama.block_count": 2,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
}


def load(arch: str, **kw):
    return ggufpy.load(fx.fixture_path(f"{arch}_f32"), tokenizer=False, **kw)


# -- config: RoPE scaling and multipliers as llama.cpp's context derives them ------------------------------------


def test_yarn_scaling_from_metadata():
    md = LLAMA | {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    md |= {"llama.rope.scaling.original_context_length": 64}
    cfg = config_from_metadata(md, 100)
    s = cfg.rope_scaling
    assert (s.type, s.freq_scale, s.ext_factor, s.orig_ctx) == ("yarn", 0.25, 1.0, 64)
    # get_mscale(4) / (1 + 0.1 ln 4): the magnitude correction ggml multiplies in, cancelled up to rounding
    assert abs(s.attn_factor - 1.0) < 1e-6
    ext = cfg.rope_ext(0)
    assert ext is not None and ext.ext_factor == 1.0 and 0 <= ext.corr_low < ext.corr_high <= cfg.rope_dim - 1
    # log multiplier (deepseek-style): get_mscale(4, 1) / get_mscale(4, 0.1), then the same cancellation
    logmul = config_from_metadata(md | {"llama.rope.scaling.yarn_log_multiplier": 0.1}, 100).rope_scaling
    expected = (0.1 * np.log(4) + 1) / (0.1 * 0.1 * np.log(4) + 1) / (1 + 0.1 * np.log(4))
    assert logmul.attn_factor == pytest.approx(expected, rel=1e-6)


def test_rope_scaling_none_ignores_the_factor_and_unknown_types_are_refused():
    """llama.cpp: type none means freq_scale 1 whatever the factor; an absent type means linear."""
    assert config_from_metadata(LLAMA | {"llama.rope.scaling.factor": 4.0}, 100).rope_freq_scale == 0.25
    md = LLAMA | {"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}
    assert config_from_metadata(md, 100).rope_freq_scale == 1.0
    with pytest.raises(GGUFMetadataError, match=r"rope\.scaling\.type = 'dynamic': must be one of none, linear"):
        config_from_metadata(LLAMA | {"llama.rope.scaling.type": "dynamic"}, 100)


def test_plain_rope_has_no_ext_and_longrope_attn_factor_has_one():
    assert config_from_metadata(LLAMA, 100).rope_ext(0) is None
    phi3 = load("phi3").config
    ext = phi3.rope_ext(0)
    assert ext.ext_factor == 0 and ext.attn_factor == pytest.approx(1.19) and phi3.long_factors()


def test_granite_needs_its_logit_scale():
    md = {k.replace("llama", "granite"): v for k, v in LLAMA.items()} | {"general.architecture": "granite"}
    with pytest.raises(GGUFMetadataError, match=r"granite\.logit_scale is required"):
        config_from_metadata(md, 100)
    cfg = load("granite").config
    assert (cfg.embedding_scale, cfg.residual_scale, cfg.logit_factor) == (12.0, pytest.approx(0.22), 0.5)
    assert cfg.attention_scale == pytest.approx(0.2)


def test_phi3_takes_the_long_factors_past_the_original_context(tmp_path):
    model = load("phi3")  # context 256 > original context 64
    assert np.array_equal(model.weights.rope_freqs, model.file.dequantize("rope_factors_long.weight"))
    spec = fx.ARCH_FIXTURES["phi3"]
    spec = replace(spec, extra_kv=(("rope.scaling.original_context_length", spec.context_length),))
    short = ggufpy.load(fx.write_tiny_llama(tmp_path / "phi3.gguf", spec), tokenizer=False)
    assert np.array_equal(short.weights.rope_freqs, short.file.dequantize("rope_factors_short.weight"))


# -- RoPE: YaRN in both numerics modes ---------------------------------------------------------------------------


def test_yarn_angles_mix_per_pair_and_scale_the_magnitude():
    pos, R, theta, fs = np.arange(50, 60), 16, 10000.0, 0.25
    low, high = ops.yarn_corr_dims(R, 4096, theta, 32.0, 1.0)
    assert (low, high) == (2.0, 6.0)
    ext = ops.RopeExt(1.0, 1.0, low, high)
    cos, sin = ops.rope_angles(pos, R, theta, fs, ext=ext)
    inv = theta ** (-np.arange(0, R, 2) / R)
    mix = np.clip(1 - (np.arange(R // 2) - low) / (high - low), 0, 1)  # 1 below pair 2, 0 above pair 6
    angle = np.outer(pos, inv) * (fs * (1 - mix) + mix)
    mscale = 1 + 0.1 * np.log(1 / fs)
    np.testing.assert_allclose(cos, np.cos(angle) * mscale, atol=2e-6)
    np.testing.assert_allclose(sin, np.sin(angle) * mscale, atol=2e-6)
    c2, s2 = rope_angles_ggml(pos, R, theta, fs, ext=ext)  # ggml's f32 steps: within rounding of the f64 ones
    np.testing.assert_allclose(c2, cos, atol=1e-5)
    np.testing.assert_allclose(s2, sin, atol=1e-5)
    plain, _ = ops.rope_angles(pos, R, theta, fs)
    assert not np.allclose(plain, cos, atol=1e-3)


# -- the block: features, fused-block predicate, laws ------------------------------------------------------------


def test_nope_layers_and_the_fused_block_predicate():
    cfg = load("smollm3").config
    assert [cfg.uses_rope(i) for i in range(4)] == [True, True, True, False]
    assert [cfg.fused_block(i) for i in range(4)] == [True, True, True, False]
    for arch in ("granite", "olmo2", "phi3"):
        assert not load(arch).config.fused_block(0), arch
    assert not load("mistral3").config.fused_block(0)  # temperature tuning scales Q per position


def test_smollm3_nope_layer_leaves_q_and_k_unrotated():
    model = load("smollm3")
    trace: dict[str, np.ndarray] = {}
    x = np.arange(5) + 10
    model.forward(x, 0, model.new_cache(capacity=8), trace=trace)
    w, cfg = model.weights.layers[3], model.config
    h = model.rms_norm(trace["l_out-2"], w.attn_norm, cfg.norm_eps)
    k = model.backend.linear(h, w.attn_k).reshape(5, cfg.n_kv_heads, cfg.head_dim)
    assert np.array_equal(trace["Kcur-3"], k)  # position 4's key as projected: no rotation
    k0 = model.backend.linear(model.rms_norm(trace["l_out-1"], model.weights.layers[2].attn_norm, cfg.norm_eps),
                              model.weights.layers[2].attn_k).reshape(5, cfg.n_kv_heads, cfg.head_dim)  # fmt: skip
    assert not np.array_equal(trace["Kcur-2"][1:], k0[1:])  # a RoPE layer rotates


@pytest.mark.parametrize("arch", NEW)
def test_decode_equals_prefill(arch):
    """Token by token through the cache equals one prefill (exact numerics, NumPy backend)."""
    model = load(arch, backend="numpy")
    tokens = np.random.default_rng(1).integers(3, 269, 12)
    full = model.logits(tokens)
    cache = model.new_cache(capacity=16)
    steps = [model.forward(tokens[t : t + 1], t, cache)[0] for t in range(len(tokens))]
    np.testing.assert_allclose(np.stack(steps), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", NEW)
def test_decode_batch_rows_equal_decode_alone(arch):
    """`block_rows` (decode_batch) gives each row bit for bit what `block` gives it alone."""
    model = load(arch, backend="numpy")
    prompts = [[5, 6, 7], [9], [20, 21, 22, 23, 24]]
    caches = []
    for p in prompts:
        c = model.new_cache(capacity=8)
        model.forward(np.asarray(p), 0, c)
        caches.append(c)
    alone = [copy.deepcopy(c) for c in caches]
    tokens = [30, 31, 32]
    expected = [model.forward(np.asarray([t]), c.length, c)[0] for t, c in zip(tokens, alone, strict=True)]
    got = model.decode_batch(np.asarray(tokens), [c.length for c in caches], caches)
    for row, e in zip(got, expected, strict=True):
        assert np.array_equal(row, e)


@pytest.mark.parametrize("arch", NEW)
def test_shard_split_equals_whole(arch):
    model = load(arch, backend="numpy")
    tokens = np.arange(3, 11)
    whole = model.logits(tokens)
    n = model.config.n_layers
    cache = model.new_cache(capacity=8)
    h = model.forward(tokens, 0, cache, layers=range(0, 1))
    assert np.array_equal(model.forward(h, 0, cache, layers=range(1, n)), whole)


def test_cohere2_parallel_block_layer_norm_and_nope_global_layer():
    model = load("cohere2")
    cfg, w = model.config, model.weights.layers[0]
    assert [cfg.uses_rope(i) for i in range(4)] == [True, True, True, False]
    assert [cfg.window(i) for i in range(4)] == [32, 32, 32, None]
    assert w.ffn_norm is None and cfg.logit_factor == 0.5 and not cfg.fused_block(0)
    x = np.random.default_rng(0).standard_normal((3, cfg.dim)).astype(np.float32) * 4 + 1
    y = ops.layer_norm(x, np.ones(cfg.dim, np.float32), cfg.norm_eps)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-5)
    np.testing.assert_allclose(y.std(-1), 1, atol=1e-4)
    trace: dict[str, np.ndarray] = {}
    h = np.random.default_rng(1).standard_normal((4, cfg.dim)).astype(np.float32)
    out = model.forward(h, 0, model.new_cache(capacity=4, layers=range(1, 2)), layers=range(1, 2), trace=trace)
    w1 = model.weights.layers[1]
    x = model.numerics.layer_norm(h, w1.attn_norm, cfg.norm_eps)
    assert np.array_equal(trace["attn_norm-1"], x)
    cos, sin = model._angles({}, 1, [np.arange(4)])
    attn = model.attention(x, w1, 1, [(0, model.new_cache(capacity=4, layers=range(1, 2)))], cos, sin)
    assert np.array_equal(out, (model.feed_forward(x, w1) + h) + attn)  # both branches read x: llama.cpp's order


def test_layer_norm_ggml_follows_the_simd_blocks():
    from ggufpy.numerics import layer_norm_ggml

    x = np.random.default_rng(2).standard_normal((5, 40)).astype(np.float32) * 3 + 0.5
    wt = np.random.default_rng(3).standard_normal(40).astype(np.float32)
    for isa in ("avx512", "avx2"):
        np.testing.assert_allclose(layer_norm_ggml(x, wt, 1e-5, isa=isa), ops.layer_norm(x, wt, 1e-5), rtol=1e-5)


def test_mistral3_temperature_tuning_scales_q_from_the_original_context_on():
    cfg = load("mistral3").config
    assert (cfg.attn_temp_scale, cfg.attn_temp_length) == (0.5, 64)
    scale = cfg.attn_temperature(np.array([0, 63, 64, 127, 128]))
    np.testing.assert_allclose(scale, [1, 1, 1 + 0.5 * np.log(2), 1 + 0.5 * np.log(2), 1 + 0.5 * np.log(3)], rtol=1e-7)


def test_granite_multipliers_each_change_the_logits():
    model = load("granite", backend="numpy")
    tokens = np.arange(3, 11)
    base = model.logits(tokens)
    for field in ("embedding_scale", "attention_scale", "residual_scale", "logit_factor"):
        changed = copy.copy(model)
        changed.config = replace(model.config, **{field: getattr(model.config, field) * 1.5})
        assert not np.allclose(changed.logits(tokens), base, atol=1e-4), field


# -- the command line, both backends --------------------------------------------------------------------------

BACKENDS = ["numpy", pytest.param("numba", marks=pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="no numba"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", NEW)
def test_ggufpy_run(arch, backend, capsys):
    from ggufpy.cli import main

    path = str(fx.fixture_path(f"{arch}_f32"))
    assert main(["run", "-m", path, "-p", "the cat", "-n", "6", "--temp", "0", "--backend", backend]) == 0
    assert "finish:" in capsys.readouterr().err


@pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")
@pytest.mark.parametrize(
    ("arch", "fused_layers"),
    [
        ("smollm3", 3),
        pytest.param("mistral3", 2, marks=pytest.mark.slow),
        pytest.param("granite", 0, marks=pytest.mark.slow),
    ],
)  # ~25 s each on 2 loaded cores, most of it compiling
def test_fused_decode_block_only_where_it_knows_the_block(arch, fused_layers, tmp_path, monkeypatch):
    """The numba fused decode block runs the layers of today's block (smollm3's RoPE layers, mistral3's YaRN
    angles come in as cos/sin) and leaves the others to `Model.block` (the NoPE layer, granite's multipliers),
    bit-identical to `Model.block` throughout."""
    from ggufpy.constants import GGMLType
    from ggufpy.kernels import layer
    from tests.test_kernels_layer import counted, decode, plain

    monkeypatch.setattr(layer, "BACKGROUND", False)
    types = {**dict.fromkeys(fx.ROLES, GGMLType.Q8_0), "embd": GGMLType.F32, "output": GGMLType.F32}
    spec = fx.ARCH_FIXTURES[arch]  # mistral3 without temperature tuning: YaRN alone changes only cos and sin
    spec = replace(spec, types=types, extra_kv=tuple(kv for kv in spec.extra_kv if "temperature" not in kv[0]))
    path = fx.write_tiny_llama(tmp_path / f"{arch}.gguf", spec)
    ref = plain(ggufpy.load(path, backend="numba", tokenizer=False))
    calls: list[int] = []
    fast = counted(ggufpy.load(path, backend="numba", tokenizer=False), calls)
    (la, _), (lb, _) = decode(ref), decode(fast)
    assert len(calls) == 8 * fused_layers
    for a, b in zip(la, lb, strict=True):
        assert np.array_equal(a, b)


def test_granite_rope_switch_off_matches_llamacpp(tmp_path):
    """granite reads rope.scaling.finetuned as its RoPE switch: false means no rotation on any layer. Live against
    llama.cpp when llama-cpp-python imports (bit for bit in the numerics mode of this CPU's build)."""
    spec = fx.ARCH_FIXTURES["granite"]
    path = fx.write_tiny_llama(
        tmp_path / "g.gguf", replace(spec, extra_kv=(*spec.extra_kv, ("rope.scaling.finetuned", False)))
    )
    cfg = ggufpy.load(path, tokenizer=False).config
    assert cfg.rope_off and not any(cfg.uses_rope(i) for i in range(cfg.n_layers))
    from conformance import llamacpp

    if not llamacpp.available():
        pytest.skip("llama-cpp-python is not installed")
    from conformance.compare import Reference, bit_differences
    from conformance.record import fixture_tokens
    from ggufpy.numerics import llamacpp_mode

    ref = Reference.from_llamacpp(path, fixture_tokens(32), 0)
    model = ggufpy.load(
        path, tokenizer=False, backend="numpy", numerics=llamacpp_mode(llamacpp.versions()["system_info"])
    )
    assert not any(bit_differences(model, ref).values())
