"""`ggufpy quantize`: llama-quantize in Python, writing the same tensors byte for byte.

    from ggufpy.workbench.quantize import quantize_model
    report = quantize_model("model.gguf", "model-Q4_K_M.gguf", "Q4_K_M", imatrix="imatrix.gguf")

Follows `llama_model_quantize_impl` (llama.cpp `src/llama-quant.cpp`): tensors in the loader's order
(`mixes.weight_order`), each type chosen by `mixes.TypePlan`; a tensor already of its new type is copied as
stored, any other is decoded to f32 (ggufpy's dequantizers are bit-identical to ggml's) and re-encoded by
`quants.rowquantizers` (ggml_quantize_chunk), with its importance-matrix row when one is given. The metadata is
the input's, in its order, with general.quantization_version and general.file_type (re)set at the end, the
split keys dropped, and llama-quantize's quantize.imatrix.* keys when an imatrix is used. The file is written
to a temporary name beside the output and renamed when complete.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..constants import GGMLType
from ..errors import GGUFError
from ..quants import quant_type
from ..quants.rowquantizers import iter_quantize_rows
from .imatrix_file import ImatrixFile
from .mixes import MixOptions, TypePlan, weight_order

__all__ = ["QuantizeReport", "TensorChoice", "quantize_model"]

GGML_QNT_VERSION = 2  # ggml.h: written as general.quantization_version
_REPLACED_KEYS = ("general.quantization_version", "general.file_type", "split.no", "split.count", "split.tensors.count")


@dataclass(frozen=True)
class TensorChoice:
    name: str
    shape: tuple[int, ...]
    old_type: GGMLType
    new_type: GGMLType
    imatrix: bool  # quantized with importance-matrix weights


@dataclass
class QuantizeReport:
    mix: str
    tensors: list[TensorChoice] = field(default_factory=list)
    n_fallback: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


# --- GGUF encoding of the few values this module writes itself ----------------------------------------------


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv_u32(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", 4, value)  # GGUFValueType.UINT32 = 4


def _kv_str(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", 8) + _string(value)  # GGUFValueType.STRING = 8


def _input_kv(path: Path) -> tuple[list[tuple[str, bytes]], int]:
    """Every key-value pair of the input file as (key, its bytes as stored), and general.alignment."""
    import gguf

    reader = gguf.GGUFReader(path)
    kvs = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        kvs.append((key, b"".join(np.asarray(p).tobytes() for p in f.parts)))
    return kvs, int(reader.alignment)


def _metadata_bytes(kvs: list[tuple[str, bytes]], ftype: int, extra: list[tuple[str, bytes]]) -> list[bytes]:
    """llama.cpp's gguf_set_kv + gguf_set_val_*: a key that is set again is removed and appended at the end."""
    out = [(k, b) for k, b in kvs if k not in _REPLACED_KEYS]
    for key, raw in [
        ("general.quantization_version", _kv_u32("general.quantization_version", GGML_QNT_VERSION)),
        ("general.file_type", _kv_u32("general.file_type", ftype)),
        *extra,
    ]:
        out = [(k, b) for k, b in out if k != key] + [(key, raw)]
    return [b for _, b in out]


def _pad(n: int, align: int) -> int:
    return (align - n % align) % align


# --- the driver --------------------------------------------------------------------------------------------


def quantize_model(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    mix: str,
    *,
    imatrix: str | os.PathLike | ImatrixFile | None = None,
    options: MixOptions | None = None,
    progress: bool | Callable[[int], None] = False,
) -> QuantizeReport:
    """Quantize the GGUF model `src` to `dst` with llama.cpp's mix `mix` (Q4_K_M, Q8_0, IQ4_XS, ...).

    `imatrix`: an importance matrix (llama.cpp's imatrix GGUF, or an `ImatrixFile`); `options`: --pure and the
    type overrides; `progress`: True for a tqdm bar (if tqdm is installed), or a callback given the number
    of elements just done. Returns what was chosen for each tensor."""
    import ggufpy

    src, dst = Path(src), Path(dst)
    im = imatrix if isinstance(imatrix, ImatrixFile) or imatrix is None else ImatrixFile.load(imatrix)
    with ggufpy.open(src) as f:
        names = weight_order(f.tensors)
        plan = TypePlan.for_model(f.metadata, names, mix, has_imatrix=im is not None, options=options)
        chosen = [(n, f.tensors[n], plan.choose(n, f.tensors[n].shape, f.tensors[n].type)) for n in names]
        report = QuantizeReport(plan.ftype.name, n_fallback=plan.n_fallback)
        kvs, align = _input_kv(src)
        extra = im.quantize_metadata(im.name) if im else []
        head = _header(chosen, _metadata_bytes(kvs, plan.ftype.value, extra), align)
        tick = _progress(progress, sum(int(np.prod(info.shape)) for _, info, _ in chosen))
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(head)
                for name, info, new_type in chosen:
                    weights = im.weights(name) if im else None
                    used = False
                    for data, with_imatrix in _tensor_bytes(f, name, info, new_type, weights, tick):
                        out.write(data)
                        report.bytes_out += len(data)
                        used |= with_imatrix
                    out.write(bytes(_pad(quant_type(new_type).row_bytes(info.shape[-1]) * _rows(info.shape), align)))
                    report.bytes_in += info.nbytes
                    report.tensors.append(TensorChoice(name, info.shape, info.type, new_type, used))
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's file is private (0600): give it an ordinary file's mode
            os.replace(tmp, dst)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        finally:
            tick(None)
    return report


def _rows(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1


def _header(chosen, kv_bytes: list[bytes], align: int) -> bytes:
    """GGUF v3 header: magic, version, counts, key-values, tensor infos (ggml dims, type, offset), padding."""
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(chosen), len(kv_bytes)), *kv_bytes]
    offset = 0
    for name, info, new_type in chosen:
        dims = info.shape[::-1]  # GGUF stores dims innermost first
        parts += [_string(name), struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, int(new_type), offset)]
        size = quant_type(new_type).row_bytes(info.shape[-1]) * _rows(info.shape)
        offset += size + _pad(size, align)
    head = b"".join(parts)
    return head + bytes(_pad(len(head), align))


def _tensor_bytes(f, name, info, new_type: GGMLType, imatrix: np.ndarray | None, tick):
    """Yields (bytes, imatrix used) for one tensor: as stored if its type does not change, else re-encoded
    from f32 one expert (3-D tensors) and one row chunk at a time."""
    if new_type == info.type:
        tick(int(np.prod(info.shape)))
        yield np.asarray(f.raw(name)).tobytes(), False
        return
    ncols = info.shape[-1]
    w = f.dequantize(name).reshape(-1, info.shape[-2], ncols)  # [expert, rows, ncols]
    n_expert = w.shape[0]
    if imatrix is not None and imatrix.size != ncols * n_expert:
        if name not in ("token_embd.weight", "per_layer_token_embd.weight"):
            raise GGUFError(f"imatrix has {imatrix.size} values for {name}, which needs {ncols * n_expert}")
        imatrix = None  # llama.cpp ignores a mismatched imatrix for the token embeddings only
    for e in range(n_expert):
        row = None if imatrix is None else imatrix[e * ncols : (e + 1) * ncols]
        done = 0
        for n_done, q in iter_quantize_rows(w[e], new_type, row):
            tick((n_done - done) * ncols)
            done = n_done
            yield q.tobytes(), row is not None


def _progress(progress, total: int):
    """A tick(n_elements) callable; tick(None) closes the bar."""
    if callable(progress):
        return lambda n: None if n is None else progress(n)
    if not progress:
        return lambda n: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda n: None
    bar = tqdm(total=total, unit="w", unit_scale=True, desc="quantize")
    return lambda n: bar.close() if n is None else bar.update(n)
