"""The k-quant, IQ4 and importance-matrix quantizers against ggml's C library, byte for byte.

Live (llama-cpp-python installed): random rows from hypothesis, edge cases and real SmolLM2 / Gemma 3 tensors
through `ggml_quantize_chunk` (what llama-quantize runs) and `quantize_row_*_ref`. Always: the goldens in
tests/data/quants/kquantizers.npz (recorded by tests/data/quants/record_kquantizers.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ggufpy.constants import GGMLType
from ggufpy.errors import GGUFError, GGUFUnsupportedError
from ggufpy.quants import QUANT_TYPES, dequantize
from ggufpy.quants import iquantizers as iq
from ggufpy.quants import kquantizers as kq
from ggufpy.quants.kquantizer_search import nearest_int, seqsum
from ggufpy.quants.rowquantizers import ROW_QUANTIZERS, iter_quantize_rows, quantize_rows
from tests.test_quants import _ggml_libraries

GOLDEN = Path(__file__).parent / "data" / "quants" / "kquantizers.npz"
K_TYPES = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
REF_TYPES = [*K_TYPES, GGMLType.IQ4_NL, GGMLType.IQ4_XS]
LEGACY = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]
CHUNK_TYPES = [*REF_TYPES, *LEGACY]
REF_FUNCTIONS = {
    **{t: getattr(kq, f"quantize_row_{t.name.lower().replace('_k', '_K')}_ref") for t in K_TYPES},
    GGMLType.IQ4_NL: iq.quantize_row_iq4_nl_ref,
    GGMLType.IQ4_XS: iq.quantize_row_iq4_xs_ref,
}
N_PER_ROW = 512
FAST = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- ggml's C library through ctypes ----------------------------------------------------------------------


def _base_library() -> ctypes.CDLL:
    libs = _ggml_libraries()
    if libs is None:
        pytest.skip("llama-cpp-python is not installed (pip install 'ggufpy[conformance]')")
    return libs[0]


def c_quantize_chunk(t: GGMLType, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    """ggml_quantize_chunk(type, x, dst, 0, rows, n_per_row, imatrix): u8[rows, row_bytes]."""
    fn = _base_library().ggml_quantize_chunk
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    fn.argtypes += [ctypes.c_void_p]
    fn.restype = ctypes.c_size_t
    x = np.ascontiguousarray(x, np.float32)
    im = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    out = np.zeros((x.shape[0], QUANT_TYPES[t].row_bytes(x.shape[1])), np.uint8)
    written = fn(
        int(t), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None if im is None else im.ctypes.data
    )
    assert written == out.nbytes
    return out


def c_quantize_ref(t: GGMLType, x: np.ndarray) -> np.ndarray:
    """quantize_row_<type>_ref over all of x: u8[blocks, type_size]."""
    name = t.name.lower().replace("_k", "_K")
    fn = getattr(_base_library(), f"quantize_row_{name}_ref")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    qt = QUANT_TYPES[t]
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.size // qt.block_size, qt.type_size), np.uint8)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


# --- inputs ------------------------------------------------------------------------------------------------


def edge_rows(rng: np.random.Generator, n: int = N_PER_ROW) -> np.ndarray:
    """Rows that reach the searches' special cases: all-zero (sub-)blocks, constants, a lone value, one sign,
    tiny / subnormal / large scales, signed zeros, an outlier, small integer grids, quarter-step ties."""
    g = rng.standard_normal
    rows = [np.zeros(n), np.full(n, 0.5), np.full(n, -2.0), np.eye(1, n, 7)[0] * 3, np.eye(1, n, 7)[0] * -3]
    r = g(n)
    r[:48] = 0
    rows.append(r)
    r = g(n)
    r[32:64], r[100:116] = 0, 0
    rows += [r, np.abs(g(n)), -np.abs(g(n)), g(n) * 1e-20, g(n) * 1e-40, g(n) * 1e4]
    r = g(n)
    r[::2] = -0.0
    rows.append(r)
    r = g(n)
    r[5] = 1e3
    rows += [r, rng.integers(-3, 4, n), rng.integers(-40, 41, n) / 8, rng.integers(-64, 65, n) / 4]
    return np.array(rows, np.float32)


def golden_inputs() -> tuple[np.ndarray, np.ndarray]:
    """The goldens' rows and importance matrix (importance values: squares of Gaussians, some exactly 0)."""
    rng = np.random.default_rng(17)
    gauss = rng.standard_normal((8, N_PER_ROW))
    wide = rng.standard_normal((8, N_PER_ROW)) * np.geomspace(1e-3, 1e3, 8)[:, None]
    x = np.concatenate([edge_rows(rng), gauss, wide]).astype(np.float32)
    x[0, 1] = 1.0  # the IQ4_NL reference reads stale stack codes for an all-zero first block
    imatrix = (rng.standard_normal(N_PER_ROW) ** 2).astype(np.float32)
    imatrix[::11] = 0
    return x, imatrix


def rows_strategy(n_per_row: int = 256):
    element = st.floats(-1e3, 1e3, width=32).map(lambda v: 0.0 if abs(v) < 1e-6 else v)
    return st.integers(1, 3).flatmap(lambda r: hnp.arrays(np.float32, (r, n_per_row), elements=element))


def imatrix_strategy(n_per_row: int = 256):
    return st.one_of(st.none(), hnp.arrays(np.float32, n_per_row, elements=st.floats(0, 100, width=32)))


# --- goldens (no llama.cpp needed) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as g:
        return {k: g[k] for k in g.files}


@pytest.mark.parametrize("t", CHUNK_TYPES, ids=lambda t: t.name)
def test_chunk_matches_golden(golden, t):
    x = golden["x"]  # includes 32-blocks of only zeros, some -0.0: ggml keeps +0.0 as their max/min
    with np.errstate(all="ignore"):
        assert np.array_equal(quantize_rows(x, t), golden[f"chunk_{t.name}"])
        assert np.array_equal(quantize_rows(x, t, golden["imatrix"]), golden[f"chunk_{t.name}_imatrix"])


@pytest.mark.parametrize("t", REF_TYPES, ids=lambda t: t.name)
def test_ref_matches_golden(golden, t):
    x = golden["x"][1:].reshape(-1, QUANT_TYPES[t].block_size)
    with np.errstate(all="ignore"):
        assert np.array_equal(REF_FUNCTIONS[t](x), golden[f"ref_{t.name}"])


# --- live against the C library ----------------------------------------------------------------------------


@pytest.mark.conformance
@pytest.mark.parametrize("t", CHUNK_TYPES, ids=lambda t: t.name)
def test_chunk_matches_ggml_random_rows(t):
    @FAST
    @given(x=rows_strategy(), imatrix=imatrix_strategy())
    def check(x, imatrix):
        assert np.array_equal(quantize_rows(x, t, imatrix), c_quantize_chunk(t, x, imatrix))

    check()


@pytest.mark.conformance
@pytest.mark.parametrize("t", REF_TYPES, ids=lambda t: t.name)
def test_ref_matches_ggml_random_rows(t):
    @FAST
    @given(x=rows_strategy())
    def check(x):
        x = x.copy()
        x[0, 0] = 1.0  # not an all-zero first block (see golden_inputs)
        blocks = x.reshape(-1, QUANT_TYPES[t].block_size)
        assert np.array_equal(REF_FUNCTIONS[t](blocks), c_quantize_ref(t, x))

    check()


@pytest.mark.conformance
@pytest.mark.parametrize("t", CHUNK_TYPES, ids=lambda t: t.name)
def test_chunk_matches_ggml_edge_rows(t):
    x = edge_rows(np.random.default_rng(int(t)))
    imatrix = (np.random.default_rng(1).standard_normal(N_PER_ROW) ** 2).astype(np.float32)
    with np.errstate(all="ignore"):
        for im in (None, imatrix, np.zeros_like(imatrix)):
            assert np.array_equal(quantize_rows(x, t, im), c_quantize_chunk(t, x, im)), im


def _real_rows(path_fn, name: str, rows: int) -> np.ndarray:
    import ggufpy

    with ggufpy.open(path_fn()) as f:
        w = f.dequantize(name)
    return w.reshape(-1, w.shape[-1])[:rows]


@pytest.mark.conformance
@pytest.mark.parametrize(
    ("model", "tensor"), [("smollm2", "blk.3.ffn_down.weight"), ("gemma3", "blk.2.ffn_down.weight")], ids=str
)
def test_chunk_matches_ggml_on_real_tensors(model, tensor):
    from tests import models

    x = _real_rows(getattr(models, f"{model}_path"), tensor, 64)
    imatrix = (np.random.default_rng(3).standard_normal(x.shape[1]) ** 2).astype(np.float32)
    for t in CHUNK_TYPES:
        for im in (None, imatrix):
            assert np.array_equal(quantize_rows(x, t, im), c_quantize_chunk(t, x, im)), (t.name, im is None)


# --- properties ------------------------------------------------------------------------------------------


def test_nearest_int_rounds_ties_to_even_like_ggml():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999998, 7.0, -3.25], np.float32)
    assert nearest_int(v).tolist() == [0, 2, 2, 0, -2, 2, 7, -3]


def test_seqsum_is_c_order_not_pairwise():
    a = np.array([[1e8, 1.0, -1e8, 1.0]], np.float32)  # C: ((1e8 + 1) - 1e8) + 1 = 1 in f32
    assert seqsum(a)[0] == np.float32(1.0)
    assert np.signbit(seqsum(np.array([[-0.0, -0.0]], np.float32))[0]) == np.False_  # C starts at +0.0


@pytest.mark.parametrize("t", REF_TYPES, ids=lambda t: t.name)
def test_roundtrip_error_is_small(t):
    """A sanity bound independent of ggml: RMS error relative to RMS of Gaussian weights."""
    x = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    y = dequantize(quantize_rows(x, t), t, x.shape)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    bits = QUANT_TYPES[t].type_size * 8 / QUANT_TYPES[t].block_size
    assert rel < 2.0 ** (1.5 - bits)  # about half a step of a uniform grid of 2^bits levels over ±3 sigma


def test_imatrix_weights_move_the_error():
    """Columns the importance matrix weights up get a smaller error than under the opposite weighting."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    even = np.where(np.arange(256) % 2 == 0, 1000, 1).astype(np.float32)
    for t in (GGMLType.Q4_K, GGMLType.Q3_K, GGMLType.Q6_K, GGMLType.IQ4_XS, GGMLType.Q4_0):
        err_even = np.abs(dequantize(quantize_rows(x, t, even), t, x.shape) - x)[:, ::2].mean()
        err_odd = np.abs(dequantize(quantize_rows(x, t, even[::-1].copy()), t, x.shape) - x)[:, ::2].mean()
        assert err_even < err_odd, t.name


def test_row_quantizer_contract():
    x = np.random.default_rng(2).standard_normal((3, 2, 512)).astype(np.float32)
    out = quantize_rows(x, GGMLType.Q4_K)
    assert out.shape == (3, 2, 2 * 144) and out.dtype == np.uint8
    chunks = list(iter_quantize_rows(x.reshape(6, 512), GGMLType.Q4_K))
    assert chunks[-1][0] == 6 and np.array_equal(np.concatenate([c for _, c in chunks]), out.reshape(6, -1))
    with pytest.raises(GGUFError, match="row length 320 is not a multiple of the block size 256"):
        quantize_rows(np.zeros((2, 320), np.float32), GGMLType.Q4_K)
    with pytest.raises(GGUFError, match="imatrix has 10 values for rows of 512"):
        quantize_rows(x, GGMLType.Q4_K, np.ones(10, np.float32))
    with pytest.raises(GGUFUnsupportedError, match="cannot quantize to IQ2_XXS"):
        quantize_rows(x, GGMLType.IQ2_XXS)
    assert set(CHUNK_TYPES) <= set(ROW_QUANTIZERS)
