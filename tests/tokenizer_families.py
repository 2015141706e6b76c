"""Vocabularies of the newer model families (issue 13), derived deterministically from the two real models.

Shared by tests/test_tokenizer_variants_new.py and scripts/record_tokenizer_families.py, like the 58 variants
of tests/data/tokenizer/variants.json: a variant is a base model's tokenizer metadata with some keys dropped
and some replaced. Here a replacement can also be derived from the base vocabulary:

- "gemma4": Gemma 3's SentencePiece vocabulary as Gemma 4 ships it, BPE merges over raw UTF-8 ("▁" for spaces).
  The merges are every way to cut a token into two tokens, best merged-token score first (how an SPM vocabulary
  becomes BPE), without the merges that build runs of 3+ newlines; the newline runs (user-defined in Gemma 3,
  so cut out before any merging) become normal tokens. Runs of 3 to 31 newlines are then tokens that only the
  whole-newline-run rule of gemma4 reaches (llama.cpp PR 21343), and longer runs merge into "\n\n" pairs.
- "harmony": SmolLM2's vocabulary with gpt-oss's o200k_harmony special tokens appended, BOS / EOS as gpt-oss
  names them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ggufpy.tokenizer import TokenType, build_vocab
from ggufpy.tokenizer.spm import spm_merges

T = "tokenizer.ggml."

# o200k_harmony's special tokens as gpt-oss's tokenizer.json has them (<|endoftext|> is already SmolLM2's id 0)
HARMONY_SPECIALS = (
    "<|startoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>", "<|constrain|>",
    "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|reserved_200009|>",
    "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>", "<|reserved_200013|>", "<|endofprompt|>",
)  # fmt: skip

# Strings added to the shared corpus for these variants: harmony and Gemma 4 turns, long newline runs.
EXTRA_CORPUS = [
    "<|start|>system<|message|>You are ChatGPT.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant",
    "<|start|>assistant<|channel|>analysis<|message|>Think.<|end|>",
    "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{}<|call|>",
    "<|startoftext|><|endofprompt|><|reserved_200000|>",
    " <|end|> \n<|return|>\n",
    "<|turn>user\nHello<turn|>\n<|turn>model\n",
    "<|channel>thought\n<channel|>",
    "a\n\n\nb",
    "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
    "x" + "\n" * 31 + "y" + "\n" * 32 + "z",
    " \n \n  \n\n  ",
    "▁▁▁ ▁ ▁\n▁",
    "\n\n\r\n\n\n",
]


def _newline_run(text: str) -> bool:
    return bool(text) and not text.strip("\n")


def gemma4_merges(metadata: Mapping[str, Any]) -> list[str]:
    """BPE merges for an SPM vocabulary (see the module docstring), as tokenizer.ggml.merges strings."""
    vocab = build_vocab(metadata)
    return [
        f"{a} {b}"
        for a, b in spm_merges(vocab)
        if " " not in a and " " not in b and not (_newline_run(a + b) and len(a + b) > 2)
    ]


def harmony_tokens(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The vocabulary with HARMONY_SPECIALS appended as control tokens, BOS / EOS / PAD as gpt-oss sets them."""
    tokens = list(metadata[T + "tokens"])
    start = len(tokens)
    types = np.concatenate([np.asarray(metadata[T + "token_type"], np.int32), np.full(16, TokenType.CONTROL, np.int32)])
    ids = {t: start + k for k, t in enumerate(HARMONY_SPECIALS)}
    return {
        T + "tokens": tokens + list(HARMONY_SPECIALS),
        T + "token_type": types,
        T + "bos_token_id": ids["<|startoftext|>"],
        T + "eos_token_id": ids["<|return|>"],
        T + "padding_token_id": 0,
    }


def gemma4_vocab(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The merges of `gemma4_merges`, and newline runs made normal tokens."""
    types = np.array(metadata[T + "token_type"], np.int32)
    types[[i for i, t in enumerate(metadata[T + "tokens"]) if _newline_run(t)]] = TokenType.NORMAL
    return {T + "merges": gemma4_merges(metadata), T + "token_type": types}


DERIVATIONS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "gemma4": gemma4_vocab,
    "harmony": harmony_tokens,
}

# label -> base model, the derivation, keys dropped, plain overrides (JSON values, recorded as they are)
FAMILY_VARIANTS: dict[str, dict[str, Any]] = {
    # Gemma 4 files: tokenizer.ggml.model "gemma4" forces the gemma4 pre-tokenizer and add_bos
    "gemma3/model=gemma4": {
        "base": "gemma3",
        "derive": "gemma4",
        "drop": [T + "pre"],
        "overrides": {T + "model": "gemma4"},
    },
    "gemma3/model=gemma4-add_bos=false": {
        "base": "gemma3",
        "derive": "gemma4",
        "drop": [T + "pre"],
        "overrides": {T + "model": "gemma4", T + "add_bos_token": False},
    },
    # the same pre-tokenizer named by a "gpt2" vocabulary (granite-embed-multi-311m shares gemma4's type)
    "gemma3/pre=granite-embed-multi-311m": {
        "base": "gemma3",
        "derive": "gemma4",
        "drop": [T + "add_bos_token"],
        "overrides": {T + "model": "gpt2", T + "pre": "granite-embed-multi-311m"},
    },
    # sarvam-moe: SPM-style BPE without the newline-run rule, no clean-up of spaces when detokenizing
    "gemma3/pre=sarvam-moe": {
        "base": "gemma3",
        "derive": "gemma4",
        "drop": [],
        "overrides": {T + "model": "gpt2", T + "pre": "sarvam-moe"},
    },
    # Llama 4 names the gpt-4o regex "llama4"; gpt-oss files name it "gpt-4o" beside o200k_harmony's tokens
    "smollm2/pre=llama4": {
        "base": "smollm2",
        "derive": None,
        "drop": [T + "add_bos_token"],
        "overrides": {T + "pre": "llama4"},
    },
    "smollm2/gpt-oss": {
        "base": "smollm2",
        "derive": "harmony",
        "drop": [],
        "overrides": {T + "pre": "gpt-4o"},
    },
    # Qwen3.5 with its own vocabulary's habits: add_bos off, qwen35 regex (the pre=qwen35 variant drops add_bos)
    "smollm2/pre=qwen35+add_eos": {
        "base": "smollm2",
        "derive": None,
        "drop": [],
        "overrides": {T + "pre": "qwen35", T + "add_eos_token": True},
    },
}


def variant_metadata(
    base: Mapping[str, Any], setting: Mapping[str, Any], derived: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The variant's tokenizer metadata: `base` without the dropped keys, then the derived and plain overrides.

    `derived`: the derivation's result when the caller has it already (Gemma's merges take seconds)."""
    if derived is None:
        derive = setting["derive"]
        derived = DERIVATIONS[derive](base) if derive else {}
    kept = {k: v for k, v in base.items() if k not in setting["drop"]}
    return kept | dict(derived) | setting["overrides"]


def write_tokenizer_gguf(path, metadata: Mapping[str, Any]) -> None:
    """A vocabulary-only GGUF file: the `tokenizer.ggml.*` keys of `metadata` typed as llama.cpp reads them (string /
    f32 / i32 arrays, u32 ids, bools, strings), with its `general.architecture` and `general.name`."""
    import gguf

    vt = gguf.GGUFValueType
    arrays = {T + "tokens": vt.STRING, T + "merges": vt.STRING, T + "scores": vt.FLOAT32, T + "token_type": vt.INT32}
    writer = gguf.GGUFWriter(str(path), arch=metadata.get("general.architecture", "llama"))
    if "general.name" in metadata:
        writer.add_name(metadata["general.name"])
    for name, value in metadata.items():
        if not name.startswith(T):
            continue
        if name in arrays:
            writer.add_key_value(name, np.asarray(value).tolist(), vt.ARRAY, sub_type=arrays[name])
        elif isinstance(value, str):
            writer.add_key_value(name, value, vt.STRING)
        elif isinstance(value, (bool, np.bool_)):
            writer.add_key_value(name, bool(value), vt.BOOL)
        else:
            writer.add_key_value(name, int(value), vt.UINT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
