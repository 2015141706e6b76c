"""`int8rows.product_rows` (the llamacpp numerics' batched products, `int8ir_rows.py`): every activation row of
a batch is bit for bit its product alone, through the weight's one-row kernel, for every integer-kernel type
and row count (hypothesis), and equals the NumPy replay of ggml's one-row x86 kernel (`vecdot.linear_x86` on
that row: the outside oracle, checked against llama.cpp in test_kernels_int8.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy.constants import GGMLType as T

int8dot = pytest.importorskip("ggufpy.kernels.int8dot")
pytestmark = pytest.mark.skipif(not int8dot.AVAILABLE, reason="no numba JIT or no AVX2: the f32 kernels run")

from ggufpy.kernels import int8rows  # noqa: E402
from tests.test_kernels_int8 import activations, assert_bitwise, random_weight, replay  # noqa: E402

# the 32-element types in GGUF rows: the kernels of `int8ir_rows` (Q4_0 and Q8_0 when out % 8 != 0); the
# k-quants (`int8ir_rows_k`) and Q4_0's eight-row groups (out % 8 == 0) have one too
ROW_TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_1, T.Q5_1]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    t=st.sampled_from(list(int8dot.INT8_TYPES)),
    rows=st.sampled_from([8, 12, 16, 20, 36]),
    blocks=st.integers(1, 4),
    n_rows=st.integers(1, 19),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_row_is_its_product_alone(t, rows, blocks, n_rows, seed):
    """Any type, any row count (past the gemm form's 4 and the tiled form's 8, past one call's 8 rows)."""
    rng = np.random.default_rng(seed)
    w = random_weight(t, rows, blocks * int8dot.INT8_TYPES[t][2], rng)
    iw = int8dot.weight(w)
    if iw is None:  # Q4_K with rows % 8 != 0: the f32 kernels
        return
    x = activations(rng, n_rows, w.shape[1])
    got = int8rows.product_rows(int8dot.quantize(x, iw.fmt), iw, threads=2)
    alone = np.concatenate([int8dot.linear(x[b : b + 1], iw, threads=1) for b in range(n_rows)])
    assert_bitwise(got, alone)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    t=st.sampled_from([*ROW_TYPES, T.Q4_K, T.Q6_K, T.Q5_K, T.Q3_K]),
    grouped=st.booleans(),
    rows=st.sampled_from([1, 3, 12, 20]),
    blocks=st.integers(1, 5),
    n_rows=st.integers(1, 17),
    seed=st.integers(0, 2**32 - 1),
)
def test_row_kernels_equal_the_one_row_replay(t, grouped, rows, blocks, n_rows, seed):
    """The block-decoded-once kernels against ggml's one-row kernel as the NumPy replay runs it, row by row: the
    32-element types, Q6_K, Q5_K and Q3_K in GGUF rows, and Q4_0's and Q4_K's eight-row groups (the repacked
    gemv)."""
    rng = np.random.default_rng(seed)
    grouped = t == T.Q4_K or (grouped and t == T.Q4_0)
    if grouped:  # out % 8 == 0: the weight is copied into eight-row groups
        rows = 8 * max(1, rows // 4)
    block = 256 if t in (T.Q4_K, T.Q6_K, T.Q5_K, T.Q3_K) else 32
    w = random_weight(t, rows, max(1, blocks * 32 // block) * block, rng)
    iw = int8dot.weight(w)
    assert iw.kernel in int8rows._ROWS, f"{t.name} with {rows} rows should take a block-decoded-once kernel"
    x = activations(rng, n_rows, w.shape[1])
    got = int8rows.product_rows(int8dot.quantize(x, iw.fmt), iw, threads=2)
    want = np.concatenate([replay(x[b : b + 1], w, "avx2") for b in range(n_rows)])
    assert_bitwise(got, want)


def test_a_batch_differs_from_the_gemm_forms():
    """The check above can fail: Q4_K's repacked gemm (4+ rows) and Q6_K's tiled kernel (8+ rows) round
    differently from their one-row kernels on these rows, and `product_rows` must not take them."""
    rng = np.random.default_rng(7)
    for t in (T.Q4_K, T.Q6_K):
        w = random_weight(t, 16, 1024, rng)
        iw = int8dot.weight(w)
        x = activations(rng, 9, 1024)
        a = int8dot.quantize(x, iw.fmt)
        rows = int8rows.product_rows(a, iw, threads=2)
        assert not np.array_equal(int8dot.product(a, iw, 2).view(np.uint32), rows.view(np.uint32)), t.name
        alone = np.concatenate([int8dot.linear(x[b : b + 1], iw, threads=1) for b in range(9)])
        assert_bitwise(rows, alone)
