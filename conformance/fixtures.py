"""Deterministic tiny synthetic GGUF models (random but well-scaled weights) written with gguf.GGUFWriter.

Any architecture of ggufpy's registry (`ggufpy.arch.ARCHITECTURES`) can be written: `TinyLlama.arch` picks it,
and the writer adds the tensors and metadata llama.cpp's loader (`src/llama-model.cpp`) requires for it: Q/K/V
biases (qwen2), per-head Q/K norms (qwen3, gemma3), post-attention/post-FFN norms (gemma2/3), the sliding
window and softcaps (gemma2/3). Gemma files are always tied (llama.cpp duplicates `token_embd` for the head).

llama.cpp loads them too, which makes them conformance fixtures as well as fast unit-test models.
The vocabulary is a small GPT-2-style byte-level BPE: the 256 byte tokens, a few merges and specials.

`FIXTURES` is the conformance catalogue: one model per quant type llama.cpp can multiply by, plus mixes
like real quantizations. Types without a ggufpy quantizer (the k-quants, IQ4_NL, IQ4_XS) are quantized
with ggml's own C quantizer (`ggml_quantize_chunk`, what `llama-quantize` runs) when the fixtures are
built, so building needs llama-cpp-python; the built files are committed under `conformance/fixtures/`
with their sha256 in `conformance/fixtures/manifest.json`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from ggufpy.arch import arch_spec
from ggufpy.constants import GGMLType
from ggufpy.quants import quant_type, quantize

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
    """Hyperparameters of a synthetic model (llama architecture unless `arch` says otherwise). Defaults fit
    every block size (256)."""

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
    # GGML type per tensor role: "embd", "output", "attn", "ffn"; norms are always F32. A key naming a tensor
    # ("blk.0.attn_v") or a tensor kind ("attn_v", "ffn_down") overrides its role, as llama.cpp's mixes do.
    types: dict[str, GGMLType] = field(default_factory=lambda: dict.fromkeys(ROLES, GGMLType.F32))
    # logits' scale: the output head (or, when tied, the embeddings) gets std logit_std / sqrt(dim), so the
    # logits have a std of about logit_std. None keeps std 1/sqrt(dim) for `output`, 1 for `token_embd`.
    logit_std: float | None = None
    arch: str = "llama"  # general.architecture: any name of ggufpy.arch.ARCHITECTURES
    key_length: int | None = None  # attention.key_length/value_length (head size) when not dim / n_heads
    sliding_window: int | None = None  # attention.sliding_window (gemma2/3: the local layers' window)
    attn_softcap: float | None = None  # attn_logit_softcapping (gemma2)
    final_softcap: float | None = None  # final_logit_softcapping (gemma2)
    # more `{arch}.` keys, by the name after the prefix: float -> FLOAT32, int -> UINT32, str -> STRING, bool ->
    # BOOL (RoPE scaling, granite's multipliers)
    extra_kv: tuple[tuple[str, float | int | str], ...] = ()
    rope_factors: bool = False  # LongRoPE's rope_factors_short / rope_factors_long (phi3)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.dim // self.n_heads


def add_vocab(w: gguf.GGUFWriter, tokens: list[str], token_types: list[int]) -> None:
    """The fixtures' GPT-2 style vocabulary (`_tokens`), its merges, special ids and chat template."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def _tokens() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + byte_level_tokens()
    for m in MERGES:
        tokens.append(m.replace(" ", ""))
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    return tokens, [int(t) for t in types]


# spec class -> writer, for the fixtures whose tensors differ from the llama block's (fixtures_moe.py,
# fixtures_hybrid.py, fixtures_llama4.py register theirs; conformance/__init__.py imports them all)
WRITERS: dict[type, Callable[[str | Path, TinyLlama], Path]] = {}


def write_tiny_llama(path: str | Path, spec: TinyLlama = TinyLlama()) -> Path:
    """Write the model to `path` and return it."""
    writer = WRITERS.get(type(spec))  # experts, hybrid layers, llama4: the other fixture modules' own tensors
    if writer is not None:
        return writer(path, spec)
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _tokens()
    V, D, F, E = len(tokens), spec.dim, spec.hidden_dim, spec.head_dim
    Q, K = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    a = arch_spec(spec.arch)
    if (a.name.startswith("gemma") or a.name == "cohere2") and not spec.tied_output:
        raise ValueError(f"{a.name}: llama.cpp always ties the output head to token_embd")

    w = gguf.GGUFWriter(str(path), a.name)
    # llama-vocab.cpp sets token attributes of "</s>", "<unk>", "<s>" for models *named* phi3 or phi-3, which this
    # vocabulary lacks (std::out_of_range): the phi3 fixture is named "tiny-phi-synthetic"
    w.add_name(f"tiny-{a.name.replace('phi3', 'phi')}-synthetic")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(F)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    if spec.key_length is not None:
        w.add_key_length(spec.key_length)
        w.add_value_length(spec.key_length)
    if spec.sliding_window is not None:
        w.add_sliding_window(spec.sliding_window)
    if spec.attn_softcap is not None:
        w.add_attn_logit_softcapping(spec.attn_softcap)
    if spec.final_softcap is not None:
        w.add_final_logit_softcapping(spec.final_softcap)
    for k, value in spec.extra_kv:
        add_kv = {float: w.add_float32, int: w.add_uint32, str: w.add_string, bool: w.add_bool}[type(value)]
        add_kv(f"{a.name}.{k}", value)
    w.add_vocab_size(V)
    add_vocab(w, tokens, token_types)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add(name: str, shape: tuple[int, ...], role: str | None, scale: float | None = None):
        if role is None:  # norm weights: around 1
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, data)
            return
        if role == "bias":  # always F32, as converted models store them
            w.add_tensor(name, (0.5 * rng.standard_normal(shape)).astype(np.float32))
            return
        data = (rng.standard_normal(shape) * (scale or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)
        stem = name.removesuffix(".weight")
        qtype = spec.types.get(stem, spec.types.get(stem.split(".")[-1], spec.types[role]))
        if qtype == GGMLType.F32:
            w.add_tensor(name, data)
        else:
            raw = _quantize(data, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    head_scale = None if spec.logit_std is None else spec.logit_std / np.sqrt(D)
    add("token_embd.weight", (V, D), "embd", scale=(head_scale if spec.tied_output else None) or 1.0)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        if a.pre_norms:
            add(p + "attn_norm.weight", (D,), None)
        if a.fused_qkv:
            add(p + "attn_qkv.weight", (Q + 2 * K, D), "attn")
        for proj, rows in (("q", Q), ("k", K), ("v", K)) if not a.fused_qkv else ():
            add(p + f"attn_{proj}.weight", (rows, D), "attn")
            if a.qkv_bias:
                add(p + f"attn_{proj}.bias", (rows,), "bias")
        if a.qk_norm:
            add(p + "attn_q_norm.weight", (Q if a.qk_norm_span == "all" else E,), None)
            add(p + "attn_k_norm.weight", (K if a.qk_norm_span == "all" else E,), None)
        add(p + "attn_output.weight", (D, Q), "attn")
        if a.post_norms:
            add(p + "post_attention_norm.weight", (D,), None)
        if a.pre_norms and not a.parallel:
            add(p + "ffn_norm.weight", (D,), None)
        if not a.fused_gate_up:
            add(p + "ffn_gate.weight", (F, D), "ffn")
        add(p + "ffn_up.weight", (2 * F if a.fused_gate_up else F, D), "ffn")
        add(p + "ffn_down.weight", (D, F), "ffn")
        if a.post_norms:
            add(p + "post_ffw_norm.weight", (D,), None)
    add("output_norm.weight", (D,), None)
    if not spec.tied_output:
        add("output.weight", (V, D), "output", scale=head_scale)
    if spec.rope_freqs:
        w.add_tensor("rope_freqs.weight", (1.0 + rng.random(spec.head_dim // 2) * 3).astype(np.float32))
    if spec.rope_factors:  # LongRoPE: short factors near 1, long ones up to 4
        w.add_tensor("rope_factors_short.weight", (1.0 + rng.random(spec.head_dim // 2) * 0.2).astype(np.float32))
        w.add_tensor("rope_factors_long.weight", (1.0 + rng.random(spec.head_dim // 2) * 3).astype(np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _quantize(data: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """ggufpy's quantizers (what `ggml_quantize_chunk` writes, which for IQ4_NL/IQ4_XS is not their `_ref`
    function), or ggml's C quantizer for the types ggufpy cannot quantize."""
    from ggufpy.quants.iqgrid_quantizers import REQUIRES_IMATRIX
    from ggufpy.quants.rowquantizers import ROW_QUANTIZERS, quantize_rows

    if qtype in ROW_QUANTIZERS:  # an importance matrix of ones where ggml requires one, as `llamacpp.ggml_quantize`
        imatrix = np.ones(data.shape[-1], np.float32) if qtype in REQUIRES_IMATRIX else None
        return quantize_rows(data, qtype, imatrix=imatrix)
    if quant_type(qtype).quantize_blocks is not None:
        return quantize(data, qtype)
    from .llamacpp import available, ggml_quantize

    if not available():
        raise RuntimeError(
            f"writing {GGMLType(qtype).name} tensors needs ggml's quantizer: pip install 'ggufpy[conformance]'"
        )
    return ggml_quantize(data, qtype)


# -- the conformance catalogue -----------------------------------------------------------------------------------

FIXTURE_DIR = Path(__file__).parent / "fixtures"
MANIFEST = FIXTURE_DIR / "manifest.json"

T = GGMLType
# Shapes per block size, as small as the blocks allow (the committed files stay under 5 MB together):
# float types take any row, 32-element types need rows of 32k, the k-quants and IQ4_XS rows of 256k.
FLOAT = TinyLlama(dim=32, hidden_dim=64, n_layers=3, n_heads=2, n_kv_heads=1, tied_output=True, logit_std=4.0)
SMALL = TinyLlama(dim=64, hidden_dim=128, n_layers=3, n_heads=4, n_kv_heads=2, tied_output=True, logit_std=4.0)
WIDE = TinyLlama(dim=256, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=1, tied_output=True, logit_std=4.0)


# One F32 fixture per architecture besides llama: each architecture's own tensors and metadata, 2 layers
# (gemma3 needs 6 for a global layer), heads of 24 where the real models' head size is not dim / n_heads (Qwen3,
# Gemma), a sliding window of 32 < the 128-token prompt on gemma2/3's local layers (layer 0 of gemma2; layers
# 0-4 of gemma3, with RoPE base 10000 there against 1e6 on layer 5), and active softcaps on gemma2 (the
# attention scores reach about +-10 and the logits +-15).
_ARCH = replace(FLOAT, n_layers=2, hidden_dim=32)
ARCH_FIXTURES: dict[str, TinyLlama] = {
    "qwen2": replace(_ARCH, arch="qwen2", seed=400, rope_theta=1e6),
    "qwen3": replace(_ARCH, arch="qwen3", seed=401, key_length=24, rope_theta=1e6),
    "gemma": replace(_ARCH, arch="gemma", seed=402, key_length=24),
    "gemma2": replace(
        _ARCH, arch="gemma2", seed=403, key_length=24, sliding_window=32, attn_softcap=5.0, final_softcap=8.0
    ),
    "gemma3": replace(_ARCH, arch="gemma3", seed=404, n_layers=6, sliding_window=32, rope_theta=1e6),
    # issue 13. mistral3 with YaRN x4 over an original context of 64 (its ramp spans pairs 0-3 of 8 at head size
    # 16) and temperature tuning (Q scaled from position 64 on); smollm3 with 4 layers, the last one NoPE;
    # granite with all four multipliers; olmo2's post-norms and whole-row Q/K norms; phi3's fused QKV and
    # gate-up, LongRoPE's long factors (the original context, 64, is shorter than the prompt and than both runs'
    # contexts) and attention factor; cohere2's parallel block with LayerNorm, 3 local RoPE layers then a global
    # NoPE one, window 32, logits times 0.5; exaone, the llama block with neox RoPE
    "mistral3": replace(
        _ARCH,
        arch="mistral3",
        seed=405,
        context_length=16384,
        extra_kv=(
            ("rope.scaling.type", "yarn"),
            ("rope.scaling.factor", 4.0),
            ("rope.scaling.original_context_length", 64),
            ("attention.temperature_scale", 0.5),
        ),
    ),
    "smollm3": replace(_ARCH, arch="smollm3", seed=406, n_layers=4, rope_theta=5e6),
    "granite": replace(
        _ARCH,
        arch="granite",
        seed=407,
        extra_kv=(("embedding_scale", 12.0), ("attention.scale", 0.2), ("residual_scale", 0.22), ("logit_scale", 2.0)),
    ),
    "cohere2": replace(
        _ARCH,
        arch="cohere2",
        seed=411,
        n_layers=4,
        sliding_window=32,
        extra_kv=(("logit_scale", 0.5), ("attention.layer_norm_epsilon", 1e-5)),
    ),
    "exaone": replace(_ARCH, arch="exaone", seed=410, rope_theta=1e6, tied_output=False),
    "olmo2": replace(_ARCH, arch="olmo2", seed=408, rope_theta=5e5, tied_output=False),  # llama.cpp needs `output`
    "phi3": replace(
        _ARCH,
        arch="phi3",
        seed=409,
        rope_factors=True,
        extra_kv=(("rope.scaling.attn_factor", 1.19), ("rope.scaling.original_context_length", 64)),
    ),
}


def _uniform(t: GGMLType) -> dict[str, GGMLType]:
    return dict.fromkeys(ROLES, t)


def _pure(t: GGMLType, seed: int) -> TinyLlama:
    base = {1: FLOAT, 32: SMALL, 64: SMALL, 128: WIDE, 256: WIDE}[quant_type(t).block_size]
    return replace(base, types=_uniform(t), seed=seed)


# name -> spec. One fixture per weight type llama.cpp multiplies by (every registered type but the activation
# formats Q8_1 and Q8_K, which llama.cpp cannot use as weights: no vec_dot, and get_rows of Q8_K aborts in
# ggml-cpu/ops.cpp), then mixes: llama.cpp's Q4_K_M recipe on a 2-layer model (Q6_K output, attn_v and
# ffn_down of layer 0; Q4_K elsewhere) and SmolLM2's (Q4_1 layers, tied Q8_0 embeddings).
FIXTURES: dict[str, TinyLlama] = {
    **{t.name.lower(): _pure(t, seed=100 + int(t)) for t in (T.F32, T.F16, T.BF16)},
    **{t.name.lower(): _pure(t, seed=100 + int(t)) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL)},
    # issue 12 types (goldens recorded on AVX2)
    **{t.name.lower(): _pure(t, seed=100 + int(t)) for t in (T.MXFP4, T.NVFP4, T.Q1_0, T.TQ1_0, T.TQ2_0)},
    # the grid types: ggml quantizes IQ2_XXS, IQ2_XS and IQ1_S with an importance matrix of ones
    **{t.name.lower(): _pure(t, seed=100 + int(t)) for t in (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)},
    **{t.name.lower(): _pure(t, seed=100 + int(t)) for t in (T.IQ1_S, T.IQ1_M)},
    **{t.name.lower(): _pure(t, seed=100 + int(t)) for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)},
    "q4_k_m": replace(
        WIDE,
        tied_output=False,
        seed=300,
        types={**_uniform(T.Q4_K), "output": T.Q6_K, "blk.0.attn_v": T.Q6_K, "blk.0.ffn_down": T.Q6_K},
    ),
    "smollm2_mix": replace(SMALL, seed=301, types={**_uniform(T.Q4_1), "embd": T.Q8_0}),
    **{f"{arch}_f32": spec for arch, spec in ARCH_FIXTURES.items()},
}


def fixture_path(name: str) -> Path:
    return FIXTURE_DIR / f"{name}.gguf"


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weight_types(spec: TinyLlama) -> list[str]:
    """The GGML types a fixture stores its weights in, most used first."""
    return sorted({t.name for t in spec.types.values()}, key=lambda n: -list(spec.types.values()).count(T[n]))


def build_fixtures(names: list[str] | None = None, directory: Path = FIXTURE_DIR) -> dict[str, dict]:
    """Write the fixtures `names` (default: all) into `directory` and update its manifest.json."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for name in names or list(FIXTURES):
        spec = FIXTURES[name]
        path = write_tiny_llama(directory / f"{name}.gguf", spec)
        manifest[name] = {"file": path.name, "sha256": sha256(path), "bytes": path.stat().st_size}
        manifest[name]["types"] = weight_types(spec)
    manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    return manifest


def load_manifest() -> dict[str, dict]:
    return json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
