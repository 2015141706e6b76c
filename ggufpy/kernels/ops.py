"""numba counterparts of `ggufpy.ops` for the per-token glue of a forward pass: RMSNorm, RoPE, SiLU, GELU.

Same signatures and shapes as `ggufpy.ops`. During decode NumPy spends most of its time on call overhead here
(RMSNorm is eight array operations on 576 floats); one compiled call each is 5-10x cheaper. RMSNorm and RoPE
repeat the reference's f32 operations in order (no contraction into FMAs), so they agree with it except
where the float64 sum of squares is added in a different order. SiLU and GELU use a sigmoid built on
`attention.exp_nonpositive`, which vectorizes: within 1e-6 relative of NumPy's `exp`/`tanh` versions.
"""

from __future__ import annotations

import numpy as np

from ._numba import jit
from .attention import exp_nonpositive

__all__ = ["ACTIVATIONS", "gelu_tanh", "rms_norm", "rope", "silu"]


@jit(fast=True)  # reassociation vectorizes the sum: a serial f64 add chain takes ~1 us per 576-wide row
def _sum_squares(row):
    total = 0.0
    for j in range(row.shape[0]):
        total += np.float64(row[j] * row[j])  # the square in f32, the sum in f64, as ggml
    return total


@jit  # no fast-math here: (x * scale) * weight keeps the reference's two f32 roundings
def _rms_norm(x, weight, eps, out):
    n, d = x.shape
    for i in range(n):
        mean = np.float32(_sum_squares(x[i]) / d)
        scale = np.float32(1.0) / np.sqrt(mean + eps)
        for j in range(d):
            out[i, j] = (x[i, j] * scale) * weight[j]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis (`ops.rms_norm`)."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _rms_norm(x2, np.ascontiguousarray(weight, np.float32), np.float32(eps), out)
    return out.reshape(x.shape)


@jit
def _rope(x, cos, sin, neox, out):
    T, heads, E = x.shape
    half = cos.shape[1]
    for t in range(T):
        for h in range(heads):
            for e in range(2 * half, E):  # dims past the rotated ones are copied
                out[t, h, e] = x[t, h, e]
            for i in range(half):
                i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
                x0 = x[t, h, i0]
                x1 = x[t, h, i1]
                c = cos[t, i]
                s = sin[t, i]
                out[t, h, i0] = x0 * c - x1 * s
                out[t, h, i1] = x0 * s + x1 * c


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate the first R dims of every head (`ops.rope`). x: (T, heads, E); cos, sin: (T, R/2)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _rope(x, np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32), style != "norm", out)
    return out


@jit(inline=True)
def _sigmoid(z):
    """1 / (1 + exp(-z)) with exp only of -|z|, so it never overflows and vectorizes."""
    e = exp_nonpositive(-abs(z))
    return np.float32(1.0) / (np.float32(1.0) + e) if z >= 0 else e / (np.float32(1.0) + e)


@jit(fast=True)
def _silu(x, out):
    for i in range(x.size):
        out[i] = x[i] * _sigmoid(x[i])


@jit(fast=True)
def _gelu_tanh(x, out):
    # 0.5 x (1 + tanh(y)) = x * sigmoid(2y), y = sqrt(2/pi) (x + 0.044715 x^3)
    c = np.float32(2.0 * np.sqrt(2.0 / np.pi))
    for i in range(x.size):
        v = x[i]
        out[i] = v * _sigmoid(c * (v + np.float32(0.044715) * v * v * v))


def _pointwise(kernel):
    def apply(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty_like(x)
        kernel(x.reshape(-1), out.reshape(-1))
        return out

    return apply


silu = _pointwise(_silu)
silu.__doc__ = "x * sigmoid(x) (`ops.silu`)."
gelu_tanh = _pointwise(_gelu_tanh)
gelu_tanh.__doc__ = "The tanh approximation of GELU (`ops.gelu_tanh`)."
ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}
