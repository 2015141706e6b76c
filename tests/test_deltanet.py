"""Hybrid recurrent models (qwen35): the Gated DeltaNet mixer, the gated attention, the per-sequence state, and
the whole model against llama.cpp's goldens (tests/data/hybrid/, `python -m conformance.fixtures_hybrid`).

The goldens hold llama.cpp's tensors on the synthetic fixtures of `conformance.fixtures_hybrid`, which are rebuilt
here (deterministic, checked against the golden's sha256). Each mixer step is checked on llama.cpp's own inputs
(bit for bit in the llamacpp numerics of the goldens' x86 build), then the model end to end.
"""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from conformance.fixtures import sha256
from conformance.fixtures_hybrid import (
    GOLDEN_CONTINUATION,
    HYBRID_FIXTURES,
    STAGE_TOKENS,
    TinyQwen35,
    build_hybrid_fixture,
    golden_path,
    write_tiny_qwen35,
)
from ggufpy import deltanet as dn
from ggufpy import gated_attention as ga
from ggufpy import ops
from ggufpy.errors import GGUFMetadataError
from ggufpy.numerics import LLAMACPP_MODES, NUMERICS, rope_angles_ggml
from ggufpy.reader import open as open_gguf

NAMES = sorted(HYBRID_FIXTURES)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hybrid")
    return {name: build_hybrid_fixture(name, directory) for name in NAMES}


def golden(name: str) -> dict:
    with np.load(golden_path(name)) as z:
        return {k: z[k] for k in z.files}


def mode(g: dict) -> str:
    """The llamacpp numerics mode that replays the build the golden was recorded on."""
    return LLAMACPP_MODES[str(g["isa"])]


def stage(g: dict, name: str, layer: int, shape=None) -> np.ndarray:
    a = g[f"t:{name}-{layer}"]
    return a if shape is None else a.reshape(shape)


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a - b) ** 2) / np.mean(b**2))


# -- the fixture and its hyperparameters ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_fixture_builder_reproduces_the_goldens_file(files, name):
    assert sha256(files[name]) == str(golden(name)["sha256"])


def test_config_reads_the_layer_pattern_and_sizes(files):
    f = open_gguf(files["hybrid_f32"])
    cfg = dn.deltanet_config(f.metadata, "qwen35", 4, 1e-6)
    spec = TinyQwen35()
    assert cfg.recurrent == (True, False, True, False)  # (i + 1) % full_attention_interval != 0
    assert (cfg.state_size, cfg.n_k_heads, cfg.n_v_heads, cfg.conv_kernel) == (64, 2, 4, 4)
    assert cfg.conv_dim == spec.conv_dim == 2 * 2 * 64 + 4 * 64
    assert cfg.rope_sections == (3, 3, 2, 0)
    md = dict(f.metadata) | {"qwen35.attention.recurrent_layers": np.array([0, 1, 1, 0], np.int32)}
    assert dn.deltanet_config(md, "qwen35", 4, 1e-6).recurrent == (False, True, True, False)


def test_config_errors_name_the_key_and_the_rule(files):
    md = dict(open_gguf(files["hybrid_f32"]).metadata)
    with pytest.raises(GGUFMetadataError, match=r"qwen35\.ssm\.inner_size = 200: must be .*time_step_rank"):
        dn.deltanet_config(md | {"qwen35.ssm.inner_size": 200}, "qwen35", 4, 1e-6, source="x.gguf")
    with pytest.raises(GGUFMetadataError, match=r"qwen35\.ssm\.group_count = 3: must divide"):
        dn.deltanet_config(md | {"qwen35.ssm.group_count": 3}, "qwen35", 4, 1e-6)
    with pytest.raises(GGUFMetadataError, match=r"recurrent_layers.*one entry per layer"):
        dn.deltanet_config(md | {"qwen35.attention.recurrent_layers": np.array([1, 0])}, "qwen35", 4, 1e-6)
    del md["qwen35.ssm.state_size"]
    with pytest.raises(GGUFMetadataError, match=r"qwen35\.ssm\.state_size is required"):
        dn.deltanet_config(md, "qwen35", 4, 1e-6)


def test_fixture_writer_refuses_inconsistent_heads(tmp_path):
    with pytest.raises(ValueError, match="n_v_heads 3 must be a multiple of n_k_heads 2"):
        write_tiny_qwen35(tmp_path / "x.gguf", TinyQwen35(n_v_heads=3))


# -- each step on llama.cpp's inputs --------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_deltanet_steps_equal_llamacpp_bit_for_bit(files, name):
    g = golden(name)
    f, arch = open_gguf(files[name]), HYBRID_FIXTURES[name].arch
    cfg = dn.deltanet_config(f.metadata, arch, 4, float(f.metadata[f"{arch}.attention.layer_norm_rms_epsilon"]))
    w = dn.load_deltanet_weights(f, cfg, 64, 0)
    math = dn.for_numerics(NUMERICS[mode(g)])
    T, A, B, S = STAGE_TOKENS, cfg.n_k_heads, cfg.n_v_heads, cfg.state_size

    def same(mine, ref_name, layer=0):
        ref = stage(g, ref_name, layer, mine.shape)
        assert np.array_equal(mine, ref), f"{ref_name}: {np.sum(mine != ref)} of {mine.size} values differ"

    if w.ssm_ba is not None:  # qwen3next: per k group, its betas then its alphas
        ba = stage(g, "linear_attn_mixed_ba", 0, (T, A, 2, B // A))
        beta_in, alpha_in = ba[:, :, 0].reshape(T, B), ba[:, :, 1].reshape(T, B)
    else:
        beta_in, alpha_in = stage(g, "beta", 0, (T, B)), stage(g, "alpha", 0, (T, B))
        same(math.sigmoid(beta_in), "beta_sigmoid")
    same(math.softplus(alpha_in + w.ssm_dt), "a_softplus")
    same(math.softplus(alpha_in + w.ssm_dt) * w.ssm_a, "gate")
    conv_input = np.concatenate(
        [np.zeros((cfg.conv_kernel - 1, cfg.conv_dim), np.float32), stage(g, "linear_attn_qkv_mixed", 0)]
    )
    same(math.conv(conv_input, w.ssm_conv1d), "conv_output_raw")
    same(math.silu(stage(g, "conv_output_raw", 0)), "conv_output_silu")
    silu = stage(g, "conv_output_silu", 0)
    repeat = B // A if cfg.head_grouping == "interleaved" else 1  # qwen3next repeats each k head first
    q = np.repeat(dn.l2_norm(silu[:, : A * S].reshape(T, A, S), cfg.norm_eps), repeat, axis=1)
    same(q, "q_conv_predelta")
    same(
        np.repeat(dn.l2_norm(silu[:, A * S : 2 * A * S].reshape(T, A, S), cfg.norm_eps), repeat, axis=1),
        "k_conv_predelta",
    )
    q, k = stage(g, "q_conv_predelta", 0, q.shape), stage(g, "k_conv_predelta", 0, q.shape)
    v = stage(g, "v_conv_predelta", 0, (T, B, S))
    gate, beta = stage(g, "gate", 0, (T, B)), math.sigmoid(beta_in)
    o, state = math.delta_rule(q, k, v, gate, beta, np.zeros((B, S, S), np.float32))
    same(o, "attn_output")
    same(state, "new_state")  # ggml's layout: state[h, j, i] = S[i][j]
    z = stage(g, "z", 0, (T, B, S))
    same(ops.rms_norm(stage(g, "attn_output", 0, (T, B, S)), w.ssm_norm, cfg.norm_eps) * math.silu(z), "final_output")


@pytest.mark.parametrize("name", NAMES)
def test_gated_attention_steps_equal_llamacpp_bit_for_bit(files, name):
    g = golden(name)
    spec, numerics = HYBRID_FIXTURES[name], NUMERICS[mode(g)]
    f = open_gguf(files[name])
    H, G, E, T = spec.n_heads, spec.n_kv_heads, spec.head_dim, STAGE_TOKENS
    w = ga.load_gated_attention_weights(f, H, G, E, spec.dim, 1)

    def same(mine, ref_name):
        ref = stage(g, ref_name, 1, mine.shape)
        assert np.array_equal(mine, ref), f"{ref_name}: {np.sum(mine != ref)} of {mine.size} values differ"

    q_full = stage(g, "Qcur_full", 1, (T, H, 2, E))  # per head: query, then gate
    same(ops.rms_norm(q_full[:, :, 0], w.attn_q_norm, spec.norm_eps), "Qcur_normed")
    cos, sin = rope_angles_ggml(np.arange(T), spec.rope_dim, spec.rope_theta)
    cos, sin = ga.text_angles(cos, sin, ga.imrope_unrotated(spec.rope_sections, spec.rope_dim))
    same(numerics.rope(stage(g, "Qcur_normed", 1, (T, H, E)), cos, sin, "neox"), "Qcur")
    same(numerics.rope(stage(g, "Kcur_normed", 1, (T, G, E)), cos, sin, "neox"), "Kcur")
    same(dn.for_numerics(numerics).sigmoid(q_full[:, :, 1].reshape(T, H * E)), "gate_sigmoid")
    kv = [stage(g, n, 1, (T, G, E)).astype(np.float16).astype(np.float32) for n in ("Kcur", "Vcur")]  # f16 cache
    scale = np.float32(1) / np.sqrt(np.float32(E))
    same(numerics.attention(stage(g, "Qcur", 1, (T, H, E)), *kv, 0, scale), "attn_pregate")


def test_imrope_leaves_the_e_section_unrotated():
    # sections (1, 1, 1, 5): sectors 0-2 rotate by t, h, w, sectors 3-7 by e (position 0 for text)
    assert ga.imrope_unrotated((1, 1, 1, 5), 16).tolist() == [False] * 3 + [True] * 5
    assert not ga.imrope_unrotated((11, 11, 10, 0), 64).any()  # Qwen3.5's: every pair rotates
    cos, sin = ga.text_angles(np.full((2, 8), 0.5, np.float32), np.full((2, 8), 0.5, np.float32), np.arange(8) > 5)
    assert cos[:, 6:].tolist() == [[1, 1]] * 2 and sin[:, 6:].tolist() == [[0, 0]] * 2 and cos[0, 0] == 0.5


# -- the model end to end -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_model_equals_llamacpp_bit_for_bit(files, name):
    """Logits, every l_out and the greedy continuation (token-by-token decode) in the goldens' llamacpp mode."""
    g = golden(name)
    model = ggufpy.load(files[name], backend="numpy", numerics=mode(g))
    tokens = g["tokens"]
    trace, cache = {}, model.new_cache(capacity=len(tokens) + GOLDEN_CONTINUATION)
    logits = model.forward(tokens, 0, cache, trace=trace)
    for i in range(model.config.n_layers):
        mine, ref = trace[f"l_out-{i}"], g[f"t:l_out-{i}"]
        assert np.array_equal(mine, ref), f"l_out-{i}: NMSE {nmse(mine, ref):.1e}"
    assert np.array_equal(logits, g["logits"]), f"logits: NMSE {nmse(logits, g['logits']):.1e}"
    out, nxt = [], int(np.argmax(logits[-1]))
    for _ in range(GOLDEN_CONTINUATION):
        out.append(nxt)
        nxt = int(np.argmax(model.forward(np.array([nxt]), cache.length, cache)[-1]))
    assert out == g["greedy"].tolist()


def mean_kl(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(logits)), in float64."""
    lp, lq = (x - np.log(np.sum(np.exp(x), -1, keepdims=True)) for x in (ref_logits.astype(np.float64), logits))
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))


@pytest.mark.parametrize("name", NAMES)
def test_exact_mode_within_the_conformance_thresholds(files, name):
    """docs/conformance.md: end to end top-1 >= 99% and mean KL <= 1e-4 (F32), >= 90% and <= 1e-2 (quantized);
    per layer, teacher-forced (each layer on llama.cpp's input to it), NMSE <= 1e-3."""
    g = golden(name)
    model = ggufpy.load(files[name], backend="numpy", numerics="exact")
    tokens = g["tokens"]
    logits = model.forward(tokens, 0, model.new_cache(capacity=len(tokens)))
    top1, kl = float(np.mean(np.argmax(logits, -1) == np.argmax(g["logits"], -1))), mean_kl(g["logits"], logits)
    assert (top1, kl) >= (0.99, 0) and kl <= 1e-4 if name == "hybrid_f32" else top1 >= 0.9 and kl <= 1e-2, (top1, kl)
    for i in range(model.config.n_layers):
        x = tokens if i == 0 else g[f"t:l_out-{i - 1}"]
        trace, layer = {}, range(i, i + 1)
        model.forward(x, 0, model.new_cache(capacity=len(tokens), layers=layer), layer, trace=trace)
        assert nmse(trace[f"l_out-{i}"], g[f"t:l_out-{i}"]) <= 1e-3, i


class RowBackend:
    """Products row by row (each row's sums in the same order whatever the number of rows)."""

    name = "rows"

    def linear(self, x, w):
        d = w.dequantize()
        return np.stack([d @ row for row in x])


@pytest.mark.parametrize("math", [dn.EXACT, dn.ggml_math("avx2"), dn.ggml_math("avx512")], ids=lambda m: m.name)
def test_deltanet_in_pieces_equals_one_call_bit_for_bit(files, math):
    """The mixer carries its conv and recurrent states exactly: T tokens at once equal 5 + 1 + 1 + rest."""
    f = open_gguf(files["hybrid_f32"])
    cfg = dn.deltanet_config(f.metadata, "qwen35", 4, 1e-6)
    w = dn.load_deltanet_weights(f, cfg, 64, 2)
    x = np.random.default_rng(6).standard_normal((12, 64)).astype(np.float32)
    whole, conv, ssm = dn.deltanet(x, w, cfg, *dn.empty_state(cfg), RowBackend(), math)
    state, parts = dn.empty_state(cfg), []
    for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 12)):
        out, *state = dn.deltanet(x[lo:hi], w, cfg, *state, RowBackend(), math)
        parts.append(out)
    assert np.array_equal(np.concatenate(parts), whole)
    assert np.array_equal(state[0], conv) and np.array_equal(state[1], ssm)
    assert np.abs(ssm).max() > 0.01 and conv.shape == (3, 512)


def test_delta_rule_exact_and_ggml_agree_and_follow_the_recurrence():
    """The two numerics agree to f32 rounding, and both implement the delta rule written out in float64."""
    rng = np.random.default_rng(7)
    T, A, B, S = 6, 2, 4, 64
    q, k = (rng.standard_normal((T, A, S)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.standard_normal((T, B, S)).astype(np.float32)
    g, beta = -rng.uniform(0, 2, (T, B)).astype(np.float32), rng.uniform(0, 1, (T, B)).astype(np.float32)
    M = np.zeros((B, S, S))  # S[i][j] stored at [h, j, i]
    ref = np.empty((T, B, S))
    for t in range(T):
        for h in range(B):
            kt, qt = k[t, h % A].astype(np.float64), q[t, h % A].astype(np.float64)
            M[h] *= np.exp(g[t, h])
            d = (v[t, h] - M[h] @ kt) * beta[t, h]
            M[h] += np.outer(d, kt)
            ref[t, h] = M[h] @ qt / np.sqrt(S)
    for rule in (dn.delta_rule_exact, dn.ggml_math("avx2").delta_rule, dn.ggml_math("avx512").delta_rule):
        o, state = rule(q, k, v, g, beta, np.zeros((B, S, S), np.float32))
        np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state, M, rtol=1e-4, atol=1e-5)
