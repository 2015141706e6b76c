"""`ggufpy bench --against-llamacpp` once per issue-12 quant type, on a synthetic llama in that type.

    python scripts/bench_types.py [--types IQ2_XXS TQ2_0 ...] [--threads 2] [--rounds 1] [--numerics exact]

The models are written once and cached in ~/.cache/ggufpy/bench/ (`types-{TYPE}-d{dim}-f{ffn}-l{layers}.gguf`):
a llama of dim 1024, ffn 2816 and 8 layers (16 heads, 4 KV heads; both multiples of 256, so every 256-element
type applies to every matrix) with every matrix, the embeddings and the output head in the type. The weights
are the same f32 draws for every type (`conformance.fixtures.write_tiny_llama`, seed 0), quantized by ggml's
own quantizer (`ggml_quantize_chunk`, with an importance matrix of ones where ggml requires one): all
matrices in one type, which llama.cpp's mixes (`llama_model_quantize`) would not give.

Each row is one `ggufpy bench --json` run: every engine in its own fresh process, best of `--rounds`. When
llama.cpp cannot run a type, the row says so and keeps ggufpy's figures. Prints a markdown table with the load
average before and after each row: on a shared machine only the ratios within a row mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0"]
CACHE = Path.home() / ".cache" / "ggufpy" / "bench"


def model_path(type_name: str, dim: int, ffn: int, layers: int) -> Path:
    """The cached model of one type, written on first use."""
    import numpy as np

    from conformance import fixtures as fx
    from conformance.llamacpp import ggml_quantize
    from ggufpy.constants import GGMLType

    path = CACHE / f"types-{type_name}-d{dim}-f{ffn}-l{layers}.gguf"
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    t = GGMLType[type_name]
    spec = fx.TinyLlama(
        dim=dim, hidden_dim=ffn, n_layers=layers, n_heads=16, n_kv_heads=4, context_length=1024,
        types=dict.fromkeys(fx.ROLES, t),
    )  # fmt: skip
    tmp = path.with_suffix(".tmp")
    quantize = fx._quantize
    fx._quantize = lambda data, qtype: ggml_quantize(np.asarray(data, np.float32), qtype)  # ggml's C quantizer
    try:
        fx.write_tiny_llama(tmp, spec)
    finally:
        fx._quantize = quantize
    tmp.replace(path)
    return path


def bench(path: Path, args: argparse.Namespace, llamacpp: bool) -> dict:
    """`ggufpy bench --json` on one model: {engine: result}."""
    cmd = [sys.executable, "-m", "ggufpy", "bench", "-m", str(path), "--backend", "numba", "--json"]
    cmd += ["--threads", str(args.threads), "--rounds", str(args.rounds), "--numerics", args.numerics]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    cmd += ["--against-llamacpp"] if llamacpp else []
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
    return json.loads(done.stdout)["engines"]


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--numerics", default="exact")
    ap.add_argument("--build-only", action="store_true", help="write the cached models and stop")
    args = ap.parse_args()

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"`python scripts/bench_types.py {' '.join(sys.argv[1:])}`, {when}")
    print(f"synthetic llama, dim {args.dim}, ffn {args.ffn}, {args.layers} layers; {args.prompt_tokens}-token prompt,")
    print(f"{args.gen_tokens} generated tokens, {args.threads} threads, numba in the {args.numerics} numerics\n")
    print("| type | ggufpy prefill tok/s | ggufpy decode tok/s | llama.cpp prefill | llama.cpp decode "
          "| prefill ratio | decode ratio | load average before / after |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in args.types:
        path = model_path(name, args.dim, args.ffn, args.layers)
        if args.build_only:
            print(f"| {name} | {path} ({path.stat().st_size / 2**20:.1f} MiB) |", flush=True)
            continue
        before = load()
        try:
            r = bench(path, args, llamacpp=True)
            theirs = r["llama.cpp"]
            cells = [f"{theirs['prefill']:.1f}", f"{theirs['decode']:.1f}"]
            cells += [f"{r['numba']['prefill_ratio']:.2f}x", f"{r['numba']['decode_ratio']:.2f}x"]
        except RuntimeError as e:  # llama.cpp refused the type (or crashed): keep ggufpy's row
            r = bench(path, args, llamacpp=False)
            cells = [f"llama.cpp cannot run it: {e}"[:80], "-", "-", "-"]
        ours = r["numba"]
        print(f"| {name} | {ours['prefill']:.1f} | {ours['decode']:.1f} | {' | '.join(cells)} | {before} / {load()} |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
