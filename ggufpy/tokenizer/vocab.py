"""The vocabulary as llama.cpp loads it: token texts, scores, attributes, special ids and the end-of-generation set.

`build_vocab(metadata)` replays `llama_vocab::impl::load` (llama.cpp `src/llama-vocab.cpp`) in the same order:
defaults per tokenizer model, the `tokenizer.ggml.pre` flags, the metadata overrides, the detection of EOT/EOM/FIM
tokens by their text, the "unused" marking, the EOG set and its fix-ups, the special-token cache (longest text
first) and the token -> piece cache.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import GGUFMetadataError, GGUFUnsupportedError
from ..schema import TOKENIZER_KEYS, fail, read_all
from .hashorder import iteration_order
from .pretokenizers import PreTokenizer, resolve_pre

__all__ = ["TokenAttr", "TokenType", "Vocab", "build_vocab"]


class TokenType(enum.IntEnum):
    """`tokenizer.ggml.token_type` values (llama.h `enum llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(enum.IntFlag):
    """llama.cpp's per-token attribute bits (llama.h `enum llama_token_attr`)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# token type -> attribute (llama-vocab.cpp: the `switch(toktypes[i])` in load); other values are UNDEFINED
_TYPE_TO_ATTR = np.zeros(256, dtype=np.int32)
for _t, _a in [
    (TokenType.UNKNOWN, TokenAttr.UNKNOWN),
    (TokenType.UNUSED, TokenAttr.UNUSED),
    (TokenType.NORMAL, TokenAttr.NORMAL),
    (TokenType.CONTROL, TokenAttr.CONTROL),
    (TokenType.USER_DEFINED, TokenAttr.USER_DEFINED),
    (TokenType.BYTE, TokenAttr.BYTE),
]:
    _TYPE_TO_ATTR[_t] = _a

K = "tokenizer.ggml."

# special id field -> metadata key, in llama.cpp's order (later keys override earlier ones: the deprecated
# prefix/suffix/middle ids win over fim_pre/suf/mid, as in llama.cpp)
_SPECIAL_KEYS: list[tuple[str, str]] = [
    ("bos", K + "bos_token_id"),
    ("eos", K + "eos_token_id"),
    ("eot", K + "eot_token_id"),
    ("eom", K + "eom_token_id"),
    ("unk", K + "unknown_token_id"),
    ("sep", K + "seperator_token_id"),  # sic: GGUF's spelling
    ("pad", K + "padding_token_id"),
    ("mask", K + "mask_token_id"),
    ("fim_pre", K + "fim_pre_token_id"),
    ("fim_suf", K + "fim_suf_token_id"),
    ("fim_mid", K + "fim_mid_token_id"),
    ("fim_pad", K + "fim_pad_token_id"),
    ("fim_rep", K + "fim_rep_token_id"),
    ("fim_sep", K + "fim_sep_token_id"),
    ("fim_pre", K + "prefix_token_id"),
    ("fim_suf", K + "suffix_token_id"),
    ("fim_mid", K + "middle_token_id"),
]

# Special tokens llama.cpp finds by their text when the metadata does not name them (load: "auto-detect
# special tokens by text"). A found token is also made CONTROL.
_DETECT_BY_TEXT: dict[str, tuple[str, ...]] = {
    "eot": (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
        "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
    ),
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip

# Texts that end generation (load: "maintain a list of tokens that cause end-of-generation").
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})  # fmt: skip

# gpt-oss: always rendered, never end generation (load: "quick hack for gpt-oss")
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass(frozen=True)
class _ModelDefaults:
    """What a `tokenizer.ggml.model` value sets before the metadata is read (load: "determine vocab type")."""

    bpe: bool  # byte-pair merges from tokenizer.ggml.merges (else SentencePiece scores)
    special: dict[str, int]  # default special ids; the others are None
    pre: str | None = None  # the tokenizer.ggml.pre this model forces, whatever the file says


TOKENIZER_MODELS: dict[str, _ModelDefaults] = {
    "llama": _ModelDefaults(bpe=False, special={"bos": 1, "eos": 2, "unk": 0}),
    "gpt2": _ModelDefaults(bpe=True, special={"bos": 11, "eos": 11}),
    # Gemma 4's converter writes this name: SPM-style BPE, every default special id null
    "gemma4": _ModelDefaults(bpe=True, special={}, pre="gemma4"),
}


@dataclass(frozen=True, eq=False)
class Vocab:
    """A GGUF vocabulary with llama.cpp's derived settings. Ids are None where llama.cpp has LLAMA_TOKEN_NULL."""

    model: str  # tokenizer.ggml.model: "llama" (SPM), "gpt2" (BPE) or "gemma4" (SPM-style BPE)
    pre: PreTokenizer | None  # BPE only
    tokens: list[str]  # token texts (an empty text becomes "[EMPTY_<id>]", as in llama.cpp)
    scores: np.ndarray  # f32[n_vocab]
    token_types: np.ndarray  # i32[n_vocab], tokenizer.ggml.token_type (all NORMAL when the file has none)
    attrs: np.ndarray  # i32[n_vocab], TokenAttr bits after llama.cpp's fix-ups
    token_to_id: dict[str, int]  # the last id wins for a repeated text, as in llama.cpp
    merges: list[tuple[str, str]]  # BPE only, by rank
    special: dict[str, int | None]  # bos, eos, eot, eom, unk, sep, pad, mask, fim_*
    add_bos: bool
    add_eos: bool
    add_sep: bool
    add_space_prefix: bool
    clean_spaces: bool
    eog_ids: frozenset[int]
    special_tokens: tuple[int, ...]  # CONTROL / USER_DEFINED / UNKNOWN ids, longest text first
    pieces: list[bytes]  # token_to_piece(id, special=True) for every id

    @property
    def is_spm(self) -> bool:
        return self.model == "llama"

    def __len__(self) -> int:
        return len(self.tokens)


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after position 0 ("  x" is (" ", "x")); no space -> ("", "")
    pos = merge.find(" ", 1)
    if pos < 0:
        return "", ""
    return merge[:pos], merge[pos + 1 :]


def _per_token(v: dict[str, Any], field: str, n: int, source: str | None) -> np.ndarray | None:
    """A per-token array (scores, token types) cut to the vocabulary; it must have an entry for every token."""
    values = v[field]
    if values is not None and len(values) < n:
        key = TOKENIZER_KEYS[field].name
        raise fail(key, values, f"must have an entry for each of the {n} tokens of {K}tokens", source)
    return None if values is None else values[:n]


def build_vocab(metadata: Mapping[str, Any], n_vocab: int | None = None, source: str | None = None) -> Vocab:
    """Read the `tokenizer.ggml.*` metadata the way llama.cpp's `llama_vocab::impl::load` does.

    Every key is checked against `ggufpy.schema.TOKENIZER_KEYS` first (`GGUFMetadataError` naming `source`, the
    file). `n_vocab`, when given, is the number of `token_embd` rows: the vocabulary must have exactly that many
    tokens (llama.cpp checks the same through the tensor's shape), which also bounds the work done below.
    """
    v = read_all(metadata, TOKENIZER_KEYS, source=source)
    model = v["model"]
    defaults = TOKENIZER_MODELS.get(model)
    if defaults is None:
        raise GGUFUnsupportedError(
            f"{source + ': ' if source else ''}tokenizer.ggml.model = {model!r} is not supported: ggufpy reads "
            "'llama' (SentencePiece BPE), 'gpt2' (byte-level BPE) and 'gemma4' (SentencePiece-style BPE) vocabularies"
        )
    n = len(v["tokens"])
    if n_vocab is not None and n != n_vocab:
        raise fail(K + "tokens", v["tokens"], f"must have one token per row of token_embd ({n_vocab})", source)
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(v["tokens"])]

    # defaults per model (load: "determine vocab type")
    special: dict[str, int | None] = dict.fromkeys(
        ["bos", "eos", "eot", "eom", "unk", "sep", "pad", "mask", "fim_pre", "fim_suf", "fim_mid", "fim_pad",
         "fim_rep", "fim_sep"]
    )  # fmt: skip
    special.update(defaults.special)
    pre: PreTokenizer | None = None
    merges: list[tuple[str, str]] = []
    if not defaults.bpe:
        add_space_prefix, clean_spaces, add_bos, add_eos = True, False, True, False
    else:
        if v["merges"] is None:
            raise GGUFMetadataError(
                f"{source + ': ' if source else ''}metadata key tokenizer.ggml.merges is required but missing: "
                f"a {model!r} vocabulary needs its BPE merges"
            )
        merges = [_split_merge(m) for m in v["merges"]]
        pre = resolve_pre(defaults.pre or v["pre"])
        add_space_prefix, clean_spaces, add_bos, add_eos = False, pre.clean_spaces, pre.add_bos, False
        if pre.no_bos:
            special["bos"] = None
    add_space_prefix = _flag(v["add_space_prefix"], add_space_prefix)

    scores = _per_token(v, "scores", n, source)
    scores = np.zeros(n, np.float32) if scores is None else scores.astype(np.float32)
    types = _per_token(v, "token_type", n, source)
    if types is not None:
        token_types = types.astype(np.int32)
        attrs = _TYPE_TO_ATTR[np.clip(token_types, 0, 255)]
        attrs[(token_types < 0) | (token_types > 255)] = TokenAttr.UNDEFINED
    else:
        token_types = np.full(n, TokenType.NORMAL, dtype=np.int32)
        attrs = np.full(n, TokenAttr.NORMAL, dtype=np.int32)
    token_to_id = {t: i for i, t in enumerate(tokens)}

    # special ids: an out-of-range default is dropped, an out-of-range override is ignored
    for name, value in special.items():
        if value is not None and value >= n:
            special[name] = None
    ids = {k.name: v[field] for field, k in TOKENIZER_KEYS.items() if k.name.endswith("_token_id")}
    for name, key in _SPECIAL_KEYS:
        new_id = ids[key]
        if new_id is None:
            continue
        if new_id < n:
            special[name] = new_id
        else:  # as llama.cpp ("bad special token"): converted files do name e.g. a padding id == n_vocab
            warnings.warn(
                f"{key} = {new_id} is outside the vocabulary (n = {n}): keeping {special[name]}", stacklevel=2
            )
    add_bos = _flag(v["add_bos"], add_bos) or (pre is not None and pre.force_bos)
    add_eos = _flag(v["add_eos"], add_eos)
    add_sep = _flag(v["add_sep"], False)
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and special[name] is None:  # llama.cpp would abort on its GGML_ASSERT at the first tokenize
            key = TOKENIZER_KEYS[f"add_{name}"].name
            raise fail(key, True, f"needs a {name} token, and this vocabulary has none", source)

    # EOT / EOM / FIM by text: llama.cpp takes the first candidate its token_to_id map yields (`hashorder`)
    map_order: list[int] = []
    for name, texts in _DETECT_BY_TEXT.items():
        if special[name] is not None:
            continue
        found = [token_to_id[t] for t in texts if t in token_to_id]
        if len(found) > 1 and not map_order:
            map_order = iteration_order(tokens)  # only then: replaying the map takes 0.1-1 s
        if found:
            special[name] = min(found, key=map_order.index) if len(found) > 1 else found[0]
            attrs[special[name]] |= TokenAttr.CONTROL

    # control tokens named "...unused..." are unused
    is_control = (attrs & TokenAttr.CONTROL) != 0
    for i in np.flatnonzero(is_control):
        if "unused" in tokens[i]:
            attrs[i] |= TokenAttr.UNUSED

    eog = {special[k] for k in ("fim_pad", "fim_rep", "fim_sep") if special[k] is not None}
    for text in _EOG_TEXTS:
        i = token_to_id.get(text)
        if i is not None:
            eog.add(i)
            attrs[i] |= TokenAttr.CONTROL
    for text in _ALWAYS_USER_DEFINED:
        if text in token_to_id:
            attrs[token_to_id[text]] = TokenAttr.USER_DEFINED
    eog.update(special[k] for k in ("eos", "eot", "eom") if special[k] is not None)
    eog_texts = {tokens[i]: i for i in eog}
    # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
    has_call = bool({"<|call|>", "<|calls|>"} & eog_texts.keys())
    if "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
        end = eog_texts["<|end|>"]
        eog.discard(end)
        attrs[end] = TokenAttr.USER_DEFINED
    # gemma4 / plamo2: "</s>" is a normal token there
    if "</s>" in eog_texts and {"<|tool_response>", "<|plamo:eos|>"} & eog_texts.keys():
        s = eog_texts["</s>"]
        eog.discard(s)
        attrs[s] = TokenAttr.NORMAL

    # the special-token cache: matched in the text longest first (std::sort by length, ties by id here)
    is_special = (attrs & (TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)) != 0
    special_ids = sorted(np.flatnonzero(is_special).tolist(), key=lambda i: -len(tokens[i].encode()))

    pieces = _pieces(tokens, attrs, escaped=not defaults.bpe or (pre is not None and pre.spm_style))
    _per_model_attrs(v, token_to_id, attrs, special_ids)

    return Vocab(
        model=model,
        pre=pre,
        tokens=tokens,
        scores=scores,
        token_types=token_types,
        attrs=attrs,
        token_to_id=token_to_id,
        merges=merges,
        special=special,
        add_bos=add_bos,
        add_eos=add_eos,
        add_sep=add_sep,
        add_space_prefix=add_space_prefix,
        clean_spaces=clean_spaces,
        eog_ids=frozenset(eog),
        special_tokens=tuple(special_ids),
        pieces=pieces,
    )


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, reversed (unicode.cpp `unicode_byte_to_utf8_map`)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


BYTE_DECODER = _byte_decoder()


def _gpt2_piece(text: str) -> bytes:
    # llama-vocab.cpp `llama_decode_text`; a character outside the byte table is spelled out as llama.cpp does
    try:
        return bytes(BYTE_DECODER[c] for c in text)
    except KeyError:
        out = bytearray()
        for c in text:
            b = BYTE_DECODER.get(c)
            if b is not None:
                out.append(b)
            else:
                out += b"[UNK_BYTE_0x" + c.encode().hex().encode() + text.encode() + b"]"
        return bytes(out)


def _pieces(tokens: Sequence[str], attrs: np.ndarray, escaped: bool) -> list[bytes]:
    """token_to_piece(id, special=True) for every token (llama-vocab.cpp `token_to_piece`, SPM and BPE cases).

    `escaped`: normal tokens spell spaces as "▁" (SPM, and BPE with `escape_whitespaces`), else GPT-2 bytes.
    """
    # plain ints: IntFlag arithmetic costs a microsecond per operation, this loop runs 262k times for Gemma
    verbatim = int(TokenAttr.UNKNOWN | TokenAttr.CONTROL | TokenAttr.USER_DEFINED)
    normal, byte = int(TokenAttr.NORMAL), int(TokenAttr.BYTE)
    pieces: list[bytes] = []
    for text, attr in zip(tokens, attrs.tolist(), strict=True):
        if attr & verbatim:
            pieces.append(text.encode())
        elif attr & normal:
            pieces.append(text.replace("▁", " ").encode() if escaped else _gpt2_piece(text))
        elif attr & byte:
            pieces.append(bytes([_strtol16(text[3:5])]))
        else:
            pieces.append(b"")  # UNUSED / UNDEFINED tokens render as nothing
    return pieces


def _strtol16(digits: str) -> int:
    # strtol(text.substr(3, 2), NULL, 16) in llama-vocab.cpp `token_to_byte`: leading hex digits, else 0
    value = 0
    for c in digits:
        if c not in "0123456789abcdefABCDEF":
            break
        value = value * 16 + int(c, 16)
    return value


def _flag(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def _per_model_attrs(
    v: Mapping[str, Any], token_to_id: Mapping[str, int], attrs: np.ndarray, special_ids: Sequence[int]
) -> None:
    """LSTRIP / RSTRIP set by model name (load: "set attributes by model/tokenizer/architecture name")."""
    name = v["name"].lower()
    pre = v["pre"] or ""
    arch = v["architecture"]
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
    ):
        if "<mask>" in token_to_id:
            attrs[token_to_id["<mask>"]] |= TokenAttr.LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for i in special_ids:
            attrs[i] |= TokenAttr.RSTRIP
        for text, on in [("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)]:
            if text in token_to_id:
                i = token_to_id[text]
                attrs[i] = attrs[i] | TokenAttr.RSTRIP if on else attrs[i] & ~TokenAttr.RSTRIP
    elif "modern-bert" in name and "[MASK]" in token_to_id:
        attrs[token_to_id["[MASK]"]] |= TokenAttr.LSTRIP
