"""`python -m conformance.record`: run llama.cpp on every fixture and real model and store the goldens.

For each model: the logits at every position of a fixed token sequence (full rows for the fixtures' 269-token
vocabulary; the top 256 with the log-sum-exp for SmolLM2's 49152 and Gemma 3's 262144), llama.cpp's `l_out-N`
and `result_norm`, and a greedy continuation; each tied in `conformance/goldens/manifest.json` to the model's
sha256, the llama.cpp build and the settings (`conformance.llamacpp.SETTINGS`).
Needs `pip install 'ggufpy[conformance]'`.

    python -m conformance.record                  # every fixture, SmolLM2, Gemma 3 and the per-op golden
    python -m conformance.record q4_0 smollm2     # some of them ("ops": the per-op golden)
    python -m conformance.record --build-fixtures # (re)write conformance/fixtures/*.gguf first
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from .compare import GOLDEN_DIR, Reference
from .fixtures import FIXTURE_DIR, FIXTURES, build_fixtures, fixture_path, load_manifest, sha256, weight_types

FIXTURE_TOKENS = 128  # tokens per fixture prompt (thresholds are measured on >= 100)
FIXTURE_CONTINUATION = 16
REAL_CONTINUATION = 32
REAL_TOP_K = 256

# The real models: name -> (path lookup, prompt). The prompt is tokenized by llama.cpp (>= 100 tokens).
# Their logits are stored as the top REAL_TOP_K per position plus the log-sum-exp (49152 and 262144 tokens).
PROMPT = (  # the English prompt of the real models and of `conformance.check`
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz, combined several existing technologies into a single machine. Movable type made of metal, an "
    "oil-based ink that clung to the letters, and a screw press adapted from the ones used to make wine allowed "
    "a small workshop to produce hundreds of identical pages in a day. Within fifty years, presses were running "
    "in more than two hundred European cities, and the price of books fell so quickly that"
)


def _packaged(name: str) -> Path:
    from ggufpy.packaged import PACKAGED_MODELS

    return PACKAGED_MODELS[name]()


REAL_MODELS = {name: (functools.partial(_packaged, name), PROMPT) for name in ("smollm2", "gemma3")}
OPS = "ops"  # the per-op golden: ggml's own activation blocks and vec_dot results, and one attention


def record_ops(directory: Path = GOLDEN_DIR) -> dict:
    """ggml's CPU matmul per weight type on random data (from_float blocks and vec_dot results), and llama.cpp's
    attention inputs and output for one fixture layer: op-level goldens, free of the rounding-decision flips
    that accumulate along a layer."""
    from ggufpy.quants import QUANT_TYPES, quantize
    from ggufpy.quants.vecdot import VEC_DOT_TYPE

    from .llamacpp import LlamaCpp, ggml_cpu_matmul, ggml_quantize

    rng = np.random.default_rng(7)
    arrays: dict[str, np.ndarray] = {}
    for t in VEC_DOT_TYPE:
        n, rows, cols = 512, 16, 4
        w = (rng.standard_normal((rows, n)) * 0.05).astype(np.float32)
        x = rng.standard_normal((cols, n)).astype(np.float32)
        x[:, rng.integers(0, n, 3)] *= 20  # outlier channels, as real activations have
        raw = quantize(w, t) if QUANT_TYPES[t].quantize_blocks is not None else ggml_quantize(w, t)
        y, acts, _ = ggml_cpu_matmul(raw, t, x)
        arrays.update({f"{t.name}:w": raw, f"{t.name}:x": x, f"{t.name}:acts": acts, f"{t.name}:y": y})
    names = ["Qcur-0", "Kcur-0", "Vcur-0", "kqv_out-0"]
    with LlamaCpp(fixture_path("q4_0")) as lc:
        _, tensors = lc.run(fixture_tokens(), capture=names)
    arrays.update({f"attention:{k}": v for k, v in tensors.items()})
    np.savez_compressed(directory / f"{OPS}.npz", **arrays)
    return {
        "file": f"{OPS}.npz",
        "model": f"fixtures/{fixture_path('q4_0').name}",
        "sha256": sha256(fixture_path("q4_0")),
    }


def fixture_tokens(n: int = FIXTURE_TOKENS) -> np.ndarray:
    """The fixed prompt of every fixture: ids drawn from the byte and merge tokens (not the 3 specials)."""
    return np.random.default_rng(4).integers(3, 269, n).astype(np.int32)


def file_types(path: Path) -> list[str]:
    """The GGML types of a file's 2-D weights, most used first (norms excluded)."""
    from ggufpy.reader import open as open_gguf

    with open_gguf(path) as f:
        counts = Counter(info.type.name for info in f.tensors.values() if len(info.shape) == 2)
    return [t for t, _ in counts.most_common()]


def record(names: list[str], directory: Path = GOLDEN_DIR) -> None:
    from .llamacpp import SETTINGS, LlamaCpp, versions

    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    fixtures = load_manifest()
    build = versions()
    for name in names:
        if name == OPS:
            manifest[OPS] = {**record_ops(directory), "llama_cpp": build, "settings": SETTINGS.as_dict()}
            print(f"{OPS}: {(directory / f'{OPS}.npz').stat().st_size / 1e3:.0f} kB", file=sys.stderr)
            continue
        if name in REAL_MODELS:
            lookup, prompt = REAL_MODELS[name]
            path = lookup()
            with LlamaCpp(path) as lc:
                tokens = lc.tokenize(prompt)
            ref = Reference.from_llamacpp(path, tokens, REAL_CONTINUATION, top_k=REAL_TOP_K, name=name)
            entry = {"model": f"packaged:{name}", "prompt": prompt, "top_k": REAL_TOP_K, "types": file_types(path)}
        else:
            path = fixture_path(name)
            expected = fixtures.get(name, {}).get("sha256")
            if expected != sha256(path):
                raise SystemExit(f"{path}: sha256 differs from {FIXTURE_DIR / 'manifest.json'}: rebuild the fixtures")
            ref = Reference.from_llamacpp(path, fixture_tokens(), FIXTURE_CONTINUATION, name=name)
            entry = {"model": f"fixtures/{path.name}", "types": weight_types(FIXTURES[name])}
        ref.save(directory / f"{name}.npz")
        manifest[name] = {
            "file": f"{name}.npz",
            **entry,
            "sha256": sha256(path),
            "n_tokens": len(ref.tokens),
            "llama_cpp": build,
            "settings": SETTINGS.as_dict(),
        }
        size = (directory / f"{name}.npz").stat().st_size
        print(f"{name}: {len(ref.tokens)} tokens, {len(ref.tensors)} tensors, {size / 1e3:.0f} kB", file=sys.stderr)
    manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.record", description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", help=f"fixtures, real models {list(REAL_MODELS)} and {OPS!r} (default: all)"
    )
    parser.add_argument("--build-fixtures", action="store_true", help="(re)write the fixture files first")
    args = parser.parse_args(argv)
    names = args.names or [*FIXTURES, *REAL_MODELS, OPS]
    unknown = [n for n in names if n not in FIXTURES and n not in REAL_MODELS and n != OPS]
    if unknown:
        parser.error(f"unknown names {unknown}; fixtures: {', '.join(FIXTURES)}; real models: {', '.join(REAL_MODELS)}")
    if args.build_fixtures or any(n in FIXTURES and not fixture_path(n).exists() for n in names):
        build_fixtures([n for n in names if n in FIXTURES])
    record(names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
