"""Q5_K and Q3_K integer kernels (`ggufpy/kernels/int8ir_k5.py`) equal the llamacpp numerics' NumPy replay of
ggml's x86 kernels (`vecdot.linear_x86`: vec_dot below 8 activation rows, tiled from 8) bit for bit: random
blocks with ordinary and extreme fp16 scales, 1..2816 weight rows, T = 1..64, both replayed builds; llama.cpp's
own mul_mat (one-node ggml graph) where it is installed; whole forward passes of the q5_k / q3_k conformance
fixtures, numba backend against NumPy backend."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot
from ggufpy.weights import QuantTensor

int8dot = pytest.importorskip("ggufpy.kernels.int8dot")
pytestmark = pytest.mark.skipif(not int8dot.AVAILABLE, reason="no numba JIT or no AVX2: the f32 kernels run")

TYPES = (T.Q5_K, T.Q3_K)
SCALES = {T.Q5_K: (0, 2), T.Q3_K: (108,)}  # byte offsets of the fp16 d (and Q5_K's dmin)
# fp16 bit patterns at the ends of the finite range: max, -max, smallest normal, smallest subnormal, 0, -0
EXTREME = np.array([0x7BFF, 0xFBFF, 0x0400, 0x0001, 0x0000, 0x8000], np.uint16)


def random_weight(t: T, rows: int, cols: int, rng: np.random.Generator, extreme: bool = False) -> QuantTensor:
    """Random blocks (every bit pattern of the quants, the high bits and the 6-bit sub-block scales and mins)
    with small finite fp16 scales, or with `extreme`, a quarter of them at the ends of fp16's finite range."""
    size = int8dot.INT8_TYPES[t][1]
    n = rows * cols // 256
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for o in SCALES[t]:
        h = (rng.standard_normal(n) * 0.02).astype("<f2").view(np.uint16)
        if extreme:
            pick = rng.random(n) < 0.25
            h[pick] = rng.choice(EXTREME, int(pick.sum()))
        b[:, o : o + 2] = h.view(np.uint8).reshape(n, 2)
    return QuantTensor("w", t, (rows, cols), b.reshape(-1))


def activations(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Rows of assorted magnitudes, a zero row (d = 0 blocks), outliers and a row whose peak is negative."""
    x = rng.standard_normal((rows, cols)) * rng.choice([1e-3, 0.1, 1.0, 8.0], size=(rows, 1))
    if rows > 1:
        x[1] = 0.0
    if rows > 2:
        x[2, :: max(1, cols // 7)] *= 300.0
    if rows > 3:
        x[3, 5] = -50 * np.abs(x[3]).max()
    return x.astype(np.float32)


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{bad.size}/{want.size} differ, e.g. {got.flat[bad[:4]]} vs {want.flat[bad[:4]]}"


def test_registered():
    """Both types take the integer path in `int8dot.weight`, with Q8_K activations."""
    from ggufpy.kernels import int8ir_k5

    rng = np.random.default_rng(0)
    for t in TYPES:
        iw = int8dot.weight(random_weight(t, 3, 256, rng))
        assert iw is not None and iw.kernel is int8ir_k5.KERNELS[t][3] and iw.fmt == "Q8_K" and iw.k_type


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 3, 7, 8, 9, 64])
@pytest.mark.parametrize(("rows", "cols"), [(1, 256), (13, 768), (40, 2048)])
@pytest.mark.parametrize("extreme", [False, True], ids=["scales", "extreme"])
def test_random_blocks_equal_the_replay(t, n_rows, rows, cols, extreme):
    """vec_dot (T = 1, 3, 7) and tiled (T = 8, 9, 64), both builds (the kernels are the same on AVX2 and
    AVX-512: `ggufpy.quants.x86.kernel_for`)."""
    rng = np.random.default_rng([int(t), n_rows, rows, extreme])
    w = random_weight(t, rows, cols, rng, extreme)
    x = activations(rng, n_rows, cols)
    got = int8dot.linear(x, int8dot.weight(w), threads=2)
    if not extreme:
        assert np.isfinite(got).all()
    for isa in ("avx512", "avx2"):
        assert_bitwise(got, vecdot.linear_x86(x, w.raw, w.type, w.shape, isa=isa))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 8])
def test_ffn_shape_equals_the_replay(t, n_rows):
    """2816 weight rows (a d1024 / f2816 model's ffn_gate), one and two threads."""
    rng = np.random.default_rng([int(t), 2816, n_rows])
    w = random_weight(t, 2816, 1024, rng)
    x = activations(rng, n_rows, 1024)
    want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
    iw = int8dot.weight(w)
    for threads in (1, 2):
        assert_bitwise(int8dot.linear(x, iw, threads=threads), want)


# -- llama.cpp itself (its graph runs the same kernels: Q5_K and Q3_K are never repacked on x86) -------------------
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("rows", "n_rows"), [(12, 1), (40, 5), (24, 9), (13, 20)])
def test_against_llamacpp(t, rows, n_rows):
    ggml_graph = pytest.importorskip("conformance.ggml_graph")
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng([int(t), rows, n_rows])
    w = random_weight(t, rows, 512, rng)
    x = activations(rng, n_rows, 512)
    want = ggml_graph.ggml_graph_matmul(w.raw.reshape(rows, -1), t, x)
    assert_bitwise(int8dot.linear(x, int8dot.weight(w), threads=2), want)


# -- whole models ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["q5_k", "q3_k"])
@pytest.mark.parametrize("mode", ["llamacpp", "llamacpp-avx2"])
def test_forward_equals_numpy_llamacpp(name, mode):
    """The conformance fixture whose every matrix is of the type: a 10-token prefill (tiled) and three decode
    steps (vec_dot), logits bit for bit against the NumPy backend's replay."""
    import ggufpy
    from conformance import fixtures as fx

    path = fx.fixture_path(name)
    fast = ggufpy.load(path, backend="numba", numerics=mode, tokenizer=False, threads=2)
    ref = ggufpy.load(path, backend="numpy", numerics=mode, tokenizer=False)
    assert fast.backend.int8_weight(fast.weights.layers[0].ffn_down) is not None
    tokens = np.array([2, 54, 38, 31, 25, 13, 30, 19, 20, 17, 99, 100, 7], np.int64)
    caches = fast.new_cache(capacity=16), ref.new_cache(capacity=16)
    got, want = (m.forward(tokens[:10], 0, c) for m, c in zip((fast, ref), caches, strict=True))
    assert np.isfinite(want).all() and want.std() > 0
    assert_bitwise(got, want)
    for pos in range(10, 13):
        got, want = (m.forward(tokens[pos : pos + 1], pos, c) for m, c in zip((fast, ref), caches, strict=True))
        assert_bitwise(got, want)
