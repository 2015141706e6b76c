"""`ggml_quantize_chunk` in NumPy: one registry, ggml type -> row quantizer, with an optional importance matrix.

    from ggufpy.quants.rowquantizers import quantize_rows
    raw = quantize_rows(w, GGMLType.Q4_K, imatrix=im)    # w f32[rows, n_per_row], im f32[n_per_row] | None

This is what llama-quantize calls for every tensor (llama.cpp `ggml/src/ggml.c` `ggml_quantize_chunk`). Without
an importance matrix most types run their `quantize_row_*_ref` (the block quantizers of the registry); IQ4_NL and
IQ4_XS run their searches with ntry = 7. With one, Q4_0/Q4_1/Q5_0/Q5_1, the k-quants and IQ4 run their
`quantize_row_*_impl` weighted by it (per input column, shared by all rows); Q8_0, the float types, TQ1_0/TQ2_0,
MXFP4, NVFP4 and Q1_0 ignore it. The IQ1/IQ2/IQ3 grid types run their searches (`iqgrid_quantizers`,
`iq1_quantizers`); IQ2_XXS, IQ2_XS and IQ1_S need an importance matrix, as in ggml. Rows are processed
`CHUNK_ELEMENTS` at a time to bound memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ..constants import GGMLType
from ..errors import GGUFError, GGUFUnsupportedError
from . import iquantizers, kquantizers
from .fields import as_bytes
from .iqgrid_quantizers import IQGRID_ROW_QUANTIZERS
from .kquantizer_search import make_qkx3_quants, make_qx_quants, seqsum
from .kquantizers import fp16
from .registry import QUANT_TYPES

__all__ = ["CHUNK_ELEMENTS", "ROW_QUANTIZERS", "iter_quantize_rows", "quantize_rows"]

F32 = np.float32
CHUNK_ELEMENTS = 1 << 16  # the searches' many temporaries stay in cache (measured: 1.5-2x faster than 1M)
# rows f32[r, n_per_row], imatrix f32[n_per_row] | None -> u8[r, row_bytes]
RowQuantizer = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]
BlockFn = Callable[[np.ndarray], np.ndarray]


def _legacy_weights(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """qw * sqrtf(sigma2 + x^2), sigma2 = sum x^2 / n_per_row over the whole row: f32[r * nb, 32]."""
    sigma2 = seqsum(rows * rows) / F32(rows.shape[1])
    return (imatrix[None, :] * np.sqrt(sigma2[:, None] + rows * rows)).reshape(-1, 32)


def _q4_0_imatrix(rows, imatrix):  # `quantize_row_q4_0_impl`: d from make_qx_quants(32, 8), no requantization
    d, L = make_qx_quants(rows.reshape(-1, 32), 8, _legacy_weights(rows, imatrix))
    return _with_d(d, L[:, :16] | (L[:, 16:] << 4), n_rows=rows.shape[0])


def _q5_0_imatrix(rows, imatrix):  # `quantize_row_q5_0_impl`
    d, L = make_qx_quants(rows.reshape(-1, 32), 16, _legacy_weights(rows, imatrix))
    return _with_d(d, _q5_bits(L), n_rows=rows.shape[0])


def _q4_1_imatrix(rows, imatrix):  # `quantize_row_q4_1_impl`: make_qkx3_quants(32, 15), m = -min
    d, the_min, L = make_qkx3_quants(rows.reshape(-1, 32), _legacy_weights(rows, imatrix), 15, -0.9, 0.05, 36)
    return _with_d(d, fp16(-the_min)[:, None], L[:, :16] | (L[:, 16:] << 4), n_rows=rows.shape[0])


def _q5_1_imatrix(rows, imatrix):  # `quantize_row_q5_1_impl`
    d, the_min, L = make_qkx3_quants(rows.reshape(-1, 32), _legacy_weights(rows, imatrix), 31, -0.9, 0.05, 36)
    return _with_d(d, fp16(-the_min)[:, None], _q5_bits(L), n_rows=rows.shape[0])


def _q5_bits(L: np.ndarray) -> np.ndarray:
    """Codes 0..31 -> qh (bit j = bit 4 of code j, as a little-endian u32) then the nibbles: u8[n, 20]."""
    qh = np.packbits((L >> 4) & 1, axis=1, bitorder="little")
    low = L & 0x0F
    return np.concatenate([qh, low[:, :16] | (low[:, 16:] << 4)], axis=1)


def _with_d(d: np.ndarray, *fields: np.ndarray, n_rows: int) -> np.ndarray:
    """Blocks {d fp16, fields...} as u8[n_rows, row_bytes]."""
    return as_bytes(fp16(d), *fields).reshape(n_rows, -1)


def _blocks(ref: BlockFn, weighted: Callable[[np.ndarray, np.ndarray | None], np.ndarray] | None, size: int):
    """A row quantizer from block quantizers: `ref` without an imatrix, `weighted(blocks, qw)` with one
    (qw = each block's slice of the imatrix); weighted=None: the imatrix is ignored, as ggml does."""

    def run(rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        n_rows = rows.shape[0]
        blocks = rows.reshape(-1, size)  # [rows * nb, size]
        if imatrix is None or weighted is None:
            return ref(blocks).reshape(n_rows, -1)
        qw = np.broadcast_to(imatrix.reshape(1, -1, size), (n_rows, rows.shape[1] // size, size))
        return weighted(blocks, qw.reshape(-1, size)).reshape(n_rows, -1)

    return run


def _legacy(t: GGMLType, weighted: RowQuantizer) -> RowQuantizer:
    ref = QUANT_TYPES[t].quantize_blocks

    def run(rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        return ref(rows.reshape(-1, 32)).reshape(rows.shape[0], -1) if imatrix is None else weighted(rows, imatrix)

    return run


def _ignoring_imatrix(t: GGMLType) -> RowQuantizer:
    qt = QUANT_TYPES[t]
    return _blocks(qt.quantize_blocks, None, qt.block_size)


_K = kquantizers
ROW_QUANTIZERS: dict[GGMLType, RowQuantizer] = {
    GGMLType.Q4_0: _legacy(GGMLType.Q4_0, _q4_0_imatrix),
    GGMLType.Q4_1: _legacy(GGMLType.Q4_1, _q4_1_imatrix),
    GGMLType.Q5_0: _legacy(GGMLType.Q5_0, _q5_0_imatrix),
    GGMLType.Q5_1: _legacy(GGMLType.Q5_1, _q5_1_imatrix),
    GGMLType.Q2_K: _blocks(_K.quantize_row_q2_K_ref, _K.quantize_q2_K_imatrix, 256),
    GGMLType.Q3_K: _blocks(_K.quantize_row_q3_K_ref, _K.quantize_q3_K_imatrix, 256),
    GGMLType.Q4_K: _blocks(_K.quantize_row_q4_K_ref, _K.quantize_q4_K_imatrix, 256),
    GGMLType.Q5_K: _blocks(_K.quantize_row_q5_K_ref, _K.quantize_q5_K_imatrix, 256),
    GGMLType.Q6_K: _blocks(_K.quantize_row_q6_K_ref, _K.quantize_q6_K_imatrix, 256),
    GGMLType.IQ4_NL: _blocks(iquantizers.quantize_iq4_nl, iquantizers.quantize_iq4_nl, 32),
    GGMLType.IQ4_XS: _blocks(iquantizers.quantize_iq4_xs, iquantizers.quantize_iq4_xs, 256),
}
_IGNORING = ("F32", "F16", "BF16", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0")
ROW_QUANTIZERS |= {
    GGMLType[name]: _ignoring_imatrix(GGMLType[name])
    for name in _IGNORING
    if name in GGMLType.__members__ and GGMLType[name] in QUANT_TYPES
}
ROW_QUANTIZERS |= IQGRID_ROW_QUANTIZERS


def _check(x: np.ndarray, t: GGMLType, imatrix: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    if t not in ROW_QUANTIZERS:
        have = ", ".join(q.name for q in ROW_QUANTIZERS)
        raise GGUFUnsupportedError(f"ggufpy cannot quantize to {t.name}; row quantizers exist for: {have}")
    x = np.ascontiguousarray(x, dtype=F32)
    x = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    block = QUANT_TYPES[t].block_size
    if x.shape[1] % block:
        raise GGUFError(f"{t.name}: row length {x.shape[1]} is not a multiple of the block size {block}")
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=F32).reshape(-1)
        if imatrix.size != x.shape[1]:
            raise GGUFError(f"imatrix has {imatrix.size} values for rows of {x.shape[1]} ({t.name})")
    return x, imatrix


def iter_quantize_rows(
    x: np.ndarray, ggml_type: GGMLType | int, imatrix: np.ndarray | None = None
) -> Iterator[tuple[int, np.ndarray]]:
    """Quantize row chunks of about CHUNK_ELEMENTS: yields (rows done so far, u8[chunk_rows, row_bytes])."""
    t = GGMLType(ggml_type)
    rows, imatrix = _check(x, t, imatrix)
    step = max(1, CHUNK_ELEMENTS // rows.shape[1])
    fn = ROW_QUANTIZERS[t]
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step]
        yield start + chunk.shape[0], fn(chunk, imatrix)


def quantize_rows(x: np.ndarray, ggml_type: GGMLType | int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml_quantize_chunk over all rows of `x` (f32[..., n_per_row]): u8[..., row_bytes]."""
    t = GGMLType(ggml_type)
    shape = np.shape(x)
    parts = [q for _, q in iter_quantize_rows(x, t, imatrix)]
    out = np.concatenate(parts, axis=0) if parts else np.zeros((0, QUANT_TYPES[t].row_bytes(shape[-1])), np.uint8)
    return out.reshape(*shape[:-1], out.shape[-1])
