"""Measure `ggufpy.distributed.RayPipeline` on a local Ray cluster (3 nodes on this machine, loopback):

1. what one hop costs: a hidden-state array sent through a chain of stage actors that return it unchanged
   (`Stage.echo`), for decode (T=1) and prefill (T=64) shapes, at SmolLM2's dim (576) and a 70B-class dim (8192);
2. throughput of 1 vs 2 vs 3 stages, with 1 and with 8 concurrent requests (greedy, `--tokens` each);
3. memory per stage (VmRSS, anonymous, the .gguf file's resident pages) against the file bytes of its layers;
4. what a real network would add per token: bytes per hop / bandwidth + RTT, for 1 and 10 Gbit/s.

    python scripts/bench_ray.py --model smollm2 --tokens 16 --json /tmp/bench_ray.json

Numbers in docs/distributed.md. On a 2-core machine the stages share the cores: the throughput rows measure the
pipeline's overhead and its batching, not a real cluster's speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node on 127.0.0.1
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

MB = 1 << 20
GB = 1 << 30
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, the first",
    "A haiku about the sea:",
    "The recipe for pancakes:",
    "Photosynthesis is",
]
LINKS = {"1 Gbit/s": (1e9 / 8, 200e-6), "10 Gbit/s": (10e9 / 8, 50e-6)}  # bytes/s and a LAN round trip


def hop_costs(ray, stages, dims=(576, 8192), rounds=20) -> list[dict]:
    """ms per hop of an f32 hidden array through `stages` echo actors (driver -> s0 -> ... -> driver)."""
    rows = []
    for dim in dims:
        for T in (1, 64):
            x = np.ones((T, dim), np.float32)
            for k in (1, len(stages)):
                times = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    ref = x
                    for st in stages[:k]:
                        ref = st.echo.remote(ref)
                    ray.get(ref, timeout=120)
                    times.append(time.perf_counter() - t0)
                ms = statistics.median(times) * 1000
                rows.append({"dim": dim, "T": T, "bytes": x.nbytes, "actors": k, "ms": ms, "ms_per_hop": ms / (k + 1)})
    return rows


def throughput(pipe, concurrent: int, tokens: int) -> dict:
    from ggufpy.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    pipe.generate(PROMPTS[0], max_tokens=2, sampling=greedy)  # first-use costs out of the timing
    before = [i["busy_seconds"] for i in pipe.info()]
    t0 = time.perf_counter()
    gens = [pipe.submit(PROMPTS[i % len(PROMPTS)], max_tokens=tokens, sampling=greedy) for i in range(concurrent)]
    results = [list(g) and g.result for g in gens]
    seconds = time.perf_counter() - t0
    busy = [i["busy_seconds"] - b for i, b in zip(pipe.info(), before, strict=True)]
    n = sum(r.completion_tokens for r in results)
    return {"tokens": n, "seconds": seconds, "tokens_per_s": n / seconds, "stage_busy_s": busy}


def single_process(path, backend: str, tokens: int, options: dict) -> dict:
    import ggufpy
    from ggufpy.generation import generate_text
    from ggufpy.sampling import SamplingParams

    model = ggufpy.load(path, backend=backend, **options)
    ids = model.tokenizer.encode(PROMPTS[0], add_special=True)
    generate_text(model, model.tokenizer, ids, max_tokens=2, sampling=SamplingParams(temperature=0))
    t0 = time.perf_counter()
    r = generate_text(model, model.tokenizer, ids, max_tokens=tokens, sampling=SamplingParams(temperature=0))
    return {
        "tokens": r.completion_tokens,
        "seconds": time.perf_counter() - t0,
        "decode_tok_s": r.decode_tokens_per_second,
    }


def network_table(dims=(576, 8192), stages=(2, 3)) -> list[dict]:
    """Time a real network adds per generated token, for a driver on its own machine.

    As the pipeline runs today, the driver calls each stage in turn: a hidden row under Ray's inline limit
    (100 KB) goes back through the driver, so a token costs S round trips and 2 (S - 1) transfers of 4 D
    bytes (`via_driver`). Stages sending straight to the next one would cost (S + 1) one-way trips and
    S - 1 transfers (`direct`, the lower bound)."""
    rows = []
    for dim in dims:
        for s in stages:
            for link, (bandwidth, rtt) in LINKS.items():
                wire = dim * 4 / bandwidth
                rows.append(
                    {
                        "dim": dim,
                        "stages": s,
                        "link": link,
                        "bytes_per_hop": dim * 4,
                        "via_driver_ms": (s * rtt + 2 * (s - 1) * wire) * 1000,
                        "direct_ms": ((s + 1) * rtt / 2 + (s - 1) * wire) * 1000,
                    }
                )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    from ggufpy.distributed import RayPipeline
    from ggufpy.packaged import resolve

    path = resolve(args.model)
    options = {"cache_bytes": 0} if args.backend == "numpy" else {}  # memory rows: mapped bytes, not a cache
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "memory": 4 * GB, "include_dashboard": False}
    )
    out: dict = {"model": str(path), "backend": args.backend, "load_average": os.getloadavg()}
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, memory=4 * GB)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        out["single_process"] = single_process(path, args.backend, args.tokens, options)
        print("single process:", out["single_process"], file=sys.stderr)
        out["pipelines"] = []
        for stages in (1, 2, 3):
            with RayPipeline(path, stages=stages, backend=args.backend, ctx_size=256, backend_options=options) as pipe:
                row = {"stages": stages, "plan": [s.describe() for s in pipe.plan]}
                if stages == 3:
                    out["hops"] = hop_costs(ray, pipe.stages)
                for concurrent in (1, 8):
                    row[f"concurrent_{concurrent}"] = throughput(pipe, concurrent, args.tokens)
                row["memory"] = [
                    {
                        "layers": i["layers"],
                        "file_share_mb": s.estimate.weights / MB,
                        **{k: i.get(k) for k in ("VmRSS", "RssAnon", "RssFile", "gguf")},
                    }
                    for s, i in zip(pipe.plan, pipe.info(), strict=True)
                ]
                print(json.dumps(row), file=sys.stderr)
                out["pipelines"].append(row)
        out["network"] = network_table()
    finally:
        ray.shutdown()
        cluster.shutdown()
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
