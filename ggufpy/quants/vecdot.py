"""llama.cpp's CPU matmul arithmetic: activations in the weight's vec_dot type, then block dot products.

`ggml_compute_forward_mul_mat` (ggml/src/ggml-cpu/ggml-cpu.c) converts each f32 activation row with the
`from_float` of the weight's `vec_dot_type` (table `type_traits_cpu`) and then calls `vec_dot(weight_row,
activation_row)`. So on a CPU llama.cpp never multiplies quantized weights by f32 activations:

    weight type                                   vec_dot type   activation row becomes
    F32                                           F32            unchanged
    F16 / BF16                                    F16 / BF16     rounded to f16 / bf16 (nearest even)
    Q4_0, Q5_0, Q8_0, IQ4_NL                      Q8_0           d = amax/127 (fp16), q = rint(x * 127/amax)
    Q4_1, Q5_1                                    Q8_1           as Q8_0, plus s = fp16(d * sum q)
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS          Q8_K           d = -max/127 (f32), q = nearest_int(x/d), bsums

(x86 rounding of Q8_0/Q8_1: `quantize_row_q8_0/1` in ggml-cpu/arch/x86/quants.c; Q8_K uses the reference
`quantize_row_q8_K_ref`; the repacked layouts' `ggml_quantize_mat_q8_*_4x8` round the same way.)

The generic dot products (ggml-cpu/quants.c `ggml_vec_dot_*_generic`) sum integer products per sub-block and
scale them; weights with a minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) add the min term through an activation
sum per sub-block instead of through the dequantized weight:

    Q4_0 . Q8_0:  sum_b  d_w d_a sum_k (q_w - 8) q_a
    Q4_1 . Q8_1:  sum_b  d_w d_a sum_k q_w q_a  +  m_w s_a          (s_a is the block's stored fp16 sum)
    Q4_K . Q8_K:  sum_b  d_w d_a sum_j sc_j sum_k q_w q_a  -  dmin_w d_a sum_j m_j bsum_j

Here every weight is split the same way (`split_weight`): `scaled` = the sub-block scale times the integer
quant (exact in f32, as the dequantizers are), and `offsets` = the constant per sub-block (`m`, or
`-dmin * m`). `linear` then forms `A @ scaled.T + sums @ offsets.T` with A = d_a * q_a: the same sums of
exact integer products that ggml forms, evaluated in float64 (exact but for ~1e-16) and rounded once to f32.
ggml's kernels round along the way (per block, per SIMD lane, in an order that differs between its generic,
AVX2, repacked and llamafile paths), so they differ from this exact value by ~1e-7 relative. An f32 BLAS
evaluation would add an error of its own of that size, and every last-bit difference can flip a rounding
decision downstream (f16 K/V, the next matmul's Q8 activations): with the exact sums a layer's outputs match
llama.cpp's bit for bit far more often (docs/conformance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import GGMLType
from ..errors import GGUFUnsupportedError
from .fields import f16_field, f32_field, i8_field
from .floats import fp32_to_bf16_bits
from .quantizers import quantize_q8_0_x86, quantize_q8_1_x86, quantize_q8_K
from .registry import dequantize, quant_type

__all__ = [
    "VEC_DOT_TYPE",
    "Activations",
    "SplitWeight",
    "decode_activations",
    "linear",
    "linear_x86",
    "quantize_activations",
    "round_bf16",
    "round_f16",
    "split_weight",
]

T = GGMLType
# ggml-cpu.c `type_traits_cpu[...].vec_dot_type`
VEC_DOT_TYPE: dict[GGMLType, GGMLType] = {
    T.F32: T.F32,
    T.F16: T.F16,
    T.BF16: T.BF16,
    T.Q4_0: T.Q8_0,
    T.Q4_1: T.Q8_1,
    T.Q5_0: T.Q8_0,
    T.Q5_1: T.Q8_1,
    T.Q8_0: T.Q8_0,
    T.IQ4_NL: T.Q8_0,
    T.MXFP4: T.Q8_0,
    T.NVFP4: T.Q8_0,
    T.Q1_0: T.Q8_0,
    T.Q2_K: T.Q8_K,
    T.Q3_K: T.Q8_K,
    T.Q4_K: T.Q8_K,
    T.Q5_K: T.Q8_K,
    T.Q6_K: T.Q8_K,
    T.IQ4_XS: T.Q8_K,
    T.TQ1_0: T.Q8_K,
    T.TQ2_0: T.Q8_K,
    T.IQ2_XXS: T.Q8_K,
    T.IQ3_XXS: T.Q8_K,
    T.IQ3_S: T.Q8_K,
    T.IQ2_XS: T.Q8_K,
    T.IQ2_S: T.Q8_K,
    T.IQ1_S: T.Q8_K,
    T.IQ1_M: T.Q8_K,
}

# The `from_float` that ggml's x86 CPU backend runs for each activation format.
_FROM_FLOAT = {T.Q8_0: quantize_q8_0_x86, T.Q8_1: quantize_q8_1_x86, T.Q8_K: quantize_q8_K}

# Weights with a per-sub-block minimum: (byte range of the scale d, byte range of the min scale, sub-block size).
# Zeroing the min scale leaves d*sc*q; zeroing d leaves the constant offset (+m or -dmin*m), both exact.
_MIN_FIELDS: dict[GGMLType, tuple[slice, slice, int]] = {
    T.Q4_1: (slice(0, 2), slice(2, 4), 32),
    T.Q5_1: (slice(0, 2), slice(2, 4), 32),
    T.Q2_K: (slice(80, 82), slice(82, 84), 16),
    T.Q4_K: (slice(0, 2), slice(2, 4), 32),
    T.Q5_K: (slice(0, 2), slice(2, 4), 32),
}


def round_f16(x: np.ndarray) -> np.ndarray:
    """f32 -> nearest-even f16 -> f32: `ggml_cpu_fp32_to_fp16` (F16C) as used for F16 weights, the f16 KV
    cache, and Q and the attention probabilities in llama.cpp's attention."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """f32 -> nearest-even bf16 -> f32: `ggml_cpu_fp32_to_bf16`, the activations of BF16 weights."""
    return (fp32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32).reshape(np.shape(x))


def quantize_activations(x: np.ndarray, vec_dot_type: GGMLType) -> np.ndarray:
    """Rows of f32 activations (..., n) -> the blocks ggml's CPU matmul multiplies with: u8 (..., row_bytes)."""
    try:
        from_float = _FROM_FLOAT[vec_dot_type]
    except KeyError:
        raise GGUFUnsupportedError(
            f"{GGMLType(vec_dot_type).name} is not an activation format; expected one of "
            f"{', '.join(t.name for t in _FROM_FLOAT)}"
        ) from None
    qt = quant_type(vec_dot_type)
    x = np.ascontiguousarray(x, np.float32)
    blocks = from_float(x.reshape(-1, qt.block_size))  # [n_blocks, type_size]
    return blocks.reshape(*x.shape[:-1], qt.row_bytes(x.shape[-1]))


@dataclass(frozen=True)
class Activations:
    """Decoded activation blocks of T rows of n elements.

    values: (T, n) d_a * q_a.  sums16: (T, n/16) the activation sums per 16 elements as the dot products see
    them: d_a * bsums for Q8_K, None otherwise.  s: (T, n/32) the stored fp16 `s` of Q8_1 blocks, else None.
    """

    values: np.ndarray
    sums16: np.ndarray | None = None
    s: np.ndarray | None = None

    def sub_block_sums(self, sub: int) -> np.ndarray:
        """Activation sums over sub-blocks of `sub` elements, as the vec_dot of the weight type uses them."""
        if self.s is not None:  # Q8_1: the block's own fp16 sum (not recomputed from the quants)
            if sub != 32:
                raise ValueError(f"Q8_1 carries sums of 32 elements, not {sub}")
            return self.s
        if self.sums16 is None:
            raise ValueError("Q8_0 activations carry no block sums")
        T, n16 = self.sums16.shape
        return self.sums16.reshape(T, n16 * 16 // sub, sub // 16).sum(axis=-1)


def decode_activations(blocks: np.ndarray, vec_dot_type: GGMLType, n: int, dtype=np.float32) -> Activations:
    """u8 (T, row_bytes) from `quantize_activations` -> `Activations` in `dtype` (float64 keeps d_a * q_a exact)."""
    qt = quant_type(vec_dot_type)
    b = np.ascontiguousarray(blocks).reshape(-1, qt.type_size)  # [T * n_blocks, type_size]
    rows = b.shape[0] // (n // qt.block_size)
    if vec_dot_type == T.Q8_K:
        d = f32_field(b, 0).astype(dtype)  # [blocks, 1]
        q = i8_field(b, 4, 256)
        bsums = b[:, 260:292].view("<i2")  # [blocks, 16]
        return Activations((d * q).reshape(rows, n), sums16=(d * bsums).reshape(rows, n // 16))
    d = f16_field(b, 0).astype(dtype)
    if vec_dot_type == T.Q8_1:
        values = (d * i8_field(b, 4, 32)).reshape(rows, n)
        return Activations(values, s=f16_field(b, 2).astype(dtype).reshape(rows, n // 32))
    return Activations((d * i8_field(b, 2, 32)).reshape(rows, n))


@dataclass(frozen=True, eq=False)
class SplitWeight:
    """A weight (out, in) as its vec_dot sees it: W = scaled + offsets, each offset constant over `sub` elements.

    scaled: (out, in) f32, sub-block scale times integer quant (the whole dequantized weight when there is
    no minimum).  offsets: (out, in/sub) f32 or None.
    """

    type: GGMLType
    scaled: np.ndarray
    offsets: np.ndarray | None = None
    sub: int = 0

    @property
    def nbytes(self) -> int:
        return self.scaled.nbytes + (0 if self.offsets is None else self.offsets.nbytes)


def split_weight(raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, int]) -> SplitWeight:
    """Split the bytes of a 2-D weight (NumPy shape (out, in)) into its scaled quants and per-sub-block offsets."""
    t = GGMLType(ggml_type)
    if t not in VEC_DOT_TYPE:
        supported = ", ".join(k.name for k in VEC_DOT_TYPE)
        raise GGUFUnsupportedError(f"no llama.cpp vec_dot is emulated for {t.name}; supported: {supported}")
    if t not in _MIN_FIELDS:
        return SplitWeight(t, dequantize(raw, t, shape))
    d_field, min_field, sub = _MIN_FIELDS[t]
    blocks = np.array(np.asarray(raw).reshape(-1).view(np.uint8).reshape(-1, quant_type(t).type_size))
    no_min, no_scale = blocks.copy(), blocks
    no_min[:, min_field] = 0
    no_scale[:, d_field] = 0
    offsets = dequantize(no_scale, t, shape)[:, ::sub]  # (out, in/sub): +m or -dmin*m
    return SplitWeight(t, dequantize(no_min, t, shape), np.ascontiguousarray(offsets), sub)


def linear(x: np.ndarray, w: SplitWeight, dtype=np.float64, chunk_bytes: int = 64 << 20) -> np.ndarray:
    """x (T, in) f32 times w (out, in) transposed, as llama.cpp's CPU matmul computes it: (T, out) f32.

    With the default float64 the block sums are exact (up to 1e-16) and rounded once: the value that ggml's
    f32 kernels, and ggufpy's numba kernels, approximate. `dtype=np.float32` is faster and about 1e-7 off.
    The weight is widened to `dtype` `chunk_bytes` at a time (a 262144-row output head would take 1.3 GB).
    """
    vt = VEC_DOT_TYPE[w.type]
    x = np.asarray(x, np.float32)
    lead, n = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, n)
    if vt in _ROUND:
        a, sums = _ROUND[vt](x).astype(dtype), None
    else:
        acts = decode_activations(quantize_activations(x, vt), vt, n, dtype)
        a, sums = acts.values, None if w.offsets is None else acts.sub_block_sums(w.sub)
    out = np.empty((x.shape[0], w.scaled.shape[0]), np.float32)
    step = max(1, chunk_bytes // (n * np.dtype(dtype).itemsize))
    for lo in range(0, w.scaled.shape[0], step):
        rows = slice(lo, lo + step)
        y = a @ w.scaled[rows].astype(dtype).T  # (T, rows)
        if sums is not None:
            y += sums @ w.offsets[rows].astype(dtype).T
        out[:, rows] = y
    return out.reshape(*lead, -1)


def linear_x86(
    x: np.ndarray, raw: np.ndarray, w_type: GGMLType, shape: tuple[int, int], isa: str = "avx512"
) -> np.ndarray:
    """x (..., in) f32 times the weight (out, in) given by its GGUF bytes, bit for bit as llama.cpp's x86 CPU
    backend (the `isa` build, `x86.simd.ISAS`) computes it: the activations as `quantize_activations`, then
    the f32 operations of the kernel that runs for this type and shape (`ggufpy.quants.x86`). Returns
    (..., out) f32."""
    from . import x86  # NumPy replays of SIMD kernels: loaded only by the llamacpp numerics

    x = np.asarray(x, np.float32)
    lead, n = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n)  # (T, in)
    a = x86.activations_for(rows, w_type, lambda r: quantize_activations(r, VEC_DOT_TYPE[w_type]))
    w = np.asarray(raw).reshape(-1).view(np.uint8).reshape(shape[0], -1)  # u8 (out, row_bytes)
    return x86.matmul(w, w_type, a, isa).reshape(*lead, shape[0])


# Float weights: the activation row is only rounded to the weight's own type (vec_dot_type F32/F16/BF16).
_ROUND = {T.F32: lambda x: x, T.F16: round_f16, T.BF16: round_bf16}
