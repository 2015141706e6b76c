"""llama-imatrix's collector run inside llama.cpp: `IMatrixCollector::collect_imatrix` (tools/imatrix/imatrix.cpp)
ported to Python and installed as the scheduler's eval callback of a `conformance.llamacpp.LlamaCpp`.

llama-cpp-python has no imatrix tool, but the callback sees every graph node with its sources: as the C++ one,
it asks for every GGML_OP_MUL_MAT_ID and for each GGML_OP_MUL_MAT of at least 16 F32 rows by a `blk.*` weight
(or `output.weight` with process_output), then adds x^2 of the product's input rows per column:

- MUL_MAT: all rows of src1 into the weight's one row of sums, count += rows;
- MUL_MAT_ID (src0 the stacked experts [n_in, n_out, n_expert], src1 [n_in, 1 or n_used, n_tokens], ids
  [n_used, n_tokens]): for each expert, the src1 row (idx % src1.ne[1], token) of every (slot idx, token) whose
  id is that expert, into the expert's row, count[expert] += 1 per such row.

Sums are kept in double here (llama.cpp's are f32): this is the rule, compared with ggufpy's f64 sums.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .llamacpp import GGMLTensor, LlamaCpp, _ggml_base, tensor_to_numpy

MIN_ROWS = 16
F32 = 0  # GGML_TYPE_F32


@functools.cache
def op_ids() -> dict[str, int]:
    """ggml's enum ggml_op values by name, as this build numbers them (`ggml_op_name`)."""
    lib = _ggml_base()
    lib.ggml_op_name.restype, lib.ggml_op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    names = {}
    for i in range(128):
        name = lib.ggml_op_name(i)
        if name:
            names[name.decode()] = i
        if name == b"COUNT" or name is None:
            break
    return names


def _weight_name(raw: str) -> str:
    # imatrix.cpp filter_tensor_name: "CUDA0#blk.0.attn_k.weight#0" -> "blk.0.attn_k.weight"
    parts = raw.split("#")
    return parts[1] if len(parts) > 1 else raw


class ImatrixCollector(LlamaCpp):
    """A llama.cpp context whose eval callback collects the imatrix sums: `.sums[name]` f64 (n_mat, n_in) and
    `.counts[name]` int (n_mat,), over every `run` since creation."""

    def __init__(self, path, process_output: bool = False, **kw):
        ops = op_ids()
        self._mul_mat, self._mul_mat_id = ops["MUL_MAT"], ops["MUL_MAT_ID"]
        self.process_output = process_output
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}
        super().__init__(path, **kw)

    def _eval_callback(self, t_ptr, ask, user_data) -> bool:
        t = GGMLTensor.from_address(t_ptr)
        if t.op not in (self._mul_mat, self._mul_mat_id):
            return not ask
        src0, src1 = (GGMLTensor.from_address(t.src[i]) for i in (0, 1))
        name = _weight_name(src0.name.decode(errors="replace"))
        if ask:
            if t.op == self._mul_mat_id:
                return True
            wanted = name.startswith("blk.") or (self.process_output and name == "output.weight")
            return src1.ne[1] >= MIN_ROWS and src1.type == F32 and wanted
        x = tensor_to_numpy(src1).astype(np.float64)  # (ne3, ne2, ne1, n_in)
        if t.op == self._mul_mat_id:
            ids = tensor_to_numpy(GGMLTensor.from_address(t.src[2]))  # (1, 1, n_tokens, n_used) int32
            n_expert = int(src0.ne[2])
            x, ids = x.reshape(-1, int(src1.ne[1]), x.shape[-1]), ids.reshape(-1, ids.shape[-1])  # (T, ne1, n_in)
            sums, counts = self._entry(name, n_expert, x.shape[-1])
            for token in range(ids.shape[0]):
                for idx in range(ids.shape[1]):
                    e = int(ids[token, idx])
                    row = x[token, idx % x.shape[1]]
                    sums[e] += row * row
                    counts[e] += 1
        else:
            rows = x.reshape(-1, x.shape[-1])
            sums, counts = self._entry(name, 1, rows.shape[1])
            sums[0] += (rows * rows).sum(axis=0)
            counts[0] += len(rows)
        return True

    def _entry(self, name: str, n_mat: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
        if name not in self.sums:
            self.sums[name] = np.zeros((n_mat, n_in), np.float64)
            self.counts[name] = np.zeros(n_mat, np.int64)
        return self.sums[name], self.counts[name]
