"""`matvec.unpack` in NumPy: the same f32 operations in the same order, so the same bits, with nothing to compile.

A prefill's BLAS tiles need `matvec._unpack_t`, ~5 s of numba compilation on a cold cache. Until it is compiled
(`NumbaBackend._unpack`, in the background), the tiles come from here: per element `A * (v + zo) + B` with
A = a (times sc) and B = b (times mn) or -0.0, each product and sum rounded to f32 once, as `_unpack_t` computes
them (it has no fastmath flags: no fused multiply-adds). Slower than the kernel, but bit-identical
(`tests/test_cold_start.py`), so which one made a tile never shows in the result.
"""

from __future__ import annotations

import numpy as np

from .layout import GROUP, Packed

__all__ = ["unpack"]


def _values(q: np.ndarray, family: str) -> np.ndarray:
    """The integers of groups (G, n, S, width) as (G, n, S, 64) f32, lane r = row r of the group (`matvec`)."""
    if family == "nib":
        v = np.concatenate([q & 15, q >> 4], axis=-1)  # rows r, 32 + r
    elif family == "nib6":  # `matvec._nib6_values`: rows r, 16 + r, 32 + r, 48 + r
        n0, n1, h = q[..., :16], q[..., 16:32], q[..., 32:48]
        lo = [(n0 & 15) | ((h & 3) << 4), (n1 & 15) | ((h & 12) << 2)]
        v = np.concatenate([*lo, (n0 >> 4) | (h & 48), (n1 >> 4) | ((h & 192) >> 2)], axis=-1)
    elif family == "i8":
        v = q
    else:
        raise NotImplementedError(f"no NumPy unpack for the {family!r} storage family")
    return v.astype(np.float32)


def _f32(x: np.ndarray) -> np.ndarray:
    """Scales as f32: fp16 bits (u16) converted exactly, or f32 as stored (`matvec._scale_at`)."""
    return x.view(np.float16).astype(np.float32) if x.dtype == np.uint16 else x.astype(np.float32)


def unpack(p: Packed, g0: int, g1: int, out: np.ndarray) -> np.ndarray:
    """The dense rows of groups g0..g1-1, transposed into out (cols, 64 * (g1 - g0)): `matvec.unpack`'s bits."""
    q = p.q[g0:g1]  # (G, n, S, width)
    G, n, S, _ = q.shape
    per = 1 if p.style == "block" else 256 // p.sub  # sub-blocks per scale of `a` / `b`
    A = np.repeat(_f32(p.a[g0:g1]), per, axis=1)[:, :n]  # (G, n, 64): a[g, s // per, r]
    if p.sc is not None:
        A = A * p.sc[g0:g1].astype(np.float32)
    if p.b is not None:
        B = np.repeat(_f32(p.b[g0:g1]), per, axis=1)[:, :n]
        if p.mn is not None:
            B = B * p.mn[g0:g1].astype(np.float32)
    else:  # -0.0 leaves every value as it is (+0.0 would turn -0.0 into +0.0)
        B = np.full((G, n, GROUP), -0.0, np.float32)
    w = A[:, :, None, :] * (_values(q, p.family) + np.float32(p.zo)) + B[:, :, None, :]  # (G, n, S, 64)
    out[:, : G * GROUP] = w.transpose(1, 2, 0, 3).reshape(n * S, G * GROUP)  # out[s*S + k, 64*i + r]
    return out
