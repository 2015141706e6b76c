"""Comparisons of a ggufpy model with llama.cpp's outputs: metrics, goldens, thresholds.

A `Reference` is what llama.cpp computed for one model and token sequence: its logits at every position
(full rows, or the top k with the log-sum-exp for large vocabularies), the per-layer outputs `l_out-N`, and a
greedy continuation. It comes from a committed golden (`Reference.load`) or from a live run
(`Reference.from_llamacpp`).

- `end_to_end`: tokens in, logits out; top-1 agreement, mean and max KL(llama.cpp || ggufpy), logit NMSE, and
  how many tokens of the greedy continuation are identical.
- `per_layer`: teacher-forced; layer N gets llama.cpp's `l_out-(N-1)` (layer 0 the tokens) and its output is
  compared with llama.cpp's `l_out-N` by NMSE; the output head likewise ("output").
`THRESHOLDS` holds the issue's acceptance criteria; `failures` applies them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GOLDEN_DIR = Path(__file__).parent / "goldens"
FLOAT_TYPES = {"F32", "F16", "BF16"}
MODES = ("exact", "llamacpp")


def mode_family(mode: str) -> str:
    """ "exact", or "llamacpp" for the replay of any llama.cpp build ("llamacpp", "llamacpp-avx2"): the
    thresholds are per family."""
    return "llamacpp" if mode.startswith("llamacpp") else mode


# -- metrics -------------------------------------------------------------------------------------------------


def nmse(ours: np.ndarray, ref: np.ndarray) -> float:
    """Σ(ours - ref)² / Σ ref², as llama.cpp's test-backend-ops (`nmse`)."""
    ref = np.asarray(ref, np.float64)
    return float(np.sum((np.asarray(ours, np.float64) - ref) ** 2) / max(np.sum(ref**2), 1e-300))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class RefLogits:
    """llama.cpp's logits (T, V): `full` rows, or the top `ids`/`values` (T, k) by value plus `lse` (T,)."""

    full: np.ndarray | None = None
    ids: np.ndarray | None = None
    values: np.ndarray | None = None
    lse: np.ndarray | None = None

    @classmethod
    def top_k(cls, logits: np.ndarray, k: int) -> RefLogits:
        x = np.asarray(logits, np.float64)
        ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        m = x.max(axis=-1, keepdims=True)
        lse = (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[:, 0]
        return cls(ids=ids.astype(np.int32), values=np.take_along_axis(logits, ids, -1).astype(np.float32), lse=lse)

    def argmax(self) -> np.ndarray:
        return self.full.argmax(axis=-1) if self.full is not None else self.ids[:, 0]

    def kl(self, ours: np.ndarray) -> np.ndarray:
        """KL(llama.cpp || ggufpy) per position. From top-k, the tail is one bucket: a lower bound on the KL."""
        log_q = log_softmax(ours)
        if self.full is not None:
            log_p = log_softmax(self.full)
            return np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
        log_p = self.values.astype(np.float64) - self.lse[:, None]  # (T, k)
        log_qk = np.take_along_axis(log_q, self.ids.astype(np.int64), -1)
        p, q = np.exp(log_p), np.exp(log_qk)
        p_tail = np.clip(1.0 - p.sum(-1), 1e-300, 1.0)
        q_tail = np.clip(1.0 - q.sum(-1), 1e-300, 1.0)
        return np.sum(p * (log_p - log_qk), axis=-1) + p_tail * np.log(p_tail / q_tail)

    def nmse(self, ours: np.ndarray) -> float:
        if self.full is not None:
            return nmse(ours, self.full)
        return nmse(np.take_along_axis(ours, self.ids.astype(np.int64), -1), self.values)


# -- references ----------------------------------------------------------------------------------------------


@dataclass
class Reference:
    """llama.cpp's results for one model file and token sequence."""

    name: str
    tokens: np.ndarray  # (T,) int
    logits: RefLogits
    tensors: dict[str, np.ndarray]  # l_out-N (T, D), result_norm (T, D), optionally more
    continuation: np.ndarray  # greedy tokens after `tokens`
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_llamacpp(
        cls, path, tokens, n_continue: int = 16, top_k: int | None = None, extra: Callable | None = None, name: str = ""
    ) -> Reference:
        """Run llama.cpp; keep `l_out-N`, `result_norm` and the tensors whose names `extra` accepts."""
        from .llamacpp import LlamaCpp

        with LlamaCpp(path) as lc:
            golden = _golden_tensor_names(lc.n_layers)
            logits, tensors = lc.run(tokens, capture=lambda n: n in golden or (extra is not None and extra(n)))
            continuation = lc.greedy(tokens, n_continue)
        ref_logits = RefLogits(full=logits) if top_k is None else RefLogits.top_k(logits, top_k)
        return cls(name or Path(path).stem, np.asarray(tokens), ref_logits, tensors, np.asarray(continuation))

    def save(self, path: Path) -> None:
        arrays = {"tokens": self.tokens.astype(np.int32), "continuation": self.continuation.astype(np.int32)}
        if self.logits.full is not None:
            arrays["logits"] = self.logits.full.astype(np.float32)
        else:
            arrays.update(top_ids=self.logits.ids, top_logits=self.logits.values, lse=self.logits.lse)
        arrays.update({f"t:{k}": v.astype(np.float32) for k, v in self.tensors.items()})
        np.savez_compressed(path, **arrays)

    def prefix(self, n: int) -> Reference:
        """The first `n` positions, without the continuation (it follows the whole sequence).

        Row t of a causal forward pass depends only on tokens 0..t, and ggml computes each output row of a
        matmul alone, so these rows are llama.cpp's answer for the first n tokens, bit for bit, as long as
        ggml picks the same kernels for n rows as for the whole ubatch: n >= 8 (tiled k-quants) and
        n % 4 == 0 (the repacked gemm takes T - T % 4 rows, gemv the rest; see ggufpy/quants/x86/repack.py).
        The padded KV length (256) is the same for any n up to 256.
        """
        if not 0 < n <= len(self.tokens):
            raise ValueError(f"prefix of {n} positions: golden {self.name!r} holds {len(self.tokens)}")
        lg = self.logits
        logits = RefLogits(*(None if a is None else a[:n] for a in (lg.full, lg.ids, lg.values, lg.lse)))
        tensors = {k: v[:n] for k, v in self.tensors.items()}
        return Reference(self.name, self.tokens[:n], logits, tensors, self.continuation[:0], self.meta)

    @classmethod
    def load(cls, name: str, directory: Path = GOLDEN_DIR) -> Reference:
        meta = json.loads((directory / "manifest.json").read_text())[name]
        with np.load(directory / meta["file"]) as z:
            if "logits" in z:
                logits = RefLogits(full=z["logits"])
            else:
                logits = RefLogits(ids=z["top_ids"], values=z["top_logits"], lse=z["lse"])
            tensors = {k[2:]: z[k] for k in z.files if k.startswith("t:")}
            return cls(name, z["tokens"], logits, tensors, z["continuation"], meta)


def _golden_tensor_names(n_layers: int) -> set[str]:
    return {f"l_out-{i}" for i in range(n_layers)} | {"result_norm"}


def golden_names(directory: Path = GOLDEN_DIR) -> list[str]:
    """The recorded models (the manifest also lists the per-op golden, which has no token sequence)."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text()) if path.exists() else {}
    return [name for name, meta in manifest.items() if "n_tokens" in meta]


# -- comparisons ---------------------------------------------------------------------------------------------


def greedy(model, tokens, n: int) -> list[int]:
    """`n` greedy (argmax) tokens after `tokens`, decoding one token at a time as llama.cpp's run did."""
    tokens = np.asarray(tokens, np.int64)
    cache = model.new_cache(capacity=len(tokens) + n)
    logits = model.forward(tokens, 0, cache, last_only=True)
    out: list[int] = []
    for _ in range(n):
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        if len(out) < n:
            logits = model.forward(np.array([nxt]), len(tokens) + len(out) - 1, cache)
    return out


def end_to_end(model, ref: Reference, continuation: bool = True) -> dict:
    logits = model.logits(ref.tokens)
    kl = ref.logits.kl(logits)
    result = {
        "top1": float(np.mean(logits.argmax(-1) == ref.logits.argmax())),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "nmse": ref.logits.nmse(logits),
        "n_tokens": len(ref.tokens),
    }
    if continuation and len(ref.continuation):
        ours = greedy(model, ref.tokens, len(ref.continuation))
        same = np.asarray(ours) == ref.continuation
        result["greedy_match"] = int(len(same) if same.all() else np.argmin(same))
        result["greedy_len"] = len(ref.continuation)
    return result


def bit_differences(model, ref: Reference) -> dict[str, int]:
    """One free-running forward pass over the golden's tokens, traced: for every tensor the golden holds
    (`l_out-N`, `result_norm`) and for the logits (`result_output`, the stored entries), how many elements
    differ from llama.cpp's. All zero means every layer reproduced llama.cpp bit for bit, so teacher forcing
    (`per_layer`) would feed each layer exactly the input it already had."""
    trace: dict[str, np.ndarray] = {}
    tokens = np.asarray(ref.tokens, np.int64)
    logits = model.forward(tokens, 0, model.new_cache(capacity=len(tokens)), trace=trace)
    out = {k: int(np.count_nonzero(trace[k] != v)) for k, v in ref.tensors.items()}
    lg = ref.logits
    if lg.full is not None:
        out["result_output"] = int(np.count_nonzero(logits != lg.full))
    else:
        out["result_output"] = int(
            np.count_nonzero(np.take_along_axis(logits, lg.ids.astype(np.int64), -1) != lg.values)
        )
    return out


def layer_inputs(model, ref: Reference):
    """(layer, input) pairs for teacher forcing: token ids for layer 0, llama.cpp's l_out-(N-1) after."""
    for i in model.layers:
        yield i, (ref.tokens if i == 0 else ref.tensors[f"l_out-{i - 1}"])


def run_layer(model, i: int, x, trace: dict | None = None) -> np.ndarray:
    """Layer i alone on input x at positions 0..T-1: its output `l_out-i`. For i == n_layers: the final
    norm and the output head, returning the logits."""
    trace = {} if trace is None else trace
    n = model.config.n_layers
    layers = range(i, min(i + 1, n))
    cache = model.new_cache(capacity=len(x), layers=layers if len(layers) else None)
    logits = model.forward(x, 0, cache, layers=layers, trace=trace)
    return logits if i == n else trace[f"l_out-{i}"]


def per_layer(model, ref: Reference) -> list[tuple[str, float]]:
    """Teacher-forced NMSE of every layer's output (`l_out-N`) and of the output head (`output`). A gemma4
    layer cannot run alone (a shared-KV layer reads an earlier layer's cache, the per-layer inputs come from the
    token ids): there, each layer's output of one free-running pass."""
    if getattr(model.config, "gemma4", None) is not None:
        trace: dict[str, np.ndarray] = {}
        tokens = np.asarray(ref.tokens, np.int64)
        logits = model.forward(tokens, 0, model.new_cache(capacity=len(tokens)), trace=trace)
        out = [(f"l_out-{i}", nmse(trace[f"l_out-{i}"], ref.tensors[f"l_out-{i}"])) for i in model.layers]
        return [*out, ("output", ref.logits.nmse(logits))]
    out = [(f"l_out-{i}", nmse(run_layer(model, i, x), ref.tensors[f"l_out-{i}"])) for i, x in layer_inputs(model, ref)]
    n = model.config.n_layers
    out.append(("output", ref.logits.nmse(run_layer(model, n, ref.tensors[f"l_out-{n - 1}"]))))
    return out


# Order in which one layer's tensors are computed (transformer.py records them under llama.cpp's names).
LAYER_TENSORS = ("attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "ffn_inp", "ffn_norm", "ffn_out", "l_out")


def layer_tensor_names(n_layers: int) -> Callable[[str], bool]:
    """A capture predicate for every tensor `first_divergence` compares."""
    wanted = {f"{base}-{i}" for base in LAYER_TENSORS for i in range(n_layers)} | {"result_norm"}
    return wanted.__contains__


def first_divergence(model, ref: Reference, threshold: float) -> tuple[str, float] | None:
    """Teacher-forced, tensor by tensor: the first (tensor name, NMSE) above `threshold`, or None.

    Needs a reference that captured them (`Reference.from_llamacpp(..., extra=layer_tensor_names(n))`).
    """
    for i, x in layer_inputs(model, ref):
        trace: dict[str, np.ndarray] = {}
        run_layer(model, i, x, trace)
        for base in LAYER_TENSORS:
            name = f"{base}-{i}"
            if name in trace and name in ref.tensors and trace[name].shape == ref.tensors[name].shape:
                err = nmse(trace[name], ref.tensors[name])
                if err > threshold:
                    return name, err
    n = model.config.n_layers
    trace = {}
    head = run_layer(model, n, ref.tensors[f"l_out-{n - 1}"], trace)
    if "result_norm" in ref.tensors and (err := nmse(trace["result_norm"], ref.tensors["result_norm"])) > threshold:
        return "result_norm", err
    if (err := ref.logits.nmse(head)) > threshold:
        return "result_output", err
    return None


# -- thresholds (issue 4) --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Threshold:
    """One row of the issue's table: for `mode` ("exact", "llamacpp", "both") and `weights` ("float": only
    F32/F16/BF16 weights, "quantized", "every"), each metric's bound."""

    mode: str
    weights: str
    limits: dict[str, tuple[str, float]]  # metric -> (">=" or "<=", bound)

    def applies(self, mode: str, is_float: bool) -> bool:
        weights_ok = self.weights == "every" or (self.weights == "float") == is_float
        return self.mode in ("both", mode_family(mode)) and weights_ok

    @property
    def what(self) -> str:
        scope = "per layer" if any(k.startswith("layer") for k in self.limits) else "end to end"
        return f"{scope}, {self.mode}, {self.weights} weights"


THRESHOLDS = (
    Threshold("exact", "float", {"top1": (">=", 0.99), "kl_mean": ("<=", 1e-4)}),
    Threshold("llamacpp", "float", {"top1": (">=", 0.99), "kl_mean": ("<=", 1e-5)}),
    Threshold("both", "quantized", {"top1": (">=", 0.90), "kl_mean": ("<=", 1e-2)}),
    Threshold("exact", "every", {"layer_max": ("<=", 1e-3)}),
    Threshold("llamacpp", "every", {"layer_median": ("<=", 1e-7), "layer_max": ("<=", 1e-4)}),
)


def summarize_layers(layers: list[tuple[str, float]]) -> dict:
    errs = np.array([e for _, e in layers])
    worst = layers[int(np.argmax(errs))][0]
    return {"layer_median": float(np.median(errs)), "layer_max": float(errs.max()), "layer_worst": worst}


def failures(row: dict) -> list[str]:
    """The thresholds a report row (mode, types, metrics) breaks, as readable strings."""
    is_float = set(row["types"]) <= FLOAT_TYPES
    broken = []
    for th in THRESHOLDS:
        if not th.applies(row["mode"], is_float):
            continue
        for metric, (op, bound) in th.limits.items():
            value = row.get(metric)
            if value is None:
                continue
            ok = value >= bound if op == ">=" else value <= bound
            if not ok:
                broken.append(f"{th.what}: {metric} = {value:.3g}, required {op} {bound:g}")
    return broken


def compare(model, ref: Reference, continuation: bool = True) -> dict:
    """End to end and per layer, as one report row (without the model/mode labels)."""
    return {**end_to_end(model, ref, continuation), **summarize_layers(per_layer(model, ref))}
