"""Mixture-of-experts speed and memory at real scale against llama.cpp (issue 13's real-scale check).

    PYTHONPATH=. .venv/bin/python scripts/bench_moe_scale.py [--models qwen3moe gpt-oss] [--write-only] [--rounds 1]
        [--numerics llamacpp] [--cpu [--engines exact llamacpp llamacpp-per-expert llama.cpp] | --profile]

Two synthetic models of 1-2 GB with random weights, cached under ~/.cache/ggufpy/bench/:

- `qwen3moe`: dim 2048, 12 layers, 16/4 heads of 128, 32 experts of width 768, 4 used; Q4_K_S (experts and
  attention Q4_K, llama.cpp's mix picks the rest), 1.1 GB.
- `gpt-oss`: gpt-oss-20b's block in small: dim 2048, 12 layers, 32/8 heads of 64, attention sinks, biases,
  alternating 128-token sliding-window / full layers, YaRN, 32 experts of width 768, 4 used, clamped SwiGLU;
  MXFP4 experts and Q8_0 elsewhere, as gpt-oss ships (llama.cpp's MXFP4_MOE mix), 1.3 GB.

Each is written in Q8_0 by `conformance.fixtures_moe.write_tiny_moe` (ggufpy's NumPy k-quant quantizer takes
minutes at this size) and requantized by llama.cpp's own `llama_model_quantize`. Then `ggufpy bench --backend
numba --against-llamacpp` runs on it: each engine in a fresh process, prefill / decode tok/s, peak RSS. `--cpu`:
the engines in this process on one thread, timed in CPU seconds, alternating rounds (what means something on a
busy machine; "llamacpp-per-expert" is the llamacpp numerics without expert stacks, the path before them).
`--profile`: cProfile (CPU time) of 5 decoded tokens.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from conformance.fixtures_moe import TinyMoE, write_tiny_moe
from ggufpy.constants import GGMLType
from ggufpy.kernels.bench import requantized

CACHE = Path.home() / ".cache" / "ggufpy" / "bench"
Q8 = dict.fromkeys(("embd", "output", "attn", "ffn"), GGMLType.Q8_0)


@dataclass(frozen=True)
class ScaleModel:
    spec: TinyMoE  # written in Q8_0
    ftype: str  # llama.cpp's mix it is requantized to


MODELS: dict[str, ScaleModel] = {
    "qwen3moe": ScaleModel(
        TinyMoE(
            arch="qwen3moe",
            dim=2048,
            hidden_dim=2048,
            n_layers=12,
            n_heads=16,
            n_kv_heads=4,
            context_length=4096,
            rope_theta=1e6,
            tied_output=False,
            n_experts=32,
            n_experts_used=4,
            expert_hidden_dim=768,
            seed=3,
            types=Q8,
        ),
        "Q4_K_S",
    ),
    "gpt-oss": ScaleModel(
        TinyMoE(
            arch="gpt-oss",
            dim=2048,
            hidden_dim=768,
            n_layers=12,
            n_heads=32,
            n_kv_heads=8,
            key_length=64,
            context_length=4096,
            rope_theta=150000.0,
            tied_output=False,
            sliding_window=128,
            n_experts=32,
            n_experts_used=4,
            expert_hidden_dim=768,
            glu_scale=3.0,
            seed=4,
            types=Q8,
            extra_kv=(
                ("rope.scaling.type", "yarn"),
                ("rope.scaling.factor", 32.0),
                ("rope.scaling.original_context_length", 4096),
            ),
        ),
        "MXFP4_MOE",
    ),
}


def model_file(name: str) -> Path:
    """The cached requantized model `name`, written (Q8_0, then llama.cpp's quantizer) if it is not there."""
    m = MODELS[name]
    dest = CACHE / f"moe-scale-{name}.{m.ftype}.gguf"
    if not dest.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        src = CACHE / f"moe-scale-{name}.gguf"
        t0 = time.perf_counter()
        write_tiny_moe(src, m.spec)
        t1 = time.perf_counter()
        out = requantized(src, m.ftype, CACHE)
        out.replace(dest)
        src.unlink()
        print(f"{name}: wrote Q8_0 in {t1 - t0:.0f} s, {m.ftype} in {time.perf_counter() - t1:.0f} s", flush=True)
    return dest


def bench(path: Path, rounds: int, prompt_tokens: int, gen_tokens: int, numerics: str = "exact") -> str:
    """`ggufpy bench --backend numba --against-llamacpp` on `path`: its table."""
    cmd = [sys.executable, "-m", "ggufpy", "bench", "-m", str(path), "--backend", "numba", "--against-llamacpp"]
    cmd += ["--numerics", numerics]
    cmd += ["--rounds", str(rounds), "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


# --cpu engines: the numba backend in a numerics mode, "-per-expert" the path before expert stacks (one product
# call per expert and tensor, the router's softmax in NumPy), and llama.cpp; all in this process, one thread.
ENGINES = ("exact", "llamacpp", "llamacpp-per-expert", "llama.cpp")


def _engine(path: Path, name: str):
    """(name) -> a function (prompt, n_decode) -> (prefill s, decode s) of work on this process's threads."""
    from ggufpy.kernels import bench as kb

    if name == "llama.cpp":
        return lambda prompt, n: _llama_steps(path, prompt, n)
    model = kb.load_model(path, "numba", threads=1, numerics=name.removesuffix("-per-expert"))
    if name.endswith("-per-expert"):
        model.backend.expert_products = lambda *a: None  # `moe.expert_products` falls back to one call per expert
        model.backend.compiled = {}  # read by `moe.feed_forward` only (the model kept its own at load)

    def steps(prompt, n):
        cache = model.new_cache(len(prompt) + n)
        t0 = time.process_time()
        model.forward(prompt, 0, cache, last_only=True)
        t1 = time.process_time()
        for i in range(n):
            model.forward(prompt[i : i + 1], len(prompt) + i, cache, last_only=True)
        return t1 - t0, time.process_time() - t1

    return steps


def _llama_steps(path: Path, prompt, n: int) -> tuple[float, float]:
    from ggufpy.kernels import bench as kb

    clock = time.perf_counter
    time.perf_counter = time.process_time  # `time_llamacpp` timed in this process's CPU seconds
    try:
        speed = kb.time_llamacpp(path, prompt, n, threads=1)
    finally:
        time.perf_counter = clock
    return len(prompt) / speed.prefill, n / speed.decode


def per_token_cpu(path: Path, n_prompt: int, n_decode: int, rounds: int, engines=ENGINES) -> dict[str, dict]:
    """Per engine: CPU s of a prefill and CPU ms per decoded token (one thread, this process's CPU time, so that
    other processes on a busy machine count less), the best of `rounds` alternating rounds after a warm-up."""
    import ggufpy
    from ggufpy.kernels import bench as kb

    runs = {e: _engine(path, e) for e in engines}
    prompt = kb.prompt_tokens(n_prompt, len(ggufpy.open(path).metadata["tokenizer.ggml.tokens"]))
    for run in runs.values():
        run(prompt[:16], 2)
    best: dict[str, dict] = {e: {} for e in engines}
    for _ in range(rounds):
        for e, run in runs.items():
            pre, dec = run(prompt, n_decode)
            for key, v in (("prefill s", pre), ("decode ms", dec / n_decode * 1e3)):
                best[e][key] = min(best[e].get(key, v), v)
    return best


def profile_token(path: Path, n_prompt: int = 64, top: int = 25, numerics: str = "exact") -> str:
    """cProfile of one decode token after a prefill (one thread, CPU time): where the time goes."""
    import cProfile
    import io
    import pstats

    from ggufpy.kernels import bench as kb

    model = kb.load_model(path, "numba", threads=1, numerics=numerics)
    prompt = kb.prompt_tokens(n_prompt, model.config.vocab_size)
    cache = model.new_cache(n_prompt + 8)
    model.forward(prompt, 0, cache, last_only=True)
    for i in range(3):  # warm: every kernel compiled, every chosen expert packed
        model.forward(prompt[i : i + 1], n_prompt + i, cache, last_only=True)
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    for i in range(3, 8):
        model.forward(prompt[i : i + 1], n_prompt + i, cache, last_only=True)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--write-only", action="store_true", help="write the cached models and stop")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="cProfile 5 decode tokens (one thread) instead")
    parser.add_argument("--cpu", action="store_true", help="CPU time per token (one thread) of --engines instead")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--numerics", default="exact", help="the numerics mode of the bench and --profile")
    args = parser.parse_args()
    for name in args.models:
        path = model_file(name)
        size = path.stat().st_size / 1e9
        print(f"{name}: {path} ({size:.2f} GB)", flush=True)
        if args.profile:
            print(profile_token(path, args.prompt_tokens, numerics=args.numerics), flush=True)
        elif args.cpu:
            print(f"load average {os.getloadavg()[0]:.2f} before", flush=True)
            best = per_token_cpu(path, args.prompt_tokens, args.gen_tokens, args.rounds, args.engines)
            ref = best.get("llama.cpp")
            for e, ms in best.items():
                ratio = ""
                if ref and e != "llama.cpp":  # speed ratios: llama.cpp's time over ours
                    ratio = f" (prefill {ref['prefill s'] / ms['prefill s']:.2f}x"
                    ratio += f", decode {ref['decode ms'] / ms['decode ms']:.2f}x llama.cpp)"
                print(f"{e}: " + ", ".join(f"{k} {v:.3g}" for k, v in ms.items()) + ratio)
            print(f"load average {os.getloadavg()[0]:.2f} after")
        elif not args.write_only:
            print(f"load average {os.getloadavg()[0]:.2f} before the run", flush=True)
            print(bench(path, args.rounds, args.prompt_tokens, args.gen_tokens, args.numerics), flush=True)


if __name__ == "__main__":
    main()
