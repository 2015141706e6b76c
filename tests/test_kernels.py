"""The numba kernels against the NumPy reference: dequantization bit for bit, repacked weights bit for bit,
linear layers and attention within f32 summation-order tolerance, ggml's int8 activation path against a
NumPy transcription of `ggml_vec_dot_*`, and whole models (a synthetic one and SmolLM2).

Everything is parametrized over the quant registry. The suite also runs with NUMBA_DISABLE_JIT=1, where the
kernels are plain Python: shapes stay small, and the real-model tests skip. No test measures time.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy import kernels
from ggufpy.constants import GGMLType
from ggufpy.numerics import NUMERICS
from ggufpy.quants import QUANT_TYPES, dequantize, quant_type
from ggufpy.quants.fields import f16_field
from ggufpy.quants.quantizers import (
    quantize_q8_0,
    quantize_q8_0_x86,
    quantize_q8_1,
    quantize_q8_1_x86,
    quantize_q8_K,
)
from ggufpy.weights import QuantTensor

needs_numba = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"numba unavailable: {kernels.IMPORT_ERROR}")

if kernels.AVAILABLE:
    from ggufpy.kernels import activations as act
    from ggufpy.kernels import layout, matvec
    from ggufpy.kernels._numba import DISABLED
    from ggufpy.kernels.attention import attention, exp_nonpositive
    from ggufpy.kernels.backend import FLOAT_TYPES, VEC_DOT, NumbaBackend
    from ggufpy.kernels.dequant import dequantize as kernel_dequantize
else:
    DISABLED = True

T = GGMLType
STORAGE_TYPES = {T.I8, T.I16, T.I32, T.F64}
SETTINGS = settings(max_examples=8 if DISABLED else 25, deadline=None, suppress_health_check=list(HealthCheck))
PACKED = sorted(QUANT_TYPES.keys() - {T.F32, T.F16, T.BF16} - STORAGE_TYPES) if kernels.AVAILABLE else []
DEQUANT_TYPES = sorted(QUANT_TYPES)
WEIGHT_TYPES = sorted(QUANT_TYPES.keys() - STORAGE_TYPES)  # the storage types hold ids and the like, not weights
# llama.cpp multiplies by these (Q8_1 and Q8_K are activation formats without a vec_dot of their own)
GGML_WEIGHT_TYPES = [t for t in WEIGHT_TYPES if t not in (T.Q8_1, T.Q8_K)]

# Byte offsets of a block's scale fields (ggml-common.h): fp16, except Q8_K's f32 d.
FP16_SCALES = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q8_1: (0, 2),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.IQ1_S: (0,),
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
}
for _name in ("Q1_0",):  # once GGMLType names it
    if _name in T.__members__:
        FP16_SCALES[T[_name]] = (0,)


def random_weight(t: GGMLType, rows: int, cols: int, seed: int) -> QuantTensor:
    """Random blocks whose scales are small finite numbers (random bytes would give inf/NaN products)."""
    rng = np.random.default_rng(seed)
    qt = quant_type(t)
    n = rows * cols // qt.block_size
    if t in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal(rows * cols).astype(np.float32) * 0.1
        raw = {T.F32: values, T.F16: values.astype("<f2"), T.BF16: values.view(np.uint32) >> 16}[t]
        raw = raw.astype({T.F32: "<f4", T.F16: "<f2", T.BF16: "<u2"}[t]).view(np.uint8)
        return QuantTensor("w", t, (rows, cols), raw)
    blocks = rng.integers(0, 256, (n, qt.type_size), dtype=np.uint8)
    for o in FP16_SCALES.get(t, ()):
        blocks[:, o : o + 2] = (rng.standard_normal(n) * 0.01).astype("<f2").view(np.uint8).reshape(n, 2)
    if t == T.Q8_K:
        blocks[:, 0:4] = (rng.standard_normal(n) * 0.01).astype("<f4").view(np.uint8).reshape(n, 4)
    if t == T.MXFP4:  # E8M0 exponents near 2^-8
        blocks[:, 0] = rng.integers(115, 125, n)
    if t.name == "NVFP4":  # UE4M3 scales below 1
        blocks[:, 0:4] = rng.integers(0, 0x38, (n, 4))
    if t == T.IQ1_M:  # its fp16 d is spread over the top nibbles of the four scale u16
        d = (np.abs(rng.standard_normal(n)) * 0.01).astype("<f2").view(np.uint16)
        for i in range(4):
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 15) << 4).astype(np.uint8)
    return QuantTensor("w", t, (rows, cols), blocks.reshape(-1))


def row_length(t: GGMLType, blocks: int) -> int:
    return blocks * max(quant_type(t).block_size, 32)


def assert_bitwise(got: np.ndarray, ref: np.ndarray) -> None:
    """Equal bit for bit, except that any NaN matches any NaN: which operand's payload a NaN result carries
    depends on the order in which the compiler put the operands of a commutative operation."""
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))


def assert_close(got: np.ndarray, ref: np.ndarray, bound: np.ndarray, rtol: float = 1e-5) -> None:
    """|got - ref| <= rtol * bound elementwise, where bound is sum |w| |x| (the size of the sum's terms)."""
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    worst = np.max(err / (bound + 1e-30))
    assert worst <= rtol, f"error {worst:.2e} of the terms' magnitude exceeds {rtol:.0e}"


# -- dequantization ---------------------------------------------------------------------------------------------
@needs_numba
@pytest.mark.parametrize("t", DEQUANT_TYPES, ids=lambda t: t.name)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n_blocks=st.integers(1, 6))
def test_dequantize_is_bit_identical_to_the_reference(t, seed, n_blocks):
    qt = quant_type(t)
    cols = row_length(t, 1)
    raw = np.random.default_rng(seed).integers(0, 256, n_blocks * cols // qt.block_size * qt.type_size, np.uint8)
    with np.errstate(all="ignore"):  # random scale bits include inf and NaN: those must match too
        ref = dequantize(raw, t, (n_blocks, cols))
    got = kernel_dequantize(raw, t, (n_blocks, cols))
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert_bitwise(got, ref)


@needs_numba
def test_linear_types_come_from_the_kernel_tables():
    """What the loader asks the backend (`linear_types`): every registered weight type in the exact numerics
    (the storage types are no weights), and in the int8 path those with a vec_dot activation format or an
    integer kernel (NVFP4 has only the latter)."""
    from ggufpy.kernels import int8dot
    from ggufpy.kernels.backend import linear_types

    assert set(WEIGHT_TYPES) <= linear_types(False) and not STORAGE_TYPES & linear_types(False)
    integer = int8dot.INT8_TYPES.keys() if int8dot.AVAILABLE else set()
    assert linear_types(True) == set(FLOAT_TYPES) | (layout.PACKED_TYPES & (VEC_DOT.keys() | integer))
    assert {T.IQ2_XXS, T.IQ1_M, T.TQ1_0, T.MXFP4} <= linear_types(True)
    assert (T.NVFP4 in linear_types(True)) == int8dot.AVAILABLE


# -- repacking --------------------------------------------------------------------------------------------------
@needs_numba
@pytest.mark.parametrize("t", PACKED, ids=lambda t: t.name)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 70), blocks=st.integers(1, 2))
def test_packed_weight_unpacks_bit_identically(t, seed, rows, blocks):
    w = random_weight(t, rows, row_length(t, blocks), seed)
    p = layout.pack(w)
    assert p.rows == rows and p.groups * layout.GROUP >= rows
    dense = matvec.unpack(p, 0, p.groups).T  # (rows, cols)
    assert_bitwise(dense[:rows], w.dequantize())
    assert not dense[rows:].any()  # padding rows are zero


@needs_numba
def test_release_pages_leaves_anonymous_memory_alone():
    w = random_weight(T.Q4_0, 64, 64, seed=1)
    before = w.raw.copy()
    assert layout.release_pages(w.raw) is False
    assert np.array_equal(w.raw, before)


@needs_numba
def test_release_pages_drops_a_file_mapping_without_changing_it(tmp_path):
    import mmap

    w = random_weight(T.Q8_0, 64, 64, seed=2)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 100 + w.raw.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    raw = np.frombuffer(mm, np.uint8, count=w.raw.size, offset=100)
    mapped = QuantTensor("w", T.Q8_0, (64, 64), raw)
    p = layout.pack(mapped)  # releases the pages
    assert layout.release_pages(raw) is (hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"))
    assert np.array_equal(raw, w.raw)  # read back from the page cache
    assert np.array_equal(matvec.unpack(p, 0, 1).T, w.dequantize())
    del raw, mapped
    mm.close()


# -- linear layers, exact numerics ---------------------------------------------------------------------------------
@needs_numba
@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 70), blocks=st.integers(1, 2), n_tokens=st.integers(1, 4))
def test_linear_matches_the_reference(t, seed, rows, blocks, n_tokens):
    w = random_weight(t, rows, row_length(t, blocks), seed)
    x = np.random.default_rng(seed + 1).standard_normal((n_tokens, w.shape[1])).astype(np.float32)
    W = w.dequantize()
    got = NumbaBackend(NUMERICS["exact"]).linear(x, w)
    assert got.shape == (n_tokens, rows) and got.dtype == np.float32
    assert_close(got, x @ W.T, np.abs(x) @ np.abs(W).T)


@needs_numba
@pytest.mark.parametrize("numerics", ["exact", "llamacpp"])
@pytest.mark.parametrize("t", [T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_blas_path_matches_the_fused_kernels(t, numerics):
    w = random_weight(t, 100, 256, seed=3)
    x = np.random.default_rng(4).standard_normal((5, 256)).astype(np.float32)
    fused = NumbaBackend(NUMERICS[numerics]).linear(x, w)
    blas = NumbaBackend(NUMERICS[numerics], blas_rows=1).linear(x, w)
    W = w.dequantize()
    assert_close(blas, fused, np.abs(x) @ np.abs(W).T)


@needs_numba
def test_results_do_not_depend_on_the_thread_count():
    w = random_weight(T.Q4_K, 200, 512, seed=5)
    x = np.random.default_rng(6).standard_normal((3, 512)).astype(np.float32)
    one = NumbaBackend(threads=1).linear(x, w)
    two = NumbaBackend(threads=2).linear(x, w)
    assert np.array_equal(one, two)  # each group of rows is computed by one task, in one order


@needs_numba
def test_weights_are_packed_once_and_cached_by_identity():
    be = NumbaBackend()
    w = random_weight(T.Q4_0, 64, 64, seed=7)
    twin = QuantTensor(w.name, w.type, w.shape, w.raw)
    be.linear(np.ones((1, 64), np.float32), w)
    assert be.packed(w) is be.packed(w)
    assert be.packed(twin) is not be.packed(w)
    assert be.packed_bytes == be.packed(w).nbytes + be.packed(twin).nbytes


@needs_numba
def test_linear_checks_shapes():
    with pytest.raises(ValueError, match="do not fit"):
        NumbaBackend().linear(np.ones((1, 32), np.float32), random_weight(T.Q4_0, 8, 64, seed=8))


# -- ggml's int8 activation path ---------------------------------------------------------------------------------
ACTIVATION_QUANTIZERS = [
    (act.Q8_0 if kernels.AVAILABLE else 1, True, quantize_q8_0_x86),
    (act.Q8_0 if kernels.AVAILABLE else 1, False, quantize_q8_0),
    (act.Q8_1 if kernels.AVAILABLE else 2, True, quantize_q8_1_x86),
    (act.Q8_1 if kernels.AVAILABLE else 2, False, quantize_q8_1),
]


@needs_numba
@pytest.mark.parametrize("mode, x86, reference", ACTIVATION_QUANTIZERS, ids=["q8_0", "q8_0_ref", "q8_1", "q8_1_ref"])
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_q8_0_and_q8_1_activations_are_ggml_bit_for_bit(mode, x86, reference, seed, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 128)) * scale).astype(np.float32)
    x[0, :32] = np.round(x[0, :32] * 4) / 4  # ties for the rounding rules
    x[1, 32:64] = 0.0  # an all-zero block
    xv, (xs, ad, am) = act.prepare(x, mode, 32, x86)
    blocks = reference(x.reshape(-1, 32))
    q = blocks[:, -32:].view(np.int8).astype(np.float32)
    assert np.array_equal(xv.reshape(-1, 32), q)
    assert np.array_equal(xs.reshape(-1), q.sum(axis=1))
    assert np.array_equal(ad.reshape(-1), f16_field(blocks, 0)[:, 0])
    if mode == act.Q8_1:
        assert np.array_equal(am.reshape(-1), f16_field(blocks, 2)[:, 0])


@needs_numba
@pytest.mark.parametrize("S", [16, 32])
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_q8_k_activations_are_ggml_bit_for_bit(S, seed, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 512)) * scale).astype(np.float32)
    x[1, 256:] = 0.0
    xv, (xs, ad, am) = act.prepare(x, act.Q8_K, S)
    blocks = quantize_q8_K(x.reshape(-1, 256))
    d = blocks[:, 0:4].copy().view("<f4")[:, 0]
    q = blocks[:, 4:260].view(np.int8).astype(np.float32)
    assert np.array_equal(xv.reshape(-1, 256), q)
    assert np.array_equal(ad.reshape(-1, 256 // S), np.repeat(d[:, None], 256 // S, axis=1))
    assert np.array_equal(xs.reshape(-1), q.reshape(-1, S).sum(axis=1))
    assert np.array_equal(am, ad * xs)  # d * bsum: the term the mins multiply
    if S == 16:  # ggml's bsums
        assert np.array_equal(xs.reshape(-1, 16), blocks[:, 260:292].copy().view("<i2").astype(np.float32))


@needs_numba
def test_f16_rounding_matches_numpy():
    rng = np.random.default_rng(9)
    x = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 5000),
            np.array([0, -0.0, 65504, 65519.99, 65520, 1e9, -1e9, 2**-24, 2**-25, 3 * 2**-26, np.inf, -np.inf]),
        ]
    ).astype(np.float32)
    out = np.empty_like(x)
    act.round_f16(x, out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out.view(np.uint32), x.astype(np.float16).astype(np.float32).view(np.uint32))


def _ggml_vec_dot(w: QuantTensor, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A NumPy transcription of ggml's CPU matmul (ggml-cpu/quants.c `ggml_vec_dot_*_generic`): quantize each
    activation row to the weight's vec_dot type with ggml's x86 quantizers, then per block d_w d_a sum(q_w q_a)
    (+ m_w s_a for Q4_1/Q5_1). The integer sums are exact in f64, so this equals the dequantized product
    W @ X_hat except for the Q8_1 term, where ggml uses the block's stored fp16 s instead of d_a sum(q_a).
    Returns the product and X_hat."""
    t = w.type
    W = w.dequantize().astype(np.float64)
    kind = VEC_DOT[t]
    if kind == act.Q8_K:
        blocks = quantize_q8_K(x.reshape(-1, 256))
        d = blocks[:, 0:4].copy().view("<f4").astype(np.float64)
        xq = (blocks[:, 4:260].view(np.int8) * d).reshape(x.shape)
        return xq @ W.T, xq
    blocks = (quantize_q8_0_x86 if kind == act.Q8_0 else quantize_q8_1_x86)(x.reshape(-1, 32))
    d = f16_field(blocks, 0).astype(np.float64)
    q = blocks[:, -32:].view(np.int8).astype(np.float64)
    xq = (q * d).reshape(x.shape)
    y = xq @ W.T
    if kind == act.Q8_1:  # + sum_b m_w (s_a - d_a sum q_a)
        s = f16_field(blocks, 2)[:, 0].astype(np.float64)
        delta = (s - d[:, 0] * q.sum(axis=1)).reshape(x.shape[0], -1)  # (T, n_blocks)
        m = f16_field(w.raw.reshape(-1, quant_type(t).type_size), 2)[:, 0].reshape(w.shape[0], -1)
        y += delta @ m.astype(np.float64).T
    return y, xq


@needs_numba
@pytest.mark.parametrize(
    "t",
    [t for t in GGML_WEIGHT_TYPES if t in VEC_DOT and t not in FLOAT_TYPES] if kernels.AVAILABLE else [],
    ids=lambda t: t.name,
)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 70), n_tokens=st.integers(1, 3))
def test_int8_linear_matches_ggml_vec_dot(t, seed, rows, n_tokens):
    w = random_weight(t, rows, 256, seed)
    x = np.random.default_rng(seed + 1).standard_normal((n_tokens, 256)).astype(np.float32)
    got = NumbaBackend(NUMERICS["llamacpp"]).linear(x, w)
    ref, xq = _ggml_vec_dot(w, x)
    assert_close(got, ref, np.abs(xq) @ np.abs(w.dequantize()).T)


@needs_numba
@pytest.mark.parametrize("t", [T.F16, T.BF16, T.F32])
def test_int8_path_rounds_float_weight_activations_like_ggml(t):
    w = random_weight(t, 40, 64, seed=10)
    x = np.random.default_rng(11).standard_normal((2, 64)).astype(np.float32)
    got = NumbaBackend(NUMERICS["llamacpp"]).linear(x, w)
    if t == T.F16:
        xr = x.astype(np.float16).astype(np.float32)
    elif t == T.BF16:
        u = x.view(np.uint32)
        xr = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    else:
        xr = x
    W = w.dequantize()
    assert_close(got, xr @ W.T, np.abs(xr) @ np.abs(W).T)


@needs_numba
def test_int8_linear_agrees_with_the_numpy_llamacpp_backend():
    from ggufpy.backend import NumpyBackend

    for t in (T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K):
        w = random_weight(t, 64, 256, seed=12)
        x = np.random.default_rng(13).standard_normal((2, 256)).astype(np.float32)
        ours = NumbaBackend(NUMERICS["llamacpp"]).linear(x, w)
        theirs = NumpyBackend(NUMERICS["llamacpp"]).linear(x, w)
        W = w.dequantize()
        assert_close(ours, theirs, np.abs(x) @ np.abs(W).T, rtol=2e-5)


# -- attention ----------------------------------------------------------------------------------------------------
@needs_numba
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n_tokens=st.integers(1, 5),
    past=st.integers(0, 12),
    heads=st.sampled_from([(4, 4), (4, 2), (6, 3), (4, 1)]),
    window=st.sampled_from([None, 1, 3]),
    softcap=st.sampled_from([None, 20.0]),
)
def test_attention_matches_ops(seed, n_tokens, past, heads, window, softcap):
    from ggufpy import ops

    rng = np.random.default_rng(seed)
    H, G, E = *heads, 16
    S = past + n_tokens
    q = rng.standard_normal((n_tokens, H, E)).astype(np.float32)
    k, v = (rng.standard_normal((S, G, E)).astype(np.float32) for _ in range(2))
    ref = ops.attention(q, k, v, past, 0.25, window, softcap)
    got = attention(q, k, v, past, 0.25, window, softcap)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@needs_numba
def test_exp_is_accurate_over_the_softmax_range():
    from ggufpy.kernels._numba import jit

    @jit
    def run(x, out):
        for i in range(x.size):
            out[i] = exp_nonpositive(x[i])

    x = -np.abs(np.random.default_rng(14).standard_normal(2000).astype(np.float32) * 30)
    x = np.concatenate([x, np.array([0, -0.0, -87.3, -200, -np.inf], np.float32)])
    out = np.empty_like(x)
    run(x, out)
    ref = np.exp(x.astype(np.float64))
    big = ref > 2.0**-126
    assert np.all(np.abs(out[big] - ref[big]) <= 3e-7 * ref[big])
    assert np.all(out[~big] <= 2.0**-126) and out[-1] == 0.0


@needs_numba
@pytest.mark.parametrize("mode", ["llamacpp", "llamacpp-avx2"])
def test_backend_attention_is_the_numerics_own(mode):
    """In the llamacpp numerics the backend's attention is the numerics' replay of ggml's, bit for bit
    (compiled: `kernels.x86`), with and without a softcap (which the NumPy replay computes)."""
    rng = np.random.default_rng(15)
    q, k, v = rng.standard_normal((2, 4, 8)), rng.standard_normal((5, 2, 8)), rng.standard_normal((5, 2, 8))
    q, k, v = (a.astype(np.float32) for a in (q, k, v))
    nm = NUMERICS[mode]
    for extra in ({}, {"softcap": 20.0}):
        got = NumbaBackend(nm).attention(q, k, v, 3, 0.3, **extra)
        assert np.array_equal(got.view(np.uint32), nm.attention(q, k, v, 3, 0.3, **extra).view(np.uint32))


# -- the per-token glue ---------------------------------------------------------------------------------------------
@needs_numba
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n_tokens=st.integers(1, 3), rope_pairs=st.sampled_from([4, 8]))
def test_glue_ops_match_ggufpy_ops(seed, n_tokens, rope_pairs):
    from ggufpy import ops
    from ggufpy.kernels import ops as kops

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, 3, 16)).astype(np.float32) * 3
    w = rng.standard_normal(16).astype(np.float32)
    assert np.allclose(kops.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    cos, sin = ops.rope_angles(np.arange(5, 5 + n_tokens), 2 * rope_pairs, 10000.0)
    for style in ("norm", "neox"):
        assert np.array_equal(kops.rope(x, cos, sin, style), ops.rope(x, cos, sin, style))  # same f32 steps
    z = (rng.standard_normal(300) * 8).astype(np.float32)
    for name in ("silu", "gelu_tanh"):
        with np.errstate(over="ignore"):
            ref = ops.ACTIVATIONS[name](z)
        np.testing.assert_allclose(kops.ACTIVATIONS[name](z), ref, rtol=2e-6, atol=1e-6)


@needs_numba
@pytest.mark.parametrize("t", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.F16])
@pytest.mark.parametrize("numerics", ["exact", "llamacpp"])
@pytest.mark.parametrize("n_rows", [1, 3, 20])  # decode, pairs + last row, BLAS prefill
def test_linears_equal_separate_products_and_share_memory(t, numerics, n_rows):
    """Q/K/V in one call: the same values as one call each (the fused kernels run the same arithmetic per
    row; BLAS may block differently), and the separate packed forms become views of the stack, so memory
    does not grow."""
    cols = 256
    ws = (random_weight(t, 128, cols, seed=1), random_weight(t, 70, cols, seed=2), random_weight(t, 64, cols, seed=3))
    x = np.random.default_rng(4).standard_normal((n_rows, cols)).astype(np.float32)
    separate = NumbaBackend(NUMERICS[numerics], release_pages=False)
    expected = [separate.linear(x, w) for w in ws]
    be = NumbaBackend(NUMERICS[numerics], release_pages=False)
    before = be.prepack(ws)
    got = be.linears(x, ws)

    def same(a, b):
        if n_rows < be.blas_rows:
            np.testing.assert_array_equal(a, b)
        else:  # BLAS blocks a larger matrix differently: f32 summation order only
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())

    for g, e, w in zip(got, expected, ws, strict=True):
        assert g.shape == (n_rows, w.shape[0])
        same(g, e)
        same(be.linear(x, w), e)  # through the view of the stack
    assert be.packed_bytes == before


@needs_numba
def test_linears_stack_the_weights_of_one_type_in_a_mix():
    """Q and K in Q5_0, V in Q8_0 (llama.cpp's Q4_K_M recipe on SmolLM2): Q and K share a kernel call, V
    has its own; outputs come back in order and equal the separate products."""
    ws = (random_weight(T.Q5_0, 128, 64, seed=1), random_weight(T.Q8_0, 64, 64, seed=2))
    ws = (ws[0], ws[1], random_weight(T.Q5_0, 64, 64, seed=3))
    x = np.random.default_rng(4).standard_normal((1, 64)).astype(np.float32)
    be = NumbaBackend(release_pages=False)
    got = be.linears(x, ws)
    groups = be._stacks[ws]
    assert sorted(members for members, _ in groups) == [(0, 2), (1,)]
    for g, w in zip(got, ws, strict=True):
        np.testing.assert_array_equal(g, NumbaBackend(release_pages=False).linear(x, w))


@needs_numba
def test_transformer_uses_compiled_activations_only_for_the_plain_functions(monkeypatch):
    """The numba SiLU replaces ops.silu in the exact numerics; a numerics record with its own activation
    (llama.cpp's fp16-table GELU) is obeyed."""
    import ggufpy
    from conformance import fixtures as fx
    from ggufpy import ops
    from ggufpy.kernels import ops as kops

    calls = []
    monkeypatch.setitem(NumbaBackend.compiled, ops.silu, lambda x: calls.append(x.shape) or kops.silu(x))
    model = ggufpy.load(fx.fixture_path("q4_0"), backend="numba", tokenizer=False)
    model.logits([5, 6])
    assert len(calls) == model.config.n_layers
    calls.clear()
    llamacpp = ggufpy.load(fx.fixture_path("q4_0"), backend="numba", numerics="llamacpp", tokenizer=False)
    llamacpp.numerics = dataclasses.replace(llamacpp.numerics, activations={"silu": lambda x: calls.append("own") or x})
    llamacpp.logits([5])
    assert calls == ["own"] * llamacpp.config.n_layers


# -- whole models ------------------------------------------------------------------------------------------------
def _write_model(path, types):
    from conformance.fixtures import TinyLlama, write_tiny_llama

    spec = TinyLlama(dim=256, hidden_dim=256, n_layers=1 if DISABLED else 2, n_heads=4, n_kv_heads=2, types=types)
    try:
        return write_tiny_llama(path, spec)
    except RuntimeError as e:  # k-quants need ggml's quantizer (llama-cpp-python)
        pytest.skip(str(e))


MODEL_MIXES = {
    "q4_1+q8_0": {"embd": T.Q8_0, "output": T.Q8_0, "attn": T.Q4_1, "ffn": T.Q4_1},
    "q4_k+q6_k": {"embd": T.Q4_K, "output": T.Q6_K, "attn": T.Q4_K, "ffn": T.Q6_K},
    "q5_0+f16": {"embd": T.F16, "output": T.F16, "attn": T.Q5_0, "ffn": T.Q5_1},
}


@needs_numba
@pytest.mark.parametrize("blas_rows", [None, 2], ids=["fused", "blas"])
@pytest.mark.parametrize("mix", list(MODEL_MIXES))
def test_tiny_model_logits_match_the_numpy_backend(tmp_path, mix, blas_rows):
    import ggufpy

    path = _write_model(tmp_path / f"{mix}.gguf", MODEL_MIXES[mix])
    ids = np.array([5, 60, 7] if DISABLED else [5, 60, 7, 200, 31, 9], dtype=np.int64)
    ref = ggufpy.load(path, tokenizer=False).logits(ids)
    model = ggufpy.load(path, backend="numba", tokenizer=False, blas_rows=blas_rows)
    model.numerics = dataclasses.replace(model.numerics, attention=model.backend.attention)
    got = model.logits(ids)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    # incremental decoding with the numba backend equals its own full prefill
    cache = model.new_cache(capacity=len(ids))
    model.forward(ids[:-1], 0, cache)
    last = model.forward(ids[-1:], len(ids) - 1, cache)
    np.testing.assert_allclose(last[0], got[-1], rtol=0, atol=2e-5 * np.abs(ref).max())


@needs_numba
@pytest.mark.skipif(DISABLED, reason="a 135M-parameter model is too slow without the JIT")
def test_smollm2_logits_match_the_numpy_backend(smollm2_file):
    import ggufpy

    ids = np.array([1, 504, 3458, 282, 2372, 30, 216, 1249], dtype=np.int64)
    ref = ggufpy.load(smollm2_file, tokenizer=False).logits(ids)
    model = ggufpy.load(smollm2_file, backend="numba", tokenizer=False)
    model.numerics = dataclasses.replace(model.numerics, attention=model.backend.attention)
    got = model.logits(ids)
    assert np.array_equal(got.argmax(axis=-1), ref.argmax(axis=-1))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@needs_numba
@pytest.mark.skipif(DISABLED, reason="real tensors are too slow without the JIT")
@pytest.mark.parametrize("numerics", ["exact", "llamacpp"])
def test_gemma3_tensors_match_the_reference(numerics):
    """Real Q8_0, Q5_0, Q4_K and Q6_K weights (the first 256 rows of one tensor of each type)."""
    import ggufpy
    from ggufpy.backend import NumpyBackend
    from tests.models import gemma3_path

    f = ggufpy.open(gemma3_path())
    seen = set()
    for name, info in f.tensors.items():
        if info.type in seen or len(info.shape) != 2 or info.type not in PACKED:
            continue
        seen.add(info.type)
        rows = min(256, info.shape[0])
        raw = f.raw(name)[: rows * info.nbytes // info.shape[0]]
        w = QuantTensor(name, info.type, (rows, info.shape[1]), raw)
        x = np.random.default_rng(16).standard_normal((3, info.shape[1])).astype(np.float32)
        W = w.dequantize()
        got = NumbaBackend(NUMERICS[numerics], release_pages=False).linear(x, w)
        ref = NumpyBackend(NUMERICS[numerics]).linear(x, w)
        assert_close(got, ref, np.abs(x) @ np.abs(W).T, rtol=2e-5)
    assert {T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K} <= seen


@needs_numba
def test_cpu_contention_switches_to_one_thread(monkeypatch):
    from ggufpy.kernels.backend import CpuContention

    # (machine busy, ours) in jiffies: others use 90, 90, 0, 90 (intervals of ~0 s: any use is over threshold)
    samples = iter([(0.0, 0.0), (100.0, 10.0), (200.0, 20.0), (300.0, 120.0), (400.0, 130.0)])
    monkeypatch.setattr(CpuContention, "_sample", staticmethod(lambda: next(samples)))
    monitor = CpuContention(interval=0.0)
    assert monitor.poll() is False  # one busy interval is a burst
    assert monitor.poll() is True  # two in a row: contention
    assert monitor.poll() is False  # a quiet one ends it
    assert monitor.poll() is False  # and the streak starts again
    be = NumbaBackend(threads=2, adaptive=False)
    be.contention = monitor
    monitor.contended = True
    monitor._next = float("inf")
    assert be._threads_for(10**9) == 1
    monitor.contended = False
    assert be._threads_for(10**9) == be.threads


# -- without numba ---------------------------------------------------------------------------------------------------
def test_without_numba_the_package_imports_and_falls_back_to_numpy():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["numba"] = None  # makes `import numba` raise ImportError
        import ggufpy.kernels as k
        from ggufpy.backend import default_backend, make_backend
        assert k.AVAILABLE is False and isinstance(k.IMPORT_ERROR, ImportError)
        assert default_backend() == "numpy"
        try:
            make_backend("numba")
        except ImportError as e:
            assert "numba" in str(e)
        else:
            raise AssertionError("the numba backend was built without numba")
        try:
            k.NumbaBackend
        except ImportError:
            pass
        else:
            raise AssertionError("NumbaBackend resolved without numba")
        print("ok")
        """
    )
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_DISABLE_JIT"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "numba unavailable" in done.stderr  # the one-line notice


@needs_numba
def test_default_backend_is_numba_when_numba_compiles():
    from ggufpy.backend import default_backend, make_backend

    # under NUMBA_DISABLE_JIT=1 the kernels are plain Python loops: still there on request, not the default
    assert default_backend() == ("numpy" if kernels.JIT_DISABLED else "numba")
    assert make_backend("numba", threads=1).name == "numba"


@needs_numba
def test_disabled_jit_makes_numpy_the_default_and_says_so():
    script = "from ggufpy.backend import default_backend; print(default_backend())"
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "numpy"
    assert "NUMBA_DISABLE_JIT is set; using the NumPy backend" in done.stderr
