"""The quant type registry: one `QuantType` record per supported ggml type, and the dispatching API.

Adding a type is one line in `_TABLE` (plus its unpacker); block sizes come from `GGML_BLOCK_LAYOUT`, the
single table of ggml's `type_traits`. Tests iterate `QUANT_TYPES`, so a new type is tested automatically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import numpy as np

from ..constants import GGML_BLOCK_LAYOUT, GGMLType
from ..errors import GGUFError, GGUFUnsupportedError
from . import floats, iqgrid, iquants, kquants, legacy, lowbit
from . import iq1_quantizers as iq1
from . import iqgrid_quantizers as iqg
from . import iquantizers as iq
from . import kquantizers as kq
from . import quantizers as ref

__all__ = ["QUANT_TYPES", "QuantType", "dequantize", "quant_type", "quantize"]

BlockFn = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class QuantType:
    """How one ggml type stores `block_size` elements in `type_size` bytes.

    `dequantize_blocks`: u8[n_blocks, type_size] -> f32[n_blocks, block_size], bit-identical to ggml.
    `quantize_blocks`:   f32[n_blocks, block_size] -> u8[n_blocks, type_size], or None if ggufpy has no
    reference quantizer for the type.
    """

    ggml_type: GGMLType
    block_size: int
    type_size: int
    dequantize_blocks: BlockFn
    quantize_blocks: BlockFn | None

    @property
    def name(self) -> str:
        return self.ggml_type.name

    def row_bytes(self, n_elements: int) -> int:
        """Bytes taken by `n_elements` (a multiple of `block_size`), like ggml's `ggml_row_size`."""
        return n_elements // self.block_size * self.type_size


# (type, dequantizer, reference quantizer or None)
_TABLE: tuple[tuple[GGMLType, BlockFn, BlockFn | None], ...] = (
    (GGMLType.F32, floats.dequantize_f32, floats.quantize_f32),
    (GGMLType.F16, floats.dequantize_f16, floats.quantize_f16),
    (GGMLType.BF16, floats.dequantize_bf16, floats.quantize_bf16),
    (GGMLType.Q4_0, legacy.dequantize_q4_0, ref.quantize_q4_0),
    (GGMLType.Q4_1, legacy.dequantize_q4_1, ref.quantize_q4_1),
    (GGMLType.Q5_0, legacy.dequantize_q5_0, ref.quantize_q5_0),
    (GGMLType.Q5_1, legacy.dequantize_q5_1, ref.quantize_q5_1),
    (GGMLType.Q8_0, legacy.dequantize_q8_0, ref.quantize_q8_0),
    (GGMLType.Q8_1, legacy.dequantize_q8_1, ref.quantize_q8_1),
    (GGMLType.Q2_K, kquants.dequantize_q2_K, kq.quantize_row_q2_K_ref),
    (GGMLType.Q3_K, kquants.dequantize_q3_K, kq.quantize_row_q3_K_ref),
    (GGMLType.Q4_K, kquants.dequantize_q4_K, kq.quantize_row_q4_K_ref),
    (GGMLType.Q5_K, kquants.dequantize_q5_K, kq.quantize_row_q5_K_ref),
    (GGMLType.Q6_K, kquants.dequantize_q6_K, kq.quantize_row_q6_K_ref),
    (GGMLType.Q8_K, kquants.dequantize_q8_K, ref.quantize_q8_K),
    (GGMLType.IQ4_NL, iquants.dequantize_iq4_nl, iq.quantize_row_iq4_nl_ref),
    (GGMLType.IQ4_XS, iquants.dequantize_iq4_xs, iq.quantize_row_iq4_xs_ref),
    (GGMLType.IQ2_XXS, iqgrid.dequantize_iq2_xxs, None),
    (GGMLType.IQ2_XS, iqgrid.dequantize_iq2_xs, None),
    (GGMLType.IQ2_S, iqgrid.dequantize_iq2_s, iqg.quantize_row_iq2_s_ref),
    (GGMLType.IQ3_XXS, iqgrid.dequantize_iq3_xxs, iqg.quantize_row_iq3_xxs_ref),
    (GGMLType.IQ3_S, iqgrid.dequantize_iq3_s, iqg.quantize_row_iq3_s_ref),
    (GGMLType.IQ1_S, iqgrid.dequantize_iq1_s, None),
    (GGMLType.IQ1_M, iqgrid.dequantize_iq1_m, iq1.quantize_iq1_m),  # no _ref in ggml: its chunk path, no imatrix
    (GGMLType.TQ1_0, lowbit.dequantize_tq1_0, ref.quantize_tq1_0),
    (GGMLType.TQ2_0, lowbit.dequantize_tq2_0, ref.quantize_tq2_0),
    (GGMLType.MXFP4, lowbit.dequantize_mxfp4, ref.quantize_mxfp4),
    (GGMLType.I8, floats.dequantize_i8, None),
    (GGMLType.I16, floats.dequantize_i16, None),
    (GGMLType.I32, floats.dequantize_i32, None),
    (GGMLType.F64, floats.dequantize_f64, None),
)
# Types newer than some `GGMLType` tables (gguf-py 0.19 / ggml ids 40, 41): registered once `constants.py`
# names them and gives their block layout; until then a file using them is refused as unsupported.
_BY_NAME: tuple[tuple[str, BlockFn, BlockFn | None], ...] = (
    ("NVFP4", lowbit.dequantize_nvfp4, ref.quantize_nvfp4),
    ("Q1_0", lowbit.dequantize_q1_0, ref.quantize_q1_0),
)
_TABLE += tuple((GGMLType[name], deq, q) for name, deq, q in _BY_NAME if name in GGMLType.__members__)

QUANT_TYPES: dict[GGMLType, QuantType] = {
    t: QuantType(t, *GGML_BLOCK_LAYOUT[t], dequantize_blocks=deq, quantize_blocks=q) for t, deq, q in _TABLE
}


def _type_name(t: GGMLType | int) -> str:
    try:
        return GGMLType(t).name
    except ValueError:
        return f"unknown ggml type id {int(t)}"


def quant_type(t: GGMLType | int) -> QuantType:
    """The registry record for `t`; `GGUFUnsupportedError` naming the type if ggufpy cannot decode it."""
    try:
        return QUANT_TYPES[GGMLType(t)]
    except (ValueError, KeyError):
        supported = ", ".join(qt.name for qt in QUANT_TYPES.values())
        raise GGUFUnsupportedError(
            f"tensor type {_type_name(t)} is not supported by ggufpy.quants; supported types: {supported}"
        ) from None


def dequantize(raw: np.ndarray, ggml_type: GGMLType | int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode the bytes of a tensor into float32 of NumPy `shape` (last dim = row, a multiple of block_size).

    `raw` is the tensor's data: an array of any dtype read as its bytes (a read-only memmap view is fine),
    or a bytes-like object.
    Raises `GGUFError` if the byte count does not match `shape`.
    """
    qt = quant_type(ggml_type)
    shape = tuple(int(s) for s in shape)
    n_elements, n_bytes = _check_shape(qt, shape)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, np.uint8)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != n_bytes:
        raise GGUFError(
            f"{qt.name} tensor of shape {shape} needs {n_bytes} bytes "
            f"({n_elements // qt.block_size} blocks of {qt.type_size} bytes), got {data.size}"
        )
    blocks = data.reshape(-1, qt.type_size)  # [n_blocks, type_size]
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN scales decode to inf/NaN, as in ggml
        return qt.dequantize_blocks(blocks).reshape(shape)


def quantize(x: np.ndarray, ggml_type: GGMLType | int) -> np.ndarray:
    """Encode `x` (last dim a multiple of block_size) with ggml's reference quantizer.

    Returns u8 of shape [..., row_bytes]. Raises `GGUFUnsupportedError` for types without a quantizer.
    """
    qt = quant_type(ggml_type)
    if qt.quantize_blocks is None:
        have = ", ".join(q.name for q in QUANT_TYPES.values() if q.quantize_blocks is not None)
        raise GGUFUnsupportedError(f"no reference quantizer for {qt.name}; quantizers exist for: {have}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    shape = x.shape if x.ndim else (1,)
    _check_shape(qt, shape)
    blocks = x.reshape(-1, qt.block_size)  # [n_blocks, block_size]
    return qt.quantize_blocks(blocks).reshape(*shape[:-1], qt.row_bytes(shape[-1]))


def _check_shape(qt: QuantType, shape: tuple[int, ...]) -> tuple[int, int]:
    """(n_elements, n_bytes) of a tensor of this type and NumPy shape; GGUFError if rows do not fit blocks."""
    if any(s < 0 for s in shape):
        raise GGUFError(f"{qt.name} tensor shape {shape} has a negative dimension")
    row = shape[-1] if shape else 1
    if row % qt.block_size:
        raise GGUFError(
            f"{qt.name} tensor shape {shape}: row length {row} is not a multiple of the block size {qt.block_size}"
        )
    n_elements = prod(shape)
    return n_elements, n_elements // qt.block_size * qt.type_size
