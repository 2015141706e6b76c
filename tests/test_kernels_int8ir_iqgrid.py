"""The grid types' AVX2-IR kernels (IR: `ggufpy/kernels/int8ir_iqgrid.py`, kernels: `int8grid.py`) equal the
llamacpp numerics' NumPy replay bit for bit: below 8 activation rows the vec_dot (`ggufpy.quants.x86.iqgrid`),
from 8 the tiled kernel (`ggufpy.quants.x86.tiled`), as `vecdot.linear_x86` picks them; and `int8lowbit`
dispatches these types here."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot
from ggufpy.quants.x86 import iqgrid, tiled

int8grid = pytest.importorskip("ggufpy.kernels.int8grid")
from ggufpy.kernels import _numba, int8dot, int8lowbit  # noqa: E402
from tests.test_kernels_int8_lowbit import activations, assert_bitwise, random_weight  # noqa: E402

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

TYPES = list(int8grid.KERNELS)


def _raw(w) -> np.ndarray:
    return np.asarray(w.raw).view(np.uint8).reshape(w.shape[0], -1)


def _run(kernel, x, w, threads):
    a = int8dot.quantize(x, int8lowbit.Q8_K)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    kernel(threads, _raw(w), a.q, a.d, a.bsums, out)
    return out


def _extremes(rng, n_rows, cols):
    """`activations` with one row of equal values (every quant -127 or 127: the largest integer sums)."""
    x = activations(rng, n_rows, cols)
    x[0] = np.float32(rng.choice([-1.0, 1.0])) * np.float32(3.0)
    return x


def test_every_grid_type_has_a_kernel():
    assert set(TYPES) == {T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M}
    assert all(int8lowbit.KERNELS[t][3] is int8grid.KERNELS[t] for t in TYPES)


SHAPES = [(1, 40, 256), (2, 8, 512), (3, 13, 768), (7, 24, 1024), (1, 1, 2048), (8, 16, 512), (13, 9, 768)]
SHAPES += [(33, 3, 256)]  # (T, rows, cols)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n_rows", "rows", "cols"), SHAPES)
def test_vec_dot_equals_the_replay(t, n_rows, rows, cols):
    """(T, rows, cols): T = 1 (`grid_dot`), 2, 3, 7 (`grid_dot_rows`), 8, 13, 33 (tiled); row counts with and
    without a multiple of 8; 1 to 8 super-blocks per row."""
    rng = np.random.default_rng([int(t), n_rows, rows])
    w = random_weight(t, rows, cols, rng)
    x = _extremes(rng, n_rows, cols)
    want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
    assert_bitwise(_run(int8grid.KERNELS[t], x, w, 1), want)
    assert_bitwise(_run(int8lowbit.KERNELS[t][3], x, w, 2), want)  # int8lowbit's dispatch, two threads


@pytest.mark.parametrize("t", [T.IQ2_XXS, T.IQ3_S, T.IQ1_M], ids=lambda t: t.name)
def test_seven_and_eight_rows_take_different_kernels(t):
    """7 rows: vec_dot, 8 rows: tiled, each equal to its own replay and, on these bytes, not to the other's (so
    the tests above tell the two paths apart)."""
    rng = np.random.default_rng([int(t), 8])
    w = random_weight(t, 32, 2048, rng)
    x = activations(rng, 8, 2048)
    for n, own, other in ((7, iqgrid.KERNELS[t], tiled.KERNELS[t]), (8, tiled.KERNELS[t], iqgrid.KERNELS[t])):
        q8k = vecdot.quantize_activations(x[:n], T.Q8_K)
        got = _run(int8grid.KERNELS[t], x[:n], w, 2)
        assert_bitwise(got, own(_raw(w), q8k))
        assert not np.array_equal(got, other(_raw(w), q8k))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 5, 8])
def test_equals_llama_cpp(t, n_rows):
    """The same bytes through llama.cpp's own mul_mat (a one-node ggml graph): equal bit for bit."""
    pytest.importorskip("llama_cpp")
    from conformance.ggml_graph import ggml_graph_matmul

    rng = np.random.default_rng([int(t), n_rows, 7])
    w = random_weight(t, 24, 768, rng)
    x = activations(rng, n_rows, 768)
    assert_bitwise(_run(int8grid.KERNELS[t], x, w, 2), ggml_graph_matmul(_raw(w), t, x))
