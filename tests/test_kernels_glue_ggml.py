"""The numba glue of the llamacpp numerics (`ggufpy.kernels.glue_ggml`) against the NumPy reference: RoPE and
SiLU bit for bit, the f16 rounding and ggml_v_expf on many bit patterns, and whole fixture models on the numba
backend in the llamacpp numerics (its attention: tests/test_kernels_x86.py).

Also runs with NUMBA_DISABLE_JIT=1 (plain Python kernels): shapes and sample counts shrink there.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy import kernels
from ggufpy.numerics import _libm_cos_sin, rope_angles_ggml, rope_ggml
from ggufpy.quants.x86.simd import fma
from ggufpy.quants.x86.unary import silu_rows, v_expf_512

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"numba unavailable: {kernels.IMPORT_ERROR}")

if kernels.AVAILABLE:
    from ggufpy.kernels import glue_ggml as glue
    from ggufpy.kernels._numba import DISABLED, fma_f32, jit

    @jit
    def _fma_array(a, b, c, out):
        for i in range(out.size):
            out[i] = fma_f32(a[i], b[i], c[i])

    @jit
    def _v_expf_array(x, out):
        for i in range(x.size):
            out[i] = glue.v_expf(x[i])
else:
    DISABLED = True

SETTINGS = settings(max_examples=6 if DISABLED else 40, deadline=None, suppress_health_check=list(HealthCheck))
SAMPLES = 3_000 if DISABLED else 1 << 20  # bit patterns per exhaustive-ish sweep

F32 = np.float32
# values where ggml_v_expf / expf / the f16 conversion change regime, and IEEE specials
SPECIALS = np.array(
    [0.0, -0.0, 1e-45, -1e-45, 1e-38, 2.0**-24, 2.0**-25, 6e-5, 0.5, 1.0, 16.0, 65504.0, 65519.0, 65520.0,
     80.0, 87.3, 88.0, 88.72, 88.73, 89.0, 103.9, 104.0, 133.0, 134.0, 150.0, 1e10, 1e30, 3.4e38, np.inf, np.nan],
    F32,
)  # fmt: skip
SPECIALS = np.concatenate([SPECIALS, -SPECIALS])


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    """The same f32 bit patterns, NaN for NaN (payloads aside)."""
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def spread_values(rng, shape, specials: bool = True) -> np.ndarray:
    """f32 values over many magnitudes (1e-6 .. 1e3, both signs), with some specials mixed in."""
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 4, shape)
    x = x.astype(F32)
    if specials and x.size:
        flat = x.reshape(-1)
        idx = rng.integers(0, flat.size, min(flat.size // 4 + 1, 16))
        flat[idx] = rng.choice(SPECIALS, idx.size)
    return x


def bit_patterns(rng, n: int) -> np.ndarray:
    """n f32 values: random upper bits (sign, exponent, high mantissa) with the low 12 bits drawn from the
    patterns that decide a rounding (0, 1, half, half +- 1, all ones) or at random."""
    hi = rng.integers(0, 1 << 20, n, dtype=np.uint64) << np.uint64(12)
    lows = np.array([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], np.uint64)
    lo = np.where(rng.random(n) < 0.75, rng.choice(lows, n), rng.integers(0, 1 << 12, n, dtype=np.uint64))
    return (hi | lo).astype(np.uint32).view(F32)


# -- the FMA intrinsic ---------------------------------------------------------------------------------------------
def test_fma_f32_rounds_once():
    rng = np.random.default_rng(0)
    n = 200 if DISABLED else 20000
    # near-halfway sums (where a float64 intermediate would round twice), spread values, subnormal results
    c = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(F32)
    half_ulp = (np.spacing(np.abs(c)) / 2).astype(F32)
    a = (1 + rng.integers(-3, 4, n) * 2.0**-23).astype(F32)
    b = (half_ulp * (1 + rng.integers(-3, 4, n) * 2.0**-23) * rng.choice([-1, 1], n)).astype(F32)
    tiny = rng.standard_normal((3, n)).astype(F32) * F32(2**-70)
    cases = [(a, b, c), tuple(spread_values(rng, (3, n))), tuple(tiny), (SPECIALS, SPECIALS[::-1], SPECIALS)]
    for x, y, z in cases:
        out = np.empty(len(x), F32)
        with np.errstate(all="ignore"):
            _fma_array(x, y, z, out)
            assert_bits_equal(out, fma(x, y, z))
    # the classic double-rounding case (tests/test_x86_simd.py)
    a1, b1, c1 = F32(1 + 2.0**-23), F32(2.0**-24 * (1 - 2.0**-23)), F32(1 + 2.0**-23)
    out = np.empty(1, F32)
    _fma_array(np.array([a1]), np.array([b1]), np.array([c1]), out)
    assert out[0] == F32(1 + 2.0**-23)


# -- f32 -> f16 rounding ---------------------------------------------------------------------------------------------
def test_round_f16_equals_numpy_on_many_bit_patterns():
    rng = np.random.default_rng(1)
    # every f16-relevant exponent (2^-26 .. 2^17) with all 2^11 high mantissa patterns when jitted
    e = np.arange(101, 144, dtype=np.uint32) << np.uint32(23)
    step = 1 if not DISABLED else 97
    m = (np.arange(0, 1 << 11, step, dtype=np.uint32) << np.uint32(12))[None, :]
    low = np.array([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], np.uint32)
    grid = (e[:, None, None] | m[:, :, None] | low[None, None, :]).reshape(-1)
    grid = np.concatenate([grid, grid | np.uint32(0x80000000)]).view(F32)
    for x in (grid, bit_patterns(rng, SAMPLES), SPECIALS, spread_values(rng, SAMPLES)):
        with np.errstate(over="ignore"):
            want = x.astype(np.float16).astype(F32)
        assert_bits_equal(glue.round_f16_array(x), want)


# -- RoPE -----------------------------------------------------------------------------------------------------------
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n_tokens=st.sampled_from([1, 2, 5, 17]),
    heads=st.integers(1, 9),
    dims=st.sampled_from([(8, 8), (16, 8), (64, 64), (64, 32)]),  # (head dim, rotated dims)
    style=st.sampled_from(["norm", "neox"]),
    start=st.integers(0, 3000),
)
def test_rope_is_bit_identical(seed, n_tokens, heads, dims, style, start):
    if DISABLED and n_tokens * heads * dims[0] > 600:
        n_tokens = 1
    rng = np.random.default_rng(seed)
    E, R = dims
    x = spread_values(rng, (n_tokens, heads, E))
    cos, sin = rope_angles_ggml(np.arange(start, start + n_tokens), R, 10000.0)
    with np.errstate(all="ignore"):
        want = rope_ggml(x, cos, sin, style)
    assert_bits_equal(glue.rope_ggml(x, cos, sin, style), want)
    # arbitrary cos/sin (not only unit-circle pairs), and a non-contiguous x
    c, s = (rng.standard_normal((2, n_tokens, R // 2)) * 3).astype(F32)
    xs = np.repeat(x, 2, axis=1)[:, ::2]
    with np.errstate(all="ignore"):
        assert_bits_equal(glue.rope_ggml(xs, c, s, style), rope_ggml(xs, c, s, style))


def test_rope_decode_shape_and_input_untouched():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 9, 64)).astype(F32)
    before = x.copy()
    cos, sin = rope_angles_ggml(np.array([123]), 64, 100000.0)
    got = glue.rope_ggml(x, cos, sin, "neox")
    assert got.shape == (1, 9, 64) and got.dtype == F32 and got is not x
    np.testing.assert_array_equal(x, before)
    assert_bits_equal(got, rope_ggml(x, cos, sin, "neox"))


# -- ggml_v_expf and SiLU --------------------------------------------------------------------------------------------
def test_v_expf_is_bit_identical():
    rng = np.random.default_rng(3)
    for x in (bit_patterns(rng, SAMPLES), SPECIALS, np.linspace(-110, 100, 5001, dtype=F32)):
        out = np.empty_like(x)
        with np.errstate(all="ignore"):
            _v_expf_array(x, out)
            assert_bits_equal(out, v_expf_512(x))


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 3),
    n=st.one_of(st.integers(1, 70), st.sampled_from([1536, 1541])),
    scale=st.sampled_from([1e-3, 1.0, 10.0, 100.0]),
)
def test_silu_rows_is_bit_identical(seed, rows, n, scale):
    """Body (16-lane ggml_v_silu) and tail (libm expf) for every n % 16; around 0, the exp's overflow and
    underflow limits, specials."""
    if DISABLED:
        n = min(n, 70)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * scale).astype(F32)
    flat = x.reshape(-1)
    idx = rng.integers(0, flat.size, min(flat.size, 12))
    flat[idx] = rng.choice(SPECIALS, idx.size)
    with np.errstate(all="ignore"):
        assert_bits_equal(glue.silu_rows(x), silu_rows(x))
        # 1-D and strided inputs (decode's gate is a column slice of the stacked Q/K/V-style product)
        assert_bits_equal(glue.silu_rows(x[0]), silu_rows(x[0]))
        wide = np.repeat(x, 2, axis=1)[:, ::2]
        assert_bits_equal(glue.silu_rows(wide), silu_rows(wide))


def test_silu_decode_shape():
    x = (np.random.default_rng(4).standard_normal((1, 1536)) * 5).astype(F32)
    got = glue.silu_rows(x)
    assert got.shape == (1, 1536) and got.dtype == F32
    assert_bits_equal(got, silu_rows(x))


# -- whole models ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["q4_0", "qwen2_f32", "gemma2_f32"])
def test_fixture_model_logits_match_the_numpy_llamacpp_reference(fixture):
    """q4_0 (llama, SiLU, norm RoPE), qwen2 (neox RoPE, Q/K/V biases), gemma2 (sliding window, softcapped
    attention, GELU): prefill and incremental decode with the numba backend in the llamacpp numerics (the glue
    here, `kernels.x86`'s attention) against the NumPy backend's replay. Q4_0's products are the integer kernels,
    so every logit is the same; the F32 weights' products are summed in another order (within 1e-5)."""
    import ggufpy
    from conformance import fixtures as fx

    path = fx.fixture_path(fixture)
    ids = np.array([5, 60, 7] if DISABLED else [5, 60, 7, 200, 31, 9, 17, 4, 88, 3], dtype=np.int64)
    ref = ggufpy.load(path, backend="numpy", numerics="llamacpp", tokenizer=False).logits(ids)
    model = ggufpy.load(path, backend="numba", numerics="llamacpp", tokenizer=False)
    got = model.logits(ids)
    atol = 0 if fixture == "q4_0" else 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
    assert np.array_equal(got.argmax(axis=-1), ref.argmax(axis=-1))
    cache = model.new_cache(capacity=len(ids))
    model.forward(ids[:-2], 0, cache)
    for i in (len(ids) - 2, len(ids) - 1):  # two decode steps
        last = model.forward(ids[i : i + 1], i, cache)
        np.testing.assert_allclose(last[0], ref[i], rtol=0, atol=atol)


def test_rope_angles_with_compiled_cosf_sinf_are_the_c_librarys():
    """The backend's compiled RoPE angles (`glue_ggml.cos_sin`: the C library's cosf/sinf in a compiled loop)
    equal the reference's ctypes calls bit for bit, plain and with YaRN, at positions up to 128k."""
    from ggufpy.kernels.backend import NumbaBackend
    from ggufpy.ops import RopeExt

    compiled = NumbaBackend.compiled[rope_angles_ggml]
    positions = np.concatenate([np.arange(0, 300), np.arange(131000, 131072), [7, 7]])
    freqs = np.random.default_rng(0).uniform(1.0, 8.0, 32).astype(np.float32)
    for kwargs in (
        {},
        {"freq_scale": 0.25, "freq_factors": freqs},
        {"freq_scale": 0.25, "ext": RopeExt(1.0, 1.0, 4.0, 20.0)},
        {"ext": RopeExt(0.0, 0.7, 0.0, 0.0)},
    ):
        for dims, theta in ((64, 10000.0), (128, 1000000.0)):
            if "freq_factors" in kwargs and dims != 64:
                continue
            want = rope_angles_ggml(positions, dims, theta, **kwargs)
            got = compiled(positions, dims, theta, **kwargs)
            for w, g in zip(want, got, strict=True):
                assert g.dtype == np.float32 and np.array_equal(w.view(np.uint32), g.view(np.uint32)), kwargs
    x = np.random.default_rng(1).uniform(-3e4, 3e4, 20000).astype(np.float32)
    cos, sin = glue.cos_sin(x)
    ref_cos, ref_sin = _libm_cos_sin(x)
    assert np.array_equal(cos.view(np.uint32), ref_cos.view(np.uint32))
    assert np.array_equal(sin.view(np.uint32), ref_sin.view(np.uint32))
