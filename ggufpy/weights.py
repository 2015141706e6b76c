"""Model weights: memory-mapped, still-quantized tensors named as in the GGUF file.

Nothing here dequantizes eagerly. A `QuantTensor` is a view on the file's bytes plus its type and shape;
the backend decides how to multiply by it. Attribute names are the GGUF tensor names (`attn_q`,
`ffn_gate`, `output_norm`...), so the mapping from file to model needs no table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .constants import GGMLType
from .errors import GGUFMetadataError, GGUFUnsupportedError
from .quants import QUANT_TYPES, dequantize, quant_type
from .quants.vecdot import VEC_DOT_TYPE
from .reader import GGUFFile


@dataclass(frozen=True, eq=False)
class QuantTensor:
    """A tensor as stored: `raw` is a read-only uint8 view into the memory map."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]  # NumPy order: a linear layer's weight is (out_features, in_features)
    raw: np.ndarray

    @property
    def row_bytes(self) -> int:
        q = quant_type(self.type)
        return self.shape[-1] // q.block_size * q.type_size

    def dequantize(self) -> np.ndarray:
        """The whole tensor as float32 (a new array of `prod(shape)` floats)."""
        return dequantize(self.raw, self.type, self.shape)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantize only the rows `ids` of a 2-D tensor (llama.cpp's `get_rows`, used for embeddings)."""
        n_rows, row_len = self.shape
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            bad = ids[(ids < 0) | (ids >= n_rows)][0]
            raise IndexError(f"token id {bad} is outside the vocabulary [0, {n_rows}) of {self.name}")
        blocks = self.raw.reshape(n_rows, self.row_bytes)[ids]  # (T, row_bytes)
        return dequantize(blocks.reshape(-1), self.type, (len(ids), row_len))


@dataclass(frozen=True, eq=False)
class ExpertTensor:
    """A stack of expert matrices as stored (`ffn_gate_exps`, ...): GGUF dims (in, out, n_experts), NumPy shape
    (X, out, in). Each expert is a 2-D `QuantTensor` over its rows of the mapped blob, made once at load (a
    view: nothing is read, copied or dequantized), so backends cache per expert, by identity, only the experts
    a token is routed to."""

    name: str
    type: GGMLType
    shape: tuple[int, int, int]  # (X, out, in)
    experts: tuple[QuantTensor, ...]
    bias: np.ndarray | None = None  # (X, out) f32: expert e's output bias (gpt-oss), added as ggml_add_id does

    @classmethod
    def view(
        cls, name: str, type: GGMLType, shape: tuple[int, int, int], raw: np.ndarray, bias: np.ndarray | None = None
    ) -> ExpertTensor:
        per_expert = raw.reshape(shape[0], -1)  # (X, out * row_bytes): experts are contiguous, outermost
        experts = tuple(QuantTensor(f"{name}[{e}]", type, shape[1:], per_expert[e]) for e in range(shape[0]))
        return cls(name, type, shape, experts, bias)

    def expert(self, e: int) -> QuantTensor:
        return self.experts[e]


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One transformer block. Shapes use D = dim, Q = n_heads*head_dim, K = n_kv_heads*head_dim, F = hidden_dim."""

    attn_norm: np.ndarray | None  # (D,) float32; None without pre-norms (olmo2)
    attn_q: QuantTensor | None  # (Q, D); None when fused into attn_qkv (phi3)
    attn_k: QuantTensor | None  # (K, D)
    attn_v: QuantTensor | None  # (K, D)
    attn_output: QuantTensor  # (D, Q)
    ffn_norm: np.ndarray | None  # (D,)
    ffn_gate: QuantTensor | None = None  # (F, D); None in a mixture-of-experts layer, or fused into ffn_up
    ffn_up: QuantTensor | None = None  # (F, D); (2F, D), gate rows first, with `arch.fused_gate_up` (phi3)
    ffn_down: QuantTensor | None = None  # (D, F)
    # present only where the ArchSpec asks for them
    attn_q_bias: np.ndarray | None = None  # (Q,)  qwen2
    attn_k_bias: np.ndarray | None = None  # (K,)
    attn_v_bias: np.ndarray | None = None  # (K,)
    attn_q_norm: np.ndarray | None = None  # (E,)  qwen3, gemma3; (Q,) over all heads (olmo2)
    attn_k_norm: np.ndarray | None = None  # (E,); (K,) (olmo2)
    post_attention_norm: np.ndarray | None = None  # (D,)  gemma2/3, olmo2
    attn_sinks: np.ndarray | None = None  # (H,)  gpt-oss: each head's sink logit
    attn_output_bias: np.ndarray | None = None  # (D,)  gpt-oss
    post_ffw_norm: np.ndarray | None = None  # (D,)
    attn_qkv: QuantTensor | None = None  # (Q+2K, D)  phi3: the Q, K and V rows stacked
    # mixture of experts (`arch.moe`; `ggufpy.moe`): X = n_experts, Fe = expert_hidden_dim, Fs = shared_hidden_dim
    ffn_gate_inp: QuantTensor | None = None  # (X, D) the router
    ffn_gate_inp_bias: np.ndarray | None = None  # (X,) gpt-oss
    ffn_exp_probs_b: np.ndarray | None = None  # (X,) deepseek2: added to the probabilities for the choice only
    ffn_gate_exps: ExpertTensor | None = None  # (X, Fe, D)
    ffn_up_exps: ExpertTensor | None = None  # (X, Fe, D)
    ffn_down_exps: ExpertTensor | None = None  # (X, D, Fe)
    ffn_gate_inp_shexp: QuantTensor | None = None  # (1, D) the shared expert's gate (qwen2moe), stored (D,)
    ffn_gate_shexp: QuantTensor | None = None  # (Fs, D)
    ffn_up_shexp: QuantTensor | None = None  # (Fs, D)
    ffn_down_shexp: QuantTensor | None = None  # (D, Fs)
    # a hybrid model's mixer (`arch.mixer == "hybrid"`): DeltaNetWeights or GatedAttentionWeights (`ggufpy.hybrid`),
    # ShortConvWeights (lfm2's short-conv layers; its attention layers have none)
    mixer: object | None = None


@dataclass(frozen=True, eq=False)
class Weights:
    token_embd: QuantTensor  # (V, D)
    layers: dict[int, LayerWeights]  # by global layer index; a shard holds only its own layers
    output_norm: np.ndarray | None  # (D,)
    output: QuantTensor | None  # (V, D); token_embd itself when the head is tied
    # (rope_dim/2,) frequency factors dividing each rotation frequency: Llama 3's rope_freqs, or LongRoPE's
    # rope_factors_long / _short as `ModelConfig.long_factors` picks them (phi3)
    rope_freqs: np.ndarray | None


def tensor(f: GGUFFile, name: str, shape: tuple[int, ...]) -> QuantTensor:
    """The tensor `name`, checked against the shape the config implies and against the types ggufpy decodes."""
    if name not in f.tensors:
        raise GGUFMetadataError(f"{f.path}: tensor {name!r} is required but missing")
    info = f.tensors[name]
    # llama.cpp `check_tensor_dims` compares all four ne, missing dims counting as 1: (1, D) passes for (D,)
    # (convert_hf_to_gguf stores qwen2moe's ffn_gate_inp_shexp as (1, D))
    if (1,) * (4 - len(info.shape)) + tuple(info.shape) != (1,) * (4 - len(shape)) + tuple(shape):
        raise GGUFMetadataError(f"{f.path}: tensor {name!r} has shape {info.shape}, expected {shape} from the metadata")
    if info.type not in QUANT_TYPES:
        raise _unsupported(f, name, info.type, "ggufpy cannot decode", QUANT_TYPES)
    return QuantTensor(name, info.type, shape, f.raw(name))


def _unsupported(f: GGUFFile, name: str, t: GGMLType | int, why: str, types) -> GGUFUnsupportedError:
    kind = t.name if isinstance(t, GGMLType) else f"type id {int(t)}"
    supported = ", ".join(GGMLType(x).name for x in sorted(types))
    return GGUFUnsupportedError(f"{f.path}: tensor {name!r} is {kind}, which {why}; supported types: {supported}")


def _numpy_types(quantize_activations: bool) -> frozenset[GGMLType]:
    # llama.cpp's integer path exists only for the types ggml gives a vec_dot (not the activation formats)
    types = frozenset(QUANT_TYPES)
    return types & VEC_DOT_TYPE.keys() if quantize_activations else types


def _numba_types(quantize_activations: bool) -> frozenset[GGMLType]:
    from .kernels.backend import linear_types  # imported only for the numba backend, which has imported it

    return linear_types(quantize_activations) & QUANT_TYPES.keys()


# backend name -> the weight types its `linear` multiplies by, derived from the registries it dispatches on
LINEAR_TYPES = {"numpy": _numpy_types, "numba": _numba_types}


def check_linear_types(f: GGUFFile, weights: Weights, backend: str, quantize_activations: bool) -> None:
    """Refuse at load, with the same error class on every backend, a weight the backend cannot multiply by
    (otherwise the first forward pass fails, differently per backend)."""
    types = LINEAR_TYPES[backend](quantize_activations)
    matrices = [w for layer in weights.layers.values() for w in vars(layer).values() if isinstance(w, QuantTensor)]
    stacks = [w for layer in weights.layers.values() for w in vars(layer).values() if isinstance(w, ExpertTensor)]
    matrices += [w.experts[0] for w in stacks]  # the experts of a stack share its type
    mixers = [layer.mixer for layer in weights.layers.values() if layer.mixer is not None]  # hybrid models
    matrices += [w for m in mixers for w in vars(m).values() if isinstance(w, QuantTensor)]
    if weights.output is not None:
        matrices.append(weights.output)
    for w in matrices:
        if w.type not in types:
            raise _unsupported(f, w.name, w.type, f"the {backend} backend cannot multiply by", types)


def vector(f: GGUFFile, name: str, size: int) -> np.ndarray:
    """A small 1-D tensor (norm weights, frequency factors), dequantized once."""
    return tensor(f, name, (size,)).dequantize()


def load_weights(f: GGUFFile, cfg: ModelConfig, layers: range) -> Weights:
    """Map the tensors of `layers` (plus embeddings and head) without reading their data."""
    D, Q, K, F, V = cfg.dim, cfg.q_dim, cfg.kv_dim, cfg.hidden_dim, cfg.vocab_size
    arch = cfg.arch
    if arch.mixer == "gemma4":  # every layer with its own shapes, plus the per-layer embeddings (`ggufpy.gemma4`)
        from .gemma4 import load_weights as load_gemma4

        return load_gemma4(f, cfg, layers)
    blocks = {}
    for i in layers:
        if arch.mixer == "hybrid":  # qwen35: each layer's mixer tensors by its kind (`ggufpy.hybrid`)
            from .hybrid import load_layer

            blocks[i] = load_layer(f, cfg, i)
            continue
        if arch.mixer == "mla":  # deepseek2: the latent attention's tensors (`ggufpy.mla`)
            from .mla import load_layer as load_mla_layer

            blocks[i] = load_mla_layer(f, cfg, i)
            continue
        p = f"blk.{i}."
        extra = {}
        if arch.fused_qkv and p + "attn_qkv.weight" in f.tensors:  # llama.cpp `create_tensor_qkv`: either form
            extra.update(attn_qkv=tensor(f, p + "attn_qkv.weight", (Q + 2 * K, D)), attn_q=None, attn_k=None)
            extra.update(attn_v=None)
        else:
            extra.update(attn_q=tensor(f, p + "attn_q.weight", (Q, D)), attn_k=tensor(f, p + "attn_k.weight", (K, D)))
            extra.update(attn_v=tensor(f, p + "attn_v.weight", (K, D)))
        if arch.qkv_bias:
            extra.update(
                attn_q_bias=vector(f, p + "attn_q.bias", Q),
                attn_k_bias=vector(f, p + "attn_k.bias", K),
                attn_v_bias=vector(f, p + "attn_v.bias", K),
            )
        if arch.qk_norm and (not arch.qk_norm_optional or p + "attn_q_norm.weight" in f.tensors):
            q_len, k_len = (Q, K) if arch.qk_norm_span == "all" else (cfg.head_dim, cfg.head_dim)
            extra.update(
                attn_q_norm=vector(f, p + "attn_q_norm.weight", q_len),
                attn_k_norm=vector(f, p + "attn_k_norm.weight", k_len),
            )
        if arch.attn_sinks:
            extra.update(attn_sinks=vector(f, p + "attn_sinks.weight", cfg.n_heads))
        if arch.attn_output_bias:
            extra.update(attn_output_bias=vector(f, p + "attn_output.bias", D))
        if arch.post_norms:
            extra.update(
                post_attention_norm=vector(f, p + "post_attention_norm.weight", D),
                post_ffw_norm=vector(f, p + "post_ffw_norm.weight", D),
            )
        if cfg.is_moe_layer(i):  # every layer of an MoE architecture but llama4's dense ones
            extra.update(expert_tensors(f, cfg, p))
        elif arch.fused_gate_up:
            extra.update(
                ffn_up=tensor(f, p + "ffn_up.weight", (2 * F, D)), ffn_down=tensor(f, p + "ffn_down.weight", (D, F))
            )
        else:
            extra.update(
                ffn_gate=tensor(f, p + "ffn_gate.weight", (F, D)),
                ffn_up=tensor(f, p + "ffn_up.weight", (F, D)),
                ffn_down=tensor(f, p + "ffn_down.weight", (D, F)),
            )
        blocks[i] = LayerWeights(
            attn_norm=vector(f, p + "attn_norm.weight", D) if arch.pre_norms else None,
            attn_output=tensor(f, p + "attn_output.weight", (D, Q)),
            ffn_norm=vector(f, p + arch.ffn_norm_name + ".weight", D) if arch.pre_norms and not arch.parallel else None,
            **extra,
        )
    token_embd = tensor(f, "token_embd.weight", (V, D))
    output = None
    if "output.weight" in f.tensors:
        output = tensor(f, "output.weight", (V, D))
    elif cfg.arch.tied_output:
        output = token_embd
    factors = "rope_freqs.weight"
    if arch.longrope and factors not in f.tensors:  # llama.cpp `get_rope_factors`: rope_freqs first
        factors = "rope_factors_long.weight" if cfg.long_factors() else "rope_factors_short.weight"
    rope_freqs = vector(f, factors, cfg.rope_dim // 2) if factors in f.tensors else None
    return Weights(
        token_embd=token_embd,
        layers=blocks,
        output_norm=vector(f, arch.output_norm_name + ".weight", D),
        output=output,
        rope_freqs=rope_freqs,
    )


def expert_tensors(f: GGUFFile, cfg: ModelConfig, p: str) -> dict[str, QuantTensor | ExpertTensor | np.ndarray]:
    """The router, the stacked experts and the shared expert of one mixture-of-experts layer (prefix `p`), with
    the tensor names and shapes of llama.cpp's loaders (src/models/qwen3moe.cpp, qwen2moe.cpp, openai-moe.cpp)."""
    D, X, Fe, Fs = cfg.dim, cfg.n_experts, cfg.expert_hidden_dim, cfg.shared_hidden_dim
    moe = cfg.arch.moe
    out: dict[str, QuantTensor | ExpertTensor | np.ndarray] = {}
    out["ffn_gate_inp"] = tensor(f, p + "ffn_gate_inp.weight", (X, D))
    if moe.biases:
        out["ffn_gate_inp_bias"] = vector(f, p + "ffn_gate_inp.bias", X)
    if moe.probs_bias and p + "exp_probs_b.bias" in f.tensors:  # glm4moe (deepseek2's: `mla.load_layer`)
        out["ffn_exp_probs_b"] = vector(f, p + "exp_probs_b.bias", X)
    for name, shape in (("ffn_gate_exps", (X, Fe, D)), ("ffn_up_exps", (X, Fe, D)), ("ffn_down_exps", (X, D, Fe))):
        t = tensor(f, p + name + ".weight", shape)
        bias = tensor(f, p + name + ".bias", shape[:2]).dequantize() if moe.biases else None  # (X, out)
        out[name] = ExpertTensor.view(t.name, t.type, shape, t.raw, bias)
    if Fs:  # a shared expert (`MoE.shared_expert`; the config sets Fs to 0 where there is none)
        for name, shape in (("ffn_gate_shexp", (Fs, D)), ("ffn_up_shexp", (Fs, D)), ("ffn_down_shexp", (D, Fs))):
            out[name] = tensor(f, p + name + ".weight", shape)
    if moe.shared_gate is not None:  # stored (D,): held as the one-row matrix llama.cpp multiplies by (`build_lora_mm`)
        g = tensor(f, p + "ffn_gate_inp_shexp.weight", (D,))
        out["ffn_gate_inp_shexp"] = QuantTensor(g.name, g.type, (1, D), g.raw)
    return out
