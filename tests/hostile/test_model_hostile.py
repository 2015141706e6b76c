"""Issue 11, the model loader's findings: each row is a crafted file, the exception `ggufpy.load` must raise, and
a fragment of its message (the key or tensor, and the rule). Before the metadata schema these were TypeError,
ValueError, OverflowError, FileNotFoundError, an IndexError mid-generation, or silently NaN logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import ggufpy
from ggufpy.constants import GGML_BLOCK_LAYOUT, GGMLType
from ggufpy.errors import GGUFError, GGUFMetadataError, GGUFUnsupportedError
from ggufpy.quants import QUANT_TYPES
from ggufpy.weights import LINEAR_TYPES
from tests.hostile.model_craft import Crafted, base, with_spm

V = ggufpy.GGUFValueType
T = "tokenizer.ggml."
NAN = float("nan")


@dataclass(frozen=True)
class Row:
    id: str
    craft: Callable[[], Crafted]
    error: type[Exception]
    fragment: str


def llama(*edits: Callable[[Crafted], object]) -> Callable[[], Crafted]:
    return _edited("llama", False, edits)


def spm(*edits: Callable[[Crafted], object]) -> Callable[[], Crafted]:
    return _edited("llama", True, edits)


def gemma(arch: str, *edits: Callable[[Crafted], object]) -> Callable[[], Crafted]:
    return _edited(arch, False, edits)


def _edited(arch: str, spm_vocab: bool, edits) -> Callable[[], Crafted]:
    def make() -> Crafted:
        m = with_spm(base(arch)) if spm_vocab else base(arch).copy()
        for edit in edits:
            edit(m)
        return m

    return make


def put(key: str, vtype, value, elem=None) -> Callable[[Crafted], object]:
    return lambda m: m.set(key, vtype, value, elem)


def drop(key: str) -> Callable[[Crafted], object]:
    return lambda m: m.drop(key)


ROWS = [
    # types that used to escape as TypeError / ValueError / AttributeError
    Row("arch-array", llama(put("general.architecture", V.ARRAY, ["llama"], V.STRING)), GGUFMetadataError,
        "general.architecture = ['llama']: must be a string"),
    Row("pre-array", llama(put(T + "pre", V.ARRAY, ["default"], V.STRING)), GGUFMetadataError,
        "tokenizer.ggml.pre = ['default']: must be a string"),
    Row("block-count-0", llama(put("llama.block_count", V.UINT32, 0)), GGUFMetadataError,
        "llama.block_count = 0: must be an integer in [1, "),
    Row("block-count-minus-1", llama(put("llama.block_count", V.INT32, -1)), GGUFMetadataError,
        "llama.block_count = -1: must be an integer in [1, "),
    Row("block-count-string", llama(put("llama.block_count", V.STRING, "abc")), GGUFMetadataError,
        "llama.block_count = 'abc': must be an integer"),
    Row("block-count-missing", llama(drop("llama.block_count")), GGUFMetadataError,
        "llama.block_count is required but missing"),
    Row("no-token-embd", llama(lambda m: m.drop_tensor("token_embd.weight")), GGUFMetadataError,
        "tensor 'token_embd.weight' is required but missing"),
    Row("scores-short", spm(put(T + "scores", V.ARRAY, [0.0] * 10, V.FLOAT32)), GGUFMetadataError,
        "tokenizer.ggml.scores = array of 10 float64: must have an entry for each of the 269"),
    Row("token-types-short", spm(put(T + "token_type", V.ARRAY, [1] * 10, V.INT32)), GGUFMetadataError,
        "tokenizer.ggml.token_type"),
    Row("scores-strings", spm(put(T + "scores", V.ARRAY, ["x"] * 269, V.STRING)), GGUFMetadataError,
        "tokenizer.ggml.scores = ['x', 'x', 'x', ...] (269 entries): must be a number array"),
    Row("token-type-2**40", spm(put(T + "token_type", V.ARRAY, [1] * 268 + [2**40], V.INT64)), GGUFMetadataError,
        "tokenizer.ggml.token_type = array of 269 int64: must be an array of int32 values"),
    Row("merges-ints", llama(put(T + "merges", V.ARRAY, [1, 2, 3], V.INT32)), GGUFMetadataError,
        "tokenizer.ggml.merges = [1, 2, 3]: must be a string array"),
    Row("tokens-ints", llama(put(T + "tokens", V.ARRAY, list(range(269)), V.INT32)), GGUFMetadataError,
        "tokenizer.ggml.tokens = array of 269 int32: must be a string array"),
    Row("bos-string", llama(put(T + "bos_token_id", V.STRING, "abc")), GGUFMetadataError,
        "tokenizer.ggml.bos_token_id = 'abc': must be an integer"),
    Row("bos-nan", llama(put(T + "bos_token_id", V.FLOAT32, NAN)), GGUFMetadataError,
        "tokenizer.ggml.bos_token_id = nan: must be an integer"),
    Row("bos-array", llama(put(T + "bos_token_id", V.ARRAY, [1], V.UINT32)), GGUFMetadataError,
        "tokenizer.ggml.bos_token_id = [1]: must be an integer"),
    Row("tokenizer-model-missing", llama(drop(T + "model")), GGUFMetadataError,
        "tokenizer.ggml.model is required but missing"),
    Row("tokenizer-model-unknown", llama(put(T + "model", V.STRING, "t5")), GGUFUnsupportedError,
        "tokenizer.ggml.model = 't5' is not supported"),
    Row("chat-template-number", llama(put("tokenizer.chat_template", V.UINT32, 5)), GGUFMetadataError,
        "tokenizer.chat_template = 5: must be a string"),
    Row("vocab-200-vs-269-rows", llama(put(T + "tokens", V.ARRAY, [f"t{i}" for i in range(200)], V.STRING)),
        GGUFMetadataError, "must have one token per row of token_embd (269)"),
    Row("rope-dim-64-head-16", llama(put("llama.rope.dimension_count", V.UINT32, 64)), GGUFMetadataError,
        "llama.rope.dimension_count = 64: must be even and <= the head size 16"),
    Row("rope-dim-odd", llama(put("llama.rope.dimension_count", V.UINT32, 7)), GGUFMetadataError,
        "llama.rope.dimension_count = 7: must be an even integer"),
    # hyperparameters that used to give all-NaN logits (or backends that disagree)
    Row("rope-base-0", llama(put("llama.rope.freq_base", V.FLOAT32, 0.0)), GGUFMetadataError,
        "llama.rope.freq_base = 0.0: must be finite and >= 1"),
    Row("rope-base-nan", llama(put("llama.rope.freq_base", V.FLOAT32, NAN)), GGUFMetadataError,
        "llama.rope.freq_base = nan"),
    Row("eps-nan", llama(put("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, NAN)), GGUFMetadataError,
        "llama.attention.layer_norm_rms_epsilon = nan: must be finite and > 0"),
    Row("eps-0", llama(put("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, 0.0)), GGUFMetadataError,
        "layer_norm_rms_epsilon = 0.0"),
    Row("eps-negative", llama(put("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, -1e-5)), GGUFMetadataError,
        "layer_norm_rms_epsilon = -9.99"),
    Row("gemma2-softcap-nan", gemma("gemma2", put("gemma2.final_logit_softcapping", V.FLOAT32, NAN)),
        GGUFMetadataError, "gemma2.final_logit_softcapping = nan: must be finite and > 0"),
    Row("gemma2-attn-softcap-0", gemma("gemma2", put("gemma2.attn_logit_softcapping", V.FLOAT32, 0.0)),
        GGUFMetadataError, "gemma2.attn_logit_softcapping = 0.0"),
    Row("gemma3-sliding-window-0", gemma("gemma3", put("gemma3.attention.sliding_window", V.UINT32, 0)),
        GGUFMetadataError, "gemma3.attention.sliding_window = 0: must be an integer in [1, "),
    Row("context-length-0", llama(put("llama.context_length", V.UINT32, 0)), GGUFMetadataError,
        "llama.context_length = 0"),
    Row("head-count-0", llama(put("llama.attention.head_count", V.UINT32, 0)), GGUFMetadataError,
        "llama.attention.head_count = 0"),
    Row("head-count-kv-3", llama(put("llama.attention.head_count_kv", V.UINT32, 3)), GGUFMetadataError,
        "llama.attention.head_count_kv = 3: must divide llama.attention.head_count = 2"),
    Row("head-count-above-dim", llama(put("llama.attention.head_count", V.UINT32, 64)), GGUFMetadataError,
        "llama.attention.head_count = 64: must be <= llama.embedding_length = 32"),
    Row("feed-forward-0", llama(put("llama.feed_forward_length", V.UINT32, 0)), GGUFMetadataError,
        "llama.feed_forward_length = 0"),
    Row("embedding-length-2**40", llama(put("llama.embedding_length", V.UINT64, 2**40)), GGUFMetadataError,
        "llama.embedding_length = 1099511627776"),
    Row("rope-scale-negative", llama(put("llama.rope.scaling.factor", V.FLOAT32, -2.0)), GGUFMetadataError,
        "llama.rope.scaling.factor = -2.0"),
    Row("name-number", llama(put("general.name", V.UINT8, 3)), GGUFMetadataError, "general.name = 3"),
]  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_hostile_metadata_is_refused_at_load_naming_key_and_rule(row, tmp_path):
    path = row.craft().write(tmp_path / f"{row.id}.gguf")
    with pytest.raises(row.error) as info:
        ggufpy.load(path, backend="numpy")
    assert isinstance(info.value, GGUFError)
    assert row.fragment in str(info.value)
    assert str(path) in str(info.value)  # the file is named


def test_the_base_files_of_the_table_load_and_run(tmp_path):
    for name, craft in [("llama", llama()), ("spm", spm()), ("gemma2", gemma("gemma2")), ("g3", gemma("gemma3"))]:
        model = ggufpy.load(craft().write(tmp_path / f"{name}.gguf"), backend="numpy")
        assert np.isfinite(model.logits([1, 2, 3])).all()


def _untyped(backend: str) -> list[GGMLType]:
    """Types a file may name that this backend cannot multiply by, and that fit a row of 256 (ffn_down)."""
    return [
        t for t in GGML_BLOCK_LAYOUT if t not in LINEAR_TYPES[backend](False) and 256 % GGML_BLOCK_LAYOUT[t][0] == 0
    ]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_unsupported_weight_type_is_refused_at_load_on_every_backend(backend, tmp_path):
    if backend == "numba":
        pytest.importorskip("numba")
    types = _untyped(backend)
    if not types:
        pytest.skip(f"the {backend} backend multiplies by every type a file can name")
    for t in types:
        block, size = GGML_BLOCK_LAYOUT[t]
        m = base("llama").copy()
        name, _, ne, _ = m.tensor("blk.1.ffn_down.weight")
        m.retype(name, int(t), bytes(ne[0] * ne[1] // block * size))
        path = m.write(tmp_path / f"{t.name}.gguf")
        with pytest.raises(GGUFUnsupportedError) as info:
            ggufpy.load(path, backend=backend)
        message = str(info.value)
        assert f"tensor 'blk.1.ffn_down.weight' is {t.name}" in message and str(path) in message
        # a type outside the quant registry is refused by the decoder (the same message on every backend)
        expected = LINEAR_TYPES[backend](False) if t in QUANT_TYPES else QUANT_TYPES
        assert set(message.split("supported types: ")[1].split(", ")) == {x.name for x in expected}


def test_a_type_ggufpy_cannot_decode_is_named_with_its_tensor(tmp_path):
    undecodable = [t for t in GGML_BLOCK_LAYOUT if t not in QUANT_TYPES and GGML_BLOCK_LAYOUT[t][0] == 1]
    if not undecodable:
        pytest.skip("every type of GGML_BLOCK_LAYOUT is in the quant registry")
    t = undecodable[0]
    m = base("llama").copy()
    m.retype("output_norm.weight", int(t), bytes(32 * GGML_BLOCK_LAYOUT[t][1]))
    with pytest.raises(GGUFUnsupportedError, match=f"tensor 'output_norm.weight' is {t.name}, which ggufpy cannot"):
        ggufpy.load(m.write(tmp_path / "norm.gguf"), backend="numpy")


def test_special_token_id_outside_the_vocabulary_warns_and_keeps_the_default_as_llama_cpp(tmp_path):
    """llama.cpp logs "bad special token" and keeps its default: converted files do carry e.g. a padding id equal
    to the vocabulary size, so refusing them would refuse files llama.cpp runs."""
    m = llama(put(T + "padding_token_id", V.UINT32, 269), put(T + "bos_token_id", V.UINT32, 2**32 - 1))()
    with pytest.warns(UserWarning, match=r"tokenizer\.ggml\.bos_token_id = 4294967295 is outside the vocabulary"):
        model = ggufpy.load(m.write(tmp_path / "ids.gguf"), backend="numpy")
    assert model.tokenizer.pad_id is None and model.tokenizer.bos_id == 11  # llama.cpp's BPE default
