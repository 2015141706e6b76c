"""Tiny models as editable (metadata, tensors) records, written byte by byte so any value of any type fits.

`base(arch)` is a valid tiny model (from `conformance.fixtures.write_tiny_llama`, read back once);
`Crafted.write(path)` writes it with `tests.gguf_bytes.GGUFBytes`, which writes whatever it is told: a block
count stored as a string, a vocabulary of integers, a tensor of any ggml type id.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import ggufpy
from conformance.fixtures import TinyLlama, write_tiny_llama
from ggufpy.constants import GGUFValueType
from tests.gguf_bytes import GGUFBytes

V = GGUFValueType
# A value as written: (type, value) for scalars and strings, (ARRAY, values, element type) for arrays;
# nested arrays hold (element type, values) pairs, as `tests.gguf_bytes.encode_value` takes them.
Value = tuple

_DTYPE_TYPES = {
    np.dtype("<i1"): V.INT8,
    np.dtype("<u1"): V.UINT8,
    np.dtype("<i2"): V.INT16,
    np.dtype("<u2"): V.UINT16,
    np.dtype("<i4"): V.INT32,
    np.dtype("<u4"): V.UINT32,
    np.dtype("<i8"): V.INT64,
    np.dtype("<u8"): V.UINT64,
    np.dtype("<f4"): V.FLOAT32,
    np.dtype("<f8"): V.FLOAT64,
}

SMALL = TinyLlama(dim=32, hidden_dim=256, n_layers=2, n_heads=2, n_kv_heads=1, tied_output=True, logit_std=4.0)
SPECS = {
    "llama": SMALL,
    "gemma2": replace(SMALL, arch="gemma2", key_length=16, sliding_window=4, attn_softcap=5.0, final_softcap=8.0),
    "gemma3": replace(SMALL, arch="gemma3", n_layers=6, sliding_window=4, rope_theta=1e6),
}


@dataclass
class Crafted:
    """A model as editable records: metadata key -> Value, and (name, ggml type id, GGUF dims, bytes) tensors."""

    kv: dict[str, Value]
    tensors: list[tuple[str, int, list[int], bytes]] = field(default_factory=list)

    def copy(self) -> Crafted:
        return Crafted(dict(self.kv), list(self.tensors))

    def set(self, key: str, vtype: GGUFValueType, value: Any, elem: GGUFValueType | None = None) -> Crafted:
        self.kv[key] = (vtype, value) if elem is None else (vtype, value, elem)
        return self

    def drop(self, key: str) -> Crafted:
        self.kv.pop(key, None)
        return self

    def drop_tensor(self, name: str) -> Crafted:
        self.tensors = [t for t in self.tensors if t[0] != name]
        return self

    def retype(self, name: str, ggml_type: int, data: bytes) -> Crafted:
        self.tensors = [(n, ggml_type, ne, data) if n == name else (n, t, ne, d) for n, t, ne, d in self.tensors]
        return self

    def tensor(self, name: str) -> tuple[str, int, list[int], bytes]:
        return next(t for t in self.tensors if t[0] == name)

    def write(self, path: str | Path) -> Path:
        g = GGUFBytes()
        for key, value in self.kv.items():
            g.add(key, value[0], value[1], value[2] if len(value) > 2 else None)
        for name, ggml_type, ne, data in self.tensors:
            g.add_tensor(name, ggml_type, ne, data)
        path = Path(path)
        path.write_bytes(g.build())
        return path


def _value(vtype: GGUFValueType, value: Any) -> Value:
    if vtype != V.ARRAY:
        return (vtype, value)
    if isinstance(value, np.ndarray):
        return (V.ARRAY, value.tolist(), _DTYPE_TYPES[value.dtype])
    if all(isinstance(x, str) for x in value):
        return (V.ARRAY, value, V.STRING)
    if all(isinstance(x, float) for x in value):
        return (V.ARRAY, value, V.FLOAT32)
    return (V.ARRAY, value, V.INT32)


@functools.cache
def base(arch: str = "llama") -> Crafted:
    """The tiny model of `arch` ("llama", "gemma2", "gemma3") as records (F32 weights, byte-level BPE vocabulary)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_llama(Path(tmp) / "base.gguf", SPECS[arch])
        with ggufpy.open(path) as f:
            kv = {k: _value(f.value_types[k], v) for k, v in f.metadata.items()}
            tensors = [
                (name, int(info.type), list(reversed(info.shape)), bytes(f.raw(name)))
                for name, info in f.tensors.items()
            ]
    kv.pop("general.alignment", None)
    return Crafted(kv, tensors)


def spm_vocab(n: int) -> dict[str, Value]:
    """Metadata of a SentencePiece vocabulary of exactly `n` tokens (<unk> <s> </s>, 256 bytes, then pieces)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["▁", "a", "b", "▁a", "ab", "▁ab", "ba", "▁b", "aa", "bb"]
    i = 0
    while len(tokens) < n:
        tokens.append(pieces[i] if i < len(pieces) else f"▁w{i}")
        types.append(1)
        i += 1
    tokens, types = tokens[:n], types[:n]
    return {
        "tokenizer.ggml.model": (V.STRING, "llama"),
        "tokenizer.ggml.tokens": (V.ARRAY, tokens, V.STRING),
        "tokenizer.ggml.scores": (V.ARRAY, [-float(i) for i in range(n)], V.FLOAT32),
        "tokenizer.ggml.token_type": (V.ARRAY, types, V.INT32),
        "tokenizer.ggml.bos_token_id": (V.UINT32, 1),
        "tokenizer.ggml.eos_token_id": (V.UINT32, 2),
        "tokenizer.ggml.add_bos_token": (V.BOOL, True),
    }


def with_spm(model: Crafted) -> Crafted:
    """`model` with its byte-level BPE vocabulary replaced by an SPM one of the same size."""
    out = model.copy()
    for key in [k for k in out.kv if k.startswith("tokenizer.ggml.")]:
        del out.kv[key]
    out.kv.update(spm_vocab(n_vocab(model)))
    return out


def n_vocab(model: Crafted) -> int:
    """Rows of token_embd (GGUF dims are innermost first)."""
    return model.tensor("token_embd.weight")[2][1]
