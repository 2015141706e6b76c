"""Decode speed after 0, 1k, 4k and 16k tokens of context (issue 16 item 5), ggufpy against llama.cpp.

    python scripts/bench_context.py [--model FILE] [--contexts 0 1024 4096 16384] [--tokens 16] [--threads 2]

Engines, each in a fresh process (its peak RSS is its own):
- `ggufpy f32`: the numba backend, exact numerics, an f32 KV cache (the fused decode block);
- `ggufpy q8_0`: the same with `new_cache(kv_type="q8_0")` (K/V as Q8_0 blocks, Hadamard-rotated as llama.cpp
  does; attention by `kernels.attention_q8`);
- `llama.cpp f16`, `llama.cpp q8_0`: llama-cpp-python with flash attention on and `type_k = type_v` F16 / Q8_0.

How the context is filled: llama.cpp by a real prefill (ubatches of 512) up to each context length in turn.
ggufpy's cache is filled directly: each layer's K/V rows for positions 0..n-1 are random values of the size a
real prefill stores (f32 normal, or those quantized to Q8_0), and the cache length set to n. The decode cost of
attention depends on the number of cached positions, not on their values, so the decode timing is that of a
real context of n tokens; a real 16k prefill of the 1B model in ggufpy takes minutes (prefill speed is
measured separately: `ggufpy bench`). A file whose context length is shorter than the longest context (the
synthetic 1B: 1024) has it raised for the run (random weights: positions past it mean no less than before).
Decode tok/s is the best of 2 runs of `--tokens` tokens each, after one
warm-up token; with `--cpu-time`, per CPU second of the process (with `--threads 1`: of one thread), which a
busy machine disturbs far less than wall time. Prints a markdown table and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_MODEL = str(Path.home() / ".cache/ggufpy/bench/synthetic-llama-1B.Q4_0.gguf")  # scripts/size_models.py

_GGUFPY = r"""
import dataclasses, json, sys, time
import numpy as np
from ggufpy.kernels import bench
path, kv_type, threads, n_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
contexts = [int(c) for c in sys.argv[5].split(",")]
clock = time.process_time if sys.argv[6] == "cpu" else time.perf_counter
kv_type = None if kv_type == "f32" else kv_type
model = bench.load_model(path, "numba", threads=threads)
if model.config.context_length < max(contexts) + 2 * n_tokens + 8:  # a synthetic file's short context: raised
    model.config = dataclasses.replace(model.config, context_length=max(contexts) + 2 * n_tokens + 8)
if kv_type and not hasattr(model.backend, "attention_q8"):
    # until NumbaBackend has `attention_q8` (kvcache.attention_q8 looks for it): the compiled kernel, f32 mode
    from ggufpy.kernels import attention_q8
    model.backend.attention_q8 = lambda q, k, v, start, scale, window=None, softcap=None: attention_q8.attention(
        q, k, v, start, scale, window, softcap, ggml=model.numerics.x86_kernels, threads=threads)
cfg = model.config
rng = np.random.default_rng(0)
cache = model.new_cache(capacity=max(contexts) + 2 * n_tokens + 8, kv_type=kv_type)
prompt = bench.prompt_tokens(64, cfg.vocab_size)
model.forward(prompt[:8], 0, cache, last_only=True)  # compiles (or loads) the kernels
out, filled = {}, 0
for n in sorted(contexts):
    if n > filled:  # fill positions filled..n-1 of every layer as a prefill would (see the module docstring)
        for i in model.layers:
            step = 2048
            for lo in range(filled, n, step):
                rows = min(step, n - lo)
                k = rng.standard_normal((rows, cfg.n_kv_heads, cfg.head_dim), np.float32)
                cache.update(i, lo, k, k[::-1].copy())
    cache.advance(n)
    filled = n
    best = 0.0
    for _ in range(2):
        cache.truncate(n)
        model.forward(prompt[:1], n, cache, last_only=True)  # warm-up token
        t0 = clock()
        for j in range(n_tokens):
            model.forward(prompt[j + 1 : j + 2], n + 1 + j, cache, last_only=True)
        best = max(best, n_tokens / (clock() - t0))
    out[n] = best
print(json.dumps({"decode": out, "peak_rss": bench.peak_rss(), "cache_bytes": cache.nbytes}))
"""

_LLAMACPP = r"""
import json, sys, time
import numpy as np
import llama_cpp
from ggufpy.kernels import bench
path, kv_type, threads, n_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
contexts = [int(c) for c in sys.argv[5].split(",")]
clock = time.process_time if sys.argv[6] == "cpu" else time.perf_counter
ggml_type = {"f16": 1, "q8_0": 8}[kv_type]
n_ctx = max(contexts) + 2 * n_tokens + 64
llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                      n_threads_batch=threads, flash_attn=True, type_k=ggml_type, type_v=ggml_type, verbose=False)
tokens = [int(t) for t in bench.prompt_tokens(max(contexts) + 2 * n_tokens + 8, llm.n_vocab(), seed=1)]
out, prefill_s, filled = {}, 0.0, 0
for n in sorted(contexts):
    llm.n_tokens = filled  # Llama.eval drops the cache from n_tokens on: the decoded tokens go, the context stays
    t0 = time.perf_counter()
    if n > filled:
        llm.eval(tokens[filled:n])  # the context, by a real prefill, continuing the shorter one
    prefill_s += time.perf_counter() - t0
    filled = n
    best = 0.0
    for _ in range(2):
        llm.n_tokens = n
        llm.eval([tokens[n]])  # warm-up token
        t0 = clock()
        for j in range(n_tokens):
            llm.eval([tokens[n + 1 + j]])
        best = max(best, n_tokens / (clock() - t0))
    out[n] = best
print(json.dumps({"decode": out, "peak_rss": bench.peak_rss(), "prefill_s": prefill_s}))
"""

ENGINES = {  # name -> (child program, KV type)
    "ggufpy numba, f32 cache": (_GGUFPY, "f32"),
    "ggufpy numba, q8_0 cache": (_GGUFPY, "q8_0"),
    "llama.cpp, f16 cache (fa on)": (_LLAMACPP, "f16"),
    "llama.cpp, q8_0 cache (fa on)": (_LLAMACPP, "q8_0"),
}


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 1024, 4096, 16384])
    p.add_argument("--llamacpp-contexts", type=int, nargs="+", default=None, help="default: --contexts")
    p.add_argument("--tokens", type=int, default=16, help="decode tokens timed per run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu-time", action="store_true", help="tokens per CPU second of the process (busy machines)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    args = p.parse_args()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    unit = "tokens per CPU second" if args.cpu_time else "tokens per second"
    print(f"{Path(args.model).name}, {args.threads} threads, {unit}, load average before: {_loadavg()}", flush=True)
    results = {}
    for name in args.engines:
        program, kv_type = ENGINES[name]
        clock = "cpu" if args.cpu_time else "wall"
        contexts = args.llamacpp_contexts if program is _LLAMACPP and args.llamacpp_contexts else args.contexts
        argv = [args.model, kv_type, str(args.threads), str(args.tokens), ",".join(map(str, contexts)), clock]
        done = subprocess.run([sys.executable, "-c", program, *argv], capture_output=True, text=True, env=env)
        if done.returncode:
            print(f"{name}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  {name}: {results[name]} (load average {_loadavg()})", flush=True)
    heads = " | ".join(f"decode tok/s @ {n}" for n in args.contexts)
    print(f"\n| engine | {heads} | peak RSS MiB |")
    print("| --- |" + " ---: |" * (len(args.contexts) + 1))
    for name, r in results.items():
        speeds = " | ".join(f"{r['decode'][str(n)]:.1f}" if str(n) in r["decode"] else "-" for n in args.contexts)
        print(f"| {name} | {speeds} | {r['peak_rss'] / 2**20:.0f} |")
    print(f"\nload average after: {_loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
