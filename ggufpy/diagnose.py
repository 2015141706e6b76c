"""Non-finite model output: detect it cheaply, then find where it started.

A NaN or inf weight (or an activation that overflows) makes every logit NaN, and an arg-max over NaN picks
token 0, which is often EOS: generation would end silently with empty text. `check_finite` looks at the one
logits row that is sampled; only when it is not finite does it rerun the tokens with the trace machinery
(`Model.forward(..., trace=dict)`, llama.cpp's tensor names) and raise `NonFiniteLogitsError` naming the first
traced tensor that went non-finite, its layer, and the weight of that step holding NaN/inf when there is one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

__all__ = ["NonFiniteLogitsError", "check_finite", "first_non_finite"]


class NonFiniteLogitsError(ValueError):
    """The model produced NaN or inf logits. `tensor` is the first traced tensor (llama.cpp name, e.g.
    "ffn_out-3") that was not finite, `layer` its layer, `weight` the GGUF weight holding NaN/inf (each None
    when unknown)."""

    def __init__(self, message: str, tensor: str | None = None, layer: int | None = None, weight: str | None = None):
        super().__init__(message)
        self.tensor, self.layer, self.weight = tensor, layer, weight


# traced tensor stem -> the weights (LayerWeights fields, or Weights fields for the head) computed into it
_STEP_WEIGHTS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("attn_norm",),
    "Qcur": ("attn_qkv", "attn_q", "attn_q_bias", "attn_q_norm"),
    "Kcur": ("attn_qkv", "attn_k", "attn_k_bias", "attn_k_norm"),
    "Vcur": ("attn_qkv", "attn_v", "attn_v_bias"),
    "kqv_out": (),
    "ffn_inp": ("attn_output", "post_attention_norm"),
    "ffn_norm": ("ffn_norm",),
    "ffn_out": ("ffn_gate", "ffn_up", "ffn_down"),
    "l_out": ("post_ffw_norm",),
    "result_norm": ("output_norm",),
    "result_output": ("output",),
}
_NAME = re.compile(r"(?P<stem>[A-Za-z_]+?)(?:-(?P<layer>\d+))?$")


def first_non_finite(trace: dict[str, np.ndarray]) -> tuple[str, int] | None:
    """(name, position) of the first traced tensor, in execution order, holding NaN or inf; None if all finite."""
    for name, value in trace.items():
        bad = ~np.isfinite(value.reshape(value.shape[0], -1)).all(axis=1)  # (T,) rows with a NaN/inf
        if bad.any():
            return name, int(np.flatnonzero(bad)[0])
    return None


def _values(w) -> np.ndarray | None:
    if w is None:
        return None
    return w if isinstance(w, np.ndarray) else w.dequantize()


def _bad_weight(model, stem: str, layer: int | None, tokens: np.ndarray) -> str | None:
    """The GGUF name of the first weight of this step holding NaN/inf, if any."""
    weights = model.weights
    if stem == "attn_norm" and layer == model.layers.start and model.layers.start == 0:
        rows = weights.token_embd.rows(tokens)  # the block's input: only the rows of these tokens matter
        if not np.isfinite(rows).all():
            return weights.token_embd.name
    source = weights if layer is None else weights.layers[layer]
    for field in _STEP_WEIGHTS.get(stem, ()):
        values = _values(getattr(source, field, None))
        if values is not None and not np.isfinite(values).all():
            w = getattr(source, field)
            return getattr(w, "name", None) or (f"blk.{layer}.{field}" if layer is not None else field)
    return None


def check_finite(model, logits_row: np.ndarray, tokens: Sequence[int]) -> None:
    """Raise `NonFiniteLogitsError` when `logits_row` (the row about to be sampled) is not all finite.

    `tokens` is the whole sequence that produced it (prompt and generated tokens); it is rerun on a fresh
    cache with tracing only in that case, to name the first tensor and layer that went NaN/inf.
    """
    row = np.asarray(logits_row)
    if np.isfinite(row).all():
        return
    n_bad = int((~np.isfinite(row)).sum())
    head = f"{n_bad} of {row.size} logits are NaN or inf"
    ids = np.asarray(tokens, dtype=np.int64)
    if model.layers.start != 0 or ids.size == 0:  # a shard past layer 0 cannot replay from token ids
        raise NonFiniteLogitsError(f"{head}; this model part cannot be replayed from token ids to find where")
    trace: dict[str, np.ndarray] = {}
    with np.errstate(all="ignore"):
        model.forward(ids, 0, model.new_cache(capacity=ids.size), trace=trace)
        found = first_non_finite(trace)
        if found is None:
            raise NonFiniteLogitsError(
                f"{head}, but a fresh run of the {ids.size} tokens is finite: the incremental (cached) path diverged"
            )
        name, pos = found
        m = _NAME.match(name)
        stem, layer = (m["stem"], int(m["layer"])) if m and m["layer"] else (name, None)
        weight = _bad_weight(model, stem, layer, ids)
    where = f"layer {layer}" if layer is not None else "the output head"
    why = f"weight {weight!r} holds NaN/inf" if weight else "no weight of that step holds NaN/inf (overflow?)"
    raise NonFiniteLogitsError(
        f"{head}: the first non-finite tensor is {name!r} ({where}, position {pos}); {why}",
        tensor=name,
        layer=layer,
        weight=weight,
    )
