"""Mixture-of-experts speed and memory at real scale against llama.cpp (issue 13's real-scale check).

    .venv/bin/python scripts/bench_moe_scale.py [--models qwen3moe gpt-oss] [--write-only] [--rounds 1]

Two synthetic models of 1-2 GB with random weights, cached under ~/.cache/ggufpy/bench/:

- `qwen3moe`: dim 2048, 12 layers, 16/4 heads of 128, 32 experts of width 768, 4 used; Q4_K_S (experts and
  attention Q4_K, llama.cpp's mix picks the rest), 1.1 GB.
- `gpt-oss`: gpt-oss-20b's block in small: dim 2048, 12 layers, 32/8 heads of 64, attention sinks, biases,
  alternating 128-token sliding-window / full layers, YaRN, 32 experts of width 768, 4 used, clamped SwiGLU;
  MXFP4 experts and Q8_0 elsewhere, as gpt-oss ships (llama.cpp's MXFP4_MOE mix), 1.3 GB.

Each is written in Q8_0 by `conformance.fixtures_moe.write_tiny_moe` (ggufpy's NumPy k-quant quantizer takes
minutes at this size) and requantized by llama.cpp's own `llama_model_quantize`. Then `ggufpy bench --backend
numba --against-llamacpp` runs on it: each engine in a fresh process, prefill / decode tok/s, peak RSS.
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


def bench(path: Path, rounds: int, prompt_tokens: int, gen_tokens: int) -> str:
    """`ggufpy bench --backend numba --against-llamacpp` on `path`: its table."""
    cmd = [sys.executable, "-m", "ggufpy", "bench", "-m", str(path), "--backend", "numba", "--against-llamacpp"]
    cmd += ["--rounds", str(rounds), "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def per_token_cpu(path: Path, n_prompt: int, n_decode: int, rounds: int) -> dict[str, float]:
    """CPU s of a prefill and CPU ms per decoded token (one thread, this process's CPU time, so that other
    processes on a busy machine count less), the best of `rounds` after one that packs the experts and compiles."""
    from ggufpy.kernels import bench as kb

    model = kb.load_model(path, "numba", threads=1)
    prompt = kb.prompt_tokens(n_prompt, model.config.vocab_size)
    best: dict[str, float] = {}
    for r in range(rounds + 1):
        cache = model.new_cache(n_prompt + n_decode)
        t0 = time.process_time()
        model.forward(prompt, 0, cache, last_only=True)
        t1 = time.process_time()
        for i in range(n_decode):
            model.forward(prompt[i : i + 1], n_prompt + i, cache, last_only=True)
        t2 = time.process_time()
        for key, v in (("prefill s", t1 - t0), ("decode ms", (t2 - t1) / n_decode * 1e3)):
            if r:
                best[key] = min(best.get(key, v), v)
    return best


def profile_token(path: Path, n_prompt: int = 64, top: int = 25) -> str:
    """cProfile of one decode token after a prefill (one thread): where the time goes."""
    import cProfile
    import io
    import pstats

    from ggufpy.kernels import bench as kb

    model = kb.load_model(path, "numba", threads=1)
    prompt = kb.prompt_tokens(n_prompt, model.config.vocab_size)
    cache = model.new_cache(n_prompt + 8)
    model.forward(prompt, 0, cache, last_only=True)
    for i in range(3):  # warm: every kernel compiled, every chosen expert packed
        model.forward(prompt[i : i + 1], n_prompt + i, cache, last_only=True)
    prof = cProfile.Profile()
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
    parser.add_argument("--cpu", action="store_true", help="CPU time per token (one thread) instead")
    args = parser.parse_args()
    for name in args.models:
        path = model_file(name)
        size = path.stat().st_size / 1e9
        print(f"{name}: {path} ({size:.2f} GB)", flush=True)
        if args.profile:
            print(profile_token(path, args.prompt_tokens), flush=True)
        elif args.cpu:
            ms = per_token_cpu(path, args.prompt_tokens, args.gen_tokens, args.rounds)
            print(", ".join(f"{k} {v:.3g}" for k, v in ms.items()), f"(load {os.getloadavg()[0]:.2f})")
        elif not args.write_only:
            print(f"load average {os.getloadavg()[0]:.2f} before the run", flush=True)
            print(bench(path, args.rounds, args.prompt_tokens, args.gen_tokens), flush=True)


if __name__ == "__main__":
    main()
