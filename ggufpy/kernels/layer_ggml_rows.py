"""One compiled call per block of a batched pass in the llamacpp numerics: `Model.block_rows` for N rows, each
at its own position of its own f16 KV cache, as `layer_ggml.py` does for one token and `layer_rows.py` for N
rows in the exact numerics.

    from ggufpy.kernels import layer_ggml_rows
    h = layer_ggml_rows.decode_rows(backend, cfg, w, i, h, positions, cos, sin, caches)   # None: use block_rows

`Model.block_rows` in this numerics is ~25 compiled calls per layer with Python and NumPy between them, and
the attention, the K/V writes and the activation once per row: on SmolLM2 at B = 8 about a third of a step. Here one
jitted function runs the block and calls the same compiled kernels, at their addresses (`_numba.native`), with
arguments of the same types, in the same order as the rows path:

    _rms_norm (all rows) -> quantize (each activation format Q/K/V read) -> Q, K, V products
    (`int8rows.product_rows`' kernel of each weight) -> [_rms_norm of each Q and K head, all rows] ->
    `glue_ggml._rope` (q, k; row r at its own angles) -> [q * 1/sqrt(E)] -> K/V of every row rounded to f16
    into its cache -> `x86_decode._attention_one` per row -> quantize -> O product -> [_rms_norm] -> + h ->
    _rms_norm -> quantize -> gate, up products -> the activation per row -> * up -> quantize -> down product
    -> [_rms_norm] -> + h

so each row is bit for bit `Model.block_rows`'s, which is that token decoded alone (batch invariance,
tests/test_kernels_layer_ggml_rows.py). The bracketed steps and the activation (SiLU, or ggml's fp16-table
GELU) are `layer_ggml.py`'s (`layer_ggml_steps`): Gemma 2/3-style layers take the same call. A product whose
kernel changes its steps with the row count and has no rows form (the tiled kernels from 8 rows, Q4_K in GGUF
rows, the low-bit types) takes its rows in chunks of `int8rows.ONE_ROW_BELOW` - 1, as `product_rows` does.

Scope (`fused_rows`): the layers `Model.forward` gives the one-token fused block (`ModelConfig.fused_block`:
not a NoPE layer, not a temperature-scaled Q) within `layer_ggml.can_fuse` (llama-style blocks with or without
Q/K norms per head, Q scaling, post-norms, GELU, windows; no attention softcap: gemma2's files), with jitted
integer kernels (not the FP4 wrappers), f16 `KVCache`s. The rest goes through `Model.block_rows`. The block
compiles in the background (`BACKGROUND`); until it is ready `decode_rows` returns None (same values).
"""

from __future__ import annotations

import weakref

import numpy as np

from ..quants.x86.attention import n_kv_cells
from . import int8dot, int8rows
from ._numba import DISABLED, call_native, compiled_in_background, jit, native
from .batched_ir import carray, u16_pointer
from .layer_ggml import (
    _MATRICES,
    _NO_SINKS,
    ACT,
    ATTN,
    NORM1,
    NORM2,
    QUANT0,
    QUANTK,
    ROPE,
    WD,
    WG,
    WK,
    WO,
    WQ,
    WU,
    WV,
    FusedGgmlLayer,
    _formats,
    _product,
    can_fuse,
)
from .layer_ggml_steps import (
    _activation,
    _adapters,
    _f16_bits,
    _head_norms,
    _post_norm,
    _product_kernel,
    _scale_q,
    _Unfusable,
)
from .layer_rows import _Step

__all__ = ["FusedGgmlRows", "decode_rows", "fused_rows"]

BACKGROUND = True  # compile `_block_rows` in the background the first time; `Model.block_rows` meanwhile


@jit(inline=True)
def _quantized_rows(fns, keys, x, need):
    """x (N, C) in each activation format of `need`, as `int8dot.quantize` stores them (`layer_ggml._quantized`
    for N rows): Q8_0 and Q8_1 (q, d, s, asum), Q8_K (q, d, bsums); formats not needed are left unwritten."""
    N, C = x.shape
    q0, d0 = np.empty((N, C), np.int8), np.empty((N, C // 32), np.float32)
    s0, a0 = np.empty((N, C // 32), np.float32), np.empty((N, C // 4), np.int32)
    q1, d1 = np.empty((N, C), np.int8), np.empty((N, C // 32), np.float32)
    s1, a1 = np.empty((N, C // 32), np.float32), np.empty((N, C // 4), np.int32)
    qk, dk, bk = np.empty((N, C), np.int8), np.empty((N, C // 256), np.float32), np.empty((N, C // 16), np.int16)
    if need & 1:
        call_native(fns[QUANT0], keys[QUANT0], (x, False, q0, d0, s0, a0))
    if need & 2:
        call_native(fns[QUANT0], keys[QUANT0], (x, True, q1, d1, s1, a1))
    if need & 4:
        call_native(fns[QUANTK], keys[QUANTK], (x, qk, dk, bk))
    return (q0, d0, s0, a0), (q1, d1, s1, a1), (qk, dk, bk)


@jit(inline=True)
def _part(a, lo, n):
    """A copy of rows lo..lo+n-1 of a 2-D array (C-contiguous, as the kernels' signatures take them)."""
    out = np.empty((n, a.shape[1]), a.dtype)
    for r in range(n):
        for c in range(a.shape[1]):
            out[r, c] = a[lo + r, c]
    return out


@jit(inline=True)
def _product_rows(fns, keys, kinds, slot, nt, w, acts, out):
    """out (N, rows): `int8rows.product_rows` of the kernel at fns[slot]: all rows in one call, or (kinds[slot,
    2] > 0) chunks of that many rows, below the row count where the kernel changes its steps."""
    N = out.shape[0]
    chunk = kinds[slot, 2]
    if chunk == 0 or N <= chunk:
        _product(fns, keys, kinds, slot, nt, w, acts, out)
        return
    (q0, d0, s0, a0), (q1, d1, s1, a1), (qk, dk, bk) = acts
    for lo in range(0, N, chunk):
        n = min(chunk, N - lo)
        sub = (
            (_part(q0, lo, n), _part(d0, lo, n), _part(s0, lo, n), _part(a0, lo, n)),
            (_part(q1, lo, n), _part(d1, lo, n), _part(s1, lo, n), _part(a1, lo, n)),
            (_part(qk, lo, n), _part(dk, lo, n), _part(bk, lo, n)),
        )
        part = np.empty((n, out.shape[1]), np.float32)
        _product(fns, keys, kinds, slot, nt, w, sub, part)
        for r in range(n):
            for c in range(out.shape[1]):
                out[lo + r, c] = part[r, c]


@jit
def _block_rows(
    fns,
    keys,
    kinds,
    nt,
    h,
    attn_norm,
    ffn_norm,
    eps,
    wq,
    wk,
    wv,
    wo,
    wg,
    wu,
    wd,
    cos,
    sin,
    neox,
    k_at,
    v_at,
    pos,
    n_kv,
    scale,
    sinks,
    steps,
    q_scale,
    dims,
):
    """The block for N rows h (N, D), row r at position pos[r] of the cache whose layer arrays (f16 bits as u16,
    (capacity, G, E)) start at k_at[r], v_at[r]; n_kv[r]: the cells its attention reads (`n_kv_cells`); steps,
    q_scale: the optional steps of `layer_ggml._block`, on every row."""
    n_heads, n_kv_heads, head_dim, hidden, act_kind, act_lanes, task_at, task_key, hp, window = dims
    q_norm, k_norm, post_attn_norm, post_ffw_norm, act_table = steps
    N, D = h.shape
    Q = n_heads * head_dim
    K = n_kv_heads * head_dim

    # attention branch
    x = np.empty((N, D), np.float32)
    call_native(fns[NORM1], keys[NORM1], (h, attn_norm, eps, x))
    acts = _quantized_rows(fns, keys, x, _formats(kinds, WQ, WV + 1))
    yq = np.empty((N, Q), np.float32)
    yk = np.empty((N, K), np.float32)
    yv = np.empty((N, K), np.float32)
    _product_rows(fns, keys, kinds, WQ, nt, wq, acts, yq)
    _product_rows(fns, keys, kinds, WK, nt, wk, acts, yk)
    _product_rows(fns, keys, kinds, WV, nt, wv, acts, yv)
    # each row's heads normed in one call, as `rms_norm` of (N, H, E): a row is reduced on its own
    q = _head_norms(fns, keys, NORM1, yq.reshape((N, n_heads, head_dim)), q_norm, eps)  # (N, H, E)
    k = _head_norms(fns, keys, NORM1, yk.reshape((N, n_kv_heads, head_dim)), k_norm, eps)  # (N, G, E)
    qr = np.empty((N, n_heads, head_dim), np.float32)  # (N, H, E)
    kr = np.empty((N, n_kv_heads, head_dim), np.float32)  # (N, G, E)
    call_native(fns[ROPE], keys[ROPE], (q, cos, sin, neox, qr))
    call_native(fns[ROPE], keys[ROPE], (k, cos, sin, neox, kr))
    _scale_q(qr, q_scale)
    # every row's `cache.update` before any attention: a row reads its cache's positions 0..its own only
    for r in range(N):
        p = pos[r]
        kc = carray(u16_pointer(k_at[r]), (p + 1, n_kv_heads, head_dim))
        vc = carray(u16_pointer(v_at[r]), (p + 1, n_kv_heads, head_dim))
        for g in range(n_kv_heads):
            for e in range(head_dim):
                kc[p, g, e] = _f16_bits(kr[r, g, e])
                vc[p, g, e] = _f16_bits(yv[r, g * head_dim + e])
    attn = np.empty((N, n_heads, head_dim), np.float32)  # (N, H, E)
    for r in range(N):  # `x86.attention` of row r alone, over positions 0..pos[r] of its cache
        p = pos[r]
        kc = carray(u16_pointer(k_at[r]), (p + 1, n_kv_heads, head_dim))
        vc = carray(u16_pointer(v_at[r]), (p + 1, n_kv_heads, head_dim))
        task = (task_at, task_key)
        args = (qr[r], kc, vc, p, p + 1, n_kv[r], scale, window, sinks, task, hp, nt, attn[r])
        call_native(fns[ATTN], keys[ATTN], args)
    acts = _quantized_rows(fns, keys, attn.reshape((N, Q)), _formats(kinds, WO, WO + 1))
    yo = np.empty((N, D), np.float32)
    _product_rows(fns, keys, kinds, WO, nt, wo, acts, yo)
    yo = _post_norm(fns, keys, NORM1, yo, post_attn_norm, eps)
    h1 = np.empty((N, D), np.float32)
    for r in range(N):
        for c in range(D):
            h1[r, c] = h[r, c] + yo[r, c]

    # feed-forward branch
    x2 = np.empty((N, D), np.float32)
    call_native(fns[NORM2], keys[NORM2], (h1, ffn_norm, eps, x2))
    acts = _quantized_rows(fns, keys, x2, _formats(kinds, WG, WU + 1))
    gate = np.empty((N, hidden), np.float32)
    up = np.empty((N, hidden), np.float32)
    _product_rows(fns, keys, kinds, WG, nt, wg, acts, gate)
    _product_rows(fns, keys, kinds, WU, nt, wu, acts, up)
    act = np.empty((N, hidden), np.float32)
    one, one_act = np.empty((1, hidden), np.float32), np.empty((1, hidden), np.float32)
    for r in range(N):  # each row alone, as `Model.feed_forward` calls the activation (SIMD body and tail differ)
        for c in range(hidden):
            one[0, c] = gate[r, c]
        _activation(fns, keys, ACT, act_kind, act_lanes, act_table, one, one_act)
        for c in range(hidden):
            act[r, c] = one_act[0, c] * up[r, c]
    acts = _quantized_rows(fns, keys, act, _formats(kinds, WD, WD + 1))
    yd = np.empty((N, D), np.float32)
    _product_rows(fns, keys, kinds, WD, nt, wd, acts, yd)
    yd = _post_norm(fns, keys, NORM2, yd, post_ffw_norm, eps)
    out = np.empty((N, D), np.float32)
    for r in range(N):
        for c in range(D):
            out[r, c] = h1[r, c] + yd[r, c]
    return out


def _rows_native(iw: int8dot.Int8Weight) -> tuple[tuple[int, int], int]:
    """((address, key) of the kernel `int8rows.product_rows` runs for `iw` on N rows, rows per call (0: all))."""
    if iw.kernel in _adapters():  # the FP4 wrappers pick their kernel by the row count: not followed here
        raise _Unfusable
    kernel, _, args = _product_kernel(iw)
    rows = int8rows._ROWS.get(iw.kernel)
    chunk = 0 if rows is not None or iw.kernel in int8rows._ANY_ROWS else int8rows.ONE_ROW_BELOW - 1
    kernel = rows or kernel
    return native(kernel, (1, iw.raw, *args, np.zeros((1, iw.rows), np.float32))), chunk


class FusedGgmlRows(FusedGgmlLayer):
    """`FusedGgmlLayer`'s prepared arguments, with each product's N-row kernel (`int8rows`) and its chunk."""

    def __init__(self, config, w, backend):
        super().__init__(config, w, backend)
        rows = [_rows_native(backend.int8_weight(getattr(w, name))) for name in _MATRICES]
        self.fns[:7] = [address for (address, _), _ in rows]
        self.keys[:7] = [key for (_, key), _ in rows]
        self.kinds = np.ascontiguousarray(np.column_stack([self.kinds, [chunk for _, chunk in rows]]))  # (7, 3)

    def rows(self, backend, h, cos, sin, k_at, v_at, pos, window: int) -> np.ndarray | None:
        """The block's output for N rows, or None while `_block_rows` is still compiling for these types."""
        nt = backend._threads_for(self.hidden * self.o_rows)  # one count for the whole call, as the one-row block
        hp = self.n_heads // self.n_kv if self.n_kv >= nt else 1  # query heads per attention task, as x86
        n_kv = np.array([n_kv_cells(int(p) + 1) for p in pos], np.int64)
        args = (
            self.fns,
            self.keys,
            self.kinds,
            nt,
            h,
            self.attn_norm,
            self.ffn_norm,
            self.eps,
            *self.raws,
            cos,
            sin,
            self.neox,
            k_at,
            v_at,
            pos,
            n_kv,
            self.scale,
            _NO_SINKS,
            self.steps,
            self.q_scale,
            (*self.dims, hp, window),
        )
        if not self.ready:
            self.ready = compiled_in_background(_block_rows, args, wait=not BACKGROUND)
            if not self.ready:
                return None
        return _block_rows(*args)


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> {id(LayerWeights): entry|False}


def fused_rows(backend, config, w, i: int) -> FusedGgmlRows | None:
    """The prepared FusedGgmlRows of layer `i`'s weights `w` on `backend`, or None when the layer cannot be fused
    (decided once per layer: what `Model.forward` asks before `decode_block`, `ModelConfig.fused_block`, e.g. no
    NoPE layer, and `can_fuse`)."""
    try:
        per_backend = _LAYERS.setdefault(backend, {})
    except TypeError:  # a backend that cannot be weakly referenced
        return None
    entry = per_backend.get(id(w))
    if entry is None or (entry is not False and entry.w is not w):
        entry = False
        if config.fused_block(i) and can_fuse(config, w, backend):
            try:
                entry = FusedGgmlRows(config, w, backend)
            except _Unfusable:
                pass
        per_backend[id(w)] = entry
    return entry or None


_STEP: list[_Step] = []  # the last pass's per-row arrays (`layer_rows._Step`, over f16 caches)


def decode_rows(backend, config, w, i: int, h: np.ndarray, positions, cos, sin, caches) -> np.ndarray | None:
    """`Model.block_rows(h, i, positions, cos, sin, caches)` in one compiled call, bit-identical: h (N, D),
    row r at positions[r] of caches[r] (a cache may hold several consecutive rows, in order), writing each
    row's K and V as `cache.update` does. None (nothing computed, nothing written) when this layer or call
    cannot be fused: then call `Model.block_rows`."""
    if DISABLED:
        return None
    layer = fused_rows(backend, config, w, i)
    if layer is None:
        return None
    step = _STEP[0] if _STEP and _STEP[0].matches(positions, caches) else None
    if step is None:
        step = _Step(positions, caches, config, np.float16)
        _STEP[:] = [step]
    if step.k_at is None or i not in step.layers or h.shape != (len(step.pos), config.dim):
        return None
    if backend._pending:  # the block takes every kernel's address: all of them loaded here, none compiled twice
        backend.await_compiles()
    row = i - step.layers.start
    h = np.ascontiguousarray(h, np.float32)
    cos = np.ascontiguousarray(cos, np.float32)
    sin = np.ascontiguousarray(sin, np.float32)
    window = int(config.window(i) or 0)
    return layer.rows(backend, h, cos, sin, step.k_at[row], step.v_at[row], step.pos, window)
