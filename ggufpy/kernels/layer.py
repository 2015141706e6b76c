"""One compiled call per decode block: `Model.block` for a single token (T == 1) in the exact numerics.

    from ggufpy.kernels import layer
    h = layer.decode_block(backend, cfg, w, i, h, pos, cos, sin, cache)   # None: not fusable, use Model.block

During decode, `Model.block` spends about a third of its time in Python between the kernels (four products,
attention, two RMSNorms, two RoPEs, the cache write, residual adds, SiLU * up). Here one jitted function
runs the whole block, calling the *same* compiled kernels as the separate path (for each product the
sub-block sums and the batched row kernel of its storage family, `nib`/`nib6`/`i8`, as `NumbaBackend.linear`
runs a one-row product: `batched.matvec_rows`), with arguments of the same types, in the same order:

    _rms_norm -> _rows_* (stacked Q/K/V) -> _rope (q, k) -> cache write -> _attention -> _rows_* (o)
    -> + h -> _rms_norm -> _rows_* (stacked gate/up) -> _silu -> * up -> _rows_* (down) -> + h

It calls them at their addresses (`_numba.native`, `call_native`), not as numba functions: numba would link
each callee into the block and optimize and generate it again (13-18 s on a cold cache, for every family
the run-time choice could pick); this way the block compiles only its glue and runs the very machine code
`Model.block` runs, so the result is bit-identical to `Model.block` with the `NumbaBackend` (the tests check
`np.array_equal` on logits and KV caches). The block compiles on a background thread (`BACKGROUND`); until
it is ready `decode_block` returns None and `Model.block` computes the same values.

Attention gets the whole cache arrays: the kernel only reads keys 0..pos, so this is the same computation
as on the cache's view of positions 0..pos, without a copy.

Scope (`can_fuse`): NumbaBackend with the exact numerics, packed (quantized) weights, no Q/K/V biases, no
attention softcap, no residual scale, SiLU or GELU (tanh); with or without per-head Q/K norms (qwen3, gemma3),
post-norms and Q scaling (gemma2/3), a sliding window. Everything else (and T > 1, and tracing) goes through
`Model.block`.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np

from .. import ops
from ._numba import call_native, compiled_in_background, jit, native
from .attention import _attention
from .backend import FLOAT_TYPES, NumbaBackend
from .batched import _sub_sums, row_kernel
from .layout import PACKED_TYPES
from .matvec import plan
from .ops import _gelu_tanh, _rms_norm, _rope, _silu

__all__ = ["FusedLayer", "can_fuse", "decode_block", "fused_layer"]


@jit(inline=True)
def _product(fns, keys, slot, nt, w, x, out):
    """`batched.matvec_rows` of weight arguments `w` (`matvec.plan`), as `NumbaBackend.linear` runs it for one
    row: the sub-block sums of x, then the family's row kernel at fns[slot]; out (N, G*64) = x @ W.T."""
    sums = np.empty((x.shape[0], w[0].shape[1]), np.float32)
    call_native(fns[SUMS], keys[SUMS], (x, w[0].shape[2], sums))
    call_native(fns[slot], keys[slot], (nt, w[0], w[1], w[2], w[3], w[4], w[5], w[6], x, sums, out))


# Compile `_block` on a background thread the first time (seconds, on a cold numba cache) and run the layers
# through `Model.block` meanwhile: the same kernels in the same order, so the switch changes no value.
BACKGROUND = True

# slots of the kernel addresses a block calls (`FusedLayer.fns`): the products, then the glue
QKV0, QKV1, QKV2, GU0, GU1, OUT, DOWN, ATTN, NORM, ROPE, SILU, SUMS = range(12)


@jit
def _block(
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
    kc,
    vc,
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
    """The block for one token. Each kernel is called at its address (fns[slot], keys[slot]: `native`), so
    this function compiles without the kernels' code and they run as the very code `Model.block` calls.
    Optional steps (`Model.attention`, `Model._residual`), each off with an empty weight or a 0: Q/K norms per
    head (qwen3, gemma3), Q scaled after RoPE (gemma's `scale_q`), a sliding window, norms on each branch's
    output (gemma2/3's post-norms)."""
    D = h.shape[1]
    Q = n_heads * head_dim
    K = n_kv * head_dim

    # attention branch
    x = np.empty((1, D), np.float32)
    call_native(fns[NORM], keys[NORM], (h, attn_norm, eps, x))
    y0 = np.empty((1, s0[0].shape[0] * 64), np.float32)
    _product(fns, keys, QKV0, nt, s0, x, y0)
    y1 = y0
    y2 = y0
    if n_qkv > 1:
        y1 = np.empty((1, s1[0].shape[0] * 64), np.float32)
        _product(fns, keys, QKV1, nt, s1, x, y1)
    if n_qkv > 2:
        y2 = np.empty((1, s2[0].shape[0] * 64), np.float32)
        _product(fns, keys, QKV2, nt, s2, x, y2)
    q = np.empty((1, n_heads, head_dim), np.float32)
    k = np.empty((1, n_kv, head_dim), np.float32)
    v = np.empty((1, n_kv, head_dim), np.float32)
    qf = q.reshape(Q)
    kf = k.reshape(K)
    vf = v.reshape(K)
    for j in range(3):
        slot = qkv_map[j, 0]
        lo = qkv_map[j, 1]
        src = y0 if slot == 0 else (y1 if slot == 1 else y2)
        if j == 0:
            for c in range(Q):
                qf[c] = src[0, lo + c]
        elif j == 1:
            for c in range(K):
                kf[c] = src[0, lo + c]
        else:
            for c in range(K):
                vf[c] = src[0, lo + c]
    if q_norm.shape[0] > 0:  # RMSNorm of each head's row, as `rms_norm` of (1, H, E) reshaped to (H, E)
        qn = np.empty_like(q)
        kn = np.empty_like(k)
        call_native(fns[NORM], keys[NORM], (q.reshape(n_heads, head_dim), q_norm, eps, qn.reshape(n_heads, head_dim)))
        call_native(fns[NORM], keys[NORM], (k.reshape(n_kv, head_dim), k_norm, eps, kn.reshape(n_kv, head_dim)))
        q = qn
        k = kn
    qr = np.empty_like(q)
    kr = np.empty_like(k)
    call_native(fns[ROPE], keys[ROPE], (q, cos, sin, neox, qr))
    call_native(fns[ROPE], keys[ROPE], (k, cos, sin, neox, kr))
    if q_scale != 0:  # q * (1/sqrt(E)) in f32 after RoPE, the attention's own scale then 1 (`Model.attention`)
        for hd in range(n_heads):
            for e in range(head_dim):
                qr[0, hd, e] = qr[0, hd, e] * q_scale
    # cache.update, element by element: an array assignment `kc[pos] = kr[0]` would compile numba's
    # shape-mismatch message formatting (string joins, seconds of compile time)
    for g in range(n_kv):
        for e in range(head_dim):
            kc[pos, g, e] = kr[0, g, e]
            vc[pos, g, e] = v[0, g, e]
    attn = np.empty((1, n_heads, head_dim), np.float32)
    softcap = np.float32(0.0)
    # reads keys 0..pos only (pos-window+1..pos with a window)
    call_native(fns[ATTN], keys[ATTN], (nt, qr, kc, vc, pos, scale, window, softcap, attn))
    yo = np.empty((1, wo[0].shape[0] * 64), np.float32)
    _product(fns, keys, OUT, nt, wo, attn.reshape(1, Q), yo)
    yo = _post_norm(fns, keys, yo, post_attn_norm, eps, D)
    h1 = np.empty((1, D), np.float32)
    for c in range(D):
        h1[0, c] = h[0, c] + yo[0, c]

    # feed-forward branch
    x2 = np.empty((1, D), np.float32)
    call_native(fns[NORM], keys[NORM], (h1, ffn_norm, eps, x2))
    z0 = np.empty((1, g0[0].shape[0] * 64), np.float32)
    _product(fns, keys, GU0, nt, g0, x2, z0)
    z1 = z0
    if n_gu > 1:
        z1 = np.empty((1, g1[0].shape[0] * 64), np.float32)
        _product(fns, keys, GU1, nt, g1, x2, z1)
    gate = np.empty(hidden, np.float32)
    src = z0 if gu_map[0, 0] == 0 else z1
    lo = gu_map[0, 1]
    for c in range(hidden):
        gate[c] = src[0, lo + c]
    act = np.empty(hidden, np.float32)
    call_native(fns[SILU], keys[SILU], (gate, act))
    src = z0 if gu_map[1, 0] == 0 else z1
    lo = gu_map[1, 1]
    prod = np.empty((1, hidden), np.float32)
    for c in range(hidden):
        prod[0, c] = act[c] * src[0, lo + c]
    yd = np.empty((1, wd[0].shape[0] * 64), np.float32)
    _product(fns, keys, DOWN, nt, wd, prod, yd)
    yd = _post_norm(fns, keys, yd, post_ffw_norm, eps, D)
    out = np.empty((1, D), np.float32)
    for c in range(D):
        out[0, c] = h1[0, c] + yd[0, c]
    return out


@jit(inline=True)
def _post_norm(fns, keys, y, weight, eps, D):
    """y (N, >= D) as `Model._residual` adds it: RMSNorm of its first D columns where there is a weight."""
    if weight.shape[0] == 0:
        return y
    N = y.shape[0]
    branch = np.empty((N, D), np.float32)
    for r in range(N):
        for c in range(D):
            branch[r, c] = y[r, c]
    normed = np.empty((N, D), np.float32)
    call_native(fns[NORM], keys[NORM], (branch, weight, eps, normed))
    return normed


def can_fuse(config, w, backend) -> bool:
    """Whether `decode_block` computes layer weights `w` of a model with `config` on `backend` (checks the
    layer-independent conditions and the weights; `decode_block` also needs T == 1 and no sliding window)."""
    if type(backend) is not NumbaBackend:
        return False
    nm = backend.numerics
    arch = config.arch
    if (
        nm.quantize_activations
        or nm.attention is not ops.attention
        or nm.rope is not ops.rope
        or nm.activations.get(arch.activation) is not ops.ACTIVATIONS.get(arch.activation)
        or arch.activation not in ACTIVATION_KERNELS
        or nm.kv_dtype != np.float32
        or (backend.blas_rows is not None and backend.blas_rows <= 1)
    ):
        return False
    if config.attn_softcap or config.residual_scale or arch.qk_norm_span != "head":
        return False
    if any(getattr(w, name, None) is not None for name in ("attn_q_bias", "attn_k_bias", "attn_v_bias")):
        return False
    if (w.attn_q_norm is None) != (w.attn_k_norm is None):
        return False
    mats = (w.attn_q, w.attn_k, w.attn_v, w.attn_output, w.ffn_gate, w.ffn_up, w.ffn_down)
    if any(m.type in FLOAT_TYPES or m.type not in PACKED_TYPES or len(m.shape) != 2 for m in mats):
        return False
    Q, K = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return (
        w.attn_q.shape[0] == Q
        and w.attn_k.shape[0] == K
        and w.attn_v.shape[0] == K
        and w.attn_output.shape[1] == Q
        and w.ffn_gate.shape[0] == w.ffn_up.shape[0] == w.ffn_down.shape[1]
    )


def optional_steps(config, w) -> tuple:
    """(attention scale, Q scale or 0, Q norm, K norm, post-attention norm, post-FFN norm; an empty array for a
    norm the layer lacks) as `Model.attention` and `Model._residual` apply them: the scale is 1.0f/sqrtf(E) or
    the file's attention.scale, or 1 when Q itself is scaled (`scale_q`)."""
    inv_sqrt = np.float32(np.float32(1.0) / np.sqrt(np.float32(config.head_dim)))
    q_scale = inv_sqrt if config.arch.scale_q else np.float32(0.0)
    scale = np.float32(1.0) if config.arch.scale_q else np.float32(config.attention_scale or inv_sqrt)
    none = np.zeros(0, np.float32)
    norms = (w.attn_q_norm, w.attn_k_norm, w.post_attention_norm, w.post_ffw_norm)
    return (scale, q_scale, *(none if a is None else np.ascontiguousarray(a, np.float32) for a in norms))


def _f32(ndim: int) -> np.ndarray:
    """A sample f32 array of `ndim` dims: `native` compiles for argument types, which ignore shapes."""
    return np.empty((1,) * ndim, np.float32)


def _rows_native(family: str, args: tuple) -> tuple[int, int]:
    """`native` of the batched row kernel of `family` for weight arguments `args`, as `_product` calls it."""
    kernel = row_kernel(family, args) if len(args) == 7 else None
    if kernel is None:
        raise _Unfusable
    return native(kernel, (1, *args, _f32(2), _f32(2), _f32(2)))


# the activation kernels `Model.feed_forward` runs through `NumbaBackend.compiled` (slot SILU holds the layer's)
ACTIVATION_KERNELS = {"silu": _silu, "gelu_tanh": _gelu_tanh}


@functools.cache
def _glue_natives(activation: str = "silu") -> list[tuple[int, int]]:
    """`native` of attention, RMSNorm, RoPE, the activation and the sub-block sums (slots ATTN, NORM, ROPE,
    SILU, SUMS), as `_block` calls them and as `Model.block` does through `NumbaBackend` (the same argument
    types)."""
    attention = (1, _f32(3), _f32(3), _f32(3), 0, np.float32(1), 0, np.float32(0), _f32(3))
    return [
        native(_attention, attention),
        native(_rms_norm, (_f32(2), _f32(1), np.float32(1e-6), _f32(2))),
        native(_rope, (_f32(3), _f32(2), _f32(2), True, _f32(3))),
        native(ACTIVATION_KERNELS[activation], (_f32(1), _f32(1))),
        native(_sub_sums, (_f32(2), 1, _f32(2))),
    ]


class _Unfusable(Exception):
    """A weight whose storage family has no batched row kernel (`batched.row_kernel`; e.g. "blocks")."""


def _planned(backend, w):
    """(storage family, weight arguments) of one product, from the backend's own `matvec.plan`."""
    p = backend.packed(w)
    planned = backend._plans.get(w)
    if planned is None:
        planned = backend._plans[w] = plan(p)
    return p.family, planned[1]


def _slots(backend, ws):
    """[(family, weight arguments)] per product and (len(ws), 2) int64 [slot, first column] per weight, from
    the same stacks `NumbaBackend.linears` uses (made here if it has not made them yet)."""
    groups = backend._stacks.get(ws)
    if groups is None:
        groups = backend._stacks[ws] = backend._stack_groups(ws)
    slots, where = [], np.zeros((len(ws), 2), np.int64)
    for members, stack in groups:
        if stack is None:
            (i,) = members
            slots.append(_planned(backend, ws[i]))
            where[i] = (len(slots) - 1, 0)
            continue
        p, planned, spans = stack
        slots.append((p.family, planned[1]))
        for i, (lo, _rows) in zip(members, spans, strict=True):
            where[i] = (len(slots) - 1, lo)
    return slots, where


class FusedLayer:
    """The prepared arguments of one layer on one backend (packed weights, stacks, maps) and its function."""

    def __init__(self, config, w, backend: NumbaBackend):
        self.w = w  # keeps the LayerWeights alive while this entry is keyed by its id
        qkv_slots, self.qkv_map = _slots(backend, (w.attn_q, w.attn_k, w.attn_v))
        gu_slots, self.gu_map = _slots(backend, (w.ffn_gate, w.ffn_up))
        self.n_qkv, self.n_gu = len(qkv_slots), len(gu_slots)
        # unused slots repeat slot 0 (never called)
        qkv_slots += [qkv_slots[0]] * (3 - len(qkv_slots))
        gu_slots += [gu_slots[0]] * (2 - len(gu_slots))
        self.qkv_args = tuple(args for _, args in qkv_slots)
        self.gu_args = tuple(args for _, args in gu_slots)
        out_slot, down_slot = _planned(backend, w.attn_output), _planned(backend, w.ffn_down)
        self.wo, self.wd = out_slot[1], down_slot[1]
        self.o_rows = w.attn_output.shape[0]
        self.attn_norm = np.ascontiguousarray(w.attn_norm, np.float32)
        self.ffn_norm = np.ascontiguousarray(w.ffn_norm, np.float32)
        self.eps = np.float32(config.norm_eps)
        self.neox = config.arch.rope_style != "norm"
        self.n_heads, self.n_kv, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.hidden = w.ffn_gate.shape[0]
        self.scale, self.q_scale, self.q_norm, self.k_norm, self.post_attn_norm, self.post_ffw_norm = optional_steps(
            config, w
        )
        # the kernels' addresses in slot order (QKV0..DOWN, then ATTN, NORM, ROPE, SILU, SUMS), compiled (or
        # loaded from the disk cache) for the very argument types `_block` passes
        natives = [_rows_native(*slot) for slot in (*qkv_slots, *gu_slots, out_slot, down_slot)]
        natives += _glue_natives(config.arch.activation)
        self.fns = np.array([address for address, _ in natives], np.int64)
        self.keys = np.array([key for _, key in natives], np.int64)
        self.ready = False  # whether `_block` is compiled for this layer's argument types

    def __call__(
        self, backend: NumbaBackend, h: np.ndarray, pos: int, cos, sin, kc, vc, window: int
    ) -> np.ndarray | None:
        """The block's output, or None while `_block` is still compiling for these argument types."""
        nt = backend._threads_for(self.hidden * self.o_rows)  # one count for the whole call
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
            kc,
            vc,
            pos,
            self.n_heads,
            self.n_kv,
            self.head_dim,
            self.scale,
            self.hidden,
            self.q_norm,
            self.k_norm,
            self.q_scale,
            window,
            self.post_attn_norm,
            self.post_ffw_norm,
        )
        if not self.ready:
            self.ready = compiled_in_background(_block, args, wait=not BACKGROUND)
            if not self.ready:
                return None
        return _block(*args)


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> {id(LayerWeights): FusedLayer|None}


def fused_layer(backend, config, w) -> FusedLayer | None:
    """The prepared FusedLayer of weights `w` on `backend`, or None when the layer cannot be fused."""
    try:
        per_backend = _LAYERS.setdefault(backend, {})
    except TypeError:  # a backend that cannot be weakly referenced
        return None
    entry = per_backend.get(id(w))
    if entry is None or (entry is not False and entry.w is not w):
        entry = False
        if can_fuse(config, w, backend):
            try:
                entry = FusedLayer(config, w, backend)
            except _Unfusable:
                pass
        per_backend[id(w)] = entry
    return entry or None


def decode_block(backend, config, w, i: int, h: np.ndarray, pos: int, cos, sin, cache) -> np.ndarray | None:
    """`Model.block(h, i, pos, cos, sin, cache)` for one token in one compiled call, bit-identical; writes
    K and V of position `pos` into `cache` like `cache.update`. Returns None (nothing computed, nothing
    written) when this layer or call cannot be fused: then call `Model.block`."""
    if h.shape[0] != 1:
        return None
    layer = fused_layer(backend, config, w)
    if layer is None:
        return None
    kc, vc = cache.k[i], cache.v[i]
    if kc.dtype != np.float32 or not (kc.flags.c_contiguous and vc.flags.c_contiguous):
        return None
    if not 0 <= pos < kc.shape[0] or h.shape[1] != config.dim:  # the kernel does not check bounds
        raise ValueError(f"position {pos} / hidden states {h.shape} do not fit the cache {kc.shape} / dim")
    h = np.ascontiguousarray(h, np.float32)
    cos = np.ascontiguousarray(cos, np.float32)
    sin = np.ascontiguousarray(sin, np.float32)
    return layer(backend, h, int(pos), cos, sin, kc, vc, int(config.window(i) or 0))
