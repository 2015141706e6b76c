"""Perplexity and KL-divergence by llama.cpp's protocol (ggufpy/perplexity.py).

Oracles: a direct float64 log-softmax on a stub model (protocol: chunking, BOS, which rows are scored), and
llama.cpp's own logits recorded by conformance/record_perplexity.py (the value users compare against).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ggufpy.kld import KLDivergence, kl_divergence
from ggufpy.perplexity import (
    LogitsFile,
    decode_log_probs,
    default_text,
    encode_log_probs,
    expf,
    make_chunks,
    perplexity,
)

GOLDENS = Path(__file__).parent / "data" / "perplexity"


class StubTokenizer:
    """Token ids are the characters' code points modulo the vocabulary; BOS is id 1."""

    def __init__(self, vocab: int, add_bos: bool):
        self.vocab, self.add_bos, self.bos_id = vocab, add_bos, 1

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = [ord(c) % self.vocab for c in text]
        return [self.bos_id, *ids] if add_special and self.add_bos else ids


class StubModel:
    """Logits of position t depend on the tokens at t and t-1 only: a table lookup, no real model needed."""

    def __init__(self, vocab: int = 97, add_bos: bool = True, seed: int = 0, noise: float = 0.0):
        rng = np.random.default_rng(seed)
        self.table = rng.standard_normal((vocab, vocab)).astype(np.float32) * 3
        if noise:
            self.table += rng.standard_normal((vocab, vocab)).astype(np.float32) * noise
        self.config = SimpleNamespace(vocab_size=vocab)
        self.tokenizer = StubTokenizer(vocab, add_bos)
        self.seen: list[np.ndarray] = []

    def new_cache(self, capacity: int):
        return SimpleNamespace(capacity=capacity)

    def forward(self, ids, pos, cache):
        ids = np.asarray(ids)
        self.seen.append(ids.copy())
        prev = np.concatenate([[0], ids[:-1]])
        return self.table[ids] + 0.5 * self.table[prev]  # (T, V)


def direct_nll(model: StubModel, text: str, n_ctx: int) -> list[float]:
    """The protocol written out plainly, in float64."""
    toks = model.tokenizer.encode(text)
    out = []
    for c in range(len(toks) // n_ctx):
        chunk = list(toks[c * n_ctx : (c + 1) * n_ctx])
        if model.tokenizer.add_bos:
            chunk[0] = model.tokenizer.bos_id
        logits = model.forward(np.array(chunk), 0, None).astype(np.float64)
        for j in range(n_ctx // 2, n_ctx - 1):
            row = logits[j]
            lse = row.max() + math.log(np.exp(row - row.max()).sum())
            out.append(lse - row[toks[c * n_ctx + j + 1]])
    return out


TEXT = "the quick brown fox jumps over the lazy dog. " * 12


@pytest.mark.parametrize("add_bos", [True, False])
def test_protocol_matches_a_direct_transcription(add_bos):
    model = StubModel(add_bos=add_bos)
    chunks = make_chunks(model.tokenizer, TEXT, 32)
    ppl = perplexity(model, chunks)
    expected = direct_nll(StubModel(add_bos=add_bos), TEXT, 32)
    assert chunks.n_chunk == len(model.tokenizer.encode(TEXT)) // 32
    assert ppl.count == len(expected) == chunks.n_chunk * 15
    assert ppl.value == pytest.approx(math.exp(np.mean(expected)), rel=1e-6)
    # each chunk is run on its own, with BOS in front when the vocabulary adds one, the rest untouched
    for c, ids in enumerate(model.seen):
        assert (ids[0] == 1) if add_bos else (ids[0] == chunks.tokens[c * 32])
        assert np.array_equal(ids[1:], chunks.tokens[c * 32 + 1 : (c + 1) * 32])
    assert len(ppl.per_chunk) == chunks.n_chunk and ppl.per_chunk[-1] == ppl.value
    assert 0 < ppl.error < ppl.value


def test_too_short_text_names_both_numbers():
    model = StubModel()
    with pytest.raises(ValueError, match=r"tokenizes to 11 tokens: at least 64 \(2 x context 32\)"):
        make_chunks(model.tokenizer, "0123456789", 32)
    with pytest.raises(ValueError, match="even number"):
        make_chunks(model.tokenizer, TEXT, 31)


def test_logits_file_encoding_is_within_half_a_step():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((7, 301)) * 4).astype(np.float32)
    logits[3] = 0.5  # a flat row: scale 0, every code 0, log p = min_log_prob exactly
    rows, _ = encode_log_probs(logits)
    assert rows.shape == (7, 2 * 151 + 4) and rows.dtype == np.uint16
    decoded = decode_log_probs(rows, 301).astype(np.float64)
    true = logits - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    scale = rows[:, :4].copy().view("<f4")[:, 0].astype(np.float64)
    keep = true > true.max(axis=1, keepdims=True) - 16  # above llama.cpp's 16-nat floor
    err = np.abs(decoded - true)
    assert np.all(err[keep] <= (scale[:, None] / 2 + 1e-5).repeat(301, axis=1)[keep])
    assert np.allclose(decoded[3], math.log(1 / 301), atol=1e-6)


def test_logits_file_round_trip_and_bad_files(tmp_path):
    model = StubModel()
    chunks = make_chunks(model.tokenizer, TEXT, 32, n_chunks=3)
    buf = io.BytesIO()
    perplexity(model, chunks, save_logits=buf)
    path = tmp_path / "base.logits"
    path.write_bytes(buf.getvalue())
    f = LogitsFile.open(path)
    assert (f.n_ctx, f.n_vocab, f.n_chunk) == (32, 97, 3)
    assert np.array_equal(f.tokens, chunks.tokens) and f.rows.shape == (3, 15, 2 * 49 + 4)

    bad = tmp_path / "bad.logits"
    bad.write_bytes(b"_logitz_" + buf.getvalue()[8:])
    with pytest.raises(ValueError, match="no '_logits_' magic"):
        LogitsFile.open(bad)
    bad.write_bytes(buf.getvalue()[:-2])
    with pytest.raises(ValueError, match=r"bytes, expected \d+ for n_ctx=32, n_chunk=3"):
        LogitsFile.open(bad)
    raw = bytearray(buf.getvalue())
    raw[20:24] = np.array([97], "<i4").tobytes()  # the first token id = the vocabulary size
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="outside the vocabulary of 97"):
        LogitsFile.open(bad)


def _base_file(tmp_path, model, n_ctx=32) -> LogitsFile:
    buf = io.BytesIO()
    perplexity(model, make_chunks(model.tokenizer, TEXT, n_ctx), save_logits=buf)
    path = tmp_path / "base.logits"
    path.write_bytes(buf.getvalue())
    return LogitsFile.open(path)


def test_kld_of_a_model_against_itself_is_zero_up_to_the_file_rounding(tmp_path):
    model = StubModel()
    stats = kl_divergence(model, _base_file(tmp_path, model)).statistics()
    # the base is stored in 16 bits per log-prob (scale ~ range/65535), so llama.cpp's own self-KLD is ~1e-7 too
    assert abs(stats["kld_mean"][0]) < 1e-5 and stats["kld_max"] < 1e-4
    assert stats["same_top"][0] == 1.0
    assert stats["ppl"][0] == pytest.approx(stats["ppl_base"][0], rel=1e-4)


def test_kld_against_a_perturbed_model_equals_the_direct_kl(tmp_path):
    base_model, quant = StubModel(), StubModel(noise=0.3)
    base = _base_file(tmp_path, base_model)
    kld = kl_divergence(quant, base)
    chunks = base.chunks(1)
    direct = []
    for c in range(chunks.n_chunk):
        ids = chunks.chunk(c)
        p = base_model.forward(ids, 0, None).astype(np.float64)[16:31]
        q = quant.forward(ids, 0, None).astype(np.float64)[16:31]
        logp = p - np.log(np.exp(p).sum(axis=1, keepdims=True))
        logq = q - np.log(np.exp(q).sum(axis=1, keepdims=True))
        direct.extend((np.exp(logp) * (logp - logq)).sum(axis=1))
    stats = kld.statistics()
    assert stats["kld_mean"][0] == pytest.approx(np.mean(direct), rel=1e-3)
    assert stats["kld_max"] == pytest.approx(max(direct), rel=1e-3)
    assert 0 < stats["same_top"][0] < 1
    assert isinstance(kld, KLDivergence) and kld.count == len(direct)


def test_kld_refuses_another_vocabulary(tmp_path):
    base = _base_file(tmp_path, StubModel())
    with pytest.raises(ValueError, match="vocabulary 97 differs from the model's 89"):
        kl_divergence(StubModel(vocab=89), base)


def test_default_text_is_long_enough_for_the_default_context():
    text = default_text()
    assert 10_000 < len(text.encode()) < 1 << 20
    assert len(StubModel().tokenizer.encode(text)) > 2 * 512


# -- llama.cpp's numbers -------------------------------------------------------------------------------------


def _golden(name: str) -> dict:
    return json.loads((GOLDENS / f"{name}.json").read_text())


# The default engine (exact numerics) is within 1 % of llama.cpp (31.243 vs 31.053 on SmolLM2, 37.838 vs 38.135
# on Gemma 3): the bound catches any protocol error (a wrong half, a missing BOS, an off-by-one target moves PPL by
# far more than 1 %).
PPL_GAP = 1e-2
# The llamacpp numerics of the build that recorded the goldens (their system_info: AVX2, "llamacpp-avx2") give
# llama.cpp's logits bit for bit, and both sides compute the NLLs as perplexity.cpp does (the C library's expf, a
# double sum, `l[tok] - max` rounded to f32; conformance/record_perplexity.py `llamacpp_nll` is an independent
# transcription): what is left is the order of the double sums (perplexity.cpp's threads, NumPy's pairwise sum).
PPL_SAME = 1e-12


@pytest.mark.slow  # the NumPy replay of llama.cpp's kernels: minutes on two busy cores
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_llamacpp_numerics_perplexity_is_llamacpps(name):
    import ggufpy
    from ggufpy.numerics import llamacpp_mode

    g = _golden(name)
    model = ggufpy.load(name, backend="numpy", numerics=llamacpp_mode(g["llama_cpp"]["system_info"]))
    chunks = make_chunks(model.tokenizer, default_text(), g["n_ctx"], g["n_chunks"])
    assert chunks.tokens.tolist() == g["tokens"]  # llama.cpp's tokenization of the text
    ppl = perplexity(model, chunks)
    assert ppl.value == pytest.approx(g["ppl"], rel=PPL_SAME)


@pytest.mark.parametrize("name", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_default_engine_perplexity_is_near_llamacpps(name):
    import ggufpy

    g = _golden(name)
    model = ggufpy.load(name)
    ppl = perplexity(model, make_chunks(model.tokenizer, default_text(), g["n_ctx"], g["n_chunks"]))
    assert ppl.value == pytest.approx(g["ppl"], rel=PPL_GAP)


@pytest.mark.conformance
@pytest.mark.parametrize("name", ["smollm2", "smollm2-q4_k_m"])
def test_goldens_are_what_llamacpp_computes_now(name):
    """Live: re-record with the installed llama.cpp (its quantizer too) and compare (skips without the
    conformance extra)."""
    pytest.importorskip("llama_cpp")
    from conformance.record_perplexity import CASES, record

    g = _golden(name)
    live = record(name, *CASES[name])
    assert live["tokens"] == g["tokens"] and live.get("sha256") == g.get("sha256")
    assert live["ppl"] == pytest.approx(g["ppl"], rel=1e-12)


# -- the C arithmetic of llama-perplexity ----------------------------------------------------------------------


def _glibc_expf(x: np.ndarray) -> np.ndarray:
    import ctypes
    import ctypes.util

    f = ctypes.CDLL(ctypes.util.find_library("m")).expf
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.array([f(v) for v in x.tolist()], np.float32)


def test_expf_is_the_c_librarys():
    """NumPy's float32 exp differs from glibc's expf in the last bit for ~40 % of arguments; `expf` must not."""
    rng = np.random.default_rng(2)
    x = np.concatenate(
        [
            (-rng.random(30_000) * 40).astype(np.float32),  # logits minus their max
            (rng.standard_normal(5_000) * 30).astype(np.float32),
            np.array([0, -0.0, -16, -87.3, -88, -103, -104, -200, 88.7, 89, np.inf, -np.inf], np.float32),
        ]
    )
    want = _glibc_expf(x)
    got = expf(x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    with np.errstate(over="ignore"):
        assert np.mean(np.exp(x) != want) > 0.2  # what this is for


def test_row_nll_is_llama_cpps_log_softmax():
    """perplexity.cpp `log_softmax`: the C library's expf of each f32 difference, summed in double in order, then
    -(double)(l[tok] - max) + log(sum): equal to this scalar transcription up to the order of the double sum."""
    from ggufpy.perplexity import row_nll

    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((5, 3001)) * 5).astype(np.float32)
    targets = rng.integers(0, 3001, 5)
    want = []
    for row, tok in zip(logits, targets, strict=True):
        m = row.max()
        total = float(np.cumsum(_glibc_expf(row - m).astype(np.float64))[-1])  # sequential, as the C loop
        want.append(-(float(np.float32(row[tok] - m)) - math.log(total)))
    np.testing.assert_allclose(row_nll(logits, targets), want, rtol=1e-15, atol=0)


@pytest.mark.parametrize("command", ["perplexity", "imatrix"])
def test_numerics_host_is_the_llamacpp_build_this_cpu_runs(command):
    from ggufpy.cli import build_parser
    from ggufpy.cli.perplexity import resolve_numerics
    from ggufpy.numerics import host_llamacpp_mode

    assert build_parser().parse_args([command, "--numerics", "host"]).numerics == "host"
    assert resolve_numerics("host") == host_llamacpp_mode() and resolve_numerics("exact") == "exact"


@pytest.mark.slow  # compiles the llamacpp numerics' kernels (integer products, ggml's attention) when cold
def test_cli_default_prints_llamacpps_perplexity(capsys):
    """`ggufpy perplexity` with no numerics flag scores in this CPU's llama.cpp numerics on the default
    (numba) backend: its final estimate is llama.cpp's own, as llama-perplexity prints it, on the golden's
    chunks (the golden was recorded on an AVX2 build, so this holds where the host replays that build)."""
    from ggufpy.cli import build_parser, main
    from ggufpy.numerics import host_llamacpp_mode, llamacpp_mode

    g = _golden("smollm2")
    if host_llamacpp_mode() != llamacpp_mode(g["llama_cpp"]["system_info"]):
        pytest.skip(f"this CPU runs {host_llamacpp_mode()}, the golden is {g['llama_cpp']['system_info']!r}")
    argv = ["perplexity", "-c", str(g["n_ctx"]), "--chunks", str(g["n_chunks"])]
    assert build_parser().parse_args(argv).numerics == "host"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"Final estimate: PPL = {g['ppl']:.4f} +/- " in out


@pytest.mark.slow  # ggufpy's NumPy quantizer writes the file (~4 minutes), then a numba forward pass per chunk
def test_requantized_q4_k_m_perplexity_is_llamacpps(tmp_path):
    """SmolLM2 requantized to Q4_K_M by ggufpy's quantizer: the file is the one llama.cpp's quantizer wrote for
    the golden (same sha256), and in the host's llama.cpp numerics (the `ggufpy perplexity` default) its PPL
    is the one llama.cpp computed from that file's logits."""
    import hashlib

    import ggufpy
    from ggufpy.numerics import llamacpp_mode
    from ggufpy.workbench.quantize import quantize_model
    from tests import models

    g = _golden("smollm2-q4_k_m")
    path = tmp_path / "smollm2-q4_k_m.gguf"
    quantize_model(models.smollm2_path(), path, "Q4_K_M")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == g["sha256"]
    model = ggufpy.load(path, numerics=llamacpp_mode(g["llama_cpp"]["system_info"]))
    chunks = make_chunks(model.tokenizer, default_text(), g["n_ctx"], g["n_chunks"])
    assert chunks.tokens.tolist() == g["tokens"]
    assert perplexity(model, chunks).value == pytest.approx(g["ppl"], rel=PPL_SAME)
