"""Synthetic hybrid recurrent models (Gated DeltaNet layers beside gated attention layers), written with
gguf.GGUFWriter under llama.cpp's keys and tensor names, loadable by the pinned llama.cpp. `qwen35moe` is the
same model with qwen2moe's feed-forward (`ffn_gate_inp`, `ffn_*_exps`, a shared expert behind
`ffn_gate_inp_shexp`; src/models/qwen35moe.cpp).

`qwen35` (llama.cpp `src/models/qwen35.cpp`, `load_arch_hparams` / `load_arch_tensors`):
- layer i is recurrent (a DeltaNet layer) unless (i + 1) % full_attention_interval == 0;
- DeltaNet layer: attn_qkv (conv_dim, D) and attn_gate (value_dim, D) projections, ssm_conv1d (conv_dim, d_conv),
  ssm_dt.bias and ssm_a (H_v,), ssm_beta and ssm_alpha (H_v, D), ssm_norm (S,), ssm_out (D, value_dim), with
  S = ssm.state_size (the head size of keys and values), H_k = ssm.group_count, H_v = ssm.time_step_rank,
  value_dim = ssm.inner_size = H_v * S and conv_dim = 2 * H_k * S + value_dim;
- attention layer: attn_q (2 * H * E, D) holds each head's query and output gate side by side, attn_k, attn_v,
  per-head attn_q_norm / attn_k_norm, attn_output (D, H * E); RoPE is IMROPE over rope.dimension_count dims with
  rope.dimension_sections;
- every layer: attn_norm, post_attention_norm (the norm in front of the feed-forward), ffn_gate/up/down.
The vocabulary, tokenizer metadata and quantizers are those of `conformance.fixtures`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from ggufpy.constants import GGMLType

from .fixtures import FIXTURES, WRITERS, TinyLlama, _quantize, _tokens, add_vocab

ROLES = ("embd", "output", "attn", "ffn", "ssm")


@dataclass(frozen=True)
class TinyQwen35(TinyLlama):
    """A synthetic `qwen35` model: `TinyLlama`'s fields (key_length = the attention head size) plus the DeltaNet
    layers'. Defaults: 4 layers, 0 and 2 DeltaNet, 1 and 3 attention. The "ssm" role (the DeltaNet products)
    takes the "attn" role's type unless `types` names it."""

    dim: int = 64
    hidden_dim: int = 96
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    key_length: int | None = 32  # attention.key_length = value_length
    rope_theta: float = 1e7
    norm_eps: float = 1e-6
    tied_output: bool = True
    logit_std: float | None = 4.0
    seed: int = 500
    arch: str = "qwen35"
    full_attention_interval: int = 2
    rope_dim: int = 16  # partial rotary, as the real models (64 of 256)
    rope_sections: tuple[int, int, int, int] = (3, 3, 2, 0)  # pairs per t/h/w/e section (real: 11, 11, 10, 0)
    state_size: int = 64  # S: head size of the keys and values (real: 128)
    n_k_heads: int = 2  # ssm.group_count
    n_v_heads: int = 4  # ssm.time_step_rank; a multiple of n_k_heads
    conv_kernel: int = 4
    # qwen35moe: a mixture of experts as feed-forward (router, stacked experts, a shared expert behind a gate)
    n_experts: int = 0  # expert_count
    n_experts_used: int = 0  # expert_used_count
    expert_hidden_dim: int = 0  # expert_feed_forward_length
    shared_hidden_dim: int = 0  # expert_shared_feed_forward_length
    beta_alpha: bool = False  # one ssm_ba (2*H_v, D) instead of ssm_beta and ssm_alpha (qwen3next)

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.state_size

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.state_size + self.value_dim

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


def write_tiny_qwen35(path: str | Path, spec: TinyQwen35 = TinyQwen35()) -> Path:
    """Write the model to `path` and return it."""
    path = Path(path)
    if spec.n_v_heads % spec.n_k_heads:
        raise ValueError(f"n_v_heads {spec.n_v_heads} must be a multiple of n_k_heads {spec.n_k_heads}")
    if sum(spec.rope_sections) * 2 > spec.rope_dim:
        raise ValueError(f"rope sections {spec.rope_sections} cover more than rope_dim {spec.rope_dim} / 2 pairs")
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _tokens()
    V, D, F, E, H, G = len(tokens), spec.dim, spec.hidden_dim, spec.head_dim, spec.n_heads, spec.n_kv_heads
    S, Hv = spec.state_size, spec.n_v_heads

    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name(f"tiny-{spec.arch}-synthetic")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(D)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_key_length(E)
    w.add_value_length(E)
    w.add_rope_dimension_count(spec.rope_dim)
    if any(spec.rope_sections):  # IMROPE (qwen35*); qwen3next's NeoX RoPE has none
        w.add_rope_dimension_sections(list(spec.rope_sections))
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_full_attention_interval(spec.full_attention_interval)
    w.add_ssm_conv_kernel(spec.conv_kernel)
    w.add_ssm_inner_size(spec.value_dim)
    w.add_ssm_state_size(S)
    w.add_ssm_time_step_rank(Hv)
    w.add_ssm_group_count(spec.n_k_heads)
    if spec.n_experts:
        w.add_expert_count(spec.n_experts)
        w.add_expert_used_count(spec.n_experts_used)
        w.add_expert_feed_forward_length(spec.expert_hidden_dim)
        w.add_expert_shared_feed_forward_length(spec.shared_hidden_dim)
    w.add_vocab_size(V)
    add_vocab(w, tokens, token_types)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add_f32(name: str, data: np.ndarray) -> None:
        w.add_tensor(name, np.asarray(data, np.float32))

    def norm(name: str, n: int) -> None:  # around 1
        add_f32(name, 1.0 + 0.1 * rng.standard_normal(n))

    def matrix(name: str, shape: tuple[int, int], role: str, scale: float | None = None) -> None:
        data = (rng.standard_normal(shape) * (scale or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)
        kind = name.removesuffix(".weight").split(".")[-1]
        qtype = spec.types.get(kind, spec.types.get(role, spec.types["attn"]))
        if qtype == GGMLType.F32:
            add_f32(name, data)
        else:
            raw = _quantize(data, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    head_scale = spec.logit_std / np.sqrt(D)
    matrix("token_embd.weight", (V, D), "embd", scale=head_scale if spec.tied_output else 1.0)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", D)
        if spec.is_recurrent(i):
            matrix(p + "attn_qkv.weight", (spec.conv_dim, D), "ssm")
            matrix(p + "attn_gate.weight", (spec.value_dim, D), "ssm")
            # a short causal filter per channel, taps of either sign (the converter stores conv1d (C, 1, K) as (C, K))
            add_f32(p + "ssm_conv1d.weight", rng.standard_normal((spec.conv_dim, spec.conv_kernel)) * 0.5)
            add_f32(p + "ssm_dt.bias", rng.uniform(-2.0, 1.0, Hv))
            add_f32(p + "ssm_a", -np.exp(rng.uniform(-1.0, 1.0, Hv)))  # -exp(A_log), as the converter stores it
            if spec.beta_alpha:  # per k group: its H_v / H_k beta rows, then its alpha rows
                matrix(p + "ssm_ba.weight", (2 * Hv, D), "ssm")
            else:
                matrix(p + "ssm_beta.weight", (Hv, D), "ssm")
                matrix(p + "ssm_alpha.weight", (Hv, D), "ssm")
            norm(p + "ssm_norm.weight", S)
            matrix(p + "ssm_out.weight", (D, spec.value_dim), "ssm")
        else:
            matrix(p + "attn_q.weight", (2 * H * E, D), "attn")
            matrix(p + "attn_k.weight", (G * E, D), "attn")
            matrix(p + "attn_v.weight", (G * E, D), "attn")
            norm(p + "attn_q_norm.weight", E)
            norm(p + "attn_k_norm.weight", E)
            matrix(p + "attn_output.weight", (D, H * E), "attn")
        norm(p + "post_attention_norm.weight", D)
        if spec.n_experts:  # llama.cpp `llama_model_qwen35moe::load_arch_tensors`
            X, Fe, Fs = spec.n_experts, spec.expert_hidden_dim, spec.shared_hidden_dim
            add_f32(p + "ffn_gate_inp.weight", rng.standard_normal((X, D)) / np.sqrt(D))  # the router stays F32
            stacked = (("ffn_gate_exps", (X, Fe, D)), ("ffn_up_exps", (X, Fe, D)), ("ffn_down_exps", (X, D, Fe)))
            for stem, shape in stacked:
                add_f32(p + stem + ".weight", rng.standard_normal(shape) / np.sqrt(shape[-1]))
            add_f32(p + "ffn_gate_inp_shexp.weight", rng.standard_normal(D) / np.sqrt(D))
            matrix(p + "ffn_gate_shexp.weight", (Fs, D), "ffn")
            matrix(p + "ffn_up_shexp.weight", (Fs, D), "ffn")
            matrix(p + "ffn_down_shexp.weight", (D, Fs), "ffn")
        else:
            matrix(p + "ffn_gate.weight", (F, D), "ffn")
            matrix(p + "ffn_up.weight", (F, D), "ffn")
            matrix(p + "ffn_down.weight", (D, F), "ffn")
    norm("output_norm.weight", D)
    if not spec.tied_output:
        matrix("output.weight", (V, D), "output", scale=head_scale)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- the catalogue ---------------------------------------------------------------------------------------------

FIXTURE_DIR = Path(__file__).parent / "fixtures"

T = GGMLType
HYBRID_FIXTURES: dict[str, TinyQwen35] = {
    "hybrid_f32": TinyQwen35(),
    # every product through activation quantization (Q8_0 weights, rows of 64 / 96 / 256 / 512)
    "hybrid_q8_0": TinyQwen35(seed=501, types=dict.fromkeys(ROLES, T.Q8_0)),
    # a head size off the SIMD step (ggml's scalar tails in the recurrence) and IMROPE pairs on the e section
    "hybrid_s48": TinyQwen35(seed=502, state_size=48, rope_sections=(1, 1, 1, 5)),
    # qwen35moe: the same mixers, 4 experts (2 used) and a gated shared expert as feed-forward
    "hybrid_moe_f32": TinyQwen35(
        arch="qwen35moe", seed=503, n_experts=4, n_experts_used=2, expert_hidden_dim=32, shared_hidden_dim=48
    ),
    # qwen3next: qwen35moe with one ssm_ba product and plain NeoX RoPE (no sections)
    "hybrid_next_f32": TinyQwen35(
        arch="qwen3next",
        seed=504,
        n_experts=4,
        n_experts_used=2,
        expert_hidden_dim=32,
        shared_hidden_dim=48,
        beta_alpha=True,
        rope_sections=(0, 0, 0, 0),
    ),
}


# the conformance catalogue's qwen35 fixture (`fixtures.FIXTURES`, goldens in conformance/goldens/): small, to fit
# the committed files' budget; the larger ones above are rebuilt by the tests against tests/data/hybrid/
CATALOGUE: dict[str, TinyQwen35] = {
    "qwen35_f32": TinyQwen35(
        dim=32,
        hidden_dim=32,
        n_heads=2,
        n_kv_heads=1,
        key_length=16,
        rope_dim=8,
        rope_sections=(2, 1, 1, 0),
        state_size=32,
        n_k_heads=1,
        n_v_heads=2,
        seed=410,
    ),
}
CATALOGUE["qwen35moe_f32"] = replace(
    CATALOGUE["qwen35_f32"], arch="qwen35moe", seed=411, n_experts=4, n_experts_used=2, expert_hidden_dim=16,
    shared_hidden_dim=24,
)  # fmt: skip
CATALOGUE["qwen3next_f32"] = replace(
    CATALOGUE["qwen35moe_f32"], arch="qwen3next", seed=412, beta_alpha=True, rope_sections=(0, 0, 0, 0)
)
WRITERS[TinyQwen35] = write_tiny_qwen35
FIXTURES.update(CATALOGUE)


def hybrid_fixture_path(name: str, directory: Path = FIXTURE_DIR) -> Path:
    return directory / f"{name}.gguf"


def build_hybrid_fixture(name: str, directory: Path = FIXTURE_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_tiny_qwen35(hybrid_fixture_path(name, directory), HYBRID_FIXTURES[name])


# -- goldens: llama.cpp's tensors on these fixtures (tests/data/hybrid/, compared by tests/test_deltanet*.py) ------

GOLDEN_DIR = Path(__file__).parent.parent / "tests" / "data" / "hybrid"
GOLDEN_TOKENS = 128  # prompt length (the conformance thresholds are measured on >= 100 tokens)
GOLDEN_CONTINUATION = 16
STAGE_TOKENS = 32  # the STAGES tensors come from a separate run on the prompt's first 32 tokens (file size)
# the intermediate tensors kept for the first DeltaNet layer (0) and the first attention layer (1): each step
# of the mixers can then be checked on llama.cpp's own inputs
STAGES = {
    0: (
        "attn_norm", "linear_attn_qkv_mixed", "z", "beta", "beta_sigmoid", "alpha", "a_softplus", "gate",
        "conv_output_raw", "conv_output_silu", "q_conv_predelta", "k_conv_predelta", "v_conv_predelta",
        "attn_output", "new_state", "final_output", "linear_attn_out",
    ),
    1: (
        "attn_norm", "Qcur_full", "Qcur_normed", "Kcur_normed", "Qcur", "Kcur", "Vcur", "attn_pregate",
        "gate_sigmoid", "attn_gated", "attn_output",
    ),
}  # fmt: skip


# qwen3next computes beta and alpha as views of one product (`linear_attn_mixed_ba`), with no name for them
FUSED_BA_STAGES = {0: (*(n for n in STAGES[0] if n not in ("beta", "alpha", "beta_sigmoid")), "linear_attn_mixed_ba")}


def golden_path(name: str, directory: Path = GOLDEN_DIR) -> Path:
    return directory / f"{name}.npz"


def record_hybrid_golden(name: str, directory: Path = GOLDEN_DIR, work: Path | None = None) -> Path:
    """Build fixture `name` (into `work`, default a temporary directory) and store llama.cpp's logits, every
    `l_out-N` and a greedy continuation for `GOLDEN_TOKENS` prompt tokens, the `STAGES` tensors of a run on the
    first `STAGE_TOKENS` (keys "t:NAME"), the fixture's sha256 and the llama.cpp build (its x86 ISA decides
    which llamacpp numerics mode replays it)."""
    import tempfile

    from .fixtures import sha256
    from .llamacpp import LlamaCpp, host_isa, versions
    from .record import fixture_tokens

    with tempfile.TemporaryDirectory() as tmp:
        path = build_hybrid_fixture(name, Path(work or tmp))
        spec = HYBRID_FIXTURES[name]
        tokens = fixture_tokens(GOLDEN_TOKENS)
        layers = {f"l_out-{i}" for i in range(spec.n_layers)}
        kept = STAGES | FUSED_BA_STAGES if spec.beta_alpha else STAGES
        stages = {f"{stage}-{layer}" for layer, names in kept.items() for stage in names}
        with LlamaCpp(path) as lc:
            logits, tensors = lc.run(tokens, layers)
            greedy = lc.greedy(tokens, GOLDEN_CONTINUATION)
            tensors.update(lc.run(tokens[:STAGE_TOKENS], stages)[1])
        missing = (layers | stages) - tensors.keys()
        if missing:
            raise RuntimeError(f"llama.cpp computed no tensor named {sorted(missing)} on {name}")
        directory.mkdir(parents=True, exist_ok=True)
        out = golden_path(name, directory)
        np.savez_compressed(
            out,
            tokens=tokens,
            logits=logits,
            greedy=np.asarray(greedy, np.int32),
            sha256=sha256(path),
            isa=host_isa(),
            llama_cpp=repr(versions()),
            **{f"t:{k}": v for k, v in tensors.items()},
        )
    return out


if __name__ == "__main__":  # python -m conformance.fixtures_hybrid [NAMES]: (re)record the goldens
    import sys

    for fixture in sys.argv[1:] or list(HYBRID_FIXTURES):
        print(record_hybrid_golden(fixture))
