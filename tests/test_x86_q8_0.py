"""Bit-exactness of the x86 matmul emulations for Q8_0-activation and float weights against llama.cpp itself.

`ggufpy/quants/x86/llamafile.py` (tinyBLAS and vec_dot: Q8_0, Q5_0, Q4_0, IQ4_NL, F32, F16, BF16) and
`ggufpy/quants/x86/repack_q8_0.py` (the repacked q4_0_8x8 / iq4_nl_8x8 gemm and gemv) must reproduce every
f32 output element of llama.cpp's CPU backend. The oracle, `ggml_graph_matmul`, builds a one-node ggml graph
(`ggml_mul_mat`) and runs it with `ggml_graph_compute_with_ctx`: ggml-cpu.c's whole mul_mat driver with
llamafile on, so it picks tinyBLAS or vec_dot exactly as llama.cpp does for that shape; with `repack=True` the
weight lives in the CPU_REPACK buffer and the op runs repack.cpp's `forward_mul_mat` (activation quantization
4 rows at a time, gemm, gemv), as in a model llama.cpp loads with its default `use_extra_bufts`.

Those tests need llama-cpp-python, and compare with the replay of the build it was compiled for (`HOST`: float
types run 16 lanes wide on AVX-512, 8 on AVX2); `test_golden` replays a recording of ggml's outputs (AVX-512
build) without it. Record it again (after a llama.cpp upgrade, on an AVX-512 machine) with
`python tests/test_x86_q8_0.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.ggml_graph import ggml_graph_matmul
from ggufpy.constants import GGMLType
from ggufpy.quants.vecdot import quantize_activations
from ggufpy.quants.x86 import floats, llamafile, repack_q8_0
from ggufpy.quants.x86.floats import float_activations

GOLDEN = Path(__file__).parent / "data" / "x86" / "q8_0.npz"

T_ = GGMLType
QUANT_TYPES = (T_.Q8_0, T_.Q4_0, T_.Q5_0, T_.IQ4_NL)
FLOAT_TYPES = (T_.F16, T_.BF16, T_.F32)
REPACKABLE = (T_.Q4_0, T_.IQ4_NL)


# -- test data ------------------------------------------------------------------------------------------------


def random_weights(rng: np.random.Generator, out: int, n: int) -> np.ndarray:
    """f32 (out, n): rows of assorted scales, a zero row, a zero block, and rows of large dynamic range."""
    w = rng.standard_normal((out, n)) * rng.choice([1e-4, 1e-2, 0.3, 1.0, 40.0], size=(out, 1))
    w[0] = 0.0
    if out > 1:
        w[1, : min(n, 32)] = 0.0
    if out > 2:  # blocks of very different magnitude within one row
        w[2] *= 10.0 ** rng.integers(-4, 3, size=-(-n // 32)).repeat(32)[:n]
    if out > 3:
        w[3] *= np.abs(rng.standard_normal(n)) ** 4  # heavy-tailed
    return w.astype(np.float32)


def random_activations(rng: np.random.Generator, T: int, n: int) -> np.ndarray:
    x = rng.standard_normal((T, n)) * rng.choice([1e-3, 0.1, 1.0, 8.0], size=(T, 1))
    if T > 1:
        x[1] = 0.0
    if T > 2:
        x[2, :: max(1, n // 7)] *= 300.0  # outliers
    return x.astype(np.float32)


def kernel_input(x: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """What the emulation takes as `a`: Q8_0 blocks for the quantized types, converted rows for float types."""
    if ggml_type in FLOAT_TYPES:
        return float_activations(x, ggml_type)
    return quantize_activations(x, GGMLType.Q8_0)


def _host_isa() -> str:
    try:
        from conformance.llamacpp import available, host_isa
    except ImportError:
        return "avx512"
    return host_isa() if available() else "avx512"


HOST = _host_isa()  # the build the installed llama.cpp replays as; the goldens' AVX-512 without it


def ours(w_bytes: np.ndarray, ggml_type: GGMLType, a: np.ndarray, repack: bool, isa: str = HOST) -> np.ndarray:
    if ggml_type in REPACKABLE:
        return repack_q8_0.KERNELS[ggml_type](w_bytes, a, repack=repack)
    if ggml_type in FLOAT_TYPES:
        return floats.KERNELS[ggml_type](w_bytes, a, isa=isa)
    return llamafile.KERNELS[ggml_type](w_bytes, a)


def weight_bytes(w: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    from conformance.llamacpp import ggml_quantize

    return ggml_quantize(w, ggml_type)


def _compare(ggml_type, out, n, T, seed, repack=False, n_threads=1):
    rng = np.random.default_rng(seed)
    wb = weight_bytes(random_weights(rng, out, n), ggml_type)
    x = random_activations(rng, T, n)
    want = ggml_graph_matmul(wb, ggml_type, x, repack=repack, n_threads=n_threads)
    got = ours(wb, ggml_type, kernel_input(x, ggml_type), repack)
    assert got.dtype == np.float32 and got.shape == want.shape
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{bad.size}/{want.size} differ, e.g. {got.flat[bad[:4]]} vs {want.flat[bad[:4]]}"
    return want.size


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("llama_cpp")
    return ggml_graph_matmul


# -- against llama.cpp ------------------------------------------------------------------------------------------

T_VALUES = (1, 3, 4, 5, 17)
# Q8_0-activation types: one block, an odd block count (IQ4_NL's vec_dot has a scalar tail), SmolLM2's widths
QUANT_SHAPES = [(out, n) for out in (12, 40) for n in (32, 96, 576, 1536)]
# float types: in % 16 or % 32 decides tinyBLAS vs vec_dot, in % 64 the vec_dot leftovers, out % 4 tinyBLAS
FLOAT_SHAPES = [(out, n) for out in (6, 36) for n in (16, 48, 96, 160, 576)]


@pytest.mark.parametrize("T", T_VALUES)
@pytest.mark.parametrize(("out", "n"), QUANT_SHAPES)
@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: t.name)
def test_quant_types_plain_buffer(oracle, ggml_type, out, n, T):
    """Weights in the plain CPU buffer: tinyBLAS_Q0_AVX (T >= 2) or vec_dot (T == 1)."""
    _compare(ggml_type, out, n, T, seed=out * 1000 + n + T)


@pytest.mark.parametrize("T", (*T_VALUES, 8, 9))
@pytest.mark.parametrize(("out", "n"), [(8, 32), (16, 96), (40, 576), (24, 1536)])
@pytest.mark.parametrize("ggml_type", REPACKABLE, ids=lambda t: t.name)
def test_repacked(oracle, ggml_type, out, n, T):
    """Q4_0 / IQ4_NL in the CPU_REPACK buffer: gemm on groups of 4 rows, gemv on the rest."""
    _compare(ggml_type, out, n, T, seed=7 * out + n + T, repack=True)


@pytest.mark.parametrize("T", T_VALUES)
@pytest.mark.parametrize(("out", "n"), FLOAT_SHAPES)
@pytest.mark.parametrize("ggml_type", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_types(oracle, ggml_type, out, n, T):
    _compare(ggml_type, out, n, T, seed=3 * out + n + T)


@pytest.mark.parametrize("ggml_type", (T_.Q8_0, T_.Q4_0, T_.IQ4_NL, T_.F16, T_.BF16, T_.F32), ids=lambda t: t.name)
def test_thread_count_does_not_matter(oracle, ggml_type):
    """Several threads split tinyBLAS / repack jobs differently; every output keeps its own order."""
    repack = ggml_type in REPACKABLE
    _compare(ggml_type, 64, 576, 9, seed=11, repack=repack, n_threads=2)
    _compare(ggml_type, 64, 576, 9, seed=11, repack=repack, n_threads=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ggml_type=st.sampled_from(QUANT_TYPES + FLOAT_TYPES),
    out=st.sampled_from([4, 8, 13, 24]),
    blocks=st.integers(1, 24),
    T=st.integers(1, 12),
    repack=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_shapes(oracle, ggml_type, out, blocks, T, repack, seed):
    repack = repack and repack_q8_0.is_repacked(ggml_type, out)
    _compare(ggml_type, out, 32 * blocks, T, seed, repack=repack)


@pytest.mark.slow
def test_smollm2_output_head_shape(oracle):
    """SmolLM2's tied Q8_0 output head (49152 x 576), a prompt of 7 tokens: the row chunking of the emulation."""
    _compare(T_.Q8_0, 49152, 576, 7, seed=5)


def test_activation_bytes_match_ggml(oracle):
    """The emulations take activations converted by ggufpy: they must be ggml's own bytes (from_float of the
    vec_dot type: quantize_row_q8_0, ggml_cpu_fp32_to_fp16, ggml_cpu_fp32_to_bf16)."""
    from conformance.llamacpp import ggml_cpu_matmul

    rng = np.random.default_rng(3)
    x = random_activations(rng, 6, 576)
    for ggml_type in (T_.Q8_0, T_.F16, T_.BF16):
        w = weight_bytes(random_weights(rng, 1, 576), ggml_type)
        _, acts, _ = ggml_cpu_matmul(w, ggml_type, x)
        mine = np.ascontiguousarray(kernel_input(x, ggml_type)).view(np.uint8).reshape(acts.shape)
        assert np.array_equal(mine, acts), ggml_type.name


# -- without llama.cpp ------------------------------------------------------------------------------------------


def test_kernel_tables():
    assert set(llamafile.KERNELS) == {T_.Q8_0, T_.Q5_0} and set(floats.KERNELS) == {T_.F32, T_.F16, T_.BF16}
    assert set(repack_q8_0.KERNELS) == {T_.Q4_0, T_.IQ4_NL}
    assert repack_q8_0.is_repacked(T_.Q4_0, 1536) and not repack_q8_0.is_repacked(T_.Q4_0, 1532)
    assert not repack_q8_0.is_repacked(T_.Q8_0, 1536)


# (name, type, out, in, T, repacked): every path of every type, small enough for a < 200 KB recording
GOLDEN_CASES = [
    ("q8_0_vec_dot", T_.Q8_0, 16, 576, 1, False),
    ("q8_0_tinyblas", T_.Q8_0, 20, 576, 5, False),
    ("q5_0_vec_dot", T_.Q5_0, 12, 96, 1, False),
    ("q5_0_tinyblas", T_.Q5_0, 20, 576, 3, False),
    ("q4_0_repacked", T_.Q4_0, 24, 576, 7, True),
    ("q4_0_tinyblas", T_.Q4_0, 12, 576, 5, False),
    ("q4_0_vec_dot", T_.Q4_0, 12, 96, 1, False),
    ("iq4_nl_repacked", T_.IQ4_NL, 16, 1536, 6, True),
    ("iq4_nl_tinyblas", T_.IQ4_NL, 12, 160, 4, False),
    ("iq4_nl_vec_dot", T_.IQ4_NL, 12, 160, 1, False),
    ("f16_tinyblas", T_.F16, 12, 576, 4, False),
    ("f16_vec_dot", T_.F16, 6, 160, 3, False),
    ("bf16_tinyblas", T_.BF16, 12, 576, 4, False),
    ("bf16_vec_dot", T_.BF16, 12, 160, 1, False),
    ("f32_tinyblas", T_.F32, 12, 160, 4, False),
    ("f32_vec_dot", T_.F32, 6, 96, 3, False),
]


def record_golden(path: Path = GOLDEN) -> None:
    """Run the oracle on GOLDEN_CASES and save weight bytes, kernel inputs and ggml's outputs."""
    from conformance.llamacpp import versions

    arrays: dict[str, np.ndarray] = {"versions": np.array(json.dumps(versions()))}
    for i, (name, ggml_type, out, n, T, repack) in enumerate(GOLDEN_CASES):
        rng = np.random.default_rng(1000 + i)
        wb = weight_bytes(random_weights(rng, out, n), ggml_type)
        x = random_activations(rng, T, n)
        y = ggml_graph_matmul(wb, ggml_type, x, repack=repack)
        a = kernel_input(x, ggml_type)
        arrays[f"{name}.w"] = wb
        arrays[f"{name}.a"] = a.view(np.uint16) if a.dtype == np.float16 else a
        arrays[f"{name}.y"] = y
        arrays[f"{name}.type"] = np.array(int(ggml_type))
        arrays[f"{name}.repack"] = np.array(repack)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)


def test_golden():
    """The emulations against a recording of llama.cpp's outputs (runs without llama-cpp-python)."""
    data = np.load(GOLDEN)
    names = sorted({k.split(".")[0] for k in data.files if "." in k})
    assert names == sorted(c[0] for c in GOLDEN_CASES)
    for name in names:
        ggml_type = GGMLType(int(data[f"{name}.type"]))
        got = ours(data[f"{name}.w"], ggml_type, data[f"{name}.a"], bool(data[f"{name}.repack"]), isa="avx512")
        want = data[f"{name}.y"]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


if __name__ == "__main__":
    record_golden()
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
