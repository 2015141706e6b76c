"""Importance matrices: the mean squared activation of each input column of each matrix, as llama-imatrix computes.

    from ggufpy.imatrix import compute_imatrix
    im = compute_imatrix(model, make_chunks(model.tokenizer, text, n_ctx=512))
    im.save("imatrix.gguf")           # llama.cpp's format; `ggufpy quantize --imatrix` and llama-quantize read it

llama.cpp `tools/imatrix/imatrix.cpp`: the text is cut into chunks of n_ctx tokens exactly as for perplexity
(`perplexity.make_chunks`: BOS in place of each chunk's first token), each chunk runs from an empty cache, and for
every matrix product x @ W.T with W a `blk.*` weight (and `output.weight` with process_output) the sum over
tokens of x_j^2 is kept per input column j, with the number of tokens. Products of fewer than 16 rows are not
collected (llama.cpp skips them). ggufpy sums in float64 and stores f32, llama.cpp sums in f32: the results agree
to f32 summation accuracy on the same activations; the activations themselves are ggufpy's (see docs).

Mixtures of experts: a stacked expert tensor (`ffn_gate_exps`, ...: llama.cpp's `ggml_mul_mat_id`) gets one row
of sums and one count per expert, (n_expert, n_in), from the rows routed to that expert only, each token once per
expert it is routed to (imatrix.cpp collect_imatrix's GGML_OP_MUL_MAT_ID branch). These products are collected
at any batch size, as llama.cpp asks for every MUL_MAT_ID; an expert no token reached keeps a count of 0 (the
file stores it so: llama-quantize then weighs its columns by 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from .perplexity import Chunks
from .weights import ExpertTensor, QuantTensor
from .workbench.imatrix_file import ImatrixEntry, ImatrixFile

__all__ = ["ActivationRecorder", "compute_imatrix", "expert_stacks"]

MIN_ROWS = 16  # imatrix.cpp collect_imatrix: "why are small batches ignored (<16 tokens)?"


class ActivationRecorder:
    """A backend that passes every product through to `inner` and, for the weights `want` names, adds each
    input row's squares to a per-column sum; for the experts of the stacks in `experts`, to that expert's row."""

    def __init__(self, inner, want: Callable[[str], bool], experts: Iterable[ExpertTensor] = ()):
        self.inner = inner
        self.name = inner.name
        self.numerics = inner.numerics
        self.want = want
        self.sums: dict[str, np.ndarray] = {}  # name -> f64[n_mat, in]
        self.counts: dict[str, np.ndarray] = {}  # name -> int64[n_mat]
        # each expert's 2-D view (a QuantTensor, hashed by identity) -> (its stack, expert index)
        self.expert_of: dict[QuantTensor, tuple[ExpertTensor, int]] = {
            q: (stack, e) for stack in experts for e, q in enumerate(stack.experts)
        }

    def linear(self, x: np.ndarray, w) -> np.ndarray:
        hit = self.expert_of.get(w)
        if hit is not None:  # a routed product: every size counts (llama.cpp collects all MUL_MAT_IDs)
            stack, e = hit
            self._add(stack.name, stack.shape[0], e, x)
        elif x.shape[0] >= MIN_ROWS and self.want(w.name):
            self._add(w.name, 1, 0, x)
        return self.inner.linear(x, w)

    def _add(self, name: str, n_mat: int, mat: int, x: np.ndarray) -> None:
        if name not in self.sums:
            self.sums[name] = np.zeros((n_mat, x.shape[1]), np.float64)
            self.counts[name] = np.zeros(n_mat, np.int64)
        x64 = np.asarray(x, np.float64)
        self.sums[name][mat] += np.einsum("tj,tj->j", x64, x64)  # (in,)
        self.counts[name][mat] += x.shape[0]


def expert_stacks(model) -> list[ExpertTensor]:
    """The stacked expert tensors of the model's layers (ffn_gate_exps, ffn_up_exps, ffn_down_exps)."""
    return [w for layer in model.weights.layers.values() for w in vars(layer).values() if isinstance(w, ExpertTensor)]


def compute_imatrix(
    model,
    chunks: Chunks,
    *,
    process_output: bool = False,
    dataset: str = "",
    on_chunk: Callable[[int], None] | None = None,
) -> ImatrixFile:
    """The importance matrix of `model` over `chunks` (llama-imatrix's protocol): an `ImatrixFile` holding,
    per weight, the f32 sums of squares (in_sum2) and the token count."""

    def want(name: str) -> bool:
        return name.startswith("blk.") or (process_output and name == "output.weight")

    recorder = ActivationRecorder(model.backend, want, expert_stacks(model))
    backend, decode_block = model.backend, model.decode_block
    model.backend, model.decode_block = recorder, None  # every product through the recorder
    try:
        for i in range(chunks.n_chunk):
            cache = model.new_cache(chunks.n_ctx)
            model.forward(chunks.chunk(i), 0, cache, last_only=not process_output)
            if on_chunk is not None:
                on_chunk(i)
    finally:
        model.backend, model.decode_block = backend, decode_block
    entries = {
        name: ImatrixEntry(sums.astype(np.float32), recorder.counts[name].astype(np.float32))
        for name, sums in recorder.sums.items()
    }
    return ImatrixFile(entries, [dataset] if dataset else [], chunk_count=chunks.n_chunk, chunk_size=chunks.n_ctx)
