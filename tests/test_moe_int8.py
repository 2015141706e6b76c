"""The numba backend's experts in the llamacpp numerics (`kernels/experts.py`): stacks of eight-row groups built
once per expert tensor, a decoded token's experts in one kernel call, the compiled router softmax; all bit for bit
the NumPy replay of llama.cpp."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import ggufpy
from conformance.fixtures_moe import MOE_FIXTURES, write_tiny_moe
from ggufpy import moe
from ggufpy.constants import GGMLType

pytest.importorskip("numba")

from ggufpy.kernels import bench, experts, int8dot

MODE = "llamacpp-avx2"
needs_int8 = pytest.mark.skipif(not int8dot.AVAILABLE, reason="no AVX2: no integer kernels")


@pytest.fixture(scope="module", params=["Q4_K", "Q4_0"])
def quantized(request, tmp_path_factory):
    """A qwen3moe of 8 experts (2 used) whose experts are `qtype` (eight-row groups), the rest Q8_0 (integer
    kernels: F32 weights are BLAS products on the numba backend, not ggml's sums)."""
    t = GGMLType[request.param]
    spec = replace(
        MOE_FIXTURES["qwen3moe_f32"],
        dim=256,
        key_length=None,
        n_heads=4,
        expert_hidden_dim=256,
        types={"embd": GGMLType.Q8_0, "output": GGMLType.Q8_0, "attn": GGMLType.Q8_0, "ffn": t},
    )
    return write_tiny_moe(tmp_path_factory.mktemp("moe_int8") / f"{request.param}.gguf", spec)


def _generate(model, tokens: np.ndarray, n_decode: int) -> list[np.ndarray]:
    """The last logits of a prefill, then of each of `n_decode` single-token steps."""
    cache = model.new_cache(len(tokens) + n_decode)
    out = [model.forward(tokens, 0, cache, last_only=True)]
    for i in range(n_decode):
        out.append(model.forward(tokens[i : i + 1], len(tokens) + i, cache, last_only=True))
    return out


@needs_int8
def test_stacked_decode_equals_the_numpy_replay(quantized, monkeypatch):
    """Prefill (per expert, over the stack's views; experts with 4 rows or more among them: the integer gemm)
    and decode (one kernel call per layer for gate and up, one for down) give the NumPy backend's llamacpp
    numerics bit for bit, whose `mul_mat_id` runs every routed row alone (repack.cpp's gemv)."""
    tokens = np.random.default_rng(3).integers(3, 269, 24)
    ref = _generate(ggufpy.load(quantized, backend="numpy", tokenizer=False, numerics=MODE), tokens, 4)
    calls = []
    stacked = experts.mul_mat_id
    monkeypatch.setattr(experts, "mul_mat_id", lambda *a, **kw: calls.append(len(a[0])) or stacked(*a, **kw))
    rows = []  # activation rows of each integer product (the prefill's per-expert ones among them)
    product = int8dot.product
    monkeypatch.setattr(int8dot, "product", lambda a, *r, **kw: rows.append(len(a.q)) or product(a, *r, **kw))
    ours = _generate(ggufpy.load(quantized, backend="numba", tokenizer=False, numerics=MODE), tokens, 4)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_array_equal(a, b)
    n_layers = MOE_FIXTURES["qwen3moe_f32"].n_layers
    assert calls == [2, 1] * n_layers * 4  # per layer and decoded token: gate and up together, then down
    assert max(rows) >= 8 and any(4 <= n < len(tokens) for n in rows)  # an expert's rows through the gemm


@needs_int8
def test_experts_are_grouped_once_and_prefill_reads_the_same_copy(quantized, monkeypatch):
    """`bench.model_weights` lists the expert tensors, `prepack` groups each into one stack, whose per-expert
    views are the experts' integer forms: after it no expert is copied again, by prefill or by decode."""
    model = ggufpy.load(quantized, backend="numba", tokenizer=False, numerics=MODE)
    be = model.backend
    layer = model.weights.layers[0]
    listed = bench.model_weights(model)
    assert any(w is layer.ffn_gate_exps for w in listed) and any(w is layer.ffn_down_exps for w in listed)
    be.prepack(listed)
    stack = be.expert_stack(layer.ffn_up_exps)
    X = layer.ffn_up_exps.shape[0]
    assert stack.w.shape[0] == X and stack.w.nbytes == layer.ffn_up_exps.experts[0].raw.nbytes * X
    for e, expert in enumerate(layer.ffn_up_exps.experts):  # the expert's integer form is its part of the stack
        assert np.shares_memory(be.int8_weight(expert).raw, stack.w[e])
    copies = []
    monkeypatch.setattr(int8dot, "interleaved", lambda iw: copies.append(iw) or None)
    _generate(model, np.arange(3, 12), 2)
    assert copies == []
    assert be.expert_stack(layer.ffn_up_exps) is stack


@pytest.mark.parametrize("n", [8, 16, 32, 40, 128, 7])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_compiled_router_softmax_is_the_replay_bit_for_bit(n, isa):
    x = (np.random.default_rng(n).standard_normal((6, n)) * 8).astype(np.float32)
    x[1, 0] = -np.inf  # a masked score (deepseek2's groups)
    np.testing.assert_array_equal(
        experts.softmax_ggml(x, isa).view(np.uint32), moe.softmax_ggml(x, isa).view(np.uint32)
    )


def test_exact_numerics_have_no_stacks(quantized):
    """The exact numerics keep the f32-lane kernels per expert: nothing is grouped."""
    model = ggufpy.load(quantized, backend="numba", tokenizer=False)
    assert model.backend.expert_stack(model.weights.layers[0].ffn_gate_exps) is None
