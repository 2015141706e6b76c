"""The `llamacpp` numerics mode, op by op: activation quantization, block dot products, RoPE angles, attention
and GELU, each against ggml's own results (committed in conformance/goldens/ops.npz, so CI needs no llama.cpp;
re-checked live against the C library when llama-cpp-python is installed), plus the model-level laws.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest

import ggufpy
from conformance.compare import nmse
from conformance.fixtures import TinyLlama, write_tiny_llama
from ggufpy import ops
from ggufpy.constants import GGMLType
from ggufpy.numerics import (
    NUMERICS,
    _gelu_table,
    attention_ggml,
    gelu_tanh_ggml,
    numerics_mode,
    rope_angles_ggml,
    rope_ggml,
)
from ggufpy.quants import QUANT_TYPES, dequantize, quantize
from ggufpy.quants.vecdot import (
    VEC_DOT_TYPE,
    decode_activations,
    linear,
    quantize_activations,
    round_bf16,
    round_f16,
    split_weight,
)
from tests.test_quants import finite_scales, same_bits

OPS = np.load("conformance/goldens/ops.npz")
WEIGHT_TYPES = list(VEC_DOT_TYPE)
ACTIVATION_FORMATS = {GGMLType.Q8_1, GGMLType.Q8_K}
T = GGMLType


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# -- the vec_dot table and the weight split -------------------------------------------------------------------


def test_every_weight_type_has_a_vec_dot_type():
    storage = {GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.F64}
    pending: set[GGMLType] = set()  # issue 12's types: all replayed (ggufpy/quants/x86)
    assert set(VEC_DOT_TYPE) == set(QUANT_TYPES) - ACTIVATION_FORMATS - storage - pending
    assert {VEC_DOT_TYPE[t] for t in (T.Q4_0, T.Q5_0, T.Q8_0, T.IQ4_NL)} == {T.Q8_0}
    assert {VEC_DOT_TYPE[t] for t in (T.Q4_1, T.Q5_1)} == {T.Q8_1}
    assert {VEC_DOT_TYPE[t] for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)} == {T.Q8_K}


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_split_weight_adds_up_to_the_dequantized_weight(t):
    """scaled + offsets rounds once, like the dequantizer's `d*sc*q - dmin*m`: equal values (a -0 may be +0)."""
    qt = QUANT_TYPES[t]
    rng = np.random.default_rng(int(t))
    n = 512 if qt.block_size > 1 else 64
    raw = finite_scales(rng.bytes(4 * n // qt.block_size * qt.type_size), t) if qt.block_size > 1 else None
    if raw is None:
        raw = quantize(rng.standard_normal((4, n)).astype(np.float32), t)
    w = split_weight(raw, t, (4, n))
    total = w.scaled if w.offsets is None else w.scaled + np.repeat(w.offsets, w.sub, axis=1)
    assert np.array_equal(total, dequantize(raw, t, (4, n)))


def test_activation_blocks_decode_like_the_dequantizers():
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    for vt in (T.Q8_0, T.Q8_1, T.Q8_K):
        blocks = quantize_activations(x, vt)
        acts = decode_activations(blocks, vt, 512)
        assert same_bits(acts.values, dequantize(blocks, vt, x.shape))
    b = quantize_activations(x, T.Q8_K).reshape(-1, 292)
    d = b[:, :4].copy().view("<f4")
    bsums = b[:, 260:].copy().view("<i2")
    assert np.array_equal(decode_activations(b, T.Q8_K, 512).sums16, (d * bsums).reshape(3, 32))
    assert decode_activations(b, T.Q8_K, 512).sub_block_sums(32).shape == (3, 16)


def test_float_weights_round_activations_to_their_own_type():
    x = np.array([1 + 2**-12, 1 + 2**-11, 1 + 2**-8, 1 + 2**-8 + 2**-9, 1 + 3 * 2**-8], np.float32)
    assert np.array_equal(round_f16(x), [1.0, 1.0, 1 + 2**-8, 1 + 2**-8 + 2**-9, 1 + 3 * 2**-8])  # ties to even
    assert np.array_equal(round_bf16(x), [1.0, 1.0, 1.0, 1 + 2**-7, 1 + 2**-6])


# -- against ggml's CPU matmul (committed golden) -------------------------------------------------------------


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_matmul_matches_ggml(t):
    """Activation blocks byte for byte, outputs within ggml's own f32 rounding (tier 2: rel <= 1e-5; measured
    <= 4e-7), while a dequantize-then-f32 matmul is off by the activation quantization (~1e-2)."""
    raw, x, acts, y = (OPS[f"{t.name}:{k}"] for k in ("w", "x", "acts", "y"))
    vt = VEC_DOT_TYPE[t]
    if vt not in (T.F32, T.F16, T.BF16):
        assert np.array_equal(quantize_activations(x, vt), acts)
    w = split_weight(raw, t, (raw.shape[0], x.shape[1]))
    assert _rel(linear(x, w), y) <= 1e-6
    assert _rel(linear(x, w, dtype=np.float32), y) <= 1e-5
    if t not in (T.F32, T.F16):
        assert _rel(x @ dequantize(raw, t, w.scaled.shape).T, y) > 5e-4


def test_linear_keeps_leading_axes_and_chunks_the_weight():
    raw = OPS["Q4_K:w"]
    x = OPS["Q4_K:x"]
    w = split_weight(raw, T.Q4_K, (raw.shape[0], x.shape[1]))
    whole = linear(x, w)
    assert np.array_equal(linear(x, w, chunk_bytes=3 * 512 * 8), whole)
    assert np.array_equal(linear(x.reshape(2, 2, -1), w), whole.reshape(2, 2, -1))


# -- RoPE, attention, GELU -------------------------------------------------------------------------------------


def _rope_cache_scalar(p: int, n_dims: int, base: float, freq_scale: float = 1.0) -> list[float]:
    """`ggml_rope_cache_init` + `rope_yarn` (no ext) one float32 operation at a time: the angles."""
    f = np.float32
    theta_scale = f(np.float64(f(base)) ** np.float64(f(-2.0) / f(n_dims)))
    theta, out = f(p), []
    for _ in range(n_dims // 2):
        out.append(f(freq_scale) * theta)
        theta = f(theta * theta_scale)
    return out


def test_rope_angles_follow_ggml_float32_recurrence():
    positions = np.array([0, 1, 7, 100, 4095])
    cos, sin = rope_angles_ggml(positions, 64, 100000.0, 0.5)
    libm = ctypes.CDLL(ctypes.util.find_library("m"))  # ggml calls the C library's cosf/sinf
    for name in ("cosf", "sinf"):
        getattr(libm, name).restype, getattr(libm, name).argtypes = ctypes.c_float, [ctypes.c_float]
    for row, p in enumerate(positions):
        angles = _rope_cache_scalar(int(p), 64, 100000.0, 0.5)
        assert np.array_equal(cos[row], np.array([libm.cosf(float(a)) for a in angles], np.float32))
        assert np.array_equal(sin[row], np.array([libm.sinf(float(a)) for a in angles], np.float32))
        # within an ulp of the correctly rounded values
        np.testing.assert_allclose(cos[row], np.cos(np.array(angles, np.float64)), rtol=0, atol=1.2e-7)
    # the float64 angles of the exact mode drift away from the f32 recurrence with the position
    c64, _ = ops.rope_angles(positions, 64, 100000.0, 0.5)
    assert 1e-5 < np.abs(c64 - cos)[-1].max() < 1e-2


def test_rope_contracts_to_fmas_like_the_compiled_rotation():
    """ggml's `x0*cos - x1*sin` compiled with FMA contraction: fma(x0, cos, -(x1*sin)), exact to one rounding."""
    from fractions import Fraction

    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    cos, sin = rope_angles_ggml(np.arange(5), 8, 10000.0)
    for style in ("norm", "neox"):
        got = rope_ggml(x, cos, sin, style)
        i0, i1 = (slice(0, 8, 2), slice(1, 8, 2)) if style == "norm" else (slice(0, 4), slice(4, 8))
        x0, x1, c, s = x[..., i0], x[..., i1], cos[:, None, :], sin[:, None, :]
        x0, x1, c, s = np.broadcast_arrays(x0, x1, c, s)
        want = [
            float(np.float32(float(Fraction(float(a)) * Fraction(float(b)) - Fraction(float(np.float32(d * e))))))
            for a, b, d, e in zip(x0.ravel(), c.ravel(), x1.ravel(), s.ravel(), strict=True)
        ]
        np.testing.assert_array_equal(got[..., i0].ravel(), np.array(want, np.float32))
        assert not np.array_equal(got[..., i0], x0 * c - x1 * s)  # two roundings differ somewhere


def test_attention_matches_llamacpp_on_its_own_inputs():
    """llama.cpp's Q, K, V of a fixture layer in, its kqv_out compared: only the SIMD expf differs."""
    q, k, v, out = (OPS[f"attention:{n}-0"] for n in ("Qcur", "Kcur", "Vcur", "kqv_out"))
    scale = 1.0 / np.sqrt(q.shape[-1])
    ours = attention_ggml(q, round_f16(k), round_f16(v), 0, scale)
    assert nmse(ours, out) < 1e-10  # measured 1.2e-12
    assert nmse(ops.attention(q, k, v, 0, scale), out) > 1e-8  # without f16 Q, K, V and probabilities


def test_attention_options_mask_like_the_exact_mode():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((6, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((9, 2, 16)).astype(np.float32) for _ in range(2))
    for extra in ({}, {"window": 3}, {"softcap": 2.0}):
        ours, exact = attention_ggml(q, k, v, 3, 0.25, **extra), ops.attention(q, k, v, 3, 0.25, **extra)
        assert nmse(ours, exact) < 1e-5


def test_gelu_is_the_fp16_table():
    x = np.array([-11.0, -10.0, -1.5, 0.0, 0.3, 9.99, 10.0, 12.0], np.float32)
    y = gelu_tanh_ggml(x)
    assert y[0] == y[1] == 0 and y[6] == 10 and y[7] == 12
    assert np.array_equal(y[2:6], _gelu_table()[x[2:6].astype(np.float16).view(np.uint16)].astype(np.float32))
    grid = np.linspace(-9.9, 9.9, 4001, dtype=np.float32)
    assert np.abs(gelu_tanh_ggml(grid) - ops.gelu_tanh(grid)).max() < 5e-3


# -- the mode in the model -------------------------------------------------------------------------------------


def test_llamacpp_mode_is_registered_with_its_rounding_points():
    mode = numerics_mode("llamacpp")
    assert mode.quantize_activations and mode.kv_dtype == np.float16
    assert mode.rope_angles is rope_angles_ggml and mode.rope is rope_ggml and mode.x86_kernels
    assert mode.attention is not ops.attention and mode.activations["gelu_tanh"] is gelu_tanh_ggml
    # SiLU and attention replay ggml's own SIMD exp; the attention rounds where attention_ggml does
    x = np.linspace(-20, 20, 4001, dtype=np.float32).reshape(1, -1)
    np.testing.assert_allclose(mode.activations["silu"](x), ops.silu(x), rtol=1e-6, atol=1e-30)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((7, 4, 16), np.float32) for _ in range(3))
    np.testing.assert_allclose(
        mode.attention(q, k[:, :2], v[:, :2], 0, 0.25),
        attention_ggml(q, k[:, :2], v[:, :2], 0, 0.25),
        rtol=1e-5,
        atol=1e-6,
    )
    assert not NUMERICS["exact"].quantize_activations
    with pytest.raises(ValueError, match="available: exact, llamacpp"):
        numerics_mode("fast")


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory):
    types = {"embd": T.Q8_0, "output": T.Q8_0, "attn": T.Q4_0, "ffn": T.Q4_1}
    path = write_tiny_llama(
        tmp_path_factory.mktemp("numerics") / "m.gguf", TinyLlama(dim=64, hidden_dim=128, types=types)
    )
    # the NumPy reference: its prefill and decode share one summation order, so they agree tightly
    return ggufpy.load(path, tokenizer=False, numerics="llamacpp", backend="numpy")


TOKENS = np.array([5, 77, 200, 3, 150, 42, 9, 260, 11, 99, 1, 0, 180, 64, 33, 7])


def test_llamacpp_mode_prefill_equals_incremental_decode(q4k_model):
    """Each row is quantized and summed on its own, so one token at a time gives the prefill's values."""
    m = q4k_model
    full = m.logits(TOKENS)
    cache = m.new_cache()
    steps = [m.forward(TOKENS[:10], 0, cache)] + [m.forward(TOKENS[t : t + 1], t, cache) for t in range(10, 16)]
    np.testing.assert_allclose(np.concatenate(steps), full, rtol=0, atol=1e-5 * np.abs(full).max())


def test_llamacpp_mode_layer_split_equals_whole_bit_for_bit(q4k_model):
    m = q4k_model
    whole = m.forward(TOKENS, 0, m.new_cache())
    cache = m.new_cache()
    hidden = m.forward(TOKENS, 0, cache, layers=range(0, 1))
    assert np.array_equal(m.forward(hidden, 0, cache, layers=range(1, m.config.n_layers)), whole)
    assert m.new_cache().k[0].dtype == np.float16


# -- live, against the C library (llama-cpp-python installed) ------------------------------------------------


@pytest.fixture(scope="module")
def ggml():
    from conformance import llamacpp

    if not llamacpp.available():
        pytest.skip("llama-cpp-python is not installed (pip install 'ggufpy[conformance]')")
    return llamacpp


@pytest.mark.conformance
@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_matmul_matches_ggml_live(ggml, t):
    rng = np.random.default_rng(1000 + int(t))
    n = 1024
    w = (rng.standard_normal((8, n)) * 0.02).astype(np.float32)
    x = rng.standard_normal((3, n)).astype(np.float32)
    x[:, :4] *= 30
    raw = quantize(w, t) if QUANT_TYPES[t].quantize_blocks is not None else ggml.ggml_quantize(w, t)
    y, acts, vt = ggml.ggml_cpu_matmul(raw, t, x)
    assert vt == VEC_DOT_TYPE[t]
    if VEC_DOT_TYPE[t] not in (T.F32, T.F16, T.BF16):
        assert np.array_equal(quantize_activations(x, VEC_DOT_TYPE[t]), acts)
    assert _rel(linear(x, split_weight(raw, t, (8, n))), y) <= 1e-6


@pytest.mark.conformance
def test_gelu_table_equals_ggmls(ggml):
    import ctypes

    cpu = ggml._ggml_cpu()
    cpu.ggml_cpu_init()
    theirs = np.ctypeslib.as_array((ctypes.c_uint16 * 65536).in_dll(cpu, "ggml_table_gelu_f16")).copy()
    ours = _gelu_table().view(np.uint16)
    finite = np.isfinite(np.arange(65536, dtype=np.uint16).view(np.float16))
    assert np.array_equal(ours[finite], theirs[finite])
