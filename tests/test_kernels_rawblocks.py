"""The "blocks" kernel family (`ggufpy/kernels/rawblocks.py`): the grid, ternary, binary and FP4 formats computed
from their blocks as stored, within the memory rule (packed bytes <= ~1.1x the file's)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ggufpy import kernels
from ggufpy.constants import GGMLType
from ggufpy.numerics import NUMERICS
from ggufpy.quants import quant_type

if not kernels.AVAILABLE:
    pytest.skip("numba kernels unavailable", allow_module_level=True)

from ggufpy.kernels import backend, layout, rawblocks
from ggufpy.kernels.backend import NumbaBackend
from tests.test_kernels import SETTINGS, assert_bitwise, assert_close, random_weight

TYPES = sorted(rawblocks.BLOCK_TYPES)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_packed_weight_costs_the_files_bytes(t):
    """The memory rule: 1.0x the file for whole groups of 64 rows (the int8 repack cost 2-6x)."""
    qt = quant_type(t)
    w = random_weight(t, 128, 2 * 256, seed=1)
    p = layout.pack(w)
    assert p.family == "blocks"
    assert p.nbytes == w.raw.nbytes == 128 * 512 // qt.block_size * qt.type_size
    ragged = layout.pack(random_weight(t, 70, 256, seed=2))  # zero rows up to a whole group: 128 rows
    assert ragged.nbytes == 128 * 256 // qt.block_size * qt.type_size


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n_blocks=st.integers(1, 40))
def test_block_decoder_is_bit_identical_to_the_reference(t, seed, n_blocks):
    """Random bytes (NaN/inf scales included): scale * value as the reference dequantizer computes it; Q1_0's
    reference negates d, which differs from d * -1 only in the sign of a NaN."""
    qt = quant_type(t)
    blocks = np.random.default_rng(seed).integers(0, 256, (n_blocks, qt.type_size), dtype=np.uint8)
    out = np.empty((n_blocks, qt.block_size), np.float32)
    rawblocks.dequantize(t, blocks, out)
    with np.errstate(all="ignore"):
        ref = qt.dequantize_blocks(blocks).reshape(n_blocks, -1)
    if t.name == "Q1_0":
        ref, out = np.where(np.isnan(ref), np.nan, ref), np.where(np.isnan(out), np.nan, out)
    assert_bitwise(out, ref)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_a_row_alone_equals_the_row_in_a_batch(t):
    """Each activation row runs the same loop whatever T is, so a batched decode (`linears_rows`) can reuse
    the kernel bit for bit; and the products are the reference's within f32 summation."""
    w = random_weight(t, 70, 512, seed=3)
    x = np.random.default_rng(4).standard_normal((5, 512)).astype(np.float32)
    be = NumbaBackend(NUMERICS["exact"], release_pages=False)
    batch = be.linear(x, w)
    for r in range(5):
        np.testing.assert_array_equal(be.linear(x[r : r + 1], w)[0], batch[r])
    W = w.dequantize()
    assert_close(batch, x @ W.T, np.abs(x) @ np.abs(W).T)


@pytest.mark.parametrize("t", [GGMLType.IQ2_XS, GGMLType.IQ3_S, GGMLType.TQ2_0, GGMLType.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("numerics", ["exact", "llamacpp"])
def test_blas_tiles_match_the_fused_kernel(t, numerics):
    w = random_weight(t, 100, 512, seed=5)
    x = np.random.default_rng(6).standard_normal((20, 512)).astype(np.float32)
    fused = NumbaBackend(NUMERICS[numerics], blas_rows=None).linear(x, w)
    blas = NumbaBackend(NUMERICS[numerics], blas_rows=1).linear(x, w)
    assert_close(blas, fused, np.abs(x) @ np.abs(w.dequantize()).T)


def test_layers_with_block_types_skip_the_fused_decode_block():
    """`layer.py` runs the nib/nib6/i8 kernels only: a layer holding any "blocks" weight goes per linear."""
    q4 = SimpleNamespace(type=GGMLType.Q4_K)
    mats = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    plain = SimpleNamespace(**dict.fromkeys(mats, q4))
    assert not backend._has_block_types(plain)
    mixed = SimpleNamespace(**{**dict.fromkeys(mats, q4), "ffn_down": SimpleNamespace(type=GGMLType.IQ2_XXS)})
    assert backend._has_block_types(mixed)
    be = NumbaBackend()
    assert be.decode_block(None, mixed, 0, None, 0, None, None, None) is None
