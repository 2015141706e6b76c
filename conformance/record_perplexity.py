"""Record llama.cpp's perplexity on the packaged models, for tests/test_perplexity.py.

llama.cpp's logits come from `conformance.llamacpp.LlamaCpp` (the conformance settings: one ubatch per
chunk, as `llama-perplexity -c N -b N` runs it); the protocol (chunks, BOS substitution, scoring the second
half) is llama-perplexity's and is applied here to llama.cpp's tokens and logits independently of ggufpy's
tokenizer and chunker. Run: `python -m conformance.record_perplexity` (needs the conformance extra).
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from pathlib import Path

import numpy as np

from conformance import llamacpp
from ggufpy.packaged import PACKAGED_MODELS
from ggufpy.perplexity import default_text

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "perplexity"
CASES = {"smollm2": (64, 3), "gemma3": (64, 2), "smollm2-q4_k_m": (64, 3)}  # -> (n_ctx, n_chunks): small and quick
REQUANTIZED = {"smollm2-q4_k_m": ("smollm2", "Q4_K_M")}  # SmolLM2 requantized by llama.cpp's own quantizer


def model_path(name: str, workdir: Path) -> Path:
    """The packaged model, or its requantization by `llama_model_quantize` (llama-quantize --allow-requantize)."""
    if name not in REQUANTIZED:
        return Path(PACKAGED_MODELS[name]())
    from tests.quantize_oracle import llama_quantize

    base, mix = REQUANTIZED[name]
    return llama_quantize(Path(PACKAGED_MODELS[base]()), workdir / f"{name}.gguf", mix)


def _libm_expf():
    import ctypes
    import ctypes.util

    f = ctypes.CDLL(ctypes.util.find_library("m")).expf
    f.argtypes, f.restype = [ctypes.c_float], ctypes.c_float
    return f


def llamacpp_nll(logits: np.ndarray, targets: list[int]) -> list[float]:
    """llama-perplexity's `log_softmax` (tools/perplexity/perplexity.cpp), in its C widths and order: max in f32,
    the C library's `expf` of each shifted logit summed left to right in double, `logits[tok] - max` rounded to f32
    before the double `log(sum_exp)` is subtracted. Written out here (not ggufpy's code) so the golden stays an
    independent transcription; the per-element ctypes calls take ~10 s on Gemma 3's vocabulary."""
    expf = _libm_expf()
    out = []
    for row, tok in zip(logits, targets, strict=True):
        row = np.asarray(row, np.float32)
        m = row.max()
        shifted = (row - m).tolist()  # f32 differences, exact as Python floats
        sum_exp = float(np.cumsum(np.array([expf(x) for x in shifted], np.float64))[-1])  # sequential double sum
        out.append(-(float(np.float32(row[tok] - m)) - math.log(sum_exp)))
    return out


def record(name: str, n_ctx: int, n_chunks: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(name, Path(tmp))
        result = _record(path, n_ctx, n_chunks)
        result["model"] = name
        if name in REQUANTIZED:  # ggufpy's quantizer must write these bytes for the golden to apply
            result["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        return result


def _record(path: Path, n_ctx: int, n_chunks: int) -> dict:
    with llamacpp.LlamaCpp(path) as lc:
        lib = llamacpp._lib()
        tokens = lc.tokenize(default_text(), add_special=True)
        add_bos = bool(lib.llama_vocab_get_add_bos(lc._vocab))
        bos = int(lib.llama_vocab_bos(lc._vocab))
        first = n_ctx // 2
        nlls = []
        for i in range(n_chunks):
            chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
            if add_bos:
                chunk = [bos, *chunk[1:]]
            logits, _ = lc.run(chunk)
            nlls.append(llamacpp_nll(logits[first : n_ctx - 1], tokens[i * n_ctx + first + 1 : (i + 1) * n_ctx]))
    flat = [x for chunk in nlls for x in chunk]
    return {
        "n_ctx": n_ctx,
        "n_chunks": n_chunks,
        "add_bos": add_bos,
        "tokens": tokens[: n_chunks * n_ctx],
        "nll": nlls,
        "ppl": math.exp(sum(flat) / len(flat)),
        "llama_cpp": llamacpp.versions(),
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (n_ctx, n_chunks) in CASES.items():
        result = record(name, n_ctx, n_chunks)
        (OUT / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"{name}: PPL {result['ppl']:.6f} over {n_chunks} chunks of {n_ctx}")


if __name__ == "__main__":
    main()
