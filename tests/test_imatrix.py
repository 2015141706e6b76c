"""`ggufpy imatrix`: per-column sums of squared matmul inputs, llama-imatrix's protocol and file format.

The sums are checked against the activations the model itself records (its trace), and live against
llama.cpp's own activations (eval callback) on SmolLM2: llama-imatrix is not part of llama-cpp-python, so the
comparison is with what it would sum, the inputs of each product in llama.cpp's graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.imatrix import compute_imatrix
from ggufpy.perplexity import Chunks, make_chunks
from ggufpy.workbench.imatrix_file import ImatrixFile
from tests import models

# which traced activation feeds which weights (llama.cpp's graph names, as ggufpy's trace uses them)
INPUTS = {
    "attn_norm": ("attn_q", "attn_k", "attn_v"),
    "kqv_out": ("attn_output",),
    "ffn_norm": ("ffn_gate", "ffn_up"),
}


def _chunks(n_tokens: int, n_ctx: int, vocab: int, bos: int | None) -> Chunks:
    rng = np.random.default_rng(0)
    return Chunks(rng.integers(3, vocab, n_tokens).astype(np.int32), n_ctx, bos)


def test_sums_are_the_squares_of_the_traced_inputs(tiny_llama):
    model = tiny_llama
    chunks = _chunks(64, 32, model.config.vocab_size, 1)
    im = compute_imatrix(model, chunks, dataset="random")
    expected: dict[str, np.ndarray] = {}
    for i in range(chunks.n_chunk):
        trace: dict[str, np.ndarray] = {}
        model.forward(chunks.chunk(i), 0, model.new_cache(32), trace=trace)
        for layer in model.layers:
            for act, weights in INPUTS.items():
                x = trace[f"{act}-{layer}"].astype(np.float64)
                for w in weights:
                    key = f"blk.{layer}.{w}.weight"
                    expected[key] = expected.get(key, 0) + (x * x).sum(axis=0)
    for key, sums in expected.items():
        e = im.entries[key]
        assert e.counts.tolist() == [64.0]
        np.testing.assert_allclose(e.sums[0], sums, rtol=1e-6)
    assert all(k.startswith("blk.") for k in im.entries)
    assert {k.split(".")[2] for k in im.entries} == {"attn_q", "attn_k", "attn_v", "attn_output"} | {
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    }
    assert im.chunk_count == 2 and im.chunk_size == 32 and im.datasets == ["random"]


def test_output_weight_only_with_process_output(tiny_llama):
    chunks = _chunks(32, 32, tiny_llama.config.vocab_size, 1)
    assert "output.weight" not in compute_imatrix(tiny_llama, chunks).entries
    assert compute_imatrix(tiny_llama, chunks, process_output=True).entries["output.weight"].counts[0] == 32


def test_cli_writes_llama_cpp_format(tiny_llama_path, tmp_path):
    import gguf

    from ggufpy.cli import main

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "im.gguf"
    assert (
        main(["imatrix", "-m", str(tiny_llama_path), "-f", str(text), "-c", "32", "--chunks", "2", "-o", str(out)]) == 0
    )
    r = gguf.GGUFReader(out)
    assert bytes(r.fields["general.type"].parts[-1]).decode() == "imatrix"
    assert int(r.fields["imatrix.chunk_count"].parts[-1][0]) == 2
    names = [t.name for t in r.tensors]  # per weight, sorted by name: <weight>.in_sum2 then <weight>.counts
    assert names[:2] == ["blk.0.attn_k.weight.in_sum2", "blk.0.attn_k.weight.counts"]
    assert names[::2] == sorted(names[::2])
    im = ImatrixFile.load(out)
    assert im.entries["blk.1.ffn_down.weight"].sums.shape == (1, 512)


@pytest.mark.conformance
@pytest.mark.parametrize("numerics", ["exact", pytest.param("host", marks=pytest.mark.slow)])  # host: ~75 s
def test_sums_match_llama_cpp_activations(numerics):
    """SmolLM2, 2 chunks of 64 tokens: ggufpy's sums against the same sums over llama.cpp's graph inputs
    (attn_norm, kqv_out, ffn_norm, ffn_swiglu). The activations themselves differ (llama.cpp quantizes the
    matmul inputs to 8 bits and keeps K/V in f16): measured relative L2 differences of the sums are <= 0.5 %
    for the normed inputs and <= 3.5 % for attn_output / ffn_down, whose inputs come out of attention and the
    gated product; the totals agree to 1 % (0.5 % for the normed inputs)."""
    pytest.importorskip("llama_cpp")
    import ggufpy
    from conformance.llamacpp import LlamaCpp
    from ggufpy.numerics import host_llamacpp_mode
    from ggufpy.perplexity import default_text

    # "host": the llamacpp numerics of the build installed here, whose matmul inputs are llama.cpp's bit for bit:
    # then only the order of the f32 sums differs
    mode = host_llamacpp_mode() if numerics == "host" else "exact"
    model = ggufpy.load(models.smollm2_path(), backend="numpy", numerics=mode)

    chunks = make_chunks(model.tokenizer, default_text(), 64, 2)
    im = compute_imatrix(model, chunks)
    inputs = dict(INPUTS, ffn_swiglu=("ffn_down",))
    theirs: dict[str, np.ndarray] = {}
    with LlamaCpp(models.smollm2_path()) as ref:
        for i in range(chunks.n_chunk):
            _, cap = ref.run(chunks.chunk(i), capture=lambda n: n.split("-")[0] in inputs)
            for name, x in cap.items():
                act, layer = name.rsplit("-", 1)
                for w in inputs[act]:
                    key = f"blk.{layer}.{w}.weight"
                    theirs[key] = theirs.get(key, 0) + (x.astype(np.float64) ** 2).sum(axis=0)
    assert set(theirs) == set(im.entries)
    for key, sums in theirs.items():
        ours = im.entries[key].sums[0]
        if numerics == "host":  # f32 sums of the same values (ours) against f64 sums (these): rounding only
            assert np.allclose(ours, sums, rtol=1e-5, atol=0), key
            continue
        late = key.split(".")[2] in ("attn_output", "ffn_down")
        assert np.linalg.norm(ours - sums) / np.linalg.norm(sums) < (0.05 if late else 0.01), key
        assert abs(ours.sum() / sums.sum() - 1) < (0.02 if late else 5e-3), key
