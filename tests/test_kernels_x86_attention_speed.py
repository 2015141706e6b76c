"""The vectorized decode attention of the llamacpp numerics (`ggufpy.kernels.x86_decode`, T = 1 over an f16 cache)
against the NumPy replay of llama.cpp's x86 kernels (`quants.x86.attention`, itself bit for bit with llama.cpp:
tests/test_x86_attention.py), and its branch-free lane functions against the replays they stand for: f16
rounding over every f16 neighbourhood, ggml_v_expf of both builds over scores, masks and special values.
Correctness only: the speed is measured by hand (see the module docstring of `x86_decode`).
"""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy import kernels
from ggufpy.quants.x86 import attention as replay
from ggufpy.quants.x86.unary import v_expf_256, v_expf_512

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"numba unavailable: {kernels.IMPORT_ERROR}")

if kernels.AVAILABLE:
    from ggufpy.kernels import x86, x86_decode
    from ggufpy.kernels._numba import DISABLED, jit

    @jit
    def _round_all(x, out):
        for i in range(x.size):
            out[i] = x86_decode.round_f16_lane(x[i])

    @jit
    def _expf_all(x, wide, out):
        for i in range(x.size):
            out[i] = x86_decode.v_expf_lane(x[i], wide)
else:
    DISABLED = True

ISAS = ["avx2", "avx512"]


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert not differ.any(), f"{differ.sum()} of {differ.size} differ, max |diff| {np.abs(got - want).max()}"


def test_round_f16_lane_is_nearest_even_on_every_f16_neighbourhood():
    """Every f32 whose top 16 bits take each of the 65536 values, with low halves at and around the f16 ties
    (bit 12 of the mantissa) and the subnormal ties: equal to NumPy's f32 -> f16 conversion (round to nearest
    even, the replay's `astype(np.float16)`), NaN quieted."""
    low = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2001, 0x3000, 0x7FFF, 0x8000, 0xEFFF, 0xF000,
                    0xF001, 0xFFFF], np.uint32)  # fmt: skip
    rng = np.random.default_rng(0)
    low = np.concatenate([low, rng.integers(0, 1 << 16, 8, dtype=np.uint32)])
    bits = (np.arange(1 << 16, dtype=np.uint32)[:, None] << np.uint32(16)) | low[None, :]
    x = bits.reshape(-1).view(np.float32)
    got = np.empty_like(x)
    _round_all(x, got)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert_bitwise(got[~nan], want[~nan])
    assert np.all(got[nan].view(np.uint32) & 0x00400000)  # quiet NaNs, as vcvtps2ph gives


@pytest.mark.parametrize("isa", ISAS)
def test_v_expf_lane_is_the_replay(isa):
    """The branch-free ggml_v_expf lane (compiled, as the decode softmax runs it) equals the replay of its build on
    scores, the masked -inf, huge and tiny inputs and NaN."""
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            (rng.standard_normal(20000) * 30).astype(np.float32),
            -rng.random(20000).astype(np.float32) * 110,
            np.array(
                [0, -0.0, -np.inf, np.inf, np.nan, 88.7, 88.8, -87.3, -103.9, -104, -150, -1e30, 1e30], np.float32
            ),
            np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 1e-40, -1e-40], np.float32),
        ]
    )
    got = np.empty_like(x)
    _expf_all(x, isa == "avx512", got)
    with np.errstate(all="ignore"):
        want = (v_expf_512 if isa == "avx512" else v_expf_256)(x)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert_bitwise(got[~nan], want[~nan])


# (S, start, H, G, E, window, sinks): GQA ratios 1, 4 and 8; head sizes 64, 128 and 256 (one to four
# `ggml_vec_dot_f16` steps on either build) and 40, 72, 96 (leftovers in double; fewer elements than one step);
# odd key counts and keys ending just before, at and after an 8/16-lane block and a 32/64-cell block of the V
# product; n_kv past 256; a sliding window starting inside a block; sinks above and below the scores; a query
# before the last cached position (cells past it read with p = 0).
DECODE_SHAPES = [
    (1, 0, 4, 4, 64, None, False),
    (15, 14, 16, 4, 64, None, False),
    (16, 15, 16, 4, 64, None, True),
    (17, 16, 8, 1, 128, None, False),
    (33, 32, 8, 8, 64, None, False),
    (63, 62, 16, 2, 256, None, True),
    (65, 64, 4, 1, 40, None, False),
    (129, 128, 6, 2, 72, None, True),
    (141, 140, 16, 4, 64, None, False),
    (141, 140, 64, 8, 64, 128, True),
    (255, 254, 8, 2, 96, 37, False),
    (257, 256, 32, 4, 128, None, True),
    (300, 250, 8, 2, 64, None, False),
    (300, 290, 8, 1, 64, 23, True),
    (601, 600, 16, 4, 64, 128, True),
    (1000, 999, 16, 4, 64, None, False),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", DECODE_SHAPES if not DISABLED else DECODE_SHAPES[:3], ids=str)
def test_decode_attention_is_the_replay(isa, shape):
    S, start, H, G, E, window, with_sinks = shape
    rng = np.random.default_rng(S * 7 + H + E)
    q = (rng.standard_normal((1, H, E)) * 2).astype(np.float32)
    k, v = ((rng.standard_normal((S, G, E)) * 2).astype(np.float16) for _ in range(2))
    sinks = None
    if with_sinks:
        sinks = (rng.standard_normal(H) * 4).astype(np.float32)
        sinks[0], sinks[-1] = 60.0, -60.0  # a sink above every score, one whose exp vanishes
    scale = np.float32(1) / np.sqrt(np.float32(E))
    want = replay.attention(q, k, v, start, scale, window, isa=isa, sinks=sinks)
    for threads in (1, 2, 3):  # a task per KV group, or per head when the groups are fewer than the threads
        assert_bitwise(x86.attention(q, k, v, start, scale, window, isa=isa, threads=threads, sinks=sinks), want)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_attention_large_scores(isa):
    """Scores far apart (exps that underflow to subnormals and to 0) and probabilities in f16's subnormal range."""
    rng = np.random.default_rng(3)
    S, H, G, E = 200, 8, 2, 64
    q = (rng.standard_normal((1, H, E)) * 30).astype(np.float32)
    k, v = ((rng.standard_normal((S, G, E)) * 8).astype(np.float16) for _ in range(2))
    scale = np.float32(1) / np.sqrt(np.float32(E))
    want = replay.attention(q, k, v, S - 1, scale, isa=isa)
    assert_bitwise(x86.attention(q, k, v, S - 1, scale, isa=isa, threads=1), want)
