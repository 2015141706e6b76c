"""Tiny synthetic lfm2 (Liquid LFM2) GGUF models, written with gguf.GGUFWriter in the layout llama.cpp's loader reads
(src/models/lfm2.cpp `load_arch_tensors`): `token_embd`, the final norm as `token_embd_norm` (llama-arch.cpp
`LLM_TENSOR_OUTPUT_NORM_LFM2`), a tied head; per block `attn_norm` (the operator norm), `ffn_norm` and a dense
`ffn_{gate,up,down}`, then by the layer's `attention.head_count_kv` entry either the short conv (0:
`shortconv.in_proj` (3D, D), `shortconv.conv` GGUF dims {l_cache, D}, `shortconv.out_proj` (D, D)) or attention
(`attn_{q,k,v,output}` and per-head `attn_{q,k}_norm`).

The keys are those convert_hf_to_gguf.py's LFM2Model writes: `head_count_kv` as one entry per layer (0 on the
conv layers), `shortconv.l_cache`, no key_length (head size dim / head_count).

`LFM2_FIXTURES` joins the conformance catalogue: importing this module (conformance/__init__.py does) adds them to
`fixtures.FIXTURES`, and `fixtures.write_tiny_llama` hands a `TinyLFM2` to `write_tiny_lfm2`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from ggufpy.constants import GGMLType

from .fixtures import FIXTURES, FLOAT, WRITERS, TinyLlama, _quantize, _tokens, add_vocab


@dataclass(frozen=True)
class TinyLFM2(TinyLlama):
    """A `TinyLlama` with lfm2's blocks: the layers of `conv_layers` are short-conv ones, the others attention."""

    conv_layers: tuple[int, ...] = (0, 1, 3)  # LFM2-350M: 0, 1, 3, 4, 6, 7, 9, 11, 13, 15 of 16
    l_cache: int = 3  # shortconv.l_cache (every LFM2: 3)
    conv_scale: float = 0.5  # the conv taps' spread
    # the value of `attention.head_count_kv` on the conv layers (0; the tests write others)
    conv_kv_heads: int = 0
    tokenizer_pre: str = "default"  # LFM2's files say "lfm2" (llama.cpp: the llama3 pre-tokenizer)


def write_tiny_lfm2(path: str | Path, spec: TinyLFM2) -> Path:
    """Write the model to `path` and return it."""
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _tokens()
    V, D, F, E, L = len(tokens), spec.dim, spec.hidden_dim, spec.head_dim, spec.l_cache
    Q, K = spec.n_heads * E, spec.n_kv_heads * E

    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_name("tiny-lfm2-synthetic")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(F)
    w.add_head_count(spec.n_heads)
    kv = [spec.conv_kv_heads if i in spec.conv_layers else spec.n_kv_heads for i in range(spec.n_layers)]
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_shortconv_l_cache(L)
    for k, value in spec.extra_kv:
        add_kv = {float: w.add_float32, int: w.add_uint32, str: w.add_string}[type(value)]
        add_kv(f"lfm2.{k}", value)
    w.add_vocab_size(V)
    add_vocab(w, tokens, token_types)
    if spec.tokenizer_pre != "default":  # add_vocab wrote "default"; the writer refuses a key twice
        del w.kv_data[0][gguf.Keys.Tokenizer.PRE]
        w.add_tokenizer_pre(spec.tokenizer_pre)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def norm(name: str, n: int) -> None:  # around 1
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    def matrix(name: str, shape: tuple[int, int], role: str, scale: float | None = None) -> None:
        data = (rng.standard_normal(shape) * (scale or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)
        qtype = spec.types[role]
        if qtype == GGMLType.F32:
            w.add_tensor(name, data)
        else:
            raw = _quantize(data, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    head_scale = spec.logit_std / np.sqrt(D)
    matrix("token_embd.weight", (V, D), "embd", scale=head_scale if spec.tied_output else 1.0)
    norm("token_embd_norm.weight", D)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", D)
        if i in spec.conv_layers:
            # in_proj's rows: b, c, x; the taps of either sign (the converter stores conv1d (D, 1, L) as (D, L))
            matrix(p + "shortconv.in_proj.weight", (3 * D, D), "attn")
            w.add_tensor(
                p + "shortconv.conv.weight", (spec.conv_scale * rng.standard_normal((D, L))).astype(np.float32)
            )
            matrix(p + "shortconv.out_proj.weight", (D, D), "attn")
        else:
            matrix(p + "attn_q.weight", (Q, D), "attn")
            matrix(p + "attn_k.weight", (K, D), "attn")
            matrix(p + "attn_v.weight", (K, D), "attn")
            norm(p + "attn_q_norm.weight", E)
            norm(p + "attn_k_norm.weight", E)
            matrix(p + "attn_output.weight", (D, Q), "attn")
        norm(p + "ffn_norm.weight", D)
        matrix(p + "ffn_gate.weight", (F, D), "ffn")
        matrix(p + "ffn_up.weight", (F, D), "ffn")
        matrix(p + "ffn_down.weight", (D, F), "ffn")
    if not spec.tied_output:
        matrix("output.weight", (V, D), "output", scale=head_scale)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# LFM2 in small, F32: 4 layers, short conv on 0, 1 and 3 (l_cache 3: a state of the last 2 inputs), attention on 2
# with 4 heads of 8 over 2 KV heads, per-head Q/K norms and neox RoPE (base 1e6, as LFM2); a tied head.
LFM2 = TinyLFM2(
    **{
        **vars(replace(FLOAT, n_layers=4, hidden_dim=64)),
        "arch": "lfm2",
        "seed": 550,
        "n_heads": 4,
        "n_kv_heads": 2,
        "rope_theta": 1e6,
    }
)
LFM2_FIXTURES: dict[str, TinyLFM2] = {"lfm2_f32": LFM2}
WRITERS[TinyLFM2] = write_tiny_lfm2
FIXTURES.update(LFM2_FIXTURES)
