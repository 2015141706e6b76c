"""Q4_0 and Q4_K weights interleaved eight rows to a group for the integer kernels (`int8dot.interleaved`;
`int8ir_x8.q4_0x8_dot`, grouped Q4_K kernels): the layouts as documented, the products bit for bit those of the
GGUF-row kernels and of the NumPy replay of ggml's repacked kernels, and the file's pages released once copied
(not resident twice)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.weights import QuantTensor

int8dot = pytest.importorskip("ggufpy.kernels.int8dot")
pytestmark = pytest.mark.skipif(not int8dot.AVAILABLE, reason="no numba JIT or no AVX2: the f32 kernels run")
from tests.test_kernels_int8 import activations, assert_bitwise, random_weight, replay  # noqa: E402


def test_layout_is_eight_rows_per_block_group():
    rng = np.random.default_rng(0)
    w = random_weight(T.Q4_0, 16, 96, rng)
    iw = int8dot.weight(w)
    rows = w.raw.reshape(16, 3, 18)  # (row, block, bytes)
    assert iw.raw.shape == (2, 3 * 144) and iw.kernel is int8dot._mv_q4_0x8
    for g in range(2):
        for b in range(3):
            blk = iw.raw[g, 144 * b : 144 * b + 144]
            for i in range(8):
                assert bytes(blk[2 * i : 2 * i + 2]) == bytes(rows[8 * g + i, b, :2])  # d
                q = 16 + 32 * (i % 4) + 16 * (i // 4)  # rows i and i + 4 share 32 bytes
                assert bytes(blk[q : q + 16]) == bytes(rows[8 * g + i, b, 2:])


def test_q4_k_layout_is_blocks_of_eight_rows_side_by_side():
    rng = np.random.default_rng(3)
    w = random_weight(T.Q4_K, 16, 512, rng)
    iw = int8dot.weight(w)
    rows = w.raw.reshape(16, 2, 144)
    assert iw.raw.shape == (2, 2 * 1152) and iw.kernel is int8dot._mv_q4_kx8
    for g, b, i in np.ndindex(2, 2, 8):
        assert bytes(iw.raw[g, 1152 * b + 144 * i : 1152 * b + 144 * (i + 1)]) == bytes(rows[8 * g + i, b])


@pytest.mark.parametrize(
    "t, rows, cols", [(T.Q4_0, 8, 32), (T.Q4_0, 24, 256), (T.Q4_0, 64, 576), (T.Q4_K, 8, 256), (T.Q4_K, 24, 768)]
)
@pytest.mark.parametrize("n_rows", [1, 2, 5, 9])
def test_products_equal_the_row_kernel_and_the_replay(t, rows, cols, n_rows):
    """Every kernel variant: Q4_0's gemv/gemm (one kernel), Q4_K's gemm rows (T - T % 4) and gemv rows."""
    rng = np.random.default_rng(rows * 7 + n_rows)
    w = random_weight(t, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    got = int8dot.linear(x, int8dot.weight(w), threads=2)
    assert_bitwise(got, int8dot.linear(x, int8dot.weight(w, interleave=False), threads=2))
    assert_bitwise(got, replay(x, w))


def test_other_types_and_shapes_keep_the_gguf_rows():
    rng = np.random.default_rng(1)
    for t, rows in ((T.Q4_0, 12), (T.Q8_0, 12), (T.Q6_K, 16)):
        w = random_weight(t, rows, 256, rng)
        iw = int8dot.weight(w)
        assert int8dot.interleaved(iw) is None and iw.raw.shape == (rows, w.raw.size // rows)


def _mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef":
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_file_pages_are_released_after_the_copy(tmp_path):
    """A 4.5 MiB Q4_0 weight read from a file map: resident once touched, released by the copy, products as
    from the map."""
    rng = np.random.default_rng(2)
    w = random_weight(T.Q4_0, 1024, 8192, rng)
    path = tmp_path / "w.bin"
    path.write_bytes(w.raw.tobytes())
    with path.open("rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = QuantTensor("w", T.Q4_0, w.shape, np.frombuffer(mm, np.uint8))
    x = activations(rng, 1, 8192)
    want = int8dot.linear(x, int8dot.weight(mapped, interleave=False), threads=2)  # touches every page
    assert _mapped_rss_kib(path) >= 4 * 1024
    iw = int8dot.weight(mapped)
    assert _mapped_rss_kib(path) < 64
    assert_bitwise(int8dot.linear(x, iw, threads=2), want)
