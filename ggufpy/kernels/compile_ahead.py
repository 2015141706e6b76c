"""Compiling ahead on a cold numba cache (`ggufpy.cli.run.prepare_kernels`): which kernels a model's one-row
products, attention and BLAS tiles will call, compiling them in the background (`_numba.compile_in_background`:
a worker process on the other core), and the calls that wait for them or run a bit-identical NumPy replay
meanwhile. A mixin of `NumbaBackend`, which holds `_pending` (kernel -> events of the compiles started here).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .. import ops
from ..weights import QuantTensor
from . import unpack_numpy
from ._numba import compile_in_background, load_cached, signature
from .attention import _attention as _attention_kernel
from .batched import _sub_sums, row_kernel
from .layout import GROUP, PACKED_TYPES, Packed
from .matvec import _FAMILY, _scale_args, _unpack_t, plan, unpack
from .rawblocks import BLOCK_TYPES

__all__ = ["CompileAhead"]


class CompileAhead:
    _pending: dict

    def row_kernels(self, weights: Iterable[QuantTensor | None], attention: bool = False) -> list[tuple]:
        """[(kernel, argument types)] of the one-row products with `weights` (decode; the head after a prefill)
        and, with `attention`, of one query's attention, in the exact numerics (the kernels `matvec` and
        `attention` pick for those arguments); [] in the llamacpp numerics, whose paths are not listed here."""
        if self.numerics.quantize_activations or self.numerics.attention is not ops.attention:
            return []
        jobs: dict[tuple, None] = {}
        one = np.zeros((1, GROUP), np.float32)  # only the types count: 2-D f32, C order, as `linear` passes
        for w in weights:
            if w is None or w.type not in PACKED_TYPES or len(w.shape) != 2 or w.type in BLOCK_TYPES:
                continue
            p = self.packed(w)
            _, args = plan(p)  # the exact numerics' one-row product: `batched.matvec_rows`
            jobs[_sub_sums, signature((one, p.sub, one))] = None
            jobs[row_kernel(p.family, args), signature((self.threads, *args, one, one, one))] = None
        if attention:
            q = np.zeros((1, 1, 1), np.float32)  # (T, H, E); keys and values (S, G, E) alike
            args = (self.threads, q, q, q, 0, np.float32(1), 0, np.float32(0), q)
            jobs[_attention_kernel, signature(args)] = None
        return list(jobs)

    def unpack_kernels(self, weights: Iterable[QuantTensor | None]) -> list[tuple]:
        """[(kernel, argument types)] of the BLAS tiles' unpacking of `weights` (a prefill of `blas_rows` rows
        or more), which runs in NumPy, bit for bit, while `compile_ahead` compiles them."""
        jobs: dict[tuple, None] = {}
        tile = np.zeros((1, GROUP), np.float32)
        for w in weights:
            if w is None or w.type not in PACKED_TYPES or len(w.shape) != 2 or w.type in BLOCK_TYPES:
                continue
            p = self.packed(w)
            jobs[_unpack_t, signature((1, p.q, _FAMILY[p.family], *_scale_args(p), p.zo, 0, tile))] = None
        return list(jobs)

    def compile_ahead(self, kernels: Iterable[tuple]) -> None:
        """Compile these (kernel, argument types) in the background (`_numba.compile_in_background`: from the
        disk cache, else in a worker process on the other core). A one-row call that needs one of them waits
        for it (`await_compiles`) rather than compiling it a second time in this process."""
        for kernel, sig in kernels:
            if load_cached(kernel, sig):  # here, now: a warm cache starts no worker
                continue
            done = compile_in_background(kernel, sig, check_cache=False)
            if not done.is_set():
                self._pending.setdefault(kernel, []).append(done)

    def await_compiles(self, kernel=None) -> None:
        """Wait until the compiles `compile_ahead` started for `kernel` (None: for every kernel) are loaded."""
        for k in [kernel] if kernel is not None else list(self._pending):
            for done in self._pending.pop(k, ()):
                done.wait()

    def _unpack(self, p: Packed, g0: int, g1: int, out: np.ndarray) -> np.ndarray:
        """`matvec.unpack` on one numba thread (BLAS runs its own threads next, and two spinning pools would
        fight), or, while `compile_ahead` compiles its kernel elsewhere, its NumPy replay: the same bits."""
        pending = self._pending.get(_unpack_t) if self._pending and p.family != "blocks" else None
        if pending:
            if not all(done.is_set() for done in pending):
                return unpack_numpy.unpack(p, g0, g1, out)
            del self._pending[_unpack_t]
        return unpack(p, g0, g1, out, threads=1)
