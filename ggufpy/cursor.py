"""Bounds-checked sequential reads of GGUF header bytes: scalars, strings, and (nested) metadata arrays.

Every length and count is checked against the bytes left in the file, and against the limits in
`ggufpy.constants` (`GGUF_MAX_*`), before it is used, so a crafted or sparse file can neither read out of
bounds nor drive a large allocation; each failure names the file, the field, the offset and the rule.
Strings, numeric arrays and `StringArray` blobs are copies, so the values outlive the map and never fault.
"""

from __future__ import annotations

import codecs
import mmap
import struct
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from .constants import (
    GGUF_MAX_ARRAY_DEPTH,
    GGUF_MAX_ARRAY_LEN,
    GGUF_MAX_HEADER_BYTES,
    GGUF_MAX_NESTED_ARRAYS,
    GGUF_MAX_STRING_BYTES,
    GGUFValueType,
)
from .errors import GGUFFormatError

__all__ = ["Cursor", "StringArray"]

SMALL_ARRAY = 64  # arrays longer than this are NumPy arrays (numeric) or a `StringArray` (strings); shorter: lists

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
_LEN = 8  # bytes of a string's length prefix
_CHUNK = 1 << 16  # strings per step of the offsets loop


class StringArray(Sequence[str]):
    """A long GGUF string array (a vocabulary, merges) kept compact: one blob of UTF-8 bytes, decoded on access.

    Memory is about the array's size in the file (the strings' bytes, plus a separator byte and a 4-byte offset
    per string) instead of a Python `str` per element (~50 bytes each). It behaves like the list of strings:
    `len`, indexing, slicing (a list), iteration, `tolist()`, and `==` against any sequence of strings. Every
    string was checked to be valid UTF-8 when the file was opened.
    """

    __slots__ = ("_blob", "_plain", "_starts")

    def __init__(self, blob: np.ndarray, starts: np.ndarray):
        # blob (read-only uint8): each string preceded by one NUL (where its length was); starts[i] is the NUL
        # before string i, starts[-1] == blob.size.
        self._blob = blob
        self._starts = starts
        self._plain = int(np.count_nonzero(blob == 0)) == len(starts) - 1  # no NUL inside a string

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"string array index {i} out of range for {n} strings")
        return _decode(self._blob[int(self._starts[j]) + 1 : int(self._starts[j + 1])])

    def __iter__(self) -> Iterator[str]:
        return iter(self.tolist())

    def tolist(self) -> list[str]:
        """Every string, decoded at once (one C-level decode and split when no string holds a NUL)."""
        if self._plain:
            return _decode(self._blob).split("\0")[1:]
        return [self[i] for i in range(len(self))]

    @property
    def nbytes(self) -> int:
        return self._blob.nbytes + self._starts.nbytes

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return np.array_equal(self._blob, other._blob) and np.array_equal(self._starts, other._starts)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # unhashable, like the list it stands for

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringArray([{head}, ...], {len(self)} strings)" if len(self) > 3 else f"StringArray([{head}])"


def _decode(b: np.ndarray) -> str:
    return codecs.utf_8_decode(b, "strict", True)[0]


class Cursor:
    """Sequential reads from the header bytes, each checked against the end of the file and the header limit."""

    def __init__(self, buf: mmap.mmap | bytes, path: str):
        self.buf = buf
        self.size = len(buf)
        self.limit = min(self.size, GGUF_MAX_HEADER_BYTES)  # no header read goes past this
        self.path = path
        self.pos = 0
        self.nested = 0  # inner arrays read so far (GGUF_MAX_NESTED_ARRAYS)

    def fail(self, field: str, rule: str, at: int | None = None) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {field} at offset {self.pos if at is None else at}: {rule}")

    def _past(self, n: int, field: str, what: str, at: int) -> GGUFFormatError | None:
        """The error for `n` bytes from `self.pos` that do not fit, or None: the end of the file or the limit."""
        if n > self.size - self.pos:
            return self.fail(field, f"{what} runs past the end of the file ({self.size - self.pos} bytes left)", at)
        if n > self.limit - self.pos:
            return self.fail(field, f"{what} runs past the header limit: {_HEADER_RULE}", at)
        return None

    def need(self, n: int, field: str) -> None:
        if n > self.limit - self.pos:
            if n > self.size - self.pos:
                raise self.fail(field, f"needs {n} bytes but the file has {self.size - self.pos} left (truncated)")
            raise self.fail(field, f"needs {n} bytes past the header limit: {_HEADER_RULE}")

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
        self._check_string(n, field, start)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(field, f"string is not valid UTF-8 ({e.reason} at byte {e.start})", at=start) from None

    def _check_string(self, n: int, field: str, at: int) -> None:
        if n > self.size - self.pos:
            raise self.fail(field, f"string length {n} runs past the end of the file", at=at)
        if n > GGUF_MAX_STRING_BYTES:
            raise self.fail(
                field, f"string length {n} is above the limit of {GGUF_MAX_STRING_BYTES} bytes ({_STRING_RULE})", at
            )
        err = self._past(n, field, f"string of {n} bytes", at)
        if err:
            raise err

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
        at = self.pos
        if depth > GGUF_MAX_ARRAY_DEPTH:
            raise self.fail(
                field,
                f"arrays nested deeper than {GGUF_MAX_ARRAY_DEPTH} levels are refused "
                "(an array of arrays is the most ggufpy reads; llama.cpp's gguf.cpp reads no nested arrays)",
                at=at,
            )
        if depth > 1:
            self.nested += 1
            if self.nested > GGUF_MAX_NESTED_ARRAYS:
                raise self.fail(
                    field,
                    f"more than {GGUF_MAX_NESTED_ARRAYS} arrays inside arrays in one file "
                    "(ggufpy.constants.GGUF_MAX_NESTED_ARRAYS)",
                    at=at,
                )
        etype = self.value_type(f"{field} element type")
        at = self.pos
        count = self.u64(f"{field} count")
        # Every element takes at least this many bytes: a count that cannot fit is refused before any allocation.
        min_size = {GGUFValueType.STRING: _LEN, GGUFValueType.ARRAY: 12}.get(etype) or _SCALARS[etype][0].size
        if count > (self.size - self.pos) // min_size:
            raise self.fail(
                f"{field} count", f"{count} elements of {etype.name} cannot fit in the bytes left in the file", at=at
            )
        if count > GGUF_MAX_ARRAY_LEN:
            raise self.fail(
                f"{field} count",
                f"{count} elements is above the limit of {GGUF_MAX_ARRAY_LEN} (ggufpy.constants.GGUF_MAX_ARRAY_LEN)",
                at=at,
            )
        err = self._past(count * min_size, f"{field} count", f"{count} elements of {etype.name}", at)
        if err:
            raise err
        if etype == GGUFValueType.STRING:
            if count <= SMALL_ARRAY:
                return [self.string(f"{field}[{i}]") for i in range(count)]
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

    def string_array(self, count: int, field: str) -> StringArray:
        """`count` strings as a `StringArray`. The hot loop for vocabularies (262k strings) only follows the
        length prefixes; bounds, limits and UTF-8 are then checked on the whole array at once."""
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        offsets = np.empty(count + 1, np.int32)  # where each string's prefix starts, then the end (< 2**31)
        offsets[0] = pos
        try:  # in chunks, so that the Python ints in flight stay few
            for c0 in range(0, count, _CHUNK):
                n = min(_CHUNK, count - c0)
                offsets[c0 + 1 : c0 + 1 + n] = [pos := pos + _LEN + unpack(buf, pos)[0] for _ in range(n)]
        except (struct.error, OverflowError):  # a length ran past the buffer: find which, with the exact message
            self._string_array_error(count, field)
        if pos > self.limit or (count and int(np.diff(offsets).max()) - _LEN > GGUF_MAX_STRING_BYTES):
            self._string_array_error(count, field)
        # One copy of the strings' bytes, each length prefix replaced by a single NUL: NUL is ASCII, so a string
        # cut inside a multi-byte sequence, or starting with a continuation byte, still fails the one decode below.
        raw = np.frombuffer(buf, np.uint8, count=pos - self.pos, offset=self.pos)
        offsets -= self.pos
        keep = np.ones(raw.size, bool)
        for k in range(_LEN - 1):
            keep[offsets[:-1] + k] = False
        blob = raw[keep]
        del keep
        starts = np.arange(count + 1, dtype=np.int32)  # -> where each string's NUL lands in the blob
        starts *= -(_LEN - 1)
        starts += offsets
        del offsets
        blob[starts[:-1]] = 0
        try:
            _decode(blob)
        except UnicodeDecodeError as e:
            i = int(np.searchsorted(starts, e.start, side="right")) - 1
            at = self.pos + int(starts[i]) + (_LEN - 1) * i
            raise self.fail(f"{field}[{i}]", "string is not valid UTF-8", at=at) from None
        self.pos = pos
        blob.flags.writeable = False
        return StringArray(blob, starts)

    def _string_array_error(self, count: int, field: str) -> None:
        """Walk the array with every check, and raise the first failure's exact error."""
        for i in range(count):
            start = self.pos
            n = self.u64(f"{field}[{i}] length")
            self._check_string(n, f"{field}[{i}]", start)
            self.pos += n
        raise AssertionError("a string array failed its bulk checks but not the per-string ones")  # unreachable


_HEADER_RULE = (
    f"metadata and tensor infos must lie in the first {GGUF_MAX_HEADER_BYTES} bytes "
    "(ggufpy.constants.GGUF_MAX_HEADER_BYTES)"
)
_STRING_RULE = "ggufpy.constants.GGUF_MAX_STRING_BYTES"
