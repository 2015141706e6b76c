"""`ggufpy bench --server`: aggregate decode throughput of `ggufpy serve` and of llama-cpp-python's server
(`python -m llama_cpp.server`) on the same model and thread count, with 1, 4, 8 ... concurrent clients.

Each server runs in its own process on 127.0.0.1 (a free port), is warmed up by one request, then gets, for
each concurrency B, B simultaneous text completions of `gen_tokens` tokens each (greedy, the end-of-generation
tokens banned so every request generates all of them). Throughput = the completion tokens of all B requests /
the wall time from sending them to the last answer (prompts are a few tokens: this is decode).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

START_TIMEOUT = 300.0  # seconds a server may take to load and answer (numba compiles on a cold cache)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commands(path, threads: int, parallel: int, ctx: int, port: int) -> dict[str, list[str]]:
    """engine -> the command that serves `path` on 127.0.0.1:`port`."""
    ggufpy = "-m ggufpy serve -m {path} --port {port} --parallel {parallel} --ctx-size {ctx}"
    # llama-cpp-python's server: one request at a time behind a lock; a new request must not abort the running one
    llama = (
        "-m llama_cpp.server --model {path} --host 127.0.0.1 --port {port} --n_threads {threads} "
        "--n_threads_batch {threads} --n_ctx {ctx} --interrupt_requests False --verbose False"
    )
    fill = {"path": "\0", "port": port, "parallel": parallel, "ctx": ctx, "threads": threads}
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
    prompts = [f"Story number {i}: once upon a time" for i in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        t0 = time.perf_counter()
        tokens = sum(pool.map(lambda p: _one(url, p, gen_tokens, banned), prompts))
        seconds = time.perf_counter() - t0
    # the 1-minute load average as it ends: on a shared machine a figure means little without it
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"streams": streams, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "load": load}


@contextlib.contextmanager
def _server(engine: str, path, parallel: int, threads: int, banned):
    """`engine`'s server on `path` at a free loopback port, warmed up by one request: yields its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = 256 if engine == "ggufpy" else 256 * parallel  # llama-cpp-python: one context for everything
    argv = _commands(path, threads, parallel, ctx, port)[engine]
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


def run(
    path, streams=(1, 4, 8), gen_tokens: int = 32, threads: int = 2, engines=("ggufpy", "llama-cpp-python"),
    rounds: int = 1,
):  # fmt: skip
    """{engine: [measure(...) per concurrency]}, the best of `rounds` (each row's `rounds_tok_s` has them all);
    the end-of-generation tokens of `path` are banned.

    Both servers run at once (the idle one sleeps) and each round measures every concurrency on every engine
    one after the other, so a slow stretch of a shared machine falls on both engines' figures of that round."""
    from ..tokenizer import load_tokenizer

    banned = {str(t): -100.0 for t in sorted(load_tokenizer(path).eog_ids)}
    runs: dict[str, dict[int, list[dict]]] = {e: {b: [] for b in streams} for e in engines}
    with contextlib.ExitStack() as stack:
        urls = {e: stack.enter_context(_server(e, path, max(streams), threads, banned)) for e in engines}
        for _ in range(rounds):
            for b in streams:
                for e in engines:
                    runs[e][b].append(measure(urls[e], b, gen_tokens, banned))
    return {
        e: [
            {**max(rows, key=lambda r: r["tok_s"]), "rounds_tok_s": [r["tok_s"] for r in rows]} for rows in per.values()
        ]
        for e, per in runs.items()
    }


def table(results: dict[str, list[dict]]) -> str:
    """A Markdown table: tok/s per engine and concurrency, ggufpy's scaling and its ratio to llama-cpp-python."""
    engines = list(results)
    head = ["streams", *(f"{e} tok/s" for e in engines)]
    if "ggufpy" in results:
        head.append("ggufpy vs 1 stream")
    if len(engines) == 2:
        head.append(f"{engines[0]} / {engines[1]}")
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for i, row in enumerate(results[engines[0]]):
        cells = [str(row["streams"]), *(f"{results[e][i]['tok_s']:.1f}" for e in engines)]
        if "ggufpy" in results:
            cells.append(f"{results['ggufpy'][i]['tok_s'] / results['ggufpy'][0]['tok_s']:.2f}x")
        if len(engines) == 2:
            cells.append(f"{results[engines[0]][i]['tok_s'] / results[engines[1]][i]['tok_s']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    if len(engines) == 2:  # the other engine serves one request at a time: its best row bounds every row
        ceiling = max(r["tok_s"] for r in results[engines[1]])
        against = ", ".join(f"{r['streams']} streams {r['tok_s'] / ceiling:.2f}x" for r in results[engines[0]])
        lines.append(f"\n{engines[0]} / {engines[1]}'s best at any concurrency ({ceiling:.1f} tok/s): {against}")
    loads = [e + " " + ", ".join(f"{r['load']:.1f}" for r in results[e]) for e in engines if "load" in results[e][0]]
    if loads:
        lines.append("\nload average (1 min) at the end of each row: " + "; ".join(loads))
    if len(engines) == 2 and len(results[engines[0]][0].get("rounds_tok_s", ())) > 1:  # each round's own ratios
        a, b = (results[e] for e in engines)
        per_round = [
            f"{x['streams']} streams "
            + ", ".join(f"{p / q:.2f}x" for p, q in zip(x["rounds_tok_s"], y["rounds_tok_s"], strict=True))
            for x, y in zip(a, b, strict=True)
        ]
        lines.append(f"\n{engines[0]} / {engines[1]} in each round (the table keeps each engine's best): ")
        lines[-1] += "; ".join(per_round)
    return "\n".join(lines)
