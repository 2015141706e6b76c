"""Prefill attention streams over blocks of queries (issue 16 item 5): memory O(rows x S), not O(T x S).

- `ops.attention` (exact numerics): one block while the scores fit the budget, so today's results are kept bit
  for bit; in blocks beyond it (BLAS sums a block's rows in another order than all rows: equal to ~1e-6);
- `quants.x86.attention` (llamacpp numerics): bit-identical for every budget (the replayed kernels depend on T
  only through T >= 2, and no block has a single row);
- the peak memory of a long prefill's attention follows the budget, not T x S.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from ggufpy import ops
from ggufpy.quants.x86 import attention as x86

f32 = np.float32


def _qkv(T: int, start: int, H: int, G: int, E: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    S = start + T
    q = rng.standard_normal((T, H, E), f32)
    return q, rng.standard_normal((S, G, E), f32), rng.standard_normal((S, G, E), f32)


@pytest.mark.parametrize(("T", "rows", "blocks"), [(1, 2, [(0, 1)]), (7, 2, [(0, 2), (2, 4), (4, 7)]),
                                                   (8, 4, [(0, 4), (4, 8)]), (9, 4, [(0, 4), (4, 9)]),
                                                   (5, 100, [(0, 5)])])  # fmt: skip
def test_query_blocks_never_leave_a_single_row(T, rows, blocks):
    assert [(s.start, s.stop) for s in ops.query_blocks(T, rows)] == blocks


def test_query_rows_follow_the_budget():
    assert ops.query_rows(100, 1000, 8, 4, budget=8 * 1000 * 4 * 10) == 10
    assert ops.query_rows(100, 1000, 8, 4, budget=1) == 2  # never a single row
    assert ops.query_rows(5, 1000, 8, 4, budget=1 << 30) == 5


@pytest.mark.parametrize("extra", [{}, {"window": 5}, {"softcap": 4.0}, {"sinks": np.array([0.5, -1, 2, 0], f32)}])
@pytest.mark.parametrize(("T", "start"), [(9, 0), (33, 6)])
def test_exact_attention_in_blocks(T, start, extra):
    q, k, v = _qkv(T, start, 4, 2, 32)
    whole = ops.attention(q, k, v, start, 0.25, **extra)
    S = start + T
    fits = ops.attention(q, k, v, start, 0.25, budget=4 * T * S * 4, **extra)  # exactly one block
    assert np.array_equal(fits, whole)
    for budget in (1, 3 * 4 * S * 4):  # blocks of 2 and 3 rows
        blocked = ops.attention(q, k, v, start, 0.25, budget=budget, **extra)
        np.testing.assert_allclose(blocked, whole, rtol=0, atol=2e-6)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("extra", [{}, {"window": 5}, {"softcap": 4.0}, {"sinks": np.array([0.5, -1, 2, 0], f32)}])
def test_llamacpp_attention_in_blocks_is_bit_identical(extra, isa):
    q, k, v = _qkv(7, 3, 4, 2, 32)
    whole = x86.attention(q, k, v, 3, 0.25, isa=isa, **extra)
    for budget in (1, 3 * 2 * 256 * 4):  # blocks of 2 (+1) rows, of 3 (+1) rows
        assert np.array_equal(x86.attention(q, k, v, 3, 0.25, isa=isa, budget=budget, **extra), whole)


def test_prefill_attention_memory_follows_the_budget():
    """2048 queries over 2048 keys, 8 heads: all scores at once are 128 MiB; in 4 MiB blocks the peak stays
    within a few blocks (the blocks' temporaries and the output)."""
    T, H, E = 2048, 8, 16
    q, k, v = _qkv(T, 0, H, 2, E)
    budget = 4 << 20
    tracemalloc.start()
    try:
        ops.attention(q, k, v, 0, 0.25, budget=budget)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 * budget, f"peak {peak / 2**20:.0f} MiB for a {budget / 2**20:.0f} MiB budget"
    assert T * T * H * 4 > 20 * budget  # the unblocked scores would be far larger
