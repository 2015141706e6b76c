"""The batched products' work units (`kernels/batched_ir.py`, issue 14): each group of 64 weight rows is cut into
units of 16 lanes (32 below `WIDE_BELOW` rows), computed in tiles of 4 rows (2 for wide units), and the units
go to any thread. None of that may change a row: every row stays bit for bit `matvec` of that row alone, for
every packed type, every row count around the tile and unit boundaries, and every thread count.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.kernels import AVAILABLE, JIT_DISABLED

pytestmark = pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")


def _types():
    """(type, packed weight, plan) of every packed type with a batched row kernel (nib, nib6, i8 families)."""
    from ggufpy.kernels.layout import PACKED_TYPES, pack
    from ggufpy.kernels.matvec import plan
    from tests.test_kernels import random_weight

    out = []
    for t in sorted(PACKED_TYPES, key=lambda t: t.name):
        p = pack(random_weight(t, 130, 512, seed=21))  # 3 groups, the last one partial
        if p.family in ("nib", "nib6", "i8"):
            out.append((t, p, plan(p)))
    return out


TYPES = _types() if AVAILABLE and not JIT_DISABLED else []
IDS = [t.name for t, _, _ in TYPES]


def _rows(p, n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, p.cols)).astype(np.float32)
    x[1] = 0.0  # a row of zeros: every sum exactly 0
    x[4, 64:96] = 0.0  # a sub-block of zeros
    x[6] *= 1e-30  # tiny values: products near the subnormal range
    x[7] *= 1e30  # large ones
    return x


@pytest.mark.parametrize("t, p, planned", TYPES, ids=IDS)
def test_every_row_count_and_thread_count_is_each_row_alone(t, p, planned):
    """B = 1..13 (wide units below 4 rows, then full tiles of 4 and remainders of 1-3 rows) on 1, 2 and 3
    threads: every row bit for bit its product alone, wherever it sits in the tiles."""
    from ggufpy.kernels.batched import matvec_rows
    from ggufpy.kernels.matvec import matvec

    x = _rows(p, 13, seed=22)
    alone = np.concatenate([matvec(p, x[b : b + 1], None, planned=planned) for b in range(13)])
    for B in range(1, 14):
        for threads in (1, 2, 3):
            rows = matvec_rows(p, x[13 - B :], None, planned, threads=threads)
            assert rows.tobytes() == alone[13 - B :].tobytes(), f"{t.name}, B={B}, threads={threads}"


@pytest.mark.parametrize("t, p, planned", TYPES[:3], ids=IDS[:3])
def test_units_cover_every_lane_once(t, p, planned):
    """Every output lane of every group is written by exactly one unit, narrow and wide: an output array
    filled with NaN beforehand has no NaN left, and each unit alone writes only its own 16 or 32 lanes."""
    from ggufpy.kernels import batched
    from ggufpy.kernels.batched_ir import UNITS, unit_rows

    args = planned[1]
    for B, units in ((8, UNITS), (3, UNITS // 2)):
        x = np.random.default_rng(23).standard_normal((B, p.cols)).astype(np.float32)
        sums = np.empty((B, args[0].shape[1]), np.float32)
        batched._sub_sums(x, args[0].shape[2], sums)
        whole = np.full((B, p.groups * 64), np.nan, np.float32)
        batched.row_kernel(p.family, args)(1, *args, x, sums, whole)
        assert not np.isnan(whole).any()
        kernel = batched.row_kernel(p.family, args)
        assert kernel is batched._ROWS[p.family, p.sc is not None or p.mn is not None]
        seen = np.zeros(p.groups * 64, np.int64)
        unit = unit_rows[p.family, p.sc is not None or p.mn is not None]
        for u in range(p.groups * units):
            out = np.full((B, p.groups * 64), np.nan, np.float32)
            _call_unit(unit, args, x, sums, u, B < batched.WIDE_BELOW, out)
            written = ~np.isnan(out[0])
            g = u // units
            assert written.sum() == written[g * 64 : g * 64 + 64].sum() == 64 // units  # its own group's lanes
            assert out[:, written].tobytes() == whole[:, written].tobytes()
            seen += written
        assert np.all(seen == 1)


def _call_unit(unit, args, x, sums, u, wide, out):
    """One unit through a compiled wrapper (an intrinsic is callable only from compiled code)."""
    q, a, b, sc, mn, per, zo = args
    _one_unit(unit)(q, a, b, sc, mn, per, np.float32(zo), x, sums, u, int(wide), out)


_WRAPPERS: dict = {}


def _one_unit(unit):
    if unit not in _WRAPPERS:
        from ggufpy.kernels._numba import jit

        @jit
        def call(q, a, b, sc, mn, per, zo, x, sums, u, wide, out):
            unit(q, a, b, sc, mn, per, zo, x, sums, u, wide, out)

        _WRAPPERS[unit] = call
    return _WRAPPERS[unit]


@pytest.mark.parametrize("t, p, planned", TYPES, ids=IDS)
def test_plain_python_units_match(t, p, planned):
    """The NUMBA_DISABLE_JIT form of a unit (`_python_unit_rows`: NumPy, a multiply and an add per step
    rather than one FMA, so the last bits may differ) covers the same lanes with the same values."""
    from ggufpy.kernels import batched
    from ggufpy.kernels.batched_ir import UNITS, _python_unit_rows

    args = planned[1]
    super_style = p.sc is not None or p.mn is not None
    python = _python_unit_rows(p.family, super_style)
    for B in (3, 5):
        x = np.random.default_rng(24).standard_normal((B, p.cols)).astype(np.float32)
        sums = np.empty((B, args[0].shape[1]), np.float32)
        batched._sub_sums(x, args[0].shape[2], sums)
        compiled = np.empty((B, p.groups * 64), np.float32)
        batched.row_kernel(p.family, args)(1, *args, x, sums, compiled)
        wide = B < batched.WIDE_BELOW
        out = np.full((B, p.groups * 64), np.nan, np.float32)
        for u in range(p.groups * (UNITS // 2 if wide else UNITS)):
            python(*args[:6], np.float32(args[6]), x, sums, u, wide, out)
        scale = np.abs(compiled).max()
        np.testing.assert_allclose(out, compiled, rtol=1e-4, atol=1e-5 * scale, err_msg=t.name)
