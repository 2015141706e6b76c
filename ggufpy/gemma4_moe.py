"""Gemma 4's mixture of experts (26B-A4B, llama.cpp `src/models/gemma4.cpp`): a layer with a router runs its dense
MLP as a shared expert beside the routed ones,

    post_ffw_norm_1(mlp(ffn_norm(h))) + post_ffw_norm_2(experts(pre_ffw_norm_2(h)))

on h, the block's input to the feed-forward. The router reads rms_norm(h) / sqrt(D) * `ffn_gate_inp.scale` (its
own input, not the experts'); softmax gating, the chosen weights normalised (build_moe_ffn's norm_w), GEGLU
experts with gate and up fused in `ffn_gate_up_exps` or apart, each expert's output times `ffn_down_exps.scale`
(the converter's router.per_expert_scale). Routing and the expert products are `ggufpy.moe`'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import moe
from .arch import MoE
from .errors import GGUFMetadataError
from .weights import ExpertTensor, QuantTensor, tensor, vector

if TYPE_CHECKING:
    from .config import ModelConfig
    from .gemma4 import Gemma4LayerWeights
    from .transformer import Model

ROUTING = MoE(norm_weights=True)  # build_moe_ffn(..., LLM_FFN_GELU, norm_w true, w_scale 1, softmax)


@dataclass(frozen=True, eq=False)
class Gemma4Experts:
    """The routed experts of a Gemma 4 layer (X experts of width Fe) and the norms around them."""

    ffn_gate_inp: QuantTensor  # (X, D) the router
    ffn_gate_inp_scale: np.ndarray  # (D,) times the router's input
    ffn_gate_up_exps: ExpertTensor | None  # (X, 2Fe, D): gate rows, then up rows; or:
    ffn_gate_exps: ExpertTensor | None  # (X, Fe, D)
    ffn_up_exps: ExpertTensor | None  # (X, Fe, D)
    ffn_down_exps: ExpertTensor  # (X, D, Fe)
    ffn_down_exps_scale: np.ndarray | None  # (X,) each expert's output times it (router.per_expert_scale)
    pre_ffw_norm_2: np.ndarray  # (D,) the experts' input norm
    post_ffw_norm_1: np.ndarray  # (D,) the shared MLP's output norm
    post_ffw_norm_2: np.ndarray  # (D,) the experts' output norm


def load_experts(f, cfg: ModelConfig, p: str) -> Gemma4Experts:
    """The router and experts of the layer with prefix `p` (gemma4.cpp: `ffn_gate_up_exps` or gate and up)."""
    g, D = cfg.gemma4, cfg.dim
    X, Fe = g.n_experts, g.expert_hidden_dim
    if not X:
        raise GGUFMetadataError(f"{f.path}: tensor {p}ffn_gate_inp.weight needs {cfg.arch.name}.expert_count > 1")

    def stack(name: str, shape: tuple[int, int, int]) -> ExpertTensor:
        t = tensor(f, p + name + ".weight", shape)
        return ExpertTensor.view(t.name, t.type, shape, t.raw)

    fused = p + "ffn_gate_up_exps.weight" in f.tensors
    down_scale = p + "ffn_down_exps.scale"
    return Gemma4Experts(
        ffn_gate_inp=tensor(f, p + "ffn_gate_inp.weight", (X, D)),
        ffn_gate_inp_scale=vector(f, p + "ffn_gate_inp.scale", D),
        ffn_gate_up_exps=stack("ffn_gate_up_exps", (X, 2 * Fe, D)) if fused else None,
        ffn_gate_exps=None if fused else stack("ffn_gate_exps", (X, Fe, D)),
        ffn_up_exps=None if fused else stack("ffn_up_exps", (X, Fe, D)),
        ffn_down_exps=stack("ffn_down_exps", (X, D, Fe)),
        ffn_down_exps_scale=vector(f, down_scale, X) if down_scale in f.tensors else None,
        pre_ffw_norm_2=vector(f, p + "pre_ffw_norm_2.weight", D),
        post_ffw_norm_1=vector(f, p + "post_ffw_norm_1.weight", D),
        post_ffw_norm_2=vector(f, p + "post_ffw_norm_2.weight", D),
    )


def add_experts(model: Model, mlp: np.ndarray, h: np.ndarray, w: Gemma4LayerWeights, rows: bool) -> np.ndarray:
    """A layer with experts: its dense MLP's output `mlp` (N, D) joined by the routed experts' on h (N, D), the
    block's input to the feed-forward (gemma4.cpp's `attn_out`); others: `mlp` as it is."""
    e = w.experts
    if e is None:
        return mlp
    eps = model.config.norm_eps
    mlp = model.rms_norm(mlp, e.post_ffw_norm_1, eps)
    if rows:  # batch-invariant: each row routed and computed alone
        routed = np.concatenate([_routed(model, h[b : b + 1], e) for b in range(len(h))])
    else:
        routed = _routed(model, h, e)
    return mlp + model.rms_norm(routed, e.post_ffw_norm_2, eps)


def _routed(model: Model, h: np.ndarray, e: Gemma4Experts) -> np.ndarray:
    """The routed experts on h (N, D): (N, D) before their output norm, in build_moe_ffn's order."""
    cfg, g, be, nm = model.config, model.config.gemma4, model.backend, model.numerics
    f32 = np.float32
    router_in = model.rms_norm(h, np.ones(cfg.dim, f32), cfg.norm_eps)  # ggml_rms_norm: x 1 is exact
    router_in = router_in * (f32(1) / np.sqrt(f32(cfg.dim))) * e.ffn_gate_inp_scale  # ggml_scale, ggml_mul
    logits = be.linear(router_in, e.ffn_gate_inp)  # (N, X)
    softmax = functools.partial(moe.softmax_ggml, isa=nm.x86_isa) if nm.x86_kernels else moe.softmax_exact
    chosen, weights = moe.route(logits, ROUTING, g.n_experts_used, softmax)  # (N, K) each
    x = model.rms_norm(h, e.pre_ffw_norm_2, cfg.norm_eps)  # (N, D)
    if e.ffn_gate_up_exps is not None:  # one product, then its gate and up halves (ggml_view_3d)
        (gate_up,) = moe.expert_products(be, x, (e.ffn_gate_up_exps,), chosen)  # (N, K, 2Fe)
        gate, up = np.split(gate_up, 2, axis=-1)
    else:
        gate, up = moe.expert_products(be, x, (e.ffn_gate_exps, e.ffn_up_exps), chosen)  # (N, K, Fe) each
    act = nm.activations[cfg.arch.activation]
    (y,) = moe.expert_products(be, moe.swiglu(gate, up, model.compiled.get(act, act)), (e.ffn_down_exps,), chosen)
    if e.ffn_down_exps_scale is not None:  # build_lora_mm_id's ggml_mul by the chosen experts' scales
        y = y * e.ffn_down_exps_scale[chosen][..., None]
    y = y * weights[..., None]  # (N, K, D)
    out = y[:, 0]
    for slot in range(1, y.shape[1]):  # ggml_add of the slots' views, one after another
        out = out + y[:, slot]
    return out
