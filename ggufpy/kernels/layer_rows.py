"""One compiled call per block of a batched pass: `Model.block_rows` (the server's decode step) in the exact
numerics, for N rows each at its own position of its own KV cache.

    from ggufpy.kernels import layer_rows
    h = layer_rows.decode_rows(backend, cfg, w, i, h, positions, cos, sin, caches)   # None: use block_rows

A server step at B = 8 on SmolLM2 spent ~27 ms of its ~115 ms in Python and NumPy between the ~10 compiled
calls of each layer (docs/server.md). As `layer.py` does for one row, one jitted function runs the whole block
and calls the *same* compiled kernels the rows path calls (`batched.py`'s `_sub_sums` and `_rows_*` of each
product's storage family, `attention._attention_rows`, `ops._rms_norm`, `_rope`, `_silu`) with arguments of
the same types, in the same order:

    _rms_norm -> _rows_* (stacked Q/K/V) -> _rope (q, k) -> K/V writes, every row -> _attention_rows
    -> _rows_* (o) -> + h -> _rms_norm -> _rows_* (stacked gate/up) -> _silu (all rows in one call, as
    `Model.feed_forward` makes it) -> * up -> _rows_* (down) -> + h

at their addresses (`_numba.native`, `call_native`), so the block compiles only its glue and every value is
bit for bit the rows path's: batch invariance (row b is the one-token forward pass of its sequence) is kept.
Like the rows path, every row's K and V are written before the attention reads them: a row reads its cache's
positions 0..its own only, so a prompt chunk's rows (several rows of one cache) work too.

Scope: `layer.can_fuse` (NumbaBackend, exact numerics, packed weights of the nib/nib6/i8 families, the llama-style
block with `layer._block`'s optional steps: Q/K norms per head, Q scaling, GELU, post-norms, sliding windows), f32
C-contiguous caches (`KVCache`, not `Q8Cache`). The rest goes through `Model.block_rows`. The block compiles in the
background (`BACKGROUND`, as `layer.py`); None until it is ready.
"""

from __future__ import annotations

import functools
import operator
import weakref

import numpy as np

from ._numba import DISABLED, call_native, compiled_in_background, jit, native
from .attention import _attention_rows
from .batched_ir import carray, f32_pointer
from .layer import (
    ATTN,
    DOWN,
    GU0,
    GU1,
    NORM,
    OUT,
    QKV0,
    QKV1,
    QKV2,
    ROPE,
    SILU,
    _glue_natives,
    _planned,
    _post_norm,
    _product,
    _rows_native,
    _slots,
    _Unfusable,
    can_fuse,
    optional_steps,
)

__all__ = ["FusedRows", "decode_rows", "fused_rows"]

# Compile `_block_rows` in the background the first time and run `Model.block_rows` meanwhile (same values).
BACKGROUND = True


@jit(inline=True)
def _columns(src, lo, n, out):
    """out (N, n) = src[:, lo:lo+n], element by element (a slice assignment compiles numba's shape checks)."""
    for r in range(out.shape[0]):
        for c in range(n):
            out[r, c] = src[r, lo + c]


@jit
def _block_rows(
    fns,
    keys,
    nt,
    h,
    attn_norm,
    ffn_norm,
    eps,
    s0,
    s1,
    s2,
    n_qkv,
    qkv_map,
    g0,
    g1,
    n_gu,
    gu_map,
    wo,
    wd,
    cos,
    sin,
    neox,
    k_at,
    v_at,
    pos,
    n_heads,
    n_kv,
    head_dim,
    scale,
    hidden,
    q_norm,
    k_norm,
    q_scale,
    window,
    post_attn_norm,
    post_ffw_norm,
):
    """The block for N rows, row r at position pos[r] of the cache whose layer arrays start at k_at[r],
    v_at[r] (f32 (capacity, G, E)). Each kernel is called at its address (fns[slot], keys[slot]). The optional
    steps are `layer._block`'s (`layer.optional_steps`), on every row."""
    N, D = h.shape
    Q = n_heads * head_dim
    K = n_kv * head_dim

    # attention branch
    x = np.empty((N, D), np.float32)
    call_native(fns[NORM], keys[NORM], (h, attn_norm, eps, x))
    y0 = np.empty((N, s0[0].shape[0] * 64), np.float32)
    _product(fns, keys, QKV0, nt, s0, x, y0)
    y1 = y0
    y2 = y0
    if n_qkv > 1:
        y1 = np.empty((N, s1[0].shape[0] * 64), np.float32)
        _product(fns, keys, QKV1, nt, s1, x, y1)
    if n_qkv > 2:
        y2 = np.empty((N, s2[0].shape[0] * 64), np.float32)
        _product(fns, keys, QKV2, nt, s2, x, y2)
    q = np.empty((N, n_heads, head_dim), np.float32)  # (N, H, E)
    k = np.empty((N, n_kv, head_dim), np.float32)  # (N, G, E)
    v = np.empty((N, n_kv, head_dim), np.float32)  # (N, G, E)
    for j in range(3):
        slot = qkv_map[j, 0]
        src = y0 if slot == 0 else (y1 if slot == 1 else y2)
        if j == 0:
            _columns(src, qkv_map[j, 1], Q, q.reshape(N, Q))
        elif j == 1:
            _columns(src, qkv_map[j, 1], K, k.reshape(N, K))
        else:
            _columns(src, qkv_map[j, 1], K, v.reshape(N, K))
    if q_norm.shape[0] > 0:  # RMSNorm of each row's heads, as `rms_norm` of (N, H, E) reshaped to (N*H, E)
        qn = np.empty_like(q)
        kn = np.empty_like(k)
        call_native(
            fns[NORM], keys[NORM], (q.reshape(N * n_heads, head_dim), q_norm, eps, qn.reshape(N * n_heads, head_dim))
        )
        call_native(fns[NORM], keys[NORM], (k.reshape(N * n_kv, head_dim), k_norm, eps, kn.reshape(N * n_kv, head_dim)))
        q = qn
        k = kn
    qr = np.empty_like(q)
    kr = np.empty_like(k)
    call_native(fns[ROPE], keys[ROPE], (q, cos, sin, neox, qr))
    call_native(fns[ROPE], keys[ROPE], (k, cos, sin, neox, kr))
    if q_scale != 0:  # q * (1/sqrt(E)) after RoPE (`scale_q`)
        for r in range(N):
            for hd in range(n_heads):
                for e in range(head_dim):
                    qr[r, hd, e] = qr[r, hd, e] * q_scale
    # `KVCache.update` of every row, then attention: row r reads positions 0..pos[r] of its own cache
    lengths = np.empty(N, np.int64)
    for r in range(N):
        p = pos[r]
        lengths[r] = p + 1
        kc = carray(f32_pointer(k_at[r]), (p + 1, n_kv, head_dim))
        vc = carray(f32_pointer(v_at[r]), (p + 1, n_kv, head_dim))
        for g in range(n_kv):
            for e in range(head_dim):
                kc[p, g, e] = kr[r, g, e]
                vc[p, g, e] = v[r, g, e]
    attn = np.empty((N, n_heads, head_dim), np.float32)  # (N, H, E)
    softcap = np.float32(0.0)
    call_native(fns[ATTN], keys[ATTN], (nt, qr, k_at, v_at, lengths, n_kv, scale, window, softcap, attn))
    yo = np.empty((N, wo[0].shape[0] * 64), np.float32)
    _product(fns, keys, OUT, nt, wo, attn.reshape(N, Q), yo)
    yo = _post_norm(fns, keys, yo, post_attn_norm, eps, D)
    h1 = np.empty((N, D), np.float32)
    for r in range(N):
        for c in range(D):
            h1[r, c] = h[r, c] + yo[r, c]

    # feed-forward branch
    x2 = np.empty((N, D), np.float32)
    call_native(fns[NORM], keys[NORM], (h1, ffn_norm, eps, x2))
    z0 = np.empty((N, g0[0].shape[0] * 64), np.float32)
    _product(fns, keys, GU0, nt, g0, x2, z0)
    z1 = z0
    if n_gu > 1:
        z1 = np.empty((N, g1[0].shape[0] * 64), np.float32)
        _product(fns, keys, GU1, nt, g1, x2, z1)
    gate = np.empty((N, hidden), np.float32)  # (N, F)
    _columns(z0 if gu_map[0, 0] == 0 else z1, gu_map[0, 1], hidden, gate)
    act = np.empty((N, hidden), np.float32)
    call_native(fns[SILU], keys[SILU], (gate.reshape(N * hidden), act.reshape(N * hidden)))
    src = z0 if gu_map[1, 0] == 0 else z1
    lo = gu_map[1, 1]
    prod = np.empty((N, hidden), np.float32)
    for r in range(N):
        for c in range(hidden):
            prod[r, c] = act[r, c] * src[r, lo + c]
    yd = np.empty((N, wd[0].shape[0] * 64), np.float32)
    _product(fns, keys, DOWN, nt, wd, prod, yd)
    yd = _post_norm(fns, keys, yd, post_ffw_norm, eps, D)
    out = np.empty((N, D), np.float32)
    for r in range(N):
        for c in range(D):
            out[r, c] = h1[r, c] + yd[r, c]
    return out


def _f32(ndim: int) -> np.ndarray:
    """A sample f32 array of `ndim` dims: `native` compiles for argument types, which ignore shapes."""
    return np.empty((1,) * ndim, np.float32)


@functools.cache
def _rows_attention_native() -> tuple[int, int]:
    """`native` of the batched attention (slot ATTN), as `_block_rows` calls it and as the rows path does
    (`batched.attention_rows`); the other slots are `layer.py`'s, with the same kernels."""
    i64 = np.empty(1, np.int64)
    return native(_attention_rows, (1, _f32(3), i64, i64, i64, 1, np.float32(1), 0, np.float32(0), _f32(3)))


class FusedRows:
    """The prepared arguments of one layer on one backend (packed weights, stacks, maps) and its function."""

    def __init__(self, config, w, backend, window: int = 0):
        self.w = w  # keeps the LayerWeights alive while this entry is keyed by its id
        qkv_slots, self.qkv_map = _slots(backend, (w.attn_q, w.attn_k, w.attn_v))
        gu_slots, self.gu_map = _slots(backend, (w.ffn_gate, w.ffn_up))
        self.n_qkv, self.n_gu = len(qkv_slots), len(gu_slots)
        qkv_slots += [qkv_slots[0]] * (3 - len(qkv_slots))  # unused slots repeat slot 0 (never called)
        gu_slots += [gu_slots[0]] * (2 - len(gu_slots))
        out_slot, down_slot = _planned(backend, w.attn_output), _planned(backend, w.ffn_down)
        self.qkv_args = tuple(args for _, args in qkv_slots)
        self.gu_args = tuple(args for _, args in gu_slots)
        self.wo, self.wd = out_slot[1], down_slot[1]
        self.attn_norm = np.ascontiguousarray(w.attn_norm, np.float32)
        self.ffn_norm = np.ascontiguousarray(w.ffn_norm, np.float32)
        self.eps = np.float32(config.norm_eps)
        self.neox = config.arch.rope_style != "norm"
        self.n_heads, self.n_kv, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.hidden = w.ffn_gate.shape[0]
        self.macs = self.hidden * w.ffn_down.shape[0]
        self.scale, self.q_scale, self.q_norm, self.k_norm, self.post_attn_norm, self.post_ffw_norm = optional_steps(
            config, w
        )
        self.window = np.int64(window)  # the layer's sliding window, 0 for none
        natives = [_rows_native(*slot) for slot in (*qkv_slots, *gu_slots, out_slot, down_slot)]
        glue = _glue_natives(config.arch.activation)[1:]  # NORM, ROPE, the activation (slot SILU), SUMS
        natives += [_rows_attention_native(), *glue]
        self.fns = np.array([address for address, _ in natives], np.int64)
        self.keys = np.array([key for _, key in natives], np.int64)
        self.ready = False  # whether `_block_rows` is compiled for this layer's argument types

    def __call__(self, backend, h, cos, sin, k_at, v_at, pos) -> np.ndarray | None:
        """The block's output, or None while `_block_rows` is still compiling for these argument types."""
        nt = backend._threads_for(len(h) * self.macs)  # one count for the whole call (no value depends on it)
        args = (
            self.fns,
            self.keys,
            nt,
            h,
            self.attn_norm,
            self.ffn_norm,
            self.eps,
            *self.qkv_args,
            self.n_qkv,
            self.qkv_map,
            *self.gu_args,
            self.n_gu,
            self.gu_map,
            self.wo,
            self.wd,
            cos,
            sin,
            self.neox,
            k_at,
            v_at,
            pos,
            self.n_heads,
            self.n_kv,
            self.head_dim,
            self.scale,
            self.hidden,
            self.q_norm,
            self.k_norm,
            self.q_scale,
            self.window,
            self.post_attn_norm,
            self.post_ffw_norm,
        )
        if not self.ready:
            self.ready = compiled_in_background(_block_rows, args, wait=not BACKGROUND)
            if not self.ready:
                return None
        return _block_rows(*args)


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> {id(LayerWeights): FusedRows|False}


def fused_rows(backend, config, w, i: int) -> FusedRows | None:
    """The prepared FusedRows of layer `i`'s weights `w` on `backend`, or None when the layer cannot be fused
    (decided once per layer: what `Model.forward` asks before `decode_block`, and `layer.can_fuse`)."""
    from .backend import _has_block_types  # (backend.py imports layer.py, which this module imports)

    try:
        per_backend = _LAYERS.setdefault(backend, {})
    except TypeError:  # a backend that cannot be weakly referenced
        return None
    entry = per_backend.get(id(w))
    if entry is None or (entry is not False and entry.w is not w):
        entry = False
        if config.fused_block(i) and not _has_block_types(w) and can_fuse(config, w, backend):
            try:
                entry = FusedRows(config, w, backend, int(config.window(i) or 0))
            except _Unfusable:
                pass
        per_backend[id(w)] = entry
    return entry or None


class _Step:
    """The per-row arrays of one batched pass, made at its first layer and reused by the others (every layer
    of a pass gets the same positions and caches): positions (N,) int64, and each layer's K and V array
    addresses (L, N) int64 of the rows' caches (of `dtype`: f32, or the llamacpp numerics' f16)."""

    def __init__(self, positions, caches, config, dtype=np.float32):
        self.source = positions  # held: a pass's layers get this one list (a new pass, a new step)
        self.positions, self.caches = list(positions), list(caches)
        self.pos = np.array(positions, np.int64)
        self.layers = caches[0].layers if caches else range(0)
        self.k_at = self.v_at = None
        shape = (config.n_kv_heads, config.head_dim)
        tables = [_addresses(c, shape, dtype) for c in caches]
        if all(t is not None for t in tables) and all(c.layers == self.layers for c in caches):
            fits = all(0 <= p < c.capacity for p, c in zip(positions, caches, strict=True))
            if not fits:  # the kernel does not check bounds (`Model.prefill_batch` checked them already)
                raise ValueError(f"positions {positions} do not fit the caches' capacities")
            self.k_at = np.ascontiguousarray(np.stack([t[0] for t in tables], axis=1))  # (L, N)
            self.v_at = np.ascontiguousarray(np.stack([t[1] for t in tables], axis=1))  # (L, N)

    def matches(self, positions, caches) -> bool:
        same = len(caches) == len(self.caches) and all(map(operator.is_, caches, self.caches))
        return same and positions is self.source and list(positions) == self.positions


# cache -> (its K and V arrays per layer, their addresses (L,) each): a cache's arrays live as long as it does
_CACHE_ADDRESSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _addresses(cache, shape: tuple[int, int], dtype=np.float32) -> tuple[np.ndarray, np.ndarray] | None:
    """The addresses of `cache`'s K and V arrays of every layer, or None unless every one is a `dtype`
    C-contiguous (capacity, G, E) array of a plain `KVCache` (not Q8_0 blocks, nor deepseek2's latent one)."""
    if getattr(cache, "kv_type", None) is not None or not isinstance(getattr(cache, "k", None), dict):
        return None
    arrays = [cache.k[i] for i in cache.layers], [cache.v[i] for i in cache.layers]
    try:
        known = _CACHE_ADDRESSES.get(cache)
    except TypeError:
        return None
    if known is not None and all(a is b for a, b in zip(known[0], arrays[0] + arrays[1], strict=True)):
        return known[1]
    for a in arrays[0] + arrays[1]:
        if a.dtype != dtype or not a.flags.c_contiguous or a.shape[1:] != shape or len(a) != cache.capacity:
            return None
    table = tuple(np.array([a.ctypes.data for a in side], np.int64) for side in arrays)
    _CACHE_ADDRESSES[cache] = (arrays[0] + arrays[1], table)
    return table


_STEP: list[_Step] = []  # the last pass's `_Step` (one at a time: a server runs one pass after another)


def decode_rows(backend, config, w, i: int, h: np.ndarray, positions, cos, sin, caches) -> np.ndarray | None:
    """`Model.block_rows(h, i, positions, cos, sin, caches)` in one compiled call, bit-identical: h (N, D),
    row r at positions[r] of caches[r] (a cache may hold several consecutive rows, in order), writing each
    row's K and V like `cache.update`. None (nothing computed, nothing written) when this layer or call
    cannot be fused: then call `Model.block_rows`."""
    if DISABLED:  # (plain Python kernels: no addresses to read the caches from)
        return None
    layer = fused_rows(backend, config, w, i)
    if layer is None:
        return None
    step = _STEP[0] if _STEP and _STEP[0].matches(positions, caches) else None
    if step is None:
        step = _Step(positions, caches, config)
        _STEP[:] = [step]
    if step.k_at is None or i not in step.layers or h.shape != (len(step.pos), config.dim):
        return None
    if backend._pending:  # the block takes every kernel's address: all of them loaded here, none compiled twice
        backend.await_compiles()
    row = i - step.layers.start
    h = np.ascontiguousarray(h, np.float32)
    cos = np.ascontiguousarray(cos, np.float32)
    sin = np.ascontiguousarray(sin, np.float32)
    return layer(backend, h, cos, sin, step.k_at[row], step.v_at[row], step.pos)
