"""Build GGUF files byte by byte, so tests can craft every kind of malformed file.

`gguf.GGUFWriter` refuses to write most broken files; this builder writes whatever it is told.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from ggufpy.constants import GGML_BLOCK_LAYOUT, GGMLType, GGUFValueType

V = GGUFValueType


def gguf_string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


_FMT = {
    V.UINT8: "B",
    V.INT8: "b",
    V.UINT16: "H",
    V.INT16: "h",
    V.UINT32: "I",
    V.INT32: "i",
    V.FLOAT32: "f",
    V.BOOL: "B",
    V.UINT64: "Q",
    V.INT64: "q",
    V.FLOAT64: "d",
}


def encode_value(vtype: GGUFValueType, value, elem_type: GGUFValueType | None = None) -> bytes:
    if vtype == V.STRING:
        return gguf_string(value)
    if vtype == V.ARRAY:
        assert elem_type is not None
        out = struct.pack("<IQ", elem_type, len(value))
        for v in value:
            if elem_type == V.ARRAY:
                sub_type, sub_values = v
                out += encode_value(V.ARRAY, sub_values, sub_type)
            else:
                out += encode_value(elem_type, v)
        return out
    return struct.pack("<" + _FMT[vtype], value)


@dataclass
class Tensor:
    name: str
    type: int  # a GGMLType, or any id for malformed files
    ne: list[int]  # GGUF order: innermost first
    data: bytes | None = None
    offset: int | None = None  # relative to the data section; None = next aligned slot

    def nbytes(self) -> int:
        block, size = GGML_BLOCK_LAYOUT.get(self.type, (1, 1))
        n = 1
        for d in self.ne:
            n *= d
        return n // block * size


@dataclass
class GGUFBytes:
    """A GGUF file under construction. `build()` returns its bytes."""

    kv: list[tuple[str, bytes]] = field(default_factory=list)  # (key, encoded type+value)
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    alignment: int = 32
    magic: bytes = b"GGUF"
    n_tensors: int | None = None  # override the header counts
    n_kv: int | None = None
    with_data: bool = True  # False writes only the header: tensor data then lies past the end of the file

    def add(self, key: str, vtype: GGUFValueType, value, elem_type=None) -> GGUFBytes:
        self.kv.append((key, struct.pack("<I", vtype) + encode_value(vtype, value, elem_type)))
        return self

    def add_tensor(self, name, type, ne, data=None, offset=None) -> GGUFBytes:
        self.tensors.append(Tensor(name, int(type), list(ne), data, offset))
        return self

    def build(self) -> bytes:
        out = bytearray(self.magic + struct.pack("<I", self.version))
        out += struct.pack(
            "<QQ",
            len(self.tensors) if self.n_tensors is None else self.n_tensors,
            len(self.kv) if self.n_kv is None else self.n_kv,
        )
        for key, val in self.kv:
            out += gguf_string(key) + val
        offsets, pos = [], 0
        for t in self.tensors:
            off = pos if t.offset is None else t.offset
            offsets.append(off)
            pos = off + t.nbytes()
            pos += (-pos) % self.alignment
        for t, off in zip(self.tensors, offsets, strict=True):
            out += gguf_string(t.name) + struct.pack("<I", len(t.ne))
            out += b"".join(struct.pack("<Q", d) for d in t.ne)
            out += struct.pack("<IQ", t.type, off)
        out += b"\0" * ((-len(out)) % self.alignment)
        data_start = len(out)
        for t, off in zip(self.tensors, offsets, strict=True) if self.with_data else []:
            data = t.data if t.data is not None else bytes(t.nbytes())
            end = data_start + off + len(data)
            if len(out) < end:
                out += b"\0" * (end - len(out))
            out[data_start + off : end] = data
        out += b"\0" * ((-(len(out) - data_start)) % self.alignment)
        return bytes(out)


def small_valid() -> GGUFBytes:
    """A small valid file with every metadata type and a few tensors (the fuzzing seed)."""
    g = GGUFBytes()
    g.add("general.architecture", V.STRING, "llama")
    g.add("general.alignment", V.UINT32, 32)
    for vt, v in [
        (V.UINT8, 7),
        (V.INT8, -7),
        (V.UINT16, 700),
        (V.INT16, -700),
        (V.UINT32, 70000),
        (V.INT32, -70000),
        (V.FLOAT32, 1.5),
        (V.BOOL, True),
        (V.UINT64, 2**40),
        (V.INT64, -(2**40)),
        (V.FLOAT64, 2.25),
    ]:
        g.add(f"test.{vt.name.lower()}", vt, v)
    g.add("test.strings", V.ARRAY, ["a", "bé", "中"], V.STRING)
    g.add("test.ints", V.ARRAY, list(range(5)), V.INT32)
    g.add("test.nested", V.ARRAY, [(V.UINT8, [1, 2]), (V.STRING, ["x"])], V.ARRAY)
    rng = np.random.default_rng(0)
    g.add_tensor("token_embd.weight", GGMLType.F32, [8, 4], rng.standard_normal(32).astype("<f4").tobytes())
    g.add_tensor("blk.0.attn_q.weight", GGMLType.F16, [32, 2], rng.standard_normal(64).astype("<f2").tobytes())
    q8 = np.zeros((2, 34), np.uint8)
    q8[:, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    q8[:, 2:] = rng.integers(0, 256, (2, 32), dtype=np.uint8)
    g.add_tensor("output.weight", GGMLType.Q8_0, [32, 2], q8.tobytes())
    return g
