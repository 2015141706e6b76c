"""`ggufpy.distributed.RayPipeline` on a real Ray cluster of three nodes on this machine (loopback only).

One cluster for the module (head + two workers, separate raylets, one CPU each; Ray is slow to start on two
busy cores). The reference is the whole model in this process: logits and greedy tokens must be bit for bit
the same through 2 and 3 stages, one request or 8 at once; a killed stage actor or worker node fails the
requests it held with a clear error and the next request succeeds; shutdown leaves no actor alive.

NumPy backend: both sides get `cache_bytes=1 << 30` so that every weight takes the same (cached dense) product
path in the whole model and in each stage (a weight past the cache is multiplied tile by tile, which sums in
another order: split == whole needs the same path on both sides, as tests/test_shard.py does).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind every node to 127.0.0.1 (shared docs, local-services)

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import ggufpy  # noqa: E402 (after the environment variable above)
from ggufpy.distributed import PlanError, RayPipeline, StageFailedError  # noqa: E402 (after the environment variable above)
from ggufpy.generation import generate_text  # noqa: E402 (after the environment variable above)
from ggufpy.kernels import AVAILABLE, JIT_DISABLED  # noqa: E402 (after the environment variable above)
from ggufpy.sampling import SamplingParams  # noqa: E402 (after the environment variable above)
from tests.models import gemma3_path, smollm2_path  # noqa: E402 (after the environment variable above)

GB = 1 << 30
FIXTURES = Path(__file__).resolve().parents[1] / "conformance" / "fixtures"
NUMPY = {"cache_bytes": GB}
CTX = 256
PROMPT = [1, 504, 3458, 282, 4649, 314]  # "The capital of France is" (SmolLM2 ids; any ids do for equality)
PROMPTS = [PROMPT, [1, 4093, 198, 19556, 905, 28], [2, 3, 4], [17] * 9, [600, 601], [9, 8, 7, 6], [42], [7, 7]]
needs_numba = pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    head = {
        "num_cpus": 1,
        "memory": 3 * GB,  # the head also runs this process: the workers, with more, get the stages first
        "include_dashboard": True,  # ray.util.state (the orphan check) asks the dashboard
        "dashboard_host": "127.0.0.1",
        "dashboard_port": _free_port(),
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
    }
    c = Cluster(initialize_head=True, head_node_args=head)
    try:
        # two logical CPUs: room for a second pipeline (the command line's) beside the module's
        workers = [c.add_node(num_cpus=2, memory=4 * GB) for _ in range(2)]
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="warning")
        c.workers = workers
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def alive_stage_actors(cluster) -> list:
    from ray.util.state import list_actors

    actors = list_actors(address=cluster.address, filters=[("state", "!=", "DEAD")], timeout=60)
    return [a for a in actors if (a.name or "").startswith("ggufpy-stage")]


@pytest.fixture(scope="module")
def whole():
    return ggufpy.load(smollm2_path(), backend="numpy", tokenizer=True, **NUMPY)


@pytest.fixture(scope="module")
def pipe2(cluster):
    p = RayPipeline(smollm2_path(), stages=2, backend="numpy", ctx_size=CTX, backend_options=NUMPY, max_sequences=8)
    yield p
    p.shutdown()


def greedy(model, prompt, n=8, **kw):
    return generate_text(model, model.tokenizer, prompt, max_tokens=n, sampling=SamplingParams(temperature=0), **kw)


def reference(whole, prompt, steps: int = 2):
    """Logits of the prompt (every position) then `steps` greedy decode steps, in one process."""
    cache = whole.new_cache(capacity=CTX)
    out = [whole.forward(np.asarray(prompt), 0, cache)]
    for _ in range(steps):
        token = int(np.argmax(out[-1][-1]))
        out.append(whole.forward(np.asarray([token]), cache.length, cache))
    return out


def through(pipe, prompt, steps: int = 2):
    cache = pipe.new_cache()
    out = [pipe.forward(np.asarray(prompt), 0, cache)]
    for _ in range(steps):
        token = int(np.argmax(out[-1][-1]))
        out.append(pipe.decode_batch([token], [cache.length], [cache]))
    cache.release()
    return out


def test_two_stages_on_two_workers_bit_identical(cluster, whole, pipe2):
    """Placement by memory puts the stages on the two 4 GB workers; logits and greedy text equal the whole."""
    workers = {w.node_id for w in cluster.workers}
    assert [s.node.node_id in workers for s in pipe2.plan] == [True, True]
    assert [(s.layers.start, s.layers.stop) for s in pipe2.plan] == [(0, 15), (15, 30)]
    for a, b in zip(reference(whole, PROMPT), through(pipe2, PROMPT), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == np.float32
        assert np.array_equal(a, b)
    want = greedy(whole, PROMPT, 12)
    got = pipe2.generate(PROMPT, max_tokens=12, sampling=SamplingParams(temperature=0))
    assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == want.finish_reason
    # the Model interface: generation.generate over the pipeline (driver-side sampling) gives the same tokens
    assert greedy(pipe2, PROMPT, 12).token_ids == want.token_ids


def test_eight_concurrent_requests(whole, pipe2):
    """8 requests at once (greedy and seeded sampling) through 2 stages: each equals its single-process run."""
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=0.8, seed=i) for i in range(8)]
    pairs = list(zip(PROMPTS, params, strict=True))
    want = [generate_text(whole, whole.tokenizer, p, max_tokens=10, sampling=s) for p, s in pairs]
    gens = [pipe2.submit(p, max_tokens=10, sampling=s) for p, s in pairs]
    got = [list(g) and g.result for g in gens]
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)


def test_kill_stage_actor_mid_generation(whole, pipe2):
    """SIGKILL of stage 1's process while a request decodes: it fails naming the stage, nothing hangs, the
    stage comes back in a new process and the next request equals the whole model again."""
    before = pipe2.info()[1]["pid"]
    gen = pipe2.submit(PROMPT, max_tokens=200, sampling=SamplingParams(temperature=0.8, seed=1))
    next(gen)
    os.kill(before, signal.SIGKILL)
    with pytest.raises(StageFailedError, match=r"stage 1 \(layers 15..29") as e:
        for _ in gen:
            pass
    assert "lost their KV caches on it" in str(e.value) and "Ray restarts the stage" in str(e.value)
    got = pipe2.generate(PROMPT, max_tokens=6, sampling=SamplingParams(temperature=0))
    assert got.token_ids == greedy(whole, PROMPT, 6).token_ids
    assert pipe2.info()[1]["pid"] != before
    assert pipe2.restored == 1


def test_plan_that_does_not_fit_is_refused(cluster):
    """A context and request count whose KV caches exceed the nodes' memory: refused before any actor."""
    with pytest.raises(PlanError, match=r"does not fit: stage 0: layers 0\.\.14 .* > node memory 4096 MB"):
        RayPipeline(smollm2_path(), stages=2, ctx_size=8192, max_sequences=64, backend_options=NUMPY)
    with pytest.raises(PlanError, match="4 stages need 4 nodes"):
        RayPipeline(smollm2_path(), stages=4)


def test_shutdown_leaves_no_actor(cluster):
    # num_cpus=0: the module's pipeline holds the workers' one CPU each; memory is what placement counts here
    p = RayPipeline(smollm2_path(), ranges="0-9,10-19,20-29", ctx_size=CTX, warmup=False, num_cpus=0, load_timeout=300)
    assert len(alive_stage_actors(cluster)) >= 3
    assert [i["layers"] for i in p.info()] == [(0, 10), (10, 20), (20, 30)]
    p.shutdown()
    pipe2_alive = [a for a in alive_stage_actors(cluster)]
    assert len(pipe2_alive) <= 2  # only the module pipeline's two stages remain


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("backend", ["numpy", pytest.param("numba", marks=needs_numba)])
@pytest.mark.parametrize("ranges", [2, 3])
def test_split_equals_whole(cluster, model, backend, ranges):
    path = {"smollm2": smollm2_path, "gemma3": gemma3_path}[model]()
    options = NUMPY if backend == "numpy" else {}
    one = ggufpy.load(path, backend=backend, **options)
    with RayPipeline(path, stages=ranges, backend=backend, ctx_size=CTX, backend_options=options, num_cpus=0) as pipe:
        prompt = one.tokenizer.encode("The capital of France is", add_special=True)
        for a, b in zip(reference(one, prompt), through(pipe, prompt), strict=True):
            assert np.array_equal(a, b)
        want = greedy(one, prompt, 8)
        assert pipe.generate(prompt, max_tokens=8, sampling=SamplingParams(temperature=0)).token_ids == want.token_ids


@pytest.mark.slow
def test_float16_hidden_states_are_close_not_identical(cluster, whole):
    options = {"hidden_dtype": "float16", "ctx_size": CTX, "backend_options": NUMPY, "num_cpus": 0}
    with RayPipeline(smollm2_path(), stages=2, **options) as pipe:
        a, b = reference(whole, PROMPT, 0)[0], through(pipe, PROMPT, 0)[0]
    assert not np.array_equal(a, b)
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()


def test_server_scheduler_over_the_pipeline(whole, pipe2):
    """The server's slot scheduler (ggufpy/server/scheduler.py, unchanged) drives a RayPipeline as its model:
    chunked prefill and `decode_batch` of 4 slots; each job's tokens equal the whole model's greedy run."""
    server = pytest.importorskip("ggufpy.server.scheduler")
    from ggufpy.sampling import Sampler

    scheduler = server.Scheduler(pipe2, parallel=4, ctx_size=CTX)
    events: dict[int, list] = {}
    done = threading.Semaphore(0)

    def emit(job_id):
        def on_event(event):
            events.setdefault(job_id, []).append(event)
            if event.kind != "text":
                done.release()

        return on_event

    scheduler.start()
    try:
        jobs = [server.Job(p, max_tokens=6, sampler=Sampler(SamplingParams(temperature=0))) for p in PROMPTS[:4]]
        for job in jobs:
            scheduler.submit(job, emit(job.id))
        for _ in jobs:
            assert done.acquire(timeout=300)
    finally:
        scheduler.stop()
    for job, prompt in zip(jobs, PROMPTS, strict=False):
        tokens = tuple(e.token for e in events[job.id] if e.kind == "text" and e.token >= 0)
        want = greedy(whole, prompt, 6).token_ids
        assert events[job.id][-1].kind == "done", events[job.id][-1]
        assert tokens == tuple(t for t in want if t not in whole.tokenizer.eog_ids)


def test_command_line_run_on_the_cluster(cluster, capsys):
    """`ggufpy run --ray ADDRESS --stages 2` streams the text, reports the stages, and releases its actors;
    a plan that cannot be placed is a usage error that says why."""
    from ggufpy.cli import main

    before = len(alive_stage_actors(cluster))
    args = ["run", "-m", str(smollm2_path()), "-p", "The capital of France is", "--ray", cluster.address]
    code = main([*args, "--stages", "2", "--backend", "numpy", "--temp", "0", "-n", "8", "-c", "256"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip() and "[ray, 2 stages, numpy]" in err and "generated 8 tokens" in err
    assert len(alive_stage_actors(cluster)) == before
    assert main([*args, "--stages", "5"]) != 0
    assert "5 stages need 5 nodes" in capsys.readouterr().err


def test_load_with_cluster_returns_a_pipeline(cluster, whole):
    """`ggufpy.load(path, cluster=ADDRESS, ...)`: the same front door as one process, a `RayPipeline` behind it."""
    options = {"stages": 2, "ctx_size": CTX, "backend_options": NUMPY, "num_cpus": 0, "backend": "numpy"}
    with ggufpy.load(smollm2_path(), cluster=cluster.address, **options) as pipe:
        assert isinstance(pipe, RayPipeline) and len(pipe.plan) == 2
        got = pipe.generate(PROMPT, max_tokens=6, sampling=SamplingParams(temperature=0))
    assert got.token_ids == greedy(whole, PROMPT, 6).token_ids


def test_serve_on_the_cluster(cluster, whole, monkeypatch):
    """`ggufpy serve --ray ADDRESS --stages 2`: the OpenAI routes over the pipeline (uvicorn replaced by an
    in-process client), the whole model's greedy completion, and every stage actor released at exit."""
    pytest.importorskip("fastapi")
    import uvicorn
    from fastapi.testclient import TestClient

    from ggufpy.cli import main

    before = len(alive_stage_actors(cluster))
    answers = []

    def serve_once(app, **_):
        with TestClient(app) as client:
            body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
            answers.append(client.post("/v1/completions", json=body).json())

    monkeypatch.setattr(uvicorn, "run", serve_once)
    args = ["serve", "-m", str(smollm2_path()), "--ray", cluster.address, "--stages", "2", "--backend", "numpy"]
    assert main([*args, "--parallel", "2", "--ctx-size", "256"]) == 0
    want = greedy(whole, whole.tokenizer.encode("The capital of France is", add_special=True), 6)
    (answer,) = answers
    assert answer["choices"][0]["text"] == want.text
    assert len(alive_stage_actors(cluster)) == before


def test_slow_stage_fails_only_its_requests(whole, pipe2):
    """Stage 1 stalls past the step timeout while a request decodes: that request fails naming the timeout, its
    late step is dropped, its state is released, and the next request equals the whole model (nothing of the
    timed-out request leaked into it)."""
    restored, timeout, pipe2.step_timeout = pipe2.restored, pipe2.step_timeout, 6.0
    try:
        gen = pipe2.submit(PROMPT, max_tokens=200, sampling=SamplingParams(temperature=0.8, seed=3))
        next(gen)
        stall = pipe2.stages[1].__ray_call__.remote(lambda stage: time.sleep(15))  # runs on the actor, in order
        with pytest.raises(StageFailedError, match=r"no answer within 6 s"):
            for _ in gen:
                pass
        ray.get(stall, timeout=120)
    finally:
        pipe2.step_timeout = timeout
    got = pipe2.generate(PROMPT, max_tokens=6, sampling=SamplingParams(temperature=0))
    assert got.token_ids == greedy(whole, PROMPT, 6).token_ids
    assert [i["requests"] for i in pipe2.info()] == [0, 0]  # the timed-out request's caches are gone too
    assert pipe2.restored == restored  # slow is not dead: no stage was restarted


@pytest.mark.parametrize("name", ["qwen35_f32", "qwen35moe_f32"])
def test_hybrid_model_split_equals_whole(cluster, name):
    """Gated DeltaNet + attention layers (and MoE) through two stages: each stage keeps its own layers' conv,
    recurrent and KV state; logits and greedy tokens equal the whole model's bit for bit."""
    path = str(FIXTURES / f"{name}.gguf")
    one = ggufpy.load(path, backend="numpy", tokenizer=True, **NUMPY)
    n = one.config.n_layers
    ranges = [range(0, n // 2), range(n // 2, n)]
    with RayPipeline(path, ranges=ranges, ctx_size=CTX, backend_options=NUMPY, num_cpus=0, warmup=False) as pipe:
        prompt = list(range(3, 40))
        for a, b in zip(reference(one, prompt), through(pipe, prompt), strict=True):
            assert np.array_equal(a, b)
        want = greedy(one, prompt, 8)
        assert pipe.generate(prompt, max_tokens=8, sampling=SamplingParams(temperature=0)).token_ids == want.token_ids


def test_kill_worker_node_mid_generation(cluster, whole, pipe2):
    """Remove the worker node of stage 1 mid-generation: the request fails clearly, Ray restarts the stage on
    a node with room (the head), and the next request equals the whole model. Runs last: it shrinks the cluster."""
    node_id = pipe2.plan[1].node.node_id
    victim = next(w for w in cluster.workers if w.node_id == node_id)
    gen = pipe2.submit(PROMPT, max_tokens=200, sampling=SamplingParams(temperature=0.8, seed=2))
    next(gen)
    threading.Thread(target=cluster.remove_node, args=(victim, False), daemon=True).start()
    with pytest.raises(StageFailedError, match="stage 1"):
        for _ in gen:
            pass
    got = pipe2.generate(PROMPT, max_tokens=6, sampling=SamplingParams(temperature=0))
    assert got.token_ids == greedy(whole, PROMPT, 6).token_ids
    pipe2.shutdown()
    assert alive_stage_actors(cluster) == []
