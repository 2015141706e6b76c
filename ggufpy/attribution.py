"""Where a quantization loses accuracy: per-layer and per-tensor attribution (`ggufpy diff BASE QUANT`).

Both models read the same tokens. The base model's hidden states are the teacher: each layer of the quantized
model, and the base layer with one of its matrices swapped for the quantized one, run on the base's input to
that layer, so errors do not compound and each number belongs to one layer or one tensor.

- layer NMSE:  ||l_out_quant - l_out_base||^2 / ||l_out_base||^2, the whole layer quantized (teacher-forced);
- tensor NMSE: the same with only that tensor quantized;
- tensor KLD:  the mean KL-divergence of the next-token distribution from the base's when only that tensor is
  quantized (a full forward pass each: the end-to-end cost of that tensor's quantization).

The ranking answers "which tensor should get more bits": keeping the top-ranked tensor at the base's precision
recovers more of the total KLD than keeping the bottom-ranked one (tests/test_diff.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .perplexity import Chunks

__all__ = ["Attribution", "TensorScore", "attribute", "matrix_names", "swapped"]

GLOBAL = ("token_embd", "output")


@dataclass(frozen=True)
class TensorScore:
    name: str  # GGUF tensor name, e.g. blk.3.ffn_down.weight
    layer: int | None  # None for token_embd / output
    base_type: str
    quant_type: str
    nmse: float | None  # teacher-forced layer-output NMSE with only this tensor quantized (None: global tensors)
    kld: float | None  # mean KLD with only this tensor quantized (None: not computed)


@dataclass
class Attribution:
    layer_nmse: dict[int, float] = field(default_factory=dict)
    tensors: list[TensorScore] = field(default_factory=list)
    total_kld: float = 0.0  # the fully quantized model against the base
    n_tokens: int = 0

    def ranked(self) -> list[TensorScore]:
        """Tensors by KLD contribution (NMSE where KLD was not computed), worst first."""
        return sorted(self.tensors, key=lambda t: (t.kld if t.kld is not None else -1, t.nmse or 0), reverse=True)


def matrix_names(model) -> list[tuple[int | None, str]]:
    """(layer, field) of every matrix of the model: the blocks' QuantTensor fields, then token_embd, output."""
    out = []
    for i, lw in sorted(model.weights.layers.items()):
        for f in dataclasses.fields(lw):
            if type(getattr(lw, f.name)).__name__ == "QuantTensor":
                out.append((i, f.name))
    out += [(None, "token_embd")] + ([(None, "output")] if model.weights.output is not model.weights.token_embd else [])
    return out


def _tensor(model, layer: int | None, name: str):
    return getattr(model.weights, name) if layer is None else getattr(model.weights.layers[layer], name)


@contextmanager
def swapped(model, donor, items: list[tuple[int | None, str]]) -> Iterator[None]:
    """`model` with the matrices `items` taken from `donor` (same architecture and shapes) while inside."""
    weights, layers = model.weights, dict(model.weights.layers)
    try:
        new_layers = dict(layers)
        globals_ = {}
        for layer, name in items:
            if layer is None:
                globals_[name] = getattr(donor.weights, name)
                if name == "token_embd" and weights.output is weights.token_embd:  # a tied head moves with it
                    globals_["output"] = donor.weights.output
            else:
                new_layers[layer] = dataclasses.replace(new_layers[layer], **{name: _tensor(donor, layer, name)})
        model.weights = dataclasses.replace(weights, layers=new_layers, **globals_)
        yield
    finally:
        model.weights = weights


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _kld(base_lp: np.ndarray, lp: np.ndarray) -> float:
    return float((np.exp(base_lp) * (base_lp - lp)).sum(axis=-1).mean())


def _logprobs(model, ids: np.ndarray, first: int) -> np.ndarray:
    return _log_softmax(model.forward(ids, 0, model.new_cache(len(ids)))[first:])


def attribute(
    base,
    quant,
    chunks: Chunks,
    *,
    kld: bool | int = True,
    on_step: Callable[[str], None] | None = None,
) -> Attribution:
    """Attribute the quantization error of `quant` (a model of the same architecture as `base`) on `chunks`.
    The KL-divergences score the second half of each chunk, as llama-perplexity does. `kld`: True for every
    tensor's KLD, False for none, an int N for the N tensors of largest NMSE and the token_embd / output."""
    step = on_step or (lambda _: None)
    items = matrix_names(base)
    result = Attribution(n_tokens=chunks.n_chunk * (chunks.n_ctx - chunks.first))
    nmse_t: dict[tuple, list[float]] = {}
    nmse_l: dict[int, list[float]] = {}
    kld_t: dict[tuple, float] = {}
    total = 0.0
    base_lps = []
    for c in range(chunks.n_chunk):
        ids = chunks.chunk(c)
        trace: dict[str, np.ndarray] = {}
        base_lps.append(_log_softmax(base.forward(ids, 0, base.new_cache(len(ids)), trace=trace)[chunks.first :]))
        total += _kld(base_lps[-1], _logprobs(quant, ids, chunks.first)) / chunks.n_chunk
        h_in = {i: trace[f"l_out-{i - 1}"] if i > base.layers.start else ids for i in base.layers}  # ids: layer 0
        for i in base.layers:
            ref = trace[f"l_out-{i}"]
            layer_items = [it for it in items if it[0] == i]
            nmse_l.setdefault(i, []).append(_layer_nmse(base, quant, layer_items, i, h_in[i], ref))
            for it in layer_items:
                nmse_t.setdefault(it, []).append(_layer_nmse(base, quant, [it], i, h_in[i], ref))
    for it in _kld_items(items, nmse_t, kld):
        step(_full_name(*it))
        with swapped(base, quant, [it]):
            for c in range(chunks.n_chunk):
                lp = _logprobs(base, chunks.chunk(c), chunks.first)
                kld_t[it] = kld_t.get(it, 0.0) + _kld(base_lps[c], lp) / chunks.n_chunk
    result.total_kld = total
    result.layer_nmse = {i: float(np.mean(v)) for i, v in nmse_l.items()}
    for layer, name in items:
        bt, qt = _tensor(base, layer, name).type.name, _tensor(quant, layer, name).type.name
        nmse = float(np.mean(nmse_t[(layer, name)])) if (layer, name) in nmse_t else None
        result.tensors.append(TensorScore(_full_name(layer, name), layer, bt, qt, nmse, kld_t.get((layer, name))))
    return result


def _kld_items(items, nmse_t: dict, kld: bool | int) -> list:
    """The tensors whose KLD is computed: all, none, or the `kld` of largest NMSE plus the global ones."""
    if kld is True or kld is False:
        return items if kld else []
    by_nmse = sorted((it for it in items if it in nmse_t), key=lambda it: -float(np.mean(nmse_t[it])))
    return by_nmse[:kld] + [it for it in items if it not in nmse_t]


def _layer_nmse(base, quant, items, i: int, h: np.ndarray, ref: np.ndarray) -> float:
    """Layer i of `base` with `items` from `quant`, on the base's input h (token ids for the first layer):
    NMSE of its output against ref."""
    trace: dict[str, np.ndarray] = {}
    with swapped(base, quant, items):
        base.forward(h, 0, base.new_cache(len(h), layers=range(i, i + 1)), layers=range(i, i + 1), trace=trace)
    out = trace[f"l_out-{i}"].astype(np.float64)
    r = ref.astype(np.float64)
    return float(((out - r) ** 2).sum() / max((r**2).sum(), 1e-300))


def _full_name(layer: int | None, name: str) -> str:
    return f"{name}.weight" if layer is None else f"blk.{layer}.{name}.weight"
