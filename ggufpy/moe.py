"""The mixture-of-experts feed-forward, as llama.cpp's `build_moe_ffn` (src/llama-graph.cpp) computes it.

    logits  = x @ ffn_gate_inp.T                       (T, X)  the router, X = n_experts
    probs   = softmax(logits)                          (T, X)  (gpt-oss: the logits themselves; llama4: sigmoid,
                                                               chosen on the logits, weighting each expert's input;
                                                               deepseek2: the sigmoid of every logit)
    scores  = probs + exp_probs_b                      (T, X)  deepseek2's selection bias, for the choice only;
                                                               -inf outside the best expert groups (DeepSeek-V3)
    chosen  = top-k of scores                          (T, K)  K = n_experts_used, in llama.cpp's order
    weights = probs[chosen]                            (T, K)  / their sum (norm_w)  (gpt-oss: softmax over K),
                                                               times expert_weights_scale (deepseek2)
    y_k     = down_e(act(gate_e(x)) * up_e(x))         (T, K, D) only the chosen experts e = chosen[t, k]
                                                               (gpt-oss: expert biases, the clamped swiglu_oai)
    out     = sum_k weights_k * y_k                    (T, D)  added slot after slot, in f32
            + shared expert                            (qwen2moe, qwen35moe: times sigmoid(x . ffn_gate_inp_shexp);
                                                               deepseek2: expert_shared_count experts' width)

Which of these steps an architecture takes is its `arch.MoE` record; the router's softmax, top-k order and the
C library's expf follow ggml-cpu's arithmetic in the llamacpp numerics (bit for bit on the conformance goldens).

Only the chosen experts are read: each expert is a 2-D `QuantTensor` view of its rows in the stacked tensor
(`weights.ExpertTensor`), multiplied by the rows routed to it (llama.cpp's `ggml_mul_mat_id` groups rows per
expert the same way). Shape letters as in `ops.py`, plus X experts, K experts used per token, Fe expert width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from . import ops
from .arch import MoE
from .backend import Backend, linears
from .numerics import Numerics, _libm_f32, libm_expf
from .weights import ExpertTensor, LayerWeights, QuantTensor

_f32 = np.float32
WEIGHTS_SUM_MIN = _f32(6.103515625e-5)  # build_moe_ffn clamps the weights' sum to the smallest normal f16


# -- the router's arithmetic per numerics mode ------------------------------------------------------------------


def softmax_exact(x: np.ndarray) -> np.ndarray:
    """Softmax of each row (T, n) in f32."""
    return ops.softmax(np.array(x, _f32))


def softmax_ggml(x: np.ndarray, isa: str = "avx512") -> np.ndarray:
    """`ggml_soft_max` of each row (T, n) as ggml-cpu computes it on the x86 build `isa` (ops.cpp
    `ggml_compute_forward_soft_max_f32`, vec.cpp `ggml_vec_soft_max_f32`): e = exp(x - max) by ggml's SIMD exp
    for each block of 16 (AVX-512) or 8 (AVX2) values, each block's horizontal sum added in double, and by the
    C library's expf for the tail of n % width values, each added in double; then e * (float)(1.0 / sum)."""
    from .quants.x86.simd import hsum_float_8, reduce_add_ps_512
    from .quants.x86.unary import v_expf_256, v_expf_512

    v_expf, width, hsum = {"avx512": (v_expf_512, 16, reduce_add_ps_512), "avx2": (v_expf_256, 8, hsum_float_8)}[isa]
    x = np.asarray(x, _f32)
    d = x - x.max(axis=-1, keepdims=True)  # (T, n) f32 subtraction
    n = x.shape[-1]
    body = n - n % width
    e = np.empty_like(x)
    total = np.zeros(x.shape[:-1], np.float64)
    if body:
        e[..., :body] = v_expf(d[..., :body])
        blocks = hsum(e[..., :body].reshape(*x.shape[:-1], body // width, width))  # (T, n / width)
        for i in range(body // width):  # in block order: the double sum is not associative
            total += blocks[..., i]
    if body < n:
        e[..., body:] = _libm_f32("expf", d[..., body:])
        for i in range(body, n):
            total += e[..., i]
    return e * (1.0 / total).astype(_f32)[..., None]  # `sum = 1.0/sum` in double, scaled by it as a float


def row_sum(x: np.ndarray) -> np.ndarray:
    """`ggml_sum_rows` (vec.h `ggml_vec_sum_f32`): each row (T, n) summed in double, in order, then rounded."""
    total = np.zeros(x.shape[:-1], np.float64)
    for i in range(x.shape[-1]):
        total += x[..., i]
    return total.astype(_f32)[..., None]  # (T, 1)


# -- top-k in llama.cpp's order ---------------------------------------------------------------------------------


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices (T, k) of each row's k largest scores (T, n), in the order llama.cpp picks them:
    `ggml_argsort_top_k` is a descending `std::sort` of the indices (ops.cpp `ggml_compute_forward_argsort_f32`)
    cut to k. Any correct sort gives the same first k when the k + 1 largest values are distinct; otherwise
    ties are ordered by replaying libstdc++'s introsort (`libstdcxx_sort`)."""
    scores = np.asarray(scores, _f32)
    order = np.argsort(-scores, axis=-1, kind="stable")[:, : k + 1]  # (T, k + 1)
    out = order[:, :k].astype(np.int32)
    head = scores[np.arange(len(scores))[:, None], order]  # (T, k + 1) descending
    strict = (head[:, :-1] > head[:, 1:]).all(axis=-1)  # no tie among them (and no NaN, which compares false)
    for t in np.flatnonzero(~strict):
        row = scores[t].tolist()
        out[t] = libstdcxx_sort(list(range(len(row))), lambda a, b, row=row: row[a] > row[b])[:k]
    return out


_THRESHOLD = 16  # libstdc++ `_S_threshold`: ranges this short are left to the final insertion sort


def libstdcxx_sort(v: list, less: Callable[[object, object], bool]) -> list:
    """`std::sort(v.begin(), v.end(), less)` as libstdc++ (bits/stl_algo.h) performs it, element moves and all:
    introsort (median-of-three pivot, heapsort past depth 2*log2(n)), then insertion sort. Sorts in place."""
    n = len(v)
    if n > 1:
        _introsort_loop(v, 0, n, 2 * (n.bit_length() - 1), less)
        _final_insertion_sort(v, 0, n, less)
    return v


def _introsort_loop(v, first, last, depth, less):
    while last - first > _THRESHOLD:
        if depth == 0:
            _heap_sort(v, first, last, less)
            return
        depth -= 1
        cut = _partition_pivot(v, first, last, less)
        _introsort_loop(v, cut, last, depth, less)
        last = cut


def _partition_pivot(v, first, last, less):
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1  # __move_median_to_first(first, first + 1, mid, last - 1)
    if less(v[a], v[b]):
        m = b if less(v[b], v[c]) else (c if less(v[a], v[c]) else a)
    else:
        m = a if less(v[a], v[c]) else (c if less(v[b], v[c]) else b)
    v[first], v[m] = v[m], v[first]
    lo, hi = first + 1, last  # __unguarded_partition(first + 1, last, first)
    while True:
        while less(v[lo], v[first]):
            lo += 1
        hi -= 1
        while less(v[first], v[hi]):
            hi -= 1
        if not lo < hi:
            return lo
        v[lo], v[hi] = v[hi], v[lo]
        lo += 1


def _final_insertion_sort(v, first, last, less):
    if last - first > _THRESHOLD:
        _insertion_sort(v, first, first + _THRESHOLD, less)
        for i in range(first + _THRESHOLD, last):
            _linear_insert(v, i, less)
    else:
        _insertion_sort(v, first, last, less)


def _insertion_sort(v, first, last, less):
    for i in range(first + 1, last):
        if less(v[i], v[first]):
            v[first : i + 1] = [v[i], *v[first:i]]
        else:
            _linear_insert(v, i, less)


def _linear_insert(v, i, less):
    val = v[i]
    while less(val, v[i - 1]):
        v[i] = v[i - 1]
        i -= 1
    v[i] = val


def _heap_sort(v, first, last, less):
    """`std::__partial_sort(first, last, last)`: `__make_heap`, then `__sort_heap` (`__adjust_heap` moves)."""
    n = last - first
    for parent in range((n - 2) // 2, -1, -1):
        _adjust_heap(v, first, parent, n, v[first + parent], less)
    while n > 1:
        n -= 1
        val = v[first + n]
        v[first + n] = v[first]
        _adjust_heap(v, first, 0, n, val, less)


def _adjust_heap(v, first, hole, n, val, less):
    top = hole
    child = hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if less(v[first + child], v[first + child - 1]):
            child -= 1
        v[first + hole] = v[first + child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        v[first + hole] = v[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2  # __push_heap
    while hole > top and less(v[first + parent], val):
        v[first + hole] = v[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    v[first + hole] = val


# -- the feed-forward -------------------------------------------------------------------------------------------


def route(
    logits: np.ndarray,
    moe: MoE,
    k: int,
    softmax: Callable[[np.ndarray], np.ndarray],
    expf: Callable[[np.ndarray], np.ndarray] | None = None,
    probs_bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(chosen experts (T, K) int32, their weights (T, K) f32) from the router logits (T, X), in build_moe_ffn's
    steps: the probabilities, the scores they are chosen on (plus `probs_bias`, deepseek2's exp_probs_b (X,); only
    the best expert groups' experts), top-k, the weights from the unbiased probabilities, normed, scaled. `expf`
    is the sigmoid's exp (default: exact)."""
    sigmoid = functools.partial(SHARED_GATES["sigmoid"], act=None, expf=expf or _expf_exact)
    rows = np.arange(len(logits))[:, None]
    probs = {"softmax": softmax, "sigmoid_probs": sigmoid}.get(moe.gating, lambda z: z)(logits)  # (T, X)
    scores = probs if probs_bias is None else probs + probs_bias  # ggml_add: the choice only
    if moe.groups > 1:
        scores = best_groups(scores, moe.groups, moe.groups_used)
    chosen = top_k(scores, k)
    weights = probs[rows, chosen]  # (T, K)
    if moe.gating == "sigmoid":  # llama4: chosen on the logits, weighted by their sigmoid (elementwise)
        weights = sigmoid(weights)
    elif moe.gating == "softmax_weight":  # gpt-oss: a softmax over the chosen logits
        weights = softmax(weights)
    if moe.norm_weights:
        weights = weights / np.maximum(row_sum(weights), WEIGHTS_SUM_MIN)  # ggml_clamp(sum, 6.1e-5, inf), ggml_div
    if moe.weights_scale not in (0, 1):  # ggml_scale (deepseek2's expert_weights_scale)
        weights = weights * _f32(moe.weights_scale)
    return chosen, weights


def best_groups(scores: np.ndarray, groups: int, used: int) -> np.ndarray:
    """scores (T, X) with -inf outside each row's `used` best groups of X / groups consecutive experts, a group
    scored by the sum of its two best (build_moe_ffn: ggml_argsort_top_k(., 2) per group, ggml_sum_rows of those
    two in that order, ggml_argsort_top_k(., used) of the sums, then ggml_fill(-inf) and ggml_set_rows)."""
    T, X = scores.shape
    per_group = scores.reshape(T * groups, X // groups)  # (T*G, X/G)
    best2 = per_group[np.arange(T * groups)[:, None], top_k(per_group, 2)]  # (T*G, 2), the largest first
    kept = top_k(row_sum(best2).reshape(T, groups), used)  # (T, used) group indices
    masked = np.full((T, groups, X // groups), _f32(-np.inf), _f32)
    rows = np.arange(T)[:, None]
    masked[rows, kept] = scores.reshape(T, groups, -1)[rows, kept]
    return masked.reshape(T, X)


def expert_products(
    backend: Backend, x: np.ndarray, ws: tuple[ExpertTensor, ...], chosen: np.ndarray
) -> list[np.ndarray]:
    """Row (t, k) of x (T, D) or (T, K, D) times expert chosen[t, k] of each of `ws` (stacks sharing their input,
    like gate and up): [(T, K, out)]. Each expert multiplies all the rows routed to it at once, as
    `ggml_mul_mat_id` does, and only the chosen experts are read. A backend with `expert_products` (numba's
    expert stacks) may compute all the routed rows in one call; None from it means this path."""
    stacked = getattr(backend, "expert_products", None)
    ys = stacked(x, ws, chosen) if stacked is not None else None
    if ys is not None:
        return ys
    T, K = chosen.shape
    outs = [np.empty((T, K, w.shape[1]), _f32) for w in ws]
    if T == 1:  # decode: slot k is expert chosen[0, k] (top-k picks distinct experts)
        routes = [(int(e), np.zeros(1, np.intp), np.array([k])) for k, e in enumerate(chosen[0])]
    else:
        routes = [(int(e), *np.nonzero(chosen == e)) for e in np.unique(chosen)]  # its rows, in token order
    for e, t, k in routes:
        rows = x[t] if x.ndim == 2 else x[t, k]  # (n_e, in)
        for out, y in zip(outs, mul_mat_id(backend, rows, tuple(w.expert(e) for w in ws)), strict=True):
            out[t, k] = y
    return outs


def mul_mat_id(backend: Backend, x: np.ndarray, ws: tuple[QuantTensor, ...]) -> list[np.ndarray]:
    """x (n, in) times each of one expert's weights `ws`: in one call where the backend stacks them
    (`backend.linears`), row by row where the NumPy backend replays llama.cpp (`mul_mat_id_rows`)."""
    if backend.name == "numpy" and backend.numerics.x86_kernels:
        return [mul_mat_id_rows(backend, x, w) for w in ws]
    return linears(backend, x, ws) if len(ws) > 1 else [backend.linear(x, ws[0])]


def mul_mat_id_rows(backend: Backend, x: np.ndarray, w: QuantTensor) -> np.ndarray:
    """x (n, in) times one expert's weight, as ggml-cpu's `ggml_compute_forward_mul_mat_id` computes it when the
    NumPy backend replays llama.cpp's x86 kernels: each row alone (`vec_dot`, or repack.cpp's gemv for repacked
    weights), except where the tiled k-quant kernel takes the expert's rows (`mul_mat_id_tiled`: 8 or more
    rows, weights not repacked). mul_mat's other batched kernels (tinyBLAS, repacked gemm) never run here."""
    if len(x) == 1:
        return backend.linear(x, w)
    from .quants.x86 import kernel_for, tiled

    if kernel_for(w.type, w.shape[0], len(x)) is tiled.KERNELS.get(w.type):
        return backend.linear(x, w)
    return np.concatenate([backend.linear(x[i : i + 1], w) for i in range(len(x))])


def swiglu(gate: np.ndarray, up: np.ndarray, act: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """act(gate) * up over rows (..., F) (`ggml_swiglu_split`: each row on its own)."""
    lead = gate.shape[:-1]
    return (act(gate.reshape(-1, gate.shape[-1])) * up.reshape(-1, up.shape[-1])).reshape(*lead, -1)


def swiglu_oai(gate: np.ndarray, up: np.ndarray, expf: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """gpt-oss's clamped SwiGLU, elementwise as ops.cpp `ggml_compute_forward_swiglu_oai_f32` (alpha 1.702, limit 7,
    the constants of build_moe_ffn's LLM_FFN_SWIGLU_OAI_MOE): x = min(gate, 7), y = clamp(up, -7, 7),
    x / (1 + expf(alpha * -x)) * (y + 1), every step in f32."""
    x = np.minimum(gate, _f32(7))
    y = np.clip(up, _f32(-7), _f32(7))
    with np.errstate(over="ignore"):
        return x / (_f32(1) + expf(_f32(1.702) * -x)) * (y + _f32(1))


def _expf_exact(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(x.astype(np.float64)).astype(_f32)


# MoE.shared_gate -> the shared expert's gate from g (T, 1) = x . ffn_gate_inp_shexp, the SiLU in use and expf
SHARED_GATES: dict[str, Callable] = {
    "silu_div": lambda g, act, expf: act(g) / g,  # ggml_div(ggml_silu(g), g) (src/models/qwen2moe.cpp)
    "sigmoid": lambda g, act, expf: _f32(1) / (_f32(1) + expf(-g)),  # ggml_sigmoid: vec.h ggml_vec_sigmoid_f32
}


def _add_bias(y: np.ndarray, w: ExpertTensor, chosen: np.ndarray) -> np.ndarray:
    """y (T, K, out) plus the bias of expert chosen[t, k] on each row (`ggml_add_id`), where the stack has biases."""
    return y if w.bias is None else y + w.bias[chosen]


def gated(
    gate: np.ndarray,
    up: np.ndarray,
    w: LayerWeights,
    chosen: np.ndarray,
    moe: MoE,
    act: Callable[[np.ndarray], np.ndarray],
    expf: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """The experts' gated unit on gate, up (T, K, Fe): their biases (gpt-oss), then `swiglu_oai` or act(gate) * up."""
    gate, up = _add_bias(gate, w.ffn_gate_exps, chosen), _add_bias(up, w.ffn_up_exps, chosen)
    if moe.glu == "swiglu_oai":
        return swiglu_oai(gate, up, expf)
    return swiglu(gate, up, act)


def combine(y: np.ndarray, w_down: ExpertTensor, chosen: np.ndarray, weights: np.ndarray, moe: MoE) -> np.ndarray:
    """The experts' outputs y (T, K, D) -> (T, D): plus the down bias (gpt-oss), times their weights (unless they
    weighted the input: llama4), the K slots added one after another."""
    y = _add_bias(y, w_down, chosen)
    if not moe.weights_on_input:
        y = y * weights[..., None]  # ggml_mul broadcasting the (1, K, T) weights
    out = y[:, 0]
    for slot in range(1, y.shape[1]):  # ggml_add of the slots' views, one after another
        out = out + y[:, slot]
    return out


def feed_forward(
    x: np.ndarray,
    w: LayerWeights,
    moe: MoE,
    k: int,
    backend: Backend,
    numerics: Numerics,
    act: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """The mixture-of-experts feed-forward of one layer: x (T, D) -> (T, D). `act` is the gate activation
    (the numerics' SiLU, or the backend's compiled form of it); `k` the experts used per token."""
    compiled = getattr(backend, "compiled", {})  # numba's forms of the functions below: the same bits
    steps = getattr(backend, "moe_steps", {})  # numba's forms of route, gated, combine: the same bits
    softmax = functools.partial(compiled.get(softmax_ggml, softmax_ggml), isa=numerics.x86_isa)
    softmax = softmax if numerics.x86_kernels else softmax_exact
    expf = compiled.get(libm_expf, libm_expf) if numerics.x86_kernels else _expf_exact  # scalar C loops call expf
    logits = backend.linear(x, w.ffn_gate_inp)  # (T, X)
    if w.ffn_gate_inp_bias is not None:
        logits = logits + w.ffn_gate_inp_bias
    bias = w.ffn_exp_probs_b if moe.probs_bias else None  # deepseek2's exp_probs_b (or None: not in the file)
    chosen, weights = steps.get(route, route)(logits, moe, k, softmax, expf, bias)  # (T, K) each
    inputs = x  # llama4: ggml_mul(ggml_repeat_4d(x), weights), each expert on its weighted copy (T, K, D)
    if moe.weights_on_input:
        inputs = x[:, None, :] * weights[..., None]
    gate, up = expert_products(backend, inputs, (w.ffn_gate_exps, w.ffn_up_exps), chosen)  # (T, K, Fe) each
    h = steps.get(gated, gated)(gate, up, w, chosen, moe, act, expf)  # (T, K, Fe)
    (y,) = expert_products(backend, h, (w.ffn_down_exps,), chosen)  # (T, K, D)
    out = steps.get(combine, combine)(y, w.ffn_down_exps, chosen, weights, moe)  # (T, D)
    if w.ffn_gate_shexp is not None:  # a shared expert, which every token runs
        gate_s, up_s = linears(backend, x, (w.ffn_gate_shexp, w.ffn_up_shexp))  # (T, Fs) each
        shared = backend.linear(swiglu(gate_s, up_s, act), w.ffn_down_shexp)  # (T, D)
        if moe.shared_gate is not None:
            g = backend.linear(x, w.ffn_gate_inp_shexp)  # (T, 1)
            shared = shared * SHARED_GATES[moe.shared_gate](g, act, expf)
        out = out + shared
    return out
