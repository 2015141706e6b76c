"""GGUF tokenizers that give llama.cpp's token ids, built from the file's metadata with HF `tokenizers` parts.

- `vocab.py`: the vocabulary, special ids, token attributes and end-of-generation set (llama.cpp's loader)
- `pretokenizers.py`: the `tokenizer.ggml.pre` table of regex splits
- `hashorder.py`: the order llama.cpp's `token_to_id` map yields tokens in (special tokens found by their text)
- `bpe.py`: byte-level BPE (`tokenizer.ggml.model == "gpt2"`), and SPM-style BPE (gemma4, sarvam-moe)
- `spm.py`: SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`)
- `tokenizer.py`: `Tokenizer` (special-token partition, encode, decode)
"""

from __future__ import annotations

import os

from .pretokenizers import PRE_TOKENIZERS, PreTokenizer
from .tokenizer import Tokenizer
from .vocab import TokenAttr, TokenType, Vocab, build_vocab

__all__ = [
    "PRE_TOKENIZERS",
    "PreTokenizer",
    "TokenAttr",
    "TokenType",
    "Tokenizer",
    "Vocab",
    "build_vocab",
    "load_tokenizer",
]


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file or packaged model (`ggufpy.packaged.resolve`), from its metadata only."""
    from ..packaged import resolve
    from ..reader import open as open_gguf  # imported here so ggufpy can import this package

    with open_gguf(resolve(path)) as f:
        embd = f.tensors.get("token_embd.weight")  # a vocabulary-only file has none
        n_vocab = embd.shape[0] if embd is not None else None
        return Tokenizer.from_metadata(f.metadata, n_vocab=n_vocab, source=str(f.path))
