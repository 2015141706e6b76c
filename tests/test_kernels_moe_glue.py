"""The MoE feed-forward's compiled glue (`kernels/moe_glue.py`): route (softmax, top-k with libstdc++'s tie order,
the chosen weights), the gated unit (biases, swiglu_oai, ggml's SiLU) and the weighted slot sum, each bit for bit
its `ggufpy.moe` reference; and a model's decode with the compiled steps equals the one without them."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("numba")

import ggufpy
from conformance.fixtures_moe import GPT_OSS, MOE_FIXTURES, write_tiny_moe
from ggufpy import moe
from ggufpy.arch import MoE
from ggufpy.constants import GGMLType
from ggufpy.kernels import glue_ggml, moe_glue
from ggufpy.weights import ExpertTensor


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _tied_rows(rng, T: int, n: int) -> np.ndarray:
    """Rows of n scores drawn from a few values (ties everywhere), with -inf, -0.0 / 0.0 and NaN mixed in."""
    values = np.array([0.5, -1.0, 2.0, 0.0, -0.0, -np.inf, np.inf, np.nan, 3.0, 0.25], np.float32)
    rows = values[rng.integers(0, len(values), (T, n))]
    plain = rng.random((T, n)) < 0.5
    rows[plain] = rng.standard_normal(plain.sum()).astype(np.float32)
    return rows


def _reference_sort(row: np.ndarray) -> list[int]:
    values = row.tolist()
    return moe.libstdcxx_sort(list(range(len(values))), lambda a, b: values[a] > values[b])


@pytest.mark.parametrize("n", [2, 5, 16, 17, 32, 64, 129, 300])
def test_std_sort_replays_libstdcxx(n):
    """The compiled introsort moves indices exactly as `moe.libstdcxx_sort` does, over ties, NaN, sorted and
    reversed runs and organ pipes."""
    rng = np.random.default_rng(n)
    rows = [_tied_rows(rng, 1, n)[0] for _ in range(40)]
    rows += [np.arange(n, dtype=np.float32), -np.arange(n, dtype=np.float32), np.zeros(n, np.float32)]
    rows += [np.minimum(np.arange(n), n - np.arange(n)).astype(np.float32)]
    for row in rows:
        got = np.arange(n, dtype=np.int64)
        moe_glue._std_sort(got, row)
        assert got.tolist() == _reference_sort(row)


def _killer(n: int) -> np.ndarray:
    """Scores that drive libstdc++'s introsort into its heap sort: McIlroy's adversary ("A killer adversary for
    quicksort") run against the reference sort, its values fixed as the comparisons asked for them."""
    gas = n
    val = [gas] * n
    state = {"solid": 0, "candidate": 0}

    def less(x, y):
        if val[x] == gas and val[y] == gas:
            z = x if x == state["candidate"] else y
            val[z] = state["solid"]
            state["solid"] += 1
        if val[x] == gas:
            state["candidate"] = x
        elif val[y] == gas:
            state["candidate"] = y
        return val[x] < val[y]

    moe.libstdcxx_sort(list(range(n)), less)
    return -np.array(val, np.float32)  # descending comparator: larger scores first


@pytest.mark.parametrize("n", [64, 500])
def test_heap_sort_branch_is_replayed(n, monkeypatch):
    """An adversarial row that exhausts the introsort's depth (the reference's heap sort runs) sorts alike."""
    row = _killer(n)
    calls = []
    heap = moe._heap_sort
    monkeypatch.setattr(moe, "_heap_sort", lambda *a: calls.append(1) or heap(*a))
    want = _reference_sort(row)
    assert calls, "the adversary no longer reaches the heap sort"
    got = np.arange(n, dtype=np.int64)
    moe_glue._std_sort(got, row)
    assert got.tolist() == want
    np.testing.assert_array_equal(moe_glue.top_k(row[None], 4), moe.top_k(row[None], 4))


@pytest.mark.parametrize("n,k", [(8, 2), (32, 4), (64, 8), (5, 5), (128, 4)])
def test_top_k_is_the_reference(n, k):
    rng = np.random.default_rng(n * 100 + k)
    for scores in (_tied_rows(rng, 64, n), rng.standard_normal((64, n)).astype(np.float32)):
        np.testing.assert_array_equal(moe_glue.top_k(scores, k), moe.top_k(scores, k))


ROUTINGS = [
    MoE(norm_weights=True),  # qwen3moe
    MoE(),
    MoE(gating="softmax_weight", biases=True, glu="swiglu_oai"),  # gpt-oss
    MoE(norm_weights=True, weights_scale=2.5),
    MoE(gating="softmax_weight", norm_weights=True),
]


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("routing", ROUTINGS, ids=range(len(ROUTINGS)))
@pytest.mark.parametrize("n", [8, 32, 37])
def test_route_is_the_reference(routing, isa, n):
    """Against `moe.route` with the softmax the numba backend passes it (`moe_glue.softmax_ggml`), on ties and
    infinities too; and with the NumPy replay `moe.softmax_ggml` on finite logits (the two softmaxes differ only in
    the sign of the NaN that an infinite logit gives, on avx2)."""
    rng = np.random.default_rng(n)
    k = 4
    compiled = functools.partial(moe_glue.softmax_ggml, isa=isa)
    replay = functools.partial(moe.softmax_ggml, isa=isa)
    finite = (rng.standard_normal((16, n)) * 4).astype(np.float32)
    tied = _tied_rows(rng, 16, n)
    tied = np.where(np.isnan(tied), np.float32(1), tied)  # NaN logits: NaN probabilities everywhere
    for logits, softmax in ((finite, compiled), (finite, replay), (tied, compiled)):
        with np.errstate(invalid="ignore", over="ignore"):
            want = moe.route(logits, routing, k, softmax)
            got = moe_glue.route(logits, routing, k, softmax)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(_bits(got[1]), _bits(want[1]))


def test_route_outside_its_scope_is_the_reference():
    """Sigmoid gating, the exact numerics' softmax: the reference itself runs."""
    logits = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    for routing, softmax in ((MoE(gating="sigmoid"), moe.softmax_exact), (MoE(), moe.softmax_exact)):
        want, got = moe.route(logits, routing, 2, softmax), moe_glue.route(logits, routing, 2, softmax)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(_bits(got[1]), _bits(want[1]))


class _Layer:
    """The three expert stacks `gated` and `combine` read (their biases only)."""

    def __init__(self, X, F, D, rng, biased):
        def stack(out):
            bias = (rng.standard_normal((X, out)) * 3).astype(np.float32) if biased else None
            return ExpertTensor("e", GGMLType.F32, (X, out, 8), (), bias)

        self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps = stack(F), stack(F), stack(D)


@pytest.mark.parametrize("biased", [True, False])
@pytest.mark.parametrize("T", [1, 3])
def test_swiglu_oai_is_the_reference(biased, T):
    """Past the limit of 7, at it, NaN and infinities included, with the C library's expf."""
    rng = np.random.default_rng(T)
    X, K, F = 8, 4, 96
    w = _Layer(X, F, 16, rng, biased)
    chosen = np.stack([rng.permutation(X)[:K] for _ in range(T)]).astype(np.int32)
    gate, up = ((rng.standard_normal((T, K, F)) * 8).astype(np.float32) for _ in range(2))
    gate[0, 0, :6] = [7, -7, np.nan, np.inf, -np.inf, -0.0]
    up[0, 1, :6] = [7, -7, np.nan, np.inf, -np.inf, -0.0]
    routing = MoE(gating="softmax_weight", biases=True, glu="swiglu_oai")
    expf = glue_ggml.expf_array
    with np.errstate(invalid="ignore", over="ignore"):
        want = moe.gated(gate, up, w, chosen, routing, None, expf)
        got = moe_glue.gated(gate, up, w, chosen, routing, None, expf)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("F", [768, 100])
def test_swiglu_with_ggmls_silu_is_the_reference(F):
    rng = np.random.default_rng(F)
    w = _Layer(8, F, 16, rng, biased=False)
    gate, up = ((rng.standard_normal((1, 4, F)) * 6).astype(np.float32) for _ in range(2))
    chosen = np.array([[3, 1, 0, 7]], np.int32)
    act = glue_ggml.silu_rows
    want = moe.gated(gate, up, w, chosen, MoE(), act, None)
    np.testing.assert_array_equal(_bits(moe_glue.gated(gate, up, w, chosen, MoE(), act, None)), _bits(want))


@pytest.mark.parametrize("routing", [MoE(), MoE(gating="sigmoid", weights_on_input=True)], ids=["out", "in"])
@pytest.mark.parametrize("biased", [True, False])
def test_combine_is_the_reference(routing, biased):
    rng = np.random.default_rng(5)
    T, X, K, D = 3, 8, 4, 64
    w = _Layer(X, 16, D, rng, biased)
    y = (rng.standard_normal((T, K, D)) * 5).astype(np.float32)
    weights = rng.random((T, K)).astype(np.float32)
    chosen = np.stack([rng.permutation(X)[:K] for _ in range(T)]).astype(np.int32)
    want = moe.combine(y, w.ffn_down_exps, chosen, weights, routing)
    got = moe_glue.combine(y, w.ffn_down_exps, chosen, weights, routing)
    np.testing.assert_array_equal(_bits(got), _bits(want))


# -- a model: decode with the compiled steps equals decode without them ---------------------------------------------
@pytest.fixture(scope="module", params=["qwen3moe", "gpt-oss"])
def model_path(request, tmp_path_factory):
    """A qwen3moe of Q4_K experts, or a gpt-oss of MXFP4 experts (biases, swiglu_oai): the stacked paths."""
    spec = MOE_FIXTURES["qwen3moe_f32"] if request.param == "qwen3moe" else GPT_OSS
    expert = GGMLType.Q4_K if request.param == "qwen3moe" else GGMLType.MXFP4
    types = {"embd": GGMLType.Q8_0, "output": GGMLType.Q8_0, "attn": GGMLType.Q8_0, "ffn": expert}
    spec = replace(spec, dim=256, key_length=None, n_heads=4, expert_hidden_dim=256, types=types)
    return write_tiny_moe(tmp_path_factory.mktemp("moe_glue") / f"{request.param}.gguf", spec)


@pytest.mark.parametrize("numerics", ["llamacpp", "llamacpp-avx2", "exact"])
def test_decode_with_compiled_steps_is_bit_identical(model_path, numerics, monkeypatch):
    """Prefill then 4 decoded tokens: every MoE block's output and the logits with `moe_steps` (the compiled
    glue) and without it (the `ggufpy.moe` reference steps) are equal, and the compiled route ran where the
    numerics are ggml's. (The block outputs are compared too: the llamacpp numerics' int8 activations of the next
    product can absorb a last-bit difference before the logits.)"""
    tokens = np.random.default_rng(3).integers(3, 200, 12)
    blocks: list[np.ndarray] = []
    feed_forward = moe.feed_forward
    monkeypatch.setattr(moe, "feed_forward", lambda *a: blocks.append(feed_forward(*a)) or blocks[-1])

    def generate(model):
        blocks.clear()
        cache = model.new_cache(len(tokens) + 4)
        out = [model.forward(tokens, 0, cache, last_only=True)]
        for i in range(4):
            out.append(model.forward(tokens[i : i + 1], len(tokens) + i, cache, last_only=True))
        return out + list(blocks)

    plain = ggufpy.load(model_path, backend="numba", tokenizer=False, numerics=numerics)
    plain.backend.moe_steps = {}
    want = generate(plain)
    model = ggufpy.load(model_path, backend="numba", tokenizer=False, numerics=numerics)
    ran = []
    compiled = moe_glue._route
    monkeypatch.setattr(moe_glue, "_route", lambda *a: ran.append(1) or compiled(*a))
    got = generate(model)
    assert len(got) == len(want) > 5
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    assert bool(ran) == (numerics != "exact")
