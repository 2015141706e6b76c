"""Load-time repacking of a quantized weight into row-interleaved groups for the matvec kernels.

ggml stores a weight row by row, block by block. A matrix-vector product over that layout needs a horizontal
sum per block, which numba cannot vectorize well. Repacked, the element k of 64 consecutive rows ("a group")
sits in consecutive bytes, so the kernel's inner loop is one SIMD lane per row: `blk[r] += x[k] * v[k, r]`,
with no shuffles and no horizontal sums (the same idea as ggml's runtime repacks, ggml-cpu/repack.cpp).

Every weight is split into small integers `v` (one per element), a zero point `zo` shared by the type, and
per sub-block scales, so that the reference dequantization is exactly

    y = A * (v + zo) + B        A = a (block style)      or d * sc (super style)
                                B = b (block style)      or dmin_neg * mn (super style), absent for some types

for every element of a sub-block of `sub` elements. Storage families (G = groups, n = sub-blocks per row,
S = sub, one group = 64 rows):

    nib    u8[G, n, S, 32]   byte r: row r in the low nibble, row 32+r in the high nibble       (v < 16)
    nib6   u8[G, n, S, 48]   bytes 0-31 as nib (low 4 bits); byte 32+r (r < 16) holds bits 4-5 of rows
                             r, 16+r, 32+r, 48+r in its bit pairs 0-1, 2-3, 4-5, 6-7              (v < 64)
    i8     i8[G, n, S, 64]   byte r: row r                                                   (any int8)

    block style:  a, b [G, n, 64]                           (legacy 32-element types, Q8_K)
    super style:  d, dmin_neg [G, n_super, 64]; sc, mn i8[G, n, 64]   (k-quants, IQ4_XS; 256/S subs each)

The f32 scales a, b, d, dmin_neg are stored as fp16 bits (they all come from fp16 fields, so this is exact),
except Q8_K's f32 d.

Memory, in bits per weight (file -> packed): Q4_0 4.5 -> 4.5, Q4_1 5 -> 5, Q5_0 5.5 -> 6.5, Q5_1 6 -> 7,
Q8_0 8.5 -> 8.5, IQ4_NL 4.5 -> 8.5, Q2_K 2.625 -> 4.625, Q3_K 3.4375 -> 4.5625, Q4_K 4.5 -> 4.625,
Q5_K 5.5 -> 6.625, Q6_K 6.5625 -> 6.5625, IQ4_XS 4.25 -> 8.5625, Q8_K 9.125 -> 8.125, plus row padding to
a multiple of 64.

The grid, ternary, binary and FP4 formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0,
MXFP4, NVFP4, Q1_0) are not split: one value per weight would cost 2-6x their 1.1-4.5 bits. Their family
"blocks" keeps the file's blocks, rows padded to whole groups: q u8[G, 64, row bytes], no scale arrays
(`a` is empty); `rawblocks.py` decodes grid indices, signs and scales inside the kernels. 1.0x the file.
F32/F16/BF16 weights are not repacked. `pack` releases the file pages it read (`release_pages`), so the
resident size is the packed size, not the sum of both.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from dataclasses import dataclass

import numpy as np

from ..constants import GGMLType
from ..quants import quant_type
from ..quants.fields import f16_field, f32_field, i8_field, nibbles
from ..quants.iquants import KVALUES_IQ4NL
from ..quants.kquants import k4_scales_mins
from ..quants.legacy import fifth_bits
from ..weights import QuantTensor
from .rawblocks import BLOCK_TYPES

__all__ = ["GROUP", "PACKED_TYPES", "Packed", "pack", "release_pages", "trim_heap"]

GROUP = 64  # rows per group: 64 f32 lanes = four AVX-512 vectors, 32 bytes of nibbles per element
CHUNK_GROUPS = 32  # repack this many groups at a time, so temporaries stay small


@dataclass(frozen=True, eq=False)
class Packed:
    """A repacked weight of shape (rows, cols); see the module docstring for the arrays."""

    type: GGMLType
    rows: int
    cols: int
    family: str  # "nib", "nib6", "i8" or "blocks"
    style: str  # "block" or "super"
    sub: int  # elements per sub-block
    zo: int  # zero point added to every stored value
    q: np.ndarray
    a: np.ndarray  # block: a [G, n, 64]; super: d [G, n_super, 64]; fp16 bits (u16), or f32 for Q8_K
    b: np.ndarray | None = None  # block: b [G, n, 64]; super: dmin_neg [G, n_super, 64]; as `a`
    sc: np.ndarray | None = None  # super: i8[G, n, 64]
    mn: np.ndarray | None = None  # super: i8[G, n, 64]

    @property
    def groups(self) -> int:
        return self.q.shape[0]

    @property
    def n_sub(self) -> int:
        return self.cols // self.sub

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.q, self.a, self.b, self.sc, self.mn) if x is not None)

    def scales(self, name: str) -> np.ndarray | None:
        """The scale array `name` ("a" or "b") as f32 (they are stored as fp16 bits when exact)."""
        x = getattr(self, name)
        return x if x is None or x.dtype == np.float32 else x.view(np.float16).astype(np.float32)


@dataclass(frozen=True)
class _Parts:
    """A chunk of rows split into integers and scales, before interleaving (rows R, sub-blocks n)."""

    v: np.ndarray  # u8 or i8 [R, cols]
    a: np.ndarray  # f32 [R, n] (block) or d f32 [R, n_super] (super)
    b: np.ndarray | None  # f32 [R, n] (block) or dmin_neg f32 [R, n_super] (super)
    sc: np.ndarray | None = None  # i8 [R, n]
    mn: np.ndarray | None = None  # i8 [R, n]


def _nib32(blocks: np.ndarray, off: int) -> np.ndarray:
    """The 32 nibbles of a legacy block in element order: u8[N, 16] at `off` -> u8[N, 32]."""
    return nibbles(blocks[:, off : off + 16]).reshape(-1, 32)


# Each splitter: blocks u8[R, nb, type_size] -> _Parts of R rows. They mirror the reference dequantizers
# in ggufpy/quants (legacy.py, kquants.py, iquants.py) but stop before the float arithmetic.
def _split_q4_0(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    return _Parts(_nib32(b, 2).reshape(R, -1), f16_field(b, 0).reshape(R, nb), None)


def _split_q4_1(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    return _Parts(_nib32(b, 4).reshape(R, -1), f16_field(b, 0).reshape(R, nb), f16_field(b, 2).reshape(R, nb))


def _split_q5_0(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    v = _nib32(b, 6) | fifth_bits(b[:, 2:6].copy().view("<u4"))
    return _Parts(v.reshape(R, -1), f16_field(b, 0).reshape(R, nb), None)


def _split_q5_1(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    v = _nib32(b, 8) | fifth_bits(b[:, 4:8].copy().view("<u4"))
    return _Parts(v.reshape(R, -1), f16_field(b, 0).reshape(R, nb), f16_field(b, 2).reshape(R, nb))


def _split_q8(offset: int, scale=f16_field, count: int = 32):
    def split(blk):
        R, nb, _ = blk.shape
        b = blk.reshape(R * nb, -1)
        return _Parts(i8_field(b, offset, count).reshape(R, -1), scale(b, 0).reshape(R, nb), None)

    return split


def _split_iq4_nl(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    return _Parts(KVALUES_IQ4NL[_nib32(b, 2)].reshape(R, -1), f16_field(b, 0).reshape(R, nb), None)


def _split_q2_k(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    # element 128h + 32j + 16k + l = (qs[32h + 16k + l] >> 2j) & 3, in sub-block 8h + 2j + k
    v = (b[:, 16:80].reshape(-1, 2, 1, 2, 16) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1, 1)) & 3
    scales = b[:, 0:16]
    d, dmin = f16_field(b, 80).reshape(R, nb), f16_field(b, 82).reshape(R, nb)
    sc, mn = (scales & 15).view(np.int8), (scales >> 4).view(np.int8)
    return _Parts(v.reshape(R, -1), d, -dmin, sc.reshape(R, -1), mn.reshape(R, -1))


def _split_q3_k(blk):
    from ..quants.kquants import _q3_k_scales

    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    low = (b[:, 32:96].reshape(-1, 2, 1, 2, 16) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1, 1)) & 3
    bit = (4 * np.arange(2, dtype=np.uint8).reshape(2, 1) + np.arange(4, dtype=np.uint8)).reshape(1, 2, 4, 1, 1)
    high = (b[:, 0:32].reshape(-1, 1, 1, 2, 16) >> bit) & 1  # [h, j, k, l]
    v = low | (high << 2)  # q + 4 in 0..7: the high bit set means "no -4"
    sc = _q3_k_scales(b[:, 96:108])
    return _Parts(v.reshape(R, -1), f16_field(b, 108).reshape(R, nb), None, sc.reshape(R, -1))


def _split_q4_k(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    v = nibbles(b[:, 16:144].reshape(-1, 4, 32))  # [c, t, l]: element 64c + 32t + l, sub-block 2c + t
    sc, mn = k4_scales_mins(b[:, 4:16])
    d, dmin = f16_field(b, 0).reshape(R, nb), f16_field(b, 2).reshape(R, nb)
    return _Parts(v.reshape(R, -1), d, -dmin, sc.view(np.int8).reshape(R, -1), mn.view(np.int8).reshape(R, -1))


def _split_q5_k(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    qh = b[:, 16:48].reshape(-1, 1, 1, 32)
    bit = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
    v = nibbles(b[:, 48:176].reshape(-1, 4, 32)) | (((qh >> bit) & 1) << 4)
    sc, mn = k4_scales_mins(b[:, 4:16])
    d, dmin = f16_field(b, 0).reshape(R, nb), f16_field(b, 2).reshape(R, nb)
    return _Parts(v.reshape(R, -1), d, -dmin, sc.view(np.int8).reshape(R, -1), mn.view(np.int8).reshape(R, -1))


def _split_q6_k(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    ql = b[:, 0:128].reshape(-1, 2, 1, 2, 32)  # [h, 1, s, l]
    low = ((ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)) & 15).reshape(-1, 2, 4, 32)
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    v = low | (high << 4)  # q in 0..63, element 128h + 32r + l
    return _Parts(v.reshape(R, -1), f16_field(b, 208).reshape(R, nb), None, i8_field(b, 192, 16).reshape(R, -1))


def _split_iq4_xs(blk):
    R, nb, _ = blk.shape
    b = blk.reshape(R * nb, -1)
    scales_h = b[:, 2:4].copy().view("<u2")
    scales_l = nibbles(b[:, 4:8]).transpose(0, 2, 1).reshape(-1, 8)
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (scales_l | (high.astype(np.uint8) << 4)).astype(np.int8) - 32
    v = KVALUES_IQ4NL[nibbles(b[:, 8:136].reshape(-1, 8, 16)).reshape(-1, 8, 32)]
    return _Parts(v.reshape(R, -1), f16_field(b, 0).reshape(R, nb), None, ls.reshape(R, -1))


@dataclass(frozen=True)
class _Recipe:
    split: object
    family: str
    style: str
    sub: int
    zo: int


_RECIPES: dict[GGMLType, _Recipe] = {
    GGMLType.Q4_0: _Recipe(_split_q4_0, "nib", "block", 32, -8),
    GGMLType.Q4_1: _Recipe(_split_q4_1, "nib", "block", 32, 0),
    GGMLType.Q5_0: _Recipe(_split_q5_0, "nib6", "block", 32, -16),
    GGMLType.Q5_1: _Recipe(_split_q5_1, "nib6", "block", 32, 0),
    GGMLType.Q8_0: _Recipe(_split_q8(2), "i8", "block", 32, 0),
    GGMLType.Q8_1: _Recipe(_split_q8(4), "i8", "block", 32, 0),
    GGMLType.Q8_K: _Recipe(_split_q8(4, f32_field, 256), "i8", "block", 256, 0),
    GGMLType.IQ4_NL: _Recipe(_split_iq4_nl, "i8", "block", 32, 0),
    GGMLType.Q2_K: _Recipe(_split_q2_k, "nib", "super", 16, 0),
    GGMLType.Q3_K: _Recipe(_split_q3_k, "nib", "super", 16, -4),
    GGMLType.Q4_K: _Recipe(_split_q4_k, "nib", "super", 32, 0),
    GGMLType.Q5_K: _Recipe(_split_q5_k, "nib6", "super", 32, 0),
    GGMLType.Q6_K: _Recipe(_split_q6_k, "nib6", "super", 16, -32),
    GGMLType.IQ4_XS: _Recipe(_split_iq4_xs, "i8", "super", 32, 0),
}
PACKED_TYPES = frozenset(_RECIPES) | frozenset(BLOCK_TYPES)
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)  # multiplied as stored, not packed
_VALUE_BYTES = {"nib": 32, "nib6": 48, "i8": 64}
_VALUE_DTYPE = {"nib": np.uint8, "nib6": np.uint8, "i8": np.int8}


def _interleave(v: np.ndarray, family: str, sub: int) -> np.ndarray:
    """Values of whole groups, [g*64, cols] -> the family's [g, n, S, bytes] layout."""
    rows, cols = v.shape
    t = v.reshape(rows // GROUP, GROUP, cols // sub, sub).transpose(0, 2, 3, 1)  # [g, n, S, 64 rows]
    if family == "i8":
        return t.view(np.int8)
    low = t & 15
    nib = low[..., :32] | (low[..., 32:] << 4)
    if family == "nib":
        return nib
    high = t >> 4  # bits 4-5, rows r + 16j in bit pair j
    two = high[..., 0:16] | (high[..., 16:32] << 2) | (high[..., 32:48] << 4) | (high[..., 48:64] << 6)
    return np.concatenate([nib, two], axis=-1)


def _by_group(s: np.ndarray) -> np.ndarray:
    """Per-row scales [g*64, n] -> [g, n, 64]."""
    rows, n = s.shape
    return s.reshape(rows // GROUP, GROUP, n).transpose(0, 2, 1)


def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    """x [R, ...] with zero rows appended up to `rows` (padding rows of a partial group)."""
    return x if x.shape[0] == rows else np.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def pack(w: QuantTensor, release: bool = True) -> Packed:
    """Repack a 2-D weight of a type in `PACKED_TYPES`. With `release`, the file pages the weight was read
    from are returned to the OS afterwards (they stay in the page cache)."""
    if w.type in BLOCK_TYPES:
        return _pack_blocks(w, release)
    recipe = _RECIPES[w.type]
    qt = quant_type(w.type)
    rows, cols = w.shape
    G = -(-rows // GROUP)
    n_sub = cols // recipe.sub
    n_scale = n_sub if recipe.style == "block" else cols // 256
    blocks = w.raw.reshape(rows, cols // qt.block_size, qt.type_size)

    arrays: dict[str, np.ndarray] = {
        "q": np.zeros((G, n_sub, recipe.sub, _VALUE_BYTES[recipe.family]), _VALUE_DTYPE[recipe.family])
    }
    shapes = {"a": (n_scale, np.float32), "b": (n_scale, np.float32), "sc": (n_sub, np.int8), "mn": (n_sub, np.int8)}
    for g0 in range(0, G, CHUNK_GROUPS):  # a chunk at a time, so the temporaries stay small
        g1 = min(G, g0 + CHUNK_GROUPS)
        r0, r1 = g0 * GROUP, min(rows, g1 * GROUP)
        parts = recipe.split(np.asarray(blocks[r0:r1]))
        if release:  # as we go, so that the file pages and the packed copy are never resident together
            release_pages(blocks[r0:r1])
        n_rows = (g1 - g0) * GROUP
        arrays["q"][g0:g1] = _interleave(_padded(parts.v, n_rows), recipe.family, recipe.sub)
        for name, (n, dtype) in shapes.items():
            part = getattr(parts, name)
            if part is not None:
                if name not in arrays:
                    arrays[name] = np.zeros((G, n, GROUP), dtype)
                arrays[name][g0:g1] = _by_group(_padded(part, n_rows))
    _to_fp16(arrays)
    return Packed(w.type, rows, cols, recipe.family, recipe.style, recipe.sub, recipe.zo, **arrays)


def _pack_blocks(w: QuantTensor, release: bool) -> Packed:
    """The "blocks" family: the file's rows as they are, in whole groups (zero rows decode to zeros)."""
    rows, cols = w.shape
    G = -(-rows // GROUP)
    raw = w.raw.reshape(rows, -1)
    q = np.zeros((G * GROUP, raw.shape[1]), np.uint8)
    for r0 in range(0, rows, CHUNK_GROUPS * GROUP):
        r1 = min(rows, r0 + CHUNK_GROUPS * GROUP)
        q[r0:r1] = raw[r0:r1]
        if release:
            release_pages(raw[r0:r1])
    sub = BLOCK_TYPES[w.type].sub
    return Packed(
        w.type, rows, cols, "blocks", "block", sub, 0, q.reshape(G, GROUP, -1), np.zeros((G, 0, GROUP), np.uint16)
    )


def _to_fp16(arrays: dict[str, np.ndarray]) -> None:
    """Store the f32 scales `a` and `b` as fp16 bits when that is exact, which it is whenever they came from
    fp16 fields (all types but Q8_K): a quarter less memory traffic for Q4_1 than f32 scales."""
    scales = {k: arrays[k] for k in ("a", "b") if k in arrays}
    with np.errstate(over="ignore", invalid="ignore"):
        halves = {k: v.astype(np.float16) for k, v in scales.items()}
    if all(np.array_equal(h.astype(np.float32).view(np.uint32), scales[k].view(np.uint32)) for k, h in halves.items()):
        arrays.update({k: h.view(np.uint16) for k, h in halves.items()})


def _mapping(a: np.ndarray) -> mmap.mmap | None:
    """The mmap that `a` views, if any (numpy views keep their buffer in `.base`, a memoryview in `.obj`)."""
    base = a
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        if isinstance(base, memoryview):
            base = base.obj
        else:
            base = getattr(base, "base", None)
    return None


def release_pages(a: np.ndarray) -> bool:
    """Drop the resident pages of a read-only file mapping that `a` views (madvise MADV_DONTNEED).

    Only for arrays backed by an `mmap.mmap` of a file: their contents come back from the page cache on
    the next access, so this frees memory without changing any value. Anything else is left alone (for
    anonymous memory the same call would zero the data). Returns whether pages were released.
    """
    mm = _mapping(a)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or a.size == 0:
        return False
    start = a.__array_interface__["data"][0] - np.frombuffer(mm, np.uint8, count=1).__array_interface__["data"][0]
    page = mmap.PAGESIZE
    lo = start // page * page
    hi = min(len(mm), -(-(start + a.nbytes) // page) * page)
    try:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):
        return False
    return True


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):  # another C library, or not Linux
        return None


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc `malloc_trim`); False where there is no such call.

    Stacking packed weights (`NumbaBackend.linears`) frees their separate copies, tens of MB at a time. glibc
    raises its mmap threshold after such frees (up to 32 MB), so later arrays of that size come from the heap
    and freed ones stay resident there: measured on a 0.77 GB Q8_0 model, peak RSS 1117 MiB without
    trimming, 954 MiB with it."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))
