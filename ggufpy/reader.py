"""A strict, fast GGUF reader over a memory map.

File layout (llama.cpp `docs/gguf.md`, `ggml/src/gguf.cpp`), all little-endian:

    u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    zero padding up to `general.alignment`
    tensor data (each offset relative to here, aligned)

Every length and count is checked against the bytes left in the file and the limits of `ggufpy.constants`
before it is used, so a malformed file raises `GGUFError` naming the file, the field, the value and the rule,
and never drives a large allocation. Metadata values are copies; tensor data is not: `raw()` returns a
read-only view into the map (or, with `open(path, mmap=False)`, into a copy read at open). A mapped file that
shrinks while in use would kill the process with SIGBUS on the next read of a lost page, so `raw()`,
`dequantize()` and `check()` compare the file's size and mtime with those seen at open (docs/security.md).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from .constants import (
    GGML_BLOCK_LAYOUT,
    GGML_MAX_DIMS,
    GGML_MAX_NAME,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_MAX_KV,
    GGUF_MAX_TENSORS,
    GGMLType,
    GGUFValueType,
)
from .cursor import Cursor, StringArray
from .errors import GGUFFormatError, GGUFUnsupportedError
from .splits import check_agrees, split_int, split_paths

__all__ = ["GGUFFile", "StringArray", "TensorInfo", "open"]

SUPPORTED_VERSIONS = (2, 3)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's description. `shape` is in NumPy order (GGUF stores dims innermost first)."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in its file
    nbytes: int
    part: int = 0  # index of the split file holding the data

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=object))


@dataclass(frozen=True)
class PartInfo:
    path: Path
    size: int  # bytes
    data_offset: int  # where the tensor data section starts
    n_tensors: int


def _align(offset: int, alignment: int) -> int:
    return offset + (-offset) % alignment


class _Part:
    """One parsed GGUF file: its map (or in-memory copy), metadata and tensor infos (absolute offsets)."""

    def __init__(self, path: Path, index: int = 0, mmap_data: bool = True):
        self.path = path
        self.data: np.ndarray | None = None  # the tensor data read into memory (mmap_data=False)
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            self.stat = os.fstat(self.fd)
            if self.stat.st_size == 0:
                raise GGUFFormatError(f"{path}: file is empty (a GGUF file starts with the magic 'GGUF')")
            self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(self.fd)
            raise
        try:
            self._parse(index)
            if not mmap_data:
                self._read_data()
        except BaseException:
            self.close()
            raise

    def _read_data(self) -> None:
        """Copy the tensor data into memory and drop the map: nothing read later can fault."""
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=self.data_offset)
        data = np.empty(end - self.data_offset, np.uint8)
        view, done = memoryview(data), 0
        while done < data.size:
            n = os.preadv(self.fd, [view[done:]], self.data_offset + done)
            if n <= 0:
                raise GGUFFormatError(
                    f"{self.path}: tensor data ends at byte {self.data_offset + done} while reading it into memory, "
                    f"expected {end} (the file shrank after its header was read)"
                )
            done += n
        data.flags.writeable = False
        self.data = data
        self.close()

    def check(self) -> None:
        """Raise `GGUFFormatError` if the mapped file changed since it was opened (in-memory parts never do)."""
        if self.data is not None or self.fd < 0:
            return  # in memory, or closed (views handed out earlier can no longer be checked)
        now = os.fstat(self.fd)
        if (now.st_size, now.st_mtime_ns) != (self.stat.st_size, self.stat.st_mtime_ns):
            raise GGUFFormatError(
                f"{self.path}: the file changed after it was opened (size {self.stat.st_size} -> {now.st_size} "
                "bytes, or rewritten): a mapped model file must not be modified while in use; open it again, or "
                "open it with mmap=False to read the tensors into memory"
            )

    def view(self, info: TensorInfo) -> np.ndarray:
        if self.data is not None:
            start = info.offset - self.data_offset
            return self.data[start : start + info.nbytes]
        if self.fd < 0:
            raise ValueError(f"{self.path}: the file is closed")
        self.check()
        return np.frombuffer(self.map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def _parse(self, index: int) -> None:
        c = Cursor(self.map, str(self.path))
        magic = c.u32("magic")
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(
                f"{self.path}: magic at offset 0: expected b'GGUF', found {magic.to_bytes(4, 'little')!r}"
                " (not a GGUF file)"
            )
        version = c.u32("version")
        if version & 0xFFFF == 0 and version != 0:
            raise GGUFUnsupportedError(
                f"{self.path}: version at offset 4 reads as {version:#010x}: this is a big-endian GGUF file, "
                "which ggufpy does not support (convert it to little-endian with gguf-py)"
            )
        if version not in SUPPORTED_VERSIONS:
            raise GGUFUnsupportedError(
                f"{self.path}: version at offset 4 is {version}: ggufpy reads GGUF versions 2 and 3"
                + (" (version 1 used 32-bit counts and is obsolete; re-convert the model)" if version == 1 else "")
            )
        self.version = version
        self.size = c.size
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata kv count")
        # Minimum record sizes: a kv is >= 8+1+4+1 bytes, a tensor info >= 8+1+4+8+4+8 bytes.
        if n_kv > (c.size - c.pos) // 14:
            raise c.fail("metadata kv count", f"{n_kv} key-value pairs cannot fit in a {c.size}-byte file", at=16)
        if n_tensors > (c.size - c.pos) // 33:
            raise c.fail("tensor count", f"{n_tensors} tensor infos cannot fit in a {c.size}-byte file", at=8)
        if n_kv > GGUF_MAX_KV:
            raise c.fail("metadata kv count", f"{n_kv} is above the limit of {GGUF_MAX_KV} (GGUF_MAX_KV)", at=16)
        if n_tensors > GGUF_MAX_TENSORS:
            raise c.fail(
                "tensor count", f"{n_tensors} is above the limit of {GGUF_MAX_TENSORS} (GGUF_MAX_TENSORS)", at=8
            )

        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, GGUFValueType] = {}
        for i in range(n_kv):
            at = c.pos
            key = c.string(f"metadata key #{i}")
            if not key:
                raise c.fail(f"metadata key #{i}", "key is empty", at=at)
            if key in self.metadata:
                raise c.fail(f"metadata key {key!r}", "duplicate key", at=at)
            vtype = c.value_type(f"metadata {key!r} value type")
            self.metadata[key] = c.value(vtype, f"metadata {key!r}")
            self.value_types[key] = vtype

        self.alignment = GGUF_DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            a, t = self.metadata["general.alignment"], self.value_types["general.alignment"]
            if t != GGUFValueType.UINT32 or a <= 0 or a & (a - 1):
                raise GGUFFormatError(
                    f"{self.path}: metadata 'general.alignment' is {a!r} ({t.name}): it must be a UINT32 power of two"
                )
            self.alignment = a

        infos = [self._tensor_info(c, i) for i in range(n_tensors)]
        self.data_offset = _align(c.pos, self.alignment)
        if self.data_offset > c.size and n_tensors:
            raise c.fail("tensor data", f"data section would start at {self.data_offset}, past the end of the file")
        self.tensors: dict[str, TensorInfo] = {}
        for name, dtype, shape, rel, nbytes, at in infos:
            if name in self.tensors:
                raise c.fail(f"tensor {name!r}", "duplicate tensor name", at=at)
            if rel % self.alignment:
                raise c.fail(
                    f"tensor {name!r} offset", f"{rel} is not a multiple of the alignment {self.alignment}", at
                )
            if rel + nbytes > c.size - self.data_offset:
                raise c.fail(
                    f"tensor {name!r} data",
                    f"bytes [{rel}, {rel + nbytes}) of the data section run past the end of the file "
                    f"({c.size - self.data_offset} data bytes)",
                    at=at,
                )
            self.tensors[name] = TensorInfo(name, dtype, shape, self.data_offset + rel, nbytes, index)
        by_offset = sorted(self.tensors.values(), key=lambda t: t.offset)
        for a, b in pairwise(by_offset):
            if b.offset < a.offset + a.nbytes:
                raise GGUFFormatError(f"{self.path}: tensor {b.name!r} data overlaps tensor {a.name!r}")

    def _tensor_info(self, c: Cursor, i: int) -> tuple:
        at = c.pos
        name = c.string(f"tensor #{i} name")
        field = f"tensor {name!r}"
        if not name or len(name.encode()) >= GGML_MAX_NAME:
            raise c.fail(f"tensor #{i} name", f"name must be 1..{GGML_MAX_NAME - 1} bytes, got {name!r}", at=at)
        n_dims = c.u32(f"{field} n_dims")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise c.fail(f"{field} n_dims", f"{n_dims} is outside 1..{GGML_MAX_DIMS}", at=c.pos - 4)
        ne = [c.u64(f"{field} dim {d}") for d in range(n_dims)]
        n_elements = 1
        for d in ne:
            n_elements *= d
        if 0 in ne or n_elements >= 2**63:
            raise c.fail(f"{field} dims", f"{ne} must all be >= 1 with a product below 2**63", at=at)
        type_at = c.pos
        t = c.u32(f"{field} type")
        try:
            dtype = GGMLType(t)
        except ValueError:
            raise c.fail(f"{field} type", f"unknown GGML type id {t}", at=type_at) from None
        block, type_size = GGML_BLOCK_LAYOUT[dtype]
        if ne[0] % block:
            raise c.fail(
                f"{field} dims", f"row length {ne[0]} is not a multiple of {dtype.name}'s block size {block}", at
            )
        rel = c.u64(f"{field} offset")
        return name, dtype, tuple(reversed(ne)), rel, n_elements // block * type_size, at

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.map.close()
        except BufferError:
            pass  # views handed out by raw() still point into the map; it closes when they are gone


class GGUFFile(Mapping[str, TensorInfo]):
    """An open GGUF model (one file, or every part of a split model). Use as a context manager.

    `metadata` maps keys to plain values; `tensors` maps names to `TensorInfo` in file order.
    The mapping interface (`file[name]`, `iter(file)`) is over the tensors.
    """

    def __init__(self, parts: list[_Part]):
        self._parts = parts
        first = parts[0]
        self.path = first.path
        self.version = first.version
        self.alignment = first.alignment
        self.metadata: dict[str, Any] = dict(first.metadata)
        self.value_types = dict(first.value_types)
        self.tensors: dict[str, TensorInfo] = {}
        for part in parts:
            for name, info in part.tensors.items():
                if name in self.tensors:
                    raise GGUFFormatError(f"{part.path}: tensor {name!r} also appears in an earlier split part")
                self.tensors[name] = info

    # Mapping over tensors
    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def paths(self) -> list[Path]:
        return [p.path for p in self._parts]

    @property
    def parts(self) -> list[PartInfo]:
        """One record per file of the model (a single one unless the model is split)."""
        return [PartInfo(p.path, p.size, p.data_offset, len(p.tensors)) for p in self._parts]

    @property
    def mapped(self) -> bool:
        """True when tensor data is read through the memory map, False when it was read into memory at open."""
        return self._parts[0].data is None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the map (no copy), or into the in-memory copy.

        Raises `GGUFFormatError` if the mapped file changed since it was opened (see `check`)."""
        info = self[name]
        return self._parts[info.part].view(info)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its NumPy shape (a new array)."""
        from .quants import dequantize

        info = self[name]
        return dequantize(self.raw(name), info.type, info.shape)

    def check(self) -> None:
        """Raise `GGUFFormatError` if a mapped file was truncated, grown or rewritten since it was opened.

        Reading a page that a truncation removed kills the process with SIGBUS, which Python cannot catch, so
        callers that hold `raw()` views (the model's weights) call this before using them: one `fstat` per file.
        A truncation racing a read after the check still faults; `open(path, mmap=False)` cannot fault."""
        for part in self._parts:
            part.check()

    def close(self) -> None:
        for part in self._parts:
            part.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, version={self.version}, tensors={len(self.tensors)})"


def open(path: str | os.PathLike, *, mmap: bool = True) -> GGUFFile:
    """Open a GGUF file. Opening any part of a split model opens the whole model.

    With `mmap=True` (the default) tensor data stays in the file and `raw()` views map it. With `mmap=False`
    the tensor data is read into memory at open: more memory and a slower open, but nothing read later can
    fault or change if the file is truncated or rewritten (see `GGUFFile.check`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    named = _Part(path, mmap_data=mmap)
    parts: list[_Part] = []
    try:
        count = split_int(named, "split.count", 1, 1, 0xFFFF)
        no = split_int(named, "split.no", 0, 0, count - 1)
        if count == 1:
            return GGUFFile([named])
        for i, p in enumerate(split_paths(path, no, count)):
            if i == no:
                part = named
                # re-index the named part's tensors to its place in the split
                part.tensors = {n: _reindex(t, i) for n, t in part.tensors.items()}
            else:
                if not p.is_file():
                    raise GGUFFormatError(f"{path}: split part {i + 1} of {count} is missing: {p}")
                part = _Part(p, i, mmap_data=mmap)
            parts.append(part)
            got = part.metadata.get("split.no")
            if got != i:
                raise GGUFFormatError(f"{p}: metadata 'split.no' is {got!r}, expected {i} for this part's file name")
        for part in parts[1:]:
            check_agrees(parts[0], part)
        model = GGUFFile(parts)
        expected = parts[0].metadata.get("split.tensors.count")
        if expected is not None and expected != len(model.tensors):
            raise GGUFFormatError(
                f"{path}: metadata 'split.tensors.count' is {expected} but the parts hold {len(model.tensors)} tensors"
            )
        return model
    except BaseException:
        for p in {id(p): p for p in [*parts, named]}.values():
            p.close()
        raise


def _reindex(info: TensorInfo, part: int) -> TensorInfo:
    return TensorInfo(info.name, info.type, info.shape, info.offset, info.nbytes, part)
