"""The mixture-of-experts feed-forward's glue compiled (`ggufpy.moe`'s steps between the products), bit for bit.

    chosen, weights = route(logits, moe, k, softmax, expf, probs_bias)   # == moe.route
    h = gated(gate, up, w, chosen, moe, act, expf)                       # == moe.gated
    out = combine(y, w_down, chosen, weights, moe)                       # == moe.combine

A decoded token's MoE block was ~40 NumPy calls per layer around its three products (argsort and the tie check
of top-k, fancy-indexed biases, the nine elementwise steps of swiglu_oai, the weighted slot sum): 0.5-0.7 ms of
Python per layer on gpt-oss's shapes, more than the expert products of one small layer. Each step here is one
compiled call doing the same f32 operations in the same order (no fast-math, so no contraction into FMAs), and
top-k replays libstdc++'s introsort whenever the k + 1 largest scores tie, as `moe.top_k` does. Outside their
scope (sigmoid gating, expert groups, deepseek2's selection bias, the exact numerics' NumPy softmax and exp, other
activations) each step calls its `ggufpy.moe` reference, so the results never depend on which one ran.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import moe as ref
from ._numba import jit
from .glue_ggml import _silu_rows
from .glue_ggml import expf_array as _expf_array
from .glue_ggml import silu_rows as _silu_ggml
from .x86 import ISA_LANES, _hsum, _libm_expf, _v_expf

__all__ = ["STEPS", "combine", "gated", "route", "softmax_ggml", "top_k"]

_f32 = np.float32
_THRESHOLD = 16  # libstdc++ `_S_threshold` (moe._THRESHOLD)


# -- the router's softmax (`moe.softmax_ggml`) ----------------------------------------------------------------
@jit
def _softmax_rows(x, lanes, out):
    rows, n = x.shape
    body = n - n % lanes
    wide = lanes == 16
    block = np.empty(lanes, np.float32)
    for r in range(rows):
        peak = x[r, 0]
        for i in range(1, n):
            peak = max(peak, x[r, i])
        total = 0.0  # double, as ggml_vec_soft_max_f32's ggml_float
        for b in range(0, body, lanes):  # each SIMD block's horizontal sum, added in block order
            for j in range(lanes):
                e = _v_expf(x[r, b + j] - peak, wide)
                out[r, b + j] = e
                block[j] = e
            total += _hsum(block, lanes)
        for i in range(body, n):  # the scalar tail: the C library's expf
            e = _libm_expf(x[r, i] - peak)
            out[r, i] = e
            total += e
        scale = np.float32(1.0 / total)
        for i in range(n):
            out[r, i] = out[r, i] * scale


def softmax_ggml(x: np.ndarray, isa: str = "avx512") -> np.ndarray:
    """`moe.softmax_ggml(x, isa)` compiled: ggml_soft_max of each row (T, n), bit for bit."""
    x = np.ascontiguousarray(x, _f32)
    out = np.empty_like(x)
    _softmax_rows(x.reshape(-1, x.shape[-1]), ISA_LANES[isa], out.reshape(-1, x.shape[-1]))
    return out


# -- top-k in llama.cpp's order: `moe.top_k`, with `moe.libstdcxx_sort` over the indices of one row -----------------
@jit(inline=True)
def _less(row, a, b):
    return row[a] > row[b]  # ggml_argsort_top_k's descending comparator; false whenever a NaN is involved


@jit(inline=True)
def _linear_insert(v, i, row):
    val = v[i]
    while _less(row, val, v[i - 1]):
        v[i] = v[i - 1]
        i -= 1
    v[i] = val


@jit(inline=True)
def _insertion_sort(v, first, last, row):
    for i in range(first + 1, last):
        if _less(row, v[i], v[first]):
            val = v[i]
            for j in range(i, first, -1):  # std::move_backward(first, i, i + 1)
                v[j] = v[j - 1]
            v[first] = val
        else:
            _linear_insert(v, i, row)


@jit(inline=True)
def _adjust_heap(v, first, hole, n, val, row):
    top = hole
    child = hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if _less(row, v[first + child], v[first + child - 1]):
            child -= 1
        v[first + hole] = v[first + child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        v[first + hole] = v[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2  # __push_heap
    while hole > top and _less(row, v[first + parent], val):
        v[first + hole] = v[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    v[first + hole] = val


@jit(inline=True)
def _heap_sort(v, first, last, row):
    n = last - first
    for parent in range((n - 2) // 2, -1, -1):
        _adjust_heap(v, first, parent, n, v[first + parent], row)
    while n > 1:
        n -= 1
        val = v[first + n]
        v[first + n] = v[first]
        _adjust_heap(v, first, 0, n, val, row)


@jit(inline=True)
def _partition_pivot(v, first, last, row):
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1  # __move_median_to_first(first, first + 1, mid, last - 1)
    if _less(row, v[a], v[b]):
        m = b if _less(row, v[b], v[c]) else (c if _less(row, v[a], v[c]) else a)
    else:
        m = a if _less(row, v[a], v[c]) else (c if _less(row, v[b], v[c]) else b)
    v[first], v[m] = v[m], v[first]
    lo, hi = first + 1, last  # __unguarded_partition(first + 1, last, first)
    while True:
        while _less(row, v[lo], v[first]):
            lo += 1
        hi -= 1
        while _less(row, v[first], v[hi]):
            hi -= 1
        if not lo < hi:
            return lo
        v[lo], v[hi] = v[hi], v[lo]
        lo += 1


@jit
def _std_sort(v, row):
    """`moe.libstdcxx_sort(v, less)` with less(a, b) = row[a] > row[b]. The introsort's recursion becomes a stack
    of ranges: each range is sorted on its own elements only, so the order they are taken in changes nothing."""
    n = v.size
    if n <= 1:
        return
    lg = 0  # n.bit_length() - 1
    while n >> (lg + 1):
        lg += 1
    depth0 = 2 * lg
    stack = np.empty((depth0 + 2, 3), np.int64)
    stack[0, 0], stack[0, 1], stack[0, 2] = 0, n, depth0
    top = 1
    while top:
        top -= 1
        first, last, depth = stack[top, 0], stack[top, 1], stack[top, 2]
        while last - first > _THRESHOLD:
            if depth == 0:
                _heap_sort(v, first, last, row)
                break
            depth -= 1
            cut = _partition_pivot(v, first, last, row)
            stack[top, 0], stack[top, 1], stack[top, 2] = cut, last, depth  # _introsort_loop(cut, last, depth)
            top += 1
            last = cut
    if n > _THRESHOLD:  # __final_insertion_sort
        _insertion_sort(v, 0, _THRESHOLD, row)
        for i in range(_THRESHOLD, n):
            _linear_insert(v, i, row)
    else:
        _insertion_sort(v, 0, n, row)


@jit
def _top_k_rows(scores, k, out):
    """out (T, k) int32: `moe.top_k(scores, k)`. The k + 1 largest non-NaN scores, first index on ties (what the
    stable argsort of -scores puts first); if they are strictly decreasing, the first k; otherwise (a tie, a NaN
    among them) the replayed std::sort of all indices, cut to k."""
    T, n = scores.shape
    m = min(k + 1, n)
    taken = np.zeros(n, np.bool_)
    head = np.empty(m, np.int64)
    v = np.empty(n, np.int64)
    for t in range(T):
        row = scores[t]
        taken[:] = False
        strict = True
        for j in range(m):
            best = -1
            for i in range(n):
                if not taken[i] and scores[t, i] == scores[t, i] and (best < 0 or scores[t, i] > scores[t, best]):
                    best = i
            if best < 0:  # fewer than m non-NaN scores: a NaN is among the head
                strict = False
                break
            taken[best] = True
            head[j] = best
            if j and not scores[t, head[j - 1]] > scores[t, best]:
                strict = False
                break
        if strict:
            for j in range(k):
                out[t, j] = head[j]
        else:
            for i in range(n):
                v[i] = i
            _std_sort(v, row)
            for j in range(k):
                out[t, j] = v[j]


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """`moe.top_k(scores, k)` compiled: indices (T, k) int32 of each row's k largest scores in llama.cpp's order."""
    scores = np.ascontiguousarray(scores, _f32)
    out = np.empty((scores.shape[0], k), np.int32)
    _top_k_rows(scores, k, out)
    return out


# -- route: softmax (or the logits), top-k, the chosen weights ---------------------------------------------------------
_SOFTMAX, _LOGITS = 0, 1  # gating "softmax" / "softmax_weight"


@jit
def _route(logits, gating, lanes, k, norm, scaled, scale, chosen, weights):
    T = logits.shape[0]
    if gating == _SOFTMAX:
        probs = np.empty_like(logits)
        _softmax_rows(logits, lanes, probs)
    else:
        probs = logits
    _top_k_rows(probs, k, chosen)
    for t in range(T):
        for j in range(k):
            weights[t, j] = probs[t, chosen[t, j]]
    if gating == _LOGITS:  # gpt-oss: ggml_soft_max over the chosen logits
        soft = np.empty_like(weights)
        _softmax_rows(weights, lanes, soft)
        weights[:] = soft
    if norm:  # ggml_sum_rows (in double, in order), ggml_clamp(6.1e-5, inf), ggml_div
        low = np.float32(6.103515625e-5)
        for t in range(T):
            total = 0.0
            for j in range(k):
                total += np.float64(weights[t, j])
            s = np.float32(total)
            if s < low:  # NaN stays (np.maximum propagates it)
                s = low
            for j in range(k):
                weights[t, j] = weights[t, j] / s
    if scaled:  # ggml_scale
        for t in range(T):
            for j in range(k):
                weights[t, j] = weights[t, j] * scale


def _ggml_isa(softmax) -> str | None:
    """The x86 build whose ggml_soft_max `softmax` is (a partial of `moe.softmax_ggml` or its compiled form)."""
    if isinstance(softmax, functools.partial) and softmax.func in (ref.softmax_ggml, softmax_ggml):
        return softmax.keywords.get("isa", "avx512") if not softmax.args else None
    return None


def route(logits, moe, k, softmax, expf=None, probs_bias=None):
    """`moe.route` in one compiled call for ggml's softmax gating ("softmax", "softmax_weight") without expert
    groups or selection bias; the reference otherwise."""
    isa = _ggml_isa(softmax)
    gating = {"softmax": _SOFTMAX, "softmax_weight": _LOGITS}.get(moe.gating)
    plain = probs_bias is None and moe.groups <= 1 and logits.dtype == _f32 and k <= logits.shape[-1]
    if isa is None or gating is None or not plain:
        return ref.route(logits, moe, k, softmax, expf, probs_bias)
    logits = np.ascontiguousarray(logits)
    T = logits.shape[0]
    chosen, weights = np.empty((T, k), np.int32), np.empty((T, k), _f32)
    scaled = moe.weights_scale not in (0, 1)
    _route(logits, gating, ISA_LANES[isa], k, moe.norm_weights, scaled, _f32(moe.weights_scale), chosen, weights)
    return chosen, weights


# -- the gated unit: the experts' biases and swiglu_oai, or act(gate) * up ---------------------------------------------
_NO_BIAS = np.zeros((1, 1), _f32)


@jit
def _swiglu_oai(gate, up, bg, bu, biased, chosen, out):
    """(T, K, F): g = gate + bg[e], u = up + bu[e] (`ggml_add_id`), then x = min(g, 7), y = clamp(u, -7, 7),
    x / (1 + expf(1.702 * -x)) * (y + 1), as `moe.swiglu_oai` with the C library's expf, each step in f32."""
    T, K, F = gate.shape
    limit, alpha, one = np.float32(7.0), np.float32(1.702), np.float32(1.0)
    for t in range(T):
        for j in range(K):
            e = chosen[t, j]
            for f in range(F):
                g, u = gate[t, j, f], up[t, j, f]
                if biased:
                    g, u = g + bg[e, f], u + bu[e, f]
                x = g if not g > limit else limit  # np.minimum: NaN stays NaN
                y = u if not u < -limit else -limit  # np.clip: NaN stays NaN
                y = y if not y > limit else limit
                out[t, j, f] = x / (one + _libm_expf(alpha * -x)) * (y + one)


@jit
def _swiglu_silu(gate, up, out):
    """(R, F) rows: ggml's SiLU of each gate row (`glue_ggml.silu_rows`, AVX-512) times up, in f32."""
    _silu_rows(gate, out)
    R, F = gate.shape
    for r in range(R):
        for f in range(F):
            out[r, f] = out[r, f] * up[r, f]


def _f32_or_none(b):
    return b is None or b.dtype == _f32


def gated(gate, up, w, chosen, moe, act, expf):
    """`moe.gated` in one compiled call where its functions are ggml's (`swiglu_oai` with the C library's expf, or
    the AVX-512 build's SiLU without biases); the reference otherwise."""
    bg, bu = w.ffn_gate_exps.bias, w.ffn_up_exps.bias
    f32 = gate.dtype == _f32 and up.dtype == _f32 and _f32_or_none(bg) and _f32_or_none(bu) and gate.ndim == 3
    if f32 and moe.glu == "swiglu_oai" and expf is _expf_array and (bg is None) == (bu is None):
        out = np.empty(gate.shape, _f32)
        biased = bg is not None
        _swiglu_oai(gate, up, bg if biased else _NO_BIAS, bu if biased else _NO_BIAS, biased, chosen, out)
        return out
    if f32 and moe.glu == "swiglu" and act is _silu_ggml and bg is None and bu is None:
        F = gate.shape[-1]
        out = np.empty(gate.shape, _f32)
        _swiglu_silu(gate.reshape(-1, F), up.reshape(-1, F), out.reshape(-1, F))
        return out
    return ref.gated(gate, up, w, chosen, moe, act, expf)


# -- combine: the down bias, the weights, the slots added one after another --------------------------------------------
@jit
def _combine(y, bias, biased, chosen, weights, weighted, out):
    T, K, D = y.shape
    for t in range(T):
        for d in range(D):
            acc = np.float32(0.0)
            for j in range(K):
                v = y[t, j, d]
                if biased:
                    v = v + bias[chosen[t, j], d]
                if weighted:
                    v = v * weights[t, j]
                acc = v if j == 0 else acc + v  # out = y[:, 0], then out + y[:, slot]
            out[t, d] = acc


def combine(y, w_down, chosen, weights, moe):
    """`moe.combine` in one compiled call (f32 throughout); the reference otherwise."""
    bias = w_down.bias
    if y.dtype != _f32 or weights.dtype != _f32 or not _f32_or_none(bias) or y.ndim != 3 or y.shape[1] == 0:
        return ref.combine(y, w_down, chosen, weights, moe)
    out = np.empty((y.shape[0], y.shape[2]), _f32)
    _combine(
        y, bias if bias is not None else _NO_BIAS, bias is not None, chosen, weights, not moe.weights_on_input, out
    )
    return out


# `moe` reference step -> its compiled form, for `NumbaBackend.moe_steps` (`experts.ExpertProducts`)
STEPS = {ref.route: route, ref.gated: gated, ref.combine: combine}
