"""Bit-exactness of the x86 matmul emulations of the issue-12 low-bit types against ggml: MXFP4, NVFP4, Q1_0
(Q8_0 activations), TQ1_0, TQ2_0, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M (Q8_K
activations)
(`ggufpy/quants/x86/{mxfp4,nvfp4,q1_0,ternary,iqgrid}.py`). The grid types run vec_dot below 8 activation
rows and the tiled kernel from 8, which round differently: the batch-split dependence of llama.cpp's logits.

The oracle is `ggml_graph_matmul` (conformance/ggml_graph.py): a one-node ggml graph computed by the installed
libggml-cpu, whose mul_mat driver picks the kernel as llama.cpp does; with `repack=True` the weight lives in
the CPU_REPACK buffer (MXFP4's mxfp4_8x8_q8_0 when out % 8 == 0: another rounding than its vec_dot). None of
these kernels has an AVX-512 variant in this ggml (their AVX2 code runs on both builds; the tiled kernel's
VNNI microkernel sums the same integers: not run on an AVX-512 machine). `test_golden` replays
a recording of ggml's outputs without llama-cpp-python; record it again with `python tests/test_x86_lowbit.py`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufpy.constants import GGMLType
from ggufpy.quants import quant_type, quantize
from ggufpy.quants.vecdot import VEC_DOT_TYPE, quantize_activations
from ggufpy.quants.x86 import kernel_for
from ggufpy.quants.x86.mxfp4 import matmul_mxfp4
from tests.test_x86_q8_0 import random_activations, random_weights

GOLDEN = Path(__file__).parent / "data" / "x86" / "lowbit.npz"
T_ = GGMLType
# per type: (out, in, T) shapes, in a multiple of the block; odd block counts (MXFP4's vec_dot has a scalar
# tail), out % 8 == 0 or not (MXFP4 repacks), T of 1, 4, 5 (the repacked gemm takes T - T % 4 rows), 9, 17
SHAPES = {
    T_.MXFP4: [(12, 32, 1), (12, 96, 3), (16, 96, 5), (40, 576, 17), (8, 64, 1), (24, 160, 9), (36, 224, 4)],
    T_.NVFP4: [(12, 64, 1), (12, 192, 3), (16, 128, 5), (40, 576, 17)],
    T_.Q1_0: [(12, 128, 1), (12, 384, 3), (16, 256, 5), (40, 640, 17)],
    T_.TQ1_0: [(12, 256, 1), (12, 768, 3), (16, 512, 9), (40, 1536, 17)],
    T_.TQ2_0: [(12, 256, 1), (12, 768, 3), (16, 512, 9), (40, 1536, 17)],
    T_.IQ2_XXS: [(12, 256, 1), (12, 768, 3), (16, 512, 7), (16, 512, 8), (40, 1536, 17)],
    T_.IQ3_XXS: [(12, 256, 1), (12, 768, 3), (16, 512, 7), (16, 512, 8), (40, 1536, 17)],
    T_.IQ3_S: [(12, 256, 1), (12, 768, 3), (16, 512, 7), (16, 512, 8), (40, 1536, 17)],
    T_.IQ2_XS: [(12, 256, 1), (16, 512, 7), (16, 512, 8), (40, 1536, 17)],
    T_.IQ2_S: [(12, 256, 1), (16, 512, 7), (16, 512, 8), (40, 1536, 17)],
    T_.IQ1_S: [(12, 256, 1), (16, 512, 7), (16, 512, 8), (40, 1536, 17)],
    T_.IQ1_M: [(12, 256, 1), (16, 512, 7), (16, 512, 8), (40, 1536, 17)],
}
# no ggufpy quantizer: random valid blocks (every grid index, sign pattern and scale is valid) with a sane fp16 d
NEEDS_IMATRIX = (T_.IQ2_XXS, T_.IQ3_XXS, T_.IQ3_S, T_.IQ2_XS, T_.IQ2_S, T_.IQ1_S, T_.IQ1_M)
CASES = [(t, *shape) for t, shapes in SHAPES.items() for shape in shapes]


def _random_blocks(rng: np.random.Generator, t: GGMLType, out: int, n: int) -> np.ndarray:
    """Rows of random bytes (every grid index, sign pattern and scale is valid) with d in [0.001, 0.05]."""
    qt = quant_type(t)
    b = rng.integers(0, 256, (out * (n // qt.block_size), qt.type_size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, b.shape[0]).astype(np.float16)
    if t == T_.IQ1_M:  # its fp16 d is the top nibbles of the four u16 scale words (bytes 48-55)
        sc = b[:, 48:56].copy().view("<u2") & np.uint16(0x0FFF)
        sc |= ((d.view(np.uint16)[:, None] >> (4 * np.arange(4, dtype=np.uint16))) & 0xF) << 12
        b[:, 48:56] = sc.view(np.uint8)
    else:
        b[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(out, -1)


def _case(t: GGMLType, out: int, n: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(int(t) * 1000 + out * n + T)
    wb = _random_blocks(rng, t, out, n) if t in NEEDS_IMATRIX else quantize(random_weights(rng, out, n), t)
    return wb, random_activations(rng, T, n)


def _ours(t: GGMLType, wb: np.ndarray, x: np.ndarray) -> np.ndarray:
    a = quantize_activations(x, VEC_DOT_TYPE[t])
    return kernel_for(t, wb.shape[0], x.shape[0], isa="avx2")(wb, a)


def _bits(y: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(y, np.float32).view(np.uint32)


def test_vec_dot_types():
    assert {t: VEC_DOT_TYPE[t] for t in SHAPES} == {
        T_.MXFP4: T_.Q8_0, T_.NVFP4: T_.Q8_0, T_.Q1_0: T_.Q8_0, T_.TQ1_0: T_.Q8_K, T_.TQ2_0: T_.Q8_K,
        T_.IQ2_XXS: T_.Q8_K, T_.IQ3_XXS: T_.Q8_K, T_.IQ3_S: T_.Q8_K, T_.IQ2_XS: T_.Q8_K, T_.IQ2_S: T_.Q8_K,
        T_.IQ1_S: T_.Q8_K, T_.IQ1_M: T_.Q8_K,
    }  # fmt: skip


@pytest.mark.parametrize(("t", "out", "n", "T"), CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_against_ggml(t, out, n, T):
    pytest.importorskip("llama_cpp")
    from conformance.ggml_graph import ggml_graph_matmul

    wb, x = _case(t, out, n, T)
    repacked = t == T_.MXFP4 and out % 8 == 0  # what llama.cpp does with a model's weight
    want = ggml_graph_matmul(wb, t, x, repack=repacked)
    bad = int((_bits(_ours(t, wb, x)) != _bits(want)).sum())
    assert bad == 0, f"{bad} of {want.size} differ"
    if repacked:  # the plain buffer runs vec_dot
        a = quantize_activations(x, T_.Q8_0)
        plain = ggml_graph_matmul(wb, t, x, repack=False)
        assert np.array_equal(_bits(matmul_mxfp4(wb, a, repack=False)), _bits(plain))


def test_iq2_xxs_kernel_changes_at_8_rows():
    """7 rows: vec_dot; 8: the tiled kernel. Row 0 of the same input differs between them."""
    wb, x = _case(T_.IQ2_XXS, 16, 512, 8)
    a = quantize_activations(x, T_.Q8_K)
    k7, k8 = kernel_for(T_.IQ2_XXS, 16, 7, isa="avx2"), kernel_for(T_.IQ2_XXS, 16, 8, isa="avx2")
    assert k7 is not k8
    assert (_bits(k7(wb, a)) != _bits(k8(wb, a))).any()


def test_mxfp4_kernels_round_differently():
    """The shape decides MXFP4's kernel, and the kernel the last bits (a test of one proves nothing of the other)."""
    wb, x = _case(T_.MXFP4, 40, 576, 17)
    a = quantize_activations(x, T_.Q8_0)
    assert (_bits(matmul_mxfp4(wb, a, repack=True)) != _bits(matmul_mxfp4(wb, a, repack=False))).any()


def record_golden(path: Path = GOLDEN) -> None:
    from conformance.ggml_graph import ggml_graph_matmul

    arrays = {}
    for t, out, n, T in CASES:
        wb, x = _case(t, out, n, T)
        arrays[f"{t.name}_{out}x{n}x{T}"] = ggml_graph_matmul(wb, t, x, repack=t == T_.MXFP4 and out % 8 == 0)
    np.savez_compressed(path, **arrays)


def test_golden():
    """The recorded ggml outputs (repacked where llama.cpp repacks), bit for bit, without llama_cpp."""
    g = np.load(GOLDEN)
    for t, out, n, T in CASES:
        wb, x = _case(t, out, n, T)
        assert np.array_equal(_bits(_ours(t, wb, x)), _bits(g[f"{t.name}_{out}x{n}x{T}"])), (t.name, out, n, T)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent))
    record_golden()
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
