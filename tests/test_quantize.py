"""Reference quantizers: byte equality with gguf-py where it has a quantizer, with scalar transcriptions of
ggml's `quantize_row_q8_*_ref` for the activation formats and, when llama-cpp-python is installed, with the
compiled ggml C library; and round trips within each format's error bound.

Parametrized over the quantizers in `QUANT_TYPES`; a new quantizer must add its error bound to `BOUNDS`.
"""

from __future__ import annotations

import math
import platform
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ggufpy.constants import GGMLType
from ggufpy.errors import GGUFError, GGUFUnsupportedError
from ggufpy.quants import QUANT_TYPES, dequantize, quantize
from ggufpy.quants.iqgrid_quantizers import IQGRID_ROW_QUANTIZERS
from ggufpy.quants.quantizers import quantize_q8_0_x86, quantize_q8_1_x86
from tests.test_quants import ggml_c_function, ggml_symbol

gguf = pytest.importorskip("gguf")
gguf_quants = pytest.importorskip("gguf.quants")

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QUANTIZABLE = [t for t, qt in QUANT_TYPES.items() if qt.quantize_blocks is not None]
F32_EPS = np.float32(2.0**-23)


def _gguf_quantizes(t: GGMLType) -> bool:
    try:
        gt = gguf.GGMLQuantizationType(int(t))
        gguf_quants.quantize(np.zeros((1, QUANT_TYPES[t].block_size), np.float32), gt)
    except (ValueError, NotImplementedError):
        return False
    return True


GGUF_QUANTIZABLE = [t for t in QUANTIZABLE if _gguf_quantizes(t)]


def weights(block_size: int, max_blocks: int = 3, scale: float = 1e4):
    """f32[n, block_size] with |x| <= scale; values below 1e-6 become 0 so that 1/d cannot overflow."""
    element = st.floats(-scale, scale, width=32).map(lambda v: 0.0 if abs(v) < 1e-6 else v)
    return st.integers(1, max_blocks).flatmap(lambda n: hnp.arrays(np.float32, (n, block_size), elements=element))


def tie_heavy(block_size: int, max_blocks: int = 3):
    """Small multiples of 1/4: many elements land exactly on rounding ties."""
    return (
        st.integers(1, max_blocks)
        .flatmap(lambda n: hnp.arrays(np.int16, (n, block_size), elements=st.integers(-64, 64)))
        .map(lambda a: a.astype(np.float32) / 4)
    )


def roundtrip(x: np.ndarray, t: GGMLType) -> np.ndarray:
    return dequantize(quantize(x, t), t, x.shape)


# --- byte equality with gguf-py -----------------------------------------------------------------------------


def test_gguf_py_quantizers_are_the_expected_ones():
    expected = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]
    assert sorted(t.name for t in GGUF_QUANTIZABLE) == sorted(expected)


@pytest.mark.parametrize("t", GGUF_QUANTIZABLE, ids=lambda t: t.name)
def test_quantize_matches_gguf_py(t):
    """Both are unfused f32 NumPy code following `quantize_row_*_ref`, so they agree byte for byte, ties too.
    (A C build of ggml that contracts `x*id + 8.5f` into an FMA may differ from both on near-ties.)"""
    qt = QUANT_TYPES[t]

    @FAST
    @given(x=st.one_of(weights(qt.block_size * (64 if qt.block_size == 1 else 1)), tie_heavy(qt.block_size)))
    def check(x):
        ours = quantize(x, t)
        theirs = np.ascontiguousarray(gguf_quants.quantize(x, gguf.GGMLQuantizationType(int(t))))
        assert np.array_equal(ours, theirs.view(np.uint8).reshape(ours.shape))

    check()


# --- scalar transcriptions of ggml's activation quantizers (ggml-quants.c) ----------------------------------


def _roundf(v: float) -> int:
    """C roundf: ties away from zero (v is an f32 value; the f64 arithmetic here is exact)."""
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _nearest_int(fval: np.float32) -> int:
    """ggml's `nearest_int`: add 1.5 * 2**23 in f32 and read the mantissa bits."""
    val = np.float32(fval) + np.float32(12582912.0)
    i = int(np.array(val, np.float32).view(np.int32))
    return (i & 0x007FFFFF) - 0x00400000


def _fp16(v) -> bytes:
    """Python's struct rounds half to even, like F16C; out of range gives inf, as GGML_FP32_TO_FP16 does."""
    try:
        return struct.pack("<e", float(v))
    except OverflowError:
        return struct.pack("<e", math.copysign(math.inf, float(v)))


def q8_0_ref(block: np.ndarray, with_sum: bool) -> bytes:
    """`quantize_row_q8_0_ref` (with_sum=False) / `quantize_row_q8_1_ref` (with_sum=True) for one block."""
    amax = np.float32(0)
    for v in block:
        amax = max(amax, np.float32(abs(v)))
    d = amax / np.float32(127)
    inv = np.float32(1) / d if d else np.float32(0)
    qs = [_roundf(float(np.float32(v) * inv)) for v in block]
    if not with_sum:
        return _fp16(d) + struct.pack("<32b", *qs)
    return _fp16(d) + _fp16(np.float32(sum(qs)) * d) + struct.pack("<32b", *qs)


def q8_k_ref(block: np.ndarray) -> bytes:
    """`quantize_row_q8_K_ref` for one 256-element block."""
    peak = amax = np.float32(0)
    for v in block:
        if abs(v) > amax:
            amax, peak = np.float32(abs(v)), v
    if not amax:
        return bytes(292)
    iscale = np.float32(-127) / peak
    qs = [min(127, _nearest_int(iscale * v)) for v in block]
    bsums = [sum(qs[16 * g : 16 * g + 16]) for g in range(16)]
    return struct.pack("<f256b16h", np.float32(1) / iscale, *qs, *bsums)


@FAST
@given(x=st.one_of(weights(32), tie_heavy(32)))
@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q8_1], ids=lambda t: t.name)
def test_q8_0_and_q8_1_match_ggml_ref(t, x):
    expected = b"".join(q8_0_ref(b, with_sum=t == GGMLType.Q8_1) for b in x)
    assert quantize(x, t).tobytes() == expected


@FAST
@given(x=st.one_of(weights(256, max_blocks=2), tie_heavy(256, max_blocks=2)))
def test_q8_k_matches_ggml_ref(x):
    assert quantize(x, GGMLType.Q8_K).tobytes() == b"".join(q8_k_ref(b) for b in x)


def test_rounding_ties():
    """Exact ties: d = 31.75/127 = 0.25, so x * (1/d) = x * 4 and Q8_K's iscale = -127/31.75 = -4."""
    ties = np.array([0.625, -0.625, 0.375, -0.125, 0.875], np.float32)  # x * 4 = 2.5, -2.5, 1.5, -0.5, 3.5
    x = np.zeros((1, 256), np.float32)
    x[0, 0], x[0, 1:6] = 31.75, ties
    q8_0 = quantize(x[:, :32], GGMLType.Q8_0)[0, 3:8].view(np.int8)
    assert q8_0.tolist() == [3, -3, 2, -1, 4]  # roundf: away from zero
    q8_0_x86 = quantize_q8_0_x86(x[:, :32])[0, 3:8].view(np.int8)
    assert q8_0_x86.tolist() == [2, -2, 2, 0, 4]  # _mm256_round_ps: to even
    q8_k = quantize(x, GGMLType.Q8_K)[0, 5:10].view(np.int8)
    assert q8_k.tolist() == [-2, 2, -2, 0, -4]  # nearest_int: to even, and d = -0.25


def test_q8_k_details():
    x = np.zeros((3, 256), np.float32)
    x[1, 7], x[1, 9] = 2.0, -2.0  # equal magnitudes: the first one (positive) is `max`, so d < 0
    x[2, :] = np.linspace(-1, 0.5, 256)
    raw = quantize(x, GGMLType.Q8_K)
    d = raw[:, :4].copy().view("<f4")[:, 0]
    qs = raw[:, 4:260].view(np.int8)
    bsums = raw[:, 260:].copy().view("<i2")
    assert raw[0].tobytes() == bytes(292)  # an all-zero block: d = 0, quants and sums zero
    assert d[1] == np.float32(1) / (np.float32(-127) / np.float32(2)) and d[1] < 0
    assert qs[1, 7] == -127 and qs[1, 9] == 127
    assert np.array_equal(bsums, qs.reshape(3, 16, 16).sum(axis=2))
    assert qs.max() <= 127


def test_bf16_rounding_and_nan():
    bits = np.array(
        [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F800001, 0xFFC12345, 0x7F800000, 0x7F7FFFFF, 0x00018000, 0x80008000],
        np.uint32,
    )
    out = quantize(bits.view(np.float32), GGMLType.BF16).view("<u2")
    # ties go to even; a signalling NaN becomes quiet keeping its top bits; the largest float rounds to inf;
    # subnormals are rounded, not flushed (ggml-impl.h `ggml_compute_fp32_to_bf16`)
    assert out.tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7FC0, 0xFFC1, 0x7F80, 0x7F80, 0x0002, 0x8000]


# --- the compiled ggml C library ----------------------------------------------------------------------------


def c_inputs(block_size: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = max(1, 256 // block_size) * 512
    return {
        "gaussian": rng.standard_normal((n, block_size)).astype(np.float32),
        "quarter ties": (rng.integers(-64, 65, (n, block_size)) / 4).astype(np.float32),
        "wide range": (rng.standard_normal((n, block_size)) * np.exp(rng.uniform(-20, 20, (n, 1)))).astype(np.float32),
    }


# F32: stored as is. The IQ grid types: ggml's quantize_row_iq*_ref aborts the process before ggml_quantize_init;
# tests/test_quantize_iqgrid.py compares them byte for byte (goldens and live, after the init).
@pytest.mark.conformance
@pytest.mark.parametrize(
    "t", [t for t in QUANTIZABLE if t != GGMLType.F32 and t not in IQGRID_ROW_QUANTIZERS], ids=lambda t: t.name
)
def test_quantize_matches_ggml_c_reference(t):
    qt = QUANT_TYPES[t]
    row = ggml_c_function(ggml_symbol(t, "quantize"))
    for name, x in c_inputs(qt.block_size, int(t)).items():
        expected = row(x, np.zeros((x.shape[0], qt.row_bytes(x.shape[1])), np.uint8), x.size)
        assert np.array_equal(quantize(x, t), expected), name


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 SIMD path")
@pytest.mark.parametrize(("t", "ours"), [(GGMLType.Q8_0, quantize_q8_0_x86), (GGMLType.Q8_1, quantize_q8_1_x86)])
def test_x86_activation_quantizers_match_ggml_cpu(t, ours):
    """The activation quantizer the CPU matmul runs (AVX path); it differs from the reference on ties."""
    row = ggml_c_function(f"quantize_row_{t.name.lower()}", library="cpu")
    differ_from_ref = 0
    for x in c_inputs(32, 7).values():
        expected = row(x, np.zeros((x.shape[0], QUANT_TYPES[t].type_size), np.uint8), x.size)
        assert np.array_equal(ours(x), expected)
        differ_from_ref += int(np.any(quantize(x, t) != expected, axis=1).sum())
    assert differ_from_ref > 0  # the quarter ties guarantee some


# --- round trips within each format's error bound ------------------------------------------------------------


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).astype(np.float32)


def _absmax(x):
    return np.abs(x).max(axis=1, keepdims=True)


def _bound_symmetric(levels: int):  # Q4_0, Q5_0: d = max/-levels, one step at the clamped end
    def bound(x):
        d = _absmax(x) / np.float32(levels)
        return d + levels * np.abs(d - _f16(d))

    return bound


def _bound_affine(levels: int):  # Q4_1, Q5_1: d = (max-min)/levels, half a step + scale and min rounding
    def bound(x):
        lo = x.min(axis=1, keepdims=True)
        d = (x.max(axis=1, keepdims=True) - lo) / np.float32(levels)
        return d / 2 + levels * np.abs(d - _f16(d)) + np.abs(lo - _f16(lo))

    return bound


def _bound_q8_0(x):
    d = _absmax(x) / np.float32(127)
    return d / 2 + 127 * np.abs(d - _f16(d))


BOUNDS = {
    GGMLType.F32: lambda x: np.zeros_like(x[:, :1]),
    GGMLType.F16: lambda x: np.abs(x - _f16(x)),
    GGMLType.BF16: lambda x: np.abs(x) * np.float32(2.0**-8),
    GGMLType.Q4_0: _bound_symmetric(8),
    GGMLType.Q5_0: _bound_symmetric(16),
    GGMLType.Q4_1: _bound_affine(15),
    GGMLType.Q5_1: _bound_affine(31),
    GGMLType.Q8_0: _bound_q8_0,
    GGMLType.Q8_1: _bound_q8_0,
    GGMLType.Q8_K: lambda x: _absmax(x) / np.float32(127) / 2,
    # d = fp16(amax), codes -1, 0, 1: half a step, plus the fp16 rounding of d
    GGMLType.TQ1_0: lambda x: _absmax(x) / 2 + np.abs(_absmax(x) - _f16(_absmax(x))),
    GGMLType.TQ2_0: lambda x: _absmax(x) / 2 + np.abs(_absmax(x) - _f16(_absmax(x))),
    # d = 2^(floor(log2 amax) - 3), so amax < 16 d; the widest gap of the doubled E2M1 grid is 8d..12d, and
    # amax may sit 4d above the top value 12d
    GGMLType.MXFP4: lambda x: _absmax(x) / 4 + _absmax(x) * np.float32(2.0**-20),
}
# The k-quants and IQ4 (searched scales, byte-identical to ggml in tests/test_quantize_kquants.py) get a sanity
# bound only: never worse than twice the block's largest magnitude
BOUNDS |= {GGMLType[n]: lambda x: 2 * _absmax(x) for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")}
BOUNDS |= {GGMLType[n]: lambda x: 2 * _absmax(x) for n in ("IQ2_S", "IQ3_XXS")}
# IQ3_S has no zero level (grid values 1..15, odd) and its x^2-weighted search leaves values of weight ~0 free:
# ggml's bytes (ggufpy's are identical) reach 2.19 x absmax on sparse rows (worst of 3,000 measured)
BOUNDS[GGMLType.IQ3_S] = lambda x: 3 * _absmax(x)
# IQ1_M's last step refits the super-block scale by least squares weighted by x^2 (no imatrix), so values whose
# weight is 0 are unconstrained: ggml (and ggufpy, byte-identical) turn a lone 69 among 255 zeros into a block of
# 690s. What the refit does guarantee, per super-block: sum x^2 (y - x)^2 <= sum x^2 x^2 (d = 0 is a candidate; the
# stored 1.1125 d keeps it, since 2 * 1.1125 - 1.1125^2 > 0), up to the fp16 rounding of d.
WEIGHTED_FIT = {GGMLType.IQ1_M}
BOUNDS |= {t: None for t in WEIGHTED_FIT}
# NVFP4 (a scale per 16 that may underflow to 0) and Q1_0 (+-mean|x|): never worse than 0 for every element
BOUNDS |= {GGMLType[name]: _absmax for name in ("NVFP4", "Q1_0") if name in GGMLType.__members__}


@pytest.mark.parametrize("t", QUANTIZABLE, ids=lambda t: t.name)
def test_roundtrip_error_within_bound(t):
    if t not in BOUNDS:
        pytest.fail(f"{t.name} has a quantizer: add its round-trip error bound to BOUNDS")
    qt = QUANT_TYPES[t]

    @FAST
    @given(x=st.one_of(weights(qt.block_size * (64 if qt.block_size == 1 else 1)), tie_heavy(qt.block_size)))
    def check(x):
        if t in WEIGHTED_FIT:
            w = (x * x).astype(np.float64).reshape(-1, 256)  # (super-blocks, 256)
            e = (roundtrip(x, t) - x).astype(np.float64).reshape(-1, 256)
            assert np.all((w * e * e).sum(axis=1) <= (w * w).sum(axis=1) * (1 + 2e-3) + 1e-30)
            return
        err = np.abs(roundtrip(x, t) - x)
        # slack for the f32 roundings of x*id, x-min and the final q*d+m: a few ulps of the block's range
        slack = 8 * F32_EPS * (_absmax(x) + np.float32(1e-30))
        assert np.all(err <= BOUNDS[t](x) * (1 + 1e-4) + slack)

    check()


# Integer grids each format represents exactly (times a power of two): q - offset for every code q. The first
# element has the largest magnitude and is negative, so the symmetric formats get d = max / -levels = step.
EXACT_GRIDS = {
    GGMLType.Q4_0: range(-8, 8),
    GGMLType.Q5_0: range(-16, 16),
    GGMLType.Q4_1: range(-7, 9),
    GGMLType.Q5_1: range(-15, 17),
    GGMLType.Q8_0: range(-127, 128),
    GGMLType.Q8_1: range(-127, 128),
    GGMLType.Q8_K: range(-127, 128),
}


@pytest.mark.parametrize("t", QUANTIZABLE, ids=lambda t: t.name)
def test_grid_values_roundtrip_exactly(t):
    qt = QUANT_TYPES[t]
    if qt.block_size == 1:
        x = np.array([0.0, 1.0, -2.5, 1024.0, 2.0**-14], np.float32).reshape(-1, 1)
    elif t in EXACT_GRIDS:
        x = (np.resize(np.array(EXACT_GRIDS[t], np.float32), qt.block_size) * np.float32(0.25)).reshape(1, -1)
    else:
        pytest.skip(f"no exact grid listed for {t.name}")
    assert np.array_equal(roundtrip(x, t), x)


# --- API contract --------------------------------------------------------------------------------------------


def test_quantize_shapes():
    x = np.random.default_rng(3).standard_normal((3, 2, 64)).astype(np.float32)
    out = quantize(x, GGMLType.Q8_0)
    assert out.dtype == np.uint8 and out.shape == (3, 2, 68)
    assert np.array_equal(quantize(x.reshape(6, 64), GGMLType.Q8_0), out.reshape(6, 68))
    assert quantize(x.astype(np.float64), GGMLType.F16).shape == (3, 2, 128)  # any float input is cast to f32
    with pytest.raises(GGUFError, match="not a multiple of the block size 32"):
        quantize(np.zeros((2, 48), np.float32), GGMLType.Q4_0)


def test_quantize_unsupported_type():
    with pytest.raises(GGUFUnsupportedError, match=r"no reference quantizer for IQ2_XXS; .*Q4_0.*Q8_K"):
        quantize(np.zeros(256, np.float32), GGMLType.IQ2_XXS)
