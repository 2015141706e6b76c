"""llama.cpp's quantization mixes: which ggml type each tensor of a model gets for Q4_K_M, Q3_K_S, IQ4_XS, ...

A transcription of `src/llama-quant.cpp` (`llama_tensor_get_type`, `llama_tensor_get_type_impl`,
`tensor_type_fallback`, `tensor_allows_quantization`, `tensor_requires_imatrix`, `llama_ftype_get_default_type`)
for the mixes whose types ggufpy can quantize. The choice depends on the tensor's category (from its name), its
position among the tensors of that category (the "use more bits" layers), the model's attention grouping and
expert count, whether an importance matrix is given, and falls back to a 32-block type when a row is not a
multiple of 256. The IQ1/IQ2/IQ3 grid types (and Q2_K in Q2_K_S) need an importance matrix: without one the
plan refuses, as llama-quantize does, unless it is a dry run.

    plan = TypePlan.for_model(metadata, tensor_names, "Q4_K_M")
    plan.choose(name, shape, current_type)    # called in llama.cpp's tensor order (see weight_order)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..constants import GGML_BLOCK_LAYOUT, GGMLType
from ..errors import GGUFError

__all__ = ["FTYPES", "MixOptions", "TypePlan", "category", "parse_type", "weight_order"]

T = GGMLType


@dataclass(frozen=True)
class FType:
    """One of llama.cpp's `llama_ftype` values: the number stored in general.file_type, its default type."""

    name: str
    value: int
    default: GGMLType


# llama.h `enum llama_ftype` and `llama_ftype_get_default_type`, for the mixes ggufpy can produce
FTYPES: dict[str, FType] = {
    name: FType(name, value, default)
    for name, value, default in (
        ("F32", 0, T.F32), ("F16", 1, T.F16), ("Q4_0", 2, T.Q4_0), ("Q4_1", 3, T.Q4_1), ("Q8_0", 7, T.Q8_0),
        ("Q5_0", 8, T.Q5_0), ("Q5_1", 9, T.Q5_1), ("Q2_K", 10, T.Q2_K), ("Q3_K_S", 11, T.Q3_K),
        ("Q3_K_M", 12, T.Q3_K), ("Q3_K_L", 13, T.Q3_K), ("Q4_K_S", 14, T.Q4_K), ("Q4_K_M", 15, T.Q4_K),
        ("Q5_K_S", 16, T.Q5_K), ("Q5_K_M", 17, T.Q5_K), ("Q6_K", 18, T.Q6_K), ("IQ2_XXS", 19, T.IQ2_XXS),
        ("IQ2_XS", 20, T.IQ2_XS), ("Q2_K_S", 21, T.Q2_K), ("IQ3_XS", 22, T.IQ3_S), ("IQ3_XXS", 23, T.IQ3_XXS),
        ("IQ1_S", 24, T.IQ1_S), ("IQ4_NL", 25, T.IQ4_NL), ("IQ3_S", 26, T.IQ3_S), ("IQ3_M", 27, T.IQ3_S),
        ("IQ2_S", 28, T.IQ2_XS), ("IQ2_M", 29, T.IQ2_S), ("IQ4_XS", 30, T.IQ4_XS), ("IQ1_M", 31, T.IQ1_M),
        ("BF16", 32, T.BF16),
    )
}  # fmt: skip
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # tools/quantize/quantize.cpp QUANT_OPTIONS

# tensor_type_fallback: a row that is not a multiple of the type's block size gets this type (then F16); a
# 32-block type has no smaller block to fall back to and goes straight to F16
FALLBACK = dict.fromkeys((T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS), T.IQ4_NL)
FALLBACK |= {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.TQ1_0: T.Q4_0, T.TQ2_0: T.Q4_0}
FALLBACK |= {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

# tensor_requires_imatrix: these types are garbage without importance weights (token_embd and output excepted)
NEEDS_IMATRIX = frozenset((T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S))

# the 1-2 bit mixes, which llama_tensor_get_type_impl handles in one branch of their own (`_mix_low_bit`)
LOW_BIT = frozenset(("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"))
# the output head (and tied token_embd) of these mixes gets Q5_K rather than Q6_K
OUTPUT_Q5_K = LOW_BIT | {"IQ3_XXS"}
# an untied token_embd's type, where the mix does not leave it at its default
TOKEN_EMBD = dict.fromkeys(("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"), T.Q2_K)
TOKEN_EMBD |= dict.fromkeys(("IQ2_S", "IQ2_M", "IQ3_XXS"), T.IQ3_S)
# attn_q and (without 8 experts) attn_k of the IQ3 mixes step down
ATTN_QK = {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}
# attn_output of a model with 8 experts gets Q5_K under these mixes; otherwise this table (falcon aside)
ATTN_OUTPUT_8_EXPERTS = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S")
ATTN_OUTPUT_8_EXPERTS += ("IQ3_M", "IQ4_XS")
ATTN_OUTPUT = {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K, "IQ3_M": T.Q4_K}

# tensor_allows_quantization: tensors whose name contains one of these are kept as they are
KEPT_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "time_mix_first.weight",
    "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight",
    "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
    ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)  # fmt: skip
KEPT_NAMES = ("position_embd.weight", "token_types.weight")

# tensor_get_category: the first rule that matches names the category
_CATEGORIES = (
    ("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
    ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
    ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"),
)  # fmt: skip
ATTN_V_LIKE = ("attn_v", "attn_qkv", "attn_kv_b")
_COUNTED = ("attn_v", "ffn_down", "ffn_gate", "ffn_up")  # the running per-category counters (i_attention_wv, ...)


def category(name: str) -> str:
    """llama.cpp's `tensor_get_category`: output, token_embd, attn_v, ffn_down, ... or other."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    return next((cat for part, cat in _CATEGORIES if part in name), "other")


def weight_order(names) -> list[str]:
    """The order llama.cpp's model loader keeps tensors in (`weight_name_comparer`): tensors outside blocks
    first, then by block number, by name within each; the mixes' per-layer counters follow it."""

    def key(name: str) -> tuple[int, str]:
        m = re.match(r"blk\.(\d+)\.", name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


def parse_type(text: str) -> GGMLType:
    """A ggml type name as the CLI takes it (case-insensitive): q8_0, Q4_K, f16 ..."""
    try:
        return GGMLType[text.upper()]
    except KeyError:
        raise GGUFError(f"unknown ggml type {text!r}; types: {', '.join(t.name for t in GGMLType)}") from None


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


@dataclass(frozen=True)
class MixOptions:
    """llama_model_quantize_params that change the choice: --pure, --output-tensor-type,
    --token-embedding-type, --tensor-type PATTERN=TYPE (regex searched in the name, first match wins)."""

    pure: bool = False
    output_tensor_type: GGMLType | None = None
    token_embedding_type: GGMLType | None = None
    tensor_types: tuple[tuple[str, GGMLType], ...] = ()


@dataclass
class TypePlan:
    """The state `llama_tensor_get_type` keeps while it walks a model's tensors (its `quantize_state_impl`).

    `dry_run` (llama-quantize --dry-run): a tensor that needs an importance matrix none was given for is listed
    in `imatrix_required` instead of refused."""

    ftype: FType
    arch: str
    n_layers: int
    n_gqa: int
    n_expert: int
    is_70b: bool
    tied_embeddings: bool
    has_imatrix: bool = False
    options: MixOptions = field(default_factory=MixOptions)
    dry_run: bool = False
    n_attention_wv: int = 0
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTED, 0))
    n_fallback: int = 0
    imatrix_required: list[str] = field(default_factory=list)

    @classmethod
    def for_model(
        cls,
        metadata: dict,
        names,
        ftype: str,
        has_imatrix: bool = False,
        options: MixOptions | None = None,
        dry_run: bool = False,
    ):
        name = ALIASES.get(ftype.upper(), ftype.upper())
        if name not in FTYPES:
            raise GGUFError(f"unknown or unsupported quantization mix {ftype!r}; ggufpy makes: {', '.join(FTYPES)}")
        arch = metadata["general.architecture"]
        n_layers = int(metadata.get(f"{arch}.block_count", 0))
        n_head, n_head_kv = (_first(metadata.get(f"{arch}.attention.{k}", 0)) for k in ("head_count", "head_count_kv"))
        names = list(names)
        return cls(
            ftype=FTYPES[name],
            arch=arch,
            n_layers=n_layers,
            n_gqa=n_head // n_head_kv if n_head_kv else 0,
            n_expert=int(metadata.get(f"{arch}.expert_count", 0)),
            is_70b=arch == "llama" and n_layers == 80 and n_head != n_head_kv,  # llama-model.cpp LLM_TYPE_70B
            tied_embeddings="output.weight" not in names,
            has_imatrix=has_imatrix,
            options=options or MixOptions(),
            dry_run=dry_run,
            n_attention_wv=sum(category(n) in ATTN_V_LIKE for n in names),
        )

    def allows_quantization(self, name: str, n_dims: int) -> bool:
        """`tensor_allows_quantization`: 2-D and 3-D `*weight` tensors that are not norms, routers, ..."""
        return (
            n_dims >= 2
            and name.endswith("weight")
            and not any(s in name for s in KEPT_SUBSTRINGS)
            and name not in KEPT_NAMES
        )

    def requires_imatrix(self, name: str, t: GGMLType) -> bool:
        """`tensor_requires_imatrix`: the grid types, and Q2_K within a Q2_K_S file; never the embeddings/head."""
        if category(name) in ("output", "token_embd"):
            return False
        return t in NEEDS_IMATRIX or (t == T.Q2_K and self.ftype.name == "Q2_K_S")

    def choose(self, name: str, shape: tuple[int, ...], current: GGMLType) -> GGMLType:
        """The type llama.cpp gives tensor `name` (NumPy `shape`, stored as `current`). Call in weight_order.
        Raises GGUFError if that type needs an importance matrix and the plan has none (unless a dry run)."""
        if not self.allows_quantization(name, len(shape)):
            return current
        new = self._choose(name, shape)
        if not self.has_imatrix and self.requires_imatrix(name, new):
            if not self.dry_run:
                raise GGUFError(
                    f"{self.ftype.name} needs an importance matrix: tensor {name} would be {new.name}, a type "
                    f"llama-quantize makes only with one (tensor_requires_imatrix); pass --imatrix"
                )
            self.imatrix_required.append(name)
        return new

    def _choose(self, name: str, shape: tuple[int, ...]) -> GGMLType:
        cat, opts = category(name), self.options
        if opts.token_embedding_type is not None and cat == "token_embd":
            return opts.token_embedding_type
        if opts.output_tensor_type is not None and cat == "output":
            return opts.output_tensor_type
        new = self.ftype.default
        if new in (T.F32, T.F16, T.BF16):  # ggml_is_quantized(default_type) is false: no mix, no fallback
            return new
        manual = next((t for pattern, t in opts.tensor_types if re.search(pattern, name)), None)
        if manual is not None:
            new = manual
        elif not opts.pure:
            new = self._mix(name, cat, new, shape[-1])
        return self._fallback(new, shape[-1])

    def _fallback(self, t: GGMLType, ncols: int) -> GGMLType:
        if ncols % _block(t) == 0:
            return t
        self.n_fallback += 1
        if t not in FALLBACK and _block(t) > 32:
            raise GGUFError(f"no type fallback is defined for {t.name} (row of {ncols} elements)")
        t = FALLBACK.get(t, t)
        return t if ncols % _block(t) == 0 else T.F16

    def _layer(self, counter: str, name: str) -> tuple[int, int]:
        """(i_layer, n_layers) for the per-layer rules: the running count of this category, or the block
        number in the name for a mixture of experts (llama.cpp's `layer_info`)."""
        if self.n_expert > 1:
            m = re.match(r"blk\.(\d+)\.", name)
            if not m or int(m.group(1)) >= self.n_layers:
                raise GGUFError(f"cannot determine the layer of tensor {name} (block_count {self.n_layers})")
            return int(m.group(1)), self.n_layers
        return self.counters[counter], self.n_layers

    def _mix(self, name: str, cat: str, new: GGMLType, ncols: int) -> GGMLType:
        """`llama_tensor_get_type_impl`: the mix's exceptions to its default type, category by category."""
        f, gqa, n_expert = self.ftype.name, self.n_gqa, self.n_expert
        if cat == "output" or (self.tied_embeddings and cat == "token_embd"):
            if self.options.output_tensor_type is not None:
                return self.options.output_tensor_type
            if self.arch == "falcon" or ncols % _block(new):
                return T.Q8_0
            if f in OUTPUT_Q5_K:
                return T.Q5_K
            return new if new == T.Q8_0 else T.Q6_K
        if cat == "token_embd":
            return TOKEN_EMBD.get(f, new)
        if f in LOW_BIT:
            return self._mix_low_bit(cat, new)
        if cat in ATTN_V_LIKE:  # attn_qkv and attn_kv_b too: llama.cpp's later attn_qkv branch is never reached
            i, n = self.counters["attn_v"], self.n_attention_wv
            if f == "Q2_K":
                new = T.Q4_K if gqa >= 4 else T.Q3_K
            elif f == "Q2_K_S" and gqa >= 4:
                new = T.Q4_K
            elif f == "IQ3_XXS":
                new = T.Q4_K if gqa >= 4 else T.IQ3_XXS if self.has_imatrix else T.IQ3_S
            elif (f in ("IQ3_XS", "IQ3_S") and gqa >= 4) or f == "IQ3_M":
                new = T.Q4_K
            elif f == "Q3_K_M":
                new = T.Q5_K if i < 2 else T.Q4_K
            elif f == "Q3_K_L":
                new = T.Q5_K
            elif f in ("IQ4_NL", "IQ4_XS") and gqa >= 4:
                new = T.Q5_K
            elif f in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n):
                new = T.Q6_K
            elif f == "Q4_K_S" and i < 4:
                new = T.Q5_K
            if self.is_70b and new in (T.Q3_K, T.Q4_K):
                new = T.Q5_K
            if n_expert == 8:
                new = T.Q8_0
            self.counters["attn_v"] += 1
            return new
        if cat == "attn_k":
            return T.Q8_0 if n_expert == 8 else ATTN_QK.get(f, new)
        if cat == "attn_q":
            return ATTN_QK.get(f, new)
        if cat == "ffn_down":
            i, n = self._layer("ffn_down", name)
            falcon = self.arch == "falcon"
            if f == "Q2_K":
                new = T.Q3_K
            elif f == "Q2_K_S":
                new = T.Q4_K if i < n // 8 else new
            elif f == "IQ3_XXS" and not self.has_imatrix:
                new = T.Q4_K if i < n // 8 else T.Q3_K
            elif f == "Q3_K_M":
                new = T.Q5_K if i < n // 16 else T.Q4_K if not falcon or _use_more_bits(i, n) else T.Q3_K
            elif f == "IQ3_M" and (i < n // 8 or (n_expert == 8 and _use_more_bits(i, n))):
                new = T.Q4_K
            elif f == "Q3_K_L":
                new = T.Q4_K if falcon else T.Q5_K
            elif f == "Q4_K_M":
                if falcon:
                    new = T.Q6_K if i < n // 16 else T.Q5_K if _use_more_bits(i, n) else T.Q4_K
                elif _use_more_bits(i, n):
                    new = T.Q6_K
            elif i < n // 8 and f in ("IQ4_NL", "IQ4_XS") and not self.has_imatrix:
                new = T.Q5_K
            elif f == "Q5_K_M" and _use_more_bits(i, n):
                new = T.Q6_K
            elif f == "Q4_K_S" and not falcon and i < n // 8:
                new = T.Q5_K
            elif f in ("Q4_0", "Q5_0") and self.has_imatrix and i < n // 8:
                new = T.Q4_1 if f == "Q4_0" else T.Q5_1  # guards the first ffn_down layers (llama-quant.cpp)
            self.counters["ffn_down"] += 1
            return new
        if cat == "attn_output":
            if self.arch == "falcon":
                return T.Q4_K if f == "Q3_K_L" else new
            if n_expert == 8:
                return T.Q5_K if f in ATTN_OUTPUT_8_EXPERTS else new
            return ATTN_OUTPUT.get(f, new)
        if cat in ("ffn_gate", "ffn_up"):
            i, n = self._layer(cat, name)
            self.counters[cat] += 1
            if f == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
                return T.IQ3_XXS
        return new

    def _mix_low_bit(self, cat: str, new: GGMLType) -> GGMLType:
        """The IQ1/IQ2 mixes' branch: a few more bits for attn_v, the first eighth of ffn_down, attn_output.
        Its ffn_down rule counts tensors even in a mixture of experts (no `layer_info`)."""
        f, n_expert = self.ftype.name, self.n_expert
        more = T.IQ3_S if f in ("IQ2_S", "IQ2_M") else T.Q2_K
        if cat in ATTN_V_LIKE:
            self.counters["attn_v"] += 1
            return T.Q4_K if self.n_gqa >= 4 or n_expert >= 4 else more
        if cat == "attn_k" and n_expert == 8:
            return T.Q4_K
        if cat == "ffn_down":
            i = self.counters["ffn_down"]
            self.counters["ffn_down"] += 1
            return more if i < self.n_layers // 8 else new
        if cat == "attn_output":
            if n_expert == 8:
                return T.Q5_K
            return {"IQ1_S": T.IQ2_XXS, "IQ1_M": T.IQ2_XXS, "IQ2_S": T.IQ3_S, "IQ2_M": T.IQ3_S}.get(f, new)
        return new


def _block(t: GGMLType) -> int:
    return GGML_BLOCK_LAYOUT[t][0]


def _first(v) -> int:
    """A per-layer hyperparameter array's first value (llama.cpp's hparams.n_head(il=0)), or the scalar."""
    return int(v[0]) if isinstance(v, (list, tuple)) else int(v)
