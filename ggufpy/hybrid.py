"""Hybrid recurrent blocks (qwen35, qwen35moe, qwen3next) in the transformer: the mixer a layer runs, its
weights, its state.

A qwen35 block is the usual pre-norm block (llama.cpp `src/models/qwen35.cpp`): h + mixer(attn_norm(h)), then
h + ffn(post_attention_norm(h)); qwen35's `post_attention_norm` is the norm in front of the feed-forward, so
it is loaded as `LayerWeights.ffn_norm`. The mixer is a Gated DeltaNet (`ggufpy.deltanet`) on the recurrent
layers (`DeltaNetConfig.recurrent`), a gated attention (`ggufpy.gated_attention`) on the others; which one is
data: the type of `LayerWeights.mixer`, looked up in `MIXERS`. The sequence's state is a `HybridState`. The
feed-forward is the transformer's: dense (qwen35), or experts with a gated shared expert (qwen35moe, qwen3next).

lfm2 (`ArchSpec.recurrent == "shortconv"`) is a hybrid of the same shape: LFM2's short conv (`ggufpy.shortconv`)
on its recurrent layers, the transformer's plain attention (no `mixer`) on the others, its layers loaded by
`shortconv.load_layer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .deltanet import DeltaNetWeights, deltanet, for_numerics, load_deltanet_weights
from .gated_attention import (
    GatedAttentionWeights,
    gated_attention,
    imrope_unrotated,
    load_gated_attention_weights,
    text_angles,
)
from .shortconv import ShortConvWeights, conv_for, shortconv
from .shortconv import load_layer as load_lfm2_layer
from .state import HybridState

if TYPE_CHECKING:
    from .config import ModelConfig
    from .transformer import Model
    from .weights import LayerWeights


def load_layer(f, cfg: ModelConfig, i: int) -> LayerWeights:
    """Layer i of a hybrid file, by the kind of its recurrent layers (`LAYER_LOADERS`)."""
    return LAYER_LOADERS[cfg.arch.recurrent](f, cfg, i)


def load_qwen35_layer(f, cfg: ModelConfig, i: int) -> LayerWeights:
    """Layer i of a qwen35-family file (llama.cpp `llama_model_qwen35::load_arch_tensors`, qwen35moe's, qwen3next's):
    the mixer's tensors in `mixer`, the norms and the feed-forward (dense or experts) where the block reads them."""
    from .weights import LayerWeights, expert_tensors, tensor, vector

    D, F, p, dn = cfg.dim, cfg.hidden_dim, f"blk.{i}.", cfg.recurrent
    if dn.recurrent[i]:
        mixer = load_deltanet_weights(f, dn, D, i)
    else:
        mixer = load_gated_attention_weights(f, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, D, i)
    if cfg.arch.moe:  # qwen35moe: experts and the gated shared expert (`ggufpy.moe`)
        ffn = expert_tensors(f, cfg, p)
    else:
        shapes = {"ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
        ffn = {name: tensor(f, p + name + ".weight", shape) for name, shape in shapes.items()}
    return LayerWeights(
        attn_norm=vector(f, p + "attn_norm.weight", D),
        attn_q=None,
        attn_k=None,
        attn_v=None,
        attn_output=None,
        ffn_norm=vector(f, p + "post_attention_norm.weight", D),
        mixer=mixer,
        **ffn,
    )


# `ArchSpec.recurrent` -> the loader of a layer
LAYER_LOADERS = {"deltanet": load_qwen35_layer, "shortconv": load_lfm2_layer}


def new_state(model: Model, layers: range, capacity: int) -> HybridState:
    cfg = model.config
    return HybridState(layers, capacity, cfg.n_kv_heads, cfg.head_dim, cfg.recurrent, model.numerics.kv_dtype)


def _deltanet_mixer(model: Model, x, w: DeltaNetWeights, i: int, pos: int, state: HybridState, cos, sin, trace):
    conv, ssm = state.recurrent(i, pos)
    math = for_numerics(model.numerics)
    out, conv, ssm = deltanet(x, w, model.config.recurrent, conv, ssm, model.backend, math, model.rms_norm, trace, i)
    state.set_recurrent(i, conv, ssm)
    return out


def _gated_attention_mixer(model: Model, x, w: GatedAttentionWeights, i, pos, state: HybridState, cos, sin, trace):
    cfg, numerics = model.config, model.numerics
    cos, sin = text_angles(cos, sin, imrope_unrotated(cfg.recurrent.rope_sections, cfg.rope_dim))
    rope = model.compiled.get(numerics.rope, numerics.rope)
    # a backend may compute attention itself (numba), deferring to the numerics mode where that is not exact
    attention = getattr(model.backend, "attention", None) or numerics.attention
    sigmoid = for_numerics(numerics).sigmoid
    E = cfg.head_dim
    args = (cfg.n_heads, cfg.n_kv_heads, E, cfg.norm_eps, pos, cos, sin, state, i, model.backend, rope, attention)
    return gated_attention(x, w, *args, sigmoid, model.rms_norm, trace)


def _shortconv_mixer(model: Model, x, w: ShortConvWeights, i: int, pos: int, state: HybridState, cos, sin, trace):
    conv, none = state.recurrent(i, pos)  # lfm2: a conv state only
    out, conv = shortconv(x, w, conv, model.backend, conv_for(model.numerics), trace, i)
    state.set_recurrent(i, conv, none)
    return out


# the mixer by the type of `LayerWeights.mixer`
MIXERS = {
    DeltaNetWeights: _deltanet_mixer,
    GatedAttentionWeights: _gated_attention_mixer,
    ShortConvWeights: _shortconv_mixer,
}


def mixer(model: Model, x: np.ndarray, w: LayerWeights, i: int, seqs, cos, sin, trace=None) -> np.ndarray:
    """The mixer of hybrid layer i on x (N, D), for `seqs` = [(position, state)] each owning N / len(seqs)
    consecutive rows (the transformer's `_block` contract). Each sequence runs on its own rows, exactly as a
    forward pass of it alone, so `decode_batch` rows stay bit-identical to single decodes."""
    run = MIXERS[type(w.mixer)]
    n = x.shape[0] // len(seqs)
    out = np.empty_like(x)
    for s, (pos, state) in enumerate(seqs):
        r = slice(s * n, (s + 1) * n)
        out[r] = run(model, x[r], w.mixer, i, pos, state, cos[r], sin[r], trace)
    return out
