"""Tokenizers of the newer families (issue 13): gemma4's SPM-style BPE, sarvam-moe, granite-embed-multi-311m,
llama4, gpt-oss (gpt-4o + o200k_harmony tokens) and qwen35, against llama.cpp.

- synthetic SPM-style BPE vocabularies for each rule (escaped spaces, raw UTF-8 merges, <0xXX> fallback, whole
  newline runs, the forced BOS, pieces), checked by hand and live against llama-cpp-python;
- the family variants of tests/tokenizer_families.py against tests/data/tokenizer/families.json (recorded by
  scripts/record_tokenizer_families.py): every string of the shared corpus, plus EXTRA_CORPUS;
- a live mode (slow) that writes each variant as a vocabulary-only GGUF file and asks llama.cpp directly.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from ggufpy.errors import GGUFMetadataError
from ggufpy.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenType, build_vocab
from ggufpy.tokenizer.hashorder import iteration_order, std_hash
from ggufpy.tokenizer.pretokenizers import UNSUPPORTED_PRE, resolve_pre
from tests.models import MODELS
from tests.test_tokenizer import CORPUS, DATA, GROUP, _digest, _random_texts, _text_or_hex, gpt2_metadata
from tests.tokenizer_families import (
    DERIVATIONS,
    EXTRA_CORPUS,
    FAMILY_VARIANTS,
    HARMONY_SPECIALS,
    T,
    variant_metadata,
    write_tokenizer_gguf,
)

# -- synthetic SPM-style BPE vocabularies ------------------------------------------------------------------------

PIECES = ["▁", "a", "b", "▁a", "ab", "▁ab", "é", "\n", "\n\n", "\n\n\n", "x"]
MERGES = ["▁ a", "a b", "▁a b", "\n \n"]  # nothing merges into "\n\n\n": only the whole-run rule reaches it


def gemma4_metadata(model: str = "gemma4", pre: str | None = None, **extra) -> dict:
    """<pad> <eos> <bos> <unk>, the 256 <0xXX> byte tokens, then PIECES; Gemma's special ids."""
    entries = [("<pad>", TokenType.CONTROL), ("<eos>", TokenType.CONTROL), ("<bos>", TokenType.CONTROL)]
    entries += [("<unk>", TokenType.UNKNOWN)] + [(f"<0x{b:02X}>", TokenType.BYTE) for b in range(256)]
    entries += [(p, TokenType.NORMAL) for p in PIECES]
    md = {
        T + "model": model,
        T + "tokens": [t for t, _ in entries],
        T + "scores": np.zeros(len(entries), np.float32),
        T + "token_type": np.asarray([int(ty) for _, ty in entries], np.int32),
        T + "merges": MERGES,
        T + "bos_token_id": 2,
        T + "eos_token_id": 1,
        T + "unknown_token_id": 3,
        T + "padding_token_id": 0,
    }
    if pre is not None:
        md[T + "pre"] = pre
    return md | extra


def texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.piece(i) for i in ids]


def test_gemma4_escapes_spaces_and_merges_raw_utf8_by_rank():
    tok = Tokenizer.from_metadata(gemma4_metadata())
    assert texts(tok, tok.encode("ab a", add_special=False)) == ["ab", "▁a"]
    assert texts(tok, tok.encode(" ab", add_special=False)) == ["▁ab"]  # ("▁", "a") first, then ("▁a", "b")
    assert texts(tok, tok.encode("é", add_special=False)) == ["é"]  # a 2-byte character is one symbol
    # a character that is no token is spelled as its UTF-8 bytes
    assert texts(tok, tok.encode("a€", add_special=False)) == ["a", "<0xE2>", "<0x82>", "<0xAC>"]
    assert tok.vocab.model == "gemma4" and tok.vocab.pre is PRE_TOKENIZERS["gemma4"]


def test_gemma4_takes_a_newline_run_whole_when_it_is_a_token():
    tok = Tokenizer.from_metadata(gemma4_metadata())
    assert texts(tok, tok.encode("a\n\n\nb", add_special=False)) == ["a", "\n\n\n", "b"]
    # a run that is no token goes through the merges: ("\n", "\n") pairs
    assert texts(tok, tok.encode("\n" * 5, add_special=False)) == ["\n\n", "\n\n", "\n"]
    # without the rule the same engine would spell the run out: the rule is what makes "\n\n\n" one token
    assert texts(tok, tok.engine.encode("\n\n\n").ids) == ["\n\n", "\n"]
    sarvam = Tokenizer.from_metadata(gemma4_metadata("gpt2", "sarvam-moe"))
    assert texts(sarvam, sarvam.encode("a\n\n\nb", add_special=False)) == ["a", "\n\n", "\n", "b"]


def test_gemma4_adds_bos_even_when_the_file_says_not_to():
    off = {T + "add_bos_token": False}
    assert Tokenizer.from_metadata(gemma4_metadata(**off)).encode("a") == [2, 260 + PIECES.index("a")]
    assert Tokenizer.from_metadata(gemma4_metadata("gpt2", "granite-embed-multi-311m", **off)).add_bos
    assert not Tokenizer.from_metadata(gemma4_metadata("gpt2", "sarvam-moe", **off)).add_bos
    # the "gemma4" model has no default special ids: without a BOS id the forced BOS cannot be added
    no_bos = {k: v for k, v in gemma4_metadata().items() if k != T + "bos_token_id"}
    with pytest.raises(GGUFMetadataError, match="needs a bos token"):
        Tokenizer.from_metadata(no_bos)


def test_gemma4_model_forces_its_pre_tokenizer_and_needs_merges():
    tok = Tokenizer.from_metadata(gemma4_metadata(pre="qwen2"))  # the file's tokenizer.ggml.pre is not read
    assert tok.vocab.pre is PRE_TOKENIZERS["gemma4"]
    no_merges = {k: v for k, v in gemma4_metadata().items() if k != T + "merges"}
    with pytest.raises(GGUFMetadataError, match="'gemma4' vocabulary needs its BPE merges"):
        Tokenizer.from_metadata(no_merges)


def test_spm_style_pieces_render_spaces_and_bytes():
    tok = Tokenizer.from_metadata(gemma4_metadata())
    t2i = tok.vocab.token_to_id
    assert tok.token_to_piece(t2i["▁ab"]) == b" ab" and tok.token_to_piece(t2i["<0xE2>"]) == b"\xe2"
    ids = tok.encode("ab a€ a", add_special=True)
    assert tok.decode(ids) == "<bos>ab a€ a" and tok.decode(ids, skip_special=True) == "ab a€ a"
    assert tok.vocab.clean_spaces  # gemma4 keeps the BPE default; sarvam-moe turns it off
    assert not Tokenizer.from_metadata(gemma4_metadata("gpt2", "sarvam-moe")).vocab.clean_spaces


def test_gemma4_names_are_supported_and_the_others_still_refused():
    for name in ("gemma4", "granite-embed-multi-311m", "sarvam-moe"):
        assert name not in UNSUPPORTED_PRE and resolve_pre(name) is PRE_TOKENIZERS[name]
    assert resolve_pre("llama4") is PRE_TOKENIZERS["gpt-4o"]
    with pytest.warns(UserWarning, match="hand-written splitter"):
        resolve_pre("kimi-k2")
    with pytest.raises(ValueError, match="'gemma4' \\(SentencePiece-style BPE\\)"):
        Tokenizer.from_metadata(gemma4_metadata("t5"))


@pytest.mark.parametrize("pre", sorted(p for p, spec in PRE_TOKENIZERS.items() if spec.spm_style))
def test_spm_style_pre_tokenizers_round_trip_through_byte_tokens(pre):
    """On GPT-2's byte characters (as test_tokenizer's round trip) plus "▁" and the <0xXX> tokens SPM-style BPE
    falls back to: without those, llama.cpp drops every space and every character that is not a token."""
    specials = [("▁", TokenType.NORMAL)] + [(f"<0x{b:02X}>", TokenType.BYTE) for b in range(256)]
    tok = Tokenizer.from_metadata(gpt2_metadata(pre, specials=specials))
    text = "Mixed 'text' with 12345 digits, CAPS and café 中文 😀\n\n  end"
    ids = tok.encode(text, add_special=False)
    assert bytes(b for i in ids for b in tok.token_to_piece(i)) == text.encode()
    # without them llama.cpp keeps an unknown character as a symbol that no merge crosses, then drops it
    bare = Tokenizer.from_metadata(gpt2_metadata(pre, [("a", "b")]))
    t2i = bare.vocab.token_to_id
    assert bare.encode("a b中ab", add_special=False) == [t2i["a"], t2i["b"], t2i["ab"]]
    # ... and writes the byte tokens it has: 中 is E4 B8 AD
    some = Tokenizer.from_metadata(gpt2_metadata(pre, [("a", "b")], specials=[("<0xE4>", TokenType.BYTE)]))
    t2i = some.vocab.token_to_id
    assert some.encode("a中b", add_special=False) == [t2i["a"], t2i["<0xE4>"], t2i["b"]]


SYNTHETIC_TEXTS = [
    "ab a", " ab", "a€ é x", "a\n\n\nb", "\n" * 5, "\n\n\n", "\n", "", " ", "  a  ", "▁a", "<bos>a<eos>", "a\r\nb",
    "ab\n\n\n\nab", "😀", "a\tb", "a b中ab", "a中b", "aba ba 中ab",
]  # fmt: skip


@pytest.mark.conformance
@pytest.mark.parametrize(
    ("model", "pre"),
    [("gemma4", None), ("gpt2", "gemma4"), ("gpt2", "granite-embed-multi-311m"), ("gpt2", "sarvam-moe")],
)
def test_synthetic_spm_style_bpe_matches_live_llama_cpp(tmp_path, model, pre):
    _check_live(tmp_path, gemma4_metadata(model, pre, **{T + "add_bos_token": False}))


@pytest.mark.conformance
@pytest.mark.parametrize("pre", ["gemma4", "sarvam-moe"])
def test_spm_style_bpe_with_missing_byte_tokens_matches_live_llama_cpp(tmp_path, pre):
    specials = [("▁", TokenType.NORMAL), ("<0xE4>", TokenType.BYTE), ("<0xAD>", TokenType.BYTE)]
    merges = [("a", "b"), ("ab", "a"), ("b", "a")]
    _check_live(tmp_path, gpt2_metadata(pre, merges, specials, **{T + "bos_token_id": 0}))


def _check_live(tmp_path, md: dict) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    write_tokenizer_gguf(tmp_path / "v.gguf", md)
    tok = Tokenizer.from_metadata(md)
    llm = llama_cpp.Llama(str(tmp_path / "v.gguf"), vocab_only=True, verbose=False)
    try:
        for text in SYNTHETIC_TEXTS + _random_texts(seed=4, n=100):
            for add, parse in ((False, False), (True, True)):
                want = llm.tokenize(text.encode(), add_bos=add, special=parse)
                assert tok.encode(text, add, parse) == want, text
        assert tok.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(llm._model.vocab))
    finally:
        llm.close()


# -- llama.cpp's token_to_id map order (special tokens found by their text) --------------------------------------


def test_std_hash_is_libstdcxx_hash_bytes():
    """Values printed by `std::hash<std::string>` built with g++ (64-bit libstdc++): empty, tail only, one block,
    block + tail, and multi-byte text."""
    texts = [b"", b"a", b"abcdefg", b"abcdefgh", b"abcdefghi", b"<|endoftext|>", "▁hello world, 17+ bytes".encode()]
    assert std_hash(texts).tolist() == [
        6142509188972423790, 4993892634952068459, 16063891478991045295, 8664279048047335611, 13036955925923793583,
        3113324847494305268, 1326651532513320005,
    ]  # fmt: skip


def test_iteration_order_is_libstdcxx_unordered_map_order():
    """The order a g++-built `std::unordered_map<std::string, int>` filled like llama.cpp's token_to_id iterates
    in (3 rehashes: 13, 29, 59 buckets); "a" is there once, with its last id."""
    texts = ["a", "b", "a", "c", "dd"] + [f"t{i}" for i in range(20)]
    want = [24, 23, 22, 19, 17, 2, 5, 21, 18, 15, 12, 3, 4, 16, 13, 6, 20, 7, 14, 1, 8, 9, 11, 10]
    assert iteration_order(texts) == want
    big = [f"token{i}" for i in range(3000)]
    assert sorted(iteration_order(big)) == list(range(3000))


def test_eot_is_the_candidate_llama_cpp_meets_first_not_the_lowest_id():
    """<|im_end|> has the lowest id, but llama.cpp's map yields <|endoftext|> first (checked live below)."""
    specials = [(t, TokenType.CONTROL) for t in ("<|im_end|>", "<|endoftext|>", "<|end|>")]
    tok = Tokenizer.from_metadata(gpt2_metadata("gpt-4o", specials=specials))
    assert tok.eot_id == 1 and tok.vocab.special["eot"] == tok.vocab.token_to_id["<|endoftext|>"]


@pytest.mark.conformance
def test_eot_pick_matches_live_llama_cpp(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    for texts in (("<|im_end|>", "<|endoftext|>", "<|end|>"), ("<|endoftext|>", "<|im_end|>"), ("<|end|>", "<EOT>")):
        md = gpt2_metadata("gpt-4o", [("a", "b")], specials=[(t, TokenType.CONTROL) for t in texts])
        write_tokenizer_gguf(tmp_path / "v.gguf", md)
        llm = llama_cpp.Llama(str(tmp_path / "v.gguf"), vocab_only=True, verbose=False)
        try:
            assert Tokenizer.from_metadata(md).eot_id == llama_cpp.llama_vocab_eot(llm._model.vocab), texts
        finally:
            llm.close()


# -- the family variants, recorded --------------------------------------------------------------------------------

TEXTS = CORPUS + EXTRA_CORPUS


@functools.cache
def _families() -> dict:
    return json.loads((DATA / "families.json").read_text(encoding="utf-8"))


# Gemma's variants build a 262k-token vocabulary with 514k merges twice (derivation, HF engine): 20-60 s
LABELS = [pytest.param(k, marks=pytest.mark.slow) if s["base"] == "gemma3" else k for k, s in FAMILY_VARIANTS.items()]


@functools.cache
def _base_metadata(base: str) -> dict:
    """The real model's metadata (without building its tokenizer, as tests.test_tokenizer's `_model` does)."""
    import ggufpy

    with ggufpy.open(MODELS[base]()) as f:
        return dict(f.metadata)


@functools.cache
def _derived(base: str, derive: str | None) -> dict:
    return DERIVATIONS[derive](_base_metadata(base)) if derive else {}


def _metadata(label: str) -> dict:
    setting = FAMILY_VARIANTS[label]
    return variant_metadata(_base_metadata(setting["base"]), setting, _derived(setting["base"], setting["derive"]))


_ENGINES: dict[tuple, object] = {}


@functools.cache
def _tokenizer(label: str) -> Tokenizer:
    """The variant's tokenizer. Variants whose engines would be equal (same base, derivation and split rules) share
    the first one built: Gemma's 514k merges take seconds to load into HF `tokenizers`."""
    setting = FAMILY_VARIANTS[label]
    metadata = _metadata(label)
    vocab = build_vocab(metadata)
    key = (setting["base"], setting["derive"], vocab.pre.regexes, vocab.pre.ignore_merges, vocab.pre.spm_style)
    if key not in _ENGINES:
        _ENGINES[key] = Tokenizer.from_metadata(metadata).engine
    return Tokenizer(vocab, _ENGINES[key])


def test_families_were_recorded_from_this_corpus_and_these_settings():
    head = _families()
    assert head["corpus_sha256"] == _digest(CORPUS) and head["extra_corpus_sha256"] == _digest(EXTRA_CORPUS)
    assert list(head["variants"]) == list(FAMILY_VARIANTS)
    for label, setting in FAMILY_VARIANTS.items():
        recorded = head["variants"][label]
        assert {k: recorded[k] for k in setting} == setting, f"re-record families.json: {label} changed"
        assert len(recorded["ids_plain"]) == -(-len(TEXTS) // GROUP)
    assert {"gemma4", "granite-embed-multi-311m", "sarvam-moe", "llama4", "gpt-4o", "qwen35"} <= {
        s["overrides"].get(T + "pre", s["overrides"].get(T + "model")) for s in FAMILY_VARIANTS.values()
    }


@pytest.mark.conformance
@pytest.mark.parametrize("label", LABELS)
def test_family_variant_matches_llama_cpp(label):
    recorded = _families()["variants"][label]
    tok = _tokenizer(label)
    assert tok.add_bos == recorded["add_bos"]
    plain = [tok.encode(t, add_special=False, parse_special=False) for t in TEXTS]
    full = [tok.encode(t, add_special=True, parse_special=True) for t in TEXTS]
    detok = [_text_or_hex(tok.detokenize(ids, unparse_special=True)) for ids in full]
    for key, got in (("ids_plain", plain), ("ids_special", full), ("detok", detok)):
        for g, want in enumerate(recorded[key]):
            chunk = got[g * GROUP : (g + 1) * GROUP]
            assert _digest(chunk) == want, f"{label} {key}: a string of {TEXTS[g * GROUP : (g + 1) * GROUP]}"


@pytest.mark.conformance
@pytest.mark.parametrize("label", LABELS)
def test_family_vocabulary_facts_match_llama_cpp(label):
    import hashlib

    facts = _families()["variants"][label]["facts"]
    tok = _tokenizer(label)
    assert tok.vocab_size == facts["n_tokens"]
    for key, want in facts["special"].items():
        if key != "nl":
            assert tok.vocab.special[key] == want, key
    assert sorted(tok.eog_ids) == facts["eog"]
    assert (tok.add_bos, tok.add_eos) == (facts["add_bos"], facts["add_eos"])
    assert hashlib.sha256(json.dumps(tok.vocab.attrs.tolist()).encode()).hexdigest() == facts["attrs_sha256"]
    for special, key in ((True, "special"), (False, "plain")):
        pieces = b"\0".join(tok.token_to_piece(i, special) for i in range(tok.vocab_size))
        assert hashlib.sha256(pieces).hexdigest() == facts["pieces_sha256"][key], key


def test_gpt_oss_variant_has_harmony_rules():
    tok = _tokenizer("smollm2/gpt-oss")
    t2i = tok.vocab.token_to_id
    assert tok.eos_id == t2i["<|return|>"] and tok.bos_id == t2i["<|startoftext|>"]
    assert {t2i["<|return|>"], t2i["<|call|>"]} <= tok.eog_ids and t2i["<|end|>"] not in tok.eog_ids
    # user-defined, so cut out even without parse_special: <|start|> <|channel|> <|message|>, and <|end|>
    # (a message end here, not a generation end); <|return|> stays a control token
    ids = tok.encode("<|start|>assistant<|channel|>final<|message|>Hi<|end|><|return|>", add_special=False)
    harmony = [tok.piece(i) for i in ids if i >= len(tok) - len(HARMONY_SPECIALS)]
    assert harmony == ["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]


# -- live mode ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.conformance
@pytest.mark.parametrize("label", list(FAMILY_VARIANTS))
def test_family_variant_matches_live_llama_cpp(tmp_path, label):
    llama_cpp = pytest.importorskip("llama_cpp")
    write_tokenizer_gguf(tmp_path / "v.gguf", _metadata(label))
    tok = _tokenizer(label)
    llm = llama_cpp.Llama(str(tmp_path / "v.gguf"), vocab_only=True, verbose=False)
    try:
        for text in EXTRA_CORPUS + _random_texts(seed=13, n=200):
            for add, parse in ((False, False), (True, True), (True, False)):
                assert tok.encode(text, add, parse) == llm.tokenize(text.encode(), add_bos=add, special=parse), text
    finally:
        llm.close()
