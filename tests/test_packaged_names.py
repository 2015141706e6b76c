"""One resolver for model names at every entry point; the HF tokenizer without transformers."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import ggufpy
from ggufpy import packaged
from ggufpy.cli import main
from tests.models import smollm2_path

ALIASES = ["smollm2", "SmolLM2-135M", "smollm2-135m", "SMOLLM2-135M-Instruct"]


@pytest.mark.parametrize("name", ALIASES)
def test_every_entry_point_takes_every_alias(name):
    """Before: `-m SmolLM2-135M` (the name --help showed), ggufpy.open("smollm2") and load_tokenizer failed."""
    path = smollm2_path()
    assert packaged.resolve(name) == path
    with ggufpy.open(name) as f:
        assert f.metadata["general.architecture"] == "llama"
    assert ggufpy.load_tokenizer(name).vocab_size == 49152


def test_gemma_aliases_name_the_same_package():
    assert {packaged.packaged_name(n) for n in ("gemma3", "Gemma-3-270M", "gemma3-270m")} == {"gemma3"}


def test_unknown_names_list_the_packaged_ones(tmp_path, capsys):
    for entry in (ggufpy.open, ggufpy.load_tokenizer, ggufpy.load):
        with pytest.raises(packaged.UnknownModelError, match=r"'llama-7b' is neither a GGUF file.*smollm2 \(also"):
            entry("llama-7b")
    assert main(["inspect", "gemma-2b"]) == 2
    assert "packaged models are smollm2 (also smollm2-135m" in capsys.readouterr().err
    # a file path is still a file path, and the default is SmolLM2
    assert packaged.resolve(str(smollm2_path())) == smollm2_path() == packaged.resolve(None)


def test_hf_style_tokenizer_is_callable_without_transformers(tiny_llama_path, monkeypatch):
    """Before: `TypeError: 'HFStyleTokenizer' object is not callable` in the README's HF example."""
    from ggufpy.hf import HFStyleTokenizer, load_tokenizer

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.warns(UserWarning, match="ggufpy"):
        tok = load_tokenizer(tiny_llama_path)
    assert isinstance(tok, HFStyleTokenizer)
    batch = tok(["the cat", "the"], padding=True, return_tensors="np")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape == (2, len(tok.encode("the cat")))
    n = len(tok.encode("the"))
    assert mask[1].tolist() == [0] * (ids.shape[1] - n) + [1] * n  # padded on the left, as the model needs
    assert ids[1, -n:].tolist() == tok.encode("the")
    assert ids[1, 0] == tok.eos_token_id and tok.pad_token_id is None  # no pad token: EOS pads
    assert tok("the cat") == {"input_ids": tok.encode("the cat"), "attention_mask": [1] * len(tok.encode("the cat"))}
    with pytest.raises(TypeError, match=r'pip install "ggufpy\[hf\]"'):
        tok(["a"], truncation=True)
    with pytest.raises(ValueError, match="padding=True"):
        tok(["the cat", "the"], return_tensors="np")
    assert isinstance(np.asarray(tok(["a"], return_tensors="np")["input_ids"]), np.ndarray)
