"""The decode attention's IR products (`ggufpy.kernels.x86_decode_ir`, taken by `x86_decode` when E is a multiple
of 8) bit for bit against the loops they replace (`x86_decode._scores`, `_values`) and, through the whole kernel,
against the NumPy replay of llama.cpp (`quants.x86.attention`): both x86 builds, key counts 1..1100 (ends on and
off the 8-key blocks, the 8/16 lanes and the 32/64-cell blocks), windows, sinks, GQA ratios 1, 4, 8, head sizes
with leftovers (E % (4 lanes) != 0), with no whole step, and not a multiple of 8 (the loops), 1-3 threads.
Correctness only: the speed is measured by hand (see `x86_decode`'s docstring).
"""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy import kernels
from ggufpy.quants.x86 import attention as replay

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"numba unavailable: {kernels.IMPORT_ERROR}")

if kernels.AVAILABLE:
    from ggufpy.kernels import x86, x86_decode
    from ggufpy.kernels._numba import DISABLED, jit

    @jit
    def _both_scores(q16, k, g, lo, hi, lanes, base, w_ir, w_loops):
        """w (hp, end - base) from both paths; only lo <= j < hi is defined (the rest is masked later)."""
        E = q16.shape[1]
        hp = q16.shape[0]
        step = 4 * lanes
        if lanes == 16:
            x86_decode._scores_ir(q16, k, g, hp, lo, hi, 16, base, w_ir)
        else:
            x86_decode._scores_ir(q16, k, g, hp, lo, hi, 8, base, w_ir)
        kf = np.empty(E, np.float32)
        kacc = np.empty(step, np.float32)
        t = np.empty((hp * x86_decode._KEYS, lanes), np.float32)
        x86_decode._scores(q16, k, g, hp, lo, hi, lanes, base, kf, kacc, t, w_loops)

    @jit
    def _both_values(v, g, w, base, kv_hi, lanes, out_ir, out_loops):
        E = v.shape[2]
        hp = w.shape[0]
        acc_ir = np.empty((hp * 4 * lanes, E), np.float32)
        if lanes == 16:
            x86_decode._values_ir(v, g, w, hp, base, kv_hi, 16, acc_ir, out_ir, 0)
        else:
            x86_decode._values_ir(v, g, w, hp, base, kv_hi, 8, acc_ir, out_ir, 0)
        acc = np.empty((4 * lanes, E), np.float32)
        for hh in range(w.shape[0]):
            x86_decode._values(v, g, w[hh], base, kv_hi, lanes, acc, out_loops[hh])
else:
    DISABLED = True

KEY_RANGES = [(0, 1), (0, 7), (0, 8), (0, 9), (0, 65), (0, 300), (3, 4), (5, 37), (31, 64), (100, 257), (250, 300)]


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert not differ.any(), f"{differ.sum()} of {differ.size} differ, max |diff| {np.abs(got - want).max()}"


def _wide(rng, shape, spread: int = 6) -> np.ndarray:
    """Normal values times 2^[-spread, spread): sums whose value depends on their order (a reordered sum
    would show)."""
    return rng.standard_normal(shape) * np.exp2(rng.integers(-spread, spread, shape).astype(np.float64))


def _f16_bits(x) -> np.ndarray:
    return np.asarray(x).astype(np.float16).view(np.uint16)


@pytest.mark.skipif(DISABLED, reason="the IR products need compiled numba")
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("E", [64, 128, 32, 40, 72, 96, 256, 8])
def test_scores_ir_is_the_loops(lanes, E):
    """Every key range lo..hi (starts and ends on and off the 8-key blocks, windows' starts) of 3 query heads."""
    rng = np.random.default_rng(E + lanes)
    S, G, hp = 300, 2, 3
    k = _f16_bits(_wide(rng, (S, G, E)))
    q16 = _wide(rng, (hp, E)).astype(np.float16).astype(np.float32)
    step = 4 * lanes
    for lo, hi in KEY_RANGES:
        base = lo - lo % step
        end = hi + (-hi) % step
        w_ir, w_loops = (np.full((hp, end - base), np.nan, np.float32) for _ in range(2))
        _both_scores(q16, k, 1, lo, hi, lanes, base, w_ir, w_loops)
        assert_bitwise(w_ir[:, lo - base : hi - base], w_loops[:, lo - base : hi - base])


@pytest.mark.skipif(DISABLED, reason="the IR products need compiled numba")
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("E", [64, 128, 40, 72, 96, 8])
def test_values_ir_is_the_loops(lanes, E):
    """Cell ranges from a 4-lane block start (as the kernel reads them), 1 to 8 query heads, probabilities
    rounded to f16 with zeros (masked cells) among them."""
    rng = np.random.default_rng(2 * E + lanes)
    S, G = 260, 3
    v = _f16_bits(_wide(rng, (S, G, E)))
    step = 4 * lanes
    ranges = [(0, 1), (0, 5), (0, step - 1), (0, step), (0, step + 1), (0, 200), (step, 260), (0, 260)]
    for (base, kv_hi), hp in zip(ranges, [1, 2, 3, 4, 8, 2, 4, 8], strict=True):  # 1, 2 or 4 heads per pass
        w = rng.random((hp, kv_hi - base)).astype(np.float16).astype(np.float32)
        w[:, rng.random(kv_hi - base) < 0.2] = 0.0
        out_ir, out_loops = (np.empty((hp, E), np.float32) for _ in range(2))
        _both_values(v, 2, w, base, kv_hi, lanes, out_ir, out_loops)
        assert_bitwise(out_ir, out_loops)


# (S, start, H, G, E, window, sinks): key counts 1..1100 around the 8-key blocks and 8/16 lanes; GQA ratios 1, 4
# and 8; head sizes with leftovers (40, 72, 96), not a multiple of 8 (20, 36: the loops) and of 32 and 256;
# windows starting inside blocks; gpt-oss's 64/8 heads with sinks; a query before the last cached position.
SHAPES = [
    (1, 0, 16, 4, 64, None, False),
    (2, 1, 8, 8, 64, None, True),
    (7, 6, 16, 4, 64, None, False),
    (9, 8, 32, 8, 64, None, False),
    (23, 22, 8, 1, 40, None, True),
    (31, 30, 4, 4, 20, None, False),
    (57, 56, 16, 2, 72, 13, False),
    (100, 99, 16, 4, 64, None, False),
    (129, 128, 32, 8, 64, None, True),
    (141, 140, 64, 8, 64, 128, True),
    (161, 160, 16, 4, 96, None, False),
    (200, 180, 8, 2, 36, 50, True),
    (333, 332, 8, 1, 256, 77, False),
    (520, 519, 16, 4, 32, None, False),
    (1000, 999, 64, 8, 64, None, True),
    (1100, 1099, 16, 4, 64, None, False),
    (1100, 1090, 8, 8, 128, 300, True),
]


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("shape", SHAPES if not DISABLED else SHAPES[:2], ids=str)
def test_decode_attention_is_the_replay(isa, shape):
    S, start, H, G, E, window, with_sinks = shape
    rng = np.random.default_rng(S * 5 + H + E)
    q = (rng.standard_normal((1, H, E)) * 2).astype(np.float32)
    k, v = ((rng.standard_normal((S, G, E)) * 2).astype(np.float16) for _ in range(2))
    sinks = None
    if with_sinks:
        sinks = (rng.standard_normal(H) * 4).astype(np.float32)
        sinks[0] = 60.0  # above every score
    scale = np.float32(1) / np.sqrt(np.float32(E))
    want = replay.attention(q, k, v, start, scale, window, isa=isa, sinks=sinks)
    for threads in (1, 2, 3):  # a task per KV group, or per head when the groups are fewer than the threads
        got = x86.attention(q, k, v, start, scale, window, isa=isa, threads=threads, sinks=sinks)
        assert_bitwise(got, want)
