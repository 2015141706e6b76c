"""The batched decode's row kernels per storage style (`kernels/batched.py`, issue 14): weights without sub-block
scales take `_rows`, which leaves out the K-quants' branches (faster), the others `_rows_super`. Either way
every row is bit for bit `matvec` of that row alone (batch invariance), for every packed type with a batched
kernel, and the two kernels agree on the weights both can take.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.kernels import AVAILABLE, JIT_DISABLED

pytestmark = pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")


def _batched_types():
    """(type, packed weight, plan) of every packed type whose storage family has a batched row kernel."""
    from ggufpy.kernels.layout import PACKED_TYPES, pack
    from ggufpy.kernels.matvec import plan
    from tests.test_kernels import random_weight

    out = []
    for t in sorted(PACKED_TYPES, key=lambda t: t.name):
        p = pack(random_weight(t, 130, 512, seed=11))
        if p.family in ("nib", "nib6", "i8"):
            out.append((t, p, plan(p)))
    return out


TYPES = _batched_types() if AVAILABLE and not JIT_DISABLED else []


@pytest.mark.parametrize("t, p, planned", TYPES, ids=[t.name for t, _, _ in TYPES])
def test_kernel_choice_follows_the_scale_storage(t, p, planned):
    from ggufpy.kernels import batched

    args = planned[1]
    kernel = batched.row_kernel(p.family, args)
    super_style = p.sc is not None or p.mn is not None
    assert kernel is batched._ROWS[p.family, super_style]
    assert kernel.__name__.endswith("_super") == super_style, t.name


@pytest.mark.parametrize("t, p, planned", TYPES, ids=[t.name for t, _, _ in TYPES])
def test_rows_equal_each_row_alone(t, p, planned):
    """Each of B = 1..8 rows (one of zeros, one with a zero sub-block) bit for bit `matvec` of that row alone,
    in every place of the row tiles; 130 weight rows leave a partial last group."""
    from ggufpy.kernels.batched import matvec_rows
    from ggufpy.kernels.matvec import matvec

    x = np.random.default_rng(12).standard_normal((8, p.cols)).astype(np.float32)
    x[3] = 0.0
    x[6, 32:64] = 0.0
    alone = np.concatenate([matvec(p, x[b : b + 1], None, planned=planned) for b in range(8)])
    for B in (1, 2, 3, 4, 5, 8):
        for threads in (1, 2):
            rows = matvec_rows(p, x[8 - B :], None, planned, threads=threads)
            assert rows.tobytes() == alone[8 - B :].tobytes(), f"{t.name}, B={B}, threads={threads}"


@pytest.mark.parametrize("t, p, planned", [c for c in TYPES if c[1].sc is None and c[1].mn is None])
def test_block_kernel_equals_the_super_kernel(t, p, planned):
    """`_rows` is `_rows_super` without the branches of sc and mn: on weights without them, the same bits."""
    from ggufpy.kernels import batched

    args = planned[1]
    x = np.random.default_rng(13).standard_normal((8, p.cols)).astype(np.float32)
    sums = np.empty((8, args[0].shape[1]), np.float32)
    batched._sub_sums(x, args[0].shape[2], sums)
    fast, general = (np.empty((8, p.groups * 64), np.float32) for _ in range(2))
    batched._ROWS[p.family, False](1, *args, x, sums, fast)
    batched._ROWS[p.family, True](1, *args, x, sums, general)
    assert fast.tobytes() == general.tobytes(), t.name
