"""The metadata schema: every key the model and the tokenizer read, with its type, range and default.

The file is untrusted, so each value is checked once, where the config (`ggufpy.config`) and the vocabulary
(`ggufpy.tokenizer.vocab`) are built; past that point the code may rely on the types and ranges below. A
violation raises `GGUFMetadataError` naming the file, the key, the value and the rule. Key names are llama.cpp's
(`src/llama-arch.cpp` LLM_KV_*); `{arch}.` stands for the value of `general.architecture`.

llama.cpp checks the GGUF value type of each key (`llama_model_loader::get_key`) but few ranges; the ranges here
are the ones the forward pass needs to stay finite and in bounds (a RoPE base of 0 or an epsilon of NaN
silently gives all-NaN logits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import GGUFMetadataError

__all__ = ["MODEL_KEYS", "TOKENIZER_KEYS", "Key", "Rule", "fail", "read", "read_all"]

I32_MAX = 2**31 - 1  # llama.cpp keeps sizes and token ids in (u)int32


@dataclass(frozen=True)
class Rule:
    """A range check on a value already of the right type; `text` completes "must be ..." in errors."""

    text: str
    ok: Callable[[Any], bool]


def _f32_positive(v: float) -> bool:
    # checked in float32, the precision the forward pass uses: 1e-50 rounds to 0 there, 1e39 to inf
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(v)) and np.float32(v) > 0)


SIZE = Rule(f"an integer in [1, {I32_MAX}]", lambda v: 1 <= v <= I32_MAX)
TOKEN_ID = Rule("an integer in [0, 2**32) (a uint32, as llama.cpp reads it)", lambda v: 0 <= v < 2**32)
EVEN_SIZE = Rule(f"an even integer in [2, {I32_MAX}] (RoPE rotates pairs)", lambda v: 2 <= v <= I32_MAX and v % 2 == 0)
POSITIVE_F32 = Rule("finite and > 0 in float32", _f32_positive)
# a base below 1 makes the rotation frequencies grow with the dimension, up to inf (then NaN angles)
ROPE_BASE = Rule("finite and >= 1 in float32", lambda v: _f32_positive(v) and v >= 1)
SCALE_FACTOR = Rule("0 (no scaling) or finite and >= 0.001", lambda v: v == 0 or (math.isfinite(v) and v >= 1e-3))
NON_EMPTY = Rule("a non-empty array", lambda v: len(v) > 0)
INT32_VALUES = Rule(
    "an array of int32 values", lambda v: len(v) == 0 or (int(np.min(v)) >= -(2**31) and int(np.max(v)) <= I32_MAX)
)


# -- value kinds: each takes a raw metadata value and returns it converted, or None when the type is wrong --------


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) else None


def _float(v: Any) -> float | None:
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    return float(v) if ok else None


def _bool(v: Any) -> bool | None:
    return bool(v) if isinstance(v, (bool, np.bool_)) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _str_array(v: Any) -> Sequence[str] | None:
    # a list, or the reader's compact `StringArray` for long arrays: any sequence of str, kept as it is
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        return None
    return v if all(isinstance(s, str) for s in v) else None


def _numeric_array(v: Any, kinds: str) -> np.ndarray | None:
    """A 1-D NumPy array of one of the dtype `kinds` (the reader gives lists for short arrays, arrays for long)."""
    if isinstance(v, list):
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            return None
        v = np.array(v) if v else np.zeros(0, np.int32)
    if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype.kind not in kinds:
        return None
    return v


KINDS: dict[str, Callable[[Any], Any]] = {
    "integer": _int,
    "number": _float,
    "bool": _bool,
    "string": _str,
    "string array": _str_array,
    "number array": lambda v: _numeric_array(v, "iuf"),
    "integer array": lambda v: _numeric_array(v, "iu"),
}


@dataclass(frozen=True)
class Key:
    """One metadata key: its GGUF name, the kind of value (a key of `KINDS`), the range, and what its absence means."""

    name: str  # "{arch}." is replaced by the architecture
    kind: str
    rule: Rule | None = None
    required: bool = False
    default: Any = None  # when absent and not required (None: "not set", the reader decides)


# ModelConfig field -> key. Defaults that depend on other keys (head_count_kv, key_length, rope dims) are None
# here and filled in by `config_from_metadata`.
MODEL_KEYS: dict[str, Key] = {
    "context_length": Key("{arch}.context_length", "integer", SIZE, required=True),
    "dim": Key("{arch}.embedding_length", "integer", SIZE, required=True),
    "n_layers": Key("{arch}.block_count", "integer", SIZE, required=True),
    "hidden_dim": Key("{arch}.feed_forward_length", "integer", SIZE, required=True),
    "n_heads": Key("{arch}.attention.head_count", "integer", SIZE, required=True),
    "n_kv_heads": Key("{arch}.attention.head_count_kv", "integer", SIZE),
    "head_dim": Key("{arch}.attention.key_length", "integer", SIZE),
    "norm_eps": Key("{arch}.attention.layer_norm_rms_epsilon", "number", POSITIVE_F32, default=1e-5),
    "rope_theta": Key("{arch}.rope.freq_base", "number", ROPE_BASE, default=10000.0),  # llama.cpp's default
    "rope_dim": Key("{arch}.rope.dimension_count", "integer", EVEN_SIZE),
    "rope_scaling": Key("{arch}.rope.scaling.type", "string", default="none"),
    "rope_scaling_factor": Key("{arch}.rope.scaling.factor", "number", SCALE_FACTOR, default=0.0),
    "rope_scale_linear": Key("{arch}.rope.scale_linear", "number", SCALE_FACTOR, default=0.0),
    # 0 where an arch has no window (convert_hf_to_gguf writes it for Phi-4) or turns it off (llama4's chunking);
    # the archs that slide a window need >= 1 (config.py)
    "sliding_window": Key("{arch}.attention.sliding_window", "integer", Rule("an integer >= 0", lambda v: v >= 0)),
    "attn_softcap": Key("{arch}.attn_logit_softcapping", "number", POSITIVE_F32),
    "final_softcap": Key("{arch}.final_logit_softcapping", "number", POSITIVE_F32),
}

T = "tokenizer.ggml."
# Vocab field -> key. Special token ids are also checked against the vocabulary size by `build_vocab`.
TOKENIZER_KEYS: dict[str, Key] = {
    "model": Key(T + "model", "string", required=True),
    "tokens": Key(T + "tokens", "string array", NON_EMPTY, required=True),
    "scores": Key(T + "scores", "number array"),
    "token_type": Key(T + "token_type", "integer array", INT32_VALUES),
    "merges": Key(T + "merges", "string array"),
    "pre": Key(T + "pre", "string"),
    "add_space_prefix": Key(T + "add_space_prefix", "bool"),
    "add_bos": Key(T + "add_bos_token", "bool"),
    "add_eos": Key(T + "add_eos_token", "bool"),
    "add_sep": Key(T + "add_sep_token", "bool"),
    "chat_template": Key("tokenizer.chat_template", "string"),
    "name": Key("general.name", "string", default=""),
    "architecture": Key("general.architecture", "string", default=""),
    **{
        f"{name}_id": Key(T + f"{name}_token_id", "integer", TOKEN_ID)
        for name in (
            "bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask", "fim_pre", "fim_suf", "fim_mid",
            "fim_pad", "fim_rep", "fim_sep", "prefix", "suffix", "middle",
        )  # "seperator": sic, GGUF's spelling
    },
}  # fmt: skip

ARCHITECTURE = Key("general.architecture", "string", required=True)


def _show(value: Any, limit: int = 60) -> str:
    """A short repr for error messages: a 2M-entry array must not become a 20 MB message."""
    if isinstance(value, np.ndarray):
        text = f"array of {value.size} {value.dtype}"
    elif isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 8:
        text = f"[{', '.join(_show(x, 20) for x in value[:3])}, ...] ({len(value)} entries)"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fail(key: str, value: Any, rule: str, source: str | None = None) -> GGUFMetadataError:
    """The error for `key` holding `value` against `rule` ("must be ..."), naming the file when known."""
    where = f"{source}: " if source else ""
    return GGUFMetadataError(f"{where}metadata {key} = {_show(value)}: {rule}")


def read(md: Mapping[str, Any], key: Key, arch: str = "", source: str | None = None) -> Any:
    """The value of `key`, converted to its kind and checked against its rule; its default when absent."""
    name = key.name.replace("{arch}", arch)
    if name not in md:
        if key.required:
            where = f"{source}: " if source else ""
            raise GGUFMetadataError(f"{where}metadata key {name} is required but missing")
        return key.default
    raw = md[name]
    value = KINDS[key.kind](raw)
    if value is None:
        article = "an" if key.kind[0] in "aeiou" else "a"
        raise fail(name, raw, f"must be {article} {key.kind}", source)
    if key.rule is not None and not key.rule.ok(value):
        raise fail(name, raw, f"must be {key.rule.text}", source)
    return value


def read_all(
    md: Mapping[str, Any], keys: Mapping[str, Key], arch: str = "", source: str | None = None
) -> dict[str, Any]:
    """`read` of every key of a table: {field: value}."""
    return {field: read(md, key, arch, source) for field, key in keys.items()}
