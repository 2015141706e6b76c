"""Decode cost of a mixture of experts against the same model computing every expert (issue 13).

    .venv/bin/python scripts/bench_moe.py [--backend numba] [--big]

Writes a synthetic qwen3moe (8 experts, 2 used per token, Q8_0) to a temporary directory, then decodes 24 tokens
with the 2 routed experts, and with the same file whose config routes every token to all 8 (the dense cost:
every expert read and computed, weights zero for none), and prints ms/token (the best of 5 runs of each) and the
ratio. Default shape: dim 512, 4 layers, expert width 1024 (57 MB); --big: dim 1024, 2 layers, width 2048 (113 MB).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

import ggufpy
from conformance.fixtures_moe import TinyMoE, write_tiny_moe
from ggufpy.constants import GGMLType


def spec(big: bool) -> TinyMoE:
    q8 = dict.fromkeys(("embd", "output", "attn", "ffn"), GGMLType.Q8_0)
    return TinyMoE(
        arch="qwen3moe",
        dim=1024 if big else 512,
        hidden_dim=2048,
        n_layers=2 if big else 4,
        n_heads=8,
        n_kv_heads=2,
        context_length=512,
        tied_output=True,
        n_experts=8,
        n_experts_used=2,
        expert_hidden_dim=2048 if big else 1024,
        seed=9,
        types=q8,
    )


def ms_per_token(model, n: int = 24) -> float:
    cache = model.new_cache(64)
    model.forward(np.arange(3, 11), 0, cache)
    token = 5
    t0 = time.perf_counter()
    for i in range(n):
        token = int(np.argmax(model.forward(np.array([token]), 8 + i, cache)[-1]))
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--big", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_moe(Path(tmp) / "moe.gguf", spec(args.big))
        routed = ggufpy.load(path, backend=args.backend, tokenizer=False)
        dense = ggufpy.load(path, backend=args.backend, tokenizer=False)
        dense.config = dataclasses.replace(dense.config, n_experts_used=dense.config.n_experts)
        for model in (routed, dense):
            ms_per_token(model, 4)  # compile, pack every expert
        runs = {"routed": [], "dense": []}
        for _ in range(5):
            runs["routed"].append(ms_per_token(routed))
            runs["dense"].append(ms_per_token(dense))
        a, b = min(runs["routed"]), min(runs["dense"])
        size = path.stat().st_size / 1e6
        print(f"{args.backend}, {size:.0f} MB: 2 of 8 experts {a:.1f} ms/token, all 8 {b:.1f} ms/token: {b / a:.2f}x")


if __name__ == "__main__":
    main()
