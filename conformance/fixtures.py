"""Deterministic tiny synthetic GGUF models (random but well-scaled weights) written with gguf.GGUFWriter.

llama.cpp loads them too, which makes them conformance fixtures as well as fast unit-test models.
The vocabulary is a small GPT-2-style byte-level BPE: the 256 byte tokens, a few merges and specials.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from ggufpy.constants import GGMLType
from ggufpy.quants import quantize

ROLES = ("embd", "output", "attn", "ffn")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a n"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_tokens() -> list[str]:
    """The 256 single-byte tokens in GPT-2's printable byte-to-unicode mapping, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


@dataclass(frozen=True)
class TinyLlama:
    """Hyperparameters of a synthetic llama-architecture model. Defaults fit every block size (256)."""

    dim: int = 256
    hidden_dim: int = 512
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    context_length: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_output: bool = False
    rope_freqs: bool = False
    seed: int = 0
    # GGML type per tensor role: "embd", "output", "attn", "ffn"; norms are always F32
    types: dict[str, GGMLType] = field(default_factory=lambda: dict.fromkeys(ROLES, GGMLType.F32))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _tokens() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + byte_level_tokens()
    for m in MERGES:
        tokens.append(m.replace(" ", ""))
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    return tokens, [int(t) for t in types]


def write_tiny_llama(path: str | Path, spec: TinyLlama = TinyLlama()) -> Path:
    """Write the model to `path` and return it."""
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _tokens()
    V, D, F = len(tokens), spec.dim, spec.hidden_dim
    Q, K = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-synthetic")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(F)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add(name: str, shape: tuple[int, ...], role: str | None, scale: float | None = None):
        if role is None:  # norm weights: around 1
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, data)
            return
        data = (rng.standard_normal(shape) * (scale or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)
        qtype = spec.types[role]
        if qtype == GGMLType.F32:
            w.add_tensor(name, data)
        else:
            raw = quantize(data, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    add("token_embd.weight", (V, D), "embd", scale=1.0)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (D,), None)
        add(p + "attn_q.weight", (Q, D), "attn")
        add(p + "attn_k.weight", (K, D), "attn")
        add(p + "attn_v.weight", (K, D), "attn")
        add(p + "attn_output.weight", (D, Q), "attn")
        add(p + "ffn_norm.weight", (D,), None)
        add(p + "ffn_gate.weight", (F, D), "ffn")
        add(p + "ffn_up.weight", (F, D), "ffn")
        add(p + "ffn_down.weight", (D, F), "ffn")
    add("output_norm.weight", (D,), None)
    if not spec.tied_output:
        add("output.weight", (V, D), "output")
    if spec.rope_freqs:
        w.add_tensor("rope_freqs.weight", (1.0 + rng.random(spec.head_dim // 2) * 3).astype(np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
