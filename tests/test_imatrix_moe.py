"""The importance matrix of a mixture of experts: one row of sums and one count per expert, from routed tokens only.

Oracles: the rule written out by hand on ggufpy's own trace (the FFN input, the router's top-k, each expert's
gated product in float64), and live, llama-imatrix's collector ported to an eval callback of llama.cpp itself
(conformance/imatrix_collector.py), run on the same chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from conformance import fixtures as fx
from conformance.fixtures_moe import MOE_FIXTURES
from ggufpy.imatrix import compute_imatrix
from ggufpy.perplexity import Chunks, default_text, make_chunks
from ggufpy.workbench.imatrix_file import ImatrixFile

STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _chunks(model, n_ctx: int = 32, n: int = 2) -> Chunks:
    rng = np.random.default_rng(1)
    return Chunks(rng.integers(3, model.config.vocab_size, n * n_ctx).astype(np.int32), n_ctx, None)


def _silu(x):
    return x / (1 + np.exp(-x))


def hand_written(model, chunks: Chunks) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per expert e of each stack: sum over the (token, slot) rows routed to e of x^2, and their number."""
    spec = model.config
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for c in range(chunks.n_chunk):
        trace: dict[str, np.ndarray] = {}
        model.forward(chunks.chunk(c), 0, model.new_cache(chunks.n_ctx), trace=trace)
        for i, w in model.weights.layers.items():
            x = trace[f"ffn_norm-{i}"].astype(np.float64)  # (T, D): the experts' input
            router = x @ w.ffn_gate_inp.dequantize().astype(np.float64).T  # (T, X)
            top = np.argsort(-router, axis=1, kind="stable")[:, : spec.n_experts_used]  # (T, K): softmax is monotone
            for stack in STACKS:
                ew = getattr(w, stack)
                n_exp, _, n_in = ew.shape
                sums, counts = out.setdefault(ew.name, (np.zeros((n_exp, n_in)), np.zeros(n_exp)))
                for e in range(n_exp):
                    rows = np.nonzero((top == e).any(axis=1))[0]  # each token at most once per expert
                    if stack == "ffn_down_exps":  # its input: SiLU(gate_e(x)) * up_e(x) of those tokens
                        g = x[rows] @ w.ffn_gate_exps.expert(e).dequantize().astype(np.float64).T
                        u = x[rows] @ w.ffn_up_exps.expert(e).dequantize().astype(np.float64).T
                        inp = _silu(g) * u
                    else:
                        inp = x[rows]
                    sums[e] += (inp * inp).sum(axis=0)
                    counts[e] += len(rows)
    return out


@pytest.mark.parametrize("name", ["qwen3moe_f32", "qwen2moe_f32"])
def test_expert_sums_follow_the_routing_rule(name):
    model = ggufpy.load(fx.fixture_path(name), backend="numpy")
    chunks = _chunks(model)
    im = compute_imatrix(model, chunks)
    want = hand_written(model, chunks)
    spec = MOE_FIXTURES[name]
    for stack_name, (sums, counts) in want.items():
        e = im.entries[stack_name]
        assert e.sums.shape == (spec.n_experts, sums.shape[1]) and e.counts.shape == (spec.n_experts,)
        assert e.counts.tolist() == counts.tolist(), stack_name  # routed tokens only
        np.testing.assert_allclose(e.sums, sums, rtol=2e-5, atol=1e-6, err_msg=stack_name)
    tokens = chunks.n_chunk * chunks.n_ctx
    for i in model.weights.layers:
        # every token reaches K experts; the router and the shared expert (qwen2moe) are dense: one count
        assert im.entries[f"blk.{i}.ffn_gate_exps.weight"].counts.sum() == tokens * spec.n_experts_used
        assert im.entries[f"blk.{i}.ffn_gate_inp.weight"].counts.tolist() == [tokens]
        if spec.shared_hidden_dim:
            assert im.entries[f"blk.{i}.ffn_up_shexp.weight"].counts.tolist() == [tokens]


def test_small_batches_still_count_for_the_experts():
    """Dense products of fewer than 16 rows are skipped (llama.cpp's rule); routed ones never are."""
    model = ggufpy.load(fx.fixture_path("qwen3moe_f32"), backend="numpy")
    im = compute_imatrix(model, _chunks(model, n_ctx=8, n=1))
    assert "blk.0.attn_q.weight" not in im.entries
    assert im.entries["blk.0.ffn_down_exps.weight"].counts.sum() == 8 * MOE_FIXTURES["qwen3moe_f32"].n_experts_used


def test_per_expert_entries_round_trip_in_llamacpps_layout(tmp_path):
    import gguf

    model = ggufpy.load(fx.fixture_path("qwen2moe_f32"), backend="numpy")
    im = compute_imatrix(model, _chunks(model))
    path = im.save(tmp_path / "moe.imatrix.gguf")
    r = {t.name: t for t in gguf.GGUFReader(path).tensors}
    t = r["blk.0.ffn_up_exps.weight.in_sum2"]
    assert t.shape.tolist() == [32, 17]  # ggml dims [n_in, n_expert], as llama-imatrix writes it
    assert r["blk.0.ffn_up_exps.weight.counts"].shape.tolist() == [1, 17]
    back = ImatrixFile.load(path).entries["blk.0.ffn_up_exps.weight"]
    np.testing.assert_array_equal(back.sums, im.entries["blk.0.ffn_up_exps.weight"].sums)
    np.testing.assert_array_equal(back.counts, im.entries["blk.0.ffn_up_exps.weight"].counts)


@pytest.mark.conformance
@pytest.mark.parametrize("name", ["qwen3moe_f32", "qwen2moe_f32", "qwen3moe_q4_0"])
@pytest.mark.parametrize("numerics", ["exact", "host"])
def test_sums_equal_llamacpps_collector_live(name, numerics):
    """llama-imatrix's rule applied inside llama.cpp (eval callback) against ggufpy's recorder, same chunks. In the
    host's llamacpp numerics the products' inputs are llama.cpp's bit for bit: the same routing, so the same counts,
    and sums equal up to their order. In exact numerics the activations differ (llama.cpp quantizes them for the
    products, keeps K/V in f16), and a near-tie in the router may go the other way (measured: 1 of 512 routed rows
    of qwen3moe_q4_0's layer 1 moves to another expert)."""
    pytest.importorskip("llama_cpp")
    from conformance.imatrix_collector import ImatrixCollector
    from ggufpy.numerics import host_llamacpp_mode

    path = fx.fixture_path(name)
    model = ggufpy.load(path, backend="numpy", numerics=host_llamacpp_mode() if numerics == "host" else "exact")
    chunks = make_chunks(model.tokenizer, default_text(), 64, 2)
    im = compute_imatrix(model, chunks)
    with ImatrixCollector(path) as ref:
        for i in range(chunks.n_chunk):
            ref.run(chunks.chunk(i))
    assert set(ref.sums) == set(im.entries)
    for key, sums in ref.sums.items():
        ours, counts = im.entries[key], ref.counts[key]
        if numerics == "host":
            assert ours.counts.tolist() == counts.tolist(), key
            np.testing.assert_allclose(ours.sums, sums, rtol=1e-6, atol=0, err_msg=key)
            continue
        assert ours.counts.sum() == counts.sum() and np.abs(ours.counts - counts).sum() <= 0.01 * counts.sum(), key
        assert np.linalg.norm(ours.sums - sums) / np.linalg.norm(sums) < 0.05, key


@pytest.mark.conformance
def test_quantizing_experts_with_their_own_rows_is_llamacpps(tmp_path):
    """`ggufpy quantize --imatrix` with a per-expert imatrix: every tensor byte-identical to llama_model_quantize
    given the same importances (expert e of a stack quantized with row e), and different from quantizing without."""
    pytest.importorskip("llama_cpp")
    from dataclasses import replace

    from ggufpy.constants import GGMLType
    from ggufpy.workbench.quantize import quantize_model
    from tests.quantize_oracle import llama_quantize

    spec = replace(MOE_FIXTURES["qwen3moe_q4_0"], types=dict.fromkeys(fx.ROLES, GGMLType.F32))  # 32-wide rows
    path = fx.write_tiny_llama(tmp_path / "moe-f32.gguf", spec)
    im = compute_imatrix(ggufpy.load(path, backend="numpy"), _chunks(ggufpy.load(path, backend="numpy"), 32, 2))
    assert im.entries["blk.0.ffn_down_exps.weight"].sums.shape == (spec.n_experts, spec.expert_hidden_dim)
    quantize_model(path, tmp_path / "ours.gguf", "Q4_0", imatrix=im)
    quantize_model(path, tmp_path / "plain.gguf", "Q4_0")
    llama_quantize(path, tmp_path / "theirs.gguf", "Q4_0", imatrix=im)
    with (
        ggufpy.open(tmp_path / "ours.gguf") as ours,
        ggufpy.open(tmp_path / "theirs.gguf") as theirs,
        ggufpy.open(tmp_path / "plain.gguf") as plain,
    ):
        assert list(ours.tensors) == list(theirs.tensors)
        for name in ours.tensors:
            assert bytes(ours.raw(name)) == bytes(theirs.raw(name)), name
        assert bytes(ours.raw("blk.1.ffn_up_exps.weight")) != bytes(plain.raw("blk.1.ffn_up_exps.weight"))
