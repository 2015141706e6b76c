"""`Tokenizer`: llama.cpp's `llama_tokenize` / `llama_detokenize` over a GGUF vocabulary.

Encoding has two stages, as in llama.cpp `llama_vocab::impl::tokenize`:

1. `partition`: special tokens are cut out of the text, longest first (`tokenizer_st_partition`).
   User-defined tokens are always cut out (those spelled like tags not in message `content`); control and
   unknown tokens only with `parse_special=True`.
2. Each remaining text fragment goes through the HF `tokenizers` engine (`bpe.py` or `spm.py`); with gemma4's
   pre-tokenizer a newline run that is a token is taken whole first (`llm_tokenizer_bpe_session::tokenize`).

Decoding concatenates the llama.cpp pieces of the ids and applies its space clean-up (`detokenize`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from ..schema import TOKENIZER_KEYS, read
from .bpe import build_bpe
from .spm import build_spm
from .vocab import TokenAttr, Vocab, build_vocab

__all__ = ["Tokenizer"]

_C_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale, used by LSTRIP / RSTRIP
_NOT_PARSED = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # cut out only when parse_special is True
# A user-defined token spelled like a chat-format tag (harmony's <|start|>, gemma4's <|turn>, deepseek's <｜...｜>):
# a control token in all but its type, so message content never matches it. Other user-defined tokens (gemma's
# HTML tags, whitespace runs) are plain text and stay matched everywhere, as in llama.cpp.
_TAG_LIKE = re.compile(r"<[|｜].*|.*[|｜]>", re.DOTALL)
_NEWLINE_RUNS = re.compile(r"[^\n]+|\n+")  # the gemma4 pre-tokenizer's split (unicode.cpp, custom newlines)


class Tokenizer:
    """A GGUF tokenizer that gives llama.cpp's token ids.

    Build it with `Tokenizer.from_metadata(metadata)` (or `ggufpy.tokenizer.load_tokenizer(path)`).
    The ids of `bos_id`, `eos_id`, `eot_id`, `pad_id` and `unk_id` are None when the vocabulary has none.
    """

    def __init__(self, vocab: Vocab, engine: HFTokenizer, chat_template: str | None = None):
        self.vocab = vocab
        self.engine = engine  # the HF tokenizer that encodes one fragment without special tokens
        self.chat_template = chat_template
        # (id, text, lstrip, rstrip) in matching order: all of them, and those matched without parse_special
        special = [
            (i, vocab.tokens[i], bool(a & TokenAttr.LSTRIP), bool(a & TokenAttr.RSTRIP), not a & _NOT_PARSED)
            for i, a in ((i, int(vocab.attrs[i])) for i in vocab.special_tokens)
        ]
        self._special_all = [s[:4] for s in special]
        self._special_always = [s[:4] for s in special if s[4]]
        user_defined = (i for i in vocab.special_tokens if vocab.attrs[i] & TokenAttr.USER_DEFINED)
        self.control_like = frozenset(i for i in user_defined if _TAG_LIKE.fullmatch(vocab.tokens[i]))
        self._special_content = [s for s in self._special_always if s[0] not in self.control_like]
        # gemma4: newline-only token texts, emitted whole for a newline run instead of merging (llama.cpp PR 21343)
        whole_runs = vocab.pre is not None and vocab.pre.whole_newline_runs
        self._newline_runs = {t: i for t, i in vocab.token_to_id.items() if not t.strip("\n")} if whole_runs else {}
        # SPM-style BPE over a vocabulary that lacks some <0xXX> tokens: byte -> id or None (else None: HF's
        # byte fallback is exact when all 256 are there)
        spm_style = vocab.pre is not None and vocab.pre.spm_style
        byte_ids = [vocab.token_to_id.get(f"<0x{b:02X}>") for b in range(256)] if spm_style else []
        self._byte_ids = byte_ids if None in byte_ids else None

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], n_vocab: int | None = None, source: str | None = None
    ) -> Tokenizer:
        """Build from GGUF metadata alone (`tokenizer.ggml.*` and `tokenizer.chat_template`).

        `n_vocab`: the model's `token_embd` rows, which the vocabulary must match; `source`: the file, named in
        errors. Bad metadata raises `GGUFMetadataError` (see `ggufpy.schema.TOKENIZER_KEYS`).
        """
        vocab = build_vocab(metadata, n_vocab=n_vocab, source=source)
        engine = build_spm(vocab, source=source) if vocab.is_spm else build_bpe(vocab)
        template = read(metadata, TOKENIZER_KEYS["chat_template"], source=source)
        return cls(vocab, engine, template)

    # -- vocabulary facts -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.special["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.special["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.special["eot"]

    @property
    def pad_id(self) -> int | None:
        return self.vocab.special["pad"]

    @property
    def unk_id(self) -> int | None:
        return self.vocab.special["unk"]

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, eot, eom and tokens such as <|im_end|> or <end_of_turn>."""
        return self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    @property
    def token_types(self) -> np.ndarray:
        """i32[vocab_size]: `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined,
        5 unused, 6 byte)."""
        return self.vocab.token_types

    def piece(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (with "▁" or GPT-2 byte characters)."""
        return self.vocab.tokens[token_id]

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        kind = "spm" if self.vocab.is_spm else f"bpe/{self.vocab.pre.type if self.vocab.pre else '?'}"
        return f"Tokenizer({kind}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"

    # -- encoding ---------------------------------------------------------------------------------------

    def partition(self, text: str, parse_special: bool = False, content: bool = False) -> list[str | int]:
        """Split `text` into raw-text fragments (str) and special token ids (int), as llama.cpp's
        `tokenizer_st_partition` does: each special token in turn, longest first, cuts every fragment.
        `content=True` (message text, grammar text; not with `parse_special`) also leaves the user-defined tokens
        in `control_like` as text."""
        if parse_special and content:
            raise ValueError("partition: parse_special and content exclude each other")
        matched = self._special_all if parse_special else self._special_content if content else self._special_always
        fragments: list[str | int] = [text] if text else []
        for token_id, token_text, lstrip, rstrip in matched:
            if token_text not in text:
                continue
            cut: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or token_text not in fragment:
                    cut.append(fragment)
                    continue
                pos, end = 0, len(fragment)
                while (match := fragment.find(token_text, pos)) >= 0:
                    left = fragment[pos:match]
                    if lstrip:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        cut.append(left)
                    cut.append(token_id)
                    pos = match + len(token_text)
                    while rstrip and pos < end and fragment[pos] in _C_SPACE:
                        pos += 1
                if pos < end:
                    cut.append(fragment[pos:])
            fragments = cut
        return fragments

    def encode(
        self, text: str, add_special: bool = True, parse_special: bool = False, content: bool = False
    ) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(vocab, text, add_special, parse_special)`.

        `add_special` adds BOS / EOS when the vocabulary asks for them (`add_bos`, `add_eos`);
        `parse_special` lets control tokens written in the text (e.g. "<|im_start|>") become their ids;
        `content` spells out the tag-like user-defined tokens too (`control_like`: gpt-oss's <|end|>), which
        llama.cpp matches even without parse_special: text that must never produce a control token.
        """
        vocab, out = self.vocab, []
        if add_special and vocab.add_bos:
            out.append(self._required("bos"))
        prefix_space = vocab.is_spm and vocab.add_space_prefix
        is_prev_special = True  # SPM: a fragment at the start or after a special token gets the prefix space
        for fragment in self.partition(text, parse_special, content):
            if isinstance(fragment, int):
                out.append(fragment)
                is_prev_special = True
                continue
            if prefix_space and is_prev_special:
                fragment = " " + fragment
            out.extend(self._fragment_ids(fragment))
            is_prev_special = False
        if add_special and vocab.add_eos:
            out.append(self._required("eos"))
        return out

    def _fragment_ids(self, fragment: str) -> list[int]:
        """The engine's ids of one fragment; a newline run found in `_newline_runs` is one token (gemma4)."""
        if not self._newline_runs or "\n" not in fragment:
            return self._engine_ids(fragment)
        ids: list[int] = []
        for piece in _NEWLINE_RUNS.findall(fragment):
            whole = self._newline_runs.get(piece)
            ids.extend([whole] if whole is not None else self._engine_ids(piece))
        return ids

    def _engine_ids(self, text: str) -> list[int]:
        """The engine's ids of `text`. SPM-style BPE without all byte tokens: HF drops a character that is no token
        and cannot be spelled in bytes before merging its neighbours; llama.cpp keeps it as a symbol no merge
        crosses, then writes the byte tokens it has. So the text is cut at such characters here."""
        byte_ids = self._byte_ids
        if byte_ids is None:
            return self.engine.encode(text, add_special_tokens=False).ids
        known = self.vocab.token_to_id
        text = text.replace(" ", "▁")  # the engine's normalizer, so that an unknown "▁" is seen here too
        ids: list[int] = []
        start = 0
        for k, c in enumerate(text):
            spelled = [byte_ids[b] for b in c.encode()]
            if c in known or None not in spelled:
                continue
            ids.extend(self.engine.encode(text[start:k], add_special_tokens=False).ids if k > start else [])
            ids.extend(i for i in spelled if i is not None)
            start = k + 1
        ids.extend(self.engine.encode(text[start:], add_special_tokens=False).ids if start < len(text) else [])
        return ids

    def _required(self, name: str) -> int:
        token_id = self.vocab.special[name]
        if token_id is None:
            raise ValueError(f"tokenizer.ggml.add_{name}_token is set but the vocabulary has no {name} token")
        return token_id

    # -- decoding ---------------------------------------------------------------------------------------

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes llama.cpp's `llama_token_to_piece(vocab, id, buf, len, 0, special)` writes.

        Control and unknown tokens render as their text only when `special` is True. A piece can be a
        fragment of a UTF-8 character (byte tokens, byte-level BPE).
        """
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        if not special and self.vocab.attrs[token_id] & _NOT_PARSED:
            return b""
        return self.vocab.pieces[token_id]

    def detokenize(self, ids: Iterable[int], remove_special: bool = False, unparse_special: bool = False) -> bytes:
        """llama.cpp's `llama_detokenize(vocab, ids, n, buf, len, remove_special, unparse_special)`.

        `remove_special` drops a leading BOS / trailing EOS that `add_bos` / `add_eos` would have added;
        `unparse_special` renders control tokens as their text. The space `add_space_prefix` put in front of
        the first token is removed, unless a BOS was removed before it (as llama.cpp does).
        """
        ids = [int(i) for i in ids]
        vocab = self.vocab
        remove_space = vocab.add_space_prefix
        if remove_special and vocab.add_bos and ids and ids[0] == vocab.special["bos"]:
            remove_space = False
            ids = ids[1:]
        if remove_special and vocab.add_eos and ids and ids[-1] == vocab.special["eos"]:
            ids = ids[:-1]
        text = bytearray()
        for n, token_id in enumerate(ids):
            piece = self.token_to_piece(token_id, unparse_special)
            if n == 0 and remove_space and piece[:1] == b" ":
                piece = piece[1:]
            text += piece
        if vocab.clean_spaces:
            _clean_spaces(text)
        return bytes(text)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`: llama.cpp's detokenize with control tokens rendered, or dropped (together with the
        BOS / EOS the vocabulary adds) when `skip_special` is True. Bytes that are not UTF-8 become U+FFFD."""
        raw = self.detokenize(ids, remove_special=skip_special, unparse_special=not skip_special)
        return raw.decode("utf-8", errors="replace")


def _clean_spaces(text: bytearray) -> None:
    """llama.cpp's `clean_spaces` passes of `detokenize` (clean_up_tokenization_spaces), in place.

    A literal port: each pass compacts the buffer while reading ahead of where it writes.
    """
    sp, apos = ord(" "), ord("'")
    # 1: " ?", " !", " .", " ," lose their space
    total1 = len(text)
    total = 1 if total1 else 0
    for i in range(1, total1):
        x = text[i]
        if text[i - 1] == sp and x in b"?!.,":
            total -= 1
        text[total] = x
        total += 1
    # 2: a lone apostrophe between spaces loses both spaces
    total2 = total
    total = 1 if total2 else 0
    i = 1
    while i < total2:
        x = text[i]
        if x == apos and i + 1 < total2 and text[i - 1] == sp and text[i + 1] == sp:
            total -= 1
            i += 1
            text[i] = 0
        text[total] = x
        total += 1
        i += 1
    # 3: " 's", " 'm", " 're", " 've" lose their space (" 't", " 'd", " 'll" keep it)
    total3 = total
    total = 1 if total3 else 0
    for i in range(1, total3):
        x = text[i]
        if text[i - 1] == sp and x == apos and i + 1 < total3:
            x1 = text[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < total3:
                if (x1, text[i + 2]) in ((ord("r"), ord("e")), (ord("v"), ord("e"))):
                    total -= 1
        text[total] = x
        total += 1
    del text[total:]
