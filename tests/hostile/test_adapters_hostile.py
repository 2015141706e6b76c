"""Hostile input to the adapters (shard engine, exo engine, HF facade): every row is a crafted call and the
exact error it must raise; the scenarios below are the findings of issue 11 that need several calls
(the same request id in flight twice, an evicted request continued long after, the context limit reached).

Each row: id, a call on the `Adapters` fixture, the exception class, a fragment of its message.
"""

from __future__ import annotations

import asyncio
from collections import namedtuple
from dataclasses import dataclass

import gguf
import numpy as np
import pytest

import ggufpy
from conformance.fixtures import TinyLlama, write_tiny_llama
from ggufpy.errors import GGUFError
from ggufpy.exo import GGUFInferenceEngine, RequestInFlightError
from ggufpy.hf import GGUFModelForCausalLM
from ggufpy.kvcache import ContextLengthError
from ggufpy.shard import EvictedRequestError, RequestCaches, RequestPositionError, Shard, ShardEngine

ExoShard = namedtuple("ExoShard", "model_id start_layer end_layer n_layers")  # exo's Shard fields
V, D, CONTEXT = 269, 256, 256  # the tiny model's vocabulary, dim and context length
IDS = np.array([[5, 77, 200, 3]])  # (1, T)


@dataclass
class Adapters:
    path: object
    whole: ShardEngine  # layers 0..2 of 3
    middle: ShardEngine  # layer 1
    hf: GGUFModelForCausalLM
    exo: GGUFInferenceEngine

    def shard(self, start=0, end=2):
        return ExoShard(str(self.path), start, end, 3)

    def run(self, coro):
        return asyncio.run(coro)

    def other_model_cache(self):
        other = GGUFModelForCausalLM.from_pretrained(self.path, backend="numpy")
        return other(IDS, use_cache=True).past_key_values

    def sample(self, x, *args, **kwargs):
        """exo samples on the engine that holds the last shard."""

        async def go():
            await self.exo.ensure_shard(self.shard())
            return await self.exo.sample(x, *args, **kwargs)

        return asyncio.run(go())


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_path):
    """The tiny model on the NumPy backend (no kernel compilation for these short calls)."""
    return ggufpy.load(tiny_llama_path, backend="numpy")


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tiny_llama):
    exo = GGUFInferenceEngine(None, backend="numpy")
    yield Adapters(
        tiny_llama_path,
        ShardEngine.view(tiny_llama, 0, 2),
        ShardEngine.view(tiny_llama, 1, 1),
        GGUFModelForCausalLM(tiny_llama),
        exo,
    )
    exo.executor.shutdown()


def hidden(dtype=np.float32, value=0.0, T=2):
    return np.full((1, T, D), value, dtype)


# (id, call, exception, message fragment)
ROWS = [
    # -- shard engine: ids, hidden states, positions, request ids, layer ranges --------------------------
    ("shard-token-id-past-vocab", lambda a: a.whole.forward("r", np.array([[5, V]])), ValueError,
     f"token id {V} is outside the vocabulary [0, {V})"),
    ("shard-negative-token-id", lambda a: a.whole.forward("r", np.array([[-1]])), ValueError,
     "token id -1 is outside the vocabulary"),
    ("shard-float-token-ids", lambda a: a.whole.forward("r", IDS.astype(np.float32)), ValueError,
     "integer dtype"),
    ("shard-float16-hidden", lambda a: a.middle.forward("r", hidden(np.float16)), ValueError,
     f"hidden states of shape (1, T, {D}) float32, got float16"),
    ("shard-float64-hidden", lambda a: a.middle.forward("r", hidden(np.float64)), ValueError,
     "float32, got float64"),
    ("shard-nan-hidden", lambda a: a.middle.forward("r", hidden(value=np.nan)), ValueError,
     "hidden states are not finite"),
    ("shard-inf-hidden", lambda a: a.middle.forward("r", hidden(value=np.inf)), ValueError,
     "hidden states are not finite"),
    ("shard-hidden-without-batch", lambda a: a.middle.forward("r", hidden()[0]), ValueError,
     f"(1, T, {D})"),
    ("shard-empty-hidden", lambda a: a.middle.forward("r", hidden(T=0)), ValueError, f"(1, T, {D})"),
    ("shard-negative-position", lambda a: a.whole.forward("r", IDS, position=-1), ValueError,
     "position must be an integer >= 0, got -1"),
    ("shard-float-position", lambda a: a.whole.forward("r", IDS, position=1.5), ValueError,
     "position must be an integer >= 0, got 1.5"),
    ("shard-huge-position-unknown-id", lambda a: a.whole.forward("never", IDS, position=10**12), EvictedRequestError,
     f"continues at position {10**12} but this shard holds no positions for it"),
    ("shard-new-sequence-not-at-0", lambda a: a.whole.forward("r", IDS, new_sequence=True, position=3), ValueError,
     "a new sequence starts at position 0, not 3"),
    ("shard-int-request-id", lambda a: a.whole.forward(123, IDS), TypeError, "a request id must be a str, got 123"),
    ("shard-list-request-id", lambda a: a.whole.forward(["r"], IDS), TypeError, "a request id must be a str"),
    ("shard-record-float-layer", lambda a: Shard.of(ExoShard("m", 1.7, 2, 3)), TypeError,
     "shard start_layer must be an integer, got 1.7"),
    ("shard-record-string-layer", lambda a: Shard.of(ExoShard("m", 0, "2", 3)), TypeError,
     "shard end_layer must be an integer, got '2'"),
    ("shard-load-float-start", lambda a: ShardEngine.load(a.path, 1.0), TypeError,
     "start_layer must be an integer, got 1.0"),
    ("shard-load-negative-start", lambda a: ShardEngine.load(a.path, -1, 1), ValueError,
     "is not a non-empty range within 0..3"),
    ("shard-load-end-past-model", lambda a: ShardEngine.load(a.path, 0, 3), ValueError,
     "is not a non-empty range within 0..3"),
    ("shard-view-float-end", lambda a: ShardEngine.view(a.whole.model, 0, 1.5), TypeError,
     "end_layer must be an integer, got 1.5"),
    ("shard-view-reversed", lambda a: ShardEngine.view(a.whole.model, 2, 1), ValueError,
     "end_layer 1 is before start_layer 2"),
    ("shard-max-requests-float", lambda a: RequestCaches(2.5), ValueError,
     "max_requests must be an integer of at least 1, got 2.5"),
    # -- HF facade: ids, masks, generation options ---------------------------------------------------
    ("hf-generate-float-ids", lambda a: a.hf.generate(np.array([[5.0, 6.7]]), max_new_tokens=1), ValueError,
     "input_ids must be integer ids of shape (batch, T)"),
    ("hf-forward-float-ids", lambda a: a.hf(np.array([[5.0, 6.7]])), ValueError, "input_ids must be integer ids"),
    ("hf-ids-past-vocab", lambda a: a.hf.generate(np.array([[5, V + 3]])), ValueError,
     f"input_ids: token id {V + 3} is outside the vocabulary [0, {V})"),
    ("hf-negative-id", lambda a: a.hf(np.array([[-2, 5]])), ValueError, "input_ids: token id -2 is outside"),
    ("hf-3d-ids", lambda a: a.hf.generate(IDS[None]), ValueError, "shape (batch, T)"),
    ("hf-ragged-ids", lambda a: a.hf.generate([[5, 6, 7], [8]]), ValueError, "input_ids rows have different lengths"),
    ("hf-empty-batch", lambda a: a.hf.generate(np.zeros((0, 3), np.int64)), ValueError, "batch >= 1"),
    ("hf-mask-2", lambda a: a.hf(IDS, attention_mask=np.array([[1, 2, 1, 1]])), ValueError,
     "attention_mask must hold only 0 and 1, got 2"),
    ("hf-mask-negative", lambda a: a.hf(IDS, attention_mask=np.array([[1, -1, 1, 1]])), ValueError,
     "only 0 and 1, got -1"),
    ("hf-mask-half", lambda a: a.hf(IDS, attention_mask=np.array([[1, 0.5, 1, 1]])), ValueError,
     "attention_mask must hold 0/1 integers or bools, got dtype float64"),
    ("hf-mask-nan", lambda a: a.hf.generate(IDS, attention_mask=np.array([[1, np.nan, 1, 1]])), ValueError,
     "0/1 integers or bools"),
    ("hf-generate-masked-row", lambda a: a.hf.generate(np.array([IDS[0], IDS[0]]),
                                                       attention_mask=np.array([[1] * 4, [0] * 4])),
     ValueError, "attention_mask row 1 has no real token"),
    ("hf-max-new-tokens-negative", lambda a: a.hf.generate(IDS, max_new_tokens=-1), ValueError,
     "max_new_tokens must be an integer >= 0, got -1"),
    ("hf-max-new-tokens-float", lambda a: a.hf.generate(IDS, max_new_tokens=2.5), ValueError,
     "max_new_tokens must be an integer >= 0, got 2.5"),
    ("hf-temperature-nan", lambda a: a.hf.generate(IDS, do_sample=True, temperature=float("nan")), ValueError,
     "temperature must be a finite number >= 0, got nan"),
    ("hf-temperature-negative", lambda a: a.hf.generate(IDS, do_sample=True, temperature=-1.0), ValueError,
     "temperature must be a finite number >= 0, got -1.0"),
    ("hf-top-p-zero", lambda a: a.hf.generate(IDS, do_sample=True, top_p=0.0), ValueError,
     "top_p must be in (0, 1], got 0.0"),
    ("hf-top-p-nan", lambda a: a.hf.generate(IDS, do_sample=True, top_p=float("nan")), ValueError,
     "top_p must be in (0, 1], got nan"),
    ("hf-top-k-negative", lambda a: a.hf.generate(IDS, do_sample=True, top_k=-5), ValueError,
     "top_k must be an integer >= 0"),
    ("hf-repetition-penalty-zero", lambda a: a.hf.generate(IDS, repetition_penalty=0.0), ValueError,
     "repetition_penalty must be a finite number > 0, got 0.0"),
    ("hf-eos-string", lambda a: a.hf.generate(IDS, eos_token_id="</s>"), ValueError,
     "eos_token_id must be an integer or a list of integers, got '</s>'"),
    ("hf-eos-float", lambda a: a.hf.generate(IDS, eos_token_id=[2.5]), ValueError, "eos_token_id must be an integer"),
    ("hf-pad-float", lambda a: a.hf.generate(IDS, pad_token_id=0.5), ValueError,
     "pad_token_id must be an integer, got 0.5"),
    ("hf-cache-of-another-model",
     lambda a: a.hf(IDS, past_key_values=a.other_model_cache()),
     ValueError, "past_key_values was filled by another model"),
    ("hf-prompt-past-context", lambda a: a.hf.generate(np.ones((1, CONTEXT + 1), np.int64)), ContextLengthError,
     f"0 positions held plus {CONTEXT + 1} new exceed the model's context length {CONTEXT}"),
    # -- exo engine: sampling, tokens, requests ------------------------------------------------------
    ("exo-max-requests-zero", lambda a: GGUFInferenceEngine(None, max_requests=0), ValueError,
     "max_requests must be an integer of at least 1, got 0"),
    ("exo-sample-nan-logits", lambda a: a.sample(np.full((1, 1, V), np.nan, np.float32)), ValueError,
     "the logits to sample from hold NaN (at token 0)"),
    ("exo-sample-hidden-states", lambda a: a.sample(hidden()), ValueError,
     f"sample takes the last shard's logits (1, T, {V})"),
    ("exo-sample-int-logits", lambda a: a.sample(np.zeros((1, 1, V), np.int64)), ValueError,
     "sample takes logits (1, T, vocab) float32, got int64"),
    ("exo-sample-temp-nan", lambda a: a.sample(np.zeros((1, 1, V), np.float32), temp=float("nan")),
     ValueError, "temp must be a finite number >= 0 (0 is greedy), got nan"),
    ("exo-sample-temp-negative", lambda a: a.sample(np.zeros((1, 1, V), np.float32), temp=-0.5),
     ValueError, "got -0.5"),
    ("exo-sample-top-p-zero", lambda a: a.sample(np.zeros((1, 1, V), np.float32), 1.0, 0.0),
     ValueError, "top_p must be in (0, 1], got 0.0"),
    ("exo-decode-float-ids", lambda a: a.run(a.exo.decode(a.shard(), np.array([1.7]))), ValueError,
     "token ids must be integers, got float64"),
    ("exo-encode-bytes", lambda a: a.run(a.exo.encode(a.shard(), b"the rain")), TypeError,
     "a prompt must be a str, got bytes"),
    ("exo-encode-lone-surrogate", lambda a: a.run(a.exo.encode(a.shard(), "ab\udcff")), ValueError,
     "'\\udcff' at index 2 is a lone surrogate"),
    ("exo-decode-step-of-unknown-request",
     lambda a: a.run(a.exo.infer_tensor("never-started", a.shard(), np.array([[5]]))), EvictedRequestError,
     "request 'never-started' continues with one sampled token but this shard holds no positions for it"),
    ("exo-int-request-id", lambda a: a.run(a.exo.infer_tensor(7, a.shard(), IDS)), TypeError,
     "a request id must be a str, got 7"),
    ("exo-float64-hidden", lambda a: a.run(a.exo.infer_tensor("h", a.shard(1, 2), hidden(np.float64))), ValueError,
     "float32, got float64"),
    ("exo-prompt-past-context", lambda a: a.run(a.exo.infer_prompt("long", a.shard(), "ab " * 2 * CONTEXT)),
     ContextLengthError, f"exceed the model's context length {CONTEXT}"),
    ("exo-shard-float-layer", lambda a: a.run(a.exo.ensure_shard(ExoShard(str(a.path), 0, 1.5, 3))), TypeError,
     "shard end_layer must be an integer, got 1.5"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "fragment"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_hostile_call_raises_a_clear_error(adapters, call, error, fragment):
    with pytest.raises(error) as info:
        call(adapters)
    assert fragment in str(info.value)
    assert adapters.whole.position("r") == 0 and adapters.middle.position("r") == 0  # nothing was stored


# -- the same request id twice at once --------------------------------------------------------------------


async def exo_generate(engine, request_id, shard, prompt, n):
    """exo's node loop on one whole-model shard: the prompt, then n - 1 decode steps, greedy."""
    logits, _ = await engine.infer_prompt(request_id, shard, prompt)
    tokens = []
    for _ in range(n):
        token = await engine.sample(logits)
        tokens.append(int(token[0]))
        logits, _ = await engine.infer_tensor(request_id, shard, token.reshape(1, -1))
    return tokens


def test_same_request_id_in_flight_twice_is_refused(adapters):
    """Two prompts under one id (asyncio.gather): one is refused, the other is exactly its solo run."""
    shard, prompts = adapters.shard(), ["the rain in spain", "<|im_start|>user\nhello"]
    engine = GGUFInferenceEngine(None, backend="numpy")
    solo = [asyncio.run(exo_generate(engine, f"solo-{i}", shard, p, 6)) for i, p in enumerate(prompts)]
    assert solo[0] != solo[1]

    async def both():
        return await asyncio.gather(*(exo_generate(engine, "same", shard, p, 6) for p in prompts),
                                    return_exceptions=True)  # fmt: skip

    first, second = asyncio.run(both())
    assert first == solo[0]
    assert isinstance(second, RequestInFlightError)
    assert "request 'same' already has a call running on this engine" in str(second)
    # the refusal holds nothing back: the id is free again once its calls are done
    assert asyncio.run(exo_generate(engine, "same", shard, prompts[1], 6)) == solo[1]
    engine.executor.shutdown()


def test_concurrent_different_ids_are_independent(adapters):
    shard, prompts = adapters.shard(), ["the rain in spain", "<|im_start|>user\nhello"]
    engine = GGUFInferenceEngine(None, backend="numpy")
    solo = [asyncio.run(exo_generate(engine, f"solo-{i}", shard, p, 4)) for i, p in enumerate(prompts)]

    async def both():
        return await asyncio.gather(*(exo_generate(engine, f"id-{i}", shard, p, 4) for i, p in enumerate(prompts)))

    assert asyncio.run(both()) == solo
    engine.executor.shutdown()


# -- a request evicted long ago ---------------------------------------------------------------------------


def evict_far_back(engine: ShardEngine, n: int = 1100):
    """n other requests pass through the LRU after the one under test (more than the 1024 ids it remembers)."""
    for i in range(n):
        engine.caches.put(f"other-{i}", engine.model.new_cache(capacity=1))


def test_evicted_request_with_a_position_is_refused_however_long_ago(tiny_llama):
    engine = ShardEngine.view(tiny_llama, 0, 2, max_requests=1)
    engine.forward("old", IDS, position=0)
    evict_far_back(engine)
    with pytest.raises(EvictedRequestError, match="request 'old' continues at position 4 but this shard holds no"):
        engine.forward("old", np.array([[9]]), position=IDS.shape[1])
    assert "old" not in engine.caches
    # position 0 is a new request under that id, whatever was evicted before
    assert np.array_equal(engine.forward("old", IDS, position=0), ShardEngine.view(tiny_llama, 0, 2).forward("x", IDS))


def test_held_request_at_the_wrong_position_is_refused(tiny_llama):
    engine = ShardEngine.view(tiny_llama, 0, 2)
    engine.forward("r", IDS, position=0)
    for position in (0, 3, 5):
        with pytest.raises(RequestPositionError, match=rf"input starts at position {position} but this shard holds 4"):
            engine.forward("r", np.array([[9]]), position=position)
    assert engine.position("r") == 4
    engine.forward("r", np.array([[9]]), position=4)
    assert engine.position("r") == 5


def test_exo_decode_step_of_a_request_evicted_long_ago_is_refused(tiny_llama_path):
    shard = ExoShard(str(tiny_llama_path), 0, 2, 3)
    engine = GGUFInferenceEngine(None, backend="numpy", max_requests=1)
    logits, _ = asyncio.run(engine.infer_prompt("old", shard, "the rain"))
    token = asyncio.run(engine.sample(logits)).reshape(1, -1)
    evict_far_back(engine.engine)
    with pytest.raises(EvictedRequestError, match="request 'old' continues with one sampled token"):
        asyncio.run(engine.infer_tensor("old", shard, token))
    engine.executor.shutdown()


def test_exo_shard_switch_refuses_the_continuation_of_requests_left_behind(tiny_llama_path):
    """A new shard holds none of the old one's positions: a decode step there is refused, not restarted."""
    engine = GGUFInferenceEngine(None, backend="numpy")
    middle, other = ExoShard(str(tiny_llama_path), 1, 1, 3), ExoShard(str(tiny_llama_path), 1, 2, 3)
    asyncio.run(engine.infer_tensor("r", middle, hidden(T=3)))
    asyncio.run(engine.ensure_shard(other))
    with pytest.raises(EvictedRequestError, match="request 'r' was evicted"):
        asyncio.run(engine.infer_tensor("r", other, hidden(T=1)))
    engine.executor.shutdown()


# -- the context limit ends generation normally -----------------------------------------------------------


SHORT = 16  # the context length of `short_path`, so that generation reaches it in a few steps


@pytest.fixture(scope="module")
def short_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("short") / "short.gguf", TinyLlama(context_length=SHORT))


def test_hf_generate_ends_at_the_context_length(short_path):
    hf = GGUFModelForCausalLM.from_pretrained(short_path, backend="numpy")
    prompt = np.array([[5, 77, 200, 3, 150, 42, 9, 260, 11, 99, 17, 230]])  # 12 tokens: 4 positions of room
    within = hf.generate(prompt, max_new_tokens=4, eos_token_id=[])
    out = hf.generate(prompt, max_new_tokens=50, eos_token_id=[])
    # the tokens of the 4 positions fed, plus the one drawn from the last position's logits
    assert out.shape == (1, SHORT + 1)
    assert np.array_equal(out[:, : within.shape[1]], within)
    # a batch: the longer row stops at the limit, the shorter one goes on while the other is padded
    batch = np.array([prompt[0], np.r_[[0, 0], prompt[0, 2:]]])
    mask = np.array([[1] * 12, [0, 0] + [1] * 10])
    out2 = hf.generate(batch, attention_mask=mask, max_new_tokens=50, eos_token_id=[], pad_token_id=1)
    assert out2.shape == (2, SHORT + 3) and np.array_equal(out2[0, : SHORT + 1], out[0])
    assert (out2[0, SHORT + 1 :] == 1).all()


def test_exo_request_at_the_context_length_ends_with_eos(short_path):
    """Split across two engines as exo runs it: the request ends with EOS instead of an exception."""
    first_shard, last_shard = ExoShard(str(short_path), 0, 1, 3), ExoShard(str(short_path), 2, 2, 3)
    first, last = GGUFInferenceEngine(None, backend="numpy"), GGUFInferenceEngine(None, backend="numpy")

    async def run():
        h, _ = await first.infer_prompt("r", first_shard, "x" * (SHORT - 4))  # a token per character
        n_prompt, tokens = first.engine.position("r"), []
        while len(tokens) < SHORT:
            logits, _ = await last.infer_tensor("r", last_shard, h)
            token = await last.sample(logits)
            tokens.append(int(token[0]))
            if tokens[-1] == last.tokenizer.eos_token_id:
                break
            h, _ = await first.infer_tensor("r", first_shard, token.reshape(1, -1))
        return n_prompt, tokens

    n_prompt, tokens = asyncio.run(run())
    eos = last.tokenizer.eos_token_id
    assert n_prompt == SHORT - 4
    assert first.engine.position("r") == last.engine.position("r") == SHORT
    # every position fed, the token drawn at the last one, then EOS
    assert len(tokens) == SHORT - n_prompt + 2 and tokens[-1] == eos and eos not in tokens[:-1]
    first.executor.shutdown()
    last.executor.shutdown()


# -- ShardEngine.load checks the config as ggufpy.load does -----------------------------------------------


@pytest.mark.parametrize(
    "add_block_count",
    [lambda w, n: None, lambda w, n: w.add_string(f"{w.arch}.block_count", "abc")],
    ids=["missing", "string"],
)
def test_shard_load_refuses_a_bad_block_count_as_load_does(tmp_path, monkeypatch, add_block_count):
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", add_block_count)
    path = write_tiny_llama(tmp_path / "bad-block-count.gguf")
    monkeypatch.undo()
    with pytest.raises(GGUFError) as by_load:
        ggufpy.load(path)
    with pytest.raises(GGUFError) as by_shard:
        ShardEngine.load(path, 0)
    assert type(by_shard.value) is type(by_load.value) and str(by_shard.value) == str(by_load.value)
    assert "llama.block_count" in str(by_load.value)
    engine = GGUFInferenceEngine(None, backend="numpy")
    with pytest.raises(type(by_load.value), match=r"llama\.block_count"):
        asyncio.run(engine.ensure_shard(ExoShard(str(path), 0, 2, 3)))
    engine.executor.shutdown()
