"""Plane-order dequantization (`ggufpy.quants.planes`) against the reference dequantizers, bit for bit,
and the plane-order product against the plain one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggufpy.constants import GGML_BLOCK_LAYOUT
from ggufpy.quants import dequantize
from ggufpy.quants.planes import PLANE_TYPES, dequantize_planes, permute

TYPES = sorted(PLANE_TYPES, key=lambda t: t.value)


@st.composite
def weights(draw, t):
    """Random bytes for a weight of `rows` x `nb` blocks: every bit pattern, NaN and inf scales included."""
    rows = draw(st.integers(1, 5))
    nb = draw(st.integers(1, 4))
    type_size = GGML_BLOCK_LAYOUT[t][1]
    raw = draw(st.binary(min_size=rows * nb * type_size, max_size=rows * nb * type_size))
    return np.frombuffer(raw, np.uint8).reshape(rows, nb * type_size)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_planes_equal_the_reference_bit_for_bit(t):
    block_size = GGML_BLOCK_LAYOUT[t][0]

    @settings(max_examples=150, deadline=None)
    @given(blocks=weights(t))
    def check(blocks):
        rows, nb = blocks.shape[0], blocks.shape[1] // GGML_BLOCK_LAYOUT[t][1]
        ref = dequantize(blocks, t, (rows, nb * block_size))
        got = dequantize_planes(blocks, t)
        assert got.shape == (block_size, nb, rows) and got.dtype == np.float32
        want = ref.reshape(rows, nb, block_size).transpose(2, 1, 0)  # P[j, b, r] = W[r, b * block_size + j]
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))

    check()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_plane_order_product_equals_the_plain_product(t):
    rng = np.random.default_rng(int(t))
    block_size, type_size = GGML_BLOCK_LAYOUT[t]
    rows, nb = 37, 3
    blocks = rng.integers(0, 256, (rows, nb * type_size), dtype=np.uint8)
    # finite scales: put small fp16 values at every 2-byte position that can hold one
    scales = rng.uniform(-0.05, 0.05, (rows, nb * type_size // 2)).astype(np.float16)
    blocks = np.where(rng.random(blocks.shape) < 0.5, blocks, scales.view(np.uint8))
    w = dequantize(blocks, t, (rows, nb * block_size))
    finite = np.isfinite(w).all(axis=1)
    assert finite.sum() > rows // 2
    x = rng.standard_normal((3, nb * block_size)).astype(np.float32)
    y = permute(x, block_size) @ dequantize_planes(blocks, t).reshape(nb * block_size, rows)
    w = w[finite]
    err = np.abs(y[:, finite] - x @ w.T)
    assert (err <= 1e-5 * (np.abs(x) @ np.abs(w).T)).all()  # f32 sums in another order, nothing more
