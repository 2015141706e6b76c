"""Q8_0 weights in eight-row groups for the integer kernels (`int8dot.interleaved`, `int8ir_q8_0_x8`): the layout
as documented, the products bit for bit those of the GGUF-row kernel (`_mv_q8_0`, ggml's vec_dot per row) and of
the NumPy replay of llama.cpp's x86 kernels, the file's pages released by the copy, and a wrong copy caught."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.weights import QuantTensor

int8dot = pytest.importorskip("ggufpy.kernels.int8dot")
pytestmark = pytest.mark.skipif(not int8dot.AVAILABLE, reason="no numba JIT or no AVX2: the f32 kernels run")
from ggufpy.kernels import int8ir_q8_0_x8  # noqa: E402
from tests.test_kernels_int8 import activations, assert_bitwise, random_weight, replay  # noqa: E402
from tests.test_kernels_thp_x8 import _mapped_rss_kib  # noqa: E402


def test_layout_is_eight_d_then_eight_rows_of_qs():
    rng = np.random.default_rng(0)
    w = random_weight(T.Q8_0, 16, 96, rng)
    iw = int8dot.weight(w)
    rows = w.raw.reshape(16, 3, 34)  # (row, block, bytes)
    assert iw.raw.shape == (2, 3 * 272) and iw.kernel is int8ir_q8_0_x8.q8_0x8_kernel
    for g, b, i in np.ndindex(2, 3, 8):
        blk = iw.raw[g, 272 * b : 272 * (b + 1)]
        assert bytes(blk[2 * i : 2 * i + 2]) == bytes(rows[8 * g + i, b, :2])  # d
        assert bytes(blk[16 + 32 * i : 48 + 32 * i]) == bytes(rows[8 * g + i, b, 2:])  # qs


@pytest.mark.parametrize("rows, cols", [(8, 32), (16, 96), (24, 256), (64, 576), (40, 2880), (2880, 64)])
@pytest.mark.parametrize("n_rows", [1, 3, 8, 20])
def test_products_equal_the_row_kernel_and_the_replay(rows, cols, n_rows):
    """T = 1 (vec_dot), odd T (pairs of activation rows plus one alone), T >= 8 (tinyBLAS in llama.cpp, the same
    rounding sequence); both ISAs' replays agree for Q8_0."""
    rng = np.random.default_rng(rows * 31 + cols + n_rows)
    w = random_weight(T.Q8_0, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    grouped = int8dot.weight(w)
    assert grouped.kernel is int8dot._GROUPED[T.Q8_0]
    got = int8dot.linear(x, grouped, threads=2)
    assert_bitwise(got, int8dot.linear(x, int8dot.weight(w, interleave=False), threads=2))
    assert_bitwise(got, replay(x, w, isa="avx2"))
    assert_bitwise(got, replay(x, w, isa="avx512"))
    assert_bitwise(int8dot.linear(x, grouped, threads=1), got)


@pytest.mark.parametrize("rows", [8, 2880])
@pytest.mark.parametrize("n_rows", [1, 3, 8, 20])
def test_against_llamacpp(rows, n_rows):
    """llama.cpp's own mul_mat (a Q8_0 weight stays in the plain CPU buffer on x86: repack.cpp
    `ggml_repack_get_optimal_repack_type` has Q8_0 layouts for NEON and RISC-V only)."""
    ggml_graph = pytest.importorskip("conformance.ggml_graph")
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(rows + n_rows)
    w = random_weight(T.Q8_0, rows, 512, rng)
    x = activations(rng, n_rows, 512)
    want = ggml_graph.ggml_graph_matmul(w.raw.reshape(rows, -1), T.Q8_0, x)
    assert_bitwise(int8dot.linear(x, int8dot.weight(w), threads=2), want)


def test_other_row_counts_keep_the_gguf_rows():
    rng = np.random.default_rng(1)
    iw = int8dot.weight(random_weight(T.Q8_0, 12, 256, rng))
    assert int8dot.interleaved(iw) is None and iw.raw.shape == (12, 8 * 34) and iw.kernel is int8dot._mv_q8_0


def _swap_rows(raw: np.ndarray) -> np.ndarray:
    """A wrong copy: rows 1 and 2 of every group exchanged."""
    out = int8ir_q8_0_x8.interleave_q8_0(raw)
    G, nb = out.shape[0], raw.shape[1] // 34
    blocks = out.reshape(G, nb, 272)
    d = blocks[:, :, :16].view(np.uint16).copy()
    qs = blocks[:, :, 16:].reshape(G, nb, 8, 32).copy()
    d[..., [1, 2]] = d[..., [2, 1]]
    qs[:, :, [1, 2]] = qs[:, :, [2, 1]]
    blocks[:, :, :16] = d.view(np.uint8)
    blocks[:, :, 16:] = qs.reshape(G, nb, 256)
    return out


@pytest.mark.parametrize(
    "wrong",
    [
        _swap_rows,
        lambda raw: np.roll(int8ir_q8_0_x8.interleave_q8_0(raw), 2, axis=1),  # d and qs shifted by one fp16
        lambda raw: raw.reshape(raw.shape[0] // 8, -1).copy(),  # eight GGUF rows end to end, not interleaved
    ],
)
def test_a_wrong_group_copy_fails(monkeypatch, wrong):
    """Mutation check: the product test above fails when the copy is wrong (so it does test the copy)."""
    rng = np.random.default_rng(5)
    w = random_weight(T.Q8_0, 16, 128, rng)
    x = activations(rng, 3, 128)
    want = replay(x, w, isa="avx2")
    monkeypatch.setitem(int8dot._GROUP_COPIES, T.Q8_0, wrong)
    got = int8dot.linear(x, int8dot.weight(w), threads=1)
    with pytest.raises(AssertionError):
        assert_bitwise(got, want)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_file_pages_are_released_after_the_copy(tmp_path):
    """A 17 MiB Q8_0 weight read from a file map (more than one chunk of groups): resident once touched,
    released by the copy, products as from the map."""
    rng = np.random.default_rng(2)
    w = random_weight(T.Q8_0, 2048, 8192, rng)
    path = tmp_path / "w.bin"
    path.write_bytes(w.raw.tobytes())
    with path.open("rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = QuantTensor("w", T.Q8_0, w.shape, np.frombuffer(mm, np.uint8))
    x = activations(rng, 1, 8192)
    want = int8dot.linear(x, int8dot.weight(mapped, interleave=False), threads=2)  # touches every page
    assert _mapped_rss_kib(path) >= 16 * 1024
    iw = int8dot.weight(mapped)
    assert _mapped_rss_kib(path) < 64
    assert_bitwise(int8dot.linear(x, iw, threads=2), want)
