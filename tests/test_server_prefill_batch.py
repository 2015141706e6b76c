"""`Model.prefill_batch`: prompt chunks of several sequences (and decode tokens) in one pass, every row bit for bit
that token decoded alone, and the server's scheduler prefilling short prompts that way.

The law: a sequence's KV and last-token logits from a batched pass equal those of its tokens decoded one by one
with `decode_batch` (B = 1), whatever other chunks share the pass and however its prompt is cut into chunks.
A row that read another sequence's keys, or a RoPE angle or product that depended on the rows beside it, breaks
it.
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest

import ggufpy
from ggufpy.kernels import AVAILABLE, JIT_DISABLED
from ggufpy.sampling import Sampler, SamplingParams
from tests.models import smollm2_path

PROMPTS = [[1, 2, 3, 4, 5], [7], [100, 200, 300, 400, 500, 600, 700, 800, 900], [42, 43], [5, 4, 3, 2, 1]]


def one_by_one(model, prompt, capacity=32):
    """The cache and last logits of `prompt` decoded one token at a time (`decode_batch` with B = 1)."""
    cache = model.new_cache(capacity=capacity)
    for pos, t in enumerate(prompt):
        logits = model.decode_batch(np.asarray([t]), [pos], [cache])[0]
    return cache, logits


def assert_same_sequence(model, batch_cache, batch_logits, alone_cache, alone_logits, what):
    assert batch_cache.length == alone_cache.length, what
    assert batch_logits.tobytes() == alone_logits.tobytes(), what
    for i in model.layers:
        n = alone_cache.length
        assert batch_cache.k[i][:n].tobytes() == alone_cache.k[i][:n].tobytes(), f"{what}: keys of layer {i}"
        assert batch_cache.v[i][:n].tobytes() == alone_cache.v[i][:n].tobytes(), f"{what}: values of layer {i}"


def check_prefill_law(model):
    V = model.config.vocab_size
    prompts = [[t % V for t in p] for p in PROMPTS]
    alone = [one_by_one(model, p) for p in prompts]
    # every prompt whole, in one pass, in a shuffled order
    order = [3, 0, 4, 2, 1]
    caches = [model.new_cache(capacity=32) for _ in order]
    logits = model.prefill_batch([prompts[j] for j in order], [0] * len(order), caches)
    assert logits.shape == (len(order), V)
    for row, j in enumerate(order):
        assert_same_sequence(model, caches[row], logits[row], *alone[j], f"prompt {j} in one pass")
    # the same prompts cut into pieces, beside a decode token of a sequence already in: as a scheduler does
    caches = [model.new_cache(capacity=32) for _ in prompts]
    done = copy.deepcopy(alone[1][0])
    model.prefill_batch([p[:2] for p in prompts], [0] * len(prompts), caches)
    rest = [(j, p[2:]) for j, p in enumerate(prompts) if len(p) > 2]
    logits = model.prefill_batch(
        [[11 % V]] + [p for _, p in rest], [done.length] + [2] * len(rest), [done] + [caches[j] for j, _ in rest]
    )
    for row, (j, _) in enumerate(rest, start=1):
        assert_same_sequence(model, caches[j], logits[row], *alone[j], f"prompt {j} in two pieces")
    ref_cache, ref_logits = one_by_one(model, prompts[1] + [11 % V])
    assert_same_sequence(model, done, logits[0], ref_cache, ref_logits, "the decode row beside them")


@pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")
def test_prefill_batch_rows_equal_decoding_alone_tiny(tiny_llama):
    check_prefill_law(tiny_llama)


@pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")
def test_prefill_batch_rows_equal_decoding_alone_smollm2():
    check_prefill_law(ggufpy.load(smollm2_path(), backend="numba", tokenizer=False))


def test_prefill_batch_numpy_backend(tiny_llama_path):
    """The NumPy backend has no batched kernels: `linears_rows` goes row by row, the law holds as well."""
    check_prefill_law(ggufpy.load(tiny_llama_path, backend="numpy"))


def test_prefill_batch_errors(tiny_llama):
    caches = [tiny_llama.new_cache(capacity=8) for _ in range(2)]
    with pytest.raises(ValueError, match="non-empty 1-D chunks"):
        tiny_llama.prefill_batch([[1, 2], []], [0, 0], caches)
    with pytest.raises(ValueError, match="appears twice"):
        tiny_llama.prefill_batch([[1, 2], [3]], [0, 0], [caches[0], caches[0]])
    with pytest.raises(ValueError, match="do not fit in a KV cache of 8"):
        tiny_llama.prefill_batch([[1] * 9, [3]], [0, 0], caches)
    assert [c.length for c in caches] == [0, 0]  # nothing was written


# -- the scheduler: short prompts prefilled in the decode pass ------------------------------------------------
def run(scheduler, prompts, max_tokens=6, cache_prompt=False, usage=None) -> list[list[int]]:
    """The generated token ids of greedy jobs for `prompts`, all submitted at once (`usage`, a list, receives
    each job's (prompt_tokens, cached_tokens))."""
    from ggufpy.server.scheduler import Job

    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    finished = threading.Semaphore(0)

    def emit(i):
        def on_event(event):
            if event.kind == "text" and event.token >= 0:
                tokens[i].append(event.token)
            elif event.kind != "text":
                assert event.kind == "done", event.message
                if usage is not None:
                    usage.append((event.prompt_tokens, event.cached_tokens))
                finished.release()

        return on_event

    banned = {t: float("-inf") for t in scheduler.tokenizer.eog_ids}
    for i, p in enumerate(prompts):
        sampler = Sampler(SamplingParams(temperature=0, logit_bias=banned))
        scheduler.submit(Job(p, max_tokens=max_tokens, sampler=sampler, cache_prompt=cache_prompt), emit(i))
    for _ in prompts:
        assert finished.acquire(timeout=300)
    return [tokens[i] for i in range(len(prompts))]


def greedy_one_by_one(model, prompt, n) -> list[int]:
    banned = list(model.tokenizer.eog_ids)
    cache = model.new_cache(capacity=64)
    out, logits = [], None
    for pos, t in enumerate(prompt):
        logits = model.decode_batch(np.asarray([t]), [pos], [cache])[0]
    for _ in range(n):
        logits = logits.copy()
        logits[banned] = -np.inf
        out.append(int(np.argmax(logits)))
        logits = model.decode_batch(np.asarray([out[-1]]), [cache.length], [cache])[0]
    return out


def test_scheduler_prefills_short_prompts_in_the_pass(tiny_llama):
    """Jobs submitted together (their prompt rows in shared passes, beside others' decode rows) generate what
    each generates alone, and what decoding its prompt token by token then greedily gives."""
    pytest.importorskip("fastapi")
    from ggufpy.server.scheduler import Scheduler

    V = tiny_llama.config.vocab_size
    prompts = [[t % V for t in p] for p in PROMPTS]
    scheduler = Scheduler(tiny_llama, parallel=4, ctx_size=64, prefill_chunk=8)  # 8: prompts cut across passes
    assert scheduler.rows_prefill
    calls = []
    original = tiny_llama.prefill_batch

    def spy(chunks, positions, caches):
        calls.append([len(c) for c in chunks])
        return original(chunks, positions, caches)

    tiny_llama.prefill_batch = spy
    scheduler.start()
    try:
        alone = [run(scheduler, [p])[0] for p in prompts]
        calls.clear()
        together = run(scheduler, prompts)
    finally:
        scheduler.stop()
        del tiny_llama.prefill_batch
    assert together == alone
    assert alone == [greedy_one_by_one(tiny_llama, p, 6) for p in prompts]
    assert any(sum(c) > max(c) > 1 for c in calls), calls  # a pass held a prompt's rows beside other rows
    assert max(map(sum, calls)) <= 8 + 4  # at most the budget of prompt rows and one row per slot
    assert scheduler.metrics.prefill_tokens_total == 2 * sum(map(len, prompts))


def test_scheduler_reuses_a_finished_turn_token_for_token(tiny_llama):
    """Multi-turn chat: the next request starts with the last one's prompt and answer. Its prompt rows reuse the
    cached positions of both (generated tokens included, no chunk rounding: every cached row is that token
    computed alone), report them as cached, and generate exactly what the request generates without the cache."""
    pytest.importorskip("fastapi")
    from ggufpy.server.scheduler import Scheduler

    V = tiny_llama.config.vocab_size
    first = [t % V for t in (3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46)]
    scheduler = Scheduler(tiny_llama, parallel=2, ctx_size=64, prefill_chunk=8)
    scheduler.start()
    try:
        usage = []
        (answer,) = run(scheduler, [first], max_tokens=5, cache_prompt=True, usage=usage)
        second = [*first, *answer, 7 % V, 11 % V]  # the answer's last token was sampled, never fed: not cached
        (cached,) = run(scheduler, [second], max_tokens=6, cache_prompt=True, usage=usage)
        (fresh,) = run(scheduler, [second], max_tokens=6, cache_prompt=False, usage=usage)
        # a request sharing only part of a cached prompt keeps that part (one cache per finished request)
        third = [*first[:5], 1, 2, 3]
        (part,) = run(scheduler, [third], max_tokens=4, cache_prompt=True, usage=usage)
        (part_fresh,) = run(scheduler, [third], max_tokens=4, cache_prompt=False, usage=usage)
    finally:
        scheduler.stop()
    assert usage[0] == (len(first), 0)
    assert usage[1] == (len(second), len(first) + len(answer) - 1)
    assert usage[2] == (len(second), 0)
    assert cached == fresh
    assert usage[3] == (len(third), 5) and part == part_fresh
    assert fresh == greedy_one_by_one(tiny_llama, second, 6)


@pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")
def test_prefill_batch_rows_equal_decoding_alone_llamacpp_numerics():
    """`ggufpy serve --numerics llamacpp-avx2`: the law holds in llama.cpp's arithmetic too (integer kernels run each
    row as its one-row kernel, `int8rows.product_rows`), so a served prompt is llama.cpp's
    token-by-token decode of it whatever shares the pass."""
    check_prefill_law(ggufpy.load(smollm2_path(), backend="numba", numerics="llamacpp-avx2", tokenizer=False))
