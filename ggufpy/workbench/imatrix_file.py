"""llama.cpp's importance-matrix file (the GGUF that `llama-imatrix` writes and `llama-quantize --imatrix` reads).

    general.type = "imatrix", imatrix.datasets (strings), imatrix.chunk_count, imatrix.chunk_size (u32)
    <weight name>.in_sum2   f32, ggml dims [n_per_row, n_mat]   sum over tokens of x_j^2, per input column
    <weight name>.counts    f32, ggml dims [1, n_mat]           number of tokens summed (n_mat: 1, or experts)

(llama.cpp `tools/imatrix/imatrix.cpp` `save_imatrix`.) llama-quantize weighs column j of a matrix by
in_sum2[j] / counts (1 where a count is 0): `tools/quantize/quantize.cpp` `load_imatrix`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import GGUFError

__all__ = ["ImatrixEntry", "ImatrixFile"]

F32 = np.float32


@dataclass
class ImatrixEntry:
    sums: np.ndarray  # f32[n_mat, n_per_row]
    counts: np.ndarray  # f32[n_mat]

    def values(self) -> np.ndarray:
        """llama-quantize's weights: sums / count per matrix (f32 division), 1 where the count is 0: f32[n_mat * n]."""
        with np.errstate(divide="ignore", invalid="ignore"):
            v = self.sums / self.counts[:, None].astype(F32)
        return np.where(self.counts[:, None] > 0, v, F32(1)).astype(F32).reshape(-1)


@dataclass
class ImatrixFile:
    entries: dict[str, ImatrixEntry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    name: str = "imatrix.gguf"  # as llama-quantize records it in quantize.imatrix.file: the path as given

    @classmethod
    def load(cls, path: str | os.PathLike) -> ImatrixFile:
        import gguf

        given, path = os.fspath(path), Path(path)
        try:
            reader = gguf.GGUFReader(path)
        except (ValueError, OSError) as e:
            raise GGUFError(f"{path}: not an imatrix GGUF file ({e}); the legacy .dat format is not supported") from e
        fields = reader.fields

        def scalar(key, default=0):
            return int(fields[key].parts[-1][0]) if key in fields else default

        datasets = []
        if "imatrix.datasets" in fields:
            f = fields["imatrix.datasets"]
            datasets = [bytes(f.parts[i]).decode() for i in f.data]
        tensors = {t.name: np.asarray(t.data, F32) for t in reader.tensors}
        entries = {}
        for tname, data in tensors.items():
            if not tname.endswith(".in_sum2"):
                continue
            name = tname[: -len(".in_sum2")]
            if f"{name}.counts" not in tensors:
                raise GGUFError(f"{path}: {tname} has no {name}.counts tensor")
            counts = tensors[f"{name}.counts"].reshape(-1)
            entries[name] = ImatrixEntry(data.reshape(len(counts), -1).copy(), counts.copy())
        return cls(entries, datasets, scalar("imatrix.chunk_count"), scalar("imatrix.chunk_size"), given)

    def save(self, path: str | os.PathLike) -> Path:
        """Write llama.cpp's format (entries sorted by name, as llama-imatrix stores them)."""
        import gguf

        path = Path(path)
        w = gguf.GGUFWriter(str(path), arch=None)
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", list(self.datasets))
        w.add_uint32("imatrix.chunk_count", self.chunk_count)
        w.add_uint32("imatrix.chunk_size", self.chunk_size)
        for name in sorted(self.entries):
            e = self.entries[name]
            w.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(e.sums, F32))
            w.add_tensor(f"{name}.counts", np.ascontiguousarray(e.counts, F32).reshape(-1, 1))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    def weights(self, name: str) -> np.ndarray | None:
        e = self.entries.get(name)
        return None if e is None else e.values()

    def quantize_metadata(self, file_name: str) -> list[tuple[str, bytes]]:
        """The quantize.imatrix.* keys llama-quantize adds (as key-value overrides): (key, GGUF bytes)."""
        out = [("quantize.imatrix.file", _kv_str("quantize.imatrix.file", file_name[:127]))]
        if self.datasets:
            out.append(("quantize.imatrix.dataset", _kv_str("quantize.imatrix.dataset", self.datasets[0][:127])))
        out.append(("quantize.imatrix.entries_count", _kv_u32("quantize.imatrix.entries_count", len(self.entries))))
        if self.chunk_count > 0:
            out.append(("quantize.imatrix.chunks_count", _kv_u32("quantize.imatrix.chunks_count", self.chunk_count)))
        return out


def _key(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv_u32(key: str, value: int) -> bytes:
    return _key(key) + struct.pack("<II", 4, value)  # GGUFValueType.UINT32


def _kv_str(key: str, value: str) -> bytes:
    return _key(key) + struct.pack("<I", 8) + _key(value)  # GGUFValueType.STRING
