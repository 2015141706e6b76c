"""The SIMD arithmetic the x86 emulations replay (`ggufpy.quants.x86.simd`), against exact rational arithmetic
and the C headers' definitions."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ggufpy.quants.x86.simd import FmaAccumulator, fma, hsum_float_8, reduce_add_ps_512


def correctly_rounded(x, y, z) -> np.float32:
    """The f32 nearest to x*y + z (ties to even), by rational arithmetic."""
    exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
    cand = np.float32(float(exact))  # Fraction -> float64 is correctly rounded; float64 -> f32 may double-round
    lo, hi = (np.nextafter(cand, np.float32(d)) for d in (-np.inf, np.inf))
    return min((lo, cand, hi), key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.uint32)) & 1))


def test_fma_rounds_once_where_a_float64_sum_would_round_twice():
    # a*b + c = 1 + 2^-23 + 2^-24 - 2^-70: just below the f32 halfway point 1 + 3 * 2^-24, so the right answer
    # is 1 + 2^-23; a float64 intermediate rounds onto the halfway point, then to even: 1 + 2^-22
    a, b, c = np.float32(1 + 2.0**-23), np.float32(2.0**-24 * (1 - 2.0**-23)), np.float32(1 + 2.0**-23)
    assert (a.astype(np.float64) * b + c).astype(np.float32) == np.float32(1 + 2.0**-22)  # the naive way
    assert fma(a, b, c) == np.float32(1 + 2.0**-23)
    assert fma(-a, b, -c) == np.float32(-(1 + 2.0**-23))
    # (1 + 2^-12)^2 is an f32 halfway point; + 2^-70 puts the exact value just above it
    h = np.float32(1 + 2**-12)
    assert fma(h, h, np.float32(2.0**-70)) == np.float32(1 + 2**-11 + 2**-23)
    assert fma(h, h, np.float32(-(2.0**-70))) == np.float32(1 + 2**-11)
    assert fma(np.full((2, 3), a), b, c).shape == (2, 3)


def test_fma_against_fractions():
    rng = np.random.default_rng(0)
    n = 2000
    # near-halfway sums: products of about half an ulp of c, off by a few units in their last places
    c_near = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    half_ulp = (np.spacing(np.abs(c_near)) / 2).astype(np.float32)
    x_near = (1 + rng.integers(-3, 4, n) * 2.0**-23).astype(np.float32)
    y_near = (half_ulp * (1 + rng.integers(-3, 4, n) * 2.0**-23) * rng.choice([-1, 1], n)).astype(np.float32)
    spread = (rng.standard_normal((3, n)) * 10.0 ** rng.integers(-3, 3, (3, n))).astype(np.float32)
    tiny = rng.standard_normal((3, 200)).astype(np.float32)
    tiny[2] *= np.float32(2**-140)  # results in the f32-subnormal range
    tiny[1] *= np.float32(2**-130)
    for x, y, z in [(x_near, y_near, c_near), spread, tiny]:
        got = fma(x, y, z)
        want = [correctly_rounded(*v) for v in zip(x, y, z, strict=True)]
        np.testing.assert_array_equal(got.view(np.uint32), np.array(want, np.float32).view(np.uint32))


def test_accumulator_repeats_fma_with_broadcasting():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 1, 5)).astype(np.float32)
    b = rng.standard_normal((4, 3, 5)).astype(np.float32)
    acc = FmaAccumulator((4, 3, 5))
    ref = np.zeros((4, 3, 5), np.float32)
    for k in range(3):
        acc.add(a * np.float32(k + 1), b)
        ref = fma(a * np.float32(k + 1), b, ref)
    np.testing.assert_array_equal(acc.acc, ref)


def test_horizontal_sums_follow_the_header_trees():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((1000, 16)) * 10.0 ** rng.integers(-4, 4, (1000, 16))).astype(np.float32)
    f = np.float32
    h8 = [(f(v[4] + v[0]) + f(v[6] + v[2])) + (f(v[5] + v[1]) + f(v[7] + v[3])) for v in x[:, :8]]
    np.testing.assert_array_equal(hsum_float_8(x[:, :8]), np.array(h8, np.float32))
    t3 = x[:, 8:] + x[:, :8]
    t6 = t3[:, 4:] + t3[:, :4]
    r = [f(v[0] + v[2]) + f(v[1] + v[3]) for v in t6]
    np.testing.assert_array_equal(reduce_add_ps_512(x), np.array(r, np.float32))
    # the order matters: a plain sum differs on some rows
    assert not np.array_equal(hsum_float_8(x[:, :8]), x[:, :8].sum(axis=1, dtype=np.float32))
