"""ggufpy.quants.x86.kquants against ggml's own x86 `ggml_vec_dot_q{3,5,6}_K_q8_K`, bit for bit.

With llama-cpp-python installed the oracle is the compiled kernel itself (conformance.llamacpp.ggml_cpu_matmul,
row by row through ctypes); without it the tests compare against a recorded golden, tests/data/x86/kquants.npz.
Regenerate the golden with `python tests/test_x86_kquants.py` (needs llama-cpp-python).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy.constants import GGMLType
from ggufpy.quants.x86 import kquants
from ggufpy.quants.x86.kquants import KERNELS

GOLDEN = Path(__file__).parent / "data" / "x86" / "kquants.npz"
TYPES = sorted(KERNELS)
# (n, out, T) of the recorded cases: two super-blocks and six, small enough for a < 200 KB file
GOLDEN_CASES = [(512, 40, 5), (1536, 16, 3)]


def _weights(rng: np.random.Generator, out: int, n: int) -> np.ndarray:
    """f32 weight rows of assorted magnitudes: per-row scales over 6 decades, all-zero rows, zeroed super-blocks
    and sub-blocks, a few large outliers, and per-sub-block scales that vary over 4 decades. (Kept well inside
    the fp16 range of the block scales: beyond it ggml's quantizers store inf.)"""
    x = rng.standard_normal((out, n)).astype(np.float32)
    x *= rng.choice(np.float32([1e-4, 1e-2, 0.1, 1, 3, 30, 300]), size=(out, 1))
    kind = rng.integers(0, 6, size=out)
    for o in range(out):
        if kind[o] == 0:
            x[o] = 0
        elif kind[o] == 1:  # one super-block, or one 16-element group, zero
            x[o, 256 * rng.integers(n // 256) :][:256] = 0
            x[o, 16 * rng.integers(n // 16) :][:16] = 0
        elif kind[o] == 2:  # outliers
            x[o, rng.integers(0, n, size=3)] *= 100
        elif kind[o] == 3:  # large dynamic range between sub-blocks
            x[o] *= np.repeat(10.0 ** rng.uniform(-2, 2, size=n // 16), 16).astype(np.float32)
    return x


def _activations(rng: np.random.Generator, T: int, n: int) -> np.ndarray:
    x = rng.standard_normal((T, n)).astype(np.float32)
    x *= rng.choice(np.float32([1e-3, 1, 1, 50, 1e4]), size=(T, 1))
    if T > 2:
        x[1] = 0  # an all-zero activation row: Q8_K d = 0
        x[2, rng.integers(0, n, size=4)] *= 300  # outliers squash the other quants to 0 and +-1
    return x


def _ggml(ggml_type: GGMLType, w_f32: np.ndarray, a_f32: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight bytes, Q8_K activation bytes, ggml's y) from ggml's own quantizers and vec_dot."""
    from conformance.llamacpp import ggml_cpu_matmul, ggml_quantize

    w = ggml_quantize(w_f32, ggml_type)
    y, acts, vec_dot_type = ggml_cpu_matmul(w, ggml_type, a_f32)
    assert vec_dot_type == GGMLType.Q8_K
    return w, acts, y


def _assert_bit_exact(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    bad = ours.view(np.int32) != ref.view(np.int32)
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ, e.g. {ours[bad][:4]} vs {ref[bad][:4]}"


# -- against the compiled kernel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("n", [256, 512, 1536])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matches_ggml(ggml_type, n, T):
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng([int(ggml_type), n, T])
    w, acts, y = _ggml(ggml_type, _weights(rng, 48, n), _activations(rng, T, n))
    _assert_bit_exact(KERNELS[ggml_type](w, acts), y)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    ggml_type=st.sampled_from(TYPES),
    blocks=st.integers(1, 6),
    T=st.integers(1, 9),
    out=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    w_scale=st.sampled_from([1e-6, 1e-3, 1.0, 10.0]),
    a_scale=st.sampled_from([1e-6, 1e-2, 1.0, 1e2, 1e5]),
)
def test_matches_ggml_property(ggml_type, blocks, T, out, seed, w_scale, a_scale):
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(seed)
    n = 256 * blocks
    w_f32 = _weights(rng, out, n) * np.float32(w_scale)
    a_f32 = _activations(rng, T, n) * np.float32(a_scale)
    w, acts, y = _ggml(ggml_type, w_f32, a_f32)
    _assert_bit_exact(KERNELS[ggml_type](w, acts), y)


# -- against the recorded golden ---------------------------------------------------------------------------------


def _golden_cases():
    with np.load(GOLDEN) as z:
        data = dict(z)
    for t in TYPES:
        for n, out, T in GOLDEN_CASES:
            key = f"{t.name}_{n}"
            w, a, y = data[f"{key}_w"], data[f"{key}_a"], data[f"{key}_y"]
            assert y.shape == (T, out) and w.shape[0] == out and a.shape == (T, n // 256 * 292)
            yield t, w, a, y


def test_golden_is_what_the_cases_say():
    cases = list(_golden_cases())
    assert len(cases) == len(TYPES) * len(GOLDEN_CASES)
    assert GOLDEN.stat().st_size < 200_000
    assert sum(y.size for *_, y in cases) == sum(out * T for _, out, T in GOLDEN_CASES) * len(TYPES)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matches_golden(ggml_type):
    for t, w, a, y in _golden_cases():
        if t == ggml_type:
            _assert_bit_exact(KERNELS[t](w, a), y)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matches_golden_in_small_chunks(ggml_type, monkeypatch):
    """Row chunks and split GEMMs (with zero padding) must not change a bit."""
    monkeypatch.setattr(kquants, "_CHUNK_BYTES", 64 * 8 * 60)  # a few output rows per chunk
    monkeypatch.setattr(kquants, "_GEMM_CELLS", 5 * 34 * 3)  # GEMMs of ~3 columns
    for t, w, a, y in _golden_cases():
        if t == ggml_type:
            _assert_bit_exact(KERNELS[t](w, a), y)


def test_golden_is_not_the_exact_value():
    """The golden discriminates: the exactly rounded dot products (ggufpy's vecdot.linear arithmetic) differ
    from ggml's in the last bit for many elements."""
    from ggufpy.quants.vecdot import decode_activations, split_weight

    differ = total = 0
    for t, w, a, y in _golden_cases():
        n = a.shape[1] // 292 * 256
        sw = split_weight(w, t, (w.shape[0], n))
        acts = decode_activations(a, GGMLType.Q8_K, n, np.float64)
        exact = acts.values @ sw.scaled.astype(np.float64).T
        if sw.offsets is not None:
            exact += acts.sub_block_sums(sw.sub) @ sw.offsets.astype(np.float64).T
        differ += int((exact.astype(np.float32) != y).sum())
        total += y.size
    assert differ > total // 10


# -- pieces ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_rejects_mismatched_rows(ggml_type):
    f = KERNELS[ggml_type]
    size = {GGMLType.Q3_K: 110, GGMLType.Q5_K: 176, GGMLType.Q6_K: 210}[ggml_type]
    with pytest.raises(ValueError):
        f(np.zeros((2, 2 * size), np.uint8), np.zeros((1, 292), np.uint8))
    with pytest.raises(ValueError):
        f(np.zeros((2, size + 1), np.uint8), np.zeros((1, 292), np.uint8))


def test_empty_shapes():
    w = np.zeros((0, 210), np.uint8)
    assert KERNELS[GGMLType.Q6_K](w, np.zeros((3, 292), np.uint8)).shape == (3, 0)
    w = np.zeros((4, 110), np.uint8)
    assert KERNELS[GGMLType.Q3_K](w, np.zeros((0, 292), np.uint8)).shape == (0, 4)


# -- recording the golden ----------------------------------------------------------------------------------------


def record_golden(path: Path = GOLDEN) -> None:
    """Run ggml's quantizers and vec_dot on the GOLDEN_CASES and save weights, activations and y."""
    data = {}
    for t in TYPES:
        for n, out, T in GOLDEN_CASES:
            rng = np.random.default_rng([int(t), n, 2024])
            w, a, y = _ggml(t, _weights(rng, out, n), _activations(rng, T, n))
            key = f"{t.name}_{n}"
            data.update({f"{key}_w": w, f"{key}_a": a, f"{key}_y": y})
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **data)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `conformance`
    record_golden()
