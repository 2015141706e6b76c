"""Timing helpers shared by `scripts/bench_kernels.py` and the `ggufpy bench` command.

    from ggufpy.kernels import bench
    model = bench.load_model(path, "numba", threads=2)
    ours = bench.time_ggufpy(model, prompt, n_decode=64)
    theirs = bench.time_llamacpp(path, prompt, n_decode=64, threads=2)
    print(ours.decode / theirs.decode)

Prefill is one forward pass over the prompt (logits of the last token only, as llama.cpp computes them);
decode is `n_decode` single-token forward passes after it. Engines should be timed alternately and the best
of several rounds kept (`best_of`): other processes on the machine only ever slow a run down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "Speed",
    "best_of",
    "compile_times",
    "llamacpp_available",
    "load_model",
    "matvec_speed",
    "peak_rss",
    "prompt_tokens",
    "requantized",
    "time_ggufpy",
    "time_llamacpp",
]


@dataclasses.dataclass(frozen=True)
class Speed:
    """Tokens per second of one engine on one model: prompt processing and generation."""

    prefill: float
    decode: float
    n_prompt: int
    n_decode: int


def best_of(speeds: Sequence[Speed]) -> Speed:
    return Speed(max(s.prefill for s in speeds), max(s.decode for s in speeds), speeds[0].n_prompt, speeds[0].n_decode)


def prompt_tokens(n: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """n token ids drawn away from the special tokens at the start of a vocabulary."""
    return np.random.default_rng(seed).integers(min(100, vocab_size // 2), vocab_size, n)


def load_model(path: str | os.PathLike, backend: str, **options):
    """`ggufpy.load` without the tokenizer, with every weight repacked up front."""
    import ggufpy

    model = ggufpy.load(path, backend=backend, tokenizer=False, **options)
    if hasattr(model.backend, "prepack"):
        model.backend.prepack(model_weights(model))
    return model


def model_weights(model) -> list:
    """Every matrix the backend multiplies by, layer by layer (expert stacks as `ExpertTensor`s: the backend's
    `prepack` groups or packs all their experts), then the output head."""
    from ..weights import ExpertTensor, QuantTensor

    found = []
    for layer in model.weights.layers.values():
        found += [w for w in vars(layer).values() if isinstance(w, QuantTensor | ExpertTensor)]
    if model.weights.output is not None:
        found.append(model.weights.output)
    return found


def time_ggufpy(model, prompt: np.ndarray, n_decode: int) -> Speed:
    cache = model.new_cache(capacity=len(prompt) + n_decode)
    t0 = time.perf_counter()
    model.forward(np.asarray(prompt), 0, cache, last_only=True)
    t1 = time.perf_counter()
    for i in range(n_decode):
        model.forward(np.asarray(prompt[i % len(prompt) : i % len(prompt) + 1]), len(prompt) + i, cache, last_only=True)
    t2 = time.perf_counter()
    return Speed(len(prompt) / (t1 - t0), n_decode / (t2 - t1), len(prompt), n_decode)


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


_LLAMAS: dict[tuple[str, int, int], object] = {}


def time_llamacpp(path: str | os.PathLike, prompt: np.ndarray, n_decode: int, threads: int = 2) -> Speed:
    """The same measurement on llama.cpp through llama-cpp-python (`Llama.eval`, default flash attention)."""
    import llama_cpp

    n_ctx = int(2 ** np.ceil(np.log2(len(prompt) + n_decode + 8)))
    key = (str(path), threads, n_ctx)
    llm = _LLAMAS.get(key)
    if llm is None:
        llm = _LLAMAS[key] = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=max(512, len(prompt)),
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
    tokens = [int(t) for t in prompt]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(tokens)
    t1 = time.perf_counter()
    for i in range(n_decode):
        llm.eval([tokens[i % len(tokens)]])
    t2 = time.perf_counter()
    return Speed(len(tokens) / (t1 - t0), n_decode / (t2 - t1), len(tokens), n_decode)


def requantized(src: str | os.PathLike, ftype: str, directory: str | os.PathLike | None = None) -> Path:
    """`src` requantized by llama.cpp to `ftype` ("Q8_0", "Q4_K_M", ...), cached in `directory`.

    Tensors whose rows do not fit the type's blocks get llama.cpp's fallback types (for SmolLM2, whose
    dim 576 is not a multiple of 256, the k-quant mixes are mostly Q5_0/Q5_1/Q8_0 with k-quant ffn_down).
    """
    import llama_cpp

    src = Path(src)
    directory = Path(directory or Path.home() / ".cache" / "ggufpy" / "bench")
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / f"{src.stem}.{ftype}.gguf"
    if not dest.exists() or dest.stat().st_mtime < src.stat().st_mtime:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 1
        tmp = dest.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
        tmp.replace(dest)
    return dest


def matvec_speed(ggml_type, rows: int, cols: int, n_tokens: int = 1, threads: int | None = None, seconds=0.3):
    """(GMAC/s, file GB/s) of `NumbaBackend.linear` on a random weight, best of a few timed batches."""
    from ..quants import quant_type
    from ..weights import QuantTensor
    from .backend import NumbaBackend

    qt = quant_type(ggml_type)
    rng = np.random.default_rng(0)
    n_blocks = rows * cols // qt.block_size
    blocks = rng.integers(0, 256, (n_blocks, qt.type_size), dtype=np.uint8)
    blocks[:, : min(4, qt.type_size)] = 0x20  # small finite scales (the fp16/f32 fields lead most blocks)
    w = QuantTensor("bench", ggml_type, (rows, cols), blocks.reshape(-1))
    be = NumbaBackend(threads=threads)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    be.linear(x, w)
    reps = 1
    while True:  # calibrate the batch length
        t0 = time.perf_counter()
        for _ in range(reps):
            be.linear(x, w)
        dt = time.perf_counter() - t0
        if dt > seconds / 5:
            break
        reps *= 2
    best = min(_timed(lambda: be.linear(x, w), reps) for _ in range(5))
    return rows * cols * n_tokens / best / 1e9, w.raw.nbytes / best / 1e9


def _timed(fn: Callable[[], object], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def peak_rss() -> int:
    """This process's peak resident set size in bytes: VmHWM from /proc/self/status. (getrusage's ru_maxrss
    would do off Linux, but on Linux a child started by exec inherits its parent's peak in it.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from ggufpy.kernels import bench
from ggufpy.kernels._numba import wait_for_compiles
import numpy as np
path, backend = sys.argv[1], sys.argv[2]
threads, n_prompt, n_decode = (int(a) for a in sys.argv[3:6])
numerics = sys.argv[6]
t1 = time.perf_counter()
model = bench.load_model(path, backend, numerics=numerics, **({"threads": threads} if backend == "numba" else {}))
t2 = time.perf_counter()
prompt = bench.prompt_tokens(n_prompt, model.config.vocab_size)
first = bench.time_ggufpy(model, prompt, 1)  # compiles (or loads) every kernel the timed run uses: the whole
# prompt, since a long prompt takes other kernels than 8 tokens (the BLAS tiles of the exact numerics)
# the fused decode blocks load in the background after the first decode step (the layers run unfused meanwhile,
# with the loader on the same cores): the timed run measures the steady state, first_call_s includes the wait
wait_for_compiles()
t3 = time.perf_counter()
speed = bench.time_ggufpy(model, prompt, n_decode)
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_call_s": t3 - t2, "peak_rss": bench.peak_rss(),
                  "prefill": speed.prefill, "decode": speed.decode}))
"""


def run_child(
    path, backend: str = "numba", threads: int = 2, n_prompt: int = 128, n_decode: int = 16, env=None, numerics="exact"
):
    """Load and run a model in a fresh interpreter: its peak RSS and its start-up costs, as a dict."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), backend, str(threads), str(n_prompt), str(n_decode), numerics],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"benchmark child failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


_BASELINE_CHILD = """
import numpy as np
from ggufpy.constants import GGMLType
from ggufpy.kernels import bench
from ggufpy.kernels.backend import NumbaBackend
from ggufpy.weights import QuantTensor
be = NumbaBackend()
rng = np.random.default_rng(0)
for t, size in ((GGMLType.Q4_1, 20), (GGMLType.Q8_0, 34)):
    raw = rng.integers(0, 256, 64 * 2 * size, dtype=np.uint8)
    raw.reshape(-1, size)[:, :2] = 0x20
    w = QuantTensor("w", t, (64, 64), raw)
    for n in (1, 2, 16):
        be.linear(np.ones((n, 64), np.float32), w)
q = np.ones((1, 4, 8), np.float32)
be.attention(q, q, q, 0, 1.0)
print(bench.peak_rss())
"""


def runtime_rss() -> int:
    """Peak RSS of a fresh process that only runs the kernels on tiny weights: Python, NumPy, numba, LLVM and
    the compiled code, the part of a model's RSS that does not depend on the model."""
    done = subprocess.run([sys.executable, "-c", _BASELINE_CHILD], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def compile_times(path, threads: int = 2) -> dict[str, float]:
    """Start-up with an empty numba cache (cold: every kernel compiled) and again with it filled (warm)."""
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        env = {"NUMBA_CACHE_DIR": cache}
        cold = run_child(path, "numba", threads, n_prompt=8, n_decode=1, env=env)
        warm = run_child(path, "numba", threads, n_prompt=8, n_decode=1, env=env)
    return {
        "cold_first_call_s": cold["first_call_s"],
        "warm_first_call_s": warm["first_call_s"],
        "cold_load_s": cold["load_s"],
        "warm_load_s": warm["load_s"],
    }
