"""Dequantization and the registry, checked bit for bit against gguf-py (llama.cpp's own NumPy port), against
blocks built field by field from llama.cpp `ggml/src/ggml-common.h`, and, when llama-cpp-python is installed
(the `conformance` extra), against the compiled ggml C library itself through ctypes.

Every test is parametrized over `QUANT_TYPES`, so a newly registered type is picked up automatically.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy.constants import GGML_BLOCK_LAYOUT, GGMLType
from ggufpy.errors import GGUFError, GGUFUnsupportedError
from ggufpy.quants import QUANT_TYPES, QuantType, dequantize, quant_type, quantize

gguf = pytest.importorskip("gguf")
gguf_quants = pytest.importorskip("gguf.quants")

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Byte offsets of the fp16 scale fields of each block (ggml-common.h). The property test forces them finite
# so that the comparison exercises real values; a type missing here is still tested, with NaN-safe equality.
FP16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.F16: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q8_1: (0, 2),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
    GGMLType.IQ2_XXS: (0,),
    GGMLType.IQ2_XS: (0,),
    GGMLType.IQ2_S: (0,),
    GGMLType.IQ3_XXS: (0,),
    GGMLType.IQ3_S: (0,),
    GGMLType.IQ1_S: (0,),
    GGMLType.TQ1_0: (52,),
    GGMLType.TQ2_0: (64,),
    GGMLType.Q1_0: (0,),
}


def _gguf_type(t: GGMLType):
    try:
        return gguf.GGMLQuantizationType(int(t))
    except ValueError:
        return None


def _gguf_can(fn, t: GGMLType, data: np.ndarray) -> bool:
    gt = _gguf_type(t)
    if gt is None:
        return False
    try:
        fn(data, gt)
    except NotImplementedError:
        return False
    return True


def gguf_dequantizable(t: GGMLType) -> bool:
    _, type_size = GGML_BLOCK_LAYOUT[t]
    return _gguf_can(gguf_quants.dequantize, t, np.zeros((1, type_size), np.uint8))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equality of two f32 arrays; NaNs must sit at the same places (payloads may differ)."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    keep = ~np.isnan(a)
    return np.array_equal(a.view(np.uint32)[keep], b.view(np.uint32)[keep])


def finite_scales(raw: bytes, t: GGMLType) -> np.ndarray:
    """Random block bytes with every fp16 scale field made finite (exponent 31 -> 15)."""
    qt = QUANT_TYPES[t]
    blocks = np.frombuffer(raw, np.uint8).reshape(-1, qt.type_size).copy()
    for off in FP16_FIELDS.get(t, ()):
        hi = blocks[:, off + 1]
        blocks[:, off + 1] = np.where((hi & 0x7C) == 0x7C, hi & ~np.uint8(0x40), hi)
    if t == GGMLType.IQ1_M:  # its fp16 d is bits 12-15 of four u16 (bytes 49, 51, 53, 55): exponent 14..10
        all_ones = ((blocks[:, 55] & 0x70) == 0x70) & ((blocks[:, 53] & 0xC0) == 0xC0)
        blocks[:, 55] = np.where(all_ones, blocks[:, 55] & ~np.uint8(0x40), blocks[:, 55])
    return blocks


def block_bytes(qt: QuantType, max_blocks: int = 6):
    return st.integers(1, max_blocks).flatmap(lambda n: st.binary(min_size=n * qt.type_size, max_size=n * qt.type_size))


ALL_TYPES = list(QUANT_TYPES)
ORACLE_TYPES = [t for t in ALL_TYPES if gguf_dequantizable(t)]
NOT_IN_GGUF_PY = [t for t in ALL_TYPES if t not in ORACLE_TYPES]


# --- the registry -------------------------------------------------------------------------------------------


def test_registry_covers_the_promised_types():
    promised = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K"}
    promised |= {"Q5_K", "Q6_K", "Q8_K", "IQ4_NL", "IQ4_XS"}
    promised |= {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"}
    promised |= {"I8", "I16", "I32", "F64"}
    promised |= {name for name in ("NVFP4", "Q1_0") if name in GGMLType.__members__}  # once constants.py has them
    assert {t.name for t in QUANT_TYPES} == promised
    # these get hand-built checks below and in tests/test_quant_types_new.py (gguf-py 0.19 has no Q1_0 class)
    hand_built = {GGMLType.Q8_1, GGMLType.Q8_K, GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.F64}
    assert {t.name for t in NOT_IN_GGUF_PY} <= {t.name for t in hand_built} | {"Q1_0"}


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_record_matches_ggml_type_traits(t):
    qt = quant_type(t)
    assert qt is quant_type(int(t)) is QUANT_TYPES[t]
    assert qt.ggml_type is t
    assert (qt.block_size, qt.type_size) == GGML_BLOCK_LAYOUT[t]
    # gguf-py's GGML_QUANT_SIZES still lists Q8_1 as (32, 40), the old f32 d/s layout; ggml-common.h has 36.
    if t in ORACLE_TYPES:
        assert (qt.block_size, qt.type_size) == tuple(gguf.GGML_QUANT_SIZES[_gguf_type(t)])


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_blocks_contract(t):
    qt = QUANT_TYPES[t]
    raw = np.random.default_rng(1).integers(0, 256, (5, qt.type_size), dtype=np.uint8)
    raw = finite_scales(raw.tobytes(), t)
    out = qt.dequantize_blocks(raw)
    assert out.dtype == np.float32 and out.shape == (5, qt.block_size)
    empty = qt.dequantize_blocks(np.zeros((0, qt.type_size), np.uint8))
    assert empty.shape == (0, qt.block_size)


def test_unsupported_type_names_it_and_lists_supported():
    with pytest.raises(GGUFUnsupportedError) as e:
        quant_type(GGMLType.I64)
    msg = str(e.value)
    assert "I64" in msg
    assert all(t.name in msg for t in QUANT_TYPES)


@pytest.mark.parametrize("bad", [4, 31, 99, -1])
def test_unknown_type_id(bad):
    with pytest.raises(GGUFUnsupportedError, match=f"unknown ggml type id {bad}"):
        quant_type(bad)


def test_dequantize_rejects_wrong_byte_count():
    raw = np.zeros(144 * 3 - 1, np.uint8)
    with pytest.raises(GGUFError, match=r"Q4_K tensor of shape \(3, 256\) needs 432 bytes .* got 431"):
        dequantize(raw, GGMLType.Q4_K, (3, 256))
    with pytest.raises(GGUFError, match="not a multiple of the block size 32"):
        dequantize(np.zeros(18, np.uint8), GGMLType.Q4_0, (1, 16))


def test_dequantize_shapes_and_inputs():
    rng = np.random.default_rng(2)
    raw = finite_scales(rng.integers(0, 256, (2 * 3 * 2, 34), dtype=np.uint8).tobytes(), GGMLType.Q8_0)
    expected = QUANT_TYPES[GGMLType.Q8_0].dequantize_blocks(raw).reshape(2, 3, 64)
    flat = raw.reshape(-1)
    flat.flags.writeable = False  # a read-only mmap view is the usual input
    assert same_bits(dequantize(flat, GGMLType.Q8_0, (2, 3, 64)), expected)
    assert same_bits(dequantize(raw, int(GGMLType.Q8_0), [2, 3, 64]), expected)  # any byte layout, list shape
    assert same_bits(dequantize(raw.tobytes(), GGMLType.Q8_0, (2, 3, 64)), expected)
    assert dequantize(np.zeros(0, np.uint8), GGMLType.Q6_K, (0, 256)).shape == (0, 256)
    f32 = np.arange(6, dtype=np.float32)
    assert np.array_equal(dequantize(f32, GGMLType.F32, (2, 3)), f32.reshape(2, 3))  # non-u8 raw is read as bytes


# --- dequantization against gguf-py -------------------------------------------------------------------------


@pytest.mark.parametrize("t", ORACLE_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_py(t):
    qt = QUANT_TYPES[t]

    @FAST
    @given(raw=block_bytes(qt))
    def check(raw):
        blocks = finite_scales(raw, t)
        ours = dequantize(blocks, t, (blocks.shape[0] * qt.block_size,))
        with np.errstate(all="ignore"):
            theirs = gguf_quants.dequantize(blocks, _gguf_type(t)).reshape(-1)
        assert same_bits(ours, theirs)

    check()


@pytest.mark.parametrize("t", ORACLE_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_py_on_many_uniform_blocks(t):
    """Uniform random bytes, including inf/NaN scales (hypothesis favours small byte values)."""
    qt = QUANT_TYPES[t]
    raw = np.random.default_rng(int(t)).integers(0, 256, (2048, qt.type_size), dtype=np.uint8)
    ours = dequantize(raw, t, (2048 * qt.block_size,))
    with np.errstate(all="ignore"):
        theirs = gguf_quants.dequantize(raw, _gguf_type(t)).reshape(-1)
    assert same_bits(ours, theirs)


# --- Q8_1 and Q8_K (not in gguf-py): blocks built field by field from ggml-common.h -------------------------

fp16_values = st.floats(width=16, allow_nan=False, allow_infinity=False)
f32_values = st.floats(width=32, allow_nan=False, allow_infinity=False)
int8_lists = st.lists(st.integers(-128, 127), min_size=32, max_size=32)


@FAST
@given(d=fp16_values, s=fp16_values, qs=int8_lists)
def test_q8_1_hand_built_block(d, s, qs):
    raw = struct.pack("<ee32b", d, s, *qs)  # block_q8_1: fp16 d, fp16 s, int8 qs[32]
    assert len(raw) == QUANT_TYPES[GGMLType.Q8_1].type_size
    expected = np.array([np.float32(q) * np.float32(d) for q in qs], np.float32)
    assert same_bits(dequantize(np.frombuffer(raw, np.uint8), GGMLType.Q8_1, (32,)), expected)


@FAST
@given(d=f32_values, qs=st.lists(st.integers(-128, 127), min_size=256, max_size=256))
def test_q8_k_hand_built_block(d, qs):
    bsums = [sum(qs[16 * g : 16 * g + 16]) for g in range(16)]
    raw = struct.pack("<f256b16h", d, *qs, *bsums)  # block_q8_K: f32 d, int8 qs[256], int16 bsums[16]
    assert len(raw) == QUANT_TYPES[GGMLType.Q8_K].type_size
    with np.errstate(over="ignore"):
        expected = np.array([np.float32(d) * np.float32(q) for q in qs], np.float32)
    assert same_bits(dequantize(np.frombuffer(raw, np.uint8), GGMLType.Q8_K, (256,)), expected)


# --- the compiled ggml C library (llama-cpp-python ships it) ------------------------------------------------


@functools.cache
def _ggml_libraries() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    found = [next(iter(sorted(lib_dir.glob(f"libggml-{part}.*"))), None) for part in ("base", "cpu")]
    if None in found:
        return None
    # libggml-cpu links against libggml-base: load base first, globally
    return tuple(ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL) for path in found)


def ggml_c_function(symbol: str, library: str = "base"):
    """`void symbol(const void * src, void * dst, int64_t n)` from ggml's C library; skips if unavailable."""
    libs = _ggml_libraries()
    if libs is None:
        pytest.skip("llama-cpp-python is not installed (pip install 'ggufpy[conformance]')")
    lib = libs[0] if library == "base" else libs[1]
    try:
        fn = getattr(lib, symbol)
    except AttributeError:
        pytest.skip(f"ggml's C library exports no {symbol}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None

    def call(src: np.ndarray, dst: np.ndarray, n: int) -> np.ndarray:
        src, dst = np.ascontiguousarray(src), np.ascontiguousarray(dst)
        fn(src.ctypes.data, dst.ctypes.data, n)
        return dst

    return call


_FLOAT_ROWS = {
    (GGMLType.F16, "dequantize"): "ggml_fp16_to_fp32_row",
    (GGMLType.BF16, "dequantize"): "ggml_bf16_to_fp32_row",
    (GGMLType.F16, "quantize"): "ggml_fp32_to_fp16_row",
    (GGMLType.BF16, "quantize"): "ggml_fp32_to_bf16_row_ref",
}


def ggml_symbol(t: GGMLType, verb: str) -> str:
    """ggml's row function for a type and verb: `dequantize_row_q4_K`, `quantize_row_q8_0_ref`, ..."""
    if (t, verb) in _FLOAT_ROWS:
        return _FLOAT_ROWS[t, verb]
    name = t.name.lower().replace("_k", "_K")
    return f"dequantize_row_{name}" if verb == "dequantize" else f"quantize_row_{name}_ref"


# ggml's C library has no dequantize_row_* for F32, Q8_1 (an activation-only format) or the storage types
NO_C_ROW = (GGMLType.F32, GGMLType.Q8_1, GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.F64)


@pytest.mark.conformance
@pytest.mark.parametrize("t", [t for t in ALL_TYPES if t not in NO_C_ROW], ids=lambda t: t.name)
def test_dequantize_matches_ggml_c_library(t):
    qt = QUANT_TYPES[t]
    row = ggml_c_function(ggml_symbol(t, "dequantize"))
    rng = np.random.default_rng(100 + int(t))
    for raw in (
        rng.integers(0, 256, (4096, qt.type_size), dtype=np.uint8),
        finite_scales(rng.bytes(4096 * qt.type_size), t),
    ):
        n = raw.shape[0] * qt.block_size
        expected = row(raw, np.zeros(n, np.float32), n)
        assert same_bits(dequantize(raw, t, (n,)), expected)


# --- unknown-to-gguf-py types get at least the contract and zero checks -------------------------------------


@pytest.mark.parametrize("t", NOT_IN_GGUF_PY, ids=lambda t: t.name)
def test_zero_block_is_zero(t):
    qt = QUANT_TYPES[t]
    out = dequantize(np.zeros(qt.type_size, np.uint8), t, (qt.block_size,))
    assert np.array_equal(out, np.zeros(qt.block_size, np.float32))


def test_quantize_is_exported_here_too():
    assert callable(quantize)


# --- every tensor of the two real models ----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])  # ~5 s and ~26 s
def test_real_model_tensors_match_gguf_py(model):
    import ggufpy
    from tests.models import MODELS

    path = MODELS[model]()
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    with ggufpy.open(path) as f:
        assert sorted(f.tensors) == sorted(theirs)
        for name, info in f.tensors.items():
            ours = dequantize(f.raw(name), info.type, info.shape)
            ref = theirs[name]
            with np.errstate(all="ignore"):
                expected = gguf_quants.dequantize(ref.data, ref.tensor_type)
            assert same_bits(ours, expected.reshape(info.shape)), name
            assert info.shape == tuple(reversed([int(n) for n in ref.shape])), name
