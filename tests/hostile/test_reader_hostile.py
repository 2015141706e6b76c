"""Hostile GGUF files against the reader: each row a crafted input and the exact error it must give.

Rows build their files with `tests.gguf_bytes` (every malformed layout can be written) or as sparse files: a
few KB on disk with a large apparent size, the cheap way to claim gigabytes. Then random mutations of a seed
holding every value kind (long string and numeric arrays, nested arrays, tensors of three types) must give a
clean open or a `GGUFError`, never another exception, and whatever opens must be readable in full.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ggufpy
from ggufpy.constants import (
    GGUF_MAX_ARRAY_LEN,
    GGUF_MAX_HEADER_BYTES,
    GGUF_MAX_KV,
    GGUF_MAX_NESTED_ARRAYS,
    GGUF_MAX_STRING_BYTES,
    GGUF_MAX_TENSORS,
    GGMLType,
)
from ggufpy.errors import GGUFError, GGUFFormatError, GGUFUnsupportedError
from ggufpy.reader import StringArray
from tests.gguf_bytes import GGUFBytes, V, gguf_string, small_valid

MiB = 2**20
SPARSE = 4 * 2**30  # apparent size of the sparse files: 4 GiB


@dataclass
class Sparse:
    """A file of `size` bytes that holds only `pieces` ({offset: bytes}); the rest is a hole reading as zeros."""

    size: int
    pieces: dict[int, bytes] = field(default_factory=dict)

    def write(self, path: Path) -> None:
        with path.open("wb") as f:
            for offset, data in sorted(self.pieces.items()):
                f.seek(offset)
                f.write(data)
        os.truncate(path, self.size)


Files = dict[str, bytes | Sparse]  # file name -> contents; the row opens its first file


def head(n_kv: int, n_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def array(etype: int, count: int, body: bytes = b"") -> bytes:
    return struct.pack("<IQ", etype, count) + body


def strings(*items: bytes) -> bytes:
    return b"".join(struct.pack("<Q", len(s)) + s for s in items)


def one(key: str, vtype: int, payload: bytes) -> Files:
    return {"m.gguf": head(1) + kv(key, vtype, payload)}


def sparse_kv(key: str, vtype: int, payload: bytes, more: dict[int, bytes] | None = None) -> Files:
    first = head(1) + kv(key, vtype, payload)
    return {"m.gguf": Sparse(SPARSE, {0: first, **(more or {})})}


def sparse_strings(key: str, lengths: list[int], count: int) -> Files:
    """A string array of `count` strings whose first ones have the given (large) lengths; the rest are empty."""
    first = head(1) + kv(key, V.ARRAY, array(V.STRING, count))
    pieces, pos = {0: first}, len(first)
    for n in lengths:
        pieces[pos] = struct.pack("<Q", n)
        pos += 8 + n
    return {"m.gguf": Sparse(SPARSE, pieces)}


def split(count_in_name: int, edit: Callable[[int, GGUFBytes], None] | None = None, count: int = 2) -> Files:
    files: Files = {}
    for i in range(count):
        g = GGUFBytes()
        if i == 0:
            g.add("general.architecture", V.STRING, "llama")
        g.add("split.no", V.UINT16, i).add("split.count", V.UINT16, count)
        g.add_tensor(f"blk.{i}.ffn_up.weight", GGMLType.F32, [32, 1])
        if edit:
            edit(i, g)
        files[f"m-{i + 1:05d}-of-{count_in_name:05d}.gguf"] = g.build()
    return files


def _arch_of_part_2(i: int, g: GGUFBytes) -> None:
    if i == 1:
        g.add("general.architecture", V.STRING, "gemma3")


def _two_u64_arrays_past_the_header_limit() -> Files:
    # each 128 MiB array is within GGUF_MAX_ARRAY_LEN; the second ends past GGUF_MAX_HEADER_BYTES
    first = head(2) + kv("a", V.ARRAY, array(V.UINT64, 2**24))
    return {"m.gguf": Sparse(SPARSE, {0: first, len(first) + 8 * 2**24: kv("b", V.ARRAY, array(V.UINT64, 2**24))})}


F = GGUFFormatError
U = GGUFUnsupportedError
BIG = GGUF_MAX_STRING_BYTES + 1

# (id, files, exception class, fragment of the message). Every message also names the file.
ROWS: list[tuple[str, Files, type[GGUFError], str]] = [
    # header
    ("empty file", {"m.gguf": b""}, F, "file is empty"),
    ("not gguf", {"m.gguf": b"\x7fELF" + bytes(60)}, F, "expected b'GGUF', found b'\\x7fELF'"),
    ("version 4", {"m.gguf": head(0, version=4)}, U, "version at offset 4 is 4: ggufpy reads GGUF versions 2 and 3"),
    ("big endian", {"m.gguf": b"GGUF" + struct.pack(">IQQ", 3, 0, 0)}, U, "this is a big-endian GGUF file"),
    ("kv count cannot fit", {"m.gguf": head(10**6)}, F, "metadata kv count at offset 16: 1000000 key-value pairs"),
    (
        "kv count above the limit",
        {"m.gguf": head(GGUF_MAX_KV + 1) + bytes(14 * (GGUF_MAX_KV + 1))},
        F,
        f"metadata kv count at offset 16: {GGUF_MAX_KV + 1} is above the limit of {GGUF_MAX_KV}",
    ),
    (
        "tensor count above the limit",
        {"m.gguf": head(0, GGUF_MAX_TENSORS + 1) + bytes(33 * (GGUF_MAX_TENSORS + 1))},
        F,
        f"tensor count at offset 8: {GGUF_MAX_TENSORS + 1} is above the limit of {GGUF_MAX_TENSORS}",
    ),
    # strings
    ("key past the end", {"m.gguf": head(1) + struct.pack("<Q", 100) + b"k" * 20}, F,
     "metadata key #0 at offset 24: string length 100 runs past the end"),
    ("key of 64 MiB + 1 (sparse)", {"m.gguf": Sparse(SPARSE, {0: head(1) + struct.pack("<Q", BIG)})}, F,
     f"metadata key #0 at offset 24: string length {BIG} is above the limit of {GGUF_MAX_STRING_BYTES} bytes"),
    ("value of ~4 GiB (sparse)", sparse_kv("general.name", V.STRING, struct.pack("<Q", SPARSE - 64)), F,
     f"metadata 'general.name' at offset 48: string length {SPARSE - 64} is above the limit"),
    ("invalid utf-8 value", one("k", V.STRING, strings(b"ok\xff")), F, "metadata 'k' at offset 37: string is not"),
    # arrays
    ("u8 array of ~4 GiB (sparse)", sparse_kv("k", V.ARRAY, array(V.UINT8, SPARSE - 64)), F,
     f"metadata 'k' count at offset 41: {SPARSE - 64} elements is above the limit of {GGUF_MAX_ARRAY_LEN}"),
    ("array count one above the limit (sparse)", sparse_kv("k", V.ARRAY, array(V.UINT8, GGUF_MAX_ARRAY_LEN + 1)), F,
     f"{GGUF_MAX_ARRAY_LEN + 1} elements is above the limit of {GGUF_MAX_ARRAY_LEN}"),
    ("arrays past the header limit (sparse)", _two_u64_arrays_past_the_header_limit(), F,
     f"metadata 'b' count at offset {66 + 8 * 2**24}: 16777216 elements of UINT64 runs past the header limit: "
     f"metadata and tensor infos must lie in the first {GGUF_MAX_HEADER_BYTES} bytes"),
    ("array count cannot fit", one("k", V.ARRAY, array(V.UINT32, 2**40)), F, "1099511627776 elements of UINT32 cannot"),
    ("bool array byte 2", one("k", V.ARRAY, array(V.BOOL, 3, b"\x00\x01\x02")), F, "bool array holds a byte other"),
    ("unknown element type", one("k", V.ARRAY, array(13, 1)), F, "metadata 'k' element type at offset 37: unknown"),
    # string arrays: short ones (lists) and long ones (StringArray) give the same errors
    ("short string array: element past the end",
     one("k", V.ARRAY, array(V.STRING, 2, strings(b"abcdefghi") + b"\x09")), F,
     "metadata 'k'[1] length at offset 66: needs 8 bytes but the file has 1 left (truncated)"),
    ("long string array: element past the end",
     one("k", V.ARRAY, array(V.STRING, 70, strings(*[b"a"] * 69) + struct.pack("<Q", 5) + b"ab")), F,
     "metadata 'k'[69] at offset 670: string length 5 runs past the end of the file"),
    ("long string array: element of 64 MiB + 1 (sparse)", sparse_strings("k", [BIG], 100), F,
     f"metadata 'k'[0] at offset 49: string length {BIG} is above the limit of {GGUF_MAX_STRING_BYTES}"),
    ("short string array past the header limit (sparse)", sparse_strings("k", [60 * MiB] * 5, 5), F,
     f"metadata 'k'[4] at offset {49 + 4 * (8 + 60 * MiB)}: string of {60 * MiB} bytes runs past the header limit"),
    ("long string array past the header limit (sparse)", sparse_strings("k", [60 * MiB] * 5, 100), F,
     f"metadata 'k'[4] at offset {49 + 4 * (8 + 60 * MiB)}: string of {60 * MiB} bytes runs past the header limit"),
    ("long string array: invalid utf-8 at 65",
     one("k", V.ARRAY, array(V.STRING, 66, strings(*[b"tok"] * 65, b"\xc0\x80"))), F,
     "metadata 'k'[65] at offset 764: string is not valid UTF-8"),
    ("long string array: 'é' split across two strings",
     one("k", V.ARRAY, array(V.STRING, 66, strings(*[b"tok"] * 64, b"\xc3", b"\xa9"))), F,
     "metadata 'k'[64] at offset 753: string is not valid UTF-8"),
    # nested arrays
    ("array of arrays of arrays", one("k", V.ARRAY, array(V.ARRAY, 1, array(V.ARRAY, 1, array(V.UINT8, 0)))), F,
     "metadata 'k'[0][0] at offset 61: arrays nested deeper than 2 levels are refused"),
    ("65,537 nested arrays",
     one("k", V.ARRAY, array(V.ARRAY, GGUF_MAX_NESTED_ARRAYS + 1, array(V.UINT8, 0) * (GGUF_MAX_NESTED_ARRAYS + 1))),
     F, f"metadata 'k'[65536] at offset 786481: more than {GGUF_MAX_NESTED_ARRAYS} arrays inside arrays"),
    # keys the reader itself interprets
    ("alignment 0", one("general.alignment", V.UINT32, struct.pack("<I", 0)), F,
     "metadata 'general.alignment' is 0 (UINT32): it must be a UINT32 power of two"),
    ("split.count above 65535", one("split.count", V.UINT32, struct.pack("<I", 70000)), F,
     "metadata 'split.count' is 70000: must be an integer in 1..65535"),
    ("split.no without split.count", one("split.no", V.UINT16, struct.pack("<H", 1)), F,
     "metadata 'split.no' is 1: must be an integer in 0..0"),
    # tensor infos
    ("tensor name of 64 bytes", {"m.gguf": GGUFBytes().add_tensor("x" * 64, GGMLType.F32, [4]).build()}, F,
     "name must be 1..63 bytes"),
    ("tensor dims overflow", {"m.gguf": GGUFBytes().add_tensor("t", GGMLType.I8, [2**32, 2**32], b"").build()}, F,
     "must all be >= 1 with a product below 2**63"),
    ("tensor past the end", {"m.gguf": GGUFBytes(with_data=False).add_tensor("t", GGMLType.F32, [1024]).build()}, F,
     "tensor 't' data at offset 24: bytes [0, 4096) of the data section run past the end of the file"),
    # split models
    ("split: name says 3 parts, metadata 2", split(count_in_name=3), F,
     "the file name says part 1 of 3 but the metadata says part 1 of 2"),
    ("split: parts of different models", split(count_in_name=2, edit=_arch_of_part_2), F,
     "metadata 'general.architecture' is 'gemma3' (STRING) but the first part m-00001-of-00002.gguf has 'llama'"),
]  # fmt: skip


@pytest.mark.parametrize("files,error,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_hostile_file_gives_its_exact_error(tmp_path, files, error, fragment):
    paths = []
    for name, contents in files.items():
        path = tmp_path / name
        contents.write(path) if isinstance(contents, Sparse) else path.write_bytes(contents)
        paths.append(path)
    with pytest.raises(GGUFError) as info:
        ggufpy.open(paths[0]).close()
    assert type(info.value) is error
    message = str(info.value)
    assert message.startswith(f"{tmp_path}/m"), message
    assert fragment in message, message


# --- fuzzing: random mutations of a seed that holds every kind of value ----------------------------------------


def _seed() -> bytes:
    g = small_valid()
    g.add("test.vocab", V.ARRAY, [f"tok{i}" if i % 7 else "é中" for i in range(100)], V.STRING)
    g.add("test.scores", V.ARRAY, [i / 8 for i in range(100)], V.FLOAT32)
    g.add("test.flags", V.ARRAY, [i % 2 for i in range(80)], V.BOOL)
    g.add("test.rows", V.ARRAY, [(V.INT32, list(range(70))), (V.STRING, ["a"] * 65)], V.ARRAY)
    return g.build()


SEED = _seed()


def _read_everything(path: Path) -> None:
    """Open, then touch every value and every tensor byte: only `GGUFError` may come out."""
    try:
        with ggufpy.open(path) as f:
            for value in f.metadata.values():
                items = value.tolist() if isinstance(value, (StringArray, np.ndarray)) else value
                repr(items)
            for name in f.tensors:
                f.raw(name).sum()
    except GGUFError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(st.tuples(st.integers(0, len(SEED) - 1), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4)
)
def test_fuzz_mutated_seed_gives_only_gguf_error(tmp_path, edits):
    b = bytearray(SEED)
    for pos, data in edits:
        b[pos : pos + len(data)] = data[: len(b) - pos]
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(b))
    _read_everything(path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.one_of(st.text(max_size=6), st.binary(max_size=6)), min_size=0, max_size=150))
def test_fuzz_string_arrays_read_like_python_decodes_them(tmp_path, items):
    """Any strings, valid UTF-8 or not: the array reads as Python decodes each alone, or the first bad one is named."""
    raw = [s.encode() if isinstance(s, str) else s for s in items]
    path = tmp_path / "s.gguf"
    path.write_bytes(head(1) + kv("k", V.ARRAY, array(V.STRING, len(raw), strings(*raw))))
    expected, bad = [], None
    for i, s in enumerate(raw):
        try:
            expected.append(s.decode("utf-8"))
        except UnicodeDecodeError:
            bad = i
            break
    if bad is None:
        with ggufpy.open(path) as f:
            assert f.metadata["k"] == expected and len(f.metadata["k"]) == len(expected)
            if expected:
                assert f.metadata["k"][len(expected) - 1] == expected[-1]
    else:
        with pytest.raises(GGUFFormatError, match=rf"metadata 'k'\[{bad}\] .*not valid UTF-8"):
            ggufpy.open(path)
