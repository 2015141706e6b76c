"""The numba backend's mixture-of-experts pieces (`ggufpy.moe`): stacked experts; the glue is `moe_glue`.

    stack = expert_stack(ffn_gate_exps)        # (X, G, group bytes): every expert's eight-row groups, copied once
    ys = mul_mat_id(stacks, ids, x, nt)        # decode: row k of x (K, in) times expert ids[k] of each stack

In the llamacpp numerics Q4_0 and Q4_K weights are copied into eight-row groups (`int8dot.interleaved`). An
expert stack holds those copies for all X experts of one `ExpertTensor` in one array, built once (on first use
or by `prepack`), the file's pages released expert by expert, so it is resident once. A decoded token then
multiplies its K experts of gate and up in one parallel call and of down in another (ggml's `mul_mat_id` also
runs all of them in one op), instead of one call per expert and tensor: each call's work is split over the
threads as a whole, and the Python glue per expert is gone. Each routed row is the one-row kernel on the same
bytes as before (repack.cpp's gemv), so the products are bit for bit the same. Prefill keeps one product per
expert over its view of the stack: an expert's rows share the integer gemm, which unpacks each block once for
all of them (ggml's `mul_mat_id` runs such rows one by one; the gemm's rows equal the gemv's bit for bit on the
fixtures of tests/test_moe_int8.py, as they did before the stacks).

MXFP4 experts (gpt-oss) are stacked the same way in `int8ir_fp4_x8`'s eight-row groups (1.0x the type's
bytes): the kernel could read the GGUF rows in place (`int8ir_fp4.mxfp4_dot8`), but the grouped copy was
1.47x faster on one thread with the weights out of cache, as a decoded token's experts are (its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..constants import GGMLType
from ..weights import ExpertTensor
from . import int8dot
from ._numba import jit, prange, use_threads
from .layout import release_pages
from .moe_glue import STEPS, softmax_ggml

__all__ = ["ExpertProducts", "ExpertStack", "expert_stack", "mul_mat_id", "softmax_ggml"]

_f32 = np.float32


# -- expert stacks ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ExpertStack:
    """The integer-kernel form of every expert of one `ExpertTensor`: w u8 (X, G, group bytes), expert e's
    eight-row groups as `int8dot.interleaved` copies them (MXFP4: `int8ir_fp4_x8.interleave_mxfp4`), and
    `views[e]` the `Int8Weight` over w[e]."""

    type: GGMLType
    fmt: str
    w: np.ndarray
    views: tuple[int8dot.Int8Weight, ...]


def expert_stack(et: ExpertTensor) -> ExpertStack | None:
    """The stack of `et`'s experts in eight-row groups (Q4_0, Q4_K with out % 8 == 0 in the llamacpp
    numerics; MXFP4 with out % 8 == 0), or None where the experts have no grouped integer kernel (they keep
    the per-expert path)."""
    if et.type not in _STACKED:
        return None
    if et.type == GGMLType.MXFP4:
        return _mxfp4_stack(et)
    first = int8dot.weight(et.expert(0))
    if first is None or first.kernel is not int8dot._GROUPED[et.type]:
        return None
    w = np.empty((len(et.experts), *first.raw.shape), np.uint8)
    w[0] = first.raw
    del first
    for e in range(1, len(et.experts)):  # one expert's copy at a time: the stack plus one expert resident
        w[e] = int8dot.weight(et.expert(e)).raw
    rows, cols = et.shape[1:]
    fmt = int8dot.INT8_TYPES[et.type][0]
    kernel, k_type = int8dot._GROUPED[et.type], fmt == int8dot.Q8_K
    views = tuple(int8dot.Int8Weight(et.type, rows, cols, fmt, w[e], kernel, k_type) for e in range(len(w)))
    return ExpertStack(et.type, fmt, w, views)


def _mxfp4_stack(et: ExpertTensor) -> ExpertStack | None:
    """MXFP4 experts of out % 8 == 0 rows copied into eight-row groups (`int8ir_fp4_x8.interleave_mxfp4`),
    one expert at a time, each expert's file pages released after its copy; None otherwise."""
    first = int8dot.weight(et.expert(0), interleave=False)
    if first is None or first.rows % 8:
        return None
    rows, cols = et.shape[1:]
    G, nb = rows // 8, cols // 32
    w = np.empty((len(et.experts), G, nb * int8ir_fp4_x8.MXFP4X8_BYTES), np.uint8)
    for e in range(len(et.experts)):
        raw = int8dot.weight(et.expert(e), interleave=False).raw  # u8 (rows, nb * 17), a view of the file
        int8ir_fp4_x8.interleave_mxfp4(raw, out=w[e])
        release_pages(raw)
    kernel = int8ir_fp4_x8.mxfp4x8_kernel
    views = tuple(int8dot.Int8Weight(et.type, rows, cols, first.fmt, w[e], kernel, False) for e in range(len(w)))
    return ExpertStack(et.type, first.fmt, w, views)


# One kernel per grouped type: tasks are (stack m, routed row k, group g) of every stack at once, so that gate and
# up of all K rows share one fork-join and each task streams one expert's groups in order. Row k's activation row
# is row k of aq, its output row k of outs[m].
if int8dot.AVAILABLE:
    from . import int8ir_fp4_x8

    _Q4_K_GEMV8_X8 = int8dot._Q4_K_GEMV8_X8
    _Q4_0_X8 = int8dot._Q4_0_X8

    @jit(parallel=True)
    def _id_q4_kx8(nt, ws, ids, aq, ad, bsums, outs):
        previous = use_threads(nt)
        K, G = ids.shape[0], ws[0].shape[1]
        nb = aq.shape[1] // 256
        for j in prange(len(ws) * K * G):
            m, k, g = j // (K * G), j // G % K, j % G
            _Q4_K_GEMV8_X8(ws[m][ids[k]], 8 * g, aq, k, ad, bsums, nb, outs[m])
        use_threads(previous)

    @jit(parallel=True)
    def _id_q4_0x8(nt, ws, ids, aq, ad, s, asum, outs):
        previous = use_threads(nt)
        K, G = ids.shape[0], ws[0].shape[1]
        nb = aq.shape[1] // 32
        for j in prange(len(ws) * K * G):
            m, k, g = j // (K * G), j // G % K, j % G
            _Q4_0_X8(ws[m][ids[k]], g, aq, k, ad, s, asum, nb, outs[m])
        use_threads(previous)

    _MXFP4X8 = int8ir_fp4_x8._X8

    @jit(parallel=True)
    def _id_mxfp4x8(nt, ws, ids, aq, ad, s, asum, outs):
        previous = use_threads(nt)
        K, G = ids.shape[0], ws[0].shape[1]
        nb = aq.shape[1] // 32
        for j in prange(len(ws) * K * G):
            m, k, g = j // (K * G), j // G % K, j % G
            _MXFP4X8(ws[m][ids[k]], g, aq, k, ad, asum, nb, outs[m])
        use_threads(previous)

    _STACKED = {GGMLType.Q4_K: _id_q4_kx8, GGMLType.Q4_0: _id_q4_0x8, GGMLType.MXFP4: _id_mxfp4x8}
else:
    _STACKED = {}


def mul_mat_id(stacks: tuple[ExpertStack, ...], ids: np.ndarray, x: np.ndarray, threads: int) -> list[np.ndarray]:
    """One token's routed rows times their experts: row k of x (K, in) times expert ids[k] of each stack (stacks
    of one type and shape, sharing their input) -> [(K, out)] per stack, in one kernel call, each row as its
    gemv alone (the kernel `int8dot` runs for one activation row)."""
    s0 = stacks[0]
    a = int8dot.quantize(x, s0.fmt)  # (K, in): quantized row by row, so a repeated row quantizes alike
    outs = tuple(np.empty((len(ids), s0.views[0].rows), _f32) for _ in stacks)
    ws = tuple(s.w for s in stacks)
    ids = np.ascontiguousarray(ids, np.int64)
    if s0.views[0].k_type:
        _STACKED[s0.type](threads, ws, ids, a.q, a.d, a.bsums, outs)
    else:
        _STACKED[s0.type](threads, ws, ids, a.q, a.d, a.s, a.asum, outs)
    return list(outs)


# -- the backend's side (`NumbaBackend` mixes this in) --------------------------------------------------------------
class ExpertProducts:
    """`NumbaBackend`'s expert stacks: `moe.expert_products` asks `expert_products` first. Uses the backend's
    `_integer`, `_int8`, `_expert_stacks`, `_expert_calls` and `_threads_for`."""

    # `moe` reference steps -> their compiled forms (`moe_glue`), which `moe.feed_forward` calls instead
    moe_steps: ClassVar[dict] = STEPS

    def expert_stack(self, et: ExpertTensor) -> ExpertStack | None:
        """All experts of `et` in eight-row groups in one array (`experts.expert_stack`), built once; its
        per-expert views become the experts' integer forms, so a product by one expert reads the same copy."""
        if et not in self._expert_stacks:
            stack = self._expert_stacks[et] = expert_stack(et) if self._integer else None
            if stack is not None:
                self._int8.update(zip(et.experts, stack.views, strict=True))
        return self._expert_stacks[et]

    def expert_products(
        self, x: np.ndarray, ws: tuple[ExpertTensor, ...], chosen: np.ndarray
    ) -> list[np.ndarray] | None:
        """`moe.expert_products` of one token in one kernel call for all of `ws` (`experts.mul_mat_id`):
        x (1, D) or (1, K, D), chosen (1, K) -> [(1, K, out)]; None where the per-expert path runs instead:
        prefill (each expert's rows through the integer gemm, over its view of the stack), experts without a
        stack, stacks of different types or shapes."""
        stacks = self._expert_calls.get(ws)
        if stacks is None:  # built on first use, prefill's too: its per-expert products then read the stacks
            stacks = tuple(self.expert_stack(w) for w in ws)
            if None in stacks or len({(s.type, s.w.shape) for s in stacks}) != 1:
                stacks = ()
            self._expert_calls[ws] = stacks
        if not stacks or len(chosen) != 1:
            return None
        K = chosen.shape[1]
        _, rows, cols = ws[0].shape
        xs = x.reshape(-1, cols)  # (K, in): row k for expert chosen[0, k]; gate and up share x's one row
        xs = np.repeat(xs, K, axis=0) if len(xs) != K else xs  # a copy (not broadcast_to's view): quantized as is
        ys = mul_mat_id(stacks, chosen[0], xs, self._threads_for(K * rows * cols * len(ws)))  # [(K, out)]
        return [y[None] for y in ys]
