"""The IQ1/IQ2/IQ3 quantizers against ggml's C library, byte for byte, and their search tables.

Live (llama-cpp-python installed): random rows from hypothesis, edge rows and real SmolLM2 / Gemma 3 tensors
through `ggml_quantize_chunk`, with and without an importance matrix (IQ2_XXS, IQ2_XS and IQ1_S only with one:
ggml aborts without it), and `quantize_row_*_ref`. Always: the goldens in tests/data/quants/iqgrid_quantizers.npz
(recorded by tests/data/quants/record_iqgrid_quantizers.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy.constants import GGMLType
from ggufpy.errors import GGUFError, GGUFUnsupportedError
from ggufpy.quants import QUANT_TYPES, dequantize, quantize
from ggufpy.quants.iqgrid_quantizers import IQGRID_ROW_QUANTIZERS, REQUIRES_IMATRIX
from ggufpy.quants.iqgrid_tables import grid_tables
from tests.test_quantize_kquants import _base_library, c_quantize_chunk, c_quantize_ref, edge_rows

GOLDEN = Path(__file__).parent / "data" / "quants" / "iqgrid_quantizers.npz"
TYPES = list(IQGRID_ROW_QUANTIZERS)
NO_IMATRIX = [t for t in TYPES if t not in REQUIRES_IMATRIX]  # IQ2_S, IQ3_XXS, IQ3_S, IQ1_M
REF_TYPES = [GGMLType.IQ2_S, GGMLType.IQ3_XXS, GGMLType.IQ3_S]  # ggml exports quantize_row_<type>_ref
N_PER_ROW = 512
# ggml's own grid init (`iq2xs_init_impl`, on first use of a type) takes about a minute for the IQ1 grid and
# 25 s for IQ2_S's: their live comparisons run with the slow tests; the goldens check them always
SLOW_INIT = (GGMLType.IQ1_S, GGMLType.IQ1_M, GGMLType.IQ2_S)


def live(types):
    return [pytest.param(t, id=t.name, marks=[pytest.mark.slow] if t in SLOW_INIT else []) for t in types]


FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def quantize_chunk(x: np.ndarray, t: GGMLType, imatrix: np.ndarray | None) -> np.ndarray:
    with np.errstate(all="ignore"):
        return IQGRID_ROW_QUANTIZERS[t](np.ascontiguousarray(x, np.float32), imatrix)


def imatrices(t: GGMLType, imatrix: np.ndarray) -> list[np.ndarray | None]:
    return [imatrix] if t in REQUIRES_IMATRIX else [imatrix, None]


def golden_inputs() -> tuple[np.ndarray, np.ndarray]:
    """Edge rows (zero sub-blocks, constants, a lone value, one sign, tiny / huge scales, signed zeros,
    quarter-step ties), Gaussians over six decades, heavy tails; an imatrix with some zero columns."""
    rng = np.random.default_rng(23)
    wide = rng.standard_normal((4, N_PER_ROW)) * np.geomspace(1e-3, 1e3, 4)[:, None]
    x = np.concatenate([edge_rows(rng), rng.standard_normal((4, N_PER_ROW)), wide, rng.standard_t(2, (2, N_PER_ROW))])
    imatrix = (rng.standard_normal(N_PER_ROW) ** 2).astype(np.float32)
    imatrix[::13] = 0
    return x.astype(np.float32), imatrix


# --- goldens (no llama.cpp needed) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as g:
        return {k: g[k] for k in g.files}


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_chunk_matches_golden(golden, t):
    x, imatrix = golden["x"], golden["imatrix"]
    assert np.array_equal(quantize_chunk(x, t, imatrix), golden[f"chunk_{t.name}_imatrix"])
    if t in NO_IMATRIX:
        assert np.array_equal(quantize_chunk(x, t, None), golden[f"chunk_{t.name}"])


def test_golden_inputs_are_the_recorded_ones(golden):
    x, imatrix = golden_inputs()
    assert np.array_equal(x, golden["x"]) and np.array_equal(imatrix, golden["imatrix"])


# --- live against the C library ----------------------------------------------------------------------------


@st.composite
def rows_and_imatrix(draw):
    """1-2 rows of 256 from a drawn seed: Gaussian, quarter-step ties, heavy-tailed or sparse, at a drawn
    scale; an imatrix (or None) with some zero columns. (Drawing 256-element arrays element by element is
    what makes hypothesis slow here; the seeded generator keeps each example cheap.)"""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["gauss", "ties", "heavy", "sparse"]))
    shape = (draw(st.integers(1, 2)), 256)
    x = {
        "gauss": lambda: rng.standard_normal(shape),
        "ties": lambda: rng.integers(-40, 41, shape) / 4,
        "heavy": lambda: rng.standard_t(2, shape),
        "sparse": lambda: rng.standard_normal(shape) * (rng.random(shape) < 0.2),
    }[kind]() * 10.0 ** draw(st.integers(-4, 3))
    imatrix = rng.standard_normal(256) ** 2 * (rng.random(256) > 0.1)
    return x.astype(np.float32), imatrix.astype(np.float32) if draw(st.booleans()) else None


@pytest.mark.conformance
@pytest.mark.parametrize("t", live(TYPES))
def test_chunk_matches_ggml_random_rows(t):
    @FAST
    @given(case=rows_and_imatrix())
    def check(case):
        x, im = case
        if im is None and t in REQUIRES_IMATRIX:
            im = np.ones(256, np.float32)
        assert np.array_equal(quantize_chunk(x, t, im), c_quantize_chunk(t, x, im))

    check()


@pytest.mark.conformance
@pytest.mark.parametrize("t", live(TYPES))
def test_chunk_matches_ggml_edge_rows(t):
    x = edge_rows(np.random.default_rng(int(t)))
    imatrix = (np.random.default_rng(1).standard_normal(N_PER_ROW) ** 2).astype(np.float32)
    for im in [*imatrices(t, imatrix), np.zeros_like(imatrix)]:
        assert np.array_equal(quantize_chunk(x, t, im), c_quantize_chunk(t, x, im)), im


@pytest.mark.conformance
@pytest.mark.parametrize("t", live(REF_TYPES))
def test_ref_matches_ggml(t):
    _base_library().ggml_quantize_init(int(t))  # the _ref functions abort unless the grids are built
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 512)) * np.exp(rng.uniform(-20, 20, (3, 1)))
    x[1, :32] = 0  # an all-zero sub-block
    x = x.astype(np.float32)
    with np.errstate(all="ignore"):
        assert np.array_equal(quantize(x, t).reshape(-1, QUANT_TYPES[t].type_size), c_quantize_ref(t, x))


@pytest.mark.slow
@pytest.mark.conformance
@pytest.mark.parametrize(
    ("model", "tensor"), [("smollm2", "blk.3.ffn_down.weight"), ("gemma3", "blk.2.ffn_down.weight")], ids=str
)
def test_chunk_matches_ggml_on_real_tensors(model, tensor):
    import ggufpy
    from tests import models

    with ggufpy.open(getattr(models, f"{model}_path")()) as f:
        w = f.dequantize(tensor)
    x = w.reshape(-1, w.shape[-1])[:4]
    imatrix = (np.random.default_rng(3).standard_normal(x.shape[1]) ** 2).astype(np.float32)
    for t in TYPES:
        for im in imatrices(t, imatrix):
            assert np.array_equal(quantize_chunk(x, t, im), c_quantize_chunk(t, x, im)), (t.name, im is None)


# --- the tables ggml builds at init ---------------------------------------------------------------------------


def _c_neighbours(t, u: int, nwant: int) -> list[int]:
    """`iq2xs_init_impl` / `iq3xs_init_impl` for one code, transcribed: qsort by (d2, j), then the rows of the
    first `nwant` distinct distances."""
    pos = np.array([2 * ((u >> (t.bits * k)) & ((1 << t.bits) - 1)) + 1 for k in range(t.width)])
    d2 = ((2 * t.levels.astype(int) + 1 - pos) ** 2).sum(axis=1)
    order = sorted(range(len(d2)), key=lambda j: (d2[j], j))
    out, d, nhave = [], d2[order[0]], 1
    for j in order:
        if d2[j] > d:
            if nhave == nwant:
                break
            d, nhave = d2[j], nhave + 1
        out.append(j)
    return out


@pytest.mark.parametrize(("name", "nwant"), [("IQ2_XXS", 2), ("IQ2_S", 1), ("IQ1_S", 3), ("IQ3_XXS", 2), ("IQ3_S", 3)])
def test_neighbour_lists_follow_ggml_init(name, nwant):
    t = grid_tables(name)
    on = t.kmap >= 0
    assert on.sum() == len(t.levels) and np.array_equal(t.kmap[t.codes(t.levels)], np.arange(len(t.levels)))
    assert np.all(t.count[on] == 0) and np.all(t.count[~on] > 0)
    for u in np.random.default_rng(0).choice(np.flatnonzero(~on), 25, replace=False):
        assert t.neighbours[t.start[u] : t.start[u] + t.count[u]].tolist() == _c_neighbours(t, int(u), nwant)


# ggml-quants.c's kgrid_* tables (the codes of the grid rows, in row order): the last three and the sum
KGRIDS = {
    "IQ2_XXS": ([42008, 43088, 43268], 3697703),
    "IQ2_XS": ([43562, 43665, 43690], 8004683),
    "IQ2_S": ([43560, 43656, 43690], 16519059),
    "IQ1_S": ([43682, 43688, 43690], 44428132),
    "IQ3_XXS": ([3906, 3924, 3992], 391138),
    "IQ3_S": ([3970, 3993, 4032], 777331),
}


@pytest.mark.parametrize("name", KGRIDS)
def test_grid_codes_are_ggmls_kgrid(name):
    t = grid_tables(name)
    kgrid = t.codes(t.levels)
    assert kgrid[-3:].tolist() == KGRIDS[name][0] and int(kgrid.sum()) == KGRIDS[name][1]
    assert np.all(np.diff(kgrid) > 0)  # ggml lists them in increasing order


def test_iq1_m_shares_iq1_s_tables():
    assert grid_tables("IQ1_M") is grid_tables("IQ1_S")  # built once: `iq2_data_index` maps both to one slot


# --- properties ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", sorted(REQUIRES_IMATRIX), ids=lambda t: t.name)
def test_types_without_a_no_imatrix_path_refuse(t):
    with pytest.raises(GGUFUnsupportedError, match=f"cannot quantize to {t.name} without an importance matrix"):
        quantize_chunk(np.ones((1, 256), np.float32), t, None)
    assert QUANT_TYPES[t].quantize_blocks is None


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_non_finite_values_are_refused(t):
    x = np.ones((1, 512), np.float32)
    x[0, 300] = np.nan
    with pytest.raises(GGUFError, match=rf"cannot quantize to {t.name}: value nan at block 1, element 44"):
        quantize_chunk(x, t, np.ones(512, np.float32))


def test_iq3_s_stores_sub_blocks_after_a_zero_one_a_slot_early():
    """ggml's qs/signs pointers skip the advance for an all-zero sub-block (`quantize_row_iq3_s_impl`)."""
    x = np.random.default_rng(9).standard_normal((1, 256)).astype(np.float32)
    z = x.copy()
    z[0, :32] = 0
    qx, qz = quantize(x, GGMLType.IQ3_S)[0], quantize(z, GGMLType.IQ3_S)[0]
    qs, signs = slice(2, 66), slice(74, 106)
    assert np.array_equal(qz[qs][:56], qx[qs][8:]) and not qz[qs][56:].any()  # without an imatrix the
    assert np.array_equal(qz[signs][:28], qx[signs][4:]) and not qz[signs][28:].any()  # sub-blocks are independent


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_roundtrip_error_is_bounded(t):
    """Independent of ggml: relative RMS error on Gaussian rows below what each format's bits allow."""
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    imatrix = np.ones(256, np.float32)
    y = dequantize(quantize_chunk(x, t, imatrix), t, x.shape)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    bits = QUANT_TYPES[t].type_size * 8 / QUANT_TYPES[t].block_size
    assert rel < 2.0 ** (1.2 - bits / 2), rel
    assert np.all(np.abs(y - x) <= 2 * np.abs(x).max(axis=1, keepdims=True))


def test_imatrix_moves_the_error():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    even = np.where(np.arange(256) % 2 == 0, 1000, 1).astype(np.float32)
    for t in TYPES:
        err_even = np.abs(dequantize(quantize_chunk(x, t, even), t, x.shape) - x)[:, ::2].mean()
        err_odd = np.abs(dequantize(quantize_chunk(x, t, even[::-1].copy()), t, x.shape) - x)[:, ::2].mean()
        assert err_even < err_odd, t.name
