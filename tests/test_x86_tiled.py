"""ggufpy.quants.x86.tiled against llama.cpp's tiled K-quant mul_mat (ggml-cpu/tiled/), bit for bit.

The oracle, `graph_matmul`, computes a one-node ggml graph (`ggml_mul_mat` of a plain-buffer weight by f32
activations) with `ggml_graph_compute_with_ctx`: ggml-cpu.c's whole mul_mat driver, which hands the op to
`ggml_compute_forward_mul_mat_tiled` for Q2_K..Q6_K / IQ4_XS weights when T >= 8 and to the vec_dot kernels
below that. It is tests/test_x86_q8_0.py's `ggml_graph_matmul` without the repack option and with room in the
context for the tiled path's per-thread 512 KB workspaces (that function's context fits them only up to 2
threads: more abort ggml with "not enough space in the context's memory pool").

Tests that call llama.cpp need llama-cpp-python; `test_golden` replays a recording (tests/data/x86/tiled.npz)
without it. Record it again with `python tests/test_x86_tiled.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy.constants import GGMLType
from ggufpy.quants.vecdot import quantize_activations
from ggufpy.quants.x86 import iquants, kquants, repack, tiled
from ggufpy.quants.x86.iqgrid import GRID_TYPES

GOLDEN = Path(__file__).parent / "data" / "x86" / "tiled.npz"
G = GGMLType
TYPES = (G.Q2_K, G.Q3_K, G.Q4_K, G.Q5_K, G.Q6_K, G.IQ4_XS)
# the vec_dot emulations llama.cpp's mul_mat runs for T < 8 (Q4_K / Q2_K: a plain, non-repacked weight,
# i.e. out % 8 != 0 in a real model; repack.matmul_* takes the vec_dot branch for those)
VEC_DOT = {**kquants.KERNELS, **iquants.KERNELS, **repack.KERNELS}


# -- the oracle ---------------------------------------------------------------------------------------------------


def graph_matmul(w_bytes: np.ndarray, w_type: GGMLType, x_f32: np.ndarray, n_threads: int = 1) -> np.ndarray:
    from conformance.ggml_graph import ggml_graph_matmul

    return ggml_graph_matmul(w_bytes, w_type, x_f32, n_threads=n_threads)


def _atoi(name: str, default: int) -> int:
    if name not in os.environ:
        return default
    digits = os.environ[name].strip()
    sign = -1 if digits.startswith("-") else 1
    digits = digits.lstrip("+-")
    n = len(digits) - len(digits.lstrip("0123456789"))
    return sign * int(digits[:n]) if n else 0


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("llama_cpp")
    # tiled.cpp reads both variables with atoi: MM=0 turns the tiled path off, FORCE=1 takes it for any T
    if _atoi("GGML_CPU_TILED_MM", 1) == 0 or _atoi("GGML_CPU_TILED_MM_FORCE", 0) == 1:
        pytest.skip("GGML_CPU_TILED_MM=0 or GGML_CPU_TILED_MM_FORCE=1: llama.cpp would not take its default path")
    return graph_matmul


# -- test data ------------------------------------------------------------------------------------------------------


def random_weights(rng: np.random.Generator, out: int, n: int) -> np.ndarray:
    """f32 (out, n): rows of scales over 6 decades, zero rows, zeroed super-blocks and 16-groups, outliers, and
    sub-blocks of very different magnitude (all well inside the fp16 range of the block scales)."""
    x = rng.standard_normal((out, n)).astype(np.float32)
    x *= rng.choice(np.float32([1e-4, 1e-2, 0.1, 1, 3, 30, 300]), size=(out, 1))
    for o, kind in enumerate(rng.integers(0, 6, size=out)):
        if kind == 0 or o == 0:
            x[o] = 0
        elif kind == 1:
            x[o, 256 * rng.integers(n // 256) :][:256] = 0
            x[o, 16 * rng.integers(n // 16) :][:16] = 0
        elif kind == 2:
            x[o, rng.integers(0, n, size=3)] *= 100
        elif kind == 3:
            x[o] *= np.repeat(10.0 ** rng.uniform(-2, 2, size=n // 16), 16).astype(np.float32)
    return x


def random_activations(rng: np.random.Generator, T: int, n: int) -> np.ndarray:
    x = rng.standard_normal((T, n)).astype(np.float32)
    x *= rng.choice(np.float32([1e-3, 1, 1, 50, 1e4]), size=(T, 1))
    if T > 2:
        x[1] = 0  # Q8_K d = 0
        x[2, rng.integers(0, n, size=4)] *= 300  # outliers squash the rest of the row's quants
    return x


def _case(ggml_type: GGMLType, out: int, n: int, T: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from conformance.llamacpp import ggml_quantize

    rng = np.random.default_rng(seed)
    return ggml_quantize(random_weights(rng, out, n), ggml_type), random_activations(rng, T, n)


def _assert_bit_exact(got: np.ndarray, want: np.ndarray) -> int:
    assert got.dtype == np.float32 and got.shape == want.shape
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{bad.size}/{want.size} differ, e.g. {got.flat[bad[:4]]} vs {want.flat[bad[:4]]}"
    return want.size


def _compare(ggml_type, out, n, T, seed, n_threads=1) -> int:
    wb, x = _case(ggml_type, out, n, T, seed)
    want = graph_matmul(wb, ggml_type, x, n_threads)
    return _assert_bit_exact(tiled.matmul_tiled(wb, quantize_activations(x, G.Q8_K), ggml_type), want)


# -- against llama.cpp ----------------------------------------------------------------------------------------------

T_TILED = (8, 9, 12, 17, 33, 128)
OUTS = (8, 24, 70, 256)
INS = (256, 512, 1536, 2048)  # the narrow path reads 1, 2, 3 and 2 super-blocks per weight row at once


@pytest.mark.parametrize("n_threads", (1, 2))
@pytest.mark.parametrize("T", T_TILED)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_tiled_matches_ggml(oracle, ggml_type, T, n_threads):
    """Every (out, in) of the grid. With these T, out and thread counts the driver's chunks take both the narrow
    path (<= 16 activation rows per window) and the standard one, with ragged 16-row microtiles on both sides."""
    compared = 0
    for out in OUTS:
        for n in INS:
            compared += _compare(ggml_type, out, n, T, seed=out * 10007 + n + 31 * T, n_threads=n_threads)
    assert compared == T * sum(OUTS) * len(INS)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_thread_count_does_not_matter(oracle, ggml_type):
    """1-4 threads split the output into different chunks (and windows of different paths); each element keeps
    its own accumulation order, so all give the same bits."""
    wb, x = _case(ggml_type, 200, 1536, 40, seed=5)
    got = tiled.matmul_tiled(wb, quantize_activations(x, G.Q8_K), ggml_type)
    for n_threads in (1, 2, 3, 4):
        _assert_bit_exact(got, graph_matmul(wb, ggml_type, x, n_threads))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ggml_type=st.sampled_from(TYPES),
    out=st.integers(1, 300),
    blocks=st.integers(1, 9),
    T=st.integers(8, 70),
    n_threads=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_shapes(oracle, ggml_type, out, blocks, T, n_threads, seed):
    _compare(ggml_type, out, 256 * blocks, T, seed, n_threads)


@pytest.mark.parametrize("T", (1, 3, 4, 5, 7))
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_vec_dot_below_min_batch(oracle, ggml_type, T):
    """T < 8: mul_mat does not take the tiled path; the existing vec_dot emulations must match the whole driver.
    Q4_K / Q2_K only with out % 8 != 0 (repack.matmul_* emulates the repacked gemm/gemv otherwise, which is what
    a model gets for out % 8 == 0; the plain-buffer graph here would run vec_dot for those)."""
    outs = (70, 13) if ggml_type in (G.Q4_K, G.Q2_K) else (8, 24, 70)
    for out in outs:
        for n in (256, 1536):
            wb, x = _case(ggml_type, out, n, T, seed=3 * out + n + T)
            want = graph_matmul(wb, ggml_type, x)
            _assert_bit_exact(VEC_DOT[ggml_type](wb, quantize_activations(x, G.Q8_K)), want)


def test_tiled_differs_from_vec_dot(oracle):
    """The T >= 8 path really is a different kernel: for T = 8 the vec_dot emulations miss many elements."""
    for ggml_type in (G.Q3_K, G.Q6_K, G.IQ4_XS):
        wb, x = _case(ggml_type, 64, 1536, 8, seed=1)
        want = graph_matmul(wb, ggml_type, x)
        assert np.mean(VEC_DOT[ggml_type](wb, quantize_activations(x, G.Q8_K)) != want) > 0.1


def test_activation_bytes_match_ggml(oracle):
    """The tiled driver converts activations with type_traits_cpu[Q8_K].from_float (quantize_row_q8_K), the same
    function as the stock driver: quantize_activations must give its bytes."""
    from conformance.llamacpp import ggml_cpu_matmul

    rng = np.random.default_rng(3)
    x = random_activations(rng, 9, 1536)
    for ggml_type in TYPES:
        wb, _ = _case(ggml_type, 1, 1536, 1, seed=0)
        _, acts, vec_dot_type = ggml_cpu_matmul(wb, ggml_type, x)
        assert vec_dot_type == int(G.Q8_K)
        assert np.array_equal(quantize_activations(x, G.Q8_K).reshape(acts.shape), acts), ggml_type.name


_FORCED_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {root!r})
from tests.test_x86_tiled import graph_matmul
d = np.load(sys.argv[1])
np.save(sys.argv[2], graph_matmul(d["w"], int(d["type"]), d["x"]))
"""


def test_forced_tiled_small_T(oracle, tmp_path):
    """With GGML_CPU_TILED_MM_FORCE=1 (read once per process, so in a child process) ggml runs the tiled kernel
    for T < 8 too: the emulation computes exactly that for any T."""
    root = str(Path(__file__).resolve().parents[1])
    for i, (ggml_type, T) in enumerate([(G.Q5_K, 1), (G.Q6_K, 3), (G.Q2_K, 5), (G.IQ4_XS, 7)]):
        wb, x = _case(ggml_type, 40, 512, T, seed=i)
        np.savez(tmp_path / "in.npz", w=wb, x=x, type=int(ggml_type))
        env = {**os.environ, "GGML_CPU_TILED_MM_FORCE": "1"}
        code = _FORCED_SCRIPT.format(root=root)
        subprocess.run([sys.executable, "-c", code, tmp_path / "in.npz", tmp_path / "y.npy"], env=env, check=True)
        want = np.load(tmp_path / "y.npy")
        _assert_bit_exact(tiled.matmul_tiled(wb, quantize_activations(x, G.Q8_K), ggml_type), want)


@pytest.mark.slow
def test_large_output(oracle):
    """Many output rows (several chunks of the emulation and 256-row windows of ggml), a prompt of 100 tokens."""
    for ggml_type in TYPES:
        _compare(ggml_type, 6000, 1536, 100, seed=9, n_threads=2)


# -- without llama.cpp --------------------------------------------------------------------------------------------


def test_kernel_table():
    assert set(tiled.KERNELS) == set(TYPES) | set(GRID_TYPES)  # the grid types: tests/test_x86_lowbit.py
    assert tiled.TILED_MIN_BATCH == 8
    for ggml_type, fn in tiled.KERNELS.items():
        assert fn.__name__ == f"matmul_{ggml_type.name.lower()}"


def test_rejects_mismatched_rows():
    w = np.zeros((4, 2 * 210), np.uint8)
    with pytest.raises(ValueError):
        tiled.matmul_q6_k(w, np.zeros((8, 292), np.uint8))
    with pytest.raises(ValueError):
        tiled.matmul_q6_k(w[:, :-1], np.zeros((8, 584), np.uint8))


def test_empty_shapes():
    assert tiled.matmul_q4_k(np.zeros((0, 144), np.uint8), np.zeros((8, 292), np.uint8)).shape == (8, 0)
    assert tiled.matmul_q4_k(np.zeros((3, 144), np.uint8), np.zeros((0, 292), np.uint8)).shape == (0, 3)


def test_small_chunks_give_the_same_bits(monkeypatch):
    """The output-row chunking of the emulation does not change any element."""
    data = np.load(GOLDEN)
    for ggml_type in TYPES:
        key = f"standard.{ggml_type.name}"
        w, a = data[f"{key}.w"], data["standard.a"]
        whole = tiled.matmul_tiled(w, a, ggml_type)
        with monkeypatch.context() as m:
            m.setattr(tiled, "_CHUNK_BYTES", 1)  # one output row per chunk
            m.setattr(tiled, "_GEMM_CELLS", 1000)  # many small GEMMs
            assert np.array_equal(tiled.matmul_tiled(w, a, ggml_type).view(np.uint32), whole.view(np.uint32))


# (name, out, in, T): with one thread ggml takes its narrow path (2 super-blocks per row) for the first and the
# standard per-super-block path for the first 17 of the 33 rows of the second (the other 16: narrow, 1 block)
GOLDEN_CASES = [("narrow", 24, 512, 9), ("standard", 40, 256, 33)]


def record_golden(path: Path = GOLDEN) -> None:
    """Run the oracle on GOLDEN_CASES for every type; save the weight bytes, the Q8_K activations, ggml's y."""
    from conformance.llamacpp import ggml_quantize, versions

    arrays: dict[str, np.ndarray] = {"versions": np.array(json.dumps(versions()))}
    for i, (name, out, n, T) in enumerate(GOLDEN_CASES):
        rng = np.random.default_rng(2000 + i)
        x = random_activations(rng, T, n)
        arrays[f"{name}.a"] = quantize_activations(x, G.Q8_K)
        for ggml_type in TYPES:
            wb = ggml_quantize(random_weights(rng, out, n), ggml_type)
            arrays[f"{name}.{ggml_type.name}.w"] = wb
            arrays[f"{name}.{ggml_type.name}.y"] = graph_matmul(wb, ggml_type, x)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)


def test_golden():
    """The emulation against a recording of llama.cpp's outputs (runs without llama-cpp-python)."""
    assert GOLDEN.stat().st_size < 200_000
    data = np.load(GOLDEN)
    compared = 0
    for name, out, n, T in GOLDEN_CASES:
        a = data[f"{name}.a"]
        assert a.shape == (T, n // 256 * 292)
        for ggml_type in TYPES:
            w, want = data[f"{name}.{ggml_type.name}.w"], data[f"{name}.{ggml_type.name}.y"]
            assert want.shape == (T, out)
            compared += _assert_bit_exact(tiled.matmul_tiled(w, a, ggml_type), want)
    assert compared == len(TYPES) * sum(out * T for _, out, _, T in GOLDEN_CASES)


def test_golden_is_not_the_vec_dot_result():
    """The recording pins the tiled arithmetic: the vec_dot emulations (another FMA order) miss some elements."""
    data = np.load(GOLDEN)
    a = data["standard.a"]
    differ = 0
    for ggml_type in (G.Q3_K, G.Q5_K, G.Q6_K, G.IQ4_XS):
        w, want = data[f"standard.{ggml_type.name}.w"], data[f"standard.{ggml_type.name}.y"]
        differ += int(np.sum(VEC_DOT[ggml_type](w, a) != want))
    assert differ > 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `conformance` when run as a script
    record_golden()
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
