"""Perplexity by llama.cpp's protocol (`tools/perplexity/perplexity.cpp`), and the logits files its KL-divergence
reads (the statistics: `ggufpy.kld`).

The text is tokenized once (with BOS when the vocabulary adds one) and cut into `n_chunk = len // n_ctx`
chunks of `n_ctx` tokens. Each chunk runs on a fresh cache with its first token replaced by BOS (when the
vocabulary adds one), and only its second half is scored, so every scored token sees at least n_ctx/2 tokens
of context: the logits at position j (first <= j < n_ctx - 1, first = n_ctx // 2) predict token j + 1.

    nll_j = log(sum_i expf(l_i - max l)) - (l[token_{j+1}] - max l)   (C's expf per f32, summed in double)
    PPL   = exp(mean nll),   PPL error = PPL * sqrt((mean nll^2 - mean nll^2) / (count - 1))

in C's float widths and order (`expf` is the C library's, not NumPy's float32 exp), so that llama.cpp's logits
give llama.cpp's numbers up to the order of the double sums.

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

from .numerics import _libm, _libm_f32

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


MIDPOINT_MARGIN = 0.497  # |exp - rounded| beyond this many ulps: within 0.003 ulp of a midpoint, ask the C library


def expf(x: np.ndarray) -> np.ndarray:
    """The C library's expf of each f32 in `x`, what llama-perplexity's scalar loops call (NumPy's own float32 exp
    differs from glibc's in the last bit for ~40 % of arguments). The float64 exponential rounded to f32 is glibc's
    result except near a rounding midpoint (glibc's expf errs by at most 0.502 ulp): those few arguments, ~1 %,
    are passed to the C library itself."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        e = np.exp(x.astype(np.float64))
        y = e.astype(np.float32)
        ulp = y.astype(np.float64) - np.nextafter(y, np.float32(0)).astype(np.float64)  # the smaller side's ulp
        near = ~(np.abs(e - y) < MIDPOINT_MARGIN * ulp)  # also flags zeros and subnormals; inf - inf is nan
    if near.any() and _libm() is not None:
        y[near] = _libm_f32("expf", x[near])
    return y


def log_sum_exp_parts(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max l f32, log(sum_exp) f64) per row of (R, V) logits, as llama-perplexity's `log_softmax` overloads compute
    them: sum_exp = the double sum of expf(l - max l), then C's double `log` (the KLD pass rounds it to f32)."""
    logits = np.asarray(logits, dtype=np.float32)
    max_l = logits.max(axis=1)  # (R,)
    sum_exp = expf(logits - max_l[:, None]).sum(axis=1, dtype=np.float64)  # (R,) f64, pairwise not sequential
    return max_l, np.array([math.log(s) for s in sum_exp.tolist()], np.float64)  # C's double log


def row_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood (R,) f64 of `targets` under each row of (R, V) logits, as llama-perplexity's
    `perplexity()` computes it: -(double)(l[tok] - max l) + log(sum_exp), the difference rounded to f32 first."""
    logits = np.asarray(logits, dtype=np.float32)
    max_l, log_sum = log_sum_exp_parts(logits)
    picked = logits[np.arange(len(targets)), targets]  # (R,) f32
    return log_sum - (picked - max_l).astype(np.float64)


def _nearest_int(x: np.ndarray) -> np.ndarray:
    # llama.cpp's nearest_int: round half to even through the 1.5 * 2^23 trick (valid below 2^22)
    return np.rint(x.astype(np.float32)).astype(np.int64)


def encode_log_probs(logits: np.ndarray, targets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows of (R, V) logits as llama.cpp stores them in a logits file: ((R, nv) uint16, nll (R,) f64 or None).

    With `targets`, also the rows' NLL as that `log_softmax` returns it (`max + log_sum_exp - l[tok]`, in f32)."""
    R, V = logits.shape
    nv = 2 * ((V + 1) // 2) + 4
    logits = np.asarray(logits, dtype=np.float32)
    max_l, log_sum = log_sum_exp_parts(logits)
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
    if targets is None:
        return out, None
    return out, (max_l + log_sum32 - logits[np.arange(R), targets]).astype(np.float64)


def decode_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """(R, nv) uint16 rows of a logits file back to log-probabilities (R, V) f32: `scale * q + min_log_prob`,
    a product and a sum each rounded to f32 (llama-perplexity is compiled without FMA contraction)."""
    head = np.ascontiguousarray(rows[:, :4]).view("<f4")  # (R, 2): scale, min_log_prob
    q = rows[:, 4 : 4 + n_vocab].astype(np.float32)
    return (head[:, :1] * q).astype(np.float32) + head[:, 1:2]


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
        if save_logits is None:
            ppl.add(row_nll(logits, chunks.targets(i)))
        else:  # this pass's NLL is the f32 one of the log_softmax that encodes the rows
            rows, nll = encode_log_probs(logits, chunks.targets(i))
            ppl.add(nll)
            save_logits.write(rows.astype("<u2").tobytes())
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
