"""ggufpy.quants.x86.repack against ggml's own repacked Q4_K / Q2_K gemm and gemv (libggml-cpu.so via ctypes).

The oracle replays what llama.cpp does for a MUL_MAT on a weight in the CPU_REPACK buffer (ggml-cpu/repack.cpp
`tensor_traits<block_q*_K, 8, 8, GGML_TYPE_Q8_K>::forward_mul_mat`): the weight rows are interleaved eight at a
time (`make_block_q4_Kx8` / `make_block_q2_Kx8`, ported below), the first T - T%4 activation rows are quantized
four at a time by `ggml_quantize_mat_t<8, GGML_TYPE_Q8_K>` and multiplied by `gemm`, each remaining row is
quantized by the Q8_K `from_float` and multiplied by `gemv`. Both templates are exported C++ symbols. A weight
with out % 8 != 0 is not repacked: that oracle is the plain `vec_dot` (conformance.llamacpp.ggml_cpu_matmul).

Regenerate the golden (tests/data/x86/repack.npz) with `python tests/test_x86_repack.py`.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ggufpy.constants import GGMLType
from ggufpy.quants import quant_type
from ggufpy.quants.vecdot import quantize_activations
from ggufpy.quants.x86.repack import KERNELS, matmul_q2_k, matmul_q4_k

GOLDEN = Path(__file__).parent / "data" / "x86" / "repack.npz"
QK_K = 256
_Q8K_X4_BYTES = 16 + 4 * QK_K + 2 * 64  # block_q8_Kx4: f32 d[4], i8 qs[1024], i16 bsums[64]
_MANGLED = {  # ggml::cpu::repack::{gemm,gemv}<block_q*_K, 8, 8, GGML_TYPE_Q8_K>(int, float*, size_t, const void*, ...)
    (GGMLType.Q4_K, "gemm"): "_ZN4ggml3cpu6repack4gemmI10block_q4_KLl8ELl8EL9ggml_type15EEEviPfmPKvS7_ii",
    (GGMLType.Q4_K, "gemv"): "_ZN4ggml3cpu6repack4gemvI10block_q4_KLl8ELl8EL9ggml_type15EEEviPfmPKvS7_ii",
    (GGMLType.Q2_K, "gemm"): "_ZN4ggml3cpu6repack4gemmI10block_q2_KLl8ELl8EL9ggml_type15EEEviPfmPKvS7_ii",
    (GGMLType.Q2_K, "gemv"): "_ZN4ggml3cpu6repack4gemvI10block_q2_KLl8ELl8EL9ggml_type15EEEviPfmPKvS7_ii",
}
_QUANTIZE_MAT = {  # ggml_quantize_mat_t<INTER_SIZE, GGML_TYPE_Q8_K>(const float*, void*, int64_t, int64_t)
    8: "_Z19ggml_quantize_mat_tILl8EL9ggml_type15EEvPKfPvll",  # the one the 8x8 Q4_K / Q2_K paths use
    4: "_Z19ggml_quantize_mat_tILl4EL9ggml_type15EEvPKfPvll",
}


# -- the repacked weight layouts (ggml-cpu/repack.cpp, ggml-cpu/repack.h) ----------------------------------------


def make_blocks_q4_Kx8(rows: np.ndarray) -> np.ndarray:
    """`repack_q4_K_to_q4_K_8_bl` with interleave 8: Q4_K rows u8 (out, nb*144) -> block_q4_Kx8 u8 (out/8*nb, 1152).

    block_q4_Kx8: fp16 d[8], fp16 dmin[8], u8 scales[96], u8 qs[1024]; block x of row group g holds block x of
    rows 8g..8g+7 (`make_block_q4_Kx8`)."""
    out = rows.shape[0]
    nb = rows.shape[1] // 144
    b = rows.reshape(out // 8, 8, nb, 144).transpose(0, 2, 1, 3)  # [group, x, i = row in group, byte]
    d, dmin, sc, qs = b[..., 0:2], b[..., 2:4], b[..., 4:16].astype(np.int32), b[..., 16:144]
    # qs: dst chunk i (8 bytes) = row i % 8, source bytes (i / 8) * 8 ...
    qs_x8 = qs.reshape(*qs.shape[:2], 8, 16, 8).transpose(0, 1, 3, 2, 4)
    # scales: twelve bytes per sub-block index (0..3 from the first loop, 4..7 from the second), each holding
    # the 6-bit scales and mins of the eight rows, packed like a Q4_K's own 12 bytes
    s_lo, m_lo = sc[..., 0:4] & 63, sc[..., 4:8] & 63  # [group, x, row, i]
    s_hi = ((sc[..., 0:4] & 192) >> 2) | (sc[..., 8:12] & 15)
    m_hi = ((sc[..., 4:8] & 192) >> 2) | ((sc[..., 8:12] & 240) >> 4)

    def pack(s, m):  # s, m [group, x, row j, i] -> [group, x, i, 12]
        s, m = np.moveaxis(s, 2, 3), np.moveaxis(m, 2, 3)  # [group, x, i, j]
        return np.concatenate(
            [
                (s[..., 0:4] & 63) + ((s[..., 4:8] & 48) << 2),
                (m[..., 0:4] & 63) + ((m[..., 4:8] & 48) << 2),
                (s[..., 4:8] & 15) + ((m[..., 4:8] & 15) << 4),
            ],
            axis=-1,
        )

    scales = np.concatenate([pack(s_lo, m_lo), pack(s_hi, m_hi)], axis=2).astype(np.uint8)  # [group, x, 8, 12]
    parts = [d, dmin, scales, qs_x8]
    flat = [p.reshape(out // 8 * nb, -1) for p in parts]
    return np.ascontiguousarray(np.concatenate(flat, axis=1))


def make_blocks_q2_Kx8(rows: np.ndarray) -> np.ndarray:
    """`repack_q2_K_to_q2_K_8_bl`: Q2_K rows u8 (out, nb*84) -> block_q2_Kx8 u8 (out/8*nb, 672).

    block_q2_Kx8: fp16 d[8], fp16 dmin[8], u8 scales[128], u8 qs[512] (`make_block_q2_Kx8`)."""
    out = rows.shape[0]
    nb = rows.shape[1] // 84
    b = rows.reshape(out // 8, 8, nb, 84).transpose(0, 2, 1, 3)  # [group, x, row, byte]
    sc, qs, d, dmin = b[..., 0:16], b[..., 16:80], b[..., 80:82], b[..., 82:84]
    qs_x8 = qs.reshape(*qs.shape[:2], 8, 8, 8).transpose(0, 1, 3, 2, 4)
    i = np.arange(128)
    scales = sc[:, :, (i % 16) // 2, (i // 16) * 2 + i % 2]  # out.scales[i] = in[(i%16)/2].scales[(i/16)*2 + i%2]
    flat = [p.reshape(out // 8 * nb, -1) for p in (d, dmin, scales, qs_x8)]
    return np.ascontiguousarray(np.concatenate(flat, axis=1))


_REPACK = {GGMLType.Q4_K: make_blocks_q4_Kx8, GGMLType.Q2_K: make_blocks_q2_Kx8}


# -- the oracle -------------------------------------------------------------------------------------------------


def _ggml():
    from conformance import llamacpp

    cpu = llamacpp._ggml_cpu()
    cpu.ggml_cpu_init.restype = None
    cpu.ggml_cpu_init()  # fills the fp16 tables and the CPU feature flags the kernels rely on
    return llamacpp, cpu


def _kernel(cpu, name: str):
    fn = getattr(cpu, name)
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_int, ctypes.c_int]
    return fn


def ggml_quantize_mat(x: np.ndarray, inter: int = 8) -> np.ndarray:
    """`ggml_quantize_mat_t<inter, GGML_TYPE_Q8_K>` on 4 rows: f32 (4, n) -> block_q8_Kx4 u8 (n/256, 1168)."""
    _, cpu = _ggml()
    fn = getattr(cpu, _QUANTIZE_MAT[inter])
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[1] // QK_K, _Q8K_X4_BYTES), np.uint8)
    fn(x.ctypes.data, out.ctypes.data, 4, x.shape[1])
    return out


def unpack_q8_Kx4(blocks: np.ndarray, inter: int = 8) -> np.ndarray:
    """block_q8_Kx4 u8 (nb, 1168) -> the four rows as standard block_q8_K u8 (4, nb*292).

    qs: `inter` bytes of row 0, of row 1, .. row 3, then the next `inter` bytes of each row. bsums: group g of
    16 quants of row r is at (g/4)*16 + r*4 + g%4 (`ggml_quantize_mat_q8_K_4x8_generic`)."""
    nb = blocks.shape[0]
    d = blocks[:, :16].reshape(nb, 4, 4).transpose(1, 0, 2)  # [row, block, 4 bytes]
    qs = blocks[:, 16:1040].reshape(nb, QK_K // inter, 4, inter).transpose(2, 0, 1, 3).reshape(4, nb, QK_K)
    bs = blocks[:, 1040:].reshape(nb, 4, 4, 4, 2).transpose(2, 0, 1, 3, 4).reshape(4, nb, 32)
    return np.concatenate([d, qs, bs], axis=2).reshape(4, nb * 292)


def ggml_repacked_matmul(w_rows: np.ndarray, w_type: GGMLType, x: np.ndarray, col_chunks=(0,)):
    """llama.cpp's repacked MUL_MAT of Q4_K / Q2_K weight rows u8 (out, row_bytes) by f32 activations (T, in).

    `col_chunks`: start columns (multiples of 8) of the output chunks the threads would hand to
    `forward_mul_mat_one_chunk`. Returns (y f32 (T, out), the standard Q8_K activation rows u8 (T, in/256*292)
    our emulation takes)."""
    llamacpp, cpu = _ggml()
    x = np.ascontiguousarray(x, np.float32)
    T, n = x.shape
    out = w_rows.shape[0]
    nb = n // QK_K
    vx = _REPACK[w_type](np.ascontiguousarray(w_rows))
    acts = quantize_activations(x, GGMLType.Q8_K)
    _, ref_acts, _ = llamacpp.ggml_cpu_matmul(w_rows[:8], w_type, x)  # ggml's own from_float, to cross-check
    assert np.array_equal(acts, ref_acts)
    n_gemm = T - T % 4
    mat = np.concatenate([ggml_quantize_mat(x[r : r + 4]) for r in range(0, n_gemm, 4)]) if n_gemm else None
    gemm, gemv = _kernel(cpu, _MANGLED[w_type, "gemm"]), _kernel(cpu, _MANGLED[w_type, "gemv"])
    y = np.full((T, out), np.nan, np.float32)
    bounds = [*col_chunks, out]
    group_bytes = nb * vx.shape[1]  # one group of 8 interleaved rows
    for c0, c1 in itertools.pairwise(bounds):
        wptr = vx.ctypes.data + c0 // 8 * group_bytes
        if n_gemm:  # forward_mul_mat_one_chunk: "if (nrows > 3) gemm(...)" on nrows - nrows % 4 rows
            gemm(n, y.ctypes.data + 4 * c0, out, wptr, mat.ctypes.data, n_gemm, c1 - c0)
        for t in range(n_gemm, T):
            gemv(n, y[t].ctypes.data + 4 * c0, out, wptr, acts[t].ctypes.data, 1, c1 - c0)
    return y, acts


# -- test data ------------------------------------------------------------------------------------------------


def weight_rows(rng: np.random.Generator, w_type: GGMLType, out: int, n: int) -> np.ndarray:
    """ggml-quantized rows of assorted scale: normal data, some all-zero rows and blocks, outliers."""
    from conformance.llamacpp import ggml_quantize

    w = rng.standard_normal((out, n)).astype(np.float32) * (10.0 ** rng.uniform(-3, 2, (out, 1))).astype(np.float32)
    w[rng.random(out) < 0.1] = 0.0  # whole rows of zeros
    w[:, :QK_K][rng.random(out) < 0.1] = 0.0  # a zero super-block
    spikes = rng.random((out, n)) < 0.003
    w[spikes] *= 1000.0  # large dynamic range within a block
    positive = rng.random(out) < 0.2
    w[positive] = np.abs(w[positive])  # rows with no negative weight
    return ggml_quantize(w, w_type)


def activations(rng: np.random.Generator, T: int, n: int) -> np.ndarray:
    x = rng.standard_normal((T, n)).astype(np.float32) * (10.0 ** rng.uniform(-2, 2, (T, 1))).astype(np.float32)
    x[rng.random(T) < 0.15, :QK_K] = 0.0  # an all-zero activation block (d = 0)
    for t in range(T):  # an absmax that occurs as both +m and -m (-m first): the 4x8 quantizer flips the sign
        if rng.random() < 0.3:
            m = np.abs(x[t, :QK_K]).max() * 1.5
            x[t, 5], x[t, 200] = -m, m
    return x


TYPES = [GGMLType.Q4_K, GGMLType.Q2_K]
MATMUL = {GGMLType.Q4_K: matmul_q4_k, GGMLType.Q2_K: matmul_q2_k}


def _compare(ours: np.ndarray, ref: np.ndarray) -> str:
    bad = np.argwhere(ours.view(np.uint32) != ref.view(np.uint32))
    return f"{len(bad)} of {ref.size} differ, first (t, o) at {bad[:5].tolist()}"


# -- tests against the live library -----------------------------------------------------------------------------


@pytest.mark.parametrize("w_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 3, 4, 5, 8, 17, 20])
@pytest.mark.parametrize("shape", [(8, 256), (24, 512), (64, 1536), (40, 768)])
def test_matches_ggml(w_type, T, shape):
    pytest.importorskip("llama_cpp")
    out, n = shape
    rng = np.random.default_rng([int(w_type), T, out, n])
    w = weight_rows(rng, w_type, out, n)
    y_ref, acts = ggml_repacked_matmul(w, w_type, activations(rng, T, n))
    y = MATMUL[w_type](w, acts)
    assert y.dtype == np.float32 and y.shape == (T, out)
    assert np.array_equal(y.view(np.uint32), y_ref.view(np.uint32)), _compare(y, y_ref)


@pytest.mark.parametrize("w_type", TYPES, ids=lambda t: t.name)
def test_column_chunks_do_not_matter(w_type):
    """Threads hand the kernels 8-aligned column ranges (16-column AVX-512 pairs plus an 8-column AVX2 tail)."""
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(7)
    w = weight_rows(rng, w_type, 56, 512)
    x = activations(rng, 9, 512)
    y_whole, acts = ggml_repacked_matmul(w, w_type, x)
    y_chunked, _ = ggml_repacked_matmul(w, w_type, x, col_chunks=(0, 8, 32, 40))
    assert np.array_equal(y_whole.view(np.uint32), y_chunked.view(np.uint32))
    assert np.array_equal(MATMUL[w_type](w, acts), y_whole)


def test_quantize_mat_4x8_is_quantize_row_q8_K_up_to_sign():
    """`ggml_quantize_mat_t<8, Q8_K>` (the AVX2 `ggml_quantize_mat_q8_K_4x8`) gives the reference Q8_K block,
    except that when +max and -max both occur (-max first) d, quants and bsums come out negated."""
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(3)
    n_same = n_negated = 0
    for _ in range(50):
        x = activations(rng, 4, 1024)
        got = unpack_q8_Kx4(ggml_quantize_mat(x)).reshape(4 * 4, 292)
        ref = quantize_activations(x, GGMLType.Q8_K).reshape(4 * 4, 292)
        for g, r in zip(got, ref, strict=True):
            if np.array_equal(g, r):
                n_same += 1
                continue
            d_g, d_r = g[:4].view("<f4")[0], r[:4].view("<f4")[0]
            assert d_g == -d_r
            assert np.array_equal(g[4:260].view(np.int8), -r[4:260].view(np.int8))
            assert np.array_equal(g[260:].view("<i2"), -r[260:].view("<i2"))
            n_negated += 1
    assert n_same and n_negated


def test_quantize_mat_4x4_rounds_the_exact_product():
    """`ggml_quantize_mat_t<4, Q8_K>` (generic C, not used by the 8x8 Q4_K / Q2_K paths): same d, but GCC
    contracted `nearest_int(x * iscale)` = (x * iscale + 1.5 * 2^23) into an FMA, so a product whose f32 rounding
    lands on a half-integer rounds by its exact value instead of ties-to-even (quants and bsums differ)."""
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(4)
    x = np.round(rng.standard_normal((4, 1024)) * 10).astype(np.float32)  # integers: many exact .5 products
    got = unpack_q8_Kx4(ggml_quantize_mat(x, inter=4), inter=4).reshape(16, 292)
    ref = quantize_activations(x, GGMLType.Q8_K).reshape(16, 292)
    assert np.array_equal(got[:, :4], ref[:, :4])  # d
    xb = x.reshape(16, 256)
    iscale = np.float32(-127) / xb[np.arange(16), np.abs(xb).argmax(axis=1)]  # max: the first largest |x|
    exact = xb.astype(np.float64) * iscale[:, None].astype(np.float64)
    magic = 12582912.0  # 1.5 * 2^23: adding it (once, after the exact product) rounds to an integer
    want = (exact + magic).astype(np.float32).astype(np.float64) - magic
    assert np.array_equal(got[:, 4:260].view(np.int8), want)
    assert not np.array_equal(got[:, 4:260], ref[:, 4:260])


@pytest.mark.parametrize("w_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 4, 5, 17])
@pytest.mark.parametrize("shape", [(1, 256), (3, 512), (13, 1536), (30, 768)])
def test_unrepacked_rows_match_ggml_vec_dot(w_type, T, shape):
    """out % 8 != 0: llama.cpp leaves the weight alone and mul_mat calls ggml_vec_dot_q*_K_q8_K per element."""
    pytest.importorskip("llama_cpp")
    from conformance.llamacpp import ggml_cpu_matmul

    out, n = shape
    rng = np.random.default_rng([int(w_type), T, out, n, 1])
    w = weight_rows(rng, w_type, out, n)
    y_ref, acts, _ = ggml_cpu_matmul(w, w_type, activations(rng, T, n))
    y = MATMUL[w_type](w, acts)
    assert np.array_equal(y.view(np.uint32), y_ref.view(np.uint32)), _compare(y, y_ref)


# -- the golden (no llama_cpp needed) ------------------------------------------------------------------------------

GOLDEN_CASES = [  # (type, out, n, T): repacked gemm + gemv, 16-row gemm + gemv, and plain vec_dot (out % 8)
    (GGMLType.Q4_K, 24, 512, 7),
    (GGMLType.Q4_K, 16, 256, 17),
    (GGMLType.Q4_K, 13, 768, 5),
    (GGMLType.Q2_K, 24, 512, 7),
    (GGMLType.Q2_K, 16, 256, 17),
    (GGMLType.Q2_K, 13, 768, 5),
]


def test_golden():
    data = np.load(GOLDEN)
    for i, (w_type, out, _, T) in enumerate(GOLDEN_CASES):
        w, a, y_ref = data[f"w{i}"], data[f"a{i}"], data[f"y{i}"]
        assert int(data[f"type{i}"]) == int(w_type) and w.shape[0] == out and y_ref.shape == (T, out)
        y = KERNELS[w_type](w, a)
        assert np.array_equal(y.view(np.uint32), y_ref.view(np.uint32)), _compare(y, y_ref)


@pytest.mark.slow
@pytest.mark.parametrize("w_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out", [1536, 1530])
def test_speed(w_type, out):
    """T=100 rows against 1536 x 512: the repacked path (out % 8 == 0) and the vec_dot path."""
    rng = np.random.default_rng(0)
    n, T = 512, 100
    qt = quant_type(w_type)
    w = rng.integers(0, 256, (out, qt.row_bytes(n)), dtype=np.uint8)
    d_at = {GGMLType.Q4_K: 0, GGMLType.Q2_K: 80}[w_type]  # sane fp16 d and dmin instead of random bits
    w.reshape(out, -1, qt.type_size)[..., d_at : d_at + 4] = np.float16([0.01, 0.001]).view(np.uint8)
    a = quantize_activations(rng.standard_normal((T, n)).astype(np.float32), GGMLType.Q8_K)
    t0 = time.perf_counter()
    MATMUL[w_type](w, a)
    assert time.perf_counter() - t0 < 1.0


def record_golden(path: Path = GOLDEN) -> None:
    rng = np.random.default_rng(20250101)
    arrays = {}
    for i, (w_type, out, n, T) in enumerate(GOLDEN_CASES):
        w = weight_rows(rng, w_type, out, n)
        x = activations(rng, T, n)
        if out % 8:
            from conformance.llamacpp import ggml_cpu_matmul

            y, acts, _ = ggml_cpu_matmul(w, w_type, x)
        else:
            y, acts = ggml_repacked_matmul(w, w_type, x)
        arrays.update({f"type{i}": np.int32(w_type), f"w{i}": w, f"a{i}": acts, f"y{i}": y})
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `conformance`
    record_golden()
