"""SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`) assembled from HF `tokenizers` parts.

llama.cpp `llm_tokenizer_spm_session::tokenize` starts from the UTF-8 characters of the whole fragment (spaces
already replaced by "▁") and repeatedly merges the adjacent pair whose concatenation is a token with the
highest score (leftmost on ties); characters left unmerged and absent from the vocabulary become `<0xXX>`
byte tokens. Any token can be the result of a merge, control and byte tokens included.

HF's `BPE` model merges by rank instead of score, so the merges are derived from the vocabulary: every way
to cut a token into two tokens is a merge, ranked by the score of the whole token (highest first). Ties
between different tokens of equal score then go by id where llama.cpp goes by position: this only matters
for two overlapping candidates of exactly equal score (Gemma 3's normal-token scores are all distinct).
HF also turns a character missing from the vocabulary into byte tokens before merging, where llama.cpp could
still merge it into a longer token; no token of Gemma 3 contains such a character.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from ..schema import fail
from .vocab import Vocab

__all__ = ["build_spm", "spm_merges"]


# Characters sliced and hashed while deriving the merges: Gemma 3's 262k tokens take 9.4M. The bound keeps a
# crafted vocabulary (thousands of long tokens) from running for minutes. llama.cpp has no such step: its SPM
# session looks the concatenation of each adjacent pair up while tokenizing.
MAX_MERGE_WORK = 1 << 27


def _cut_spans(lengths: Counter[int]) -> dict[int, range]:
    """Token length -> the cut positions k worth trying. Both parts of a cut are tokens shorter than the whole,
    so neither part can be longer than the longest shorter token: one 1M-character token among short ones
    gets no cut at all, instead of a million slices of a million characters."""
    spans, longest = {}, 0
    for n in sorted(lengths):
        spans[n] = range(max(1, n - longest), min(n - 1, longest) + 1)
        longest = n
    return spans


def spm_merges(vocab: Vocab, source: str | None = None) -> list[tuple[str, str]]:
    """All (left, right) token pairs whose concatenation is a token, best merged token score first (then id).

    `GGUFMetadataError` when that would take more than `MAX_MERGE_WORK` characters of slicing.
    """
    known = vocab.token_to_id
    ids = np.fromiter(known.values(), dtype=np.int64, count=len(known))  # each text once, last id wins
    ids.sort()
    ranked = ids[np.argsort(-vocab.scores[ids], kind="stable")].tolist()
    texts = [vocab.tokens[i] for i in ranked]
    lengths = Counter(map(len, texts))
    spans = _cut_spans(lengths)
    work = sum(count * n * len(spans[n]) for n, count in lengths.items())
    if work > MAX_MERGE_WORK:
        raise fail(
            "tokenizer.ggml.tokens",
            vocab.tokens,
            f"must not need more than {MAX_MERGE_WORK} characters of SPM merge derivation, these tokens need "
            f"{work} (longest token: {max(lengths)} characters)",
            source,
        )
    # one comprehension: the fastest plain-Python form of this 1.5M-step loop for Gemma's 262k tokens
    return [(t[:k], t[k:]) for t in texts for k in spans[len(t)] if t[:k] in known and t[k:] in known]


def build_spm(vocab: Vocab, source: str | None = None) -> HFTokenizer:
    """An HF tokenizer that turns one text fragment (no special tokens in it) into llama.cpp's ids.

    The caller adds the leading space of `add_space_prefix`: llama.cpp adds it per fragment.
    """
    model = models.BPE(vocab=dict(vocab.token_to_id), merges=spm_merges(vocab, source), byte_fallback=True)
    tok = HFTokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "▁")  # llama-vocab.cpp `llama_escape_whitespace`
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok
