"""Bounds-checked sequential reads of GGUF header bytes: scalars, strings, and (nested) metadata arrays.

Every length and count is checked against the bytes left in the file before it is used, so a crafted
file can neither read out of bounds nor drive a large allocation; each failure names the file, the field,
the offset and the rule.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

from .constants import GGUFValueType
from .errors import GGUFFormatError

MAX_ARRAY_DEPTH = 8  # nested arrays are legal GGUF; bound the recursion a crafted file could ask for
SMALL_ARRAY = 64  # numeric arrays longer than this are returned as NumPy arrays

# Scalar value types: (struct format, NumPy dtype). BOOL is one byte that must be 0 or 1.
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, np.dtype]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Cursor:
    """Sequential reads from the header bytes, each checked against the end of the file."""

    def __init__(self, buf: mmap.mmap, path: str):
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0

    def fail(self, field: str, rule: str, at: int | None = None) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {field} at offset {self.pos if at is None else at}: {rule}")

    def need(self, n: int, field: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(field, f"needs {n} bytes but the file has {self.size - self.pos} left (truncated)")

    def u32(self, field: str) -> int:
        self.need(4, field)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, field: str) -> int:
        self.need(8, field)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, field: str) -> str:
        start = self.pos
        n = self.u64(f"{field} length")
        if n > self.size - self.pos:
            raise self.fail(field, f"string length {n} runs past the end of the file", at=start)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(field, f"string is not valid UTF-8 ({e.reason} at byte {e.start})", at=start) from None

    def scalar(self, vtype: GGUFValueType, field: str) -> Any:
        fmt, _ = _SCALARS[vtype]
        self.need(fmt.size, field)
        (v,) = fmt.unpack_from(self.buf, self.pos)
        if vtype == GGUFValueType.BOOL:
            if v > 1:
                raise self.fail(field, f"bool byte is {v}, must be 0 or 1")
            v = bool(v)
        self.pos += fmt.size
        return v

    def value_type(self, field: str) -> GGUFValueType:
        at = self.pos
        t = self.u32(field)
        try:
            return GGUFValueType(t)
        except ValueError:
            raise self.fail(field, f"unknown value type {t} (valid: 0..12)", at=at) from None

    def value(self, vtype: GGUFValueType, field: str, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(field)
        if vtype == GGUFValueType.ARRAY:
            return self.array(field, depth + 1)
        return self.scalar(vtype, field)

    def array(self, field: str, depth: int) -> Any:
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(field, f"arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
        etype = self.value_type(f"{field} element type")
        at = self.pos
        count = self.u64(f"{field} count")
        # Every element takes at least this many bytes: a count that cannot fit is refused before any allocation.
        min_size = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}.get(etype) or _SCALARS[etype][0].size
        if count > (self.size - self.pos) // min_size:
            raise self.fail(
                f"{field} count", f"{count} elements of {etype.name} cannot fit in the bytes left in the file", at=at
            )
        if etype == GGUFValueType.STRING:
            return self.string_array(count, field)
        if etype == GGUFValueType.ARRAY:
            return [self.array(f"{field}[{i}]", depth + 1) for i in range(count)]
        dtype = _SCALARS[etype][1]
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += count * dtype.itemsize
        if etype == GGUFValueType.BOOL:
            if count and arr.max() > 1:
                raise self.fail(field, "bool array holds a byte other than 0 or 1")
            arr = arr.astype(bool)
        if count <= SMALL_ARRAY:
            return arr.tolist()
        arr.flags.writeable = False
        return arr

    def string_array(self, count: int, field: str) -> list[str]:
        # The hot loop for vocabularies (262k strings): locals only, one bounds check per element.
        buf, pos, end = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        out: list[Any] = [None] * count
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                raise self.fail(f"{field}[{i}] length", "truncated")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                self.pos = pos - 8
                raise self.fail(f"{field}[{i}]", f"string length {n} runs past the end of the file")
            out[i] = buf[pos : pos + n]
            pos += n
        start, self.pos = self.pos, pos
        try:
            return [b.decode("utf-8") for b in out]
        except UnicodeDecodeError:
            bad = next(i for i, b in enumerate(out) if not _is_utf8(b))
            raise self.fail(f"{field}[{bad}]", "string is not valid UTF-8", at=start) from None


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
