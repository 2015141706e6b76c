"""The Gated DeltaNet mixer of hybrid recurrent models (qwen35, qwen35moe, qwen3next), as pure functions.

A DeltaNet layer replaces attention by a short causal convolution and a recurrent state per head, a matrix
M (S, S) updated by the gated delta rule at every token (llama.cpp `src/models/qwen35.cpp`
`build_layer_attn_linear`, `src/models/delta-net-base.cpp`, ggml-cpu/ops.cpp `gated_delta_net`):

    qkv = conv1d(x @ attn_qkv) -> silu -> q, k (T, H_k, S), v (T, H_v, S);  q, k L2-normalized per head
    g    = softplus(x @ ssm_alpha + ssm_dt) * ssm_a          (T, H_v) the log decay, ssm_a = -exp(A_log) < 0
    beta = sigmoid(x @ ssm_beta)                              (T, H_v) the write strength (qwen3next: both
                                                              from one product, ssm_ba)
    per token t, head h (v head h reads k/q head h % H_k, ggml's broadcast; qwen3next: h // (H_v / H_k)):
        M = M * exp(g);  d = (v - M k) * beta;  M = M + d k^T;  o = M q / sqrt(S)
    out = (rms_norm(o) * ssm_norm * silu(x @ attn_gate)) @ ssm_out

M is kept as ggml stores it, transposed: state[h, j, i] = S[i][j], row j the j-th value dimension. A prompt
runs the same per-token recurrence as decode (llama.cpp's CPU backend runs the fused op, not the chunked
form, for prompts too), so a prompt and its token-by-token decode give identical states.

Shape letters (besides ops.py's T, D): S state_size (head size of k and v), A n_k_heads (ssm.group_count),
B n_v_heads (ssm.time_step_rank), C conv channels = 2*A*S + B*S, K conv_kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import ops, schema
from .numerics import Numerics, _libm_f32
from .quants.x86.simd import FmaAccumulator, fma, reduce_add_ps_512
from .quants.x86.unary import silu_rows
from .schema import SIZE, Key

if TYPE_CHECKING:  # config.py may import this module: the weight and backend modules import the config
    from .backend import Backend
    from .weights import QuantTensor

# -- hyperparameters -----------------------------------------------------------------------------------------

DELTANET_KEYS: dict[str, Key] = {
    "conv_kernel": Key("{arch}.ssm.conv_kernel", "integer", SIZE, required=True),
    "inner_size": Key("{arch}.ssm.inner_size", "integer", SIZE, required=True),
    "state_size": Key("{arch}.ssm.state_size", "integer", SIZE, required=True),
    "n_v_heads": Key("{arch}.ssm.time_step_rank", "integer", SIZE, required=True),
    "n_k_heads": Key("{arch}.ssm.group_count", "integer", SIZE, required=True),
    "full_attention_interval": Key("{arch}.full_attention_interval", "integer", SIZE, default=4),
    "recurrent_layers": Key("{arch}.attention.recurrent_layers", "integer array"),
    # the attention layers' IMROPE sections (pairs per t, h, w, e position): qwen35 (llama.cpp requires them);
    # none (plain NeoX RoPE) for qwen3next
    "rope_sections": Key("{arch}.rope.dimension_sections", "integer array", default=()),
}


# architectures whose v heads read their q/k heads "interleaved" (see `DeltaNetConfig.head_grouping`)
HEAD_GROUPING = {"qwen3next": "interleaved"}


@dataclass(frozen=True)
class DeltaNetConfig:
    conv_kernel: int  # K: taps of the causal conv (d_conv)
    state_size: int  # S: head size of k and v; each v head keeps an (S, S) state
    n_k_heads: int  # A: q/k heads (ssm.group_count)
    n_v_heads: int  # B: v heads (ssm.time_step_rank), a multiple of A
    norm_eps: float  # the L2 norms of q, k and the gated RMSNorm use the model's rms eps
    recurrent: tuple[bool, ...]  # per layer: a DeltaNet layer (True) or an attention layer
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)  # of the gated attention layers (`gated_attention`)
    # which q/k head a v head reads: "tiled" h % A (qwen35: ggml's broadcast in gated_delta_net) or
    # "interleaved" h // (B / A) (qwen3next repeats each k head B / A times first, src/models/qwen3next.cpp)
    head_grouping: str = "tiled"

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.state_size

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.state_size

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def deltanet_config(
    md: Mapping[str, Any], arch: str, n_layers: int, norm_eps: float, source: str | None = None
) -> DeltaNetConfig:
    """The DeltaNet hyperparameters (llama.cpp `llama_model_qwen35::load_arch_hparams`): a layer is recurrent as
    `attention.recurrent_layers` says, else unless (i + 1) % full_attention_interval == 0."""
    v = schema.read_all(md, DELTANET_KEYS, arch=arch, source=source)

    def key(field: str) -> str:
        return DELTANET_KEYS[field].name.replace("{arch}", arch)

    if v["inner_size"] != v["n_v_heads"] * v["state_size"]:
        rule = f"must be {key('n_v_heads')} * {key('state_size')} = {v['n_v_heads'] * v['state_size']}"
        raise schema.fail(key("inner_size"), v["inner_size"], rule, source)
    if v["n_v_heads"] % v["n_k_heads"]:
        raise schema.fail(key("n_k_heads"), v["n_k_heads"], f"must divide {key('n_v_heads')}", source)
    sections = tuple(int(x) for x in v["rope_sections"][:4]) + (0,) * max(0, 4 - len(v["rope_sections"]))
    if min(sections) < 0:
        raise schema.fail(key("rope_sections"), v["rope_sections"], "must hold 4 counts >= 0", source)
    if v["recurrent_layers"] is not None:
        flags = [bool(x) for x in v["recurrent_layers"]][:n_layers]
        if len(flags) < n_layers:
            rule = f"must have one entry per layer ({n_layers})"
            raise schema.fail(key("recurrent_layers"), v["recurrent_layers"], rule, source)
    else:
        n = v["full_attention_interval"]
        flags = [(i + 1) % n != 0 for i in range(n_layers)]
    return DeltaNetConfig(
        conv_kernel=v["conv_kernel"],
        state_size=v["state_size"],
        n_k_heads=v["n_k_heads"],
        n_v_heads=v["n_v_heads"],
        norm_eps=norm_eps,
        recurrent=tuple(flags),
        rope_sections=sections,
        head_grouping=HEAD_GROUPING.get(arch, "tiled"),
    )


# -- weights -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DeltaNetWeights:
    """The mixer tensors of one DeltaNet layer, named as in the GGUF file."""

    attn_qkv: QuantTensor  # (C, D)
    attn_gate: QuantTensor  # (B*S, D)  z, the output gate
    ssm_conv1d: np.ndarray  # (C, K) f32
    ssm_dt: np.ndarray  # (B,)  bias of the decay's softplus (ssm_dt.bias)
    ssm_a: np.ndarray  # (B,)  -exp(A_log)
    ssm_beta: QuantTensor | None  # (B, D); None when fused into ssm_ba
    ssm_alpha: QuantTensor | None  # (B, D)
    ssm_norm: np.ndarray  # (S,)
    ssm_out: QuantTensor  # (D, B*S)
    # qwen3next: beta and alpha from one product, per k group its B/A betas then its B/A alphas
    ssm_ba: QuantTensor | None = None  # (2*B, D)


def load_deltanet_weights(f, cfg: DeltaNetConfig, dim: int, layer: int) -> DeltaNetWeights:
    """Map layer `layer`'s DeltaNet tensors (shapes from llama.cpp `llama_model_qwen35::load_arch_tensors`)."""
    from .weights import tensor, vector

    p, B, C = f"blk.{layer}.", cfg.n_v_heads, cfg.conv_dim
    if p + "ssm_ba.weight" in f.tensors:  # qwen3next
        ba = {"ssm_beta": None, "ssm_alpha": None}
        ba["ssm_ba"] = tensor(f, p + "ssm_ba.weight", (2 * B, dim))
    else:
        ba = {"ssm_beta": tensor(f, p + "ssm_beta.weight", (B, dim))}
        ba["ssm_alpha"] = tensor(f, p + "ssm_alpha.weight", (B, dim))
    return DeltaNetWeights(
        attn_qkv=tensor(f, p + "attn_qkv.weight", (C, dim)),
        attn_gate=tensor(f, p + "attn_gate.weight", (cfg.value_dim, dim)),
        ssm_conv1d=tensor(f, p + "ssm_conv1d.weight", (C, cfg.conv_kernel)).dequantize(),
        ssm_dt=vector(f, p + "ssm_dt.bias", B),
        ssm_a=vector(f, p + "ssm_a", B),
        ssm_norm=vector(f, p + "ssm_norm.weight", cfg.state_size),
        ssm_out=tensor(f, p + "ssm_out.weight", (dim, cfg.value_dim)),
        **ba,
    )


def empty_state(cfg: DeltaNetConfig) -> tuple[np.ndarray, np.ndarray]:
    """A fresh sequence's (conv state (K-1, C), recurrent state (B, S, S)): zeros, as llama.cpp clears them."""
    S = cfg.state_size
    return np.zeros((cfg.conv_kernel - 1, cfg.conv_dim), np.float32), np.zeros((cfg.n_v_heads, S, S), np.float32)


# -- the numerics: exact float32, or ggml's CPU operations in their order --------------------------------------


@dataclass(frozen=True)
class DeltaNetMath:
    """The steps whose rounding differs between the numerics modes (`for_numerics` picks one)."""

    name: str
    expf: Callable  # f32 -> f32
    logf: Callable
    silu: Callable  # rows (..., n) -> (..., n)
    conv: Callable  # (conv_input (K-1+T, C), w (C, K)) -> (T, C)
    delta_rule: Callable  # (q, k, v, g, beta, state) -> (o (T, B, S), state)

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        """1 / (1 + exp(-x)) (unary-ops.cpp `op_sigmoid`)."""
        return np.float32(1) / (np.float32(1) + self.expf(-np.asarray(x, np.float32)))

    def softplus(self, x: np.ndarray) -> np.ndarray:
        """x > 20 ? x : log(1 + exp(x)) (unary-ops.cpp `op_softplus`; torch's threshold too)."""
        x = np.asarray(x, np.float32)
        with np.errstate(over="ignore"):
            return np.where(x > 20, x, self.logf(np.float32(1) + self.expf(np.minimum(x, np.float32(20)))))


def conv1d(conv_input: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Causal depthwise conv: out[t, c] = sum_k conv_input[t + k, c] * w[c, k]. (K-1+T, C), (C, K) -> (T, C).

    In ggml's order (ggml-cpu/ops.cpp `ssm_conv_f32`: `sumf += s[i0] * c[i0]` tap by tap from 0.0f, each product
    and sum rounded to f32: not contracted to FMAs, checked against llama.cpp's `conv_output_raw`), which is
    also the exact mode's."""
    K = w.shape[1]
    T = conv_input.shape[0] - (K - 1)
    out = np.zeros((T, w.shape[0]), np.float32)
    for k in range(K):
        out += conv_input[k : k + T] * w[:, k]
    return out


def delta_rule_exact(q, k, v, g, beta, state):
    """The gated delta rule token by token in float32. q, k (T, A, S); v (T, B, S); g, beta (T, B);
    state (B, S, S) as ggml lays it out (state[h, j, i] = S[i][j]). Returns o (T, B, S) and the new state."""
    T, B, S = v.shape
    heads = np.arange(B) % q.shape[1]  # v head h reads q/k head h % A (ggml's broadcast of q and k)
    scale = np.float32(1) / np.sqrt(np.float32(S))
    M = np.array(state, np.float32)  # (B, S, S)
    out = np.empty((T, B, S), np.float32)
    for t in range(T):
        kt, qt = k[t, heads], q[t, heads]  # (B, S)
        M *= np.exp(g[t])[:, None, None]
        d = (v[t] - np.einsum("hji,hi->hj", M, kt)) * beta[t][:, None]  # (B, S)
        M += d[:, :, None] * kt[:, None, :]
        out[t] = np.einsum("hji,hi->hj", M, qt) * scale
    return out, M


# ggml's F32 vector loops by x86 build: (lanes per register, registers per step); GGML_F32_ARR is 4 on both.
_WIDTH = {"avx512": 16, "avx2": 8}


def _reduce(acc: np.ndarray, isa: str) -> np.ndarray:
    """simd-mappings.h `GGML_F32_VEC_REDUCE`: (..., 4, W) -> (...,): x0+x2, x1+x3, then x0+x1, then the lanes
    (`_mm512_reduce_add_ps`; on AVX: low 128 + high 128 and two `_mm_hadd_ps`)."""
    x = (acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])
    if isa == "avx512":
        return reduce_add_ps_512(x)
    t = x[..., :4] + x[..., 4:]
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])


def vec_dot_f32(x: np.ndarray, y: np.ndarray, isa: str) -> np.ndarray:
    """vec.cpp `ggml_vec_dot_f32` along the last axis (x (..., n), y broadcastable): 4 FMA accumulators of W
    lanes over the first n & ~(4W-1) values, reduced, then the rest added one by one, `sumf += x[i]*y[i]` with
    the product rounded on its own (not contracted: checked against llama.cpp with S = 20, 40, 48)."""
    W = _WIDTH[isa]
    n = x.shape[-1]
    body = n & ~(4 * W - 1)
    shape = np.broadcast_shapes(x.shape, y.shape)[:-1]
    s = np.zeros(shape, np.float32)
    if body:
        acc = FmaAccumulator((*shape, 4, W))
        for i in range(0, body, 4 * W):
            acc.add(
                x[..., i : i + 4 * W].reshape(*x.shape[:-1], 4, W), y[..., i : i + 4 * W].reshape(*y.shape[:-1], 4, W)
            )
        s = _reduce(acc.acc, isa)
    for i in range(body, n):
        s = s + x[..., i] * y[..., i]
    return s


def delta_rule_ggml(q, k, v, g, beta, state, isa: str = "avx512"):
    """`delta_rule_exact` in the f32 operations of ggml-cpu/ops.cpp `gated_delta_net_one_chunk` (K=1):
    M *= expf(g) (`ggml_vec_scale_f32`); delta[j] = (v[j] - dot(M[j], k)) * beta (`ggml_vec_dot_f32`);
    M[j] = fma(k, delta[j], M[j]) (`ggml_vec_mad_f32`, whose scalar tail g++ contracts to FMAs too: checked);
    o[j] = dot(M[j], q) * (1.0f / sqrtf(S))."""
    T, B, S = v.shape
    heads = np.arange(B) % q.shape[1]
    scale = np.float32(1) / np.float32(np.sqrt(np.float32(S)))
    M = np.array(state, np.float32)  # (B, S, S)
    out = np.empty((T, B, S), np.float32)
    decay = _libm_f32("expf", np.asarray(g, np.float32))  # (T, B)
    for t in range(T):
        kt, qt = k[t, heads], q[t, heads]  # (B, S)
        M *= decay[t][:, None, None]
        d = (v[t] - vec_dot_f32(M, kt[:, None, :], isa)) * beta[t][:, None]  # (B, S)
        M = fma(kt[:, None, :], d[:, :, None], M)
        out[t] = vec_dot_f32(M, qt[:, None, :], isa) * scale
    return out, M


def _expf_libm(x):
    return _libm_f32("expf", np.asarray(x, np.float32))


def _logf_libm(x):
    return _libm_f32("logf", np.asarray(x, np.float32))


def _exp32(x):
    with np.errstate(over="ignore"):
        return np.exp(np.asarray(x, np.float32))


EXACT = DeltaNetMath("exact", _exp32, lambda x: np.log(np.asarray(x, np.float32)), ops.silu, conv1d, delta_rule_exact)


def ggml_math(isa: str = "avx512") -> DeltaNetMath:
    """ggml's CPU steps on the `isa` x86 build (`quants.x86.simd.ISAS`): the C library's expf/logf in the scalar
    unary ops (sigmoid, softplus, the decay), `ggml_vec_silu_f32`, the fused gated-delta-net loop."""

    def delta_rule(q, k, v, g, beta, state):
        return delta_rule_ggml(q, k, v, g, beta, state, isa)

    return DeltaNetMath(
        f"llamacpp-{isa}",
        _expf_libm,
        _logf_libm,
        lambda x: silu_rows(x, isa=isa),
        conv1d,
        delta_rule,
    )


def for_numerics(numerics: Numerics) -> DeltaNetMath:
    """The DeltaNet steps of a numerics mode: float32 for `exact`, ggml's for the llamacpp modes (on the
    mode's x86 build, `numerics.x86_isa`)."""
    return ggml_math(numerics.x86_isa) if numerics.x86_kernels else EXACT


# -- the mixer -----------------------------------------------------------------------------------------------


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum x^2 + eps) over the last axis, as llama.cpp builds it (`build_gdn_l2_norm`):
    rms_norm(x, eps / n) * (1 / sqrtf(n))."""
    n = np.float32(x.shape[-1])
    ones = np.ones(x.shape[-1], np.float32)
    return ops.rms_norm(x, ones, np.float32(eps) / n) * (np.float32(1) / np.sqrt(n))


def deltanet(
    x: np.ndarray,
    w: DeltaNetWeights,
    cfg: DeltaNetConfig,
    conv_state: np.ndarray,
    ssm_state: np.ndarray,
    backend: Backend,
    math: DeltaNetMath,
    rms_norm: Callable = ops.rms_norm,
    trace: dict | None = None,
    layer: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The DeltaNet mixer on x (T, D) = the normed residual stream, continuing from the sequence's conv state
    (K-1, C) and recurrent state (B, S, S). Returns (out (T, D), new conv state, new recurrent state); the
    inputs are not modified. `trace` receives llama.cpp's tensor names (`linear_attn_qkv_mixed-N`...)."""
    from .backend import linears

    T = x.shape[0]
    A, B, S = cfg.n_k_heads, cfg.n_v_heads, cfg.state_size

    def record(name: str, value: np.ndarray) -> None:
        if trace is not None:
            trace[f"{name}-{layer}"] = value.copy()

    if w.ssm_ba is None:
        qkv, z, beta, alpha = linears(backend, x, (w.attn_qkv, w.attn_gate, w.ssm_beta, w.ssm_alpha))
    else:  # qwen3next (src/models/qwen3next.cpp `build_layer_attn_linear`): views of one product
        qkv, z, ba = linears(backend, x, (w.attn_qkv, w.attn_gate, w.ssm_ba))
        ba = ba.reshape(T, A, 2, B // A)  # per k group: its betas, then its alphas
        beta, alpha = ba[:, :, 0].reshape(T, B), ba[:, :, 1].reshape(T, B)
    record("linear_attn_qkv_mixed", qkv)  # (T, C)
    record("z", z)  # (T, B*S)
    beta = math.sigmoid(beta)  # (T, B)
    record("beta_sigmoid", beta[..., None])  # (T, B, 1), llama.cpp's shape
    g = math.softplus(alpha + w.ssm_dt) * w.ssm_a  # (T, B) log decay, < 0
    record("gate", g)

    conv_input = np.concatenate([conv_state, qkv])  # (K-1+T, C): the previous K-1 inputs first
    new_conv_state = conv_input[T:].copy()  # (K-1, C)
    conv = math.conv(conv_input, w.ssm_conv1d)  # (T, C)
    record("conv_output_raw", conv)
    conv = math.silu(conv)
    record("conv_output_silu", conv)

    q = l2_norm(conv[:, : A * S].reshape(T, A, S), cfg.norm_eps)  # (T, A, S)
    k = l2_norm(conv[:, A * S : 2 * A * S].reshape(T, A, S), cfg.norm_eps)  # (T, A, S)
    v = conv[:, 2 * A * S :].reshape(T, B, S)  # (T, B, S)
    if cfg.head_grouping == "interleaved" and A != B:  # ggml_repeat_4d of each k head: (T, A, S) -> (T, B, S)
        q, k = np.repeat(q, B // A, axis=1), np.repeat(k, B // A, axis=1)
    record("q_conv_predelta", q)
    record("k_conv_predelta", k)
    record("v_conv_predelta", v)

    o, new_ssm_state = math.delta_rule(q, k, v, g, beta, ssm_state)  # (T, B, S), (B, S, S)
    record("attn_output", o)
    record("new_state", new_ssm_state)

    gated = rms_norm(o, w.ssm_norm, cfg.norm_eps) * math.silu(z.reshape(T, B, S))  # (T, B, S)
    final = gated.reshape(T, B * S)
    record("final_output", final)
    out = backend.linear(final, w.ssm_out)  # (T, D)
    record("linear_attn_out", out)
    return out, new_conv_state, new_ssm_state
