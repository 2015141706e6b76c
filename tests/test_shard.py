"""The shard engine: chained shards equal the whole model bit for bit, the data contract, the KV-cache LRU,
and a shard's resident memory against the whole model's."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import namedtuple

import numpy as np
import pytest

import ggufpy
from conformance.fixtures import TinyLlama, write_tiny_llama
from ggufpy import shard as shard_module
from ggufpy.backend import BACKENDS
from ggufpy.constants import GGMLType
from ggufpy.kvcache import ContextLengthError
from ggufpy.numerics import NUMERICS
from ggufpy.shard import EvictedRequestError, RequestCaches, Shard, ShardEngine

PROMPT = np.array([[5, 77, 200, 3, 150, 42, 9, 260, 11, 99]], dtype=np.int64)  # (1, T)
DECODE = [17, 230, 4]  # tokens fed one at a time after the prompt
N_LAYERS = 4
# Every split of the 4 layers into 2 shards, and two 3-way splits (inclusive end layers)
SPLITS = [[(0, k), (k + 1, N_LAYERS - 1)] for k in range(N_LAYERS - 1)] + [
    [(0, 0), (1, 2), (3, 3)],
    [(0, 1), (2, 2), (3, 3)],
]
MODES = [(b, n) for b in BACKENDS for n in NUMERICS]  # every registered backend x numerics mode
# one kernel thread: on a busy 2-core machine numba's thread pool costs more than it gives on tiny models
BACKEND_OPTIONS = {"numba": {"threads": 1}}


@pytest.fixture(scope="module")
def quantized_tiny(tmp_path_factory):
    """4 layers with quantized weights, so llama.cpp numerics quantize activations (vec_dot types)."""
    T = GGMLType
    spec = TinyLlama(
        n_layers=N_LAYERS,
        types={"embd": T.Q4_1, "output": T.Q8_0, "attn": T.Q4_0, "ffn": T.Q5_1, "ffn_down": T.Q8_0},
        logit_std=4.0,
        seed=3,
    )
    return write_tiny_llama(tmp_path_factory.mktemp("shard") / "tiny-q.gguf", spec)


@pytest.fixture(scope="module")
def engines(quantized_tiny):
    """ShardEngine by (backend, numerics, start, end), loaded once per module."""
    loaded = {}

    def get(backend, numerics, start, end):
        key = (backend, numerics, start, end)
        if key not in loaded:
            options = BACKEND_OPTIONS.get(backend, {})
            loaded[key] = ShardEngine.load(quantized_tiny, start, end, backend=backend, numerics=numerics, **options)
        return loaded[key]

    return get


def run_chain(chain, request_id, x):
    for engine in chain:
        x = engine.forward(request_id, x)
    return x


def assert_split_equals_whole(whole, chain, request_id):
    """Prompt, then each decode token: the chain's logits equal the whole shard's, bit for bit."""
    for step, x in enumerate([PROMPT] + [np.array([[t]]) for t in DECODE]):
        expected = whole.forward(request_id, x)
        got = run_chain(chain, request_id, x)
        assert got.dtype == np.float32 and got.shape == expected.shape == (1, x.shape[1], whole.config.vocab_size)
        assert np.array_equal(got, expected), f"step {step}: split logits differ from the whole model's"


@pytest.mark.parametrize(("backend", "numerics"), MODES)
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "+".join(f"{a}..{b}" for a, b in s))
def test_split_equals_whole_bit_for_bit(engines, backend, numerics, split):
    whole = engines(backend, numerics, 0, N_LAYERS - 1)
    chain = [engines(backend, numerics, a, b) for a, b in split]
    assert_split_equals_whole(whole, chain, request_id=f"split-{split}")


@pytest.fixture(scope="module")
def smollm2_engines(smollm2_file):
    """Shard views of one loaded SmolLM2 per mode: they share the backend's dequantized weights, so the
    model is dequantized once (loading shards from the file is tested on the tiny model above)."""
    models = {}

    def get(backend, numerics, start, end):
        if (backend, numerics) not in models:
            options = {"cache_bytes": 1 << 30} if backend == "numpy" else BACKEND_OPTIONS.get(backend, {})
            models[backend, numerics] = ggufpy.load(smollm2_file, backend=backend, numerics=numerics, **options)
        return ShardEngine.view(models[backend, numerics], start, end)

    yield get
    models.clear()


def _real_model_modes():
    """numpy/exact by default; the other backend x numerics modes on the real model are slow (CI runs them)."""
    return [
        pytest.param(b, n, marks=() if (b, n) == ("numpy", "exact") else pytest.mark.slow)
        for b in BACKENDS
        for n in NUMERICS
    ]


@pytest.mark.parametrize(("backend", "numerics"), _real_model_modes())
def test_split_equals_whole_on_smollm2(smollm2_engines, backend, numerics):
    whole = smollm2_engines(backend, numerics, 0, 29)
    assert whole.is_first and whole.is_last
    for split in ([(0, 14), (15, 29)], [(0, 9), (10, 19), (20, 29)]):
        chain = [smollm2_engines(backend, numerics, a, b) for a, b in split]
        for step, x in enumerate([np.array([[1, 4093, 198, 19556, 905, 28]]), np.array([[30]]), np.array([[2]])]):
            assert np.array_equal(run_chain(chain, f"r{split}", x), whole.forward(f"r{split}", x)), (split, step)


def test_data_contract_shapes_and_dtypes(engines):
    first, middle, last = (engines("numpy", "exact", a, b) for a, b in [(0, 0), (1, 2), (3, 3)])
    assert (first.is_first, first.is_last, middle.is_first, middle.is_last, last.is_last) == (
        True,
        False,
        False,
        False,
        True,
    )
    D, V = first.config.dim, first.config.vocab_size
    h = first.forward("contract", PROMPT.astype(np.int32))  # any integer dtype
    assert h.shape == (1, PROMPT.shape[1], D) and h.dtype == np.float32
    h = middle.forward("contract", h)
    assert h.shape == (1, PROMPT.shape[1], D) and h.dtype == np.float32
    logits = last.forward("contract", h)
    assert logits.shape == (1, PROMPT.shape[1], V) and logits.dtype == np.float32
    with pytest.raises(ValueError, match=r"token ids of shape \(1, T\)"):
        first.forward("bad", PROMPT[0])  # no batch dimension
    with pytest.raises(ValueError, match="integer dtype"):
        first.forward("bad", PROMPT.astype(np.float32))
    with pytest.raises(ValueError, match=rf"hidden states of shape \(1, T, {D}\)"):
        middle.forward("bad", PROMPT)
    with pytest.raises(ValueError, match=rf"\(1, T, {D}\)"):
        last.forward("bad", np.zeros((1, 3, D + 1), np.float32))
    assert middle.position("bad") == 0  # a refused call leaves no cache behind


def test_position_is_implicit_and_requests_are_independent(engines):
    whole = engines("numpy", "exact", 0, N_LAYERS - 1)
    whole.forward("A", PROMPT)
    b = whole.forward("B", PROMPT[:, :4])
    assert whole.position("A") == PROMPT.shape[1] and whole.position("B") == 4
    a_next = whole.forward("A", np.array([[DECODE[0]]]))  # A continues at position 10, untouched by B
    fresh = whole.forward("A2", np.concatenate([PROMPT, [[DECODE[0]]]], axis=1))
    np.testing.assert_allclose(a_next[0, -1], fresh[0, -1], rtol=0, atol=1e-4 * np.abs(fresh).max())
    assert np.array_equal(whole.forward("B2", PROMPT[:, :4]), b)
    whole.forward("A", PROMPT, new_sequence=True)  # a new prompt under a reused id starts at 0
    assert whole.position("A") == PROMPT.shape[1]


def test_lru_evicts_least_recently_used_and_refuses_their_continuation(quantized_tiny):
    engine = ShardEngine.load(quantized_tiny, backend="numpy", max_requests=2)
    engine.forward("r1", PROMPT)
    engine.forward("r2", PROMPT)
    engine.forward("r1", np.array([[DECODE[0]]]))  # r1 is now the most recently used
    engine.forward("r3", PROMPT)  # evicts r2
    assert engine.caches.ids() == ["r1", "r3"]
    with pytest.raises(EvictedRequestError, match=r"request 'r2' was evicted .*max_requests=2"):
        engine.forward("r2", np.array([[DECODE[0]]]))
    engine.forward("r2", PROMPT, new_sequence=True)  # restarting it is fine (and evicts r1)
    assert engine.caches.ids() == ["r3", "r2"]
    engine.release("r3")
    assert engine.caches.ids() == ["r2"] and engine.position("r3") == 0
    assert engine.caches.nbytes > 0
    with pytest.raises(ValueError, match="at least 1"):
        RequestCaches(0)


def test_growing_cache_equals_preallocated(engines, monkeypatch):
    """Caches start small and double; the copy keeps every position, so results are unchanged."""
    monkeypatch.setattr(shard_module, "INITIAL_CACHE_POSITIONS", 4)
    whole = engines("numpy", "exact", 0, N_LAYERS - 1)
    model = whole.model
    cache = model.new_cache(capacity=64)
    expected = [model.forward(PROMPT[0, :3], 0, cache)]
    got = [whole.forward("grow", PROMPT[:, :3])[0]]
    assert whole.caches.get("grow").capacity == 4
    for pos, t in enumerate(PROMPT[0, 3:].tolist() + DECODE, start=3):
        expected.append(model.forward(np.array([t]), pos, cache))
        got.append(whole.forward("grow", np.array([[t]]))[0])
    assert whole.caches.get("grow").capacity == 16  # 4 -> 8 -> 16 for 13 positions
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))


def test_context_length_is_a_clear_error_and_keeps_the_request(engines):
    whole = engines("numpy", "exact", 0, N_LAYERS - 1)
    context = whole.config.context_length
    whole.forward("long", np.zeros((1, context - 2), np.int64))
    with pytest.raises(ContextLengthError, match=rf"request 'long': {context - 2} positions held plus 3 new"):
        whole.forward("long", np.zeros((1, 3), np.int64))
    assert whole.position("long") == context - 2
    whole.forward("long", np.zeros((1, 2), np.int64))
    assert whole.position("long") == context
    whole.release("long")


def test_view_shares_the_loaded_model(tiny_llama):
    first, last = ShardEngine.view(tiny_llama, 0, 1), ShardEngine.view(tiny_llama, 2, 2)
    assert first.model.weights is last.model.weights is tiny_llama.weights
    x = PROMPT % tiny_llama.config.vocab_size
    assert np.array_equal(last.forward("v", first.forward("v", x))[0], tiny_llama.logits(x[0]))
    with pytest.raises(ValueError, match="not within"):
        ShardEngine.view(tiny_llama, 2, 3)


def test_shard_record_and_duck_typing(tiny_llama_path):
    exo_like = namedtuple("ExoShard", "model_id start_layer end_layer n_layers")
    s = Shard.of(exo_like("m", 1, 2, 3))
    assert s == Shard("m", 1, 2, 3) and s.layers == range(1, 3) and s.get_layer_count() == 2
    assert (s.is_first_layer(), s.is_last_layer()) == (False, True)
    with pytest.raises(ValueError, match=r"layers 2\.\.1 \(inclusive\) are not a non-empty range within 0\.\.2"):
        Shard("m", 2, 1, 3)
    with pytest.raises(TypeError, match="has no end_layer"):
        Shard.of(namedtuple("Half", "model_id start_layer")("m", 0))
    engine = ShardEngine.load(tiny_llama_path, 1)  # end_layer defaults to the last layer
    assert (engine.start_layer, engine.end_layer, engine.n_layers) == (1, 2, 3)
    assert sorted(engine.model.weights.layers) == [1, 2]
    assert "layers 1..2 of 3" in repr(engine)


# -- resident memory ---------------------------------------------------------------------------------------

RSS_PROBE = r"""
import json, sys
import numpy as np
from ggufpy.shard import ShardEngine

def status():
    out = {k: int(v.split()[0]) // 1024 for k, _, v in (l.partition(":") for l in open("/proc/self/status"))
           if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    mapping, gguf = "", 0  # resident pages of the model file's memory map, from /proc/self/smaps
    for line in open("/proc/self/smaps"):
        f = line.split()
        if f and "-" in f[0] and len(f) >= 5:
            mapping = f[5] if len(f) > 5 else ""
        elif f and f[0] == "Rss:" and mapping.endswith(".gguf"):
            gguf += int(f[1])
    out["gguf"] = gguf // 1024
    return out

path, start, end, backend = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
options = {"cache_bytes": 0} if backend == "numpy" else {}  # no dequantized-weight cache: mapped bytes only
engine = ShardEngine.load(path, start, end, backend=backend, tokenizer=False, **options)
if engine.is_first:
    x = np.array([[1, 4093, 198, 19556, 905, 28, 357, 506]])
else:
    x = np.random.default_rng(0).standard_normal((1, 8, engine.config.dim)).astype(np.float32)
engine.forward("r", x)
print(json.dumps(status()))
"""


def measure_rss(path, start: int, end: int, backend: str = "numpy") -> dict[str, int]:
    """MB resident after one forward of an 8-token prompt through layers start..end, in a fresh process:
    VmRSS, VmHWM (peak), RssAnon, RssFile, and gguf (the model file's resident pages)."""
    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(path), str(start), str(end), backend],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_half_shard_maps_about_half_the_model(smollm2_file):
    """The first half of SmolLM2 touches its own layers and the prompt's embedding rows only."""
    full = measure_rss(smollm2_file, 0, 29)
    half = measure_rss(smollm2_file, 0, 14)
    assert half["gguf"] < 0.5 * full["gguf"], (half, full)
    assert half["VmRSS"] < full["VmRSS"] - 30, (half, full)
