"""`ggufpy diff`: per-layer and per-tensor attribution of a quantization's error (ggufpy/attribution.py)."""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from ggufpy.attribution import _kld, _log_softmax, attribute, matrix_names, swapped
from ggufpy.perplexity import Chunks
from ggufpy.workbench.mixes import MixOptions
from ggufpy.workbench.quantize import quantize_model


@pytest.fixture(scope="module")
def pair(tiny_llama_path, tmp_path_factory):
    """The tiny F32 model and its Q2_K quantization (--pure: every matrix Q2_K, the head too)."""
    out = tmp_path_factory.mktemp("diff") / "q2k.gguf"
    quantize_model(tiny_llama_path, out, "Q2_K", options=MixOptions(pure=True))
    return ggufpy.load(tiny_llama_path, backend="numpy"), ggufpy.load(out, backend="numpy"), out


def _chunks(model) -> Chunks:
    ids = np.random.default_rng(3).integers(3, model.config.vocab_size, 64).astype(np.int32)
    return Chunks(ids, 32, 1)


def _kld_of(model, base, chunks) -> float:
    total = 0.0
    for c in range(chunks.n_chunk):
        ids = chunks.chunk(c)
        lp = _log_softmax(model.forward(ids, 0, model.new_cache(32))[chunks.first :])
        blp = _log_softmax(base.forward(ids, 0, base.new_cache(32))[chunks.first :])
        total += _kld(blp, lp) / chunks.n_chunk
    return total


def test_keeping_the_top_ranked_tensor_recovers_more_kld(pair):
    base, quant, _ = pair
    chunks = _chunks(base)
    result = attribute(base, quant, chunks)
    ranked = result.ranked()
    assert len(ranked) == len(matrix_names(base)) and all(t.kld is not None for t in ranked)
    assert ranked[0].kld > ranked[-1].kld >= 0
    top, bottom = ranked[0], ranked[-1]
    items = {t.name: it for t, it in zip(result.tensors, matrix_names(base), strict=True)}
    with swapped(quant, base, [items[top.name]]):
        keep_top = _kld_of(quant, base, chunks)
    with swapped(quant, base, [items[bottom.name]]):
        keep_bottom = _kld_of(quant, base, chunks)
    assert keep_top < keep_bottom <= result.total_kld * 1.05
    assert abs(_kld_of(quant, base, chunks) - result.total_kld) < 1e-9


def test_a_model_against_itself_attributes_nothing(pair):
    base, _, _ = pair
    result = attribute(base, base, _chunks(base))
    assert result.total_kld == 0 and all(v == 0 for v in result.layer_nmse.values())
    assert all(t.nmse in (0, None) and t.kld == 0 for t in result.tensors)


def test_layer_nmse_is_teacher_forced(pair):
    """Each layer's number is its own error on the base's input: positive for every quantized layer, and not
    growing with depth the way the compounding error of a free-running forward pass does."""
    base, quant, _ = pair
    result = attribute(base, quant, _chunks(base), kld=False)
    assert all(v > 0 for v in result.layer_nmse.values())
    assert all(t.kld is None for t in result.tensors)
    some = attribute(base, quant, _chunks(base), kld=2)  # the 2 of largest NMSE, and token_embd / output
    with_kld = [t for t in some.tensors if t.kld is not None]
    worst_nmse = sorted((t for t in result.tensors if t.nmse is not None), key=lambda t: -t.nmse)[:2]
    assert {t.name for t in with_kld} == {t.name for t in worst_nmse} | {"token_embd.weight", "output.weight"}
    layer0 = [t for t in result.tensors if t.layer == 0]
    assert {t.base_type for t in layer0} == {"F32"} and {t.quant_type for t in layer0} == {"Q2_K"}


def test_cli_prints_a_ranked_table(pair, tiny_llama_path, tmp_path, capsys):
    from ggufpy.cli import main

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    _, _, qpath = pair
    assert main(["diff", str(tiny_llama_path), str(qpath), "-f", str(text), "-c", "32", "--chunks", "1"]) == 0
    out = capsys.readouterr().out
    assert "KLD" in out and "blk.0.attn_q.weight" in out and "total KLD" in out
