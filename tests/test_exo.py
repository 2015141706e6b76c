"""`ggufpy.exo.GGUFInferenceEngine` driven the way exo drives its engines.

exo is not on PyPI, so these tests reproduce, with a duck-typed Shard, the two places exo uses an engine:
- exo's engine test, `exo/inference/test_inference_engine.py` at exo commit 5f18fae (the last commit with the
  legacy tree): a full shard against two half shards on two engines, prefill and one decode step;
- exo's node loop, `exo/orchestration/node.py` at 5f18fae (`process_prompt`, `process_tensor`,
  `process_inference_result`, `forward_prompt`, `forward_tensor`, `get_current_shard`), with the shard mapping
  of `exo/topology/partitioning_strategy.py` (`map_partitions_to_shards`) and tensors crossing as exo's gRPC
  transport sends them (`exo/networking/grpc/grpc_server.py`: bytes, shape, dtype string).
`scripts/exo_engine_test.py` runs exo's own test module and exo's own Node class against a checkout of exo.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
import time
import types
from abc import ABC, abstractmethod
from collections import namedtuple
from typing import ClassVar

import numpy as np
import pytest

import ggufpy
import ggufpy.exo
from ggufpy.backend import BACKENDS
from ggufpy.chat import ChatTemplate
from ggufpy.exo import GGUFInferenceEngine, available_models, resolve_model
from ggufpy.generation import generate_text
from ggufpy.hf import HFStyleTokenizer
from ggufpy.numerics import NUMERICS
from ggufpy.sampling import SamplingParams

# exo's Shard has these four fields; the engine must accept any object that has them
ExoShard = namedtuple("ExoShard", "model_id start_layer end_layer n_layers")
MODES = [(b, n) for b in BACKENDS for n in NUMERICS]
BACKEND_OPTIONS = {"numba": {"threads": 1}, "numpy": {"cache_bytes": 1 << 30}}
EXO_TEST_PROMPT = "In a single word only, what is the last name of the current president of the USA?"


def engine_pair(backend="numpy", numerics="exact"):
    options = BACKEND_OPTIONS.get(backend, {})
    return (
        GGUFInferenceEngine(None, backend=backend, numerics=numerics, **options),
        GGUFInferenceEngine(None, backend=backend, numerics=numerics, **options),
    )


def shutdown(*engines):
    for engine in engines:
        engine.executor.shutdown()


# -- exo's engine test ------------------------------------------------------------------------------------


async def exo_engine_test(engine_1, engine_2, model_id: str, n_layers: int, prompt: str = EXO_TEST_PROMPT):
    """The procedure of exo's `test_inference_engine` (exo/inference/test_inference_engine.py @ 5f18fae)."""
    full = ExoShard(model_id, 0, n_layers - 1, n_layers)
    resp_full, _ = await engine_1.infer_prompt("A", shard=full, prompt=prompt)
    token_full = (await engine_1.sample(resp_full)).reshape(1, -1)
    next_resp_full, _ = await engine_1.infer_tensor("A", shard=full, input_data=token_full)

    pp = n_layers // 2
    first, second = ExoShard(model_id, 0, pp, n_layers), ExoShard(model_id, pp + 1, n_layers - 1, n_layers)
    resp1, _ = await engine_1.infer_prompt("B", shard=first, prompt=prompt)
    resp2, _ = await engine_2.infer_tensor("B", shard=second, input_data=resp1)
    tokens2 = (await engine_1.sample(resp2)).reshape(1, -1)
    resp3, _ = await engine_1.infer_tensor("B", shard=first, input_data=tokens2)
    resp4, _ = await engine_2.infer_tensor("B", shard=second, input_data=resp3)

    assert np.array_equal(resp_full, resp2)
    assert np.array_equal(next_resp_full, resp4)
    return resp_full, resp1, token_full


@pytest.mark.parametrize(("backend", "numerics"), MODES)
def test_exo_engine_test_on_tiny_model(tiny_llama_path, backend, numerics):
    engines = engine_pair(backend, numerics)
    logits, hidden, token = asyncio.run(exo_engine_test(*engines, str(tiny_llama_path), 3))
    shutdown(*engines)
    assert logits.dtype == hidden.dtype == np.float32
    assert logits.shape[::2] == (1, 269) and hidden.shape[::2] == (1, 256) and logits.shape[1] == hidden.shape[1]
    assert token.shape == (1, 1) and token.dtype == np.int64


def _real_model_modes():
    return [
        pytest.param(b, n, marks=() if (b, n) == ("numpy", "exact") else pytest.mark.slow)
        for b in BACKENDS
        for n in NUMERICS
    ]


@pytest.mark.parametrize(("backend", "numerics"), _real_model_modes())
def test_exo_engine_test_on_smollm2(smollm2_file, backend, numerics):
    # The NumPy replay of llama.cpp's kernels is slow per position; the law (two half shards give the whole
    # model's logits, prefill and decode) does not depend on the prompt's length, so that mode gets 5 tokens.
    prompt = "The capital of France is" if (backend, numerics) == ("numpy", "llamacpp") else EXO_TEST_PROMPT
    engines = engine_pair(backend, numerics)
    logits, hidden, _ = asyncio.run(exo_engine_test(*engines, "smollm2", 30, prompt))
    shutdown(*engines)
    assert hidden.shape == (1, logits.shape[1], 576) and logits.shape[2] == 49152
    assert logits.shape[1] == len(ggufpy.load_tokenizer(smollm2_file).encode(prompt))


# -- exo's node loop --------------------------------------------------------------------------------------

Partition = namedtuple("Partition", "node_id start end")  # exo/topology/partitioning_strategy.py


def map_partitions_to_shards(partitions, n_layers: int, model_id: str) -> list[ExoShard]:
    """exo's mapping of [start, end) fractions to inclusive layer ranges: the last shard ends at the last
    layer, empty shards are dropped (partitioning_strategy.py `map_partitions_to_shards` @ 5f18fae)."""
    shards = []
    for i, p in enumerate(partitions):
        start, end = int(p.start * n_layers), int(p.end * n_layers) - 1
        if i == len(partitions) - 1:
            end = n_layers - 1
        if start <= end:
            shards.append(ExoShard(model_id, start, end, n_layers))
    if shards and shards[-1].end_layer < n_layers - 1:
        shards[-1] = ExoShard(model_id, shards[-1].start_layer, n_layers - 1, n_layers)
    return shards


def over_the_wire(tensor: np.ndarray) -> np.ndarray:
    """A tensor as exo's gRPC peers receive it: raw bytes, shape and `str(dtype)` (grpc_server.py SendTensor)."""
    data, shape, dtype = tensor.tobytes(), list(tensor.shape), str(tensor.dtype)
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


class RingNode:
    """exo's `Node` reduced to its inference path (exo/orchestration/node.py @ 5f18fae).

    The last shard samples (`engine.sample(result, temp=default_sample_temperature)`), appends the token to
    the request's buffer, finishes on `tokenizer.eos_token_id` or `max_generate_tokens`, calls its on_token
    callbacks and sends the result to every peer; an unfinished result goes to the next partition (the ring
    wraps, so the token goes back to the first shard as `token.reshape(1, -1)`), through a new task.
    """

    def __init__(self, node_id, engine, partitions, max_generate_tokens, default_sample_temperature=0.0):
        self.id, self.inference_engine, self.partitions = node_id, engine, partitions
        self.max_generate_tokens = max_generate_tokens
        self.default_sample_temperature = default_sample_temperature
        self.peers: dict[str, RingNode] = {}
        self.buffered_token_output: dict[str, tuple[list[int], bool]] = {}
        self.outstanding_requests: dict[str, str] = {}
        self.on_token = []  # callbacks (request_id, tokens, is_finished)
        self.tasks = []

    def get_partition_index(self, offset=0):
        current = next(i for i, p in enumerate(self.partitions) if p.node_id == self.id)
        return (current + offset) % len(self.partitions)

    def get_current_shard(self, base_shard, index=None):
        index = self.get_partition_index() if index is None else index
        return map_partitions_to_shards(self.partitions, base_shard.n_layers, base_shard.model_id)[index]

    async def process_prompt(self, base_shard, prompt, request_id, inference_state=None):
        shard = self.get_current_shard(base_shard)
        if shard.start_layer != 0:  # not the first layer: hand the prompt to partition 0
            self.outstanding_requests[request_id] = "waiting"
            await self.forward_prompt(shard, prompt, request_id, 0, inference_state)
            return
        self.outstanding_requests[request_id] = "processing"
        result, inference_state = await self.inference_engine.infer_prompt(request_id, shard, prompt, inference_state)
        await self.process_inference_result(shard, result, request_id, inference_state)

    async def process_tensor(self, base_shard, tensor, request_id, inference_state=None):
        shard = self.get_current_shard(base_shard)
        self.outstanding_requests[request_id] = "processing"
        result, inference_state = await self.inference_engine.infer_tensor(request_id, shard, tensor, inference_state)
        await self.process_inference_result(shard, result, request_id, inference_state)

    async def process_inference_result(self, shard, result, request_id, inference_state):
        is_last = shard.end_layer == shard.n_layers - 1
        tokens, _ = self.buffered_token_output.setdefault(request_id, ([], False))
        is_finished = len(tokens) >= self.max_generate_tokens
        if is_last and not is_finished:
            token = await self.inference_engine.sample(result, temp=self.default_sample_temperature)
            await self.inference_engine.ensure_shard(shard)
            tokens.append(token.item())
            is_finished = (
                token.item() == self.inference_engine.tokenizer.eos_token_id
                or is_finished
                or len(tokens) >= self.max_generate_tokens
            )
            forward, intermediate_result = token.reshape(1, -1), [tokens[-1]]
        else:
            forward = result
        if is_last:
            for callback in self.on_token:
                callback(request_id, intermediate_result, is_finished)
            for peer in self.peers.values():  # broadcast_result -> the peer's SendResult -> its on_token
                for callback in peer.on_token:
                    callback(request_id, list(intermediate_result), is_finished)
        if is_finished:
            self.buffered_token_output[request_id] = (tokens, True)
            self.outstanding_requests.pop(request_id)
        else:
            self.outstanding_requests[request_id] = "waiting"
            target = self.get_partition_index(offset=1)
            self.tasks.append(
                asyncio.create_task(self.forward_tensor(shard, forward, request_id, target, inference_state))
            )

    def _target(self, index):
        node_id = self.partitions[index].node_id
        return self if node_id == self.id else self.peers[node_id]

    async def forward_prompt(self, base_shard, prompt, request_id, target_index, inference_state=None):
        next_shard = self.get_current_shard(base_shard, target_index)
        await self._target(target_index).process_prompt(next_shard, prompt, request_id, inference_state)

    async def forward_tensor(self, base_shard, tensor, request_id, target_index, inference_state=None):
        next_shard = self.get_current_shard(base_shard, target_index)
        target = self._target(target_index)
        await target.process_tensor(next_shard, tensor if target is self else over_the_wire(tensor), request_id)


async def generate_on_ring(engines, model_id, n_layers, prompt, max_tokens, entry=0):
    """exo/main.py `run_model_cli`: the prompt goes to one node with the base shard Shard(model, 0, 0, n);
    tokens arrive through that node's on_token callbacks until one says the request is finished."""
    ids = [f"node-{i}" for i in range(len(engines))]
    partitions = [Partition(ids[i], i / len(ids), (i + 1) / len(ids)) for i in range(len(ids))]
    nodes = [RingNode(i, e, partitions, max_tokens) for i, e in zip(ids, engines, strict=True)]
    for node in nodes:
        node.peers = {other.id: other for other in nodes if other is not node}
    tokens, finished = [], asyncio.Event()

    def on_token(request_id, new_tokens, is_finished):
        tokens.extend(new_tokens)
        if is_finished:
            finished.set()

    nodes[entry].on_token.append(on_token)
    await nodes[entry].process_prompt(ExoShard(model_id, 0, 0, n_layers), prompt, request_id="req-1")
    await asyncio.wait_for(finished.wait(), timeout=120)
    for node in nodes:
        await asyncio.gather(*node.tasks)
    return tokens


def chat_prompt(path, question):
    """The prompt string exo's API and CLI build: the chat template, rendered, not tokenized."""
    tok = HFStyleTokenizer(ggufpy.load_tokenizer(path))
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def assert_ring_equals_single(path, model_id, n_layers, n_nodes, max_tokens, entry=0, **options):
    prompt = chat_prompt(path, "What is the capital of France? Answer in one sentence.")
    ring_engines = [GGUFInferenceEngine(None, **options) for _ in range(n_nodes)]
    single = GGUFInferenceEngine(None, **options)
    ring = asyncio.run(generate_on_ring(ring_engines, model_id, n_layers, prompt, max_tokens, entry=entry))
    alone = asyncio.run(generate_on_ring([single], model_id, n_layers, prompt, max_tokens))
    shapes = {(e.engine.start_layer, e.engine.end_layer) for e in ring_engines}
    assert len(shapes) == n_nodes  # the ring really ran on n different shards
    assert ring == alone

    # and ggufpy's own greedy generation of the same prompt
    model = single.engine.model
    ids = single._encode(prompt)
    ref = generate_text(model, model.tokenizer, ids, max_tokens=max_tokens, sampling=SamplingParams.greedy())
    tok = single.tokenizer
    ends_at_eos = ring[-1] == tok.eos_token_id
    text = tok.decode(ring[:-1] if ends_at_eos else ring)
    n = len(ref.token_ids)
    assert ring[:n] == list(ref.token_ids)  # exo stops at eos only; ggufpy at any end-of-generation token
    if ref.finish_reason != "eog" or ends_at_eos:
        assert text == ref.text
    shutdown(*ring_engines, single)
    return text


def test_exo_ring_generates_single_engine_text_on_smollm2(smollm2_file):
    text = assert_ring_equals_single(
        smollm2_file, "smollm2", 30, n_nodes=2, max_tokens=24, backend="numpy", cache_bytes=1 << 30
    )
    assert "Paris" in text


@pytest.mark.parametrize("entry", [0, 2], ids=["prompt-at-first-node", "prompt-at-last-node"])
def test_exo_ring_of_three_on_tiny_model(tiny_llama_path, entry):
    assert_ring_equals_single(
        tiny_llama_path, str(tiny_llama_path), 3, n_nodes=3, max_tokens=12, entry=entry, backend="numpy"
    )


def test_ring_shard_mapping_matches_exo():
    parts = [Partition("a", 0.0, 0.5), Partition("b", 0.5, 1.0)]
    assert map_partitions_to_shards(parts, 30, "m") == [ExoShard("m", 0, 14, 30), ExoShard("m", 15, 29, 30)]
    parts = [Partition("a", 0.0, 0.34), Partition("b", 0.34, 0.67), Partition("c", 0.67, 1.0)]
    assert [(s.start_layer, s.end_layer) for s in map_partitions_to_shards(parts, 3, "m")] == [(0, 0), (1, 1), (2, 2)]


# -- the engine's own surface -----------------------------------------------------------------------------


@pytest.fixture()
def engine():
    e = GGUFInferenceEngine(None, backend="numpy", seed=0)
    yield e
    e.executor.shutdown()


def test_sample_is_greedy_by_default_and_seeded_otherwise(engine):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((1, 3, 50)).astype(np.float32)
    token = asyncio.run(engine.sample(logits))
    assert token.shape == (1,) and token.dtype == np.int64 and token[0] == np.argmax(logits[0, -1])
    assert asyncio.run(engine.sample(logits, temp=1.0, top_p=1e-6))[0] == np.argmax(logits[0, -1])
    seeded = [GGUFInferenceEngine(None, seed=7) for _ in range(2)]
    draws = [asyncio.run(e.sample(logits, temp=1.5))[0] for e in seeded]
    assert draws[0] == draws[1]
    shutdown(*seeded)


def test_tokens_and_tokenizer(engine, tiny_llama_path):
    shard = ExoShard(str(tiny_llama_path), 0, 2, 3)
    text = "<|im_start|>user\nthe rain in spain<|im_end|>\n"
    ids = asyncio.run(engine.encode(shard, text))
    tok = ggufpy.load_tokenizer(tiny_llama_path)
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert ids.tolist() == tok.encode(text, parse_special=True)
    assert ids[0] == 1  # "<|im_start|>" is parsed as a special token
    assert asyncio.run(engine.decode(shard, ids.reshape(1, -1))) == text
    t = engine.tokenizer
    assert (t.eos_token_id, t.bos_token_id, t.eos_token) == (tok.eos_id, tok.bos_id, "<|endoftext|>")
    assert t.encode(text) == ids.tolist()
    messages = [{"role": "user", "content": "hi"}]
    rendered = ChatTemplate.from_tokenizer(tok).render(messages, add_generation_prompt=True)
    assert t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    assert t.apply_chat_template(messages, add_generation_prompt=True) == tok.encode(rendered, parse_special=True)


def test_infer_prompt_starts_the_request_afresh(engine, tiny_llama_path):
    shard = ExoShard(str(tiny_llama_path), 0, 2, 3)
    first, _ = asyncio.run(engine.infer_prompt("r", shard, "the rain"))
    again, state = asyncio.run(engine.infer_prompt("r", shard, "the rain", {"k": 1}))
    assert np.array_equal(first, again) and state == {"k": 1}
    assert engine.engine.position("r") == first.shape[1]


def test_shard_switch_reloads_and_drops_caches(engine, tiny_llama_path):
    path = str(tiny_llama_path)
    asyncio.run(engine.infer_prompt("r", ExoShard(path, 0, 1, 3), "the rain"))
    loaded = engine.engine
    asyncio.run(engine.ensure_shard(ExoShard(path, 0, 1, 3)))
    assert engine.engine is loaded  # the same shard is not reloaded
    asyncio.run(engine.ensure_shard(ExoShard(path, 2, 2, 3)))
    assert engine.engine is not loaded and engine.engine.layers == range(2, 3) and len(engine.engine.caches) == 0
    assert engine.shard == ExoShard(path, 2, 2, 3)  # the object exo passed, kept as exo's engines keep it
    with pytest.raises(ValueError, match=r"has 3 layers but the shard .* says n_layers=16"):
        asyncio.run(engine.ensure_shard(ExoShard(path, 0, 7, 16)))


def test_compute_runs_in_the_executor_not_the_event_loop(engine, tiny_llama_path):
    """A slow forward pass must leave the event loop free (exo issue #325: no blocking in engines)."""
    shard = ExoShard(str(tiny_llama_path), 0, 2, 3)
    asyncio.run(engine.ensure_shard(shard))
    threads, forward = [], engine.engine.forward

    def slow_forward(*args):
        threads.append(threading.current_thread().name)
        time.sleep(0.3)
        return forward(*args)

    engine.engine.forward = slow_forward

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await engine.infer_tensor("r", shard, np.array([[3, 4, 5]]))
        task.cancel()
        return ticks

    assert asyncio.run(main()) >= 10
    assert threads == ["ggufpy-exo_0"]


def test_model_ids_resolve_to_local_files(tmp_path, tiny_llama_path):
    models = tmp_path / "models"
    (models / "HuggingFaceTB--Tiny").mkdir(parents=True)
    (models / "HuggingFaceTB--Tiny" / "tiny.gguf").write_bytes(tiny_llama_path.read_bytes())
    (models / "flat.gguf").write_bytes(tiny_llama_path.read_bytes())
    assert resolve_model(tiny_llama_path) == tiny_llama_path
    assert resolve_model(tiny_llama_path.parent) == tiny_llama_path
    assert resolve_model("HuggingFaceTB/Tiny", [models]) == models / "HuggingFaceTB--Tiny" / "tiny.gguf"
    assert resolve_model("flat", [models]) == models / "flat.gguf"
    with pytest.raises(FileNotFoundError, match=r"model id 'nope' names no GGUF file; tried nope, .*models/nope"):
        resolve_model("nope", [models])
    (models / "HuggingFaceTB--Tiny" / "other.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="several models"):
        resolve_model("HuggingFaceTB/Tiny", [models])
    found = available_models([models])
    assert found["flat"] == models / "flat.gguf" and "HuggingFaceTB--Tiny" not in found


def test_packaged_model_ids(smollm2_file):
    assert resolve_model("smollm2") == resolve_model("SmolLM2-135M-Instruct") == smollm2_file
    assert available_models()["smollm2"] == smollm2_file


def test_unknown_ids_go_to_the_shard_downloader(tmp_path, tiny_llama_path):
    calls = []

    class Downloader:
        async def ensure_shard(self, shard, engine_name):
            calls.append((shard.model_id, engine_name))
            return tiny_llama_path.parent

    engine = GGUFInferenceEngine(Downloader(), backend="numpy")
    out, _ = asyncio.run(engine.infer_prompt("r", ExoShard("org/tiny-model", 0, 2, 3), "the rain"))
    assert calls == [("org/tiny-model", "GGUFInferenceEngine")] and out.shape[2] == 269
    engine.executor.shutdown()


def test_checkpoints_and_sessions(engine, tiny_llama_path):
    shard = ExoShard("any-name", 0, 2, 3)
    asyncio.run(engine.load_checkpoint(shard, str(tiny_llama_path)))
    assert engine.model_path == tiny_llama_path and engine.engine.layers == range(0, 3)
    with pytest.raises(NotImplementedError, match="inference only"):
        asyncio.run(engine.save_checkpoint(shard, "x"))
    asyncio.run(engine.save_session("k", 1))
    assert engine.session == {"k": 1}
    asyncio.run(engine.clear_session())
    assert engine.session == {}


def test_subclasses_exos_abc_when_exo_is_importable(monkeypatch):
    """With exo importable, the engine is an `InferenceEngine` and implements every abstract method."""

    class InferenceEngine(ABC):  # the abstract methods of exo/inference/inference_engine.py @ 5f18fae
        session: ClassVar[dict] = {}  # exo shares one dict across engines

        @abstractmethod
        async def encode(self, shard, prompt): ...

        @abstractmethod
        async def sample(self, x): ...

        @abstractmethod
        async def decode(self, shard, tokens): ...

        @abstractmethod
        async def infer_tensor(self, request_id, shard, input_data, inference_state=None): ...

        @abstractmethod
        async def load_checkpoint(self, shard, path): ...

    for name in ("exo", "exo.inference"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    fake = types.ModuleType("exo.inference.inference_engine")
    fake.InferenceEngine = InferenceEngine
    monkeypatch.setitem(sys.modules, "exo.inference.inference_engine", fake)
    spec = importlib.util.spec_from_file_location("ggufpy._exo_with_exo", ggufpy.exo.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.EXO_AVAILABLE and issubclass(module.GGUFInferenceEngine, InferenceEngine)
    engine = module.GGUFInferenceEngine(None)  # would raise TypeError if an abstract method were missing
    assert engine.session == {} and engine.session is not InferenceEngine.session
    engine.executor.shutdown()


def test_standalone_without_exo():
    base = GGUFInferenceEngine.__mro__[1]
    if ggufpy.exo.EXO_AVAILABLE:
        assert base.__module__ == "exo.inference.inference_engine"
    else:
        assert base is object
    for name in ("encode", "decode", "sample", "infer_tensor", "infer_prompt", "ensure_shard", "load_checkpoint"):
        assert asyncio.iscoroutinefunction(getattr(GGUFInferenceEngine, name)), name
