"""Bit-exactness of `ggufpy.quants.x86.attention` (llama.cpp's non-flash attention on x86) against llama.cpp.

Two oracles:
- llama.cpp itself running a fixture model (`conformance.llamacpp.LlamaCpp`): its captured `Qcur-N`, `Kcur-N`,
  `Vcur-N` go into `attention_parts`, whose kq, kq_soft_max and kqv_out must equal llama.cpp's `kq-N` (or
  `kq_scaled_2-N` after gemma2's softcap), `kq_soft_max-N` and `kqv_out-N` bit for bit: prompts of 1, 7, 100
  and 300 tokens (300 > 256 makes n_kv 512), and a prompt followed by single-token (and small batch) steps;
- `ggml_attention`, the same ggml ops as `build_attn_mha` (mul_mat of the permuted f16 K by the permuted
  f32 Q, the softcap's scale/tanh/scale, soft_max_ext with an f32 mask, mul_mat of the transposed f16 V, the
  permute + cont) in a ggml graph computed by `ggml_graph_compute_with_ctx`, for random shapes and
  magnitudes the fixtures do not reach (E = 64, 80, 128; scores spread enough that exp underflows).
Plus ggml's exported `ggml_vec_soft_max_f32` for the exp and the double sum alone, and glibc's `tanhf`.

Those need llama-cpp-python and compare with the replay of the build it was compiled for (`HOST`: AVX-512 or
AVX2). `test_golden` replays a recording of llama.cpp's outputs (AVX-512 build) without it. Record it again
(after a llama.cpp upgrade, on an AVX-512 machine) with `python tests/test_x86_attention.py`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufpy.quants.x86.attention import attention, attention_parts, n_kv_cells, vec_soft_max_f32
from ggufpy.quants.x86.unary import V_EXPF, tanhf_glibc

GOLDEN = Path(__file__).parent / "data" / "x86" / "attention.npz"
FIXTURES = Path(__file__).parent.parent / "conformance" / "fixtures"
MODELS = ("f32", "q8_0", "gemma2_f32", "gemma3_f32", "qwen3_f32")

f32 = np.float32


def _host_isa() -> str:
    """The build the installed llama.cpp replays as (`conformance.llamacpp.host_isa`); AVX-512 without it."""
    try:
        from conformance.llamacpp import available, host_isa
    except ImportError:
        return "avx512"
    return host_isa() if available() else "avx512"


HOST = _host_isa()


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, f32), np.asarray(b, f32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _mismatches(a: np.ndarray, b: np.ndarray) -> int:
    return int((np.asarray(a, f32).view(np.uint32) != np.asarray(b, f32).reshape(a.shape).view(np.uint32)).sum())


# -- oracle 1: ggml ops in a ggml graph ---------------------------------------------------------------------------


class _InitParams(ctypes.Structure):
    """`struct ggml_init_params` (ggml.h)."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_LIBS = None
_F32, _F16 = 0, 1  # enum ggml_type


def _ggml():
    """(libggml-base, libggml-cpu) with the prototypes used here."""
    global _LIBS
    if _LIBS is not None:
        return _LIBS
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
    P, i64, i32, fl = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    protos = [
        (base.ggml_init, [_InitParams], P),
        (base.ggml_free, [P], None),
        (base.ggml_new_tensor_2d, [P, i32, i64, i64], P),
        (base.ggml_new_tensor_3d, [P, i32, i64, i64, i64], P),
        (base.ggml_permute, [P, P, i32, i32, i32, i32], P),
        (base.ggml_mul_mat, [P, P, P], P),
        (base.ggml_scale, [P, P, fl], P),
        (base.ggml_tanh, [P, P], P),
        (base.ggml_soft_max_ext, [P, P, P, fl, fl], P),
        (base.ggml_cont_2d, [P, P, i64, i64], P),
        (base.ggml_new_graph, [P], P),
        (base.ggml_build_forward_expand, [P, P], None),
        (base.ggml_get_data, [P], P),
        (base.ggml_nbytes, [P], ctypes.c_size_t),
        (cpu.ggml_cpu_init, [], None),
        (cpu.ggml_graph_compute_with_ctx, [P, P, i32], i32),
        (cpu.ggml_vec_soft_max_f32, [i32, P, P, fl], ctypes.c_double),
    ]
    for fn, argtypes, restype in protos:
        fn.argtypes, fn.restype = argtypes, restype
    cpu.ggml_cpu_init()
    _LIBS = base, cpu
    return _LIBS


def _set(base, t, a: np.ndarray) -> None:
    a = np.ascontiguousarray(a)
    assert base.ggml_nbytes(t) == a.nbytes
    ctypes.memmove(base.ggml_get_data(t), a.ctypes.data, a.nbytes)


def _get(base, t, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    buf = (ctypes.c_float * n).from_address(base.ggml_get_data(t))
    return np.frombuffer(buf, f32).reshape(shape).copy()


def ggml_attention(q, k, v, start, scale, window=None, softcap=None, n_threads=2) -> dict[str, np.ndarray]:
    """`build_attn_mha` (src/llama-graph.cpp, no flash attention) as a ggml graph, on a fresh f16 cache of
    n_kv_cells(S) cells holding positions 0..S-1: kq (H, T, n_kv) after the softcap, kq_soft_max, kqv_out."""
    base, cpu = _ggml()
    T, H, E = q.shape
    S, G, _ = k.shape
    n_kv = n_kv_cells(S)
    kc = np.zeros((n_kv, G, E), np.float16)  # the K cache: one row of G*E per cell
    kc[:S] = np.asarray(k, f32).astype(np.float16)
    vc = np.zeros((G, E, n_kv), np.float16)  # the transposed V cache: one row of cells per (group, channel)
    vc[:, :, :S] = np.asarray(v, f32).astype(np.float16).transpose(1, 2, 0)
    pos_q = start + np.arange(T)[:, None]
    pos_k = np.arange(n_kv)[None, :]
    hidden = (pos_k > pos_q) | (pos_k >= S)  # llama-kv-cache.cpp set_input_kq_mask: causal, empty cells
    if window is not None:
        hidden |= pos_q - pos_k >= window  # is_masked_swa, LLAMA_SWA_TYPE_STANDARD
    mask = np.where(hidden, -np.inf, 0).astype(f32)

    nbytes = 4 * (3 * H * T * n_kv + 2 * H * T * E) + 2 * (2 * G * E * n_kv + H * T * E) + mask.nbytes
    ctx = base.ggml_init(_InitParams(nbytes * 2 + (16 << 20), None, False))
    try:
        tk = base.ggml_new_tensor_3d(ctx, _F16, E, G, n_kv)
        tv = base.ggml_new_tensor_3d(ctx, _F16, n_kv, E, G)
        tq = base.ggml_new_tensor_3d(ctx, _F32, E, H, T)
        tm = base.ggml_new_tensor_2d(ctx, _F32, n_kv, T)
        for t, a in ((tk, kc), (tv, vc), (tq, np.asarray(q, f32)), (tm, mask)):
            _set(base, t, a)
        kq = base.ggml_mul_mat(ctx, base.ggml_permute(ctx, tk, 0, 2, 1, 3), base.ggml_permute(ctx, tq, 0, 2, 1, 3))
        if softcap:
            kq = base.ggml_scale(ctx, kq, f32(1) / f32(softcap))
            kq = base.ggml_tanh(ctx, kq)
            kq = base.ggml_scale(ctx, kq, f32(softcap))
        sm = base.ggml_soft_max_ext(ctx, kq, tm, f32(scale), 0.0)
        kqv = base.ggml_mul_mat(ctx, tv, sm)  # (E, T, H)
        out = base.ggml_cont_2d(ctx, base.ggml_permute(ctx, kqv, 0, 2, 1, 3), E * H, T)
        gf = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(gf, out)
        if cpu.ggml_graph_compute_with_ctx(ctx, gf, n_threads) != 0:
            raise RuntimeError("ggml_graph_compute_with_ctx failed")
        return {
            "kq": _get(base, kq, (H, T, n_kv)),
            "kq_soft_max": _get(base, sm, (H, T, n_kv)),
            "kqv_out": _get(base, out, (T, H * E)),
        }
    finally:
        base.ggml_free(ctx)


# -- oracle 2: llama.cpp running a fixture model --------------------------------------------------------------


def _config(name: str):
    from ggufpy import reader
    from ggufpy.config import config_from_metadata

    f = reader.open(FIXTURES / f"{name}.gguf")
    return config_from_metadata(f.metadata, vocab_size=f.tensors["token_embd.weight"].shape[0])


def _capture_names(cfg) -> set[str]:
    names = ("Qcur", "Kcur", "Vcur", "kq", "kq_scaled_2", "kq_soft_max", "kqv_out")
    return {f"{n}-{il}" for n in names for il in range(cfg.n_layers)}


def _capture_chunks(model, chunks: list[int], names: set[str], seed: int) -> list[tuple[int, dict]]:
    """Decode random tokens in ubatches of `chunks` sizes from an empty cache (the first a prompt, then e.g.
    single-token steps), capturing `names` at every step: [(start position, {name: tensor})]. Uses
    LlamaCpp's private `_decode` (its `run` resets the cache, `greedy` captures nothing)."""
    from conformance.llamacpp import _squeeze_leading

    rng = np.random.default_rng(seed)
    model._reset()
    steps, pos = [], 0
    for n in chunks:
        model._want, model._captured = (lambda name: name in names), {}
        try:
            model._decode([int(t) for t in rng.integers(0, model.n_vocab, n)], pos, all_logits=False)
        finally:
            model._want = None
        steps.append((pos, {name: _squeeze_leading(a, 2) for name, a in model._captured.items()}))
        pos += n
    return steps


def _layer_inputs(cfg, cap: dict, il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, dict]:
    """(q, k, v, scale, extra) of layer `il` from llama.cpp's captures, as ggufpy's transformer passes them:
    gemma scales Q in f32 by 1/sqrtf(E) (`ggml_scale(Qcur, f_attention_scale)`) and uses kq_scale 1; the
    others keep Q and use kq_scale = 1.0f/sqrtf(E), an f32 computation."""
    E = cfg.head_dim
    q = cap[f"Qcur-{il}"].reshape(-1, cfg.n_heads, E)
    k = cap[f"Kcur-{il}"].reshape(-1, cfg.n_kv_heads, E)
    v = cap[f"Vcur-{il}"].reshape(-1, cfg.n_kv_heads, E)
    inv_sqrt = f32(1) / np.sqrt(f32(E))
    q, scale = (q * inv_sqrt, f32(1)) if cfg.arch.scale_q else (q, inv_sqrt)
    extra = {"window": cfg.window(il), "softcap": cfg.attn_softcap}
    return q, k, v, scale, extra


def _compare_layer(cfg, cap: dict, il: int, parts: dict) -> dict[str, int]:
    kq_name = f"kq_scaled_2-{il}" if cfg.attn_softcap else f"kq-{il}"
    theirs = {"kq": cap[kq_name], "kq_soft_max": cap[f"kq_soft_max-{il}"], "kqv_out": cap[f"kqv_out-{il}"]}
    return {key: _mismatches(parts[key], theirs[key]) for key in theirs}


@pytest.fixture(scope="module")
def llama_models():
    pytest.importorskip("llama_cpp")
    from conformance.llamacpp import LlamaCpp

    models = {name: LlamaCpp(FIXTURES / f"{name}.gguf") for name in MODELS}
    yield models
    for m in models.values():
        m.close()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("T", [1, 7, 100, 300])
def test_prompt_vs_llamacpp(llama_models, name, T):
    """One prompt of T random tokens: every layer's kq, kq_soft_max and kqv_out equal llama.cpp's."""
    cfg = _config(name)
    _, cap = llama_models[name].run(np.random.default_rng(T).integers(0, cfg.vocab_size, T), _capture_names(cfg))
    for il in range(cfg.n_layers):
        q, k, v, scale, extra = _layer_inputs(cfg, cap, il)
        parts = attention_parts(q, k, v, 0, scale, **extra, isa=HOST)
        assert parts["kq"].shape[-1] == (256 if T <= 256 else 512)
        assert _compare_layer(cfg, cap, il, parts) == {"kq": 0, "kq_soft_max": 0, "kqv_out": 0}, f"layer {il}"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "chunks", [[50] + [1] * 8, [250] + [1] * 8, [50, 1, 7, 1, 3, 1]], ids=["50+1s", "250+1s", "mix"]
)
def test_incremental_vs_llamacpp(llama_models, name, chunks):
    """A prompt, then single-token (and small batch) steps on the growing cache: at each step the queries
    at positions start.. see keys 0..S-1 (250 + 8 steps crosses n_kv 256 -> 512)."""
    cfg = _config(name)
    steps = _capture_chunks(llama_models[name], chunks, _capture_names(cfg), seed=len(chunks))
    for il in range(cfg.n_layers):
        ks, vs = [], []
        for start, cap in steps:
            q, k, v, scale, extra = _layer_inputs(cfg, cap, il)
            ks.append(k)
            vs.append(v)
            parts = attention_parts(q, np.concatenate(ks), np.concatenate(vs), start, scale, **extra, isa=HOST)
            bad = _compare_layer(cfg, cap, il, parts)
            assert bad == {"kq": 0, "kq_soft_max": 0, "kqv_out": 0}, f"layer {il} start {start}"


# -- ggml graph: random shapes and magnitudes ---------------------------------------------------------------------


@st.composite
def _attention_case(draw):
    E = draw(st.sampled_from([16, 24, 64, 80, 128]))
    G = draw(st.sampled_from([1, 2]))
    H = G * draw(st.sampled_from([1, 2, 4]))
    T = draw(st.sampled_from([1, 2, 3, 5, 17]))
    start = draw(st.sampled_from([0, 1, 40, 250, 300]))
    window = draw(st.sampled_from([None, 4, 32]))
    softcap = draw(st.sampled_from([None, 5.0, 50.0]))
    spread = draw(st.sampled_from([0.1, 1.0, 4.0, 30.0]))  # 30: scores far apart, exp underflows to 0
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    S = start + T
    q = (rng.standard_normal((T, H, E)) * spread).astype(f32)
    k = (rng.standard_normal((S, G, E)) * spread).astype(f32)
    v = rng.standard_normal((S, G, E)).astype(f32)
    if draw(st.booleans()):
        k[rng.integers(0, S)] = 0  # a zero key: a score of exactly 0
    return q, k, v, start, f32(1) / np.sqrt(f32(E)), window, softcap


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=_attention_case())
def test_attention_vs_ggml_graph(case):
    pytest.importorskip("llama_cpp")
    q, k, v, start, scale, window, softcap = case
    ours = attention_parts(q, k, v, start, scale, window, softcap, isa=HOST)
    theirs = ggml_attention(q, k, v, start, scale, window, softcap)
    for key in ("kq", "kq_soft_max", "kqv_out"):
        assert _bits_equal(ours[key], theirs[key]), f"{key}: {_mismatches(ours[key], theirs[key])} differ"
    assert _bits_equal(attention(q, k, v, start, scale, window, softcap, isa=HOST), theirs["kqv_out"])


def test_attention_real_shape_vs_ggml_graph():
    """A real model's shape (E = 128, 32 query heads on 8 KV groups, T = 100, S = 300 -> n_kv 512), 1 thread
    and 2: the partition of the work between threads does not change any element."""
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(7)
    T, H, G, E, start = 100, 32, 8, 128, 200
    q = (rng.standard_normal((T, H, E)) * 2).astype(f32)
    k = (rng.standard_normal((start + T, G, E)) * 2).astype(f32)
    v = rng.standard_normal((start + T, G, E)).astype(f32)
    ours = attention_parts(q, k, v, start, f32(1) / np.sqrt(f32(E)), isa=HOST)
    for threads in (1, 2):
        theirs = ggml_attention(q, k, v, start, f32(1) / np.sqrt(f32(E)), n_threads=threads)
        for key in ("kq", "kq_soft_max", "kqv_out"):
            assert _bits_equal(ours[key], theirs[key]), f"{key} ({threads} threads)"


# -- the pieces: ggml_vec_soft_max_f32 and tanhf ------------------------------------------------------------------


@pytest.mark.parametrize("n", [16, 256, 512, 4096])
@pytest.mark.parametrize("spread", [0.5, 5.0, 60.0, 1e4])
def test_vec_soft_max_vs_ggml(n, spread):
    """ggml's exported `ggml_vec_soft_max_f32(n, y, x, max)`: y and the returned double sum, for rows whose
    exps span normal, subnormal (60: down to e^-200) and zero (1e4: |n| > 192) results, and masked -inf."""
    pytest.importorskip("llama_cpp")
    _, cpu = _ggml()
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((24, n)) * spread).astype(f32)
    x[3, rng.integers(0, n, n // 4)] = -np.inf
    x[5] = 0
    mx = x.max(axis=1)
    y, total = vec_soft_max_f32(x, mx, HOST)
    for r in range(x.shape[0]):
        yr = np.zeros(n, f32)
        s = cpu.ggml_vec_soft_max_f32(n, yr.ctypes.data, np.ascontiguousarray(x[r]).ctypes.data, float(mx[r]))
        assert _bits_equal(y[r], yr), f"row {r}: {_mismatches(y[r], yr)} of {n} differ"
        assert total[r] == s, f"row {r}"


def test_v_expf_vs_ggml_dense():
    """ggml_v_expf on 12 million f32 spread evenly (by bit pattern) over [-104, 0], through
    ggml_vec_soft_max_f32 with max 0: the whole range where exp(x) is neither 0 nor 1, subnormals included."""
    pytest.importorskip("llama_cpp")
    _, cpu = _ggml()
    top = int(f32(-104).view(np.uint32))  # -0 is 0x80000000; more negative values have larger bit patterns
    bits = np.arange(0x80000000, top + 1, 89, dtype=np.uint32)
    for chunk in np.array_split(bits[: bits.size - bits.size % 16], 16):
        x = np.ascontiguousarray(chunk[: chunk.size - chunk.size % 16]).view(f32)
        y = np.empty_like(x)
        cpu.ggml_vec_soft_max_f32(x.size, y.ctypes.data, x.ctypes.data, 0.0)
        ours = V_EXPF[HOST][0](x)
        assert _bits_equal(ours, y), f"{_mismatches(ours, y)} of {x.size} differ"


def _libm_tanhf():
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
    return libm.tanhf


def _tanhf_inputs() -> np.ndarray:
    """Every branch of glibc's tanhf and expm1f: tiny, |x| < 1, |x| >= 1, the reduction thresholds 0.5 ln2
    and 1.5 ln2 (as 2|x|), 27 ln2 / 2, 22, and the specials."""
    rng = np.random.default_rng(0)
    edges = np.array([0.25 * np.log(2), 0.75 * np.log(2), 1.0, 13.5 * np.log(2), 22.0, 2.0**-55, 2.0**-26], f32)
    near = (edges.view(np.int32)[:, None] + np.arange(-8, 9)[None, :]).astype(np.int32).view(f32).ravel()
    wide = np.exp(rng.uniform(np.log(1e-20), np.log(40.0), 1000)).astype(f32)
    x = np.concatenate([near, wide, f32([0.0, np.inf, np.nan, 1e-40, 100.0])])
    return np.concatenate([x, -x])


def test_tanhf_vs_libm():
    """tanhf_glibc against the C library's tanhf (the one llama.cpp's ggml_tanh calls). The emulation is of
    glibc 2.36 (it also matched all 2^32 inputs there); glibc 2.41+ has a correctly rounded tanhf."""
    pytest.importorskip("llama_cpp")
    if platform.libc_ver() != ("glibc", "2.36"):
        pytest.skip(f"tanhf_glibc follows glibc 2.36, this is {platform.libc_ver()}")
    tanhf = _libm_tanhf()
    x = _tanhf_inputs()
    ref = np.array([tanhf(float(t)) for t in x], f32)
    ours = tanhf_glibc(x)
    same = (ours.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(ours) & np.isnan(ref))
    assert same.all(), x[~same][:8]


# -- golden: a recording of llama.cpp's outputs, for CI without llama_cpp ------------------------------------------

# (fixture, token chunks, layer, seed): the last chunk's attention of that layer is recorded
_GOLDEN_CASES = [
    ("f32", [7], 0, 1),  # tinyBLAS kq (E = 16) and kqv
    ("q8_0", [20], 1, 2),  # 4 heads on 2 KV groups
    ("gemma2_f32", [40], 0, 3),  # softcap, window 32, E = 24: vec_dot kq (E % 16 != 0)
    ("gemma2_f32", [40], 1, 3),  # softcap, global layer
    ("qwen3_f32", [1], 1, 4),  # T = 1: vec_dot for both products, E = 24 with leftovers
    ("gemma3_f32", [250, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 0, 5),  # decode at 260: n_kv 512, window 32
    ("f32", [50, 1, 7], 2, 6),  # a batch of 7 on top of 51 cached positions
]


def record_golden(path: Path = GOLDEN) -> None:
    """Capture each case from llama.cpp, and one large-spread case from the ggml graph; store q, k, v as f16
    (exactly what the function uses: it rounds them to f16 first), the outputs over the S filled cells (the
    padded cells' kq and probabilities are 0), and the parameters."""
    from conformance.llamacpp import LlamaCpp

    out: dict[str, np.ndarray] = {}

    def store(i, q, k, v, start, scale, window, softcap, kq, sm, kqv):
        S = k.shape[0]
        assert not kq[..., S:].any() and not sm[..., S:].any()
        out.update({
            f"{i}_q": np.asarray(q, f32).astype(np.float16), f"{i}_k": np.asarray(k, f32).astype(np.float16),
            f"{i}_v": np.asarray(v, f32).astype(np.float16), f"{i}_kq": kq[..., :S], f"{i}_kq_soft_max": sm[..., :S],
            f"{i}_kqv_out": kqv,
            f"{i}_params": np.array([start, scale, -1 if window is None else window, softcap or 0.0], np.float64),
        })  # fmt: skip

    for i, (name, chunks, il, seed) in enumerate(_GOLDEN_CASES):
        cfg = _config(name)
        with LlamaCpp(FIXTURES / f"{name}.gguf") as model:
            steps = _capture_chunks(model, chunks, _capture_names(cfg), seed)
        inputs = [_layer_inputs(cfg, cap, il) for _, cap in steps]
        k, v = (np.concatenate([x[j] for x in inputs]) for j in (1, 2))
        q, _, _, scale, extra = inputs[-1]
        start, cap = steps[-1]
        kq_name = f"kq_scaled_2-{il}" if cfg.attn_softcap else f"kq-{il}"
        H, T = cfg.n_heads, q.shape[0]
        kq, sm = (cap[n].reshape(H, T, -1) for n in (kq_name, f"kq_soft_max-{il}"))
        store(i, q, k, v, start, scale, extra["window"], extra["softcap"], kq, sm, cap[f"kqv_out-{il}"])
    # scores spread far apart (exps down to the f32 subnormals and 0), E = 64, groups, softcap 50
    i = len(_GOLDEN_CASES)
    rng = np.random.default_rng(11)
    q = (rng.standard_normal((5, 4, 64)) * 30).astype(f32)
    k = (rng.standard_normal((45, 2, 64)) * 30).astype(f32)
    v = rng.standard_normal((45, 2, 64)).astype(f32)
    g = ggml_attention(q, k, v, 40, f32(0.125), None, 50.0)
    store(i, q, k, v, 40, 0.125, None, 50.0, g["kq"], g["kq_soft_max"], g["kqv_out"])
    x = _tanhf_inputs()
    tanhf = _libm_tanhf()
    out["tanhf_x"] = x
    out["tanhf_y"] = np.array([tanhf(float(t)) for t in x], f32)
    np.savez_compressed(path, **out)


def test_golden():
    """The recorded llama.cpp outputs, bit for bit, without llama_cpp."""
    g = np.load(GOLDEN)
    n_cases = len({key.split("_")[0] for key in g.files if key[0].isdigit()})
    assert n_cases == len(_GOLDEN_CASES) + 1
    compared = 0
    for i in range(n_cases):
        start, scale, window, softcap = g[f"{i}_params"]
        q, k, v = (g[f"{i}_{n}"].astype(f32) for n in "qkv")
        window = None if window < 0 else int(window)
        parts = attention_parts(q, k, v, int(start), f32(scale), window, float(softcap) or None)
        S = k.shape[0]
        for key in ("kq", "kq_soft_max", "kqv_out"):
            ours = parts[key] if key == "kqv_out" else parts[key][..., :S]
            assert _bits_equal(ours, g[f"{i}_{key}"]), f"case {i} {key}: {_mismatches(ours, g[f'{i}_{key}'])} differ"
            compared += ours.size
        assert not parts["kq_soft_max"][..., S:].any()
    assert compared > 20_000
    y, ref = tanhf_glibc(g["tanhf_x"]), g["tanhf_y"]
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    assert _bits_equal(y[~np.isnan(y)], ref[~np.isnan(ref)])


def test_n_kv_cells():
    assert [n_kv_cells(S) for S in (1, 255, 256, 257, 512)] == [256, 256, 256, 512, 512]
    assert n_kv_cells(300, cache_size=384) == 384


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent))  # the repository root, for `conformance`
    record_golden()
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
