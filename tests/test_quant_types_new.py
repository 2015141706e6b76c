"""The quant types of issue 12 (IQ1/IQ2/IQ3, TQ1_0/TQ2_0, MXFP4, NVFP4, Q1_0, and the storage types I8, I16,
I32, F64): grids and tables against gguf-py's copies, hand-built blocks for what gguf-py cannot decode,
the split into (scale, value) parts the kernels repack, and ggml's C library (live when llama-cpp-python is
installed, else the goldens recorded from it in tests/data/quants/).

The comparisons with gguf-py over the whole registry are in tests/test_quants.py.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy.constants import GGMLType
from ggufpy.quants import QUANT_TYPES, dequantize, grids, iqgrid, lowbit, quantize
from tests.test_quants import finite_scales, ggml_c_function, same_bits

gguf = pytest.importorskip("gguf")
gguf_quants = pytest.importorskip("gguf.quants")

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GOLDENS = Path(__file__).parent / "data" / "quants"

# --- tables -------------------------------------------------------------------------------------------------

GRIDS = {
    "IQ2_XXS": grids.IQ2XXS_GRID,
    "IQ2_XS": grids.IQ2XS_GRID,
    "IQ2_S": grids.IQ2S_GRID,
    "IQ3_XXS": grids.IQ3XXS_GRID,
    "IQ3_S": grids.IQ3S_GRID,
    "IQ1_S": grids.IQ1S_GRID,
}


@pytest.mark.parametrize("name", GRIDS)
def test_grid_equals_gguf_py(name):
    cls = getattr(gguf_quants, name)
    cls.init_grid()
    theirs = cls.grid.reshape(cls.grid_shape)
    assert GRIDS[name].shape == theirs.shape
    assert np.array_equal(GRIDS[name].astype(np.float32), theirs)


def test_ksigns_and_fp4_tables_equal_gguf_py():
    assert np.array_equal(iqgrid.KSIGNS_IQ2XS, np.frombuffer(gguf_quants.IQ2_XXS.ksigns, np.uint8))
    assert lowbit.KVALUES_MXFP4.tolist() == list(gguf_quants.MXFP4.kvalues)
    codes = np.arange(256, dtype=np.uint8)
    assert same_bits(lowbit.UE4M3_HALF, gguf_quants.NVFP4.ue4m3_to_fp32(codes).astype(np.float32))
    assert same_bits(lowbit.e8m0_to_fp32_half(codes), gguf_quants.MXFP4.e8m0_to_fp32_half(codes))
    assert lowbit.UE4M3_HALF[0x38] == 0.5 and lowbit.UE4M3_HALF[0x7E] == 224.0  # 1.0 and 448 (max), halved


# --- NVFP4 and Q1_0: not (yet) in GGMLType, tested through their block functions ----------------------------


@FAST
@given(raw=st.integers(1, 6).flatmap(lambda n: st.binary(min_size=36 * n, max_size=36 * n)))
def test_nvfp4_matches_gguf_py(raw):
    blocks = np.frombuffer(raw, np.uint8).reshape(-1, 36)
    theirs = gguf_quants.dequantize(blocks, gguf.GGMLQuantizationType.NVFP4)
    assert same_bits(lowbit.dequantize_nvfp4(blocks), theirs.reshape(-1, 64))


@FAST
@given(d=st.floats(width=16), bits=st.lists(st.booleans(), min_size=128, max_size=128))
def test_q1_0_hand_built_block(d, bits):
    raw = struct.pack("<e", d) + np.packbits(np.array(bits), bitorder="little").tobytes()  # fp16 d, u8 qs[16]
    expected = np.array([np.float32(d) if b else -np.float32(d) for b in bits], np.float32)
    got = lowbit.dequantize_q1_0(np.frombuffer(raw, np.uint8).reshape(1, 18)).reshape(-1)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))  # signs of NaN too: ggml negates


# --- the storage types --------------------------------------------------------------------------------------

STORAGE = {  # type -> (struct format of one element, hypothesis strategy)
    GGMLType.I8: ("<b", st.integers(-128, 127)),
    GGMLType.I16: ("<h", st.integers(-(2**15), 2**15 - 1)),
    GGMLType.I32: ("<i", st.integers(-(2**31), 2**31 - 1)),
    GGMLType.F64: ("<d", st.floats(allow_nan=False)),
}


@pytest.mark.parametrize("t", STORAGE, ids=lambda t: t.name)
def test_storage_type_reads_like_a_c_cast(t):
    fmt, values = STORAGE[t]

    @FAST
    @given(xs=st.lists(values, min_size=1, max_size=20))
    def check(xs):
        raw = b"".join(struct.pack(fmt, x) for x in xs)
        with np.errstate(over="ignore"):
            expected = np.array(xs, np.float64 if t == GGMLType.F64 else np.int64).astype(np.float32)
        assert same_bits(dequantize(raw, t, (len(xs),)), expected)

    check()


def test_i32_rounds_to_nearest_even_above_2_24():
    raw = np.array([2**24 + 1, 2**24 + 3, -(2**31)], "<i4")
    assert dequantize(raw, GGMLType.I32, (3,)).tolist() == [2.0**24, 2.0**24 + 4, -(2.0**31)]


# --- parts: the (scale, value) split the kernels repack is the dequantization -----------------------------

PARTS = {**iqgrid.PARTS, **lowbit.PARTS}
BLOCK = {"IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110, "IQ1_S": 50, "IQ1_M": 56}
BLOCK |= {"TQ1_0": 54, "TQ2_0": 66, "Q1_0": 18, "MXFP4": 17, "NVFP4": 36}
DEQUANTIZE = {name: getattr(iqgrid if name in iqgrid.PARTS else lowbit, f"dequantize_{name.lower()}") for name in PARTS}


@pytest.mark.parametrize("name", PARTS)
def test_parts_times_scales_is_the_dequantization(name):
    blocks = np.random.default_rng(len(name)).integers(0, 256, (500, BLOCK[name]), dtype=np.uint8)
    if name in GGMLType.__members__:
        blocks = finite_scales(blocks.tobytes(), GGMLType[name])
        assert (QUANT_TYPES[GGMLType[name]].type_size, name) == (BLOCK[name], name)
    scale, v = PARTS[name](blocks)
    assert scale.dtype == np.float32 and v.dtype == np.int8 and scale.shape == v.shape[:2]
    assert np.abs(v.astype(np.int32)).max() <= 127
    with np.errstate(all="ignore"):
        product = (v.astype(np.float32) * scale[:, :, None]).reshape(len(blocks), -1)
        assert same_bits(product, DEQUANTIZE[name](blocks))


# --- ggml's C library: live, and goldens recorded from it ---------------------------------------------------
# Q1_0 has no dequantizer in gguf-py 0.19: ggml's C `dequantize_row_q1_0` is the oracle there.


def _golden(name: str) -> tuple[np.ndarray, np.ndarray]:
    with np.load(GOLDENS / f"{name.lower()}.npz") as z:
        return z["blocks"], z["expected"]


@pytest.mark.parametrize("name", ["Q1_0", "NVFP4"])
def test_matches_recorded_ggml_goldens(name):
    path = GOLDENS / f"{name.lower()}.npz"
    if not path.exists():
        pytest.skip(f"no golden recorded yet for {name} (tests/data/quants/record.py needs llama-cpp-python)")
    blocks, expected = _golden(name)
    assert same_bits(DEQUANTIZE[name](blocks).reshape(-1), expected)


@pytest.mark.parametrize("name", ["Q1_0", "NVFP4"])
def test_quantizer_matches_recorded_ggml_golden(name):
    from ggufpy.quants import quantizers

    path = GOLDENS / f"{name.lower()}.npz"
    if not path.exists():
        pytest.skip(f"no golden recorded yet for {name} (tests/data/quants/record.py needs llama-cpp-python)")
    with np.load(path) as z:
        assert np.array_equal(getattr(quantizers, f"quantize_{name.lower()}")(z["x"]), z["q"])


@pytest.mark.conformance
@pytest.mark.parametrize("name", ["Q1_0", "NVFP4"])
def test_matches_ggml_c_library_live(name):
    row = ggml_c_function(f"dequantize_row_{name.lower()}")
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (4096, BLOCK[name]), dtype=np.uint8)
    ours = DEQUANTIZE[name](blocks).reshape(-1)
    expected = row(blocks, np.zeros(ours.size, np.float32), ours.size)
    assert same_bits(ours, expected)


# --- reference quantizers -----------------------------------------------------------------------------------

QUANTIZERS = [GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.MXFP4]
element = st.floats(-1e4, 1e4, width=32).map(lambda v: 0.0 if abs(v) < 1e-6 else v)
rows = st.integers(1, 3).flatmap(lambda n: st.lists(element, min_size=256 * n, max_size=256 * n))
ties = st.integers(1, 3).flatmap(lambda n: st.lists(st.integers(-64, 64), min_size=256 * n, max_size=256 * n))


@pytest.mark.parametrize("t", QUANTIZERS, ids=lambda t: t.name)
def test_quantizer_matches_gguf_py(t):
    @FAST
    @given(x=st.one_of(rows, ties.map(lambda v: [q / 4 for q in v])))
    def check(x):
        x = np.array(x, np.float32).reshape(-1, 256)
        ours = quantize(x, t)
        theirs = gguf_quants.quantize(x, gguf.GGMLQuantizationType(int(t)))
        assert np.array_equal(ours, theirs.view(np.uint8).reshape(ours.shape))

    check()


@pytest.mark.parametrize("t", [GGMLType.TQ1_0, GGMLType.TQ2_0], ids=lambda t: t.name)
def test_ternary_values_roundtrip_exactly(t):
    x = np.random.default_rng(3).integers(-1, 2, (4, 256)).astype(np.float32) * np.float32(0.375)
    x[:, 0] = 0.375  # amax = 0.375, exact in fp16
    assert np.array_equal(dequantize(quantize(x, t), t, x.shape), x)


def test_mxfp4_roundtrips_its_own_values():
    codes = np.random.default_rng(4).integers(0, 16, (8, 32))
    x = lowbit.KVALUES_MXFP4[codes].astype(np.float32) * np.float32(2.0**-5)
    x[:, 0] = 12 * 2.0**-5  # amax 0.375: e = floor(log2 0.375) - 2 + 127 = 123, d = 2^-5
    assert np.array_equal(dequantize(quantize(x, GGMLType.MXFP4), GGMLType.MXFP4, x.shape), x)


def _q1_0_ref(block: np.ndarray) -> bytes:
    """`quantize_row_q1_0_ref` for one block, scalar: sum |x| left to right in f32, bits where x >= 0."""
    total = np.float32(0)
    for v in block:
        total = np.float32(total + np.float32(abs(v)))
    d = total / np.float32(128)
    return struct.pack("<e", float(d)) + np.packbits(block >= 0, bitorder="little").tobytes()


@FAST
@given(x=st.lists(element, min_size=128, max_size=128))
def test_q1_0_quantizer_follows_ggml(x):
    from ggufpy.quants.quantizers import quantize_q1_0

    block = np.array(x, np.float32)
    assert quantize_q1_0(block.reshape(1, 128)).tobytes() == _q1_0_ref(block)


@pytest.mark.conformance
@pytest.mark.parametrize("t", QUANTIZERS, ids=lambda t: t.name)
def test_quantizer_matches_ggml_c_library_live(t):
    row = ggml_c_function(f"quantize_row_{t.name.lower()}_ref")
    x = (np.random.default_rng(9).standard_normal((512, 256)) * np.geomspace(1e-3, 1e3, 512)[:, None]).astype(
        np.float32
    )
    expected = row(x, np.zeros((512, QUANT_TYPES[t].row_bytes(256)), np.uint8), x.size)
    assert np.array_equal(quantize(x, t), expected)


def _fp32_to_ue4m3_scalar(x: np.float32) -> int:
    """ggml-impl.h `ggml_fp32_to_ue4m3`, line by line."""
    if not x > 0:
        return 0
    x = min(x, np.float32(448))
    bits = int(np.array(x, np.float32).view(np.uint32))
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    if exp <= 0:
        man = min(int(x * np.float32(512) + np.float32(0.5)), 7)
        return 0 if man < 1 else man
    if exp >= 15:
        return 0x7E
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    if man > 7:
        man, exp = 0, exp + 1
        if exp >= 15:
            return 0x7E
    return (exp << 3) | man


def _nvfp4_ref(block: np.ndarray) -> bytes:
    """`quantize_row_nvfp4_ref` for one 64-element block, scalar."""
    scales, qs = [], []
    for s in range(4):
        xb = block[16 * s : 16 * s + 16]
        amax = np.float32(0)
        for v in xb:
            amax = max(amax, np.float32(abs(v)))
        ue = _fp32_to_ue4m3_scalar(amax / np.float32(6))
        d = lowbit.UE4M3_HALF[ue]

        def best(v, d=d):
            errs = [abs(np.float32(k) * d - v) for k in lowbit.KVALUES_MXFP4]
            return int(np.argmin(errs))  # the first of equal errors, like the C loop's strict <

        scales.append(ue)
        qs += [best(xb[j]) | (best(xb[8 + j]) << 4) for j in range(8)]
    return bytes(scales + qs)


@FAST
@given(x=st.lists(element, min_size=64, max_size=64), scale=st.sampled_from([1e-6, 1e-3, 1.0, 1e3]))
def test_nvfp4_quantizer_follows_ggml(x, scale):
    from ggufpy.quants.quantizers import fp32_to_ue4m3, quantize_nvfp4

    block = (np.array(x, np.float32) * np.float32(scale)).astype(np.float32)
    assert quantize_nvfp4(block.reshape(1, 64)).tobytes() == _nvfp4_ref(block)
    assert fp32_to_ue4m3(np.abs(block)).tolist() == [_fp32_to_ue4m3_scalar(abs(v)) for v in block]


def test_fp32_to_ue4m3_edges():
    from ggufpy.quants.quantizers import fp32_to_ue4m3

    edges = np.array(
        [0, -1, np.nan, np.inf, 448, 300, 256, 2**-6, 2**-7, 2**-9, 2**-11, 1.0, 1.0625, 1.125], np.float32
    )
    assert fp32_to_ue4m3(edges).tolist() == [_fp32_to_ue4m3_scalar(v) for v in edges]
    assert fp32_to_ue4m3(edges).tolist()[:7] == [0, 0, 0, 0x7E, 0x7E, 0x7E, 0x7E]
