"""The integer dot-product kernels (`ggufpy/kernels/int8dot.py`, IR in `int8ir.py`) equal the llamacpp numerics'
NumPy replay of ggml's x86 kernels (`vecdot.linear_x86`) bit for bit: random blocks for every type and path
(hypothesis), the activation quantizers against `vecdot.quantize_activations`, llama.cpp's own mul_mat where
the graph oracle reaches the same kernel, real SmolLM2 / Gemma 3 weights, and whole forward passes of the numba
backend against the NumPy backend in the llamacpp numerics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot
from ggufpy.weights import QuantTensor

int8dot = pytest.importorskip("ggufpy.kernels.int8dot")
pytestmark = pytest.mark.skipif(not int8dot.AVAILABLE, reason="no numba JIT or no AVX2: the f32 kernels run")

TYPES = list(int8dot.INT8_TYPES)
ISAS = ("avx512", "avx2")


def random_weight(t: T, rows: int, cols: int, rng: np.random.Generator) -> QuantTensor:
    """Random blocks with small finite fp16 scales (d, and m / dmin where the type has one)."""
    _, size, block = int8dot.INT8_TYPES[t]
    n = rows * cols // block
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    scales = {T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,)}.get(
        t, (0,)
    )
    for o in scales:
        blocks[:, o : o + 2] = (rng.standard_normal(n) * 0.02).astype("<f2").view(np.uint8).reshape(n, 2)
    return QuantTensor("w", t, (rows, cols), blocks.reshape(-1))


def activations(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Rows of assorted magnitudes, a zero row (d = 0 blocks) and outliers."""
    x = rng.standard_normal((rows, cols)) * rng.choice([1e-3, 0.1, 1.0, 8.0], size=(rows, 1))
    if rows > 1:
        x[1] = 0.0
    if rows > 2:
        x[2, :: max(1, cols // 7)] *= 300.0
    return x.astype(np.float32)


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{bad.size}/{want.size} differ, e.g. {got.flat[bad[:4]]} vs {want.flat[bad[:4]]}"


def replay(x: np.ndarray, w: QuantTensor, isa: str = "avx512") -> np.ndarray:
    try:
        return vecdot.linear_x86(x, w.raw, w.type, w.shape, isa=isa)
    except TypeError:  # a replay without builds to choose from
        return vecdot.linear_x86(x, w.raw, w.type, w.shape)


# -- random blocks ----------------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    t=st.sampled_from(TYPES),
    rows=st.sampled_from([8, 16, 24, 12, 36]),
    blocks=st.integers(1, 6),
    n_rows=st.sampled_from([1, 2, 3, 4, 5, 7, 8, 9, 12]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_blocks_equal_the_replay(t, rows, blocks, n_rows, seed):
    """Every kernel variant: Q4_0 repacked (rows % 8 == 0) or vec_dot, Q4_K gemm rows (T - T % 4) and gemv
    rows, Q6_K vec_dot (T < 8) and tiled (T >= 8); both replayed builds agree on these types."""
    rng = np.random.default_rng(seed)
    block = int8dot.INT8_TYPES[t][2]
    w = random_weight(t, rows, blocks * block, rng)
    iw = int8dot.weight(w)
    if iw is None:  # Q4_K with rows % 8 != 0: llama.cpp's plain vec_dot, left to the f32 kernels
        assert t == T.Q4_K and rows % 8
        return
    x = activations(rng, n_rows, blocks * block)
    got = int8dot.linear(x, iw, threads=2)
    for isa in ISAS:
        assert_bitwise(got, replay(x, w, isa))


@pytest.mark.parametrize("fmt, vec_dot_type", [("Q8_0", T.Q8_0), ("Q8_1", T.Q8_1), ("Q8_K", T.Q8_K)])
def test_quantize_matches_ggml_bytes(fmt, vec_dot_type):
    """The arrays the kernels read hold exactly the blocks `vecdot.quantize_activations` writes."""
    rng = np.random.default_rng(4)
    x = activations(rng, 5, 512)
    x[3, 7] = -x[3].__abs__().max() * 2  # a negative peak: Q8_K's d < 0
    a = int8dot.quantize(x, fmt)
    blocks = vecdot.quantize_activations(x, vec_dot_type)
    if fmt == "Q8_K":
        b = blocks.reshape(5, 2, 292)
        assert np.array_equal(a.d, b[..., 0:4].copy().view("<f4")[..., 0])
        assert np.array_equal(a.q, b[..., 4:260].reshape(5, 512).view(np.int8))
        assert np.array_equal(a.bsums, b[..., 260:292].copy().view("<i2").reshape(5, 32))
        return
    size = 34 if fmt == "Q8_0" else 36
    b = blocks.reshape(5, 16, size)
    assert np.array_equal(a.d, b[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32))
    if fmt == "Q8_1":
        assert np.array_equal(a.s, b[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32))
    q = b[..., size - 32 :].reshape(5, 512).view(np.int8)
    assert np.array_equal(a.q, q)
    assert np.array_equal(a.asum, q.reshape(5, 128, 4).sum(-1, dtype=np.int32))


def test_unsupported_shapes_keep_the_f32_kernels():
    rng = np.random.default_rng(0)
    assert int8dot.weight(random_weight(T.Q4_K, 12, 256, rng)) is None  # plain vec_dot: its own lane order
    assert int8dot.weight(random_weight(T.Q4_K, 16, 256, rng)) is not None
    q4_0 = int8dot.weight(random_weight(T.Q4_0, 12, 64, rng))
    assert q4_0 is not None and q4_0.kernel is not int8dot.weight(random_weight(T.Q4_0, 16, 64, rng)).kernel


# -- llama.cpp itself (its graph runs the same kernels: no k-quant repacking in the oracle) --------------------------
ORACLE_CASES = [
    (T.Q8_0, 12, 1),
    (T.Q8_0, 40, 5),
    (T.Q5_0, 40, 1),
    (T.Q5_0, 12, 17),
    (T.Q4_0, 12, 3),
    (T.Q4_1, 40, 1),
    (T.Q5_1, 12, 4),
    (T.Q6_K, 12, 1),
    (T.Q6_K, 40, 9),
]


@pytest.mark.parametrize("t, rows, n_rows", ORACLE_CASES)
def test_against_llamacpp(t, rows, n_rows):
    ggml_graph = pytest.importorskip("conformance.ggml_graph")
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(rows * 31 + n_rows)
    cols = 512
    w = random_weight(t, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    want = ggml_graph.ggml_graph_matmul(w.raw.reshape(rows, -1), t, x)
    assert_bitwise(int8dot.linear(x, int8dot.weight(w), threads=2), want)


def test_repacked_q4_0_against_llamacpp():
    ggml_graph = pytest.importorskip("conformance.ggml_graph")
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(9)
    w = random_weight(T.Q4_0, 24, 576, rng)
    for n_rows in (1, 6):
        x = activations(rng, n_rows, 576)
        want = ggml_graph.ggml_graph_matmul(w.raw.reshape(24, -1), T.Q4_0, x, repack=True)
        assert_bitwise(int8dot.linear(x, int8dot.weight(w), threads=2), want)


# -- the real models --------------------------------------------------------------------------------------------------
def _layer_weights(model, layers):
    for i in layers:
        lw = model.weights.layers[i]
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            w = getattr(lw, name, None)
            if isinstance(w, QuantTensor):
                yield w


@pytest.mark.parametrize("name", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])  # gemma3: ~20-60 s
def test_real_layer_weights(name):
    """Every integer-kernel weight of two layers (SmolLM2: Q4_1, Q8_0 head; Gemma 3 Q4_K_M: Q5_0, Q8_0, Q4_K,
    Q6_K), one row (decode) and five (prefill) of activations."""
    import ggufpy
    from tests.models import MODELS

    model = ggufpy.load(MODELS[name](), backend="numpy", tokenizer=False)
    rng = np.random.default_rng(1)
    seen = set()
    for w in _layer_weights(model, (0, model.config.n_layers - 1)):
        iw = int8dot.weight(w)
        if iw is None:
            continue
        seen.add(w.type)
        for n_rows in (1, 5):
            x = activations(rng, n_rows, w.shape[1])
            assert_bitwise(int8dot.linear(x, iw, threads=2), replay(x, w))
    assert seen, "no weight of these layers has an integer kernel"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@pytest.mark.parametrize("mode", ["llamacpp", "llamacpp-avx2"])
def test_forward_equals_numpy_llamacpp(name, mode):
    """The numba backend in the llamacpp numerics (integer kernels for every product of these files, compiled
    RoPE, SiLU and attention) against the NumPy backend's replay: logits of a 10-token prompt and of 3 decode
    steps, bit for bit."""
    import ggufpy
    from tests.models import MODELS

    path = MODELS[name]()
    fast = ggufpy.load(path, backend="numba", numerics=mode, tokenizer=False, threads=2)
    ref = ggufpy.load(path, backend="numpy", numerics=mode, tokenizer=False)
    tokens = np.array([2, 504, 3458, 314, 253, 1345, 30, 198, 200, 17, 99, 1000, 7], np.int64)
    caches = fast.new_cache(capacity=16), ref.new_cache(capacity=16)
    got, want = (m.forward(tokens[:10], 0, c) for m, c in zip((fast, ref), caches, strict=True))
    assert_bitwise(got, want)
    for pos in range(10, 13):
        got, want = (m.forward(tokens[pos : pos + 1], pos, c) for m, c in zip((fast, ref), caches, strict=True))
        assert_bitwise(got, want)


def test_backend_linears_mix_integer_and_f32_kernels():
    """`NumbaBackend.linears` over weights of which only some have integer kernels (Q4_K of 12 rows has not):
    those that have are the replay's values bit for bit, the others the f32 kernels' (close to it)."""
    from ggufpy.kernels.backend import NumbaBackend
    from ggufpy.numerics import NUMERICS

    rng = np.random.default_rng(5)
    ws = (random_weight(T.Q4_K, 16, 256, rng), random_weight(T.Q4_K, 12, 256, rng), random_weight(T.Q8_0, 8, 256, rng))
    x = activations(rng, 1, 256)
    be = NumbaBackend(NUMERICS["llamacpp"], threads=2)
    ys = be.linears(x, ws)
    assert_bitwise(ys[0], replay(x, ws[0]))
    assert_bitwise(ys[2], replay(x, ws[2]))
    np.testing.assert_allclose(ys[1], replay(x, ws[1]), rtol=1e-4, atol=1e-4)
    assert be.int8_weight(ws[1]) is None and not NumbaBackend(NUMERICS["exact"]).int8_weight(ws[0])
