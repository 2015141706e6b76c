"""`attention_rows` (every row's attention of a batched decode step in one compiled call) equals the single-row
kernel on each row alone, bit for bit: sequences of different lengths, a sliding window, a logit softcap."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.kernels import AVAILABLE

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (37, None), (None, 30.0)])
def test_rows_equal_each_row_alone(window, softcap):
    from ggufpy.kernels.attention import attention, attention_rows

    rng = np.random.default_rng(0)
    H, G, E = 9, 3, 64
    kv = []
    for S in (1, 2, 40, 130, 7):
        kv.append(tuple(rng.standard_normal((S, G, E)).astype(np.float32) for _ in range(2)))
    q = rng.standard_normal((len(kv), H, E)).astype(np.float32)
    got = attention_rows(q, kv, 0.125, window, softcap)
    want = [attention(q[b : b + 1], k, v, len(k) - 1, 0.125, window, softcap) for b, (k, v) in enumerate(kv)]
    assert got.shape == (len(kv), H * E)
    assert got.tobytes() == np.concatenate(want).tobytes()
