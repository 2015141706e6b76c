"""A strict, fast GGUF reader over a memory map.

File layout (llama.cpp `docs/gguf.md`, `ggml/src/gguf.cpp`), all little-endian:

    u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    zero padding up to `general.alignment`
    tensor data (each offset relative to here, aligned)

Every length and count is checked against the bytes left in the file before it is used, so a malformed
file raises `GGUFError` naming the file, the field, the value and the rule, and never drives a large
allocation. Tensor data is never copied: `raw()` returns a read-only view into the map.
"""

from __future__ import annotations

import mmap
import os
import re
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
    GGMLType,
    GGUFValueType,
)
from .cursor import Cursor
from .errors import GGUFFormatError, GGUFUnsupportedError

__all__ = ["GGUFFile", "TensorInfo", "open"]

SUPPORTED_VERSIONS = (2, 3)

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


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
    """One parsed GGUF file: its map, metadata and tensor infos (absolute offsets)."""

    def __init__(self, path: Path, index: int = 0):
        self.path = path
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFFormatError(f"{path}: file is empty (a GGUF file starts with the magic 'GGUF')")
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(index)
        except BaseException:
            self.map.close()
            raise

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

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the map (no copy)."""
        info = self[name]
        return np.frombuffer(self._parts[info.part].map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its NumPy shape (a new array)."""
        from .quants import dequantize

        info = self[name]
        return dequantize(self.raw(name), info.type, info.shape)

    def close(self) -> None:
        for part in self._parts:
            part.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, version={self.version}, tensors={len(self.tensors)})"


def _split_paths(path: Path, count: int) -> list[Path]:
    m = _SPLIT_NAME.match(path.name)
    if not m:
        raise GGUFFormatError(
            f"{path}: metadata 'split.count' is {count} but the file name does not follow "
            "'<prefix>-00001-of-0000N.gguf', so the other parts cannot be found"
        )
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def open(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file. Opening any part of a split model opens the whole model."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    first = _Part(path)
    count = first.metadata.get("split.count", 1)
    if not isinstance(count, int) or count < 1 or count > 0xFFFF:
        first.close()
        raise GGUFFormatError(f"{path}: metadata 'split.count' is {count!r}: must be an integer in 1..65535")
    if count == 1:
        return GGUFFile([first])

    parts: list[_Part] = []
    try:
        paths = _split_paths(path, count)
        for i, p in enumerate(paths):
            if p == path and i == first.metadata.get("split.no"):
                part = first
                # re-index the first-opened part's tensors to its place in the split
                part.tensors = {n: _reindex(t, i) for n, t in part.tensors.items()}
            else:
                if not p.is_file():
                    raise GGUFFormatError(f"{path}: split part {i + 1} of {count} is missing: {p}")
                part = _Part(p, i)
            no = part.metadata.get("split.no")
            if no != i:
                raise GGUFFormatError(f"{p}: metadata 'split.no' is {no!r}, expected {i} for this part's file name")
            parts.append(part)
        if first not in parts:
            first.close()
        model = GGUFFile(parts)
        expected = parts[0].metadata.get("split.tensors.count")
        if expected is not None and expected != len(model.tensors):
            raise GGUFFormatError(
                f"{path}: metadata 'split.tensors.count' is {expected} but the parts hold {len(model.tensors)} tensors"
            )
        return model
    except BaseException:
        for p in [*parts, first]:
            p.close()
        raise


def _reindex(info: TensorInfo, part: int) -> TensorInfo:
    return TensorInfo(info.name, info.type, info.shape, info.offset, info.nbytes, part)
