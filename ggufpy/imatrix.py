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
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .perplexity import Chunks
from .workbench.imatrix_file import ImatrixEntry, ImatrixFile

__all__ = ["ActivationRecorder", "compute_imatrix"]

MIN_ROWS = 16  # imatrix.cpp collect_imatrix: "why are small batches ignored (<16 tokens)?"


class ActivationRecorder:
    """A backend that passes every product through to `inner` and, for the weights `want` names, adds each
    input row's squares to a per-column sum."""

    def __init__(self, inner, want: Callable[[str], bool]):
        self.inner = inner
        self.name = inner.name
        self.numerics = inner.numerics
        self.want = want
        self.sums: dict[str, np.ndarray] = {}  # name -> f64[in]
        self.counts: dict[str, int] = {}

    def linear(self, x: np.ndarray, w) -> np.ndarray:
        if x.shape[0] >= MIN_ROWS and self.want(w.name):
            x64 = np.asarray(x, np.float64)
            sq = np.einsum("tj,tj->j", x64, x64)  # (in,)
            if w.name in self.sums:
                self.sums[w.name] += sq
            else:
                self.sums[w.name] = sq
            self.counts[w.name] = self.counts.get(w.name, 0) + x.shape[0]
        return self.inner.linear(x, w)


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

    recorder = ActivationRecorder(model.backend, want)
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
        name: ImatrixEntry(sums.astype(np.float32)[None, :], np.array([recorder.counts[name]], np.float32))
        for name, sums in recorder.sums.items()
    }
    return ImatrixFile(entries, [dataset] if dataset else [], chunk_count=chunks.n_chunk, chunk_size=chunks.n_ctx)
