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
class LayerWeights:
    """One transformer block. Shapes use D = dim, Q = n_heads*head_dim, K = n_kv_heads*head_dim, F = hidden_dim."""

    attn_norm: np.ndarray  # (D,) float32
    attn_q: QuantTensor  # (Q, D)
    attn_k: QuantTensor  # (K, D)
    attn_v: QuantTensor  # (K, D)
    attn_output: QuantTensor  # (D, Q)
    ffn_norm: np.ndarray  # (D,)
    ffn_gate: QuantTensor  # (F, D)
    ffn_up: QuantTensor  # (F, D)
    ffn_down: QuantTensor  # (D, F)
    # present only where the ArchSpec asks for them
    attn_q_bias: np.ndarray | None = None  # (Q,)  qwen2
    attn_k_bias: np.ndarray | None = None  # (K,)
    attn_v_bias: np.ndarray | None = None  # (K,)
    attn_q_norm: np.ndarray | None = None  # (E,)  qwen3, gemma3
    attn_k_norm: np.ndarray | None = None  # (E,)
    post_attention_norm: np.ndarray | None = None  # (D,)  gemma2/3
    post_ffw_norm: np.ndarray | None = None  # (D,)


@dataclass(frozen=True, eq=False)
class Weights:
    token_embd: QuantTensor  # (V, D)
    layers: dict[int, LayerWeights]  # by global layer index; a shard holds only its own layers
    output_norm: np.ndarray | None  # (D,)
    output: QuantTensor | None  # (V, D); token_embd itself when the head is tied
    rope_freqs: np.ndarray | None  # (rope_dim/2,) Llama 3 frequency factors, divides each rotation frequency


def tensor(f: GGUFFile, name: str, shape: tuple[int, ...]) -> QuantTensor:
    """The tensor `name`, checked against the shape the config implies and against the types ggufpy decodes."""
    if name not in f.tensors:
        raise GGUFMetadataError(f"{f.path}: tensor {name!r} is required but missing")
    info = f.tensors[name]
    if info.shape != shape:
        raise GGUFMetadataError(f"{f.path}: tensor {name!r} has shape {info.shape}, expected {shape} from the metadata")
    if info.type not in QUANT_TYPES:
        raise _unsupported(f, name, info.type, "ggufpy cannot decode", QUANT_TYPES)
    return QuantTensor(name, info.type, info.shape, f.raw(name))


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
    blocks = {}
    for i in layers:
        p = f"blk.{i}."
        extra = {}
        if arch.qkv_bias:
            extra.update(
                attn_q_bias=vector(f, p + "attn_q.bias", Q),
                attn_k_bias=vector(f, p + "attn_k.bias", K),
                attn_v_bias=vector(f, p + "attn_v.bias", K),
            )
        if arch.qk_norm:
            E = cfg.head_dim
            extra.update(
                attn_q_norm=vector(f, p + "attn_q_norm.weight", E), attn_k_norm=vector(f, p + "attn_k_norm.weight", E)
            )
        if arch.post_norms:
            extra.update(
                post_attention_norm=vector(f, p + "post_attention_norm.weight", D),
                post_ffw_norm=vector(f, p + "post_ffw_norm.weight", D),
            )
        blocks[i] = LayerWeights(
            attn_norm=vector(f, p + "attn_norm.weight", D),
            attn_q=tensor(f, p + "attn_q.weight", (Q, D)),
            attn_k=tensor(f, p + "attn_k.weight", (K, D)),
            attn_v=tensor(f, p + "attn_v.weight", (K, D)),
            attn_output=tensor(f, p + "attn_output.weight", (D, Q)),
            ffn_norm=vector(f, p + "ffn_norm.weight", D),
            ffn_gate=tensor(f, p + "ffn_gate.weight", (F, D)),
            ffn_up=tensor(f, p + "ffn_up.weight", (F, D)),
            ffn_down=tensor(f, p + "ffn_down.weight", (D, F)),
            **extra,
        )
    token_embd = tensor(f, "token_embd.weight", (V, D))
    output = None
    if "output.weight" in f.tensors:
        output = tensor(f, "output.weight", (V, D))
    elif cfg.arch.tied_output:
        output = token_embd
    rope_freqs = vector(f, "rope_freqs.weight", cfg.rope_dim // 2) if "rope_freqs.weight" in f.tensors else None
    return Weights(
        token_embd=token_embd,
        layers=blocks,
        output_norm=vector(f, "output_norm.weight", D),
        output=output,
        rope_freqs=rope_freqs,
    )
