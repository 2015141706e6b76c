"""KL-divergence of a model against a base model's saved log-probabilities, as `llama-perplexity --kl-divergence`.

llama.cpp `tools/perplexity/perplexity.cpp`: `kl_divergence` runs the model on the base file's own tokens and
chunks (`perplexity.LogitsFile`), and for each scored row its `log_softmax(..., base_log_prob, tok, kld)`
accumulates, in the same float widths:

    nll      = max l + log_sum_exp - l[tok]                       f32
    nll_base = -(scale * q[tok] + min_log_prob)                   f32, the base's 16-bit code of tok
    kld      = sum over i with log p_base_i > -16 of  p_base_i * (log p_base_i - l_i + (max l + log_sum_exp))
               (each term an f32 product, summed in double)
    p_diff   = expf(-nll) - expf(-nll_base)                       f32
    same top = first argmax of l == first argmax of the base's log-probs

and the sums of nll, nll^2, nll_base, nll_base^2, nll * nll_base, p_diff^2 (f32 products) in double; kld and
p_diff per token are kept (as f32) for the percentiles. `KLDivergence.statistics()` gives every number the tool
prints at the end; llama.cpp prints them only for 100 scored tokens or more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .perplexity import LogitsFile, chunk_logits, decode_log_probs, expf, log_sum_exp_parts

__all__ = ["MIN_COUNT", "KLDivergence", "kl_divergence"]

F32 = np.float32
MIN_COUNT = 100  # "we do not wish to do statistics on so few values": llama.cpp prints no summary below this
KLD_PERCENTILES = (0.999, 0.99, 0.95, 0.9, 0.1, 0.05, 0.01, 0.001)
P_DIFF_PERCENTILES = (0.999, 0.99, 0.95, 0.9, 0.75, 0.25, 0.1, 0.05, 0.01, 0.001)


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
    kld_values: list[np.ndarray] = field(default_factory=list)  # f32 per scored token
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: np.ndarray, base_rows: np.ndarray, targets: np.ndarray) -> None:
        """Score rows of (R, V) logits against the base's (R, nv) stored log-probs of the same tokens."""
        R, V = logits.shape
        logits = np.asarray(logits, dtype=F32)
        idx = np.arange(R)
        max_l, log_sum = log_sum_exp_parts(logits)
        log_sum32 = log_sum.astype(F32)
        nll = max_l + log_sum32 - logits[idx, targets]  # (R,) f32, left to right as C
        base_log_p = decode_log_probs(base_rows, V)  # (R, V) f32
        nll_base = -base_log_p[idx, targets]
        top = max_l + log_sum32  # C reuses max_logit for max + log_sum_exp
        keep = base_log_p > F32(-16)
        p_base = np.where(keep, expf(np.where(keep, base_log_p, 0)), 0)  # (R, V) f32; 0 outside the sum
        terms = p_base * ((base_log_p - logits) + top[:, None])  # f32 products, f32 differences in C's order
        kld = terms.astype(np.float64).sum(axis=1)  # (R,) double
        p_diff = expf(-nll) - expf(-nll_base)  # (R,) f32
        n64, b64, d64 = (v.astype(np.float64) for v in (nll, nll_base, p_diff))
        d2 = (p_diff * p_diff).astype(np.float64)  # `const double p_diff2 = p_diff*p_diff`: an f32 product
        self.sum_nll += n64.sum()
        self.sum_nll2 += (nll * nll).astype(np.float64).sum()
        self.sum_nll_base += b64.sum()
        self.sum_nll_base2 += (nll_base * nll_base).astype(np.float64).sum()
        self.sum_nll_nll_base += (nll * nll_base).astype(np.float64).sum()
        self.sum_kld += kld.sum()
        self.sum_kld2 += (kld * kld).sum()
        self.sum_p_diff += d64.sum()
        self.sum_p_diff2 += d2.sum()
        self.sum_p_diff4 += (d2 * d2).sum()
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max()))
        # the first maximum of each, as llama.cpp's loops pick it (np.argmax too)
        self.n_same_top += int((logits.argmax(axis=1) == base_log_p.argmax(axis=1)).sum())
        self.count += R
        self.kld_values.append(kld.astype(F32))
        self.p_diff_values.append(p_diff.astype(F32))

    def chunk_line(self) -> dict[str, tuple[float, float]]:
        """The running values llama.cpp prints after each chunk: PPL, ln(PPL(Q)/PPL(base)), KLD, RMS Δp, same top."""
        s = self._moments()
        return {k: s[k] for k in ("ppl", "ln_ppl_ratio", "kld_mean", "p_diff_rms", "same_top")}

    def _moments(self) -> dict[str, tuple[float, float]]:
        log_ppl = _mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)
        log_base = _mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)
        cov = _covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, self.count)
        ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_base[0])
        ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
        ratio = log_ppl[0] - log_base[0]
        ratio_unc = _sqrt(log_ppl[1] ** 2 + log_base[1] ** 2 - 2.0 * cov)
        mse = _mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = math.sqrt(mse[0])
        top = self.n_same_top / self.count
        denominator = log_ppl[1] * log_base[1]
        return {
            "ppl": (ppl, ppl_unc),
            "ppl_base": (ppl_base, base_unc),
            "cor": (cov / denominator if denominator else math.nan, 0.0),
            "ln_ppl_ratio": (ratio, ratio_unc),
            "ppl_ratio": (math.exp(ratio), math.exp(ratio) * ratio_unc),
            "ppl_diff": (ppl - ppl_base, _sqrt(ppl_unc**2 + base_unc**2 - 2.0 * (ppl * ppl_base * cov))),
            "kld_mean": _mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count),
            "p_diff_mean": _mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, self.count),
            "p_diff_rms": (rms, 0.5 / rms * mse[1] if rms > 0 else math.nan),
            "same_top": (top, _sqrt(top * (1 - top) / (self.count - 1)) if self.count > 1 else 0.0),
        }

    def statistics(self) -> dict[str, tuple[float, float] | float]:
        """Every number llama.cpp prints after the chunks: (value, uncertainty) where it gives one, else the value.
        Keys: ppl, ppl_base, cor, ln_ppl_ratio, ppl_ratio, ppl_diff, kld_mean, kld_max, kld_99.9% ... kld_0.1%,
        kld_median, kld_min, p_diff_mean, p_diff_max, p_diff_99.9% ... p_diff_0.1%, p_diff_median, p_diff_min,
        p_diff_rms, same_top."""
        stats: dict[str, tuple[float, float] | float] = dict(self._moments())
        for name, values, fractions in (
            ("kld", self.kld_values, KLD_PERCENTILES),
            ("p_diff", self.p_diff_values, P_DIFF_PERCENTILES),
        ):
            v = np.sort(np.concatenate(values))  # f32
            stats[f"{name}_max"] = float(v[-1])
            stats[f"{name}_min"] = float(v[0])
            stats[f"{name}_median"] = _median(v)
            for f in fractions:
                stats[f"{name}_{f * 100:g}%"] = _percentile(v, f)
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


def _sqrt(x: float) -> float:
    return math.sqrt(x) if x >= 0 else math.nan  # C's sqrt of a negative rounding residue: nan, printed as such


def _mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def _covariance(a: float, b: float, ab: float, count: int) -> float:
    return 0.0 if count < 10 else (ab / count - (a / count) * (b / count)) / (count - 1)


def _median(values: np.ndarray) -> float:
    """`0.5f*(v[n/2] + v[n/2-1])` for an even count: f32 arithmetic."""
    n = len(values)
    return float(F32(0.5) * (values[n // 2] + values[n // 2 - 1]) if n % 2 == 0 else values[n // 2])


def _percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's linear-interpolation percentile over sorted f32 values, in f32 arithmetic."""
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = F32(fraction) * F32(len(values) - 1)
    ip = int(p)
    p = p - F32(ip)
    return float((F32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])
