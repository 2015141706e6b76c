"""The GGUF tokenizer: llama.cpp goldens on the two real models, variants of their vocabularies, and small
synthetic vocabularies for each rule (pre-tokenizer choice, byte fallback, special tokens, EOG set, decoding).

Goldens come from scripts/record_tokenizer_goldens.py (llama-cpp-python as the oracle).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, pre_tokenizers

from ggufpy.tokenizer import PRE_TOKENIZERS, TokenAttr, Tokenizer, TokenType, build_vocab, load_tokenizer
from ggufpy.tokenizer.pretokenizers import onig_pattern, resolve_pre
from ggufpy.tokenizer.tokenizer import _clean_spaces
from ggufpy.tokenizer.vocab import BYTE_DECODER
from tests.models import MODELS

DATA = Path(__file__).parent / "data" / "tokenizer"
COMBOS = [(False, False), (False, True), (True, False), (True, True)]  # (add_special, parse_special)
GROUP = 25  # as in the recorder


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()[:12]


def _text_or_hex(b: bytes):
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": b.hex()}


def _bytes(recorded) -> bytes:
    return bytes.fromhex(recorded["hex"]) if isinstance(recorded, dict) else recorded.encode()


@functools.cache
def _load(name: str):
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


CORPUS: list[str] = _load("corpus")
VARIANTS: dict = _load("variants")["variants"]


def _ids(case: dict) -> list[list[int]]:
    ids = case["ids"]
    return [ids[x] if isinstance(x, int) else x for x in ids]


# -- the real models -------------------------------------------------------------------------------------------


@functools.cache
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    """(name, Tokenizer, golden, metadata) for each real model; the tokenizer is built once per module."""
    name = request.param
    return _model(name)


@functools.cache
def _model_cached(name: str):
    import ggufpy

    path = Path(MODELS[name]())
    golden = _load(name)
    if _sha256(path) != golden["sha256"]:
        pytest.skip(f"{path} is not the file the goldens were recorded from (sha256 {golden['sha256']})")
    with ggufpy.open(path) as f:
        metadata = dict(f.metadata)
    return name, Tokenizer.from_metadata(metadata), golden, metadata


def _model(name: str):
    MODELS[name]()  # skips the test when the model package is missing
    return _model_cached(name)


def test_corpus_is_what_the_goldens_were_recorded_from():
    assert len(CORPUS) >= 300
    for name in MODELS:
        golden = _load(name)
        assert golden["corpus_sha256"] == _digest(CORPUS), f"re-record {name}.json"
        assert len(golden["cases"]) == len(CORPUS)
    for must in ("", " ", "\n", "<|im_start|>", "<end_of_turn>", "👨‍👩‍👧‍👦", "你好，世界！", "12345678901234567890"):
        assert must in CORPUS


@pytest.mark.conformance
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"add_special={c[0]}-parse_special={c[1]}")
def test_encode_matches_llama_cpp(model, combo):
    name, tok, golden, _ = model
    k = COMBOS.index(combo)
    bad = [
        (text, got, want)
        for text, case in zip(CORPUS, golden["cases"], strict=True)
        if (got := tok.encode(text, *combo)) != (want := _ids(case)[k])
    ]
    assert not bad, f"{name}: {len(bad)}/{len(CORPUS)} differ, first: " + "; ".join(
        f"{t!r}: got {g} want {w}" for t, g, w in bad[:5]
    )


@pytest.mark.conformance
def test_detokenize_matches_llama_cpp(model):
    name, tok, golden, _ = model
    bad = []
    for text, case in zip(CORPUS, golden["cases"], strict=True):
        ids = _ids(case)[3]
        if tok.detokenize(ids, remove_special=False, unparse_special=True) != _bytes(case["detok"]):
            bad.append((text, "rendered"))
        if tok.detokenize(ids, remove_special=True, unparse_special=False) != _bytes(case["detok_skip"]):
            bad.append((text, "skipped"))
    assert not bad, f"{name}: {len(bad)} differ, first: {bad[:5]}"


@pytest.mark.conformance
def test_decode_of_encode_is_llama_cpp_detokenize(model):
    _, tok, golden, _ = model
    for text, case in zip(CORPUS, golden["cases"], strict=True):
        ids = tok.encode(text, add_special=True, parse_special=True)
        assert tok.decode(ids) == _bytes(case["detok"]).decode("utf-8", errors="replace"), text
        assert tok.decode(ids, skip_special=True) == _bytes(case["detok_skip"]).decode("utf-8", errors="replace")


@pytest.mark.conformance
def test_vocabulary_facts_match_llama_cpp(model):
    _, tok, golden, _ = model
    facts = golden["vocab"]
    assert tok.vocab_size == facts["n_tokens"]
    for key, want in facts["special"].items():
        if key != "nl":  # llama.cpp's newline id is not part of the public API here
            assert tok.vocab.special[key] == want, key
    assert (tok.bos_id, tok.eos_id, tok.eot_id, tok.pad_id) == tuple(
        facts["special"][k] for k in ("bos", "eos", "eot", "pad")
    )
    assert sorted(tok.eog_ids) == facts["eog"]
    assert (tok.add_bos, tok.add_eos) == (facts["add_bos"], facts["add_eos"])
    assert hashlib.sha256(json.dumps(tok.vocab.attrs.tolist()).encode()).hexdigest() == facts["attrs_sha256"]
    for special, key in ((True, "special"), (False, "plain")):
        pieces = b"\0".join(tok.token_to_piece(i, special) for i in range(tok.vocab_size))
        assert hashlib.sha256(pieces).hexdigest() == facts["pieces_sha256"][key], key


def test_real_model_properties(model):
    name, tok, _, metadata = model
    assert tok.token_types.shape == (tok.vocab_size,)
    assert tok.chat_template == metadata.get("tokenizer.chat_template")
    assert tok.piece(tok.bos_id) == metadata["tokenizer.ggml.tokens"][tok.bos_id]
    if name == "smollm2":
        assert tok.eog_ids >= {tok.vocab.token_to_id["<|im_end|>"], tok.vocab.token_to_id["<|endoftext|>"]}
        assert tok.unk_id == 0 and "<|im_start|>" in tok.chat_template
    else:
        assert tok.vocab.token_to_id["<end_of_turn>"] in tok.eog_ids and tok.unk_id == 3
        assert tok.encode("<start_of_turn>user\nHi<end_of_turn>", parse_special=True) == [2, 105, 2364, 107, 10979, 106]


@pytest.mark.conformance
@pytest.mark.parametrize("label", list(VARIANTS))
def test_variant_matches_llama_cpp(label):
    """The real vocabularies with other settings: every `tokenizer.ggml.pre` setting on SmolLM2's."""
    variant = VARIANTS[label]
    _, base, _, metadata = _model(variant["base"])
    metadata = {k: v for k, v in metadata.items() if k not in variant.get("drop", ())} | variant["overrides"]
    if base.vocab.is_spm:  # the SPM engine does not depend on these flags: skip rebuilding 262k merges
        tok = Tokenizer(build_vocab(metadata), base.engine)
    else:
        tok = Tokenizer.from_metadata(metadata)
    assert tok.add_bos == variant["add_bos"]
    plain = [tok.encode(t, add_special=False, parse_special=False) for t in CORPUS]
    full = [tok.encode(t, add_special=True, parse_special=True) for t in CORPUS]
    detok = [_text_or_hex(tok.detokenize(ids, unparse_special=True)) for ids in full]
    for key, got in (("ids_plain", plain), ("ids_special", full), ("detok", detok)):
        for g, want in enumerate(variant[key]):
            chunk = got[g * GROUP : (g + 1) * GROUP]
            assert _digest(chunk) == want, f"{label} {key}: a string of {CORPUS[g * GROUP : (g + 1) * GROUP]}"


def _random_texts(seed: int, n: int) -> list[str]:
    pool = (
        "aAzZ09 _-.,;:!?'\"()[]{}<>|/\\@#$%^&*+=~`\t\n\r" + "éßç€漢字かなカナ한글مرحباשלוםнет😀🇫👍🏽\u200d\u00a0\u3000"
    )
    specials = ["<|im_start|>", "<|im_end|>", "<end_of_turn>", "<bos>", "</s>", "  ", "\n\n", "<h1>", "'s", "123"]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [rng.choice(specials) if rng.random() < 0.1 else rng.choice(pool) for _ in range(rng.randint(0, 30))]
        out.append("".join(parts))
    return out


@pytest.mark.conformance
def test_random_strings_match_live_llama_cpp(model):
    llama_cpp = pytest.importorskip("llama_cpp")
    name, tok, _, _ = model
    llm = llama_cpp.Llama(str(MODELS[name]()), vocab_only=True, verbose=False)
    try:
        for text in _random_texts(seed=len(name), n=300):
            for add, parse in COMBOS:
                assert tok.encode(text, add, parse) == llm.tokenize(text.encode(), add_bos=add, special=parse), text
    finally:
        llm.close()


# -- synthetic vocabularies --------------------------------------------------------------------------------------

BYTE_CHARS = sorted(BYTE_DECODER, key=BYTE_DECODER.get)  # GPT-2's printable stand-in of each byte


def gpt2_metadata(pre: str | None = "gpt-2", merges=(), specials=(), **extra) -> dict:
    """A byte-level BPE vocabulary: `specials` (text, token type) first, then the 256 bytes, then the merges."""
    tokens = [t for t, _ in specials] + BYTE_CHARS
    types = [ty for _, ty in specials] + [TokenType.NORMAL] * 256
    for a, b in merges:
        tokens.append(a + b)
        types.append(TokenType.NORMAL)
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.asarray(types, dtype=np.int32),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
    }
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return md | extra


def spm_metadata(pieces: dict[str, float], specials=(), byte_tokens=True, **extra) -> dict:
    """A SentencePiece vocabulary: <unk> <s> </s>, `specials`, the <0xXX> bytes, then `pieces` with scores."""
    entries = [("<unk>", 0.0, TokenType.UNKNOWN), ("<s>", 0.0, TokenType.CONTROL), ("</s>", 0.0, TokenType.CONTROL)]
    entries += [(t, 0.0, ty) for t, ty in specials]
    if byte_tokens:
        entries += [(f"<0x{b:02X}>", 0.0, TokenType.BYTE) for b in range(256)]
    entries += [(t, s, TokenType.NORMAL) for t, s in pieces.items()]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [e[0] for e in entries],
        "tokenizer.ggml.scores": [e[1] for e in entries],  # a list here, a NumPy array from real files
        "tokenizer.ggml.token_type": [int(e[2]) for e in entries],
    } | extra


def split(tok: Tokenizer, text: str) -> list[str]:
    """The pre-tokenizer's pieces, turned back from GPT-2 byte characters into text."""
    return [
        bytes(BYTE_DECODER[c] for c in piece).decode() for piece, _ in tok.engine.pre_tokenizer.pre_tokenize_str(text)
    ]


def test_pre_tokenizer_is_chosen_by_tokenizer_ggml_pre():
    text = "Hello  world's 1234567 ok!!\n\n"
    gpt2 = Tokenizer.from_metadata(gpt2_metadata("gpt-2"))
    llama3 = Tokenizer.from_metadata(gpt2_metadata("llama-bpe"))
    qwen2 = Tokenizer.from_metadata(gpt2_metadata("qwen2"))
    smollm = Tokenizer.from_metadata(gpt2_metadata("smollm"))
    assert split(gpt2, text) == ["Hello", " ", " world", "'s", " 1234567", " ok", "!!", "\n\n"]
    assert split(llama3, text) == ["Hello", " ", " world", "'s", " ", "123", "456", "7", " ok", "!!\n\n"]
    assert split(qwen2, text) == ["Hello", " ", " world", "'s", " ", *"1234567", " ok", "!!\n\n"]
    assert split(smollm, text) == ["Hello", " ", " world", "'s", " ", *"1234567", " ok", "!!", "\n\n"]
    assert llama3.vocab.pre.ignore_merges and llama3.add_bos and not gpt2.add_bos
    assert gpt2.vocab.clean_spaces and not smollm.vocab.clean_spaces


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds_and_round_trips(pre):
    # the SPM-style ones (gemma4) spell spaces as "▁" and unknown bytes as <0xXX> tokens: give them those, as
    # llama.cpp itself drops what a byte-level vocabulary cannot spell there
    spm_bytes = [("▁", TokenType.NORMAL)] + [(f"<0x{b:02X}>", TokenType.BYTE) for b in range(256)]
    tok = Tokenizer.from_metadata(gpt2_metadata(pre, specials=spm_bytes if PRE_TOKENIZERS[pre].spm_style else ()))
    text = "Mixed 'text' with 12345 digits, CAPS and café 中文 😀\n\n  end"
    ids = tok.encode(text, add_special=False)
    assert bytes(b for i in ids for b in tok.token_to_piece(i)) == text.encode()


def test_llama_cpp_regex_spellings_become_oniguruma():
    assert onig_pattern(r"[\p{Lu}\p{Ll}]+") == r"[\p{L}\p{L}]+"
    assert onig_pattern(r"\s+$") == r"\s+\z"
    assert onig_pattern(r"\p{AFMoE_digits}").startswith(r"[^\p{N}]*")
    # llama.cpp's AFMoE digit splitter keeps the text before a digit run glued to its first group
    afmoe = pre_tokenizers.Split(Regex(onig_pattern(r"\p{AFMoE_digits}")), behavior="isolated")
    assert [p for p, _ in afmoe.pre_tokenize_str("ab1234567x")] == ["ab1", "234", "567", "x"]


def test_unknown_or_missing_pre_falls_back_to_default_with_a_warning():
    with pytest.warns(UserWarning, match="'no-such-pre' is not supported"):
        tok = Tokenizer.from_metadata(gpt2_metadata("no-such-pre"))
    assert tok.vocab.pre is PRE_TOKENIZERS["default"]
    with pytest.warns(UserWarning, match="kimi-k2"):
        assert resolve_pre("kimi-k2") is PRE_TOKENIZERS["default"]
    with pytest.warns(UserWarning, match="missing"):
        Tokenizer.from_metadata(gpt2_metadata(None))


def test_bpe_merges_by_rank_and_ignore_merges():
    merges = [("a", "b"), ("b", "c"), ("ab", "c")]
    tok = Tokenizer.from_metadata(gpt2_metadata("gpt-2", merges))
    t2i = tok.vocab.token_to_id
    assert tok.encode("abc") == [t2i["abc"]]
    assert tok.encode("bcb") == [t2i["bc"], t2i["b"]]
    # llama3 emits a pre-token found whole in the vocabulary without running the merges
    only_result = gpt2_metadata("llama3", [("x", "y")], specials=[("zz", TokenType.NORMAL)])
    tok3 = Tokenizer.from_metadata(only_result)
    assert tok3.encode("zz", add_special=False) == [0]
    z = 1 + BYTE_CHARS.index("z")  # after the one special token
    assert Tokenizer.from_metadata(only_result | {"tokenizer.ggml.pre": "gpt-2"}).encode("zz") == [z, z]


def test_spm_merges_by_score_not_by_order():
    base = {"▁": -1.0, "a": -2.0, "b": -3.0, "c": -4.0}
    right_first = Tokenizer.from_metadata(spm_metadata(base | {"ab": -10.0, "bc": -5.0}))
    left_first = Tokenizer.from_metadata(spm_metadata(base | {"ab": -5.0, "bc": -10.0}))
    piece = right_first.piece
    assert [piece(i) for i in right_first.encode("abc", add_special=False)] == ["▁", "a", "bc"]
    assert [piece(i) for i in left_first.encode("abc", add_special=False)] == ["▁", "ab", "c"]


def test_spm_byte_fallback_and_space_prefix():
    tok = Tokenizer.from_metadata(spm_metadata({"▁": -1.0, "a": -2.0, "▁a": -1.5}))
    ids = tok.encode("a€ a")
    assert ids[0] == tok.bos_id == 1 and not tok.add_eos
    assert [tok.piece(i) for i in ids[1:]] == ["▁a", "<0xE2>", "<0x82>", "<0xAC>", "▁a"]
    assert tok.token_to_piece(ids[2]) == b"\xe2" and tok.token_to_piece(ids[1]) == b" a"
    assert tok.decode(ids) == "<s> a€ a"  # llama.cpp keeps the prefix space after a BOS
    assert tok.decode(ids[1:]) == "a€ a"  # ... and drops it at the start
    assert tok.decode(ids, skip_special=True) == " a€ a"
    no_prefix = Tokenizer.from_metadata(spm_metadata({"a": -2.0}, **{"tokenizer.ggml.add_space_prefix": False}))
    assert [no_prefix.piece(i) for i in no_prefix.encode("a", add_special=False)] == ["a"]
    assert tok.encode("", add_special=True) == [1] and tok.encode("", add_special=False) == []


def test_special_tokens_user_defined_always_control_only_with_parse_special():
    md = spm_metadata(
        {"▁": -1.0, "x": -2.0, "▁x": -1.5},
        specials=[
            ("<ctl>", TokenType.CONTROL),
            ("<usr>", TokenType.USER_DEFINED),
            ("<usr><ctl>", TokenType.USER_DEFINED),
        ],
        **{"tokenizer.ggml.add_space_prefix": False},
    )
    tok = Tokenizer.from_metadata(md)
    ctl, usr, both = (tok.vocab.token_to_id[t] for t in ("<ctl>", "<usr>", "<usr><ctl>"))
    assert tok.partition("x<usr>x<ctl>x") == ["x", usr, "x<ctl>x"]
    assert tok.partition("x<usr>x<ctl>x", parse_special=True) == ["x", usr, "x", ctl, "x"]
    assert tok.partition("<usr><ctl>", parse_special=True) == [both]  # longest first
    assert tok.partition("<usr><usr><ctl>") == [usr, both]
    ids = tok.encode("x<ctl>", add_special=False)
    assert ctl not in ids and tok.decode(ids) == "x<ctl>"
    assert tok.encode("x<ctl>", add_special=False, parse_special=True)[-1] == ctl
    assert tok.decode([ctl]) == "<ctl>" and tok.decode([ctl], skip_special=True) == ""
    assert tok.decode([usr], skip_special=True) == "<usr>"  # user-defined tokens always render


def test_spm_space_prefix_after_each_special_token():
    md = spm_metadata({"▁": -1.0, "x": -2.0, "▁x": -1.5}, specials=[("<t>", TokenType.CONTROL)])
    tok = Tokenizer.from_metadata(md)
    pieces = [tok.piece(i) for i in tok.encode("x<t>x", add_special=False, parse_special=True)]
    assert pieces == ["▁x", "<t>", "▁x"]


def test_rstrip_for_phi3_special_tokens():
    md = gpt2_metadata("gpt-2", specials=[("<|end|>", TokenType.CONTROL)], **{"general.name": "Phi-3 mini"})
    tok = Tokenizer.from_metadata(md)
    assert tok.partition("a<|end|>  \nb", parse_special=True) == ["a", 0, "b"]


def test_eog_set_and_detected_special_tokens():
    specials = [
        (t, TokenType.CONTROL)
        for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|unused_3|>", "<|eom_id|>")
    ] + [("<end_of_turn>", TokenType.NORMAL)]
    tok = Tokenizer.from_metadata(gpt2_metadata("qwen2", specials=specials, **{"tokenizer.ggml.eos_token_id": 2}))
    t2i = tok.vocab.token_to_id
    assert tok.eos_id == 2 and tok.eot_id == t2i["<|endoftext|>"]  # the lowest id of the candidates
    assert tok.vocab.special["fim_pre"] == t2i["<|fim_prefix|>"] and tok.vocab.special["eom"] == t2i["<|eom_id|>"]
    assert tok.eog_ids == {t2i[t] for t in ("<|endoftext|>", "<|im_end|>", "<|eom_id|>", "<end_of_turn>")}
    assert tok.vocab.attrs[t2i["<end_of_turn>"]] & TokenAttr.CONTROL  # made control because it ends generation
    assert tok.vocab.attrs[t2i["<|unused_3|>"]] & TokenAttr.UNUSED
    assert tok.bos_id == 11 and tok.pad_id is None and tok.unk_id is None  # llama.cpp's BPE defaults
    assert all(tok.is_eog(i) for i in tok.eog_ids)


def test_eog_fixups_for_end_tokens():
    harmony = [(t, TokenType.CONTROL) for t in ("<|return|>", "<|call|>", "<|end|>", "<|channel|>")]
    tok = Tokenizer.from_metadata(gpt2_metadata("gpt-4o", specials=harmony))
    t2i = tok.vocab.token_to_id
    assert t2i["<|end|>"] not in tok.eog_ids and tok.vocab.attrs[t2i["<|end|>"]] == TokenAttr.USER_DEFINED
    assert tok.vocab.attrs[t2i["<|channel|>"]] == TokenAttr.USER_DEFINED
    gemma4ish = [(t, TokenType.CONTROL) for t in ("</s>", "<|tool_response>")]
    tok = Tokenizer.from_metadata(gpt2_metadata("gpt-2", specials=gemma4ish))
    assert tok.vocab.token_to_id["</s>"] not in tok.eog_ids


def test_detokenize_clean_spaces_like_llama_cpp():
    def clean(s: bytes) -> bytes:
        b = bytearray(s)
        _clean_spaces(b)
        return bytes(b)

    assert clean(b"Hello , world . Yes ? No !") == b"Hello, world. Yes? No!"
    assert clean(b"rock ' n ' roll") == b"rock'n'roll"
    assert clean(b"it 's I 'm we 're they 've don 't I 'd we 'll") == b"it's I'm we're they've don 't I 'd we 'll"
    assert clean(b"") == b"" and clean(b" ,") == b","
    tok = Tokenizer.from_metadata(gpt2_metadata("gpt-2"))  # clean_spaces is on for gpt-2
    assert tok.decode(tok.encode("a , b")) == "a, b"


def test_metadata_errors_name_the_field():
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model = 't5'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.merges"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})
    tok = Tokenizer.from_metadata(gpt2_metadata("gpt-2", **{"tokenizer.ggml.add_bos_token": True}))
    tok.vocab.special["bos"] = None
    with pytest.raises(ValueError, match="no bos token"):
        tok.encode("a")
    with pytest.raises(IndexError):
        tok.token_to_piece(10**6)


def test_load_tokenizer_reads_only_metadata(tmp_path):
    gguf = pytest.importorskip("gguf")
    md = spm_metadata({"▁": -1.0, "h": -2.0, "i": -3.0, "▁h": -1.2, "▁hi": -1.1})
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_scores(md["tokenizer.ggml.scores"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_tokenizer_model("llama")
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = load_tokenizer(tmp_path / "t.gguf")
    assert [tok.piece(i) for i in tok.encode("hi", add_special=False)] == ["▁hi"]
    assert tok.chat_template == "{{ messages }}" and tok.vocab_size == len(md["tokenizer.ggml.tokens"])


# -- hostile vocabularies (issue 11) -------------------------------------------------------------------------------


class _CountingDict(dict):
    """token_to_id that counts its membership tests: the merge derivation's unit of work."""

    lookups = 0

    def __contains__(self, key):
        _CountingDict.lookups += 1
        return super().__contains__(key)


def test_spm_merges_skip_cuts_no_token_can_fill():
    """One very long token among short ones gets no cut at all: it was one lookup (and one slice of the whole
    token) per character, quadratic: a 1M-character token took 150 s."""
    import dataclasses

    from ggufpy.tokenizer.spm import spm_merges

    tok = Tokenizer.from_metadata(spm_metadata({"▁": -1.0, "a": -2.0, "▁a": -1.5, "a" * 20_000: -3.0}))
    counting = _CountingDict(tok.vocab.token_to_id)
    _CountingDict.lookups = 0
    merges = spm_merges(dataclasses.replace(tok.vocab, token_to_id=counting))
    assert ("▁", "a") in merges and _CountingDict.lookups < 2000  # 256 byte tokens of 6 characters: 1291


def test_spm_vocabulary_with_a_1m_character_token_loads():
    long = "▁" + "a" * 1_000_000
    tok = Tokenizer.from_metadata(spm_metadata({"▁": -1.0, "a": -2.0, "▁a": -1.5, long: -3.0}))
    assert [tok.piece(i) for i in tok.encode("a a", add_special=False)] == ["▁a", "▁a"]
    assert tok.vocab.token_to_id[long] == len(tok) - 1


def test_spm_vocabulary_needing_too_much_merge_work_is_refused(monkeypatch):
    from ggufpy.errors import GGUFMetadataError
    from ggufpy.tokenizer import spm

    many_long = {"a" * n: -float(n) for n in range(1, 301)}  # every split of each is a pair of tokens: 9M steps
    monkeypatch.setattr(spm, "MAX_MERGE_WORK", 1_000_000)
    with pytest.raises(
        GGUFMetadataError, match=r"tokenizer\.ggml\.tokens = .*SPM merge derivation.*longest token: 300"
    ):
        Tokenizer.from_metadata(spm_metadata(many_long), source="crafted.gguf")


def test_vocabulary_size_is_checked_against_the_embeddings_before_the_build(monkeypatch):
    """2M empty tokens (a 16 MB file) took 918 MB to build; the model's embedding rows bound it first."""
    from ggufpy.errors import GGUFMetadataError
    from ggufpy.tokenizer import vocab

    def expensive(*args):
        raise AssertionError("the vocabulary was built before its size was checked")

    monkeypatch.setattr(vocab, "_pieces", expensive)
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [""] * 2_000_000}
    with pytest.raises(GGUFMetadataError, match=r"m\.gguf: metadata tokenizer\.ggml\.tokens = .* token_embd \(269\)"):
        build_vocab(md, n_vocab=269, source="m.gguf")


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("tokenizer.ggml.tokens", [1, 2, 3], "must be a string array"),
        ("tokenizer.ggml.tokens", [], "must be a non-empty array"),
        ("tokenizer.ggml.scores", ["x"] * 261, "must be a number array"),
        ("tokenizer.ggml.scores", [0.0], "must have an entry for each of the 261 tokens"),
        ("tokenizer.ggml.token_type", np.full(261, 2**40, np.int64), "must be an array of int32 values"),
        ("tokenizer.ggml.token_type", [1.5] * 261, "must be an integer array"),
        ("tokenizer.ggml.add_bos_token", 1, "must be a bool"),
        ("tokenizer.ggml.eos_token_id", float("nan"), "must be an integer"),
        ("tokenizer.ggml.eos_token_id", -1, "must be an integer in [0, 2**32)"),
        ("tokenizer.ggml.eos_token_id", 2**32, "must be an integer in [0, 2**32)"),
        ("tokenizer.ggml.pre", ["default"], "must be a string"),
        ("tokenizer.chat_template", 5, "must be a string"),
        ("tokenizer.ggml.model", None, "must be a string"),
    ],
)
def test_bad_tokenizer_metadata_names_key_value_and_rule(key, value, rule):
    from ggufpy.errors import GGUFMetadataError

    base = spm_metadata({"a": -1.0, "b": -2.0})
    assert len(base["tokenizer.ggml.tokens"]) == 261
    md = base | {key: value}
    with pytest.raises(GGUFMetadataError) as info:
        Tokenizer.from_metadata(md, source="x.gguf")
    message = str(info.value)
    assert message.startswith(f"x.gguf: metadata {key} = ") and rule in message


def test_add_bos_without_a_bos_token_is_refused_when_built_not_at_first_encode():
    from ggufpy.errors import GGUFMetadataError

    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}  # SPM's default bos id 1 is not a token
    with pytest.raises(
        GGUFMetadataError, match=r"add_bos_token = True: needs a bos token, and this vocabulary has none"
    ):
        Tokenizer.from_metadata(md)
    assert Tokenizer.from_metadata(md | {"tokenizer.ggml.add_bos_token": False}).encode("a") == [0]
