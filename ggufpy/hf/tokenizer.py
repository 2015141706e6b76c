"""An HF tokenizer (transformers.PreTrainedTokenizerFast) built from a GGUF tokenizer."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..checks import check_token_ids
from ..tokenizer import Tokenizer
from ..tokenizer.vocab import TokenAttr
from ._torch import _is_torch, _like, _numpy

_NOT_PARSED = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # llama.cpp's "special" tokens, HF's special=True


def _token_text(tok: Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tok.piece(token_id)


def _model_max_length(metadata: Mapping[str, Any], source: str | None = None) -> int | None:
    """The context length, checked like the model loader checks it (None for a vocabulary-only file)."""
    from ..schema import MODEL_KEYS, read

    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or f"{arch}.context_length" not in metadata:
        return None
    return read(metadata, MODEL_KEYS["context_length"], arch, source)


class HFStyleTokenizer:
    """ggufpy's `Tokenizer` behind the attributes and methods of an HF tokenizer that most code uses.

    `encode` is HF's `encode(text)`: special tokens written in the text become their ids (HF matches added
    tokens always) and BOS/EOS are added when the vocabulary asks for them. `decode` renders special tokens
    unless `skip_special_tokens`. `apply_chat_template` renders with ggufpy's HF-identical Jinja environment.
    """

    padding_side = "left"

    def __init__(self, tokenizer: Tokenizer, model_max_length: int | None = None):
        self.tokenizer = tokenizer
        self.model_max_length = model_max_length
        self.chat_template = tokenizer.chat_template

    # special tokens, HF names
    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def pad_token_id(self) -> int | None:
        return self.tokenizer.pad_id

    @property
    def unk_token_id(self) -> int | None:
        return self.tokenizer.unk_id

    @property
    def bos_token(self) -> str | None:
        return _token_text(self.tokenizer, self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return _token_text(self.tokenizer, self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return _token_text(self.tokenizer, self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        return _token_text(self.tokenizer, self.unk_token_id)

    @property
    def all_special_ids(self) -> list[int]:
        vocab = self.tokenizer.vocab
        return sorted(i for i in vocab.special_tokens if vocab.attrs[i] & _NOT_PARSED)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special_tokens, parse_special=True)

    def __call__(
        self,
        text: str | Sequence[str],
        add_special_tokens: bool = True,
        padding: bool | str = False,
        return_tensors: str | None = None,
        return_attention_mask: bool = True,
        **unsupported: Any,
    ) -> dict[str, Any]:
        """HF's ``tok(texts, padding=True, return_tensors="np")``: ``input_ids`` and ``attention_mask``.

        Rows are padded on the left (``padding=True`` or ``"longest"``) with the pad token, else EOS. Options
        beyond these (truncation, text pairs, ``max_length`` padding) need transformers' own tokenizer.
        """
        if unsupported:
            raise TypeError(
                f"HFStyleTokenizer does not support {', '.join(sorted(unsupported))}: "
                'install transformers (pip install "ggufpy[hf]") for the full tokenizer interface'
            )
        if padding not in (False, True, "longest", "do_not_pad"):
            raise ValueError(f'padding={padding!r}: HFStyleTokenizer pads to the longest row only (True or "longest")')
        if return_tensors not in (None, "np", "pt"):
            raise ValueError(f"return_tensors={return_tensors!r}: HFStyleTokenizer returns lists, 'np' or 'pt'")
        single = isinstance(text, str)
        rows = [self.encode(t, add_special_tokens) for t in ([text] if single else text)]
        masks = [[1] * len(r) for r in rows]
        if padding in (True, "longest") and rows:
            width = max(len(r) for r in rows)
            pad = self.pad_token_id if self.pad_token_id is not None else self.eos_token_id
            if pad is None and any(len(r) < width for r in rows):
                raise ValueError("padding needs a pad or EOS token, and this vocabulary has neither")
            masks = [[0] * (width - len(r)) + m for r, m in zip(rows, masks, strict=True)]
            rows = [[pad] * (width - len(r)) + r for r in rows]
        if return_tensors is not None:
            if len({len(r) for r in rows}) > 1:
                raise ValueError(
                    f"rows of different lengths cannot become tensors: pass padding=True ({return_tensors=})"
                )
            rows, masks = (np.asarray(a, dtype=np.int64).reshape(len(rows), -1) for a in (rows, masks))
            rows, masks = (_like(a, return_tensors == "pt") for a in (rows, masks))
        elif single:
            rows, masks = rows[0], masks[0]
        out = {"input_ids": rows}
        if return_attention_mask:
            out["attention_mask"] = masks
        return out

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str:
        ids = np.asarray(_numpy(token_ids)).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):  # 1.7 must not silently become token 1
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        check_token_ids(ids, self.tokenizer.vocab_size)
        return self.tokenizer.decode([int(i) for i in ids], skip_special=skip_special_tokens)

    def batch_decode(self, sequences: Iterable[Any], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in _numpy_rows(sequences)]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, (int, np.integer)):
            return self.tokenizer.piece(int(ids))
        return [self.tokenizer.piece(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
        known = self.tokenizer.vocab.token_to_id
        if isinstance(tokens, str):
            return known.get(tokens, self.unk_token_id)
        return [known.get(t, self.unk_token_id) for t in tokens]

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """The prompt string (`tokenize=False`) or its ids (`tokenize=True`, no BOS/EOS added, as HF)."""
        from ..chat import ChatTemplate

        template = (
            ChatTemplate(chat_template, self.bos_token or "", self.eos_token or "")
            if chat_template
            else ChatTemplate.from_tokenizer(self.tokenizer)
        )
        text = template.render(conversation, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"HFStyleTokenizer({self.tokenizer!r})"


def _numpy_rows(sequences: Any) -> list[np.ndarray]:
    if _is_torch(sequences) or isinstance(sequences, np.ndarray):
        a = _numpy(sequences)
        return list(a.reshape(1, -1) if a.ndim == 1 else a)
    return [np.asarray(_numpy(s)).reshape(-1) for s in sequences]


def hf_tokenizer(tokenizer: Tokenizer, model_max_length: int | None = None):
    """A `transformers.PreTrainedTokenizerFast` giving the same ids as the GGUF `tokenizer`.

    Its engine is ggufpy's own HF `tokenizers` pipeline (the GGUF pre-tokenizer regexes and merges) with the
    vocabulary's special tokens registered as added tokens: control and unknown tokens as special (dropped
    by `skip_special_tokens`), user-defined tokens as normal. The BOS/EOS the vocabulary adds come from a
    template post-processor; SentencePiece vocabularies with `add_space_prefix` get the leading "▁" of each
    text fragment from a normalizer, as llama.cpp adds it per fragment. The padding side is left, the side
    `GGUFModelForCausalLM` batches need.
    """
    from tokenizers import AddedToken, decoders, normalizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = tokenizer.vocab
    engine = RustTokenizer.from_str(tokenizer.engine.to_str())  # a copy: ggufpy's own engine stays as it is
    special, normal = [], []
    for i in sorted(vocab.special_tokens):
        attr = int(vocab.attrs[i])
        token = AddedToken(
            vocab.tokens[i],
            special=bool(attr & _NOT_PARSED),
            normalized=False,
            lstrip=bool(attr & TokenAttr.LSTRIP),
            rstrip=bool(attr & TokenAttr.RSTRIP),
        )
        (special if token.special else normal).append(token)
    engine.add_special_tokens(special)
    engine.add_tokens(normal)
    if vocab.is_spm and vocab.add_space_prefix:
        engine.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        engine.decoder = decoders.Sequence([engine.decoder, decoders.Strip(" ", 1, 0)])
    named = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "unk": tokenizer.unk_id, "pad": tokenizer.pad_id}
    before = [named["bos"]] if vocab.add_bos else []  # what `encode` adds around the text
    after = [named["eos"]] if vocab.add_eos else []
    if None in before + after:
        raise ValueError("tokenizer.ggml.add_bos_token/add_eos_token is set but the vocabulary has no such token")
    if before or after:
        pieces = {i: tokenizer.piece(i) for i in before + after}
        single = " ".join([*(pieces[i] for i in before), "$A", *(pieces[i] for i in after)])
        engine.post_processor = processors.TemplateProcessing(
            single=single,
            pair=f"{single} {single.replace('$A', '$B')}",
            special_tokens=[(text, i) for i, text in pieces.items()],
        )
    kwargs = {f"{name}_token": tokenizer.piece(i) for name, i in named.items() if i is not None}
    kwargs["additional_special_tokens"] = [
        t.content for t in special if vocab.token_to_id[t.content] not in named.values()
    ]
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(
        tokenizer_object=engine,
        chat_template=tokenizer.chat_template,
        clean_up_tokenization_spaces=vocab.clean_spaces,
        padding_side="left",
        **kwargs,
    )


def load_tokenizer(path: str | os.PathLike | None = None):
    """The tokenizer of a GGUF file (or packaged model name; None = the default model) as an HF tokenizer.

    A `transformers.PreTrainedTokenizerFast` (bos, eos, pad, unk and the chat template set) when transformers
    is installed (`pip install 'ggufpy[hf]'`), else an `HFStyleTokenizer` with a warning. Either gives
    llama.cpp's ids, the same as `ggufpy.load_tokenizer(path).encode(text, parse_special=True)`.
    """
    from ..loading import resolve_model_path
    from ..reader import open as open_gguf

    with open_gguf(resolve_model_path(path)) as f:
        embd = f.tensors.get("token_embd.weight")
        tok = Tokenizer.from_metadata(
            f.metadata, n_vocab=embd.shape[0] if embd is not None else None, source=str(f.path)
        )
        max_length = _model_max_length(f.metadata, str(f.path))
    try:
        import transformers  # noqa: F401
    except ImportError:
        warnings.warn(
            "transformers is not installed: returning ggufpy.hf.HFStyleTokenizer, not a PreTrainedTokenizerFast "
            "(pip install 'ggufpy[hf]')",
            stacklevel=2,
        )
        return HFStyleTokenizer(tok, max_length)
    return hf_tokenizer(tok, max_length)
