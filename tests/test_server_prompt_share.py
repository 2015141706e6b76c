"""The scheduler shares prompt prefixes between requests that run at the same time: a new request copies the
computed positions of a running one, and requests admitted together with one prompt (`n` choices) prefill
it once, the others waiting for those positions. Each shared position is that token computed alone, so every
response is the one the request gets with no sharing at all (`cache_prompt: false`)."""

from __future__ import annotations

import threading

import pytest

from ggufpy.sampling import Sampler, SamplingParams
from tests.test_server_prefill_batch import greedy_one_by_one

pytest.importorskip("fastapi")

from ggufpy.server.scheduler import Job, Scheduler

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]  # 20 ids: 3 chunks of 8


class Jobs:
    """Greedy jobs submitted to a scheduler, each one's tokens and usage kept by its index."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.tokens: dict[int, list[int]] = {}
        self.usage: dict[int, tuple[int, int, str]] = {}
        self.first = {}  # index -> an Event set on the job's first token
        self.done = threading.Semaphore(0)
        self.jobs: dict[int, Job] = {}

    def submit(self, i: int, prompt, max_tokens: int = 6, cache_prompt: bool = True) -> Job:
        V = self.scheduler.model.config.vocab_size
        self.tokens[i], self.first[i] = [], threading.Event()

        def on_event(event):
            if event.kind == "text" and event.token >= 0:
                self.tokens[i].append(event.token)
                self.first[i].set()
            elif event.kind != "text":
                assert event.kind == "done", event.message
                self.usage[i] = (event.prompt_tokens, event.cached_tokens, event.finish_reason)
                self.first[i].set()
                self.done.release()

        banned = {t: float("-inf") for t in self.scheduler.tokenizer.eog_ids}
        sampler = Sampler(SamplingParams(temperature=0, logit_bias=banned))
        job = Job([t % V for t in prompt], max_tokens=max_tokens, sampler=sampler, cache_prompt=cache_prompt)
        self.jobs[i] = job
        return self.scheduler.submit(job, on_event)

    def wait(self, n: int) -> None:
        for _ in range(n):
            assert self.done.acquire(timeout=300)


@pytest.fixture
def scheduler(tiny_llama):
    s = Scheduler(tiny_llama, parallel=4, ctx_size=64, prefill_chunk=8)
    assert s.rows_prefill
    s.start()
    yield s
    s.stop()


def test_choices_of_one_prompt_prefill_it_once(scheduler, tiny_llama):
    jobs = Jobs(scheduler)
    for i in range(3):
        jobs.submit(i, PROMPT)
    jobs.wait(3)
    prefilled = scheduler.metrics.prefill_tokens_total
    jobs.submit(3, PROMPT, cache_prompt=False)
    jobs.wait(1)
    V = tiny_llama.config.vocab_size
    expected = greedy_one_by_one(tiny_llama, [t % V for t in PROMPT], 6)
    assert [jobs.tokens[i] for i in range(4)] == [expected] * 4
    # the first computes the prompt; the two others copy all of it but its last token, which gives their logits
    assert sorted(jobs.usage[i][1] for i in range(3)) == [0, len(PROMPT) - 1, len(PROMPT) - 1]
    assert prefilled == len(PROMPT) + 2
    assert jobs.usage[3][1] == 0 and scheduler.metrics.prefill_tokens_total == prefilled + len(PROMPT)


def test_a_new_request_copies_a_running_requests_positions(scheduler, tiny_llama):
    """While the first request generates, a second one whose prompt is the first's prompt and some of its answer
    copies those positions (the first goes on writing its own cache)."""
    jobs = Jobs(scheduler)
    jobs.submit(0, PROMPT, max_tokens=24)
    assert jobs.first[0].wait(300)
    while len(jobs.tokens[0]) < 3 and 0 not in jobs.usage:  # a few of its tokens fed back into its cache
        threading.Event().wait(0.01)
    answer = list(jobs.tokens[0][:2])
    second = [*PROMPT, *answer, 7, 11]
    jobs.submit(1, second)
    jobs.wait(2)
    jobs.submit(2, second, cache_prompt=False)
    jobs.wait(1)
    assert 0 not in jobs.usage or jobs.usage[0][2] == "length"
    # at least its prompt up to the 2 ids the first did not write (more only if the first wrote them too)
    assert len(PROMPT) + len(answer) <= jobs.usage[1][1] < len(second)
    V = tiny_llama.config.vocab_size
    assert jobs.tokens[1] == jobs.tokens[2] == greedy_one_by_one(tiny_llama, [t % V for t in second], 6)
    assert jobs.tokens[0] == greedy_one_by_one(tiny_llama, [t % V for t in PROMPT], 24)  # untouched by the copy


def test_a_waiting_request_prefills_itself_when_its_source_is_cancelled(scheduler, tiny_llama):
    jobs = Jobs(scheduler)
    original = tiny_llama.prefill_batch
    passes = []

    def spy(chunks, positions, caches):
        passes.append([len(c) for c in chunks])
        if len(passes) == 1:
            first.cancel()  # after the source's first chunk: the follower has to compute the rest itself
        return original(chunks, positions, caches)

    tiny_llama.prefill_batch = spy
    try:
        first = jobs.submit(0, PROMPT)
        jobs.submit(1, PROMPT)
        jobs.wait(2)
    finally:
        del tiny_llama.prefill_batch
    V = tiny_llama.config.vocab_size
    assert jobs.usage[0][2] == "cancelled"
    assert jobs.usage[1][1:] == (0, "length")  # nothing left to copy: it computed its whole prompt
    assert jobs.tokens[1] == greedy_one_by_one(tiny_llama, [t % V for t in PROMPT], 6)
    assert passes[0] == [8]  # the follower did not prefill beside its source


def test_a_recurrent_state_is_not_cut_to_a_shorter_prefix(tmp_path):
    """A hybrid model's recurrent state holds its whole sequence: a request sharing only the first chunks of a
    finished one's prompt starts afresh (cutting the state would keep the state of positions it does not have)."""
    import ggufpy
    from conformance.fixtures_hybrid import build_hybrid_fixture

    model = ggufpy.load(build_hybrid_fixture("hybrid_f32", tmp_path))
    scheduler = Scheduler(model, parallel=2, ctx_size=64, prefill_chunk=8)
    assert not scheduler.rows_prefill
    scheduler.start()
    try:
        jobs = Jobs(scheduler)
        jobs.submit(0, PROMPT)
        jobs.wait(1)
        shorter = [*PROMPT[:16], 1, 2, 3]  # two whole chunks of the finished prompt
        jobs.submit(1, shorter)
        jobs.wait(1)
        jobs.submit(2, shorter, cache_prompt=False)
        jobs.wait(1)
    finally:
        scheduler.stop()
    assert jobs.usage[1][1] == 0
    assert jobs.tokens[1] == jobs.tokens[2]
