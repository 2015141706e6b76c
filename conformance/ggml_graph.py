"""llama.cpp's CPU matmul as one ggml graph node: the oracle of the x86 kernel emulations (tests/test_x86_*.py).

`ggml_graph_matmul` builds `ggml_mul_mat(weight, x)` in a ggml context and computes it with
`ggml_graph_compute_with_ctx`, so the real mul_mat driver of libggml-cpu runs (ggml-cpu.c: the tiled k-quant
kernel, tinyBLAS, vec_dot; with `repack` the weight goes through the CPU_REPACK buffer and repack.cpp's
driver). Needs llama-cpp-python (`pip install 'ggufpy[conformance]'`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ggufpy.constants import GGMLType
from ggufpy.quants.x86 import repack_q8_0

__all__ = ["ggml_graph_matmul"]

TILED_WS_SLOT = 512 * 1024  # tiled/tiled-kernel.h: each thread's workspace in the mul_mat work buffer


class _InitParams(ctypes.Structure):
    """`struct ggml_init_params` (ggml.h)."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_GGML = None


def _ggml():
    """(libggml-base, libggml-cpu, the CPU_REPACK buffer type) with the few prototypes the oracle calls."""
    global _GGML
    if _GGML is not None:
        return _GGML
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
    P, size_t, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
    protos = [
        (base.ggml_init, [_InitParams], P),
        (base.ggml_free, [P], None),
        (base.ggml_new_tensor_2d, [P, ctypes.c_int, i64, i64], P),
        (base.ggml_mul_mat, [P, P, P], P),
        (base.ggml_new_graph, [P], P),
        (base.ggml_build_forward_expand, [P, P], None),
        (base.ggml_get_data, [P], P),
        (base.ggml_nbytes, [P], size_t),
        (base.ggml_graph_overhead, [], size_t),
        (base.ggml_tensor_overhead, [], size_t),
        (base.ggml_backend_alloc_ctx_tensors_from_buft, [P, P], P),
        (base.ggml_backend_tensor_set, [P, P, size_t, size_t], None),
        (base.ggml_backend_buffer_free, [P], None),
        (base.ggml_backend_reg_dev_get, [P, size_t], P),
        (base.ggml_backend_reg_get_proc_address, [P, ctypes.c_char_p], P),
        (base.ggml_backend_buft_name, [P], ctypes.c_char_p),
        (cpu.ggml_graph_compute_with_ctx, [P, P, ctypes.c_int], ctypes.c_int),
        (cpu.ggml_backend_cpu_reg, [], P),
        (cpu.ggml_cpu_init, [], None),
    ]
    for fn, args, res in protos:
        fn.argtypes, fn.restype = args, res
    cpu.ggml_cpu_init()
    # the CPU device's extra buffer types (ggml-cpu.cpp `ggml_backend_cpu_device_get_extra_buffers_type`)
    reg = cpu.ggml_backend_cpu_reg()
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(
        base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    )
    bufts = get_extra(base.ggml_backend_reg_dev_get(reg, 0))
    repack = None
    for i in range(16):
        if not bufts[i]:
            break
        if base.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            repack = bufts[i]
    _GGML = base, cpu, repack
    return _GGML


def ggml_graph_matmul(
    w_bytes: np.ndarray, w_type: GGMLType, x_f32: np.ndarray, *, repack: bool = False, n_threads: int = 1
) -> np.ndarray:
    """llama.cpp's CPU mul_mat of weight rows `w_bytes` u8 (out, row_bytes) of `w_type` by f32 activation rows
    `x_f32` (T, in): y f32 (T, out), computed by a one-node ggml graph (`ggml_graph_compute_with_ctx`).

    The activations go in as f32 and ggml converts them itself (from_float of the vec_dot type). With
    `repack` the weight is stored through the CPU_REPACK buffer type (only Q4_0 / IQ4_NL / MXFP4 with out % 8 == 0
    have a repacked layout on AVX2; ggml would crash on others, so they are refused here)."""
    base, cpu, repack_buft = _ggml()
    w_bytes = np.ascontiguousarray(w_bytes, np.uint8)
    x = np.ascontiguousarray(x_f32, np.float32)
    T, n = x.shape
    out = w_bytes.shape[0]
    if repack and not (repack_q8_0.is_repacked(w_type, out) or (w_type == GGMLType.MXFP4 and out % 8 == 0)):
        raise ValueError(f"llama.cpp does not repack a {GGMLType(w_type).name} weight of {out} rows on x86")
    overhead = base.ggml_graph_overhead() + 8 * base.ggml_tensor_overhead() + (1 << 20)
    # weight, f32 input and output, and the work buffer of compute_with_ctx: the converted activations and,
    # for the tiled k-quant kernel, one workspace per thread
    work = 2 * x.nbytes + n_threads * (TILED_WS_SLOT + 4096) + 4096
    mem = w_bytes.nbytes + x.nbytes + 4 * T * out + work + overhead
    ctx_w = buf = None
    ctx = None
    try:
        if repack:
            ctx_w = base.ggml_init(_InitParams(4 * base.ggml_tensor_overhead(), None, True))
            w = base.ggml_new_tensor_2d(ctx_w, int(w_type), n, out)
            buf = base.ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, repack_buft)
            if not buf:
                raise RuntimeError("could not allocate a CPU_REPACK buffer")
        ctx = base.ggml_init(_InitParams(mem, None, False))
        if not repack:
            w = base.ggml_new_tensor_2d(ctx, int(w_type), n, out)
        if base.ggml_nbytes(w) != w_bytes.nbytes:
            raise ValueError(f"{w_bytes.shape} bytes are not {out} rows of {n} {GGMLType(w_type).name} elements")
        if repack:
            base.ggml_backend_tensor_set(w, w_bytes.ctypes.data, 0, w_bytes.nbytes)  # repacks the blocks
        else:
            ctypes.memmove(base.ggml_get_data(w), w_bytes.ctypes.data, w_bytes.nbytes)
        xt = base.ggml_new_tensor_2d(ctx, int(GGMLType.F32), n, T)
        ctypes.memmove(base.ggml_get_data(xt), x.ctypes.data, x.nbytes)
        y = base.ggml_mul_mat(ctx, w, xt)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, y)
        status = cpu.ggml_graph_compute_with_ctx(ctx, graph, n_threads)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute_with_ctx returned {status}")
        result = np.empty((T, out), np.float32)
        ctypes.memmove(result.ctypes.data, base.ggml_get_data(y), result.nbytes)
        return result
    finally:
        if ctx:
            base.ggml_free(ctx)
        if buf:
            base.ggml_backend_buffer_free(buf)
        if ctx_w:
            base.ggml_free(ctx_w)
