"""The metadata schema (`ggufpy.schema`) and the config built through it: types, ranges, cross-key rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ggufpy import schema
from ggufpy.config import config_from_metadata
from ggufpy.errors import GGUFError, GGUFMetadataError, GGUFUnsupportedError

LLAMA = {
    "general.architecture": "llama",
    "llama.context_length": 256,
    "llama.embedding_length": 64,
    "llama.block_count": 2,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
}


def key(kind: str, rule=None, **kw) -> schema.Key:
    return schema.Key("test.{arch}.key", kind, rule, **kw)


def test_read_converts_checks_and_defaults():
    assert schema.read({"test.a.key": 3}, key("number"), arch="a") == 3.0
    assert isinstance(schema.read({"test.a.key": np.uint32(3)}, key("integer"), arch="a"), int)
    assert schema.read({}, key("integer", default=7), arch="a") == 7
    with pytest.raises(GGUFMetadataError, match=r"^f\.gguf: metadata key test\.a\.key is required but missing$"):
        schema.read({}, key("integer", required=True), arch="a", source="f.gguf")


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("integer", True),  # a bool is not a count
        ("integer", 2.0),
        ("integer", "2"),
        ("number", "1e-5"),
        ("number", [1.0]),
        ("bool", 1),
        ("string", 5),
        ("string", ["a"]),
        ("string array", "abc"),
        ("string array", ["a", 1]),
        ("number array", ["1"]),
        ("number array", np.array([True, False])),
        ("integer array", [1.5]),
        ("integer array", np.zeros((2, 2), np.int32)),
    ],
)
def test_each_kind_refuses_other_types(kind, value):
    with pytest.raises(GGUFMetadataError, match=rf"metadata test\.\.key = .*: must be an? {kind}$"):
        schema.read({"test..key": value}, key(kind))


def test_float_rules_are_checked_in_float32():
    """1e-50 is > 0 as a Python float but 0 in the forward pass; 1e39 is finite in float64, inf in float32."""
    for value in (1e-50, 1e39, math.nan, math.inf, 0.0, -1.0):
        assert not schema.POSITIVE_F32.ok(value), value
    assert schema.POSITIVE_F32.ok(1e-6) and schema.POSITIVE_F32.ok(3e38)
    assert not schema.ROPE_BASE.ok(0.5) and schema.ROPE_BASE.ok(1e6)


def test_error_messages_stay_short_for_huge_values():
    with pytest.raises(GGUFMetadataError) as info:
        schema.read({"test..key": list(range(2_000_000))}, key("string array"))
    assert len(str(info.value)) < 200 and "(2000000 entries)" in str(info.value)


def test_config_from_metadata_fills_defaults():
    cfg = config_from_metadata(LLAMA, vocab_size=100)
    assert (cfg.head_dim, cfg.rope_dim, cfg.rope_theta, cfg.norm_eps, cfg.sliding_window) == (16, 16, 1e4, 1e-5, None)
    assert config_from_metadata(LLAMA | {"llama.rope.scaling.factor": 4}, 100).rope_freq_scale == 0.25


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        ({"general.architecture": ["llama"]}, "general.architecture = ['llama']: must be a string"),
        ({"llama.block_count": 0}, "llama.block_count = 0: must be an integer in [1, 2147483647]"),
        ({"llama.context_length": 2**32}, "llama.context_length = 4294967296"),
        ({"llama.attention.head_count_kv": 3}, "head_count_kv = 3: must divide llama.attention.head_count = 4"),
        ({"llama.attention.head_count": 128}, "head_count = 128: must be <= llama.embedding_length = 64"),
        ({"llama.rope.dimension_count": 32}, "dimension_count = 32: must be even and <= the head size 16"),
        ({"llama.rope.dimension_count": 9}, "dimension_count = 9: must be an even integer"),
        ({"llama.rope.freq_base": math.nan}, "llama.rope.freq_base = nan: must be finite and >= 1 in float32"),
        ({"llama.attention.layer_norm_rms_epsilon": 0}, "layer_norm_rms_epsilon = 0: must be finite and > 0"),
        ({"llama.rope.scaling.factor": math.inf}, "llama.rope.scaling.factor = inf"),
        ({"llama.rope.scaling.type": "dynamic"}, "must be one of none, linear, yarn, longrope"),
    ],
)
def test_config_refuses_bad_hyperparameters(edit, fragment):
    with pytest.raises(GGUFMetadataError) as info:
        config_from_metadata(LLAMA | edit, vocab_size=100, source="m.gguf")
    assert str(info.value).startswith("m.gguf: ") and fragment in str(info.value)


def test_vocab_size_from_the_embeddings_must_be_positive():
    with pytest.raises(GGUFMetadataError, match="token_embd has 0 rows"):
        config_from_metadata(LLAMA, vocab_size=0)


def test_gemma_keys_are_read_only_where_the_architecture_has_them():
    gemma2 = {k.replace("llama", "gemma2"): v for k, v in LLAMA.items()} | {"general.architecture": "gemma2"}
    cfg = config_from_metadata(gemma2 | {"gemma2.attn_logit_softcapping": 50, "gemma2.attention.sliding_window": 8}, 9)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window) == (50.0, None, 8)
    assert config_from_metadata(LLAMA | {"llama.attention.sliding_window": 8}, 9).sliding_window is None
    with pytest.raises(GGUFMetadataError, match=r"gemma2\.final_logit_softcapping = -1\.0"):
        config_from_metadata(gemma2 | {"gemma2.final_logit_softcapping": -1.0}, 9)


def test_unknown_architecture_is_unsupported_and_every_error_is_a_gguf_error():
    with pytest.raises(GGUFUnsupportedError, match="'mamba9' is not supported"):
        config_from_metadata(LLAMA | {"general.architecture": "mamba9"}, 9)
    assert issubclass(GGUFMetadataError, GGUFError) and issubclass(GGUFMetadataError, ValueError)


def test_every_model_key_names_a_known_kind():
    for table in (schema.MODEL_KEYS, schema.TOKENIZER_KEYS):
        for k in table.values():
            assert k.kind in schema.KINDS, k
