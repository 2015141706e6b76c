"""ggufpy.quants.x86.legacy (Q4_1, Q5_1) and ggufpy.quants.x86.iquants (IQ4_XS) against ggml itself, bit for bit.

The oracle is the installed llama.cpp CPU backend (`conformance.llamacpp.ggml_cpu_matmul`: ggml's own
`from_float` and `vec_dot` through ctypes). Those tests skip without llama-cpp-python; the goldens in
tests/data/x86/{legacy,iquants}.npz, recorded from the same oracle by running this file as a script, keep
the emulations checked without it:

    python tests/test_x86_legacy_iquants.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy.constants import GGMLType
from ggufpy.quants import quantize
from ggufpy.quants.vecdot import VEC_DOT_TYPE, quantize_activations
from ggufpy.quants.x86 import iquants as x86_iquants
from ggufpy.quants.x86 import legacy as x86_legacy

KERNELS = {**x86_legacy.KERNELS, **x86_iquants.KERNELS}
DATA = Path(__file__).parent / "data" / "x86"
GOLDEN_FILES = {"legacy": (GGMLType.Q4_1, GGMLType.Q5_1), "iquants": (GGMLType.IQ4_XS,)}
BLOCK = {GGMLType.Q4_1: 32, GGMLType.Q5_1: 32, GGMLType.IQ4_XS: 256}
# row lengths: the minimum block multiple, and model-like sizes the block size allows
LENGTHS = {GGMLType.Q4_1: (32, 576, 1536), GGMLType.Q5_1: (32, 576, 1536), GGMLType.IQ4_XS: (256, 1536)}
TOKENS = (1, 3, 4, 5, 17)


def random_weights(rng: np.random.Generator, out: int, n: int, block: int) -> np.ndarray:
    """f32 (out, n): normal rows at assorted scales, some with a mean offset (exercises Q*_1's m), some
    all zero, some with per-block magnitudes spread over 1e-4..1e3, and scattered all-zero blocks."""
    w = rng.standard_normal((out, n)).astype(np.float32)
    w *= rng.choice([0.0, 1e-3, 0.05, 1.0, 30.0], size=(out, 1), p=[0.1, 0.2, 0.3, 0.3, 0.1]).astype(np.float32)
    w += (rng.standard_normal((out, 1)) * rng.choice([0.0, 1.0], size=(out, 1))).astype(np.float32)
    wide = rng.random(out) < 0.3  # large dynamic range inside a row
    spread = np.exp(rng.uniform(np.log(1e-4), np.log(1e3), size=(int(wide.sum()), n // block, 1)))
    w[wide] = (w[wide].reshape(-1, n // block, block) * spread).reshape(-1, n).astype(np.float32)
    zero_blocks = rng.random((out, n // block, 1)) < 0.1
    return np.where(zero_blocks, 0, w.reshape(out, n // block, block)).reshape(out, n).astype(np.float32)


def random_activations(rng: np.random.Generator, T: int, n: int, block: int) -> np.ndarray:
    x = rng.standard_normal((T, n)) * rng.choice([1e-3, 0.1, 1.0, 20.0, 500.0], size=(T, 1))
    outliers = rng.random((T, n)) < 0.01  # a few large channels, as in real residual streams
    x = np.where(outliers, x * 50, x)
    zero_blocks = rng.random((T, n // block, 1)) < 0.05
    return np.where(zero_blocks, 0, x.reshape(T, n // block, block)).reshape(T, n).astype(np.float32)


def oracle_case(w_type: GGMLType, T: int, n: int, out: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight bytes, activation bytes, ggml's y) for a random case, from the installed ggml."""
    from conformance.llamacpp import ggml_cpu_matmul, ggml_quantize

    rng = np.random.default_rng(seed)
    block = BLOCK[w_type]
    w = ggml_quantize(random_weights(rng, out, n, block), w_type)
    x = random_activations(rng, T, n, block)
    y, acts, vec_dot_type = ggml_cpu_matmul(w, w_type, x)
    assert vec_dot_type == VEC_DOT_TYPE[w_type]
    return w, acts, y


def assert_bit_equal(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    bad = np.flatnonzero(ours.view(np.uint32) != theirs.view(np.uint32))
    assert bad.size == 0, (
        f"{bad.size}/{ours.size} elements differ, first at {bad[:5]}: {ours.flat[bad[:5]]} vs {theirs.flat[bad[:5]]}"
    )


# -- against the installed ggml ------------------------------------------------------------------------------


@pytest.mark.parametrize("w_type", list(KERNELS), ids=lambda t: t.name)
@pytest.mark.parametrize("T", TOKENS)
def test_matches_ggml(w_type, T):
    pytest.importorskip("llama_cpp")
    for i, n in enumerate(LENGTHS[w_type]):
        w, acts, y = oracle_case(w_type, T, n, out=40, seed=1000 * T + i)
        assert_bit_equal(KERNELS[w_type](w, acts), y)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    w_type=st.sampled_from(list(KERNELS)),
    seed=st.integers(0, 2**32 - 1),
    T=st.sampled_from(TOKENS),
    n_blocks=st.integers(1, 8),
    out=st.integers(1, 70),
)
def test_matches_ggml_random_shapes(w_type, seed, T, n_blocks, out):
    pytest.importorskip("llama_cpp")
    w, acts, y = oracle_case(w_type, T, n_blocks * BLOCK[w_type], out, seed)
    assert_bit_equal(KERNELS[w_type](w, acts), y)


@pytest.mark.slow
@pytest.mark.parametrize("w_type", list(KERNELS), ids=lambda t: t.name)
def test_matches_ggml_many_rows(w_type):
    """~35k outputs per type, model-sized rows: rare events (FMA double-rounding ties) get a chance."""
    pytest.importorskip("llama_cpp")
    w, acts, y = oracle_case(w_type, T=17, n=1536, out=2048, seed=7)
    assert_bit_equal(KERNELS[w_type](w, acts), y)


def test_activation_bytes_match_ggml():
    """The kernels' contract: ggufpy's quantize_activations gives the bytes ggml's from_float does."""
    pytest.importorskip("llama_cpp")
    from conformance.llamacpp import ggml_cpu_matmul, ggml_quantize

    rng = np.random.default_rng(3)
    for w_type in KERNELS:
        x = random_activations(rng, 5, 512, 256)
        w = ggml_quantize(random_weights(rng, 4, 512, 256), w_type)
        y, acts, _ = ggml_cpu_matmul(w, w_type, x)
        assert np.array_equal(quantize_activations(x, VEC_DOT_TYPE[w_type]), acts)
        assert_bit_equal(KERNELS[w_type](w, quantize_activations(x, VEC_DOT_TYPE[w_type])), y)


# -- without llama.cpp ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GOLDEN_FILES))
def test_golden(name):
    with np.load(DATA / f"{name}.npz") as golden:
        cases = [k[:-2] for k in golden.files if k.endswith("/w")]
        assert {c.split("/")[0] for c in cases} == {t.name for t in GOLDEN_FILES[name]}
        for case in cases:
            w_type = GGMLType[case.split("/")[0]]
            assert_bit_equal(KERNELS[w_type](golden[f"{case}/w"], golden[f"{case}/a"]), golden[f"{case}/y"])


def test_empty_and_chunked(monkeypatch):
    """Output chunking does not change results; empty inputs give empty outputs."""
    rng = np.random.default_rng(5)
    for w_type, fn in KERNELS.items():
        block = BLOCK[w_type]
        w_f32 = random_weights(rng, 9, 2 * block, block)
        if w_type == GGMLType.IQ4_XS:  # no NumPy quantizer: build rows from random bytes with fp16 d set
            w = rng.integers(0, 256, size=(9, 2 * 136), dtype=np.uint8)
            w.reshape(-1, 136)[:, :2] = np.array([0.01], np.float16).view(np.uint8)
        else:
            w = quantize(w_f32, w_type).reshape(9, -1)
        a = quantize_activations(random_activations(rng, 3, 2 * block, block), VEC_DOT_TYPE[w_type])
        whole = fn(w, a)
        module = x86_iquants if w_type == GGMLType.IQ4_XS else x86_legacy
        monkeypatch.setattr(module, "_TEMP_BYTES", 64 * 3 * 2)  # 2 rows per chunk
        assert_bit_equal(fn(w, a), whole)
        monkeypatch.undo()
        assert fn(w, a[:0]).shape == (0, 9)
        assert fn(w[:0], a).shape == (3, 0)


# -- recording the goldens ------------------------------------------------------------------------------------

GOLDEN_CASES = ((17, 64, 16), (5, 1536, 24))  # (T, n, out); n rounded up to the block size


def record_goldens() -> None:
    from conformance.llamacpp import versions

    DATA.mkdir(parents=True, exist_ok=True)
    for name, types in GOLDEN_FILES.items():
        arrays: dict[str, np.ndarray] = {"versions": np.array(json.dumps(versions()))}
        for w_type in types:
            for i, (T, n, out) in enumerate(GOLDEN_CASES):
                n = -(-n // BLOCK[w_type]) * BLOCK[w_type]
                w, acts, y = oracle_case(w_type, T, n, out, seed=42 + i)
                case = f"{w_type.name}/{T}x{n}x{out}"
                arrays |= {f"{case}/w": w, f"{case}/a": acts, f"{case}/y": y}
        path = DATA / f"{name}.npz"
        np.savez_compressed(path, **arrays)
        print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    record_goldens()
