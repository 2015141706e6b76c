"""The search tables ggml's IQ1/IQ2/IQ3 quantizers build at init, and the neighbour search that reads them.

llama.cpp `ggml/src/ggml-quants.c` `iq2xs_init_impl` (IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) and
`iq3xs_init_impl` (IQ3_XXS, IQ3_S) turn each grid into:

- `levels`: per grid row, the level l of each element (the quantizer works with 2l + 1; the grid bytes of
  `grids.py` are these levels mapped through a few values, so ggml's `kgrid_*` tables are recovered exactly);
- `kmap`: for every code u = sum(l_i << bits * i) the grid row holding it, or -1;
- for every code not on the grid, its neighbours: the grid rows whose squared integer distance to (2l + 1) is
  among the `nwant` smallest distinct distances, ordered by (distance, row) as ggml's qsort leaves them.

ggml computes them at `ggml_quantize_init`; here they are computed at first use and cached (0.1 s for the IQ3
grids, 1-2 s for IQ2's, 3-4 s for the 2048-row IQ1 grid on a loaded 2-core machine; ggml's own init of the
IQ1 grid took a minute there).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from ..errors import GGUFError, GGUFUnsupportedError
from .grids import IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID

__all__ = ["GridTables", "best_neighbours", "check_finite", "grid_tables", "require_imatrix"]

F32 = np.float32

# name -> (grid, its byte values in level order, bits per level, kmap size, nwant) as ggml's init chooses them
_SOURCES = {
    "IQ2_XXS": (IQ2XXS_GRID, (8, 25, 43), 2, 43692, 2),
    "IQ2_XS": (IQ2XS_GRID, (8, 25, 43), 2, 43692, 2),
    "IQ2_S": (IQ2S_GRID, (8, 25, 43), 2, 43692, 1),
    "IQ1_S": (IQ1S_GRID, (-1, 0, 1), 2, 43692, 3),  # IQ1_M shares IQ1_S's tables (`iq2_data_index`)
    "IQ3_XXS": (IQ3XXS_GRID, (4, 12, 20, 28, 36, 44, 52, 62), 3, 4096, 2),
    "IQ3_S": (IQ3S_GRID, (1, 3, 5, 7, 9, 11, 13, 15), 3, 4096, 3),
}


def check_finite(x: np.ndarray, name: str) -> None:
    """The grid searches need finite values: ggml's aborts (`GGML_ASSERT(grid_index >= 0)`) on a NaN or inf."""
    if not np.isfinite(x).all():
        r, c = np.argwhere(~np.isfinite(x))[0]
        raise GGUFError(f"cannot quantize to {name}: value {x[r, c]} at block {r}, element {c} is not finite")


def require_imatrix(qw: np.ndarray | None, name: str) -> None:
    """IQ2_XXS, IQ2_XS and IQ1_S have no path without an importance matrix: ggml asserts one is given."""
    if qw is None:
        raise GGUFUnsupportedError(
            f"cannot quantize to {name} without an importance matrix: ggml requires one for it "
            "(ggml_quantize_requires_imatrix)"
        )


@dataclass(frozen=True)
class GridTables:
    """One grid's quantizer tables. Neighbour lists are CSR: code u's list is `neighbours[start[u]:][:count[u]]`."""

    levels: np.ndarray  # i8[n_grid, width]: l of each element, 0..levels-1
    bits: int
    kmap: np.ndarray  # i32[kmap_size]: grid row of code u, -1 if u is not on the grid
    start: np.ndarray  # i64[kmap_size]
    count: np.ndarray  # i64[kmap_size]: 0 for codes on the grid
    neighbours: np.ndarray  # i32[total]
    levels_t: np.ndarray  # i64[width, n_grid]: `levels` transposed, one contiguous row per element position

    @property
    def width(self) -> int:
        return self.levels.shape[1]

    def codes(self, L: np.ndarray) -> np.ndarray:
        """Levels i8[..., width] -> the code u of each group: i64[...]."""
        shifts = self.bits * np.arange(self.width, dtype=np.int64)
        return (L.astype(np.int64) << shifts).sum(axis=-1)


def _neighbour_lists(pos: np.ndarray, grid_pos: np.ndarray, nwant: int) -> tuple[np.ndarray, np.ndarray]:
    """For points pos i32[m, w]: (counts i64[m], grid rows in (distance, row) order, concatenated)."""
    g = grid_pos.astype(F32)
    # |p - g|^2 - |p|^2 = |g|^2 - 2 p.g orders the rows of each point as the distance does; small integers, exact
    d2 = pos.astype(F32) @ (-2 * g.T)
    d2 += (g * g).sum(1)[None, :]
    t = d2.min(axis=1)
    for _ in range(nwant - 1):  # the next distinct distance, if any
        nxt = np.min(d2, axis=1, where=d2 > t[:, None], initial=np.inf)
        t = np.where(nxt < np.inf, nxt, t)
    r, j = np.nonzero(d2 <= t[:, None])
    order = np.lexsort((j, d2[r, j], r))
    return np.bincount(r, minlength=len(pos)).astype(np.int64), j[order].astype(np.int32)


def grid_tables(name: str) -> GridTables:
    """The tables of `iq2xs_init_impl` / `iq3xs_init_impl` for the type `name` (IQ1_M: those of IQ1_S)."""
    return _build("IQ1_S" if name == "IQ1_M" else name)


@cache
def _build(name: str) -> GridTables:
    grid, values, bits, kmap_size, nwant = _SOURCES[name]
    levels = np.searchsorted(np.array(values), grid.astype(np.int32)).astype(np.int8)
    width = grid.shape[1]
    shifts = bits * np.arange(width, dtype=np.int64)
    kmap = np.full(kmap_size, -1, np.int32)
    kmap[(levels.astype(np.int64) << shifts).sum(axis=1)] = np.arange(len(grid), dtype=np.int32)
    off = np.flatnonzero(kmap < 0)
    pos = 2 * ((off[:, None] >> shifts) & ((1 << bits) - 1)).astype(np.int32) + 1  # [m, width]
    grid_pos = 2 * levels.astype(np.int32) + 1
    counts, lists = [], []
    for s in range(0, len(off), 4096):  # bounds the [m, n_grid] distance matrix
        c, nb = _neighbour_lists(pos[s : s + 4096], grid_pos, nwant)
        counts.append(c)
        lists.append(nb)
    count = np.zeros(kmap_size, np.int64)
    count[off] = np.concatenate(counts)
    start = np.cumsum(count) - count
    levels_t = np.ascontiguousarray(levels.T.astype(np.int64))
    return GridTables(levels, bits, kmap, start, count, np.concatenate(lists), levels_t)


def best_neighbours(
    t: GridTables, codes: np.ndarray, xval: np.ndarray, weight: np.ndarray, scale: np.ndarray, values: np.ndarray
) -> np.ndarray:
    """For groups off the grid, the neighbour of their code with the least `d2 += weight[i]*diff*diff`,
    diff = scale * q - xval[i], q = values[level] (the first on ties: C's strict `<` from FLT_MAX).

    codes i64[m], xval/weight f32[m, width], scale f32[m], values f32[levels] or per group f32[m, levels]
    -> grid rows i64[m]. Every candidate of every group is scored at once, one element column at a time
    (the sum in C's order), then the minimum is taken per group."""
    count = t.count[codes]
    if not len(codes):
        return np.zeros(0, np.int64)
    first = np.cumsum(count) - count
    group = np.repeat(np.arange(len(codes)), count)  # [p]
    within = np.arange(group.size) - first[group]
    cand = t.neighbours[t.start[codes][group] + within]
    # per pair: the group's x, weight and scale (repeated, not gathered) and the candidate's q per element
    xr = np.repeat(np.ascontiguousarray(xval.T), count, axis=1)  # [width, p]
    wr = np.repeat(np.ascontiguousarray(weight.T), count, axis=1)
    sg = np.repeat(scale, count)
    if values.ndim == 1:
        qtab = values[t.levels_t]  # [width, n_grid]
        q = [qtab[i][cand] for i in range(t.width)]
    else:  # values per group (IQ1's shift): index the flattened [m, levels] table
        base = group * values.shape[1]
        q = [values.reshape(-1)[base + t.levels_t[i][cand]] for i in range(t.width)]
    d2 = None
    for i in range(t.width):
        diff = sg * q[i] - xr[i]
        term = wr[i] * diff * diff
        d2 = term + F32(0) if d2 is None else d2 + term  # C's sum starts at +0.0
    lowest = np.minimum.reduceat(d2, first)
    at = np.where(d2 == lowest[group], np.arange(d2.size), d2.size)
    return cand[np.minimum.reduceat(at, first)].astype(np.int64)
