"""The mixture-of-experts feed-forward (ggufpy/moe.py): llama.cpp's router steps (softmax, top-k order, weight
normalisation), experts read as views of the stacked tensors, only the chosen ones computed, and the whole
layer against llama.cpp (live, when llama-cpp-python imports) and through `ggufpy run` on both backends."""

from __future__ import annotations

import ctypes
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import ggufpy
from conformance import fixtures as fx
from conformance.fixtures_moe import MOE_FIXTURES, write_tiny_moe
from ggufpy import moe
from ggufpy.arch import ARCHITECTURES
from ggufpy.cli.inspect import human_count
from ggufpy.errors import GGUFMetadataError
from ggufpy.numerics import LLAMACPP_MODES, NUMERICS
from ggufpy.weights import ExpertTensor

FIXTURES = sorted(MOE_FIXTURES)


def _llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.skip("llama-cpp-python is not installed (pip install 'ggufpy[conformance]')")


@pytest.fixture(scope="module", params=FIXTURES)
def fixture(request):
    return request.param, fx.fixture_path(request.param)


# -- the router: top-k in libstdc++'s order, ggml's softmax ---------------------------------------------------------

# Rows with ties and what `std::sort(idx, idx + n, [&](a, b) { return x[a] > x[b]; })` gives for them (libstdc++ of
# gcc 12, the sort ggml's argsort runs): insertion sort below 17 elements, introsort above.
TIES = [
    ([0.25, 0.5, 0.25, 0.5, 0.125, 0.5, 0.25, 0.0], [1, 3, 5, 0, 2, 6, 4, 7]),
    (
        [3, 1, 3, 2, 3, 1, 2, 3, 0, 3, 1, 2, 3, 3, 2, 1, 3, 0, 3, 2],
        [2, 4, 18, 7, 16, 9, 0, 12, 13, 19, 3, 6, 11, 14, 10, 15, 5, 1, 8, 17],
    ),
    ([1] * 20, [10, 19, 18, 17, 16, 15, 14, 13, 12, 11, 0, 9, 8, 7, 6, 5, 4, 3, 2, 1]),
]


@pytest.mark.parametrize(("row", "order"), TIES)
def test_top_k_orders_ties_as_llamacpp_does(row, order):
    scores = np.asarray([row], np.float32)
    for k in (1, 2, 5, 8):
        assert moe.top_k(scores, k)[0].tolist() == order[:k]
    assert moe.libstdcxx_sort(list(range(len(row))), lambda a, b: row[a] > row[b]) == order


def test_top_k_without_ties_is_the_k_largest_in_descending_order():
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((50, 128)).astype(np.float32)
    chosen = moe.top_k(scores, 8)
    assert chosen.dtype == np.int32 and chosen.shape == (50, 8)
    np.testing.assert_array_equal(chosen, np.argsort(-scores, axis=1)[:, :8])


def test_heap_sort_fallback_sorts():
    """Introsort's heapsort (past 2 log2 n levels of bad pivots) is rarely reached; it must still sort."""
    rng = np.random.default_rng(1)
    row = rng.integers(0, 9, 300).tolist()
    v = list(range(300))
    moe._heap_sort(v, 0, 300, lambda a, b: row[a] > row[b])
    assert sorted(v) == list(range(300)) and [row[i] for i in v] == sorted(row, reverse=True)


def test_route_normalises_weights_where_the_architecture_does():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((16, 8)).astype(np.float32)
    normed = ARCHITECTURES["qwen3moe"].moe
    plain = ARCHITECTURES["qwen2moe"].moe
    chosen, w = moe.route(logits, normed, 2, moe.softmax_exact)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
    chosen2, w2 = moe.route(logits, plain, 2, moe.softmax_exact)
    np.testing.assert_array_equal(chosen, chosen2)
    probs = moe.softmax_exact(logits)
    np.testing.assert_array_equal(w2, np.take_along_axis(probs, chosen, axis=1))  # the probabilities as they are
    assert (w2.sum(axis=1) < 1).all()


def _ggml_op(make, x: np.ndarray, out_dtype) -> np.ndarray:
    """A one-node ggml graph `make(base, ctx, tensor)` on the rows of x (T, n) f32, computed by libggml-cpu."""
    from conformance.ggml_graph import _ggml, _InitParams

    base, cpu, _ = _ggml()
    x = np.ascontiguousarray(x, np.float32)
    T, n = x.shape
    ctx = base.ggml_init(_InitParams(16 * x.nbytes + (4 << 20), None, False))
    try:
        a = base.ggml_new_tensor_2d(ctx, 0, n, T)  # GGML_TYPE_F32
        ctypes.memmove(base.ggml_get_data(a), x.ctypes.data, x.nbytes)
        y = make(base, ctx, a)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, y)
        assert cpu.ggml_graph_compute_with_ctx(ctx, graph, 2) == 0
        out = np.empty((T, n), out_dtype)
        ctypes.memmove(out.ctypes.data, base.ggml_get_data(y), out.nbytes)
        return out
    finally:
        base.ggml_free(ctx)


def _soft_max(base, ctx, a):
    base.ggml_soft_max.argtypes, base.ggml_soft_max.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_void_p
    return base.ggml_soft_max(ctx, a)


def _argsort_desc(base, ctx, a):
    f = base.ggml_argsort
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
    return f(ctx, a, 1)  # GGML_SORT_ORDER_DESC


@pytest.mark.parametrize("n", [4, 8, 17, 20, 128])
def test_softmax_ggml_is_ggmls_soft_max_bit_for_bit(n):
    """Rows of n router logits: SIMD blocks of 16 (AVX-512) or 8 (AVX2) and the expf tail, both summed in
    double as ggml-cpu does, on the build llama-cpp-python was compiled for."""
    _llama_cpp()
    from conformance.llamacpp import host_isa

    x = (np.random.default_rng(n).standard_normal((64, n)) * 3).astype(np.float32)
    want = _ggml_op(_soft_max, x, np.float32)
    np.testing.assert_array_equal(moe.softmax_ggml(x, host_isa()), want)
    assert not np.array_equal(moe.softmax_exact(x), want)  # a plain f32 softmax rounds differently somewhere


def test_top_k_is_ggmls_argsort():
    _llama_cpp()
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.integers(0, 4, (32, 20)), rng.integers(0, 3, (32, 20))]).astype(np.float32)  # ties
    want = _ggml_op(_argsort_desc, x, np.int32)
    np.testing.assert_array_equal(moe.top_k(x, 20), want)


# -- weights: experts are views ------------------------------------------------------------------------------------


def test_experts_are_views_of_the_stacked_tensor(fixture):
    name, path = fixture
    model = ggufpy.load(path, backend="numpy", tokenizer=False)
    spec = MOE_FIXTURES[name]
    for w in model.weights.layers.values():
        for t in (w.ffn_gate_exps, w.ffn_up_exps, w.ffn_down_exps):
            assert isinstance(t, ExpertTensor) and t.shape[0] == spec.n_experts == len(t.experts)
            whole = ggufpy.quants.dequantize(model.file.raw(t.name), t.type, t.shape)  # (X, out, in)
            for e in (0, spec.n_experts - 1):
                x = t.expert(e)
                assert x.shape == t.shape[1:] and np.shares_memory(x.raw, model.file.raw(t.name))
                np.testing.assert_array_equal(x.dequantize(), whole[e])


def _all_experts_dense(model, x, w):
    """The layer's feed-forward with every expert computed for every token and weighted by zero unless chosen:
    the dense definition the routed computation must agree with."""
    cfg, arch = model.config, model.config.arch.moe
    logits = x @ w.ffn_gate_inp.dequantize().T
    chosen, weights = moe.route(logits, arch, cfg.n_experts_used, moe.softmax_exact)
    full = np.zeros((len(x), cfg.n_experts), np.float32)
    np.put_along_axis(full, chosen, weights, axis=1)
    stacks = (w.ffn_gate_exps, w.ffn_up_exps, w.ffn_down_exps)
    gate, up, down = (np.stack([e.dequantize() for e in t.experts]) for t in stacks)  # (X, out, in)
    out = np.zeros_like(x)
    for e in range(cfg.n_experts):
        h = x @ gate[e].T
        out += full[:, e : e + 1] * (((h / (1 + np.exp(-h))) * (x @ up[e].T)) @ down[e].T)
    if w.ffn_gate_shexp is not None:
        h = x @ w.ffn_gate_shexp.dequantize().T
        s = ((h / (1 + np.exp(-h))) * (x @ w.ffn_up_shexp.dequantize().T)) @ w.ffn_down_shexp.dequantize().T
        if arch.shared_gate is not None:
            s = s / (1 + np.exp(-(x @ w.ffn_gate_inp_shexp.dequantize().T)))
        out += s
    return out


def test_routed_experts_equal_the_dense_definition(fixture):
    _, path = fixture
    model = ggufpy.load(path, backend="numpy", tokenizer=False)
    x = np.random.default_rng(4).standard_normal((40, model.config.dim)).astype(np.float32)
    for w in model.weights.layers.values():
        ours = model.feed_forward(x, w)
        np.testing.assert_allclose(ours, _all_experts_dense(model, x, w), rtol=2e-5, atol=2e-6)


def test_only_the_chosen_experts_are_read(fixture):
    """One decode step on the numba backend multiplies by (and so packs, reads) K experts per layer and stacked
    tensor, no more."""
    pytest.importorskip("numba")
    name, path = fixture
    spec = MOE_FIXTURES[name]
    model = ggufpy.load(path, backend="numba", tokenizer=False)
    seen: dict[str, set] = {}

    def note(ws):
        for w in ws:
            stem, _, e = w.name.partition("[")
            if e:
                seen.setdefault(stem, set()).add(int(e[:-1]))

    be, linear, linears = model.backend, model.backend.linear, model.backend.linears
    be.linear = lambda x, w: note([w]) or linear(x, w)
    be.linears = lambda x, ws: note(ws) or linears(x, ws)
    model.logits([7])
    assert len(seen) == 3 * spec.n_layers
    assert all(len(experts) == spec.n_experts_used for experts in seen.values()), seen
    assert sum(w.name.endswith("]") for w in be._packed) <= 3 * spec.n_layers * spec.n_experts_used


# -- the whole model -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_decode_batch_rows_equal_single_decodes(fixture, backend):
    if backend == "numba":
        pytest.importorskip("numba")
    _, path = fixture
    model = ggufpy.load(path, backend=backend, tokenizer=False)
    prompts = [[5, 9, 40], [100, 3], [7, 8, 9, 10]]
    caches, singles, last = [], [], []
    for p in prompts:
        c1, c2 = model.new_cache(16), model.new_cache(16)
        model.forward(np.array(p[:-1]), 0, c1)
        model.forward(np.array(p[:-1]), 0, c2)
        caches.append(c1)
        singles.append(model.forward(np.array(p[-1:]), len(p) - 1, c2)[0])
        last.append(p[-1])
    batch = model.decode_batch(last, [len(p) - 1 for p in prompts], caches)
    np.testing.assert_array_equal(batch, np.stack(singles))


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_incremental_decode_equals_prefill(fixture, backend):
    """A 40-token prefill (the numba backend's BLAS path for the products of 16 rows or more) then one token at a
    time give the logits of one whole pass."""
    if backend == "numba":
        pytest.importorskip("numba")
    _, path = fixture
    model = ggufpy.load(path, backend=backend, tokenizer=False)
    tokens = np.random.default_rng(5).integers(3, 269, 48)
    full = model.logits(tokens)
    cache = model.new_cache(48)
    steps = [model.forward(tokens[:40], 0, cache)[-1]]
    steps += [model.forward(tokens[i : i + 1], i, cache)[0] for i in range(40, 48)]
    np.testing.assert_allclose(np.stack(steps), full[39:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_ggufpy_run_generates(fixture, backend, capsys):
    if backend == "numba":
        pytest.importorskip("numba")
    from ggufpy.cli import main

    _, path = fixture
    code = main(["run", "-m", str(path), "--backend", backend, "-p", "the", "-n", "6", "--temp", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    model = ggufpy.load(path, backend="numpy")
    ids = model.tokenizer.encode("the")
    greedy = []
    cache = model.new_cache(32)
    logits = model.forward(np.array(ids), 0, cache)[-1]
    for i in range(6):
        greedy.append(int(np.argmax(logits)))
        logits = model.forward(np.array(greedy[-1:]), len(ids) + i, cache)[0]
    assert model.tokenizer.decode(greedy) in out


def test_inspect_names_the_experts(fixture, capsys):
    from ggufpy.cli import main

    name, path = fixture
    spec = MOE_FIXTURES[name]
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("experts:"))
    assert line.startswith(f"experts:      {spec.n_experts}, {spec.n_experts_used} used per token")
    assert (f"width {spec.expert_hidden_dim}" in line) == ARCHITECTURES[spec.arch].moe.expert_width_key
    assert (f"shared expert width {spec.shared_hidden_dim}" in line) == bool(spec.shared_hidden_dim)
    stacked = 3 * spec.n_layers * spec.n_experts * spec.expert_hidden_dim * spec.dim
    with ggufpy.open(path) as f:
        total = sum(t.n_elements for t in f.tensors.values())
    active = total - stacked + stacked * spec.n_experts_used // spec.n_experts
    assert f"active per token: {human_count(active)} ({active:,})" in out


def test_more_experts_used_than_exist_is_a_metadata_error(tmp_path):
    path = write_tiny_moe(tmp_path / "bad.gguf", replace(MOE_FIXTURES["qwen3moe_f32"], n_experts=4, n_experts_used=5))
    with pytest.raises(GGUFMetadataError, match=r"qwen3moe.expert_used_count = 5: must be <= expert_count = 4"):
        ggufpy.load(path, tokenizer=False)


# -- against llama.cpp (live) ---------------------------------------------------------------------------------------


def test_moe_layer_is_llamacpps_bit_for_bit(fixture):
    """Teacher-forced: llama.cpp's `ffn_norm-N` through `moe.feed_forward` in the llamacpp numerics gives its
    `ffn_moe_logits`, `ffn_moe_probs`, `ffn_moe_topk` and the layer's feed-forward output, to the last bit, on the
    x86 build llama-cpp-python was compiled for (the llamacpp numerics mode replaying that build)."""
    _llama_cpp()
    from conformance.compare import Reference
    from conformance.llamacpp import host_isa
    from conformance.record import fixture_tokens

    name, path = fixture
    isa = host_isa()
    wanted = ("ffn_norm", "ffn_moe_logits", "ffn_moe_probs", "ffn_moe_topk", "ffn_moe_out", "ffn_out")
    ref = Reference.from_llamacpp(path, fixture_tokens(), 0, name=name, extra=lambda n: n.startswith(wanted))
    model = ggufpy.load(path, backend="numpy", tokenizer=False, numerics=LLAMACPP_MODES[isa])
    cfg = model.config
    for i, w in model.weights.layers.items():
        x = ref.tensors[f"ffn_norm-{i}"].reshape(len(ref.tokens), -1)
        logits = model.backend.linear(x, w.ffn_gate_inp)
        np.testing.assert_array_equal(logits, ref.tensors[f"ffn_moe_logits-{i}"].reshape(logits.shape))
        probs = moe.softmax_ggml(logits, isa)
        np.testing.assert_array_equal(probs, ref.tensors[f"ffn_moe_probs-{i}"].reshape(probs.shape))
        topk = ref.tensors[f"ffn_moe_topk-{i}"].reshape(len(x), -1).view(np.int32)
        np.testing.assert_array_equal(moe.top_k(probs, cfg.n_experts_used), topk)
        out = model.feed_forward(x, w)
        want = ref.tensors.get(f"ffn_out-{i}", ref.tensors.get(f"ffn_moe_out-{i}"))
        np.testing.assert_array_equal(out, want.reshape(out.shape))


def test_gpt_oss_moe_layer_is_llamacpps_bit_for_bit(tmp_path):
    """gpt-oss's feed-forward (router bias, the softmax over the chosen experts' logits, expert biases, the clamped
    `swiglu_oai`, which the fixture's large gate/up weights drive past its limit of 7), teacher-forced on
    llama.cpp's `attn_post_norm-N`, gives its `ffn_moe_out-N` to the last bit. gpt-oss's block (attention sinks,
    the attn_output bias) is not in ggufpy yet, so the layer's weights are loaded here on their own."""
    _llama_cpp()
    from conformance.compare import Reference
    from conformance.fixtures_moe import GPT_OSS, PENDING
    from conformance.llamacpp import host_isa
    from conformance.record import fixture_tokens
    from ggufpy.backend import NumpyBackend
    from ggufpy.config import ModelConfig
    from ggufpy.weights import expert_tensors

    path = write_tiny_moe(tmp_path / "gpt-oss.gguf", GPT_OSS)
    wanted = ("attn_post_norm", "ffn_moe_out", "ffn_moe_gate_biased")
    ref = Reference.from_llamacpp(path, fixture_tokens(), 0, name="gpt-oss", extra=lambda n: n.startswith(wanted))
    s, isa = GPT_OSS, host_isa()
    cfg = ModelConfig(
        **dict(arch=PENDING["gpt-oss"], dim=s.dim, hidden_dim=s.hidden_dim, n_layers=s.n_layers, n_heads=s.n_heads),
        **dict(n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, vocab_size=269, context_length=s.context_length),
        **dict(norm_eps=s.norm_eps, rope_theta=s.rope_theta, rope_dim=s.head_dim, n_experts=s.n_experts),
        **dict(n_experts_used=s.n_experts_used, expert_hidden_dim=s.expert_hidden_dim),
    )
    numerics = NUMERICS[LLAMACPP_MODES[isa]]
    replay = NumpyBackend(numerics)

    with ggufpy.open(path) as f:
        for i in range(s.n_layers):
            assert ref.tensors[f"ffn_moe_gate_biased-{i}"].max() > 7  # the clamp bites
            w = SimpleNamespace(ffn_gate_shexp=None, **expert_tensors(f, cfg, f"blk.{i}."))
            x = ref.tensors[f"attn_post_norm-{i}"].reshape(len(ref.tokens), -1)
            want = ref.tensors[f"ffn_moe_out-{i}"].reshape(x.shape)
            out = moe.feed_forward(x, w, cfg.arch.moe, s.n_experts_used, replay, numerics, None)
            np.testing.assert_array_equal(out, want)
            exact = moe.feed_forward(x, w, cfg.arch.moe, s.n_experts_used, NumpyBackend(), NUMERICS["exact"], None)
            np.testing.assert_allclose(exact, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K"])
def test_quantized_experts_are_llamacpps_bit_for_bit(tmp_path, monkeypatch, qtype):
    """`ggml_mul_mat_id` runs per expert what mul_mat would not: Q6_K experts with 8 or more routed rows take
    the tiled k-quant kernel and the others vec_dot row by row; Q4_K experts (repacked on x86) repack.cpp's
    gemv row by row, never the gemm. Every l_out, the final norm and the logits equal llama.cpp's (live)."""
    _llama_cpp()
    from conformance.compare import Reference, bit_differences
    from conformance.llamacpp import host_isa
    from conformance.record import fixture_tokens
    from ggufpy.constants import GGMLType

    t = GGMLType[qtype]
    spec = replace(
        MOE_FIXTURES["qwen3moe_f32"],
        dim=256,
        key_length=None,
        n_heads=4,
        expert_hidden_dim=256,
        types={"embd": GGMLType.F32, "output": GGMLType.F32, "attn": GGMLType.F32, "ffn": t},
    )
    path = write_tiny_moe(tmp_path / f"{qtype}.gguf", spec)
    ref = Reference.from_llamacpp(path, fixture_tokens(), 0, name=qtype)
    model = ggufpy.load(path, backend="numpy", tokenizer=False, numerics=LLAMACPP_MODES[host_isa()])
    rows = []
    per_expert = moe.mul_mat_id_rows
    monkeypatch.setattr(moe, "mul_mat_id_rows", lambda be, x, w: rows.append(len(x)) or per_expert(be, x, w))
    diffs = bit_differences(model, ref)
    assert len(diffs) == spec.n_layers + 2 and not any(diffs.values()), diffs
    assert min(rows) < 8 <= max(rows)  # experts on both sides of the tiled kernel's threshold


def test_shards_chain_to_the_whole_model(fixture):
    """Layer 0 on one shard, layer 1 on another (each mapping only its own experts) equal the whole model."""
    _, path = fixture
    tokens = np.random.default_rng(6).integers(3, 269, 10)
    whole = ggufpy.load(path, backend="numpy", tokenizer=False).logits(tokens)
    first = ggufpy.load(path, backend="numpy", tokenizer=False, layers=range(0, 1))
    second = ggufpy.load(path, backend="numpy", tokenizer=False, layers=range(1, 2))
    assert set(first.weights.layers) == {0} and set(second.weights.layers) == {1}
    h = first.forward(tokens, 0, first.new_cache(16))
    np.testing.assert_array_equal(second.forward(h, 0, second.new_cache(16)), whole)


def test_numba_in_llamacpp_numerics_equals_the_numpy_replay_on_quantized_experts():
    """Routed rows through the numba backend's integer kernels give the NumPy replay's logits bit for bit."""
    pytest.importorskip("numba")
    path = fx.fixture_path("qwen3moe_q4_0")
    tokens = np.random.default_rng(1).integers(3, 269, 12)
    mode = "llamacpp-avx2"
    numpy_logits = ggufpy.load(path, backend="numpy", tokenizer=False, numerics=mode).logits(tokens)
    numba_logits = ggufpy.load(path, backend="numba", tokenizer=False, numerics=mode).logits(tokens)
    np.testing.assert_array_equal(numba_logits, numpy_logits)


def test_a_mixture_of_experts_never_takes_the_fused_decode_block():
    """The numba fused decode block (kernels/layer.py) computes a dense feed-forward only."""
    from ggufpy.arch import ArchSpec, MoE

    assert ArchSpec("llama").fused_block()
    assert not ArchSpec("llama", moe=MoE()).fused_block()
    assert all(not spec.fused_block() for spec in ARCHITECTURES.values() if spec.moe is not None)
