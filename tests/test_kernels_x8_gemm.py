"""The prefill kernels that unpack each weight block once for all activation rows (`int8ir_x8_gemm`: grouped
Q4_0 and Q4_K, Q6_K's tiled rows): every product bit for bit the NumPy replay of ggml's kernels (both builds)
and the one-row kernels, for T = 1..13 activation rows (Q4_K: T - T % 4 of them through the gemm; Q6_K: the
tiled kernel from T = 8), several widths, one and two threads."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T

int8dot = pytest.importorskip("ggufpy.kernels.int8dot")
pytestmark = pytest.mark.skipif(not int8dot.AVAILABLE, reason="no numba JIT or no AVX2: the f32 kernels run")
from tests.test_kernels_int8 import ISAS, activations, assert_bitwise, random_weight, replay  # noqa: E402

SHAPES = [(T.Q4_0, 8, 32), (T.Q4_0, 16, 288), (T.Q4_0, 40, 1024), (T.Q4_K, 8, 256), (T.Q4_K, 16, 768),
          (T.Q4_K, 40, 2048), (T.Q6_K, 8, 256), (T.Q6_K, 13, 1024)]  # fmt: skip


@pytest.mark.parametrize("t, rows, cols", SHAPES)
def test_gemm_rows_equal_the_replay_for_t_1_to_13(t, rows, cols):
    rng = np.random.default_rng(rows + cols)
    w = random_weight(t, rows, cols, rng)
    iw, plain = int8dot.weight(w), int8dot.weight(w, interleave=False)
    assert iw.kernel is (int8dot._K_KERNELS | int8dot._GROUPED)[t]
    for n in range(1, 14):
        x = activations(rng, n, cols)
        got = int8dot.linear(x, iw, threads=1 + n % 2)
        for isa in ISAS:
            assert_bitwise(got, replay(x, w, isa))
        if t != T.Q6_K:  # Q6_K's GGUF rows are its only layout
            assert_bitwise(got, int8dot.linear(x, plain, threads=1))


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_K])
def test_threads_and_group_order_do_not_change_a_bit(t):
    """One and two threads, and each row of a batch against the same row alone through the gemv (T = 1): the
    gemm and gemv rows agree for Q4_0 (one formula); Q4_K's gemm rows round per 64 elements, so they differ."""
    rng = np.random.default_rng(7)
    w = random_weight(t, 64, 512, rng)
    iw = int8dot.weight(w)
    x = activations(rng, 8, 512)
    one, two = int8dot.linear(x, iw, threads=1), int8dot.linear(x, iw, threads=2)
    assert_bitwise(one, two)
    alone = np.concatenate([int8dot.linear(x[i : i + 1], iw, threads=1) for i in range(8)])
    if t == T.Q4_0:
        assert_bitwise(one, alone)
    else:
        assert (one.view(np.uint32) != alone.view(np.uint32)).any()  # the test can tell gemm from gemv rows
