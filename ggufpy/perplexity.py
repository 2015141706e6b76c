"""Perplexity and KL-divergence, by llama.cpp's protocol (`tools/perplexity/perplexity.cpp`).

The text is tokenized once (with BOS when the vocabulary adds one) and cut into `n_chunk = len // n_ctx`
chunks of `n_ctx` tokens. Each chunk runs on a fresh cache with its first token replaced by BOS (when the
vocabulary adds one), and only its second half is scored, so every scored token sees at least n_ctx/2 tokens
of context: the logits at position j (first <= j < n_ctx - 1, first = n_ctx // 2) predict token j + 1.

    nll_j = log(sum_i exp(l_i - max l)) + max l - l[token_{j+1}]        (f32 exps summed in f64)
    PPL   = exp(mean nll),   PPL error = PPL * sqrt((mean nll^2 - mean nll^2) / (count - 1))

A saved-logits file has llama.cpp's `--kl-divergence-base` layout, so a base saved by one engine can be
compared by the other:

    "_logits_"  u32 n_ctx  i32 n_vocab  i32 n_chunk  i32 tokens[n_chunk * n_ctx]
    per chunk, per scored row (n_ctx - 1 - first rows), nv = 2 * ((n_vocab + 1) // 2) + 4 u16 values:
      f32 scale, f32 min_log_prob (the first 4 u16), then u16 q[i] = round((l_i - min_l) / scale)
    where min_l = max(min l, max l - 16) and log p_i ~= scale * q[i] + min_log_prob.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

LOGITS_MAGIC = b"_logits_"


def default_text() -> str:
    """The English text shipped with ggufpy (self-written, ~13 KB), so the commands work offline."""
    return resources.files("ggufpy.data").joinpath("eval.txt").read_text(encoding="utf-8")


@dataclass
class Chunks:
    """The evaluation tokens cut into chunks of n_ctx, as llama.cpp cuts them."""

    tokens: np.ndarray  # (n_chunk * n_ctx,) int32: the tokens scored, BOS not yet substituted
    n_ctx: int
    bos_id: int | None  # substituted for each chunk's first token when the vocabulary adds BOS

    @property
    def n_chunk(self) -> int:
        return len(self.tokens) // self.n_ctx

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    def chunk(self, i: int) -> np.ndarray:
        """Chunk i as the model sees it: (n_ctx,) token ids, BOS first when the vocabulary adds one."""
        ids = self.tokens[i * self.n_ctx : (i + 1) * self.n_ctx].copy()
        if self.bos_id is not None:
            ids[0] = self.bos_id
        return ids

    def targets(self, i: int) -> np.ndarray:
        """The tokens the scored rows of chunk i predict: (n_ctx - 1 - first,)."""
        start = i * self.n_ctx
        return self.tokens[start + self.first + 1 : start + self.n_ctx]


def make_chunks(tokenizer, text: str, n_ctx: int, n_chunks: int | None = None) -> Chunks:
    """Tokenize `text` and cut it; at least 2 * n_ctx tokens are needed (llama.cpp's rule)."""
    if n_ctx < 4 or n_ctx % 2:
        raise ValueError(f"context {n_ctx} must be an even number >= 4 (the second half of each chunk is scored)")
    ids = np.asarray(tokenizer.encode(text, add_special=True), dtype=np.int32)
    if len(ids) < 2 * n_ctx:
        raise ValueError(
            f"the text tokenizes to {len(ids)} tokens: at least {2 * n_ctx} (2 x context {n_ctx}) are needed"
        )
    n = len(ids) // n_ctx if n_chunks is None else min(n_chunks, len(ids) // n_ctx)
    if n < 1:
        raise ValueError(f"chunks must be >= 1, got {n_chunks}")
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    return Chunks(ids[: n * n_ctx], n_ctx, bos)


def log_softmax_parts(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max l, log sum exp(l - max l)) per row of (R, V) f32 logits, as llama.cpp's `log_softmax`."""
    logits = np.asarray(logits, dtype=np.float32)
    max_l = logits.max(axis=1)  # (R,)
    sum_exp = np.exp(logits - max_l[:, None]).sum(axis=1, dtype=np.float64)  # f32 exps, f64 sum
    return max_l, np.log(sum_exp)


def row_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood (R,) f64 of `targets` under each row of `logits` (R, V)."""
    max_l, log_sum = log_softmax_parts(logits)
    picked = logits[np.arange(len(targets)), targets].astype(np.float64)
    return max_l.astype(np.float64) + log_sum - picked


def _nearest_int(x: np.ndarray) -> np.ndarray:
    # llama.cpp's nearest_int: round half to even through the 1.5 * 2^23 trick (valid below 2^22)
    return np.rint(x.astype(np.float32)).astype(np.int64)


def encode_log_probs(logits: np.ndarray) -> np.ndarray:
    """Rows of (R, V) logits as llama.cpp stores them in a logits file: (R, nv) uint16."""
    R, V = logits.shape
    nv = 2 * ((V + 1) // 2) + 4
    logits = np.asarray(logits, dtype=np.float32)
    max_l, log_sum = log_softmax_parts(logits)
    min_l = np.maximum(logits.min(axis=1), max_l - np.float32(16))  # (R,) f32
    log_sum32 = log_sum.astype(np.float32)  # `const float log_sum_exp = log(sum_exp)`
    min_log_prob = (min_l - max_l - log_sum32).astype(np.float32)
    scale = ((max_l - min_l) / np.float32(65535)).astype(np.float32)
    out = np.zeros((R, nv), dtype=np.uint16)
    head = np.stack([scale, min_log_prob], axis=1).astype("<f4")  # (R, 2) f32 = 4 u16
    out[:, :4] = head.view("<u2").reshape(R, 4)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        q = _nearest_int(inv[:, None] * (logits - min_l[:, None]))
    q = np.where(logits > min_l[:, None], q, 0)
    out[:, 4 : 4 + V] = np.clip(q, 0, 65535).astype(np.uint16)
    return out


def decode_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """(R, nv) uint16 rows of a logits file back to approximate log-probabilities (R, V) f32."""
    head = np.ascontiguousarray(rows[:, :4]).view("<f4")  # (R, 2): scale, min_log_prob
    q = rows[:, 4 : 4 + n_vocab].astype(np.float32)
    return head[:, :1] * q + head[:, 1:2]


@dataclass
class Perplexity:
    """Running sums over the scored tokens, and the value after each chunk (llama.cpp prints them)."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0
    per_chunk: list[float] = field(default_factory=list)

    def add(self, nlls: np.ndarray) -> None:
        self.nll += float(nlls.sum())
        self.nll2 += float((nlls * nlls).sum())
        self.count += len(nlls)
        self.per_chunk.append(self.value)

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def error(self) -> float:
        """PPL uncertainty as llama.cpp's "Final estimate: PPL = x +/- y"."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return math.sqrt(var / (self.count - 1)) * self.value if var > 0 and self.count > 1 else 0.0


def chunk_logits(model, chunks: Chunks, i: int) -> np.ndarray:
    """Logits (n_ctx - 1 - first, V) of the scored rows of chunk i, from one forward pass on a fresh cache."""
    cache = model.new_cache(capacity=chunks.n_ctx)
    logits = model.forward(chunks.chunk(i), 0, cache)  # (n_ctx, V): one batch, as llama-perplexity with -b >= -c
    return logits[chunks.first : chunks.n_ctx - 1]


def perplexity(
    model,
    chunks: Chunks,
    save_logits: io.BufferedIOBase | None = None,
    on_chunk: Callable[[int, Perplexity], None] | None = None,
) -> Perplexity:
    """Perplexity of `model` over `chunks`; with `save_logits`, write llama.cpp's logits file as it goes."""
    if save_logits is not None:
        write_logits_header(save_logits, chunks, model.config.vocab_size)
    ppl = Perplexity()
    for i in range(chunks.n_chunk):
        logits = chunk_logits(model, chunks, i)
        ppl.add(row_nll(logits, chunks.targets(i)))
        if save_logits is not None:
            save_logits.write(encode_log_probs(logits).astype("<u2").tobytes())
        if on_chunk is not None:
            on_chunk(i, ppl)
    return ppl


# -- logits files ---------------------------------------------------------------------------------------------


def write_logits_header(out: io.BufferedIOBase, chunks: Chunks, n_vocab: int) -> None:
    out.write(LOGITS_MAGIC)
    out.write(np.array([chunks.n_ctx], "<u4").tobytes())
    out.write(np.array([n_vocab, chunks.n_chunk], "<i4").tobytes())
    out.write(chunks.tokens.astype("<i4").tobytes())


@dataclass
class LogitsFile:
    """A base model's saved log-probabilities (llama.cpp's `--kl-divergence-base` file), memory-mapped."""

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # (n_chunk * n_ctx,) int32
    rows: np.ndarray  # (n_chunk, n_ctx - 1 - n_ctx // 2, nv) uint16

    @classmethod
    def open(cls, path: str | Path) -> LogitsFile:
        path = Path(path)
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        if raw[:8].tobytes() != LOGITS_MAGIC:
            raise ValueError(f"{path}: not a logits file (no '_logits_' magic at the start)")
        if len(raw) < 20:
            raise ValueError(f"{path}: truncated header ({len(raw)} bytes)")
        n_ctx = int(raw[8:12].view("<u4")[0])
        n_vocab, n_chunk = (int(x) for x in raw[12:20].view("<i4"))
        if not (4 <= n_ctx <= 1 << 24 and 1 <= n_vocab <= 1 << 24 and 1 <= n_chunk <= 1 << 20):
            raise ValueError(f"{path}: header n_ctx={n_ctx} n_vocab={n_vocab} n_chunk={n_chunk} out of range")
        nv = 2 * ((n_vocab + 1) // 2) + 4
        n_rows = n_ctx - 1 - n_ctx // 2
        tokens_end = 20 + 4 * n_chunk * n_ctx
        expected = tokens_end + 2 * n_chunk * n_rows * nv
        if len(raw) != expected:
            raise ValueError(f"{path}: {len(raw)} bytes, expected {expected} for n_ctx={n_ctx}, n_chunk={n_chunk}")
        tokens = raw[20:tokens_end].view("<i4")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= n_vocab):
            raise ValueError(f"{path}: token ids outside the vocabulary of {n_vocab}")
        rows = raw[tokens_end:].view("<u2").reshape(n_chunk, n_rows, nv)
        return cls(path, n_ctx, n_vocab, n_chunk, tokens, rows)

    def chunks(self, bos_id: int | None) -> Chunks:
        return Chunks(np.asarray(self.tokens, dtype=np.int32), self.n_ctx, bos_id)


# -- KL-divergence --------------------------------------------------------------------------------------------


@dataclass
class KLDivergence:
    """llama.cpp's `kl_divergence_result`: running sums plus every token's KLD and Δp for the percentiles."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list[np.ndarray] = field(default_factory=list)
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: np.ndarray, base_rows: np.ndarray, targets: np.ndarray) -> None:
        """Score rows of (R, V) logits against the base's (R, nv) stored log-probs of the same tokens."""
        R, V = logits.shape
        logits = np.asarray(logits, dtype=np.float32)
        max_l, log_sum = log_softmax_parts(logits)
        log_sum32 = log_sum.astype(np.float32)
        idx = np.arange(R)
        nll = (max_l + log_sum32 - logits[idx, targets]).astype(np.float32)
        base_log_p = decode_log_probs(base_rows, V)  # (R, V) f32
        nll_base = (-base_log_p[idx, targets]).astype(np.float32)
        # KL(base || model) over the base's probable tokens (p_base > e^-16), as llama.cpp sums it
        log_p = logits - (max_l + log_sum32)[:, None]  # (R, V) f32 log-probs of the model
        mask = base_log_p > np.float32(-16)
        p_base = np.where(mask, np.exp(np.where(mask, base_log_p, 0)), 0).astype(np.float32)
        kld = (p_base * (base_log_p - log_p)).astype(np.float64).sum(axis=1)  # (R,)
        p_diff = (np.exp(-nll) - np.exp(-nll_base)).astype(np.float32)
        n64, b64, d64 = nll.astype(np.float64), nll_base.astype(np.float64), p_diff.astype(np.float64)
        self.sum_nll += n64.sum()
        self.sum_nll2 += (n64 * n64).sum()
        self.sum_nll_base += b64.sum()
        self.sum_nll_base2 += (b64 * b64).sum()
        self.sum_nll_nll_base += (n64 * b64).sum()
        self.sum_kld += kld.sum()
        self.sum_kld2 += (kld * kld).sum()
        self.sum_p_diff += d64.sum()
        self.sum_p_diff2 += (d64 * d64).sum()
        self.sum_p_diff4 += (d64**4).sum()
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max()))
        # first maximum of each, as llama.cpp's loops pick it
        self.n_same_top += int((logits.argmax(axis=1) == base_log_p.argmax(axis=1)).sum())
        self.count += R
        self.kld_values.append(kld.astype(np.float32))
        self.p_diff_values.append(p_diff)

    def statistics(self) -> dict[str, tuple[float, float] | float]:
        """The numbers llama.cpp prints after the chunks (values; uncertainties where it gives one)."""
        log_ppl = _mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)
        log_base = _mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)
        cov = _covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, self.count)
        ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_base[0])
        ratio = log_ppl[0] - log_base[0]
        ratio_unc = math.sqrt(max(log_ppl[1] ** 2 + log_base[1] ** 2 - 2 * cov, 0.0))
        kld = np.sort(np.concatenate(self.kld_values))
        p_diff = np.sort(np.concatenate(self.p_diff_values))
        mse = _mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = math.sqrt(mse[0])
        top = self.n_same_top / self.count
        stats: dict[str, tuple[float, float] | float] = {
            "ppl": (ppl, ppl * log_ppl[1]),
            "ppl_base": (ppl_base, ppl_base * log_base[1]),
            "ln_ppl_ratio": (ratio, ratio_unc),
            "kld_mean": _mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count),
            "kld_max": float(kld[-1]),
            "kld_median": _median(kld),
            "p_diff_mean": _mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, self.count),
            "p_diff_rms": (rms, 0.5 / rms * mse[1] if rms > 0 else 0.0),
            "same_top": (top, math.sqrt(top * (1 - top) / (self.count - 1)) if self.count > 1 else 0.0),
        }
        for f in (0.999, 0.99, 0.95, 0.9, 0.1, 0.05, 0.01, 0.001):
            stats[f"kld_{f * 100:g}%"] = _percentile(kld, f)
        for f in (0.999, 0.99, 0.95, 0.9, 0.75, 0.25, 0.1, 0.05, 0.01, 0.001):
            stats[f"p_diff_{f * 100:g}%"] = _percentile(p_diff, f)
        stats["kld_min"] = float(kld[0])
        stats["p_diff_median"] = _median(p_diff)
        return stats


def kl_divergence(model, base: LogitsFile, on_chunk: Callable[[int, KLDivergence], None] | None = None) -> KLDivergence:
    """Compare `model` with a base model's saved log-probabilities on the base's own tokens and chunks."""
    if base.n_vocab != model.config.vocab_size:
        raise ValueError(f"{base.path}: vocabulary {base.n_vocab} differs from the model's {model.config.vocab_size}")
    tok = model.tokenizer
    chunks = base.chunks(tok.bos_id if tok is not None and tok.add_bos else None)
    kld = KLDivergence()
    for i in range(chunks.n_chunk):
        kld.add(chunk_logits(model, chunks, i), np.asarray(base.rows[i]), chunks.targets(i))
        if on_chunk is not None:
            on_chunk(i, kld)
    return kld


def _mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def _covariance(a: float, b: float, ab: float, count: int) -> float:
    return 0.0 if count < 10 else (ab / count - (a / count) * (b / count)) / (count - 1)


def _median(values: np.ndarray) -> float:
    n = len(values)
    return float(0.5 * (values[n // 2] + values[n // 2 - 1]) if n % 2 == 0 else values[n // 2])


def _percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's linear-interpolation percentile over sorted values (f32 arithmetic)."""
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = np.float32(fraction) * np.float32(len(values) - 1)
    ip = int(p)
    p = p - np.float32(ip)
    return float((np.float32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])
