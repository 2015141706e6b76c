"""What the llamacpp numerics' fused blocks (`layer_ggml.py`: one token, `layer_ggml_rows.py`: N rows) share
beside the block itself: the argument lists of the kernels they call, and the optional steps of the
Gemma-style blocks.

- Products: the jitted kernel `int8dot.product` runs for a weight and its argument family (`_product_kernel`;
  the FP4 types' Python wrappers resolved to the kernel they call, `_adapters`).
- Activations: the compiled function `Model.feed_forward` calls for the layer's activation in this numerics
  (`activation_kernel`), as one of three argument lists (`ACT_PLAIN`, `ACT_LANES`, `ACT_TABLE`). SiLU is
  `glue_ggml._silu_rows` or the AVX2 build's `x86._silu_rows` (`NumbaBackend.compiled`). GELU is ggml's fp16
  table (`numerics.gelu_tanh_ggml`), which the numerics record holds as a NumPy function that nothing compiles
  for `Model.feed_forward`; `_gelu_ggml` is its compiled form, bit for bit (the same table, the same f32 -> f16
  index): a table lookup has no rounding of its own to get wrong.
- Optional steps (gemma, gemma2, gemma3, qwen3: `layer.optional_steps` gives their weights and scales, as for
  the exact numerics' blocks): per-head Q/K RMSNorms (`_head_norms`), Q times 1/sqrt(E) after RoPE
  (`_scale_q`), RMSNorm on each branch's output before the residual add (`_post_norm`), each through the same
  compiled RMSNorm `Model.block` calls (`NumbaBackend.rms_norm`: `ops._rms_norm` on rows (N, C)).
"""

from __future__ import annotations

import functools

import numpy as np

from ..numerics import _gelu_table, gelu_tanh_ggml
from . import glue_ggml, int8dot, x86
from ._numba import call_native, jit, native
from .activations import f32_to_f16_bits

__all__ = ["activation_kernel", "gelu_ggml"]

# argument lists of the product kernels: (nt, w, q, d, bsums, out), (nt, w, q, d, s, asum, out), (nt, w, q, d,
# asum, out)
FAM_K, FAM_Q0, FAM_ASUM = range(3)
FORMATS = {int8dot.Q8_0: 0, int8dot.Q8_1: 1, int8dot.Q8_K: 2}  # activation format -> its bit in `_formats`
# argument lists of the activation kernels: (x, out), (x, lanes, out), (x, table, out)
ACT_PLAIN, ACT_LANES, ACT_TABLE = range(3)
NO_WEIGHT = np.zeros(0, np.float32)  # an optional step's weight where the layer has none


@jit(inline=True)
def _f16_bits(x):
    """NumPy's f32 -> f16 conversion as bits (what `cache.update` stores): `f32_to_f16_bits`, with NaNs as NumPy
    keeps them (the top 10 payload bits, never an infinity)."""
    u = np.int64(np.float32(x).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF) != 0:
        payload = (u & 0x007FFFFF) >> 13
        return np.uint16(((u >> 16) & 0x8000) | 0x7C00 | (payload if payload != 0 else 1))
    return np.uint16(f32_to_f16_bits(x))


# -- the optional steps, inside the jitted blocks ---------------------------------------------------------------


@jit(inline=True)
def _head_norms(fns, keys, slot, x, weight, eps):
    """x (N, heads, E) with each head's row RMS-normed by the RMSNorm at fns[slot], as `Model.attention` calls
    `rms_norm` on (N, heads, E) (reshaped to (N * heads, E)); x itself without a weight."""
    if weight.shape[0] == 0:
        return x
    N, heads, E = x.shape
    out = np.empty_like(x)
    call_native(fns[slot], keys[slot], (x.reshape((N * heads, E)), weight, eps, out.reshape((N * heads, E))))
    return out


@jit(inline=True)
def _scale_q(q, q_scale):
    """q (N, H, E) times q_scale in f32, in place, unless q_scale is 0 (`scale_q`: after RoPE, `Model.attention`)."""
    if q_scale != 0:
        N, H, E = q.shape
        for r in range(N):
            for hd in range(H):
                for e in range(E):
                    q[r, hd, e] = q[r, hd, e] * q_scale


@jit(inline=True)
def _post_norm(fns, keys, slot, y, weight, eps):
    """A branch's output y (N, D) as `Model._residual` adds it: RMS-normed by the RMSNorm at fns[slot] where the
    layer has a post-norm (gemma2/3), else y itself."""
    if weight.shape[0] == 0:
        return y
    out = np.empty_like(y)
    call_native(fns[slot], keys[slot], (y, weight, eps, out))
    return out


@jit(inline=True)
def _activation(fns, keys, slot, kind, lanes, table, x, out):
    """out (N, F) = the activation kernel at fns[slot] of x (N, F), with its argument list `kind`."""
    if kind == ACT_PLAIN:
        call_native(fns[slot], keys[slot], (x, out))
    elif kind == ACT_LANES:
        call_native(fns[slot], keys[slot], (x, lanes, out))
    else:
        call_native(fns[slot], keys[slot], (x, table, out))


# -- GELU: ggml's fp16 table, compiled --------------------------------------------------------------------------


@jit
def _gelu_ggml(x, table, out):
    """out (N, F) = `numerics.gelu_tanh_ggml(x)`: 0 at x <= -10, x at x >= 10, else table[x's f16 bits], with
    table the f32 values of `ggml_table_gelu_f16` (`gelu_table`)."""
    rows, n = x.shape
    for r in range(rows):
        for i in range(n):
            v = x[r, i]
            if v <= np.float32(-10.0):
                out[r, i] = np.float32(0.0)
            elif v >= np.float32(10.0):
                out[r, i] = v
            else:
                out[r, i] = table[_f16_bits(v)]


@functools.cache
def gelu_table() -> np.ndarray:
    """(65536,) f32: the table `numerics.gelu_tanh_ggml` looks up, converted from f16 as it converts each value."""
    return _gelu_table().astype(np.float32)


def gelu_ggml(x: np.ndarray) -> np.ndarray:
    """`numerics.gelu_tanh_ggml(x)` compiled, bit for bit (tests/test_kernels_layer_ggml.py): f32 (..., n)."""
    x = np.ascontiguousarray(x, np.float32)
    x2 = x.reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _gelu_ggml(x2, gelu_table(), out)
    return out.reshape(x.shape)


def activation_kernel(backend, activation: str) -> tuple[object, int, int] | None:
    """(jitted kernel, argument list ACT_*, lanes or 0) of the compiled function `Model.feed_forward` runs for
    `activation` on `backend` (`NumbaBackend.compiled` of the numerics' function, or that function), or None
    when it is none of these."""
    f = backend.numerics.activations.get(activation)
    compiled = backend.compiled.get(f, f)
    if compiled is glue_ggml.silu_rows:
        return glue_ggml._silu_rows, ACT_PLAIN, 0
    if isinstance(compiled, functools.partial) and compiled.func is x86.silu_rows and not compiled.args:
        return x86._silu_rows, ACT_LANES, x86.ISA_LANES[compiled.keywords.get("isa", "avx512")]
    if compiled is gelu_tanh_ggml or compiled is gelu_ggml:
        return _gelu_ggml, ACT_TABLE, 0
    return None


def activation_native(backend, activation: str, hidden: int) -> tuple[tuple[int, int], int, int, np.ndarray]:
    """(`native` of the activation kernel, its ACT_* kind, lanes, its table or NO_WEIGHT) for `_activation`."""
    kernel, kind, lanes = activation_kernel(backend, activation)
    x = np.zeros((1, hidden), np.float32)
    table = gelu_table() if kind == ACT_TABLE else NO_WEIGHT
    args = {ACT_PLAIN: (x, x), ACT_LANES: (x, lanes, x), ACT_TABLE: (x, table, x)}[kind]
    return native(kernel, args), kind, lanes, table


# -- the product kernels' argument lists ------------------------------------------------------------------------


@functools.cache
def _adapters() -> dict:
    """`int8dot` kernels that are Python wrappers (the FP4 types) -> f(weight rows) = the jitted kernel the
    wrapper calls for them and one activation row, all of family FAM_ASUM (int8ir_fp4.py, int8ir_fp4_x8.py:
    keep in step with the wrappers)."""
    from . import int8ir_fp4, int8ir_fp4_x8

    return {
        int8ir_fp4.mxfp4_kernel: lambda w: int8ir_fp4._mv_mxfp4_8 if w.shape[0] % 8 == 0 else int8ir_fp4._mv_mxfp4,
        int8ir_fp4.nvfp4_kernel: lambda w: int8ir_fp4._mv_nvfp4,
        int8ir_fp4_x8.mxfp4x8_kernel: lambda w: int8ir_fp4_x8._mv_mxfp4x8,
    }


class _Unfusable(Exception):
    """A weight whose integer kernel is neither jitted nor a known wrapper (`_adapters`)."""


def _sample_activations(fmt: str, C: int) -> tuple[np.ndarray, ...]:
    """Arrays of the types `int8dot.quantize` gives for format `fmt` (one row of C): q, d, then s, asum or
    bsums."""
    q, d = np.zeros((1, C), np.int8), np.zeros((1, max(1, C // 32)), np.float32)
    if fmt == int8dot.Q8_K:
        return q, d, np.zeros((1, max(1, C // 16)), np.int16)
    return q, d, np.zeros((1, C // 32), np.float32), np.zeros((1, C // 4), np.int32)


def _product_kernel(iw: int8dot.Int8Weight) -> tuple[object, int, tuple[np.ndarray, ...]]:
    """(the jitted kernel `int8dot.product` runs for `iw`, its family, sample activation arguments)."""
    q, d, *rest = _sample_activations(iw.fmt, iw.cols)
    adapter = _adapters().get(iw.kernel)
    if adapter is not None:
        return adapter(iw.raw), FAM_ASUM, (q, d, rest[-1])
    if getattr(iw.kernel, "py_func", None) is None:  # not a numba function
        raise _Unfusable
    return iw.kernel, FAM_K if iw.k_type else FAM_Q0, (q, d, *rest)


def _product_native(iw: int8dot.Int8Weight) -> tuple[tuple[int, int], tuple[int, int]]:
    """((address, key) of the jitted kernel `int8dot.product` runs for `iw`, (family, format))."""
    kernel, family, args = _product_kernel(iw)
    return native(kernel, (1, iw.raw, *args, np.zeros((1, iw.rows), np.float32))), (family, FORMATS[iw.fmt])
