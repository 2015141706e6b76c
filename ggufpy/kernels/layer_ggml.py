"""One compiled call per decode block in the llamacpp numerics: `Model.block` for one token (T = 1) with ggml's
integer products, as `layer.py` does for the exact numerics.

    from ggufpy.kernels import layer_ggml
    h = layer_ggml.decode_block(backend, cfg, w, i, h, pos, cos, sin, cache)   # None: use Model.block

In the llamacpp numerics a decoded token's block is ~15 compiled calls with Python and small NumPy steps
between them (on an 8-layer dim-1024 TQ2_0 model, ~2.4 ms of an 8 ms token). Here one jitted function runs the
block and calls the *same* compiled kernels `Model.block` calls through `NumbaBackend`, with arguments of the
same types, in the same order:

    _rms_norm -> quantize (each activation format the Q/K/V weights read, `int8dot.quantize`) -> Q, K, V
    products (`int8dot.product`: the weight's integer kernel) -> [_rms_norm of each Q and K head] ->
    `glue_ggml._rope` (q, k) -> [q * 1/sqrt(E)] -> K/V rounded to f16 into the cache ->
    `x86_decode._attention_one` -> quantize -> O product -> [_rms_norm] -> + h -> _rms_norm -> quantize ->
    gate, up products -> the activation -> * up -> quantize -> down product -> [_rms_norm] -> + h

at their addresses (`_numba.native`, `call_native`), so the block compiles only its glue and its values are
`Model.block`'s bit for bit (tests/test_kernels_layer_ggml.py). The steps in brackets are the optional ones of
the exact numerics' block (`layer.optional_steps`: Q/K norms per head, Q scaling, post-norms; each off with an
empty weight or a 0), for gemma, gemma2, gemma3 and qwen3. The activation is the compiled function
`Model.feed_forward` calls in this numerics: SiLU (`glue_ggml._silu_rows`, or the AVX2 build's
`x86._silu_rows`), or ggml's fp16-table GELU, which the numerics computes in NumPy and
`layer_ggml_steps._gelu_ggml` looks up in the same table. The kernels' argument lists differ by type; they come
in three families (`layer_ggml_steps.FAM_*`): Q8_K activations (q, d, bsums), Q8_0/Q8_1 (q, d, s, asum), and
the FP4 kernels behind Python wrappers that take q, d, asum (`layer_ggml_steps._adapters` resolves a wrapper to
the jitted kernel it calls for that weight). Each product's family and activation format are data (`kinds`),
so one compiled block serves every weight type: it is compiled per argument types only (the weights' array
types).

Scope (`can_fuse`): NumbaBackend running the integer kernels (`NumbaBackend._integer`: llamacpp numerics,
x86 activation rounding), every one of the seven matrices with an integer kernel (`int8dot.weight`),
llama-style blocks with or without per-head Q/K norms (qwen3, gemma3), post-norms and Q scaling (gemma2/3),
SiLU or GELU, a sliding window; ggml's compiled x86 attention over an f16 `KVCache`. Not in it: an attention
softcap (gemma2 files: `x86_decode._attention_one` has none, so `NumbaBackend.attention` runs the NumPy
replay and so does `Model.block` here), Q/K norms over all heads (olmo2), biases, sinks, a residual scale,
experts. The rest goes through `Model.block`. The block compiles in the background (`BACKGROUND`); until it
is ready `decode_block` returns None (same values).
"""

from __future__ import annotations

import weakref

import numpy as np

from ..numerics import rope_ggml
from ..quants.x86.attention import n_kv_cells
from . import glue_ggml, int8dot, x86, x86_decode
from ._numba import call_native, compiled_in_background, jit, native
from .backend import NumbaBackend, _is_x86_attention
from .layer import optional_steps
from .layer_ggml_steps import (
    FAM_K,
    FAM_Q0,
    _activation,
    _f16_bits,
    _head_norms,
    _post_norm,
    _product_native,
    _sample_activations,
    _scale_q,
    _Unfusable,
    activation_kernel,
    activation_native,
)
from .ops import _rms_norm
from .x86_decode import _attention_one

__all__ = ["FusedGgmlLayer", "can_fuse", "decode_block", "fused_layer"]

# Compile `_block` in the background the first time and run `Model.block` meanwhile (the same values).
BACKGROUND = True

# slots of the kernel addresses a block calls (`FusedGgmlLayer.fns`): the seven products, then the glue (NORM1
# also norms Q/K heads and the attention output, NORM2 the FFN output: `_rms_norm` both)
WQ, WK, WV, WO, WG, WU, WD, NORM1, NORM2, ROPE, ATTN, ACT, QUANT0, QUANTK = range(14)


@jit(inline=True)
def _formats(kinds, lo, hi):
    """Bit mask of the activation formats products lo..hi-1 read (bit FORMATS[fmt])."""
    need = 0
    for s in range(lo, hi):
        need |= 1 << kinds[s, 1]
    return need


@jit(inline=True)
def _quantized(fns, keys, x, need):
    """x (1, C) in each activation format of `need`, as `int8dot.quantize` stores them: Q8_0 and Q8_1 (q, d, s,
    asum), Q8_K (q, d, bsums). Formats not needed are left unwritten (never read)."""
    C = x.shape[1]
    q0, d0 = np.empty((1, C), np.int8), np.empty((1, C // 32), np.float32)
    s0, a0 = np.empty((1, C // 32), np.float32), np.empty((1, C // 4), np.int32)
    q1, d1 = np.empty((1, C), np.int8), np.empty((1, C // 32), np.float32)
    s1, a1 = np.empty((1, C // 32), np.float32), np.empty((1, C // 4), np.int32)
    qk, dk, bk = np.empty((1, C), np.int8), np.empty((1, C // 256), np.float32), np.empty((1, C // 16), np.int16)
    if need & 1:
        call_native(fns[QUANT0], keys[QUANT0], (x, False, q0, d0, s0, a0))
    if need & 2:
        call_native(fns[QUANT0], keys[QUANT0], (x, True, q1, d1, s1, a1))
    if need & 4:
        call_native(fns[QUANTK], keys[QUANTK], (x, qk, dk, bk))
    return (q0, d0, s0, a0), (q1, d1, s1, a1), (qk, dk, bk)


@jit(inline=True)
def _product(fns, keys, kinds, slot, nt, w, acts, out):
    """out (1, rows) = the integer kernel at fns[slot] over weight rows `w` and the activations of its format."""
    (q0, d0, s0, a0), (q1, d1, s1, a1), (qk, dk, bk) = acts
    family, fmt = kinds[slot, 0], kinds[slot, 1]
    if family == FAM_K:
        call_native(fns[slot], keys[slot], (nt, w, qk, dk, bk, out))
    elif family == FAM_Q0:
        if fmt == 1:
            call_native(fns[slot], keys[slot], (nt, w, q1, d1, s1, a1, out))
        else:
            call_native(fns[slot], keys[slot], (nt, w, q0, d0, s0, a0, out))
    elif fmt == 1:
        call_native(fns[slot], keys[slot], (nt, w, q1, d1, a1, out))
    else:
        call_native(fns[slot], keys[slot], (nt, w, q0, d0, a0, out))


@jit
def _block(
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
    kc,
    vc,
    pos,
    scale,
    sinks,
    steps,
    q_scale,
    dims,
):
    """The block for one token h (1, D) at position `pos`; kc, vc: the layer's f16 cache as u16 bits (capacity,
    G, E); steps: the optional steps' weights (Q norm, K norm, post-attention norm, post-FFN norm, each (0,)
    where the layer has none) and the activation's table (`FusedGgmlLayer.steps`); q_scale: Q's scale after
    RoPE or 0; dims: the integers of `FusedGgmlLayer.dims`. Each kernel is called at its address (fns[slot],
    keys[slot]: `native`)."""
    n_heads, n_kv_heads, head_dim, hidden, act_kind, act_lanes, task_at, task_key, hp, window, n_kv = dims
    q_norm, k_norm, post_attn_norm, post_ffw_norm, act_table = steps
    D = h.shape[1]
    Q = n_heads * head_dim
    K = n_kv_heads * head_dim

    # attention branch
    x = np.empty((1, D), np.float32)
    call_native(fns[NORM1], keys[NORM1], (h, attn_norm, eps, x))
    acts = _quantized(fns, keys, x, _formats(kinds, WQ, WV + 1))
    yq = np.empty((1, Q), np.float32)
    yk = np.empty((1, K), np.float32)
    yv = np.empty((1, K), np.float32)
    _product(fns, keys, kinds, WQ, nt, wq, acts, yq)
    _product(fns, keys, kinds, WK, nt, wk, acts, yk)
    _product(fns, keys, kinds, WV, nt, wv, acts, yv)
    q = _head_norms(fns, keys, NORM1, yq.reshape((1, n_heads, head_dim)), q_norm, eps)  # (1, H, E)
    k = _head_norms(fns, keys, NORM1, yk.reshape((1, n_kv_heads, head_dim)), k_norm, eps)  # (1, G, E)
    qr = np.empty((1, n_heads, head_dim), np.float32)  # (1, H, E)
    kr = np.empty((1, n_kv_heads, head_dim), np.float32)  # (1, G, E)
    call_native(fns[ROPE], keys[ROPE], (q, cos, sin, neox, qr))
    call_native(fns[ROPE], keys[ROPE], (k, cos, sin, neox, kr))
    _scale_q(qr, q_scale)
    # cache.update, element by element (an array assignment compiles numba's shape-mismatch messages)
    for g in range(n_kv_heads):
        for e in range(head_dim):
            kc[pos, g, e] = _f16_bits(kr[0, g, e])
            vc[pos, g, e] = _f16_bits(yv[0, g * head_dim + e])
    attn = np.empty((n_heads, head_dim), np.float32)  # (H, E)
    # reads cells 0..pos only: the whole cache is the same computation as its view of positions 0..pos
    task = (task_at, task_key)
    args = (qr.reshape((n_heads, head_dim)), kc, vc, pos, pos + 1, n_kv, scale, window, sinks, task, hp, nt, attn)
    call_native(fns[ATTN], keys[ATTN], args)
    acts = _quantized(fns, keys, attn.reshape((1, Q)), _formats(kinds, WO, WO + 1))
    yo = np.empty((1, D), np.float32)
    _product(fns, keys, kinds, WO, nt, wo, acts, yo)
    yo = _post_norm(fns, keys, NORM1, yo, post_attn_norm, eps)
    h1 = np.empty((1, D), np.float32)
    for c in range(D):
        h1[0, c] = h[0, c] + yo[0, c]

    # feed-forward branch
    x2 = np.empty((1, D), np.float32)
    call_native(fns[NORM2], keys[NORM2], (h1, ffn_norm, eps, x2))
    acts = _quantized(fns, keys, x2, _formats(kinds, WG, WU + 1))
    gate = np.empty((1, hidden), np.float32)
    up = np.empty((1, hidden), np.float32)
    _product(fns, keys, kinds, WG, nt, wg, acts, gate)
    _product(fns, keys, kinds, WU, nt, wu, acts, up)
    act = np.empty((1, hidden), np.float32)
    _activation(fns, keys, ACT, act_kind, act_lanes, act_table, gate, act)
    for c in range(hidden):
        act[0, c] = act[0, c] * up[0, c]
    acts = _quantized(fns, keys, act, _formats(kinds, WD, WD + 1))
    yd = np.empty((1, D), np.float32)
    _product(fns, keys, kinds, WD, nt, wd, acts, yd)
    yd = _post_norm(fns, keys, NORM2, yd, post_ffw_norm, eps)
    out = np.empty((1, D), np.float32)
    for c in range(D):
        out[0, c] = h1[0, c] + yd[0, c]
    return out


_NO_SINKS = np.empty(0, np.float32)
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# layer weights outside the block (the steps `Model.block` takes for them are not here)
_UNFUSED = (
    "attn_qkv", "attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_output_bias", "attn_sinks", "ffn_gate_inp",
    "mixer",
)  # fmt: skip


def can_fuse(config, w, backend) -> bool:
    """Whether `decode_block` computes layer weights `w` of a model with `config` on `backend` (the
    layer-independent conditions and the weights; `decode_block` checks T == 1 and the cache, `Model.forward`
    the architecture's per-layer steps, `ModelConfig.fused_block`). Not here: an attention softcap (gemma2's
    files: the compiled x86 attention has none, `NumbaBackend.attention` runs the NumPy replay), Q/K norms
    over all heads (olmo2), biases, a residual scale, the FP4 types' rows forms in `layer_ggml_rows`."""
    if type(backend) is not NumbaBackend or not backend._integer:
        return False
    nm = backend.numerics
    if (
        not _is_x86_attention(nm.attention)
        or backend.compiled.get(nm.rope) is not glue_ggml.rope_ggml
        or nm.rope is not rope_ggml
        or nm.kv_dtype != np.float16
        or activation_kernel(backend, config.arch.activation) is None
        or (backend.blas_rows is not None and backend.blas_rows <= 1)
    ):
        return False
    if config.attn_softcap or config.residual_scale or config.arch.qk_norm_span != "head":
        return False
    if any(getattr(w, name, None) is not None for name in _UNFUSED):
        return False
    if w.attn_norm is None or w.ffn_norm is None or (w.attn_q_norm is None) != (w.attn_k_norm is None):
        return False
    D, E = config.dim, config.head_dim
    norms = {"attn_norm": D, "ffn_norm": D, "attn_q_norm": E, "attn_k_norm": E, "post_attention_norm": D}
    norms["post_ffw_norm"] = D
    if any(getattr(w, name) is not None and getattr(w, name).shape != (n,) for name, n in norms.items()):
        return False  # (the RMSNorm kernel reads `n` weights unchecked)
    mats = [getattr(w, name, None) for name in _MATRICES]
    if any(m is None or len(m.shape) != 2 or backend.int8_weight(m) is None for m in mats):
        return False
    Q, K = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    wq, wk, wv, wo, wg, wu, wd = mats
    return (
        wq.shape == (Q, config.dim)
        and wk.shape == wv.shape == (K, config.dim)
        and wo.shape == (config.dim, Q)
        and wg.shape == wu.shape == (wd.shape[1], config.dim)
        and wd.shape[0] == config.dim
    )


class FusedGgmlLayer:
    """The prepared arguments of one layer on one backend (integer-kernel weights, kinds, addresses)."""

    def __init__(self, config, w, backend):
        self.w = w  # keeps the LayerWeights alive while this entry is keyed by its id
        nm = backend.numerics
        iws = [backend.int8_weight(getattr(w, name)) for name in _MATRICES]
        products = [_product_native(iw) for iw in iws]
        self.raws = tuple(iw.raw for iw in iws)
        self.kinds = np.array([kind for _, kind in products], np.int64)  # (7, 2): family, format
        self.attn_norm = np.ascontiguousarray(w.attn_norm, np.float32)  # as `kernels.ops.rms_norm` passes it
        self.ffn_norm = np.ascontiguousarray(w.ffn_norm, np.float32)
        self.eps = np.float32(config.norm_eps)
        self.neox = config.arch.rope_style != "norm"
        self.n_heads, self.n_kv, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.hidden = iws[4].rows
        self.o_rows = iws[3].rows
        # the attention's scale (1.0f/sqrtf(E), the file's attention.scale, or 1 with Q scaled: `scale_q`) and
        # the optional steps' weights, as `Model.attention` and `Model._residual` take them (exact numerics' too)
        self.scale, self.q_scale, *norms = optional_steps(config, w)
        act, act_kind, act_lanes, act_table = activation_native(backend, config.arch.activation, self.hidden)
        self.steps = (*norms, act_table)  # Q norm, K norm, post-attention norm, post-FFN norm, activation table
        task = x86_decode.task(x86.ISA_LANES[nm.x86_isa])  # the attention's per-head-group task, at its address
        dims = (self.n_heads, self.n_kv, self.head_dim, self.hidden, act_kind, act_lanes, *task)
        self.dims = dims  # + hp, window, n_kv per call
        D, Q = config.dim, self.n_heads * self.head_dim
        f32 = np.float32
        row, q3, k3 = np.zeros((1, D), f32), np.zeros((1, self.n_heads, 1), f32), np.zeros((1, 1, 1), np.uint16)
        glue = [
            native(_rms_norm, (row, self.attn_norm, self.eps, row)),
            native(_rms_norm, (row, self.ffn_norm, self.eps, row)),
            native(glue_ggml._rope, (q3, np.zeros((1, 1), f32), np.zeros((1, 1), f32), self.neox, q3)),
            native(_attention_one, (q3[0], k3, k3, 0, 1, 256, self.scale, 0, _NO_SINKS, (0, 0), 1, 1, q3[0])),
            act,
            native(int8dot._quantize_q8_0, (np.zeros((1, Q), f32), True, *_sample_activations(int8dot.Q8_0, 32))),
            native(int8dot._quantize_q8_k, (row, *_sample_activations(int8dot.Q8_K, 256))),
        ]
        natives = [address for address, _ in products] + glue
        self.fns = np.array([address for address, _ in natives], np.int64)
        self.keys = np.array([key for _, key in natives], np.int64)
        self.ready = False  # whether `_block` is compiled for this layer's argument types

    def __call__(self, backend, h, pos: int, window: int, cos, sin, kc, vc) -> np.ndarray | None:
        """The block's output, or None while `_block` is still compiling for these argument types."""
        nt = backend._threads_for(self.hidden * self.o_rows)  # one count for the whole call
        hp = self.n_heads // self.n_kv if self.n_kv >= nt else 1  # query heads per attention task, as x86
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
            kc,
            vc,
            pos,
            self.scale,
            _NO_SINKS,
            self.steps,
            self.q_scale,
            (*self.dims, hp, window, n_kv_cells(pos + 1)),  # the cells attention reads, as `x86.attention`
        )
        if not self.ready:
            self.ready = compiled_in_background(_block, args, wait=not BACKGROUND)
            if not self.ready:
                return None
        return _block(*args)


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> {id(LayerWeights): entry|False}


def fused_layer(backend, config, w) -> FusedGgmlLayer | None:
    """The prepared FusedGgmlLayer of weights `w` on `backend`, or None when the layer cannot be fused."""
    try:
        per_backend = _LAYERS.setdefault(backend, {})
    except TypeError:  # a backend that cannot be weakly referenced
        return None
    entry = per_backend.get(id(w))
    if entry is None or (entry is not False and entry.w is not w):
        entry = False
        if can_fuse(config, w, backend):
            try:
                entry = FusedGgmlLayer(config, w, backend)
            except _Unfusable:
                pass
        per_backend[id(w)] = entry
    return entry or None


def decode_block(backend, config, w, i: int, h: np.ndarray, pos: int, cos, sin, cache) -> np.ndarray | None:
    """`Model.block(h, i, pos, cos, sin, cache)` for one token in one compiled call, bit-identical; writes K and
    V of position `pos` into `cache` as `cache.update` does. Returns None (nothing computed, nothing written)
    when this layer or call cannot be fused: then call `Model.block`."""
    if h.shape[0] != 1 or getattr(cache, "kv_type", None) is not None:
        return None
    layer = fused_layer(backend, config, w)
    if layer is None:
        return None
    kc, vc = cache.k[i], cache.v[i]
    if kc.dtype != np.float16 or vc.dtype != np.float16 or kc.shape != vc.shape:
        return None
    if not (kc.flags.c_contiguous and vc.flags.c_contiguous):
        return None
    if not 0 <= pos < kc.shape[0] or h.shape[1] != config.dim:  # the kernel does not check bounds
        raise ValueError(f"position {pos} / hidden states {h.shape} do not fit the cache {kc.shape} / dim")
    h = np.ascontiguousarray(h, np.float32)
    cos = np.ascontiguousarray(cos, np.float32)
    sin = np.ascontiguousarray(sin, np.float32)
    window = config.window(i) or 0
    return layer(backend, h, int(pos), window, cos, sin, kc.view(np.uint16), vc.view(np.uint16))
