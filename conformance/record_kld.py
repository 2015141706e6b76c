"""Record llama.cpp's KL-divergence statistics (`llama-perplexity --kl-divergence`) for tests/test_kld_llamacpp.py.

llama-cpp-python has no perplexity tool, so its protocol is transcribed here from `tools/perplexity/perplexity.cpp`
row by row, independently of ggufpy/kld.py: the C library's expf called element by element (ctypes), the double
sums accumulated in sequence (`np.cumsum`, as one thread of `process_logits` does), every float expression in
the float width and left-to-right order C evaluates it (llama-perplexity built for baseline x86-64: no FMA
contraction). The logits are llama.cpp's own (`conformance.llamacpp.LlamaCpp`, one ubatch per chunk as
`llama-perplexity -c N -b N` runs, all rows' logits).

The pair is synthetic (`PAIR`): one random model written twice from the same seed, F32 and SmolLM2's mix (Q4_1
blocks, Q8_0 embeddings), small enough that the golden holds the base's logits file and the quantized model's
logits. Run: `python -m conformance.record_kld` (needs the conformance extra).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from conformance import llamacpp
from conformance.fixtures import SMALL, _uniform, write_tiny_llama
from ggufpy.constants import GGMLType
from ggufpy.perplexity import default_text

F32 = np.float32
GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "kld" / "synthetic_q4_1.npz"
N_CTX, N_CHUNK = 64, 4  # 4 x 31 = 124 scored tokens: llama.cpp prints its summary from 100 on
BASE = replace(SMALL, seed=500, types=_uniform(GGMLType.F32))
PAIR = {"base": BASE, "quant": replace(BASE, types={**_uniform(GGMLType.Q4_1), "embd": GGMLType.Q8_0})}


def _expf():
    f = ctypes.CDLL(ctypes.util.find_library("m")).expf
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return lambda x: np.fromiter((f(v) for v in np.asarray(x, F32).ravel().tolist()), F32).reshape(np.shape(x))


EXPF = _expf()


def _sequential(values: np.ndarray) -> float:
    """A double sum accumulated left to right, as a C loop does."""
    return float(np.cumsum(np.asarray(values, np.float64))[-1]) if len(values) else 0.0


def encode_row(logits: np.ndarray) -> np.ndarray:
    """perplexity.cpp `log_softmax(n_vocab, logits, log_prob, tok)`: one row's (nv,) uint16 codes."""
    V = len(logits)
    max_l, min_l = logits.max(), logits.min()
    min_l = max(min_l, F32(max_l - F32(16)))
    sum_exp = _sequential(EXPF(logits - max_l))
    log_sum_exp = F32(math.log(sum_exp))
    min_log_prob = F32(F32(min_l - max_l) - log_sum_exp)
    scale = F32((max_l - min_l) / F32(65535))
    out = np.zeros(2 * ((V + 1) // 2) + 4, np.uint16)
    out[:4] = np.array([scale, min_log_prob], "<f4").view("<u2")
    if scale:
        inv = F32(F32(1) / scale)
        val = (inv * (logits - min_l)).astype(F32) + F32(12582912)  # nearest_int: the bits of val + 1.5 * 2^23
        q = (val.view(np.int32) & 0x007FFFFF) - 0x00400000
        out[4 : 4 + V] = np.where(logits > min_l, q, 0)
    return out


def kld_row(logits: np.ndarray, base: np.ndarray, tok: int) -> dict:
    """perplexity.cpp `log_softmax(n_vocab, logits, base_log_prob, tok, kld)`: one row's contributions."""
    V = len(logits)
    imax = int(np.argmax(logits))  # strict > in a loop from 0: the first maximum
    max_l = logits[imax]
    log_sum_exp = F32(math.log(_sequential(EXPF(logits - max_l))))
    scale, min_log_prob = base[:4].view("<f4")
    q = base[4 : 4 + V].astype(F32)
    nll = F32(F32(max_l + log_sum_exp) - logits[tok])
    nll_base = -F32(F32(scale * q[tok]) + min_log_prob)
    top = F32(max_l + log_sum_exp)
    p_log_base = (scale * q).astype(F32) + min_log_prob
    keep = p_log_base > F32(-16)
    terms = EXPF(p_log_base[keep]) * ((p_log_base[keep] - logits[keep]) + top)  # f32
    kld = _sequential(terms)
    p_diff = F32(EXPF(-nll) - EXPF(-nll_base))
    return {
        "nll": float(nll),
        "nll2": float(F32(nll * nll)),
        "nll_base": float(nll_base),
        "nll_base2": float(F32(nll_base * nll_base)),
        "nll_nll_base": float(F32(nll * nll_base)),
        "kld": kld,
        "p_diff": float(p_diff),
        "p_diff2": float(F32(p_diff * p_diff)),
        "same_top": imax == int(np.argmax(p_log_base)),
    }


def _mean_unc(s: float, s2: float, n: int) -> tuple[float, float]:
    f = s / n
    df = s2 / n - f * f
    return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)


def _percentile(v: np.ndarray, fraction: float) -> float:
    p = F32(F32(fraction) * F32(len(v) - 1))
    ip = int(p)
    p = F32(p - F32(ip))
    return float(F32(F32(F32(1) - p) * v[ip]) + F32(p * v[min(ip + 1, len(v) - 1)]))


def statistics(rows: list[dict]) -> dict:
    """kl_divergence's closing numbers from the rows' contributions (the sums in row order)."""
    n = len(rows)
    col = {k: np.array([r[k] for r in rows]) for k in rows[0]}
    sums = {k: _sequential(col[k]) for k in ("nll", "nll2", "nll_base", "nll_base2", "nll_nll_base", "kld", "p_diff")}
    sums["kld2"] = _sequential(col["kld"] * col["kld"])
    sums["p_diff2"] = _sequential(col["p_diff2"])
    sums["p_diff4"] = _sequential(col["p_diff2"] * col["p_diff2"])
    log_ppl = _mean_unc(sums["nll"], sums["nll2"], n)
    log_base = _mean_unc(sums["nll_base"], sums["nll_base2"], n)
    cov = (sums["nll_nll_base"] / n - (sums["nll"] / n) * (sums["nll_base"] / n)) / (n - 1)
    ppl, base = math.exp(log_ppl[0]), math.exp(log_base[0])
    ratio = log_ppl[0] - log_base[0]
    ratio_unc = math.sqrt(log_ppl[1] * log_ppl[1] + log_base[1] * log_base[1] - 2.0 * cov)
    mse = _mean_unc(sums["p_diff2"], sums["p_diff4"], n)
    rms = math.sqrt(mse[0])
    top = float(col["same_top"].sum()) / n
    out = {
        "ppl": [ppl, ppl * log_ppl[1]],
        "ppl_base": [base, base * log_base[1]],
        "cor": [cov / (log_ppl[1] * log_base[1]), 0.0],
        "ln_ppl_ratio": [ratio, ratio_unc],
        "ppl_ratio": [math.exp(ratio), math.exp(ratio) * ratio_unc],
        "ppl_diff": [
            ppl - base,
            math.sqrt((ppl * log_ppl[1]) ** 2 + (base * log_base[1]) ** 2 - 2.0 * (ppl * base * cov)),
        ],
        "kld_mean": list(_mean_unc(sums["kld"], sums["kld2"], n)),
        "p_diff_mean": list(_mean_unc(sums["p_diff"], sums["p_diff2"], n)),
        "p_diff_rms": [rms, 0.5 / rms * mse[1]],
        "same_top": [top, math.sqrt(top * (1 - top) / (n - 1))],
    }
    for name, fractions in (
        ("kld", (0.999, 0.99, 0.95, 0.9, 0.1, 0.05, 0.01, 0.001)),
        ("p_diff", (0.999, 0.99, 0.95, 0.9, 0.75, 0.25, 0.1, 0.05, 0.01, 0.001)),
    ):
        v = np.sort(col[name].astype(F32))
        out[f"{name}_max"], out[f"{name}_min"] = float(v[-1]), float(v[0])
        out[f"{name}_median"] = float(F32(F32(0.5) * F32(v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else v[n // 2])
        for f in fractions:
            out[f"{name}_{f * 100:g}%"] = _percentile(v, f)
    return out


def llamacpp_logits(path: Path, tokens: list[int], add_bos: bool, bos: int) -> list[np.ndarray]:
    """llama.cpp's logits of the scored rows (n_ctx/2 .. n_ctx-2) of each chunk."""
    first, out = N_CTX // 2, []
    with llamacpp.LlamaCpp(path) as lc:
        for i in range(N_CHUNK):
            chunk = tokens[i * N_CTX : (i + 1) * N_CTX]
            if add_bos:
                chunk = [bos, *chunk[1:]]
            logits, _ = lc.run(chunk)
            out.append(logits[first : N_CTX - 1].astype(F32))
    return out


def record(directory: Path) -> dict:
    """Write the pair under `directory`, run both in llama.cpp, apply the protocol: the golden's arrays."""
    paths = {name: write_tiny_llama(directory / f"{name}.gguf", spec) for name, spec in PAIR.items()}
    lib = llamacpp._lib()
    with llamacpp.LlamaCpp(paths["base"]) as lc:
        tokens = lc.tokenize(default_text(), add_special=True)[: N_CTX * N_CHUNK]
        add_bos = bool(lib.llama_vocab_get_add_bos(lc._vocab))
        bos = int(lib.llama_vocab_bos(lc._vocab))
    base = llamacpp_logits(paths["base"], tokens, add_bos, bos)
    quant = llamacpp_logits(paths["quant"], tokens, add_bos, bos)
    first = N_CTX // 2
    header = b"_logits_" + np.array([N_CTX], "<u4").tobytes() + np.array([base[0].shape[1], N_CHUNK], "<i4").tobytes()
    body = [np.array(tokens, "<i4").tobytes()]
    rows = []
    for i in range(N_CHUNK):
        codes = np.stack([encode_row(r) for r in base[i]])
        body.append(codes.astype("<u2").tobytes())
        targets = tokens[i * N_CTX + first + 1 : (i + 1) * N_CTX]
        rows += [kld_row(quant[i][j], codes[j], t) for j, t in enumerate(targets)]
    stats = statistics(rows)
    return {
        "tokens": np.array(tokens, np.int32),
        "base_file": np.frombuffer(header + b"".join(body), np.uint8),
        "quant_logits": np.stack(quant),  # (N_CHUNK, N_CTX - 1 - N_CTX // 2, V) f32
        "stats": np.array(json.dumps(stats)),
        "versions": np.array(json.dumps(llamacpp.versions())),
    }


def main() -> None:
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        golden = record(Path(d))
    np.savez_compressed(GOLDEN, **golden)
    s = json.loads(str(golden["stats"]))
    print(f"{GOLDEN}: {GOLDEN.stat().st_size} bytes; mean KLD {s['kld_mean'][0]:.6f}, same top {s['same_top'][0]:.4f}")


if __name__ == "__main__":
    main()
