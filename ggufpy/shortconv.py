"""LFM2's short-conv mixer (Liquid LFM2-350M / 700M / 1.2B / 2.6B): a gated causal convolution in place of
attention on most layers, as pure functions.

An LFM2 block is the usual pre-norm block (llama.cpp `src/models/lfm2.cpp`): h + mixer(attn_norm(h)), then
h + ffn(ffn_norm(h)). The mixer is attention with per-head Q/K norms and neox RoPE on the layers whose
`attention.head_count_kv` entry is non-zero (the transformer's own `Model.attention`), and on the others, whose
entry is 0 (llama.cpp `load_arch_hparams`: `is_recr = n_head_kv(il) == 0`), the short conv (`build_shortconv_block`):

    b, c, x = split(x @ shortconv.in_proj, 3)             (T, D) each
    y = c * conv1d(concat(state, b * x), shortconv.conv)  the causal depthwise conv over the last L positions
    out = y @ shortconv.out_proj

The state of a short-conv layer is the last L-1 gated inputs b * x (llama.cpp's recurrent memory, `r_l`; there
is no `s_l`), L = `shortconv.l_cache`. The final norm is stored as `token_embd_norm` (llama-arch.cpp
`LLM_TENSOR_OUTPUT_NORM_LFM2`, "fix for wrong tensor name"); the head is tied unless the file has `output`.

Shape letters (besides ops.py's T, D): L the conv's taps (shortconv.l_cache).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import schema
from .deltanet import conv1d
from .errors import GGUFUnsupportedError
from .quants.x86.simd import fma

if TYPE_CHECKING:
    from .backend import Backend
    from .config import ModelConfig
    from .numerics import Numerics
    from .weights import LayerWeights, QuantTensor

# llama.cpp asserts n_shortconv_l_cache > 1 (`build_shortconv_block`: d_conv = l_cache - 1 positions of state)
L_CACHE = schema.Key(
    "{arch}.shortconv.l_cache", "integer", schema.Rule("an integer > 1", lambda v: v > 1), required=True
)
HEAD_COUNT_KV = "{arch}.attention.head_count_kv"  # one entry per layer: 0 marks a short-conv layer
SLIDING_WINDOW = "{arch}.attention.sliding_window"
_COUNTS = schema.Rule("an array of integers >= 0", lambda v: len(v) == 0 or int(np.min(v)) >= 0)


@dataclass(frozen=True)
class ShortConvConfig:
    """The short-conv layers of an LFM2 model (`ModelConfig.recurrent`, the hybrid models' recurrent-layer config)."""

    l_cache: int  # L: taps of the causal conv; the state keeps the last L-1 inputs
    dim: int  # D: the conv's channels
    recurrent: tuple[bool, ...]  # per layer: a short-conv layer (True) or an attention layer


def scalar_metadata(md: Mapping[str, Any], arch: str, source: str | None = None) -> dict[str, Any]:
    """The metadata with the per-layer `head_count_kv` array replaced by the attention layers' count (the one
    `ModelConfig.n_kv_heads` holds); llama.cpp reads it with `get_key_or_arr`. Attention layers of different
    KV head counts are refused (`HybridState` keeps one KV shape)."""
    name = HEAD_COUNT_KV.replace("{arch}", arch)
    value = md.get(name)
    if not isinstance(value, (list, np.ndarray)):
        return dict(md)
    array = schema.read(md, schema.Key(HEAD_COUNT_KV, "integer array", _COUNTS), arch=arch, source=source)
    counts = {int(n) for n in array} - {0}
    if len(counts) > 1:
        raise schema.fail(name, value, "must give every attention layer the same KV head count", source)
    out = dict(md)
    if counts:
        out[name] = counts.pop()
    else:  # short-conv layers only: n_kv_heads defaults to head_count and is never used
        del out[name]
    return out


def shortconv_config(md: Mapping[str, Any], arch: str, n_layers: int, norm_eps: float, source=None):
    """The short-conv hyperparameters (llama.cpp `llama_model_lfm2::load_arch_hparams`): shortconv.l_cache, and
    which layers are short-conv ones (head_count_kv 0; a single number applies to every layer). `norm_eps` is
    unused (the signature of the hybrid configs' builders, `config.RECURRENT_CONFIGS`)."""
    del norm_eps
    name = HEAD_COUNT_KV.replace("{arch}", arch)
    value = md.get(name, 1)
    if isinstance(value, (list, np.ndarray)):
        counts = schema.read(md, schema.Key(HEAD_COUNT_KV, "integer array", _COUNTS), arch=arch, source=source)
        if len(counts) != n_layers:
            raise schema.fail(name, value, f"must have one entry per layer ({n_layers})", source)
    else:
        counts = [value] * n_layers
    window = md.get(SLIDING_WINDOW.replace("{arch}", arch), 0)
    if window:  # llama.cpp's iswa graph: sliding-window attention on the attention layers
        raise GGUFUnsupportedError(
            f"{source or 'model'}: {SLIDING_WINDOW.replace('{arch}', arch)} = {window}: sliding-window "
            f"attention is not supported for {arch}"
        )
    dim = schema.read(md, schema.MODEL_KEYS["dim"], arch=arch, source=source)
    l_cache = schema.read(md, L_CACHE, arch=arch, source=source)
    return ShortConvConfig(l_cache=l_cache, dim=dim, recurrent=tuple(int(n) == 0 for n in counts))


def empty_state(cfg: ShortConvConfig) -> tuple[np.ndarray, np.ndarray]:
    """A fresh sequence's (conv state (L-1, D), no recurrent state (0,)): zeros, as llama.cpp clears `r_l`."""
    return np.zeros((cfg.l_cache - 1, cfg.dim), np.float32), np.zeros(0, np.float32)


# -- weights -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ShortConvWeights:
    """The mixer tensors of one short-conv layer, named as in the GGUF file."""

    shortconv_in_proj: QuantTensor  # (3*D, D): b, c, x rows in that order
    shortconv_conv: np.ndarray  # (D, L) f32: GGUF dims {L, D}
    shortconv_out_proj: QuantTensor  # (D, D)


def load_layer(f, cfg: ModelConfig, i: int) -> LayerWeights:
    """Layer i of an lfm2 file (llama.cpp `llama_model_lfm2::load_arch_tensors`): attn_norm, ffn_norm and the
    dense feed-forward on every layer; the short conv's tensors in `mixer` on the short-conv layers, attention's
    (Q/K/V/output, per-head Q/K norms) on the others, where the transformer's attention reads them."""
    from .weights import LayerWeights, tensor, vector

    D, F, E, p = cfg.dim, cfg.hidden_dim, cfg.head_dim, f"blk.{i}."
    sc: ShortConvConfig = cfg.recurrent
    if sc.recurrent[i]:
        mixer = ShortConvWeights(
            shortconv_in_proj=tensor(f, p + "shortconv.in_proj.weight", (3 * D, D)),
            shortconv_conv=tensor(f, p + "shortconv.conv.weight", (D, sc.l_cache)).dequantize(),
            shortconv_out_proj=tensor(f, p + "shortconv.out_proj.weight", (D, D)),
        )
        attn = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output"))
    else:
        mixer, Q, K = None, cfg.q_dim, cfg.kv_dim
        shapes = {"attn_q": (Q, D), "attn_k": (K, D), "attn_v": (K, D), "attn_output": (D, Q)}
        attn = {name: tensor(f, p + name + ".weight", shape) for name, shape in shapes.items()}
        attn.update(
            attn_q_norm=vector(f, p + "attn_q_norm.weight", E), attn_k_norm=vector(f, p + "attn_k_norm.weight", E)
        )
    shapes = {"ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
    ffn = {name: tensor(f, p + name + ".weight", shape) for name, shape in shapes.items()}
    return LayerWeights(
        attn_norm=vector(f, p + "attn_norm.weight", D),
        ffn_norm=vector(f, p + "ffn_norm.weight", D),
        mixer=mixer,
        **attn,
        **ffn,
    )


# -- the conv: float32, or ggml's x86 build -------------------------------------------------------------------


def ssm_conv_ggml(conv_input: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`deltanet.conv1d` as ggml's x86 builds compute it: ggml-cpu/ops.cpp `ssm_conv_f32`'s `sumf += s[i0] * c[i0]`
    over the L taps, which g++ vectorizes in groups of 4 taps as an in-order reduction (the 4 products rounded,
    then added one by one) and whose scalar tail, the last L % 4 taps, it contracts to FMAs. (L-1+T, D), (D, L)
    -> (T, D). Checked against llama.cpp's `conv.conv` for L = 2..9, 12, 16, 17 (AVX2 build): LFM2's L = 3 is
    an FMA chain from 0; qwen35's K = 4 has no FMA (`deltanet.conv1d`)."""
    L = w.shape[1]
    T = conv_input.shape[0] - (L - 1)
    body = L - L % 4
    out = np.zeros((T, w.shape[0]), np.float32)
    for k in range(body):
        out = out + conv_input[k : k + T] * w[:, k]
    for k in range(body, L):
        out = fma(conv_input[k : k + T], w[:, k], out)
    return out


def conv_for(numerics: Numerics):
    """The conv of a numerics mode: ggml's order in the llamacpp modes (`numerics.x86_kernels`), float32 taps
    summed one by one in the exact mode."""
    return ssm_conv_ggml if numerics.x86_kernels else conv1d


# -- the mixer -----------------------------------------------------------------------------------------------


def shortconv(
    x: np.ndarray,
    w: ShortConvWeights,
    conv_state: np.ndarray,
    backend: Backend,
    conv=conv1d,
    trace: dict | None = None,
    layer: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The short-conv mixer on x (T, D) = the normed residual stream, continuing from the sequence's conv state
    (L-1, D). Returns (out (T, D), new conv state (L-1, D)); the inputs are not modified. Every step is f32
    elementwise but the products and the `conv` (`conv_for` the numerics mode). `trace` receives llama.cpp's
    tensor names (`model.layers.{}.conv.in_proj-N`...)."""
    T, D = x.shape

    def record(name: str, value: np.ndarray) -> None:
        if trace is not None:
            trace[f"model.layers.{{}}.conv.{name}-{layer}"] = value.copy()

    bcx = backend.linear(x, w.shortconv_in_proj)  # (T, 3D)
    record("in_proj", bcx)
    b, c, xs = bcx[:, :D], bcx[:, D : 2 * D], bcx[:, 2 * D :]  # (T, D) each: ggml_view_3d at 0, D, 2D
    conv_input = np.concatenate([conv_state, b * xs])  # (L-1+T, D): the previous L-1 inputs first
    new_state = conv_input[T:].copy()  # (L-1, D)
    conv = conv(conv_input, w.shortconv_conv)  # (T, D)
    record("conv", conv)
    out = backend.linear(c * conv, w.shortconv_out_proj)  # (T, D)
    record("out_proj", out)
    return out, new_state
