"""The integer kernels of issue 12's types (`ggufpy/kernels/int8lowbit.py`) equal the llamacpp numerics' NumPy
replay of ggml's x86 kernels (`vecdot.linear_x86`) bit for bit: random blocks of every type, vec_dot and tiled
row counts, widths 256..2048, one and two threads."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot
from ggufpy.weights import QuantTensor

int8lowbit = pytest.importorskip("ggufpy.kernels.int8lowbit")
from ggufpy.kernels import _numba, int8dot  # noqa: E402
from tests.test_quant_types_models import model_file  # noqa: E402, F401  (its module-scoped fixture of models)

pytestmark = pytest.mark.skipif(_numba.DISABLED, reason="no numba JIT")

TYPES = list(int8lowbit.KERNELS)


def _fp16_bytes(rng: np.random.Generator, n: int, scale: float = 0.02) -> np.ndarray:
    return (rng.standard_normal(n) * scale).astype("<f2").view(np.uint8).reshape(n, 2)


def random_weight(t: T, rows: int, cols: int, rng: np.random.Generator) -> QuantTensor:
    """Random blocks (every bit pattern of the quants and sub-block scales) with small finite block scales."""
    _, size, block, _ = int8lowbit.KERNELS[t]
    n = rows * cols // block
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if t == T.IQ1_M:  # fp16 d in the top nibbles of the four u16 scales at 48
        bits = _fp16_bytes(rng, n).view("<u2")[:, 0]
        sc = b[:, 48:56].view("<u2") & np.uint16(0x0FFF)
        b[:, 48:56] = (sc | ((bits[:, None] >> (4 * np.arange(4, dtype=np.uint16))) & 15) << 12).view(np.uint8)
    elif t == T.MXFP4:  # E8M0 exponent: scales 2^-28 .. 2^4
        b[:, 0] = rng.integers(100, 133, n)
    elif t != T.NVFP4:  # UE4M3 scales are finite for every byte
        at = {T.TQ1_0: 52, T.TQ2_0: 64}.get(t, 0)
        b[:, at : at + 2] = _fp16_bytes(rng, n)
    return QuantTensor("w", t, (rows, cols), b.reshape(-1))


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


def product(x: np.ndarray, w: QuantTensor, threads: int) -> np.ndarray:
    fmt, size, block, kernel = int8lowbit.KERNELS[w.type]
    rows, cols = w.shape
    raw = np.asarray(w.raw).view(np.uint8).reshape(rows, cols // block * size)
    a = int8dot.quantize(x, fmt)
    out = np.empty((x.shape[0], rows), np.float32)
    if fmt == int8lowbit.Q8_K:
        kernel(threads, raw, a.q, a.d, a.bsums, out)
    else:
        kernel(threads, raw, a.q, a.d, a.s, a.asum, out)
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("n_rows", "rows", "cols", "threads"), [(1, 40, 256, 1), (3, 36, 768, 2), (8, 24, 2048, 2), (17, 13, 512, 1)]
)
def test_random_blocks_equal_the_replay(t, n_rows, rows, cols, threads):
    """T = 1, 3 (vec_dot), 8, 17 (the grid types' tiled kernel); rows % 8 == 0 and != 0 (MXFP4 repacked or
    not); widths of odd block counts (MXFP4's scalar last block)."""
    rng = np.random.default_rng([int(t), n_rows])
    w = random_weight(t, rows, cols + (32 if t == T.MXFP4 and cols == 768 else 0), rng)
    x = activations(rng, n_rows, w.shape[1])
    want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
    assert_bitwise(product(x, w, threads), want)


# -- whole models: the numba backend in the llamacpp numerics against the NumPy backend's replay ----------------------
FAMILIES = [T.IQ2_XXS, T.IQ1_M, T.TQ1_0, T.MXFP4, T.Q1_0]  # grid, IQ1 (delta apart), ternary, Q8_0 (two)


@pytest.mark.parametrize("t", FAMILIES, ids=lambda t: t.name)
def test_forward_equals_numpy_llamacpp(model_file, t):  # noqa: F811
    """A 20-token prefill (the grid types' tiled kernel) and two decode steps (vec_dot), logits bit for bit."""
    import ggufpy

    if not int8dot.AVAILABLE:
        pytest.skip("no AVX2: the f32 kernels run")
    path = model_file(t)
    fast = ggufpy.load(path, backend="numba", numerics="llamacpp", tokenizer=False, threads=2)
    ref = ggufpy.load(path, backend="numpy", numerics="llamacpp", tokenizer=False)
    assert fast.backend.int8_weight(fast.weights.layers[0].ffn_down) is not None
    ids = np.array([5, 60, 7, 200, 31, 9, 100, 3, 17, 250, 41, 8, 90, 12, 64, 77, 120, 33, 2, 48, 11, 6])
    caches = fast.new_cache(capacity=len(ids)), ref.new_cache(capacity=len(ids))
    got, want = (m.forward(ids[:20], 0, c) for m, c in zip((fast, ref), caches, strict=True))
    assert np.isfinite(want).all() and want.std() > 0
    assert_bitwise(got, want)
    for pos in (20, 21):
        got, want = (m.forward(ids[pos : pos + 1], pos, c) for m, c in zip((fast, ref), caches, strict=True))
        assert_bitwise(got, want)
