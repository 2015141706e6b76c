"""KL-divergence statistics against llama.cpp's (`llama-perplexity --kl-divergence`), golden and live.

The golden (conformance/record_kld.py) holds, for a synthetic F32 model and its Q4_1/Q8_0 requantization:
llama.cpp's logits of the quantized model, the base logits file made from llama.cpp's logits of the F32 model,
and the statistics perplexity.cpp's protocol gives on them, transcribed independently of ggufpy/kld.py (the C
library's expf per element, sequential double sums). ggufpy must give the same numbers up to the order of its
double sums (pairwise here, sequential in C: a few 1e-16 relative).
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from conformance.record_kld import GOLDEN, N_CTX, PAIR
from ggufpy.kld import KLDivergence, kl_divergence
from ggufpy.perplexity import Chunks, LogitsFile, expf, perplexity

SUM_ORDER = 1e-14  # relative: the same double sums added in another order (measured <= 2.5e-16)


@pytest.fixture(scope="module")
def golden():
    g = np.load(GOLDEN)
    return {
        "tokens": g["tokens"],
        "base_file": g["base_file"].tobytes(),
        "quant_logits": g["quant_logits"],
        "stats": json.loads(str(g["stats"])),
        "versions": json.loads(str(g["versions"])),
    }


@pytest.fixture(scope="module")
def base_file(golden, tmp_path_factory):
    path = tmp_path_factory.mktemp("kld") / "base.logits"
    path.write_bytes(golden["base_file"])
    return LogitsFile.open(path)


def assert_same_statistics(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for key, want in theirs.items():
        got = np.atleast_1d(ours[key]).astype(np.float64)
        assert got == pytest.approx(np.atleast_1d(want), rel=SUM_ORDER, abs=0), key


def test_statistics_of_llamacpps_logits_are_llamacpps(golden, base_file):
    """The protocol and its float widths alone: llama.cpp's logits in, llama.cpp's numbers out."""
    kld = KLDivergence()
    chunks = base_file.chunks(None)
    for i in range(base_file.n_chunk):
        kld.add(golden["quant_logits"][i], np.asarray(base_file.rows[i]), chunks.targets(i))
    assert kld.count == 4 * 31
    stats = kld.statistics()
    assert_same_statistics(stats, golden["stats"])
    # the numbers are those of a real quantization, not degenerate ones
    assert 0.1 < stats["kld_mean"][0] < 0.5 and 0.5 < stats["same_top"][0] < 0.95


def test_the_c_library_expf_matters(golden, base_file, monkeypatch):
    """The comparison can fail: with NumPy's own float32 exp, which differs from glibc's expf in the last bit for
    ~40 % of arguments, the statistics leave llama.cpp's by far more than the summation order."""
    import ggufpy.kld

    x = (-np.random.default_rng(0).random(20_000) * 30).astype(np.float32)
    assert np.mean(np.exp(x) != expf(x)) > 0.2
    monkeypatch.setattr(ggufpy.kld, "expf", np.exp)
    kld = KLDivergence()
    chunks = base_file.chunks(None)
    for i in range(base_file.n_chunk):
        kld.add(golden["quant_logits"][i], np.asarray(base_file.rows[i]), chunks.targets(i))
    with pytest.raises(AssertionError, match=r"kld_mean|p_diff"):
        assert_same_statistics(kld.statistics(), golden["stats"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from conformance.fixtures import write_tiny_llama

    d = tmp_path_factory.mktemp("pair")
    return {name: write_tiny_llama(d / f"{name}.gguf", spec) for name, spec in PAIR.items()}


def _host_mode(golden) -> str:
    from ggufpy.numerics import llamacpp_mode

    return llamacpp_mode(golden["versions"]["system_info"])  # the build that recorded the golden (AVX2)


def test_base_logits_file_in_llamacpp_numerics_is_llamacpps_byte_for_byte(golden, pair):
    import ggufpy

    model = ggufpy.load(pair["base"], backend="numpy", numerics=_host_mode(golden))
    buf = io.BytesIO()
    perplexity(model, Chunks(golden["tokens"], N_CTX, None), save_logits=buf)
    assert buf.getvalue() == golden["base_file"]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_kld_in_llamacpp_numerics_equals_llamacpps(golden, pair, base_file, backend):
    import ggufpy

    if backend == "numba":
        pytest.importorskip("numba")
    model = ggufpy.load(pair["quant"], backend=backend, numerics=_host_mode(golden))
    assert_same_statistics(kl_divergence(model, base_file).statistics(), golden["stats"])


def test_cli_prints_llamacpps_summary(golden, pair, tmp_path, capsys):
    from ggufpy.cli import main

    path = tmp_path / "base.logits"
    path.write_bytes(golden["base_file"])
    argv = ["perplexity", "-m", str(pair["quant"]), "--kl-base", str(path), "--backend", "numpy"]
    assert main([*argv, "--numerics", _host_mode(golden)]) == 0
    out = capsys.readouterr().out
    s = golden["stats"]
    assert f"Mean    KLD: {s['kld_mean'][0]:10.6f} ± {s['kld_mean'][1]:10.6f}" in out
    assert f"Same top p: {100 * s['same_top'][0]:6.3f} ± {100 * s['same_top'][1]:5.3f} %" in out
    assert f"99.0%   KLD: {s['kld_99%']:10.6f}" in out and f" 0.1%   KLD: {s['kld_0.1%']:10.6f}" in out
    assert out.count("\n   4    ") == 1  # one line per chunk, llama.cpp's table
    assert math.isfinite(s["cor"][0]) and f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor'][0]:6.2f}%" in out


@pytest.mark.conformance
def test_golden_is_what_llamacpp_computes_now(golden, tmp_path):
    """Live: the pair run through the installed llama.cpp again, the protocol applied again."""
    pytest.importorskip("llama_cpp")
    from conformance.record_kld import record

    live = record(tmp_path)
    assert live["base_file"].tobytes() == golden["base_file"]
    assert np.array_equal(live["quant_logits"], golden["quant_logits"])
    assert json.loads(str(live["stats"])) == golden["stats"]
