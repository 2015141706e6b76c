"""`ggufpy bench --server`: aggregate decode throughput of `ggufpy serve`, of llama-cpp-python's server
(`python -m llama_cpp.server`) and of llama.cpp's own batched decode (`bench_llamacpp.py`) on the same model and
thread count, with 1, 4, 8 ... concurrent streams.

Each server runs in its own process on 127.0.0.1 (a free port), is warmed up by one request, then gets, for
each concurrency B, B simultaneous text completions of `gen_tokens` tokens each (greedy, the end-of-generation
tokens banned so every request generates all of them). Throughput = the completion tokens of all B requests /
the wall time from sending them to the last answer (prompts are a few tokens: this is decode). llama-cpp-python's
server decodes one request at a time; "llama.cpp batched" decodes the same B prompts together in one process
(what llama-server's slots do, without HTTP), so it shows what batching gives llama.cpp on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

START_TIMEOUT = 300.0  # seconds a server may take to load and answer (numba compiles on a cold cache)
ONE_AT_A_TIME = "llama-cpp-python"  # serves one request at a time: its best row bounds it at any concurrency
BATCHED = "llama.cpp batched"  # llama.cpp's batched decode in one process, no server (bench_llamacpp.py)
ENGINES = ("ggufpy", ONE_AT_A_TIME, BATCHED)
PROMPT = "Story number {}: once upon a time"  # stream i's prompt, the same for every engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commands(path, threads: int, parallel: int, ctx: int, port: int, numerics: str = "exact") -> dict[str, list[str]]:
    """engine -> the command that serves `path` on 127.0.0.1:`port` (ggufpy in `numerics`)."""
    ggufpy = "-m ggufpy serve -m {path} --port {port} --parallel {parallel} --ctx-size {ctx} --numerics {numerics}"
    # llama-cpp-python's server: one request at a time behind a lock; a new request must not abort the running one
    llama = (
        "-m llama_cpp.server --model {path} --host 127.0.0.1 --port {port} --n_threads {threads} "
        "--n_threads_batch {threads} --n_ctx {ctx} --interrupt_requests False --verbose False"
    )
    fill = {"path": "\0", "port": port, "parallel": parallel, "ctx": ctx, "threads": threads, "numerics": numerics}
    return {  # the path goes in after splitting: it may hold spaces
        engine: [sys.executable, *(str(path) if a == "\0" else a for a in line.format(**fill).split())]
        for engine, line in (("ggufpy", ggufpy), ("llama-cpp-python", llama))
    }


def _wait_ready(proc: subprocess.Popen, url: str, log) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with code {proc.returncode}: {log.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server on {url} did not answer within {START_TIMEOUT:.0f} s")


def _one(url: str, prompt: str, n: int, banned: dict[str, float]) -> int:
    import httpx

    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logit_bias": banned}
    r = httpx.post(url + "/v1/completions", json=body, timeout=3600)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


def measure(url: str, streams: int, gen_tokens: int, banned: dict[str, float]) -> dict:
    """`streams` concurrent completions of `gen_tokens` tokens: tokens, seconds, aggregate tokens per second."""
    prompts = [PROMPT.format(i) for i in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        t0 = time.perf_counter()
        tokens = sum(pool.map(lambda p: _one(url, p, gen_tokens, banned), prompts))
        seconds = time.perf_counter() - t0
    # the 1-minute load average as it ends: on a shared machine a figure means little without it
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"streams": streams, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "load": load}


@contextlib.contextmanager
def _server(engine: str, path, parallel: int, threads: int, banned, numerics: str = "exact"):
    """`engine`'s server on `path` at a free loopback port, warmed up by one request: yields its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = 256 if engine == "ggufpy" else 256 * parallel  # llama-cpp-python: one context for everything
    argv = _commands(path, threads, parallel, ctx, port, numerics)[engine]
    env = {**os.environ, "NUMBA_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    log = tempfile.TemporaryFile()  # not a pipe: llama.cpp's load log would fill it and block the server
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        _wait_ready(proc, url, log)
        _one(url, "warm up", 4, banned)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _batched_command(path, streams: int, gen_tokens: int, threads: int, eog: list[int]) -> list[str]:
    """The command that measures llama.cpp's batched decode of `streams` sequences (`bench_llamacpp.py`)."""
    argv = [sys.executable, "-m", "ggufpy.server.bench_llamacpp", str(path), "--threads", str(threads)]
    return [*argv, "--streams", str(streams), "--gen-tokens", str(gen_tokens), "--eog", *map(str, eog)]


def _batched(path, streams: int, gen_tokens: int, threads: int, eog: list[int]) -> dict:
    """The `measure` row of llama.cpp's batched decode, run in a fresh process (OpenMP teams of `threads`)."""
    argv = _batched_command(path, streams, gen_tokens, threads, eog)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp's batched decode failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(
    path, streams=(1, 4, 8), gen_tokens: int = 32, threads: int = 2, engines=ENGINES, rounds: int = 1,
    numerics: str = "exact",
):  # fmt: skip
    """{engine: [measure(...) per concurrency]}, the best of `rounds` (each row's `rounds_tok_s` has them all);
    the end-of-generation tokens of `path` are banned; ggufpy serves in `numerics`.

    The servers run at once (the idle one sleeps) and each round measures every concurrency on every engine
    one after the other, so a slow stretch of a shared machine falls on all engines' figures of that round."""
    from ..tokenizer import load_tokenizer

    eog = sorted(load_tokenizer(path).eog_ids)
    banned = {str(t): -100.0 for t in eog}
    runs: dict[str, dict[int, list[dict]]] = {e: {b: [] for b in streams} for e in engines}
    with contextlib.ExitStack() as stack:
        servers = [e for e in engines if e != BATCHED]
        urls = {e: stack.enter_context(_server(e, path, max(streams), threads, banned, numerics)) for e in servers}
        for _ in range(rounds):
            for b in streams:
                for e in engines:
                    if e == BATCHED:
                        runs[e][b].append(_batched(path, b, gen_tokens, threads, eog))
                    else:
                        runs[e][b].append(measure(urls[e], b, gen_tokens, banned))
    return {
        e: [
            {**max(rows, key=lambda r: r["tok_s"]), "rounds_tok_s": [r["tok_s"] for r in rows]} for rows in per.values()
        ]
        for e, per in runs.items()
    }


def table(results: dict[str, list[dict]]) -> str:
    """A Markdown table: tok/s per engine and concurrency, each batching engine's gain over its one stream, and the
    first engine's ratio to each other one; then the lines that read those ratios on a shared machine."""
    engines = list(results)
    first, others = engines[0], engines[1:]
    batching = [e for e in engines if e != ONE_AT_A_TIME]
    head = ["streams", *(f"{e} tok/s" for e in engines), *(f"{e} vs 1 stream" for e in batching)]
    head += [f"{first} / {e}" for e in others]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for i, row in enumerate(results[first]):
        cells = [str(row["streams"]), *(f"{results[e][i]['tok_s']:.1f}" for e in engines)]
        cells += [f"{results[e][i]['tok_s'] / results[e][0]['tok_s']:.2f}x" for e in batching]
        cells += [f"{row['tok_s'] / results[e][i]['tok_s']:.2f}x" for e in others]
        lines.append("| " + " | ".join(cells) + " |")
    if ONE_AT_A_TIME in others:  # it serves one request at a time: its best row bounds every row
        ceiling = max(r["tok_s"] for r in results[ONE_AT_A_TIME])
        against = ", ".join(f"{r['streams']} streams {r['tok_s'] / ceiling:.2f}x" for r in results[first])
        lines.append(f"\n{first} / {ONE_AT_A_TIME}'s best at any concurrency ({ceiling:.1f} tok/s): {against}")
    loads = [e + " " + ", ".join(f"{r['load']:.1f}" for r in results[e]) for e in engines if "load" in results[e][0]]
    if loads:
        lines.append("\nload average (1 min) at the end of each row: " + "; ".join(loads))
    for other in others:  # each round's own ratios
        a, b = results[first], results[other]
        if len(a[0].get("rounds_tok_s", ())) > 1:
            per_round = [
                f"{x['streams']} streams "
                + ", ".join(f"{p / q:.2f}x" for p, q in zip(x["rounds_tok_s"], y["rounds_tok_s"], strict=True))
                for x, y in zip(a, b, strict=True)
            ]
            lines.append(f"\n{first} / {other} in each round (the table keeps each engine's best): ")
            lines[-1] += "; ".join(per_round)
    return "\n".join(lines)
