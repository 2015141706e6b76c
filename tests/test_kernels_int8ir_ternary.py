"""The LLVM-IR kernels of TQ1_0, TQ2_0 and Q1_0 (`ggufpy/kernels/int8ir_ternary.py`) equal the llamacpp
numerics' NumPy replay of ggml's x86 kernels (`quants.x86.ternary`, `q1_0`, through `vecdot.linear_x86`) bit for
bit: random blocks (every byte pattern, TQ2_0's unused code 3 included), T = 1..17, odd row counts, one and two
threads."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot
from ggufpy.quants.x86 import kernel_for

int8ir_ternary = pytest.importorskip("ggufpy.kernels.int8ir_ternary")
from ggufpy.kernels import _numba, int8dot, int8lowbit  # noqa: E402
from tests.test_kernels_int8_lowbit import activations, assert_bitwise, random_weight  # noqa: E402

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

TYPES = list(int8ir_ternary.KERNELS)


def product(x: np.ndarray, raw: np.ndarray, t: T, threads: int) -> np.ndarray:
    fmt, _, _, kernel = int8ir_ternary.KERNELS[t]
    a = int8dot.quantize(x, fmt)
    out = np.empty((x.shape[0], raw.shape[0]), np.float32)
    if fmt == int8ir_ternary.Q8_K:
        kernel(threads, raw, a.q, a.d, a.bsums, out)
    else:
        kernel(threads, raw, a.q, a.d, a.s, a.asum, out)
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("n_rows", "rows", "cols", "threads"),
    [
        (1, 40, 256, 1),
        (1, 7, 1024, 2),
        (2, 11, 1024, 2),
        (3, 36, 768, 2),
        (8, 24, 2048, 1),
        (16, 9, 512, 2),
        (17, 40, 512, 1),
    ],
)
def test_random_blocks_equal_the_replay(t, n_rows, rows, cols, threads):
    """Decode (T = 1), small batches and prefill (TQ1_0 unpacks its codes from T = 2; rows past one 16-row task);
    the replay runs one kernel for every shape (`kernel_for`)."""
    rng = np.random.default_rng([int(t), n_rows, rows])
    w = random_weight(t, rows, cols, rng)
    _, size, block, _ = int8ir_ternary.KERNELS[t]
    raw = np.asarray(w.raw).view(np.uint8).reshape(rows, cols // block * size)
    x = activations(rng, n_rows, cols)
    want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
    assert kernel_for(t, rows, n_rows) is kernel_for(t, rows, 1)  # one replay kernel: no shape to dispatch on
    assert_bitwise(product(x, raw, t, threads), want)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_registered_for_int8dot(t):
    """int8lowbit (and so int8dot) runs these kernels for the three types."""
    assert int8lowbit.KERNELS[t] == int8ir_ternary.KERNELS[t]
    assert int8dot.INT8_TYPES[t] == int8ir_ternary.KERNELS[t][:3]


def test_top_digit_identity():
    """`_digit`'s compares equal the fixed-point digit of `lowbit._trits`, (3 m) >> 8, for every byte."""
    m = np.arange(256)
    assert np.array_equal((3 * m) >> 8, (m > 85).astype(int) + (m > 170))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 3, 16])
def test_equal_llamacpp_mul_mat(t, n_rows):
    """Live: llama.cpp's own mul_mat on the same bytes (one-node ggml graph), bit for bit."""
    pytest.importorskip("llama_cpp")
    from conformance.ggml_graph import ggml_graph_matmul

    rng = np.random.default_rng([int(t), n_rows, 99])
    rows, cols = 24, 1024
    w = random_weight(t, rows, cols, rng)
    _, size, block, _ = int8ir_ternary.KERNELS[t]
    raw = np.asarray(w.raw).view(np.uint8).reshape(rows, cols // block * size)
    x = activations(rng, n_rows, cols)
    assert_bitwise(product(x, raw, t, 2), ggml_graph_matmul(raw, t, x))
