"""Numerics modes: how much of llama.cpp's arithmetic the forward pass reproduces.

`exact` dequantizes weights and computes in float32: the teaching reference.

`llamacpp` follows ggml's CPU backend as llama.cpp runs it with flash attention off and an f16 KV cache
(the configuration of `conformance/llamacpp.py` SETTINGS; docs/conformance.md):
- every matmul quantizes its activations to the weight's vec_dot type and forms block dot products
  (`ggufpy.quants.vecdot`; the backend reads `quantize_activations`), in the order of the f32 operations of
  the x86 kernel llama.cpp runs for that weight and shape (`ggufpy.quants.x86`; `x86_kernels`), so that the
  NumPy backend's products equal llama.cpp's bit for bit on the x86 build the goldens come from;
- K and V are stored as f16 (`kv_dtype`);
- RoPE angles are built like `ggml_rope_cache_init`: theta_scale = powf(base, -2/n_dims), theta multiplied
  by it pair after pair in f32, then the C library's cosf/sinf (`rope_angles_ggml`); the rotation contracts
  to FMAs as compiled (`rope_ggml`);
- attention rounds where ggml's does (`attention_ggml`), in the order of its kernels' f32 operations
  (`ggufpy.quants.x86.attention`: tinyBLAS F16 products over the padded cache, `ggml_v_expf`);
- GELU is ggml's fp16 table (`gelu_tanh_ggml`, GGML_GELU_FP16); SiLU uses ggml's own SIMD exp (`_silu_x86`).
The forward pass and the backends read only these fields.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import ops
from .quants.vecdot import round_f16
from .quants.x86.simd import fma


@dataclass(frozen=True)
class Numerics:
    name: str
    kv_dtype: np.dtype  # storage type of the KV cache
    rope_angles: Callable = ops.rope_angles  # (positions, rope_dim, theta, freq_scale, freq_factors) -> cos, sin
    rope: Callable = ops.rope  # (x (T, heads, E), cos, sin, style) -> rotated x
    softcap: Callable = ops.apply_softcap  # (x, cap) -> cap * tanh(x / cap): gemma2's final logits
    attention: Callable = ops.attention  # (q, k, v, start, scale) -> (T, H*E)
    quantize_activations: bool = False  # round activations to each weight type's vec_dot type (ggml-cpu.c)
    x86_kernels: bool = False  # and replay the f32 operations of ggml's x86 kernels (ggufpy/quants/x86)
    x86_isa: str = "avx512"  # ... of this build (quants.x86.simd.ISAS): the goldens' AVX-512, or AVX2
    activations: dict[str, Callable] = field(default_factory=lambda: dict(ops.ACTIVATIONS))  # by ArchSpec name
    layer_norm: Callable = ops.layer_norm  # (x, weight, eps) -> LayerNorm without bias (ArchSpec norm "layer")


def rope_angles_ggml(
    positions: np.ndarray,
    rope_dim: int,
    theta: float,
    freq_scale: float = 1.0,
    freq_factors: np.ndarray | None = None,
    ext: ops.RopeExt | None = None,
    cos_sin: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (T, R/2) as ggml computes them (ggml-cpu/ops.cpp `ggml_rope_cache_init`, `rope_yarn`).

    theta_scale = powf(freq_base, -2.0f/n_dims); pair i's angle is pos * theta_scale^i built by repeated f32
    multiplication, divided by freq_factors[i], times freq_scale; then cosf/sinf. A float64 theta^(-2i/R)
    differs from this by up to ~1e-5 rad at position 100. With `ext` (YaRN, attention factor): the
    interpolated and extrapolated angles mixed per pair, and cos, sin times mscale, in rope_yarn's f32 steps.
    `cos_sin(angles)`: the C library's cosf and sinf of every element (default: called one by one from Python;
    a backend passes a compiled form, `glue_ggml.cos_sin`).
    """
    cos_sin = cos_sin or _libm_cos_sin
    exponent = np.float32(-2.0) / np.float32(rope_dim)
    theta_scale = np.float32(np.float64(np.float32(theta)) ** np.float64(exponent))  # powf, correctly rounded
    t = np.asarray(positions).astype(np.float32)  # (T,)
    angles = np.full((t.shape[0], rope_dim // 2), theta_scale, np.float32)  # (T, R/2)
    angles[:, 0] = t
    angles = np.multiply.accumulate(angles, axis=1, dtype=np.float32)  # pos, pos*s, (pos*s)*s, ... one by one in f32
    if freq_factors is not None:
        angles = angles / np.asarray(freq_factors, np.float32)
    if ext is None:
        return cos_sin(np.float32(freq_scale) * angles)
    f32 = np.float32
    extrap, interp = angles, f32(freq_scale) * angles
    mscale = f32(ext.attn_factor)
    if ext.ext_factor != 0:
        mix = ops.yarn_ramp(ext, rope_dim // 2)  # (R/2,)
        # theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix, contracted to one FMA as compiled
        angles = fma(interp, (f32(1) - mix), extrap * mix)
        mscale = mscale * fma(f32(0.1), logf(f32(1) / f32(freq_scale)), f32(1))  # 1.0f + 0.1f * logf(1/fs)
    else:
        angles = interp
    cos, sin = cos_sin(angles)
    return cos * mscale, sin * mscale


def _libm_cos_sin(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _libm_f32("cosf", angles), _libm_f32("sinf", angles)


def logf(x) -> np.float32:
    """The C library's logf of one float32 (what llama.cpp's scalar f32 code calls)."""
    return _libm_f32("logf", np.asarray([x], np.float32))[0]


@functools.cache
def _libm():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("m")
    return ctypes.CDLL(name) if name else None


def _libm_f32(fn: str, x: np.ndarray) -> np.ndarray:
    """The C library's single-precision `fn` (cosf, sinf), element by element: what ggml calls. glibc's are
    not correctly rounded (on 800 RoPE angles, 13 results differ in the last bit from the rounded float64
    value); without a C math library, the correctly rounded value."""
    lib = _libm()
    if lib is None:
        return getattr(np, fn[:-1])(x.astype(np.float64)).astype(np.float32)
    import ctypes

    f = getattr(lib, fn)
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    flat = x.reshape(-1)
    return np.fromiter((f(v) for v in flat.tolist()), np.float32, flat.size).reshape(x.shape)


def libm_expf(x: np.ndarray) -> np.ndarray:
    """The C library's expf of every element (ggml's scalar loops: swiglu_oai, sigmoid gates, router tails);
    a backend may hold a compiled form (`NumbaBackend.compiled`), the same calls without Python per element."""
    return _libm_f32("expf", x)


def rope_ggml(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """`ops.rope` as ggml computes it (ops.cpp `rotate_pairs`): `x0*cos - x1*sin` and `x0*sin + x1*cos`,
    which g++ contracts to fma(x0, cos, -(x1*sin)) and fma(x0, sin, x1*cos) (checked against llama.cpp's
    Qcur: 0 of 6400 values differ, 1380 with separate roundings)."""
    r = 2 * cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, R/2)
    out = np.array(x, np.float32)
    i0, i1 = (slice(0, r, 2), slice(1, r, 2)) if style == "norm" else (slice(0, r // 2), slice(r // 2, r))
    x0, x1 = out[..., i0].copy(), out[..., i1].copy()  # (T, heads, R/2) each
    out[..., i0] = fma(x0, c, -(x1 * s))
    out[..., i1] = fma(x0, s, x1 * c)
    return out


def attention_ggml(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """llama.cpp's attention without flash attention (src/llama-graph.cpp `build_attn_mha`), shapes as
    `ops.attention`: q (T, H, E); k, v (S, G, E) read from the f16 cache.

    kq = mul_mat(K, Q): K is f16, so Q is rounded to f16 (F16's vec_dot type) and the exact products are
    summed (ggml in f32; here exactly, in f64, and rounded once, as in `vecdot.linear`). soft_max_ext
    (ops.cpp `ggml_compute_forward_soft_max_f32`): kq * scale in f32, masked entries -inf, exp(x - max) in
    f32 summed in double, times (float)(1/sum); `sinks` (H,) join each head's max and sum (gpt-oss). kqv =
    mul_mat(V, kq): the probabilities are rounded to f16 and their products with f16 V summed likewise.
    """
    T, H, E = q.shape
    S, G, _ = k.shape
    f64 = np.float64
    q16 = round_f16(q).astype(f64).reshape(T, G, H // G, E).transpose(1, 2, 0, 3)  # (G, H/G, T, E)
    k16 = round_f16(k).astype(f64).transpose(1, 2, 0)[:, None]  # (G, 1, E, S)
    v16 = round_f16(v).astype(f64).transpose(1, 0, 2)[:, None]  # (G, 1, S, E)
    scores = (q16 @ k16).astype(np.float32) * np.float32(scale)  # (G, H/G, T, S)
    if softcap:
        scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
    distance = (start + np.arange(T))[:, None] - np.arange(S)[None, :]  # query position - key position (T, S)
    masked = distance < 0
    if window is not None:
        masked |= distance >= window
    scores = np.where(masked, np.float32(-np.inf), scores)
    peak = scores.max(axis=-1, keepdims=True)
    sink = None if sinks is None else np.asarray(sinks, np.float32).reshape(G, H // G, 1, 1)
    if sink is not None:
        peak = np.maximum(peak, sink)
    e = np.exp(scores - peak)
    total = e.sum(axis=-1, keepdims=True, dtype=np.float64)
    if sink is not None:
        total = total + np.exp(sink - peak)  # sum += (ggml_float) expf(sink - max)
    inv = (1.0 / total).astype(np.float32)
    probs = round_f16(e * inv)
    out = (probs.astype(f64) @ v16).astype(np.float32)  # (G, H/G, T, E)
    return out.transpose(2, 0, 1, 3).reshape(T, H * E)


@functools.cache
def _gelu_table() -> np.ndarray:
    """`ggml_table_gelu_f16` (ggml-cpu.c `ggml_cpu_init`): fp16(ggml_gelu_f32(x)) for every fp16 bit pattern x,
    with ggml_gelu_f32 = 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))) evaluated in f32 as
    the compiled C does (the inner 1 + (A*x)*x contracted to an FMA). Equal to ggml's table on every finite entry."""
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    f32 = np.float32
    with np.errstate(all="ignore"):
        inner = ((f32(0.044715) * x).astype(np.float64) * x + 1.0).astype(np.float32)  # fmaf(A*x, x, 1)
        th = np.tanh((f32(0.79788456080286535587989211986876) * x * inner).astype(np.float64)).astype(np.float32)
        return (f32(0.5) * x * (f32(1.0) + th)).astype(np.float16)


def gelu_tanh_ggml(x: np.ndarray) -> np.ndarray:
    """ggml's GELU (vec.h `ggml_vec_gelu_f32` with GGML_GELU_FP16, always defined): x <= -10 gives 0, x >= 10
    gives x, anything between is rounded to fp16 and looked up in the fp16 table of the tanh approximation."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore"):
        looked_up = _gelu_table()[x.astype(np.float16).view(np.uint16)].astype(np.float32)
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, looked_up))


def attention_x86(q, k, v, start, scale, window=None, softcap=None, isa="avx512", sinks=None):
    """`attention_ggml` with the f32 operations of the kernels llama.cpp runs (`ggufpy.quants.x86.attention`)."""
    from .quants.x86.attention import attention

    return attention(q, k, v, start, scale, window=window, softcap=softcap, isa=isa, sinks=sinks)


def layer_norm_ggml(x: np.ndarray, weight: np.ndarray, eps: float, isa: str = "avx512") -> np.ndarray:
    """`ggml_norm` then `ggml_mul` by the weight, as ggml-cpu computes them (ops.cpp
    `ggml_compute_forward_norm_f32`): sum in double rounded to f32, mean = sum / n in f32, y = x - mean,
    the variance by `ggml_vec_cvar_f32` (vec.cpp: per SIMD block of 16 (AVX-512) or 8 (AVX2) lanes the f32
    squares summed by the intrinsic's tree, each block's sum added in double, the tail scalar), divided by n,
    then y * (1.0f / sqrtf(variance + eps)) and the weight."""
    from .quants.x86.simd import hsum_float_8, reduce_add_ps_512

    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    mean = (x.astype(np.float64).sum(axis=-1, keepdims=True).astype(np.float32) / np.float32(n)).astype(np.float32)
    y = x - mean
    lanes, hsum = (16, reduce_add_ps_512) if isa == "avx512" else (8, hsum_float_8)
    blocks = n // lanes * lanes
    sq = y * y
    body = hsum(sq[..., :blocks].reshape(*sq.shape[:-1], blocks // lanes, lanes)).astype(np.float64)
    total = np.zeros(sq.shape[:-1], np.float64)
    for b in range(blocks // lanes):  # sum += (ggml_float) block, in order
        total = total + body[..., b]
    for i in range(blocks, n):
        total = total + sq[..., i].astype(np.float64)
    variance = (total / n).astype(np.float32)[..., None]
    scale = np.float32(1.0) / np.sqrt(variance + np.float32(eps))
    return (y * scale) * np.asarray(weight, np.float32)


def _softcap_ggml(x, cap):
    """ggml_scale(x, 1.0f/cap), ggml_tanh (the C library's tanhf), ggml_scale(x, cap) (src/models/gemma2.cpp)."""
    from .quants.x86.unary import tanhf_glibc

    cap = np.float32(cap)
    return tanhf_glibc(np.asarray(x, np.float32) * (np.float32(1) / cap)) * cap


def _silu_x86(x, isa="avx512"):
    """SiLU as `ggml_vec_swiglu_f32` computes it: x / (1 + ggml's own SIMD exp(-x)) (`ggufpy.quants.x86.unary`)."""
    from .quants.x86.unary import silu_rows

    return silu_rows(x, isa)


NUMERICS: dict[str, Numerics] = {
    "exact": Numerics("exact", np.dtype(np.float32)),
    "llamacpp": Numerics(
        "llamacpp",
        np.dtype(np.float16),
        rope_angles=rope_angles_ggml,
        rope=rope_ggml,
        softcap=_softcap_ggml,
        attention=attention_x86,
        quantize_activations=True,
        x86_kernels=True,
        activations={"silu": _silu_x86, "gelu_tanh": gelu_tanh_ggml},
        layer_norm=layer_norm_ggml,
    ),
}
# The same on an AVX2 build of llama.cpp (no AVX-512): 8-lane SIMD exp, softmax sums and F16/F32 products.
NUMERICS["llamacpp-avx2"] = dataclasses.replace(
    NUMERICS["llamacpp"],
    name="llamacpp-avx2",
    attention=functools.partial(attention_x86, isa="avx2"),
    activations={"silu": functools.partial(_silu_x86, isa="avx2"), "gelu_tanh": gelu_tanh_ggml},
    x86_isa="avx2",
    layer_norm=functools.partial(layer_norm_ggml, isa="avx2"),
)
LLAMACPP_MODES = {"avx512": "llamacpp", "avx2": "llamacpp-avx2"}  # the mode replaying each llama.cpp build


def llamacpp_mode(system_info: str) -> str:
    """The numerics mode that replays the llama.cpp build whose `llama_print_system_info()` is given."""
    from .quants.x86.simd import isa_of

    return LLAMACPP_MODES[isa_of(system_info)]


def host_llamacpp_mode(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The mode replaying the llama.cpp that a native build (llama-cpp-python's default) runs on this CPU: its
    AVX-512 kernels need AVX512F and AVX512DQ (ggml-cpu's `__AVX512F__ && __AVX512DQ__` branches), else AVX2."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return LLAMACPP_MODES["avx512" if {"avx512f", "avx512dq"} <= set(flags) else "avx2"]


def numerics_mode(name: str) -> Numerics:
    try:
        return NUMERICS[name]
    except KeyError:
        raise ValueError(f"unknown numerics mode {name!r}; available: {', '.join(NUMERICS)}") from None
