"""`GGUFModelForCausalLM`: input_ids in, logits out, with HF's call and `generate` conventions."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import sampling
from ..checks import check_token_ids, is_int, is_real
from ..kvcache import KVCache
from ..shard import cache_with_room
from ..transformer import Model
from ._torch import _is_torch, _like, _numpy


@dataclass(frozen=True)
class GGUFConfig:
    """The model's hyperparameters under Hugging Face's config names (read from the GGUF metadata)."""

    model_type: str  # the GGUF architecture (llama, qwen2, gemma3...)
    vocab_size: int
    hidden_size: int  # dim
    intermediate_size: int  # hidden_dim
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int  # context_length
    rms_norm_eps: float
    rope_theta: float
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    tie_word_embeddings: bool
    sliding_window: int | None = None
    use_cache: bool = True
    is_encoder_decoder: bool = False
    dtype: str = "float32"  # the dtype of the logits and hidden states
    architectures: tuple[str, ...] = field(default=("GGUFModelForCausalLM",))

    @classmethod
    def from_model(cls, model: Model) -> GGUFConfig:
        c, tok = model.config, model.tokenizer
        tied = model.file is not None and "output.weight" not in model.file.tensors
        return cls(
            model_type=c.arch.name,
            vocab_size=c.vocab_size,
            hidden_size=c.dim,
            intermediate_size=c.hidden_dim,
            num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            max_position_embeddings=c.context_length,
            rms_norm_eps=c.norm_eps,
            rope_theta=c.rope_theta,
            bos_token_id=tok.bos_id if tok else None,
            eos_token_id=tok.eos_id if tok else None,
            pad_token_id=tok.pad_id if tok else None,
            tie_word_embeddings=tied,
            sliding_window=c.sliding_window,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["architectures"] = list(self.architectures)
        return d


class GGUFCache:
    """The KV caches of a batch, one `ggufpy.KVCache` per row, filled in place by each forward call.

    Rows hold only their real (unmasked) positions, so rows of one batch may differ in length.
    `get_seq_length()` counts the columns of `input_ids` seen so far, padding included, as an HF cache does.
    """

    def __init__(self, batch_size: int):
        self.rows: list[KVCache | None] = [None] * batch_size
        self.seen_tokens = 0
        self.model: Model | None = None  # the model that filled it: another one's keys have other shapes

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    @property
    def lengths(self) -> list[int]:
        """Real positions held per row."""
        return [0 if r is None else r.length for r in self.rows]

    def __repr__(self) -> str:
        return f"GGUFCache(batch_size={self.batch_size}, seen_tokens={self.seen_tokens}, lengths={self.lengths})"


@dataclass
class CausalLMOutput:
    """What a forward call returns: `.logits` (B, T, vocab) float32 and `.past_key_values` (or None).

    Also indexable like HF's `ModelOutput`: `out["logits"]`, `out[0]`, `out.to_tuple()`.
    """

    logits: Any
    past_key_values: GGUFCache | None = None

    def to_tuple(self) -> tuple:
        return tuple(v for v in (self.logits, self.past_key_values) if v is not None)

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]


_HF_LOAD_OPTIONS = ("torch_dtype", "dtype", "device_map", "trust_remote_code", "low_cpu_mem_usage", "revision")


class GGUFModelForCausalLM:
    """A GGUF language model with the calling conventions of `transformers.AutoModelForCausalLM`.

    `model(input_ids, attention_mask=None, past_key_values=None, use_cache=False)` returns a `CausalLMOutput`;
    `generate(...)` returns prompt and generated ids like HF. CPU only, float32, inference only.
    """

    def __init__(self, model: Model):
        if model.layers != range(model.config.n_layers):
            raise ValueError(f"GGUFModelForCausalLM needs the whole model, got the shard {model.layers}")
        self.model = model
        self.config = GGUFConfig.from_model(model)
        self.tokenizer = model.tokenizer

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike | None = None,
        *,
        gguf_file: str | None = None,
        backend: str = "numpy",
        numerics: str = "exact",
        backend_options: Mapping[str, Any] | None = None,
        **hf_options: Any,
    ) -> GGUFModelForCausalLM:
        """Load a GGUF file, a packaged model name ("smollm2"), or `gguf_file` inside the folder `path`.

        HF loading options that do not apply on a NumPy CPU model (torch_dtype, device_map...) are accepted
        and ignored; anything else is an error.
        """
        from ..loading import load

        unknown = sorted(set(hf_options) - set(_HF_LOAD_OPTIONS))
        if unknown:
            raise TypeError(
                f"from_pretrained got unsupported options {unknown}; ignored HF options: {_HF_LOAD_OPTIONS}"
            )
        if gguf_file is not None:
            path = Path(path or ".") / gguf_file
        return cls(load(path, backend=backend, numerics=numerics, **dict(backend_options or {})))

    # torch-module conveniences that HF code calls
    device = "cpu"

    def eval(self) -> GGUFModelForCausalLM:
        return self

    def to(self, *args: Any, **kwargs: Any) -> GGUFModelForCausalLM:
        """Accepts "cpu" (and dtypes, ignored: ggufpy computes in float32); any other device is an error."""
        for a in (*args, kwargs.get("device")):
            if (isinstance(a, str) or type(a).__name__ == "device") and str(a).split(":")[0] != "cpu":
                raise ValueError(f"ggufpy runs on the CPU only, not on {a!r}")
        return self

    # -- forward ------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs) -> CausalLMOutput:
        return self.forward(*args, **kwargs)

    def forward(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        past_key_values: GGUFCache | None = None,
        use_cache: bool = False,
        return_dict: bool = True,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        **kwargs: Any,
    ) -> CausalLMOutput:
        """Logits (B, T, vocab) float32 for `input_ids` (B, T).

        `attention_mask` (B, T), or (B, past + T) with a cache as HF passes it: each row's ones must be
        contiguous (left or right padding); masked positions are skipped and get zero logits. A row's real
        tokens continue its sequence in `past_key_values` (filled in place), so row b gives exactly the
        logits of its tokens run alone. The cache is returned when `use_cache` or one was passed in.
        """
        if output_attentions or output_hidden_states:
            raise NotImplementedError("output_attentions and output_hidden_states are not supported")
        ignored = {"position_ids", "cache_position", "token_type_ids"}
        unknown = sorted(k for k, v in kwargs.items() if k not in ignored and v is not None)
        if unknown:
            raise TypeError(f"forward got unsupported arguments {unknown}")
        as_torch = _is_torch(input_ids)
        ids = self._token_ids(input_ids)
        B, T = ids.shape
        cache = past_key_values if past_key_values is not None else GGUFCache(B)
        if not isinstance(cache, GGUFCache):
            raise TypeError(f"past_key_values must be the GGUFCache this model returned, got {type(cache).__name__}")
        if cache.batch_size != B:
            raise ValueError(f"past_key_values holds {cache.batch_size} rows, input_ids has {B}")
        if cache.model is not None and cache.model is not self.model:
            raise ValueError(f"past_key_values was filled by another model ({cache.model!r}), not {self.model!r}")
        cache.model = self.model
        mask = self._new_columns(attention_mask, B, T, cache.seen_tokens)

        V = self.config.vocab_size
        logits = np.zeros((B, T, V), np.float32)
        for b in range(B):
            real = np.flatnonzero(mask[b])
            if real.size == 0:
                continue
            if real[-1] - real[0] + 1 != real.size:
                raise ValueError(
                    f"attention_mask row {b} has gaps ({mask[b].tolist()}): only left or right padding is supported"
                )
            kv = cache_with_room(self.model, cache.rows[b], real.size, f"batch row {b}")
            logits[b, real] = self.model.forward(ids[b, real], kv.length, kv)  # (n, V)
            cache.rows[b] = kv
        cache.seen_tokens += T
        keep = use_cache or past_key_values is not None
        return CausalLMOutput(logits=_like(logits, as_torch), past_key_values=cache if keep else None)

    def _token_ids(self, input_ids: Any) -> np.ndarray:
        """input_ids as int64 (B, T), refused unless integer ids inside the vocabulary (no float truncation)."""
        try:
            ids = _numpy(input_ids)
        except ValueError:  # NumPy's "inhomogeneous shape"
            raise ValueError("input_ids rows have different lengths: pad them (tok(texts, padding=True))") from None
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[0] == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"input_ids must be integer ids of shape (batch, T) with batch >= 1, got {ids.dtype} {ids.shape}"
            )
        check_token_ids(ids, self.config.vocab_size, "input_ids: token id")
        return ids.astype(np.int64)

    @staticmethod
    def _new_columns(attention_mask: Any, B: int, T: int, seen: int) -> np.ndarray:
        """The mask (B, T) of the new columns: all ones by default; HF passes past + new columns.

        Only 0/1 integers or bools: 2, 0.5 or NaN have no meaning as a mask, and `astype(bool)` would read
        them as 1."""
        if attention_mask is None:
            return np.ones((B, T), bool)
        mask = _numpy(attention_mask)
        if mask.ndim == 1:
            mask = mask[None]
        if mask.shape == (B, seen + T):
            mask = mask[:, seen:]
        if mask.shape != (B, T):
            raise ValueError(
                f"attention_mask has shape {mask.shape}: expected ({B}, {T}) or ({B}, {seen + T}) with {seen} "
                "cached columns"
            )
        if mask.dtype != np.bool_:
            if not np.issubdtype(mask.dtype, np.integer):
                raise ValueError(f"attention_mask must hold 0/1 integers or bools, got dtype {mask.dtype}")
            bad = mask[(mask != 0) & (mask != 1)]
            if bad.size:
                raise ValueError(f"attention_mask must hold only 0 and 1, got {bad.flat[0]}")
        return mask.astype(bool)

    # -- generation ---------------------------------------------------------------------------------------
    def generate(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        num_beams: int = 1,
        **kwargs: Any,
    ):
        """Prompt and generated ids (B, T + n) like HF's `generate`, n <= `max_new_tokens`.

        Greedy unless `do_sample`; then HF's order: repetition penalty, temperature, top-k, top-p, a draw from
        a NumPy generator seeded with `seed` (so the draws differ from torch's). The repetition penalty (also
        applied when greedy, as in HF) sees each row's prompt and generated ids. A row stops at a token of
        `eos_token_id` (default: the model's end-of-generation ids), which is kept; finished rows are padded
        with `pad_token_id` (default: the config's, else the first eos id) until every row has stopped.
        """
        if num_beams != 1:
            raise NotImplementedError("beam search is not supported (num_beams must be 1)")
        ignored = {"use_cache", "output_scores", "return_dict_in_generate", "generation_config", "streamer"}
        unknown = sorted(k for k, v in kwargs.items() if k not in ignored and v not in (None, False, True))
        if unknown:
            raise TypeError(f"generate got unsupported arguments {unknown}")
        _check_generation_options(max_new_tokens, temperature, top_k, top_p, repetition_penalty)
        as_torch = _is_torch(input_ids)
        ids = self._token_ids(input_ids)
        B, T = ids.shape
        if eos_token_id is None:
            eos = sorted(self.tokenizer.eog_ids) if self.tokenizer else [self.config.eos_token_id]
        else:
            eos = [eos_token_id] if is_int(eos_token_id) else list(eos_token_id)
            if not all(is_int(e) for e in eos):
                raise ValueError(f"eos_token_id must be an integer or a list of integers, got {eos_token_id!r}")
        eos_set = {int(e) for e in eos if e is not None}
        pad = pad_token_id if pad_token_id is not None else self.config.pad_token_id
        if pad is None:
            pad = min(eos_set) if eos_set else 0
        if not is_int(pad):
            raise ValueError(f"pad_token_id must be an integer, got {pad!r}")
        rng = np.random.default_rng(seed)

        mask = self._new_columns(attention_mask, B, T, 0)
        empty = np.flatnonzero(~mask.any(axis=1))
        if empty.size:  # its next token would be drawn from the zero logits of a masked row
            raise ValueError(f"attention_mask row {int(empty[0])} has no real token: there is nothing to continue")
        history = [list(ids[b, mask[b]]) for b in range(B)]
        cache = GGUFCache(B)
        logits = _numpy(self.forward(ids, attention_mask=mask, past_key_values=cache).logits)
        last = np.array([np.flatnonzero(mask[b])[-1] for b in range(B)])
        step_logits = logits[np.arange(B), last]  # (B, V)
        done = np.zeros(B, bool)
        context = self.config.max_position_embeddings
        new_columns = []
        for _ in range(max_new_tokens):
            token = np.full(B, pad, np.int64)
            for b in np.flatnonzero(~done):
                x = step_logits[b]
                if repetition_penalty != 1.0:
                    x = sampling.apply_penalties(x, history[b], repetition_penalty)
                if do_sample and temperature > 0:
                    x = sampling.apply_temperature(x, temperature)
                    x = sampling.top_p(sampling.top_k(x, top_k), top_p)
                    token[b] = sampling.sample_categorical(x, rng)
                else:
                    token[b] = sampling.greedy(x)
                history[b].append(int(token[b]))
            new_columns.append(token)
            done |= np.isin(token, list(eos_set))
            # a row whose cache holds the whole context ends with the token just drawn, as llama.cpp and
            # OpenAI end at the length limit (finish_reason "length"): its tokens so far are the result
            done |= np.array(cache.lengths) >= context
            if done.all():
                break
            step_mask = ~done
            step_logits = _numpy(
                self.forward(token[:, None], attention_mask=step_mask[:, None], past_key_values=cache).logits
            )[:, -1]
        out = np.concatenate([ids, np.stack(new_columns, axis=1)], axis=1) if new_columns else ids
        return _like(out, as_torch)

    def __repr__(self) -> str:
        return f"GGUFModelForCausalLM({self.model!r})"


def _check_generation_options(max_new_tokens, temperature, top_k, top_p, repetition_penalty) -> None:
    """Refuse values HF refuses (or that would silently mean something else here, such as a NaN temperature
    turning sampling into greedy decoding)."""
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not is_real(repetition_penalty) or not math.isfinite(repetition_penalty) or repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be a finite number > 0, got {repetition_penalty!r}")
