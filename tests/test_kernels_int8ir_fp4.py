"""The FP4 intrinsics (`ggufpy/kernels/int8ir_fp4.py`) equal the NumPy replays of ggml's x86 kernels
(`quants/x86/mxfp4.py`, `nvfp4.py`, through `vecdot.linear_x86`) bit for bit: random valid blocks, T = 1, 3,
8, 17, row counts that are and are not multiples of 8 (MXFP4 repacked or vec_dot), odd and even block counts."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.constants import GGMLType as T
from ggufpy.quants import vecdot
from ggufpy.quants.lowbit import UE4M3_HALF, e8m0_to_fp32_half
from ggufpy.weights import QuantTensor

pytest.importorskip("numba")
from ggufpy.kernels import _numba, int8dot

pytestmark = pytest.mark.skipif(_numba.DISABLED or not int8dot.AVAILABLE, reason="no numba JIT or no AVX2")

if int8dot.AVAILABLE:
    from ggufpy.kernels import int8ir_fp4, int8ir_fp4_x8


def random_weight(t: T, rows: int, cols: int, rng: np.random.Generator, e_range=(100, 133)) -> QuantTensor:
    """Random blocks: every nibble pattern; MXFP4 exponents in e_range, NVFP4 scale bytes all 256 codes."""
    _, size, block, _ = int8ir_fp4.KERNELS[t]
    n = rows * cols // block
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if t == T.MXFP4:
        b[:, 0] = rng.integers(*e_range, n)
    return QuantTensor("w", t, (rows, cols), b.reshape(-1))


def activations(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Rows of assorted magnitudes, a zero row (d = 0 blocks) and outliers."""
    x = rng.standard_normal((rows, cols)) * rng.choice([1e-3, 0.1, 1.0, 8.0], size=(rows, 1))
    if rows > 1:
        x[1] = 0.0
    if rows > 2:
        x[2, :: max(1, cols // 7)] *= 300.0
    return x.astype(np.float32)


def product(x: np.ndarray, w: QuantTensor, threads: int) -> np.ndarray:
    fmt, size, block, kernel = int8ir_fp4.KERNELS[w.type]
    rows, cols = w.shape
    raw = np.asarray(w.raw).view(np.uint8).reshape(rows, cols // block * size)
    a = int8dot.quantize(x, fmt)
    out = np.empty((x.shape[0], rows), np.float32)
    kernel(threads, raw, a.q, a.d, a.s, a.asum, out)
    return out


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, f"{bad.size}/{want.size} differ, e.g. {got.flat[bad[:4]]} vs {want.flat[bad[:4]]}"


SHAPES = [
    (1, 40, 288, 1),
    (3, 36, 2880, 2),
    (8, 24, 256, 2),
    (17, 13, 320, 1),
    (1, 13, 2880, 1),
    (16, 16, 64, 2),
    (17, 24, 96, 2),
    (3, 8, 32, 1),
]


@pytest.mark.parametrize(("n_rows", "rows", "cols", "threads"), SHAPES)
def test_mxfp4_equals_the_replay(n_rows, rows, cols, threads):
    """rows % 8 == 0 (the repacked gemv / gemm) and != 0 (vec_dot); 9, 90 blocks (odd: the scalar last block),
    8, 10, 2 blocks (even)."""
    rng = np.random.default_rng([n_rows, rows, cols])
    w = random_weight(T.MXFP4, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
    assert np.isfinite(want).all()
    assert_bitwise(product(x, w, threads), want)


@pytest.mark.parametrize(("n_rows", "rows", "cols"), [(1, 40, 288), (3, 24, 2880), (8, 16, 64), (17, 8, 96)])
def test_mxfp4_eight_row_groups_equal_the_replay(n_rows, rows, cols):
    """The grouped copy (`int8ir_fp4_x8`, expert stacks) gives the repacked gemv / gemm's values bit for bit."""
    rng = np.random.default_rng([n_rows, rows, cols, 8])
    w = random_weight(T.MXFP4, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    raw = np.asarray(w.raw).reshape(rows, -1)
    grouped = int8ir_fp4_x8.interleave_mxfp4(raw)
    assert grouped.shape == (rows // 8, cols // 32 * 136)
    a = int8dot.quantize(x, "Q8_0")
    out = np.empty((n_rows, rows), np.float32)
    int8ir_fp4_x8.mxfp4x8_kernel(2, grouped, a.q, a.d, a.s, a.asum, out)
    assert_bitwise(out, vecdot.linear_x86(x, w.raw, w.type, w.shape))


@pytest.mark.parametrize("rows", [16, 13])
@pytest.mark.parametrize("top", [256, 24])
def test_mxfp4_extreme_exponents(rows, top):
    """Every E8M0 byte: subnormal scales (e < 2), products below 2^-126 (the f32 rounding of d_w * d_a; rows
    of only such blocks with top = 24) and overflow to inf / nan, as the replay propagates them."""
    rng = np.random.default_rng(rows)
    w = random_weight(T.MXFP4, rows, 21 * 32, rng, e_range=(0, top))
    blocks = np.asarray(w.raw).reshape(-1, 17)
    blocks[:top, 0] = np.arange(top)  # each exponent at least once
    x = activations(rng, 5, w.shape[1])
    with np.errstate(all="ignore"):
        want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
    assert_bitwise(product(x, w, 1), want)
    if rows % 8 == 0:  # the eight-row groups too
        a, out = int8dot.quantize(x, "Q8_0"), np.empty_like(want)
        grouped = int8ir_fp4_x8.interleave_mxfp4(np.asarray(w.raw).reshape(rows, -1))
        int8ir_fp4_x8.mxfp4x8_kernel(1, grouped, a.q, a.d, a.s, a.asum, out)
        assert_bitwise(out, want)


@pytest.mark.parametrize(("n_rows", "rows", "cols", "threads"), SHAPES)
def test_nvfp4_equals_the_replay(n_rows, rows, cols, threads):
    """Every UE4M3 scale byte (0x7F is 0), every nibble; row counts as for MXFP4 (NVFP4 runs its vec_dot)."""
    rng = np.random.default_rng([n_rows, rows, cols, 4])
    cols = cols // 64 * 64 or 64
    w = random_weight(T.NVFP4, rows, cols, rng)
    x = activations(rng, n_rows, cols)
    want = vecdot.linear_x86(x, w.raw, w.type, w.shape)
    assert np.isfinite(want).all()
    assert_bitwise(product(x, w, threads), want)


def test_scale_tables_cover_every_byte():
    """The tables the replays read, over every byte: what the IR's bit formulas must match (checked through
    one-block weights whose values are all 1: y = the scale times the activation sum)."""
    x = np.ones((1, 64), np.float32)  # q = 127 everywhere, d_a = fp16(1/127)
    a = int8dot.quantize(x, "Q8_0")
    for t, table, codes in ((T.MXFP4, e8m0_to_fp32_half(np.arange(256)), 0x22), (T.NVFP4, UE4M3_HALF, 0x22)):
        _, size, block, kernel = int8ir_fp4.KERNELS[t]
        raw = np.full((256, 64 // block * size), codes, np.uint8)  # code 2: value 2 (E2M1 1.0, doubled)
        if t == T.MXFP4:
            raw[:, 0] = raw[:, 17] = np.arange(256)
        else:
            raw[:, :4] = np.arange(256)[:, None]
        out = np.empty((1, 256), np.float32)
        with np.errstate(all="ignore"):
            kernel(1, raw, a.q, a.d, a.s, a.asum, out)
            want = vecdot.linear_x86(x, raw.reshape(-1), t, (256, 64))
        assert_bitwise(out, want)
        finite = np.isfinite(table * np.float32(a.d[0, 0]))
        assert np.unique(table[finite]).size > 100


# -- gpt-oss's MXFP4 experts: a decoded token's experts in one call, over the mapped file --------------------------
@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """The gpt_oss_mxfp4 fixture's shape (MXFP4 experts, 32 wide, dim 64) with Q8_0 elsewhere (integer kernels
    on both backends: F32 weights are BLAS products on the numba backend, not ggml's sums)."""
    from dataclasses import replace

    from conformance.fixtures_moe import GPT_OSS_FIXTURES, write_tiny_moe

    spec = replace(
        GPT_OSS_FIXTURES["gpt_oss_mxfp4"],
        types={"embd": T.Q8_0, "output": T.Q8_0, "attn": T.Q8_0, "ffn": T.MXFP4},
    )
    return write_tiny_moe(tmp_path_factory.mktemp("fp4") / "gpt_oss_mxfp4_q8.gguf", spec), spec.n_layers


def _generate(model, tokens: np.ndarray, n_decode: int) -> list[np.ndarray]:
    cache = model.new_cache(len(tokens) + n_decode)
    out = [model.forward(tokens, 0, cache, last_only=True)]
    for i in range(n_decode):
        out.append(model.forward(tokens[i : i + 1], len(tokens) + i, cache, last_only=True))
    return out


def test_gpt_oss_mxfp4_experts_decode_in_one_call_from_the_file(gpt_oss_mxfp4, monkeypatch):
    """Decode: gate and up of the routed experts in one kernel call, down in another, straight from the mapped
    GGUF rows (the stack is a view: no copy); prefill and decode logits equal the NumPy replay bit for bit."""
    import ggufpy
    from ggufpy.kernels import experts

    path, n_layers = gpt_oss_mxfp4
    tokens = np.random.default_rng(5).integers(3, 200, 40)
    ref = _generate(ggufpy.load(path, backend="numpy", tokenizer=False, numerics="llamacpp"), tokens, 3)
    calls = []
    stacked = experts.mul_mat_id
    monkeypatch.setattr(experts, "mul_mat_id", lambda *a, **kw: calls.append(len(a[0])) or stacked(*a, **kw))
    model = ggufpy.load(path, backend="numba", tokenizer=False, numerics="llamacpp", threads=2)
    ours = _generate(model, tokens, 3)
    for a, b in zip(ours, ref, strict=True):
        assert_bitwise(a, b)
    assert calls == [2, 1] * n_layers * 3
    layer = model.weights.layers[0]
    for et in (layer.ffn_gate_exps, layer.ffn_up_exps, layer.ffn_down_exps):
        stack = model.backend.expert_stack(et)
        assert stack.w.nbytes == sum(e.raw.nbytes for e in et.experts)  # 1.0x the type's bytes
        for e, expert in enumerate(et.experts):  # one copy: the experts' integer forms are its parts
            raw = np.asarray(expert.raw).view(np.uint8).reshape(et.shape[1], -1)
            assert np.array_equal(stack.w[e], int8ir_fp4_x8.interleave_mxfp4(raw))
            assert np.shares_memory(model.backend.int8_weight(expert).raw, stack.w[e])
