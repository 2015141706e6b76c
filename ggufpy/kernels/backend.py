"""`NumbaBackend`: the `ggufpy.backend.Backend` contract computed from the quantized blocks.

    be = NumbaBackend(numerics, threads=2)
    y = be.linear(x, w)            # x (T, in) f32, w a QuantTensor (out, in) -> (T, out) f32

A weight is repacked (`layout.pack`) the first time it is used, and the packed form is cached per
QuantTensor (by identity). A few activation rows (decode) go through the fused kernels (`matvec`), which
read each weight byte once per call; many rows (prefill) through dense f32 tiles unpacked for BLAS, which
then does the compute-bound part. `numerics.quantize_activations` switches to ggml's int8
path: activations are quantized per row to the weight's vec_dot type (ggml-cpu.c `type_traits_cpu`) and
block dots are integer, as in `ggml_vec_dot_*`. F32/F16/BF16 weights are not repacked: they are
dequantized in tiles and multiplied with BLAS (with f16/bf16-rounded activations in the int8 path, as ggml).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import ClassVar

import numpy as np

from .. import moe, ops
from ..constants import GGMLType
from ..numerics import NUMERICS, Numerics, attention_x86, gelu_tanh_ggml, libm_expf, rope_angles_ggml, rope_ggml
from ..weights import ExpertTensor, QuantTensor
from . import activations as act
from . import experts, glue_ggml, int8dot, layer_ggml_steps, x86
from . import ops as kernel_ops
from ._numba import set_threads
from .attention import _attention as _attention_kernel
from .attention import attention as _attention
from .batched import _sub_sums, matvec_rows
from .batched import row_kernel as one_row_kernel
from .compile_ahead import CompileAhead
from .dequant import dequantize_blocks
from .experts import ExpertProducts
from .layout import FLOAT_TYPES, GROUP, PACKED_TYPES, Packed, pack, trim_heap
from .matvec import matvec, plan
from .rawblocks import BLOCK_TYPES

__all__ = ["VEC_DOT", "NumbaBackend", "linear_types"]

# ggml-cpu.c type_traits_cpu[...].vec_dot_type for the types the backend repacks. Q8_1 and Q8_K are
# activation formats ggml never multiplies as weights: they keep f32 activations.
VEC_DOT = {
    GGMLType.Q4_0: act.Q8_0,
    GGMLType.Q5_0: act.Q8_0,
    GGMLType.Q8_0: act.Q8_0,
    GGMLType.IQ4_NL: act.Q8_0,
    GGMLType.Q4_1: act.Q8_1,
    GGMLType.Q5_1: act.Q8_1,
    GGMLType.Q2_K: act.Q8_K,
    GGMLType.Q3_K: act.Q8_K,
    GGMLType.Q4_K: act.Q8_K,
    GGMLType.Q5_K: act.Q8_K,
    GGMLType.Q6_K: act.Q8_K,
    GGMLType.IQ4_XS: act.Q8_K,
    GGMLType.IQ2_XXS: act.Q8_K,
    GGMLType.IQ2_XS: act.Q8_K,
    GGMLType.IQ2_S: act.Q8_K,
    GGMLType.IQ3_XXS: act.Q8_K,
    GGMLType.IQ3_S: act.Q8_K,
    GGMLType.IQ1_S: act.Q8_K,
    GGMLType.IQ1_M: act.Q8_K,
    GGMLType.TQ1_0: act.Q8_K,
    GGMLType.TQ2_0: act.Q8_K,
    GGMLType.MXFP4: act.Q8_0,
    GGMLType.Q8_1: act.EXACT,
    GGMLType.Q8_K: act.EXACT,
}
# Q1_0 (packed in sub-blocks of 32 for this): once `GGMLType` names it. NVFP4 (vec_dot type Q8_0 too) has no
# entry: its scales change every 16 elements, within one Q8_0 block, which the activation terms cannot express.
VEC_DOT |= {GGMLType[name]: act.Q8_0 for name in ("Q1_0",) if name in GGMLType.__members__}


def linear_types(quantize_activations: bool) -> frozenset[GGMLType]:
    """The weight types `NumbaBackend.linear` multiplies by, from its kernel tables: the float types and the
    packed ones, and with quantized activations (llamacpp numerics) those with a vec_dot type here or an
    integer kernel (`int8dot.INT8_TYPES`: NVFP4 has only that)."""
    if not quantize_activations:
        return frozenset(FLOAT_TYPES) | PACKED_TYPES
    integer = int8dot.INT8_TYPES.keys() if int8dot.AVAILABLE else set()
    return frozenset(FLOAT_TYPES) | (PACKED_TYPES & (VEC_DOT.keys() | integer))


# -- issue 12: the formats computed from their blocks as stored (`rawblocks.py`, family "blocks") ----------------
_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _is_x86_attention(f) -> bool:
    """Whether a numerics record's attention is the replay of ggml's x86 kernels (`numerics.attention_x86`, for
    either build), which `x86.attention` computes bit for bit."""
    return getattr(f, "func", f) is attention_x86


def _has_block_types(w) -> bool:
    """Whether a layer holds a weight of the "blocks" family, which the fused decode block (`layer.py`, whose
    kernels are the nib/nib6/i8 families) cannot run: such layers take the per-linear path."""
    return any(getattr(getattr(w, name, None), "type", None) in BLOCK_TYPES for name in _LAYER_MATRICES)


TILE_BYTES = 4 << 20  # dense f32 tile for the BLAS path: a few MB stays in L2/L3
BLAS_ROWS = 16  # prefill of this many rows or more goes through BLAS (measured crossover: 8-16 rows)
PARALLEL_MIN = 0  # multiply-adds below which a product runs on one thread (see docs/kernels.md)


class CpuContention:
    """Whether other processes keep this machine's cores busy, from /proc/stat, refreshed every `interval` s.

    numba's parallel loops are fork-join: a product on two threads waits for both, and when another process
    holds a core the second thread may only get it a scheduler time slice later (milliseconds, for a product
    that takes microseconds). Measured on 2 cores under a load average of 4: 2 threads 1-10 tok/s, 1 thread
    30-70 tok/s. So the backend drops to one thread while other processes use more than `threshold` cores,
    for `windows` intervals in a row: a single busy interval is mostly a burst (a client starting its requests,
    measured at 0.6-1.4 cores for 0.25 s at the start of each burst of `ggufpy bench --server`), and dropping to
    one thread for it cost the server a third of its 8-stream throughput. Off Linux (no /proc/stat) it never
    reports contention.
    """

    def __init__(self, interval: float = 0.25, threshold: float = 0.5, windows: int = 2):
        self.interval = interval
        self.threshold = threshold
        self.windows = windows
        self.contended = False
        self._streak = 0  # intervals in a row in which other processes used more than `threshold` cores
        self._last = self._sample()
        self._next = time.monotonic() + interval

    @staticmethod
    def _sample() -> tuple[float, float] | None:
        """(jiffies the machine spent busy, jiffies this process used), or None without /proc/stat."""
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait; steal counts as busy
        t = os.times()
        return sum(fields) - idle, (t.user + t.system) * os.sysconf("SC_CLK_TCK")

    def poll(self) -> bool:
        now = time.monotonic()
        if now >= self._next and self._last is not None:
            sample = self._sample()
            if sample is not None:
                elapsed = (now - self._next + self.interval) * os.sysconf("SC_CLK_TCK")
                others = (sample[0] - self._last[0]) - (sample[1] - self._last[1])
                self._streak = self._streak + 1 if others > self.threshold * elapsed else 0
                self.contended = self._streak >= self.windows
                self._last = sample
            self._next = now + self.interval
        return self.contended


class NumbaBackend(CompileAhead, ExpertProducts):
    """Fused dequantize-and-multiply kernels over repacked weights (see `ggufpy.kernels`).

    `threads`: parallel kernel threads (default: the cores this process may use); products of fewer than
    `parallel_min` multiply-adds run on one thread, and so does everything while other processes keep the
    cores busy, unless `adaptive` is False (see `CpuContention`). `blas_rows`: from this many activation rows
    on (prefill), weights are unpacked into dense f32 tiles and multiplied with BLAS, and attention is
    NumPy's (None: always the fused kernels). `x86_activations`: quantize Q8_0/Q8_1 activations
    like llama.cpp's AVX code (True) or like ggml's scalar reference (False). `release_pages`: return a
    weight's file pages to the OS once it is repacked, so the model is resident once, not twice. `int8`: in
    the llamacpp numerics, multiply the types of `int8dot.INT8_TYPES` with integer dot products over the
    GGUF rows as stored (bit-identical to the NumPy backend's replay of ggml), not the f32-lane kernels.
    """

    name = "numba"

    def __init__(
        self,
        numerics: Numerics = NUMERICS["exact"],
        threads: int | None = None,
        blas_rows: int | None = BLAS_ROWS,
        parallel_min: int = PARALLEL_MIN,
        adaptive: bool = True,
        x86_activations: bool = True,
        release_pages: bool = True,
        int8: bool = True,
    ):
        self.numerics = numerics
        self.threads = set_threads(threads)
        self.parallel_min = parallel_min
        self.contention = CpuContention() if adaptive and self.threads > 1 else None
        self.blas_rows = blas_rows
        self.x86_activations = x86_activations
        self.release_pages = release_pages
        self.int8 = int8
        self._packed: dict[QuantTensor, Packed] = {}  # keyed by identity (QuantTensor has eq=False)
        self._plans: dict[QuantTensor, tuple] = {}
        self._stacks: dict[tuple[QuantTensor, ...], list] = {}  # linears(): weights stacked by type
        self._int8: dict[QuantTensor, int8dot.Int8Weight | None] = {}  # llamacpp numerics: integer kernels
        self._expert_stacks: dict[ExpertTensor, experts.ExpertStack | None] = {}  # their experts, grouped once
        self._expert_calls: dict[tuple[ExpertTensor, ...], tuple] = {}  # stacks multiplied in one call, or ()
        self._tile = np.empty(0, np.float32)
        self._pending: dict[object, list] = {}  # kernel -> events of its compiles started by `compile_ahead`

    # -- the Backend contract ------------------------------------------------------------------------------
    def linear(self, x: np.ndarray, w: QuantTensor) -> np.ndarray:
        """x (T, in) float32 times w (out, in) transposed -> (T, out) float32."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != w.shape[-1]:
            raise ValueError(f"{w.name}: activations of shape {x.shape} do not fit a weight of shape {w.shape}")
        if w.type in FLOAT_TYPES:
            return self._float_linear(x, w)
        iw = self.int8_weight(w)
        if iw is not None:
            return int8dot.linear(x, iw, self._threads_for(x.shape[0] * iw.rows * iw.cols))
        p = self.packed(w)
        planned = self._plans.get(w)
        if planned is None:
            planned = self._plans[w] = plan(p)
        y = self._product(x, p, planned)
        return y if y.shape[1] == p.rows else y[:, : p.rows]

    def linears(self, x: np.ndarray, ws: tuple[QuantTensor, ...]) -> list[np.ndarray]:
        """x times each of `ws` (Q/K/V, gate/up: weights that share their input).

        Weights of one packed type and width are stacked into one packed weight the first time (their
        separate packed forms become views of it, so memory does not grow): one kernel call then covers all
        of them, which saves the per-call cost and balances small matrices over the threads. A mix (Q and K
        in Q5_0, V in Q8_0) stacks what it can."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        integer = [self.int8_weight(w) is not None for w in ws]
        if all(integer):
            return self._int8_linears(x, ws)
        if any(integer):  # a mix (Q4_K with rows % 8 != 0 beside others): each kind on its own path
            ys = iter(self._int8_linears(x, tuple(w for w, i in zip(ws, integer, strict=True) if i)))
            rest = iter(self.linears(x, tuple(w for w, i in zip(ws, integer, strict=True) if not i)))
            return [next(ys) if i else next(rest) for i in integer]
        groups = self._stacks.get(ws)
        if groups is None:
            groups = self._stacks[ws] = self._stack_groups(ws)
        out: list[np.ndarray | None] = [None] * len(ws)
        for members, stack in groups:
            if stack is None:
                (i,) = members
                out[i] = self.linear(x, ws[i])
                continue
            if x.ndim != 2 or x.shape[1] != ws[members[0]].shape[-1]:
                w = ws[members[0]]
                raise ValueError(f"{w.name}: activations of shape {x.shape} do not fit weights of shape {w.shape}")
            p, planned, spans = stack
            y = self._product(x, p, planned)  # (T, G*64) over the stacked groups
            for i, (lo, rows) in zip(members, spans, strict=True):
                out[i] = y[:, lo : lo + rows]
        return out

    def int8_weight(self, w: QuantTensor) -> int8dot.Int8Weight | None:
        """The integer-kernel form of `w` in the llamacpp numerics (`int8dot`: ggml's integer block dots over
        the GGUF rows as stored, except Q4_0 / Q4_K with rows % 8 == 0, copied into eight-row groups
        (`int8dot.interleaved`); bit-identical to the NumPy backend's replay), else None."""
        if not self._integer:
            return None
        if w not in self._int8:
            self._int8[w] = int8dot.weight(w)
        return self._int8[w]

    @property
    def _integer(self) -> bool:
        """Whether the integer kernels run: the llamacpp numerics with ggml's x86 activation rounding only."""
        return self.int8 and self.numerics.x86_kernels and self.x86_activations

    def _int8_linears(self, x: np.ndarray, ws: tuple[QuantTensor, ...]) -> list[np.ndarray]:
        """`linears` over integer-kernel weights: each activation format quantized once for all of them."""
        quantized: dict[str, int8dot.Activations] = {}
        out = []
        for w in ws:
            iw = self._int8[w]
            if x.ndim != 2 or x.shape[1] != iw.cols:
                raise ValueError(f"{w.name}: activations of shape {x.shape} do not fit a weight of shape {w.shape}")
            a = quantized.get(iw.fmt)
            if a is None:
                a = quantized[iw.fmt] = int8dot.quantize(x, iw.fmt)
            out.append(int8dot.product(a, iw, self._threads_for(x.shape[0] * iw.rows * iw.cols)))
        return out

    def _stack_groups(self, ws: tuple[QuantTensor, ...]) -> list[tuple[tuple[int, ...], tuple | None]]:
        """[(indices into ws, their stack or None)]: weights grouped by (type, width), each group of two or
        more stacked (when their scale storage agrees)."""
        by_kind: dict[tuple, list[int]] = {}
        for i, w in enumerate(ws):
            by_kind.setdefault((w.type, w.shape[-1], len(w.shape)), []).append(i)
        groups = []
        for members in by_kind.values():
            stack = self._stack(tuple(ws[i] for i in members)) if len(members) > 1 else None
            if stack is None:
                groups += [((i,), None) for i in members]
            else:
                groups.append((tuple(members), stack))
        return groups

    def _product(self, x: np.ndarray, p: Packed, planned: tuple) -> np.ndarray:
        mode = act.EXACT
        if self.numerics.quantize_activations:
            if p.type not in VEC_DOT:
                raise NotImplementedError(f"no {self.numerics.name} numerics kernel for {p.type.name} weights")
            mode = VEC_DOT[p.type]
        if self._use_blas(x.shape[0]):
            return self._blas_linear(x, p, mode)
        threads = self._threads_for(x.shape[0] * p.rows * p.cols)
        if mode == act.EXACT and x.shape[0] == 1:
            # decode: the batched row kernels (bit for bit `matvec`'s one-row kernel, tests/test_batch_rows_split.py)
            # keep the sums in registers: 1.8-4.4x faster per product than `_mv_*_row` (docs/kernels.md)
            if self._pending and p.family != "blocks":
                self.await_compiles(_sub_sums)
                self.await_compiles(one_row_kernel(p.family, planned[1]))
            return matvec_rows(p, x, None, planned, threads)
        xv, terms = (x, None) if mode == act.EXACT else act.prepare(x, mode, p.sub, self.x86_activations)
        return matvec(p, xv, terms, planned=planned, threads=threads)

    def _stack(self, ws: tuple[QuantTensor, ...]) -> tuple | None:
        """(stacked Packed, its plan, [(first output column, rows)] per weight), or None when `ws` cannot
        share one kernel (types, widths or scale storage differ, or float weights, which are not packed)."""
        if len({(w.type, w.shape[-1], len(w.shape)) for w in ws}) != 1 or ws[0].type in FLOAT_TYPES:
            return None
        parts = [self.packed(w) for w in ws]
        fields = ("q", "a", "b", "sc", "mn")
        for f in fields:  # e.g. scales stored as fp16 bits in one weight and as f32 in another
            if len({None if getattr(p, f) is None else getattr(p, f).dtype for p in parts}) != 1:
                return None
        arrays = {
            f: None if getattr(parts[0], f) is None else np.concatenate([getattr(p, f) for p in parts]) for f in fields
        }  # each (G_i, ...) -> (sum G_i, ...)
        stacked = replace(parts[0], rows=sum(p.groups for p in parts) * GROUP, **arrays)
        spans, g0 = [], 0
        for w, p in zip(ws, parts, strict=True):  # the separate forms become views of the stack
            g1 = g0 + p.groups
            self._packed[w] = replace(p, **{f: None if a is None else a[g0:g1] for f, a in arrays.items()})
            self._plans.pop(w, None)
            spans.append((g0 * GROUP, p.rows))
            g0 = g1
        del parts
        trim_heap()  # the separate packed arrays are free now: give their pages back (see `trim_heap`)
        return stacked, plan(stacked), spans

    def _use_blas(self, n_rows: int) -> bool:
        """Prefill through BLAS (and NumPy's attention, also BLAS): numba stays on one thread meanwhile."""
        return self.blas_rows is not None and n_rows >= self.blas_rows

    def _threads_for(self, macs: int) -> int:
        """All threads, or one for work too small to repay waking the others or while other processes hold
        the cores (`CpuContention`)."""
        if macs < self.parallel_min or (self.contention is not None and self.contention.poll()):
            return 1
        return self.threads

    def attention(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        start: int,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: np.ndarray | None = None,
    ) -> np.ndarray:
        """The numerics' attention (`ops.attention` contract): a numba kernel when the numerics use the
        plain f32 `ops.attention`, otherwise the numerics' own function (e.g. llama.cpp's f16 roundings);
        NumPy's during a BLAS prefill, to keep numba's threads idle while BLAS runs. `sinks` (gpt-oss): the
        compiled x86 replay knows them, the f32 kernel does not (the numerics' function then)."""
        nm = self.numerics
        threads = self._threads_for(q.shape[0] * q.shape[1] * k.shape[0] * q.shape[2])
        if nm.x86_kernels and not softcap and _is_x86_attention(nm.attention):
            # ggml's attention kernels replayed and compiled: bit-identical to the numerics' NumPy replay
            return x86.attention(q, k, v, start, scale, window, isa=nm.x86_isa, threads=threads, sinks=sinks)
        if sinks is not None or nm.attention is not ops.attention or self._use_blas(q.shape[0]):
            extra = {"window": window} if window is not None else {}
            if softcap:
                extra["softcap"] = softcap
            if sinks is not None:
                extra["sinks"] = sinks
            return nm.attention(q, k, v, start, scale, **extra)
        if self._pending:
            self.await_compiles(_attention_kernel)
        return _attention(q, k, v, start, scale, window, softcap, threads=threads)

    def attention_q8(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float, window=None, softcap=None
    ) -> np.ndarray:
        """Attention over a Q8_0 KV cache (`kvcache.Q8Cache`), compiled (`kernels.attention_q8`): llama.cpp's
        flash attention bit for bit in the llamacpp numerics, f32 over the blocks in the exact numerics."""
        from . import attention_q8

        threads = self._threads_for(q.shape[0] * q.shape[1] * k.shape[0] * q.shape[2])
        ggml = self.numerics.x86_kernels
        return attention_q8.attention(q, k, v, start, scale, window, softcap, ggml=ggml, threads=threads)

    def decode_block(self, config, w, i: int, h: np.ndarray, pos: int, cos, sin, cache) -> np.ndarray | None:
        """A whole transformer block for one token in one compiled call (`kernels.layer`; with the integer
        kernels of the llamacpp numerics `kernels.layer_ggml`), bit-identical to `Model.block` on this backend;
        None where the layer or the numerics are outside its scope."""
        from . import layer, layer_ggml  # import this module

        if not self._integer and _has_block_types(w):
            return None
        if self._pending:  # the block takes every kernel's address: all of them loaded here, none compiled twice
            self.await_compiles()
        fused = layer_ggml if self._integer else layer
        return fused.decode_block(self, config, w, i, h, pos, cos, sin, cache)

    def decode_rows(self, config, w, i: int, h: np.ndarray, positions, cos, sin, caches) -> np.ndarray | None:
        """A whole block of a batched pass (B rows, each at its own position of its own cache) in one compiled
        call (`kernels.layer_rows`; the llamacpp numerics' integer kernels: `kernels.layer_ggml_rows`),
        bit-identical to `Model.block_rows` on this backend; None outside its scope."""
        from . import layer_ggml_rows, layer_rows  # import this module

        fused = layer_ggml_rows if self._integer else layer_rows
        return fused.decode_rows(self, config, w, i, h, positions, cos, sin, caches)

    # The per-token glue, for a transformer that asks its backend (`getattr(backend, "rms_norm", ops.rms_norm)`):
    rms_norm = staticmethod(kernel_ops.rms_norm)  # the same f32 steps as ops.rms_norm, in both numerics modes

    # Reference functions of the numerics records -> compiled functions with the same f32 steps, which the
    # transformer calls instead (`Model.compiled`); a numerics record holding some other function is obeyed.
    compiled: ClassVar[dict] = {
        ops.rope: kernel_ops.rope,
        ops.silu: kernel_ops.silu,
        ops.gelu_tanh: kernel_ops.gelu_tanh,
        rope_ggml: glue_ggml.rope_ggml,  # bit-identical to the NumPy functions of the llamacpp numerics
        NUMERICS["llamacpp"].activations["silu"]: glue_ggml.silu_rows,
        NUMERICS["llamacpp-avx2"].activations["silu"]: functools.partial(x86.silu_rows, isa="avx2"),
        gelu_tanh_ggml: layer_ggml_steps.gelu_ggml,  # ggml's fp16 GELU table, the same lookup per element
        moe.softmax_ggml: experts.softmax_ggml,  # the router's softmax, same `isa` argument
        libm_expf: glue_ggml.expf_array,  # the C library's expf per element (swiglu_oai, sigmoid gates)
        rope_angles_ggml: functools.partial(rope_angles_ggml, cos_sin=glue_ggml.cos_sin),  # cosf/sinf compiled
    }

    # -- weights -------------------------------------------------------------------------------------------
    def packed(self, w: QuantTensor) -> Packed:
        """The repacked form of `w`, made on first use and cached."""
        p = self._packed.get(w)
        if p is None:
            if w.type not in PACKED_TYPES or len(w.shape) != 2:
                raise NotImplementedError(f"{w.name}: no numba kernel for {w.type.name} weights of shape {w.shape}")
            p = self._packed[w] = pack(w, release=self.release_pages)
        return p

    def prepack(self, tensors: Iterable[QuantTensor | ExpertTensor]) -> int:
        """Repack these weights now rather than on first use; returns the bytes the packed forms take.
        Expert stacks (`ExpertTensor`) are grouped (`expert_stack`) or every expert packed."""
        for w in tensors:
            if isinstance(w, ExpertTensor):
                if self.expert_stack(w) is None:
                    self.prepack(w.experts)
            elif w.type not in FLOAT_TYPES and self.int8_weight(w) is None:
                self.packed(w)
        return self.packed_bytes

    @property
    def packed_bytes(self) -> int:
        return sum(p.nbytes for p in self._packed.values())

    # -- the dense paths -----------------------------------------------------------------------------------
    def _tile_rows(self, cols: int) -> int:
        return max(GROUP, TILE_BYTES // (4 * cols) // GROUP * GROUP)

    def _scratch(self, n: int) -> np.ndarray:
        if self._tile.size < n:
            self._tile = np.empty(n, np.float32)
        return self._tile[:n]

    def _blas_linear(self, x: np.ndarray, p: Packed, mode: int) -> np.ndarray:
        """Unpack dense row tiles and multiply with BLAS. In the int8 path the activations are the
        dequantized quantized ones; Q8_1's fp16-rounded block sums enter as a correction of the mins."""
        T = x.shape[0]
        xe = x
        correction = None
        if mode != act.EXACT:
            xv, (xs, ad, am) = act.prepare(x, mode, p.sub, self.x86_activations)
            xe = (xv.reshape(T, -1, p.sub) * ad[:, :, None]).reshape(T, -1)  # (T, C)
            if p.b is not None and p.style == "block":
                correction = am - ad * xs  # (T, n): s - d * sum(q), nonzero only for Q8_1
        y = np.empty((T, p.rows), np.float32)
        step = self._tile_rows(p.cols) // GROUP
        for g0 in range(0, p.groups, step):
            g1 = min(p.groups, g0 + step)
            r0, r1 = g0 * GROUP, min(p.rows, g1 * GROUP)
            tile = self._unpack(p, g0, g1, self._scratch(p.cols * (g1 - g0) * GROUP).reshape(p.cols, -1))
            y[:, r0:r1] = xe @ tile[:, : r1 - r0]
        if correction is not None:
            b = p.scales("b").transpose(0, 2, 1).reshape(-1, p.n_sub)[: p.rows]  # (rows, n)
            y += correction @ b.T
        return y

    def _float_linear(self, x: np.ndarray, w: QuantTensor) -> np.ndarray:
        rows, cols = w.shape
        if self.numerics.quantize_activations and w.type != GGMLType.F32:
            xr = np.empty_like(x)
            (act.round_f16 if w.type == GGMLType.F16 else act.round_bf16)(x, xr)  # ggml's vec_dot_type
            x = xr
        if w.type == GGMLType.F32:
            return x @ w.raw.view("<f4").reshape(rows, cols).T
        y = np.empty((x.shape[0], rows), np.float32)
        step = self._tile_rows(cols)
        blocks = w.raw.reshape(rows, -1)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            tile = self._scratch((r1 - r0) * cols).reshape(r1 - r0, cols)
            dequantize_blocks(w.type, blocks[r0:r1], tile.reshape(-1, 1))
            y[:, r0:r1] = x @ tile.T
        return y

    # -- batched decode (`Model.decode_batch`), kernels in `batched.py` -------------------------------------
    def linears_rows(self, x: np.ndarray, ws: tuple[QuantTensor, ...]) -> list[np.ndarray]:
        """`linears` for B rows of B independent sequences, each row bit-identical to its product alone."""
        from .batched import linears_rows  # imports this module

        return linears_rows(self, x, ws)

    def attention_rows(self, q: np.ndarray, kv: list, scale: float, **extra) -> np.ndarray | None:
        """`attention` of B sequences' last rows in one call, each row bit-identical to its call alone; None
        where `attention` would not run its numba kernel (the caller then goes row by row)."""
        from .batched import attention_rows

        return attention_rows(self, q, kv, scale, **extra)

    # Activations whose compiled loop does the same f32 operations in its SIMD body and its scalar tail (ggml's
    # GELU: one table lookup per element), so that one call on (B, F) equals B calls of one row
    # (tests/test_batch.py): `Model.feed_forward` then makes one call.
    row_invariant: ClassVar[frozenset] = frozenset({kernel_ops.silu, kernel_ops.gelu_tanh, layer_ggml_steps.gelu_ggml})

    def __repr__(self) -> str:
        return (
            f"NumbaBackend(numerics={self.numerics.name!r}, threads={self.threads}, "
            f"packed={len(self._packed)} tensors / {self.packed_bytes >> 20} MiB)"
        )
