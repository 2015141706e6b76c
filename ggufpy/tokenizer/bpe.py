"""Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) assembled from HF `tokenizers` parts.

llama.cpp `llm_tokenizer_bpe_session::tokenize`: split the text with the pre-tokenizer's regex list, map every
byte of each piece to GPT-2's printable characters, then merge adjacent symbols lowest rank first (leftmost
on ties). With `ignore_merges` a piece found whole in the vocabulary is emitted as is. The same parts in
HF terms: `Split(regex, "isolated")` for each regex, `ByteLevel(use_regex=False)`, and a `BPE` model.

SPM-style BPE (`PreTokenizer.spm_style`: gemma4, sarvam-moe) has no byte-level step: spaces become "▁"
(`llama_escape_whitespace`), the symbols are the raw UTF-8 characters, and a final symbol that is not a
token is spelled as `<0xXX>` byte tokens. In HF terms: a `Replace(" ", "▁")` normalizer and a `BPE` model with
`byte_fallback`. gemma4's whole-newline-run rule is applied by `Tokenizer` before this engine.
"""

from __future__ import annotations

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .pretokenizers import onig_pattern
from .vocab import Vocab

__all__ = ["build_bpe"]


def _usable_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """Merges by rank, keeping the first of repeated pairs (llama.cpp `bpe_ranks.emplace`).

    HF refuses merges whose parts or result are not tokens; llama.cpp would merge them and then spell the
    unknown result out byte by byte, which a well-formed vocabulary never needs.
    """
    known = vocab.token_to_id
    seen: set[tuple[str, str]] = set()
    out = []
    for pair in vocab.merges:
        a, b = pair
        if pair in seen or a not in known or b not in known or a + b not in known:
            continue
        seen.add(pair)
        out.append(pair)
    return out


def build_bpe(vocab: Vocab) -> HFTokenizer:
    """An HF tokenizer that turns one text fragment (no special tokens in it) into llama.cpp's ids."""
    assert vocab.pre is not None
    spm_style = vocab.pre.spm_style
    model = models.BPE(
        vocab=dict(vocab.token_to_id),
        merges=_usable_merges(vocab),
        ignore_merges=vocab.pre.ignore_merges,
        byte_fallback=spm_style,
    )
    tok = HFTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(onig_pattern(r)), behavior="isolated") for r in vocab.pre.regexes]
    if spm_style:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok
