"""Integer dot products for issue 12's types in the llamacpp numerics: each weight block decoded to int8, then
ggml's integer block dots with the Q8_K / Q8_0 activations and its f32 steps in its order.

    KERNELS[type] = (activation format, block bytes, elements per block, kernel)   # registered by int8dot

The blocks are decoded by `rawblocks._decode` (the grid / sign / ternary / FP4 values as int8, the same
decoders as the f32 kernels) and stay in the file (1.0x its bytes). The spec is the NumPy replay of the x86
kernel llama.cpp runs for the type and shape (`ggufpy.quants.x86.kernel_for`), reproduced bit for bit:

    type                        vec_dot  kernel replayed                                     module (quants.x86)
    IQ2_XXS/XS/S, IQ3_XXS/S     Q8_K     T < 8: vec_dot, 8 lanes; T >= 8: the tiled kernel   iqgrid, tiled
    IQ1_S, IQ1_M                Q8_K     as above, the delta term apart below 8 rows         iqgrid, tiled
    TQ1_0, TQ2_0                Q8_K     vec_dot (every shape)                               ternary
    MXFP4                       Q8_0     repacked 8x8 gemv/gemm (out % 8 == 0), else vec_dot mxfp4
    NVFP4, Q1_0                 Q8_0     vec_dot (every shape)                               nvfp4, q1_0

Every vec_dot keeps 8 f32 lanes; lane L of a 32-element chunk holds elements 4L..4L+3 (`maddubs` + `madd`),
so per super-block (or Q8_0 block) the kernels first sum the exact integers of each lane (`_lanes`, a loop
LLVM vectorizes), then run the lane's f32 steps with explicit FMAs (`fma_f32`: ggml's `_mm256_fmadd_ps`, never
contracted elsewhere: these kernels are compiled without fast-math). Integer sums never overflow: the largest,
sc * w * q over 256 elements of IQ3_XXS, is below 2^26.
"""

from __future__ import annotations

import numpy as np

from ..constants import GGMLType
from ._numba import fma_f32, half_to_float, jit, prange, use_threads
from .rawblocks import BLOCK_TYPES, _decode

__all__ = ["KERNELS", "Q8_0", "Q8_K"]

Q8_0, Q8_K = "Q8_0", "Q8_K"  # activation formats, as int8dot names them
TILED_MIN_BATCH = 8  # tiled.cpp `ggml_tiled_min_batch`: the grid types' tiled kernel from 8 activation rows
ROWS_PER_TASK = 16  # weight rows per parallel task (scratch buffers are allocated per task)


@jit(inline=True)
def _u16(b, o):
    return np.int64(b[o]) | (np.int64(b[o + 1]) << 8)


@jit(inline=True)
def _hsum8(a):
    """arch/x86/quants.c `hsum_float_8`: r_i = a[i + 4] + a[i]; (r0 + r2) + (r1 + r3)."""
    r0, r1, r2, r3 = a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]
    return (r0 + r2) + (r1 + r3)


@jit(inline=True)
def _lanes(vs, q, qo, n, lanes, acc):
    """lanes[L] = sum over the 32-element chunks c < n / 32 of vs[32c + j] * q[qo + 32c + j], j in 4L..4L+3:
    the 32-bit lanes of `maddubs` + `madd` (exact integers). The products go to acc (int32[32]) one chunk at a
    time, then into the lanes: measured faster than accumulating into acc across chunks."""
    for L in range(8):
        lanes[L] = 0
    for c in range(n // 32):
        o = 32 * c
        for j in range(32):
            acc[j] = np.int32(vs[o + j]) * np.int32(q[qo + o + j])
        for L in range(8):
            lanes[L] += acc[4 * L] + acc[4 * L + 1] + acc[4 * L + 2] + acc[4 * L + 3]


@jit(inline=True)
def _dot(vs, q, qo, n):
    """sum of vs[k] * q[qo + k], k < n: exact integers (the tiled kernel's s1, a block's isum)."""
    total = np.int32(0)
    for k in range(n):
        total += np.int32(vs[k]) * np.int32(q[qo + k])
    return total


# -- the grid types: fp16 d and the integer scales 2 ls + 1 of each sub-block (the layouts: quants/iqgrid.py) -----
@jit(inline=True)
def _grid_scales(kind, b, o, isc):
    """Block at b[o:] of rawblocks kind `kind` -> its fp16 d as f32; isc[s] = 2 ls + 1 per sub-block."""
    if kind == 0:  # IQ2_XXS: ls = the top 4 bits of the second u32 of each 8-byte group
        for s in range(8):
            isc[s] = 2 * (np.int64(b[o + 2 + 8 * s + 7]) >> 4) + 1
    elif kind == 1 or kind == 2:  # IQ2_XS (scales at 66), IQ2_S (at 74): a nibble per 16, low first
        at = 66 if kind == 1 else 74
        for s in range(16):
            isc[s] = 2 * ((np.int64(b[o + at + s // 2]) >> (4 * (s % 2))) & 15) + 1
    elif kind == 3:  # IQ3_XXS: ls = the top 4 bits of the u32 at 66 + 4s
        for s in range(8):
            isc[s] = 2 * (np.int64(b[o + 66 + 4 * s + 3]) >> 4) + 1
    elif kind == 4:  # IQ3_S: a nibble per 32 at 106, low first
        for s in range(8):
            isc[s] = 2 * ((np.int64(b[o + 106 + s // 2]) >> (4 * (s % 2))) & 15) + 1
    elif kind == 5:  # IQ1_S: bits 12-14 of the u16 at 34 + 2s
        for s in range(8):
            isc[s] = 2 * ((_u16(b, o + 34 + 2 * s) >> 12) & 7) + 1
    else:  # IQ1_M: 3 bits per 16 in the four u16 at 48; d from their top nibbles
        bits = np.int64(0)
        for i in range(4):
            u = _u16(b, o + 48 + 2 * i)
            bits |= (u >> 12) << (4 * i)
            for k in range(4):
                isc[4 * i + k] = 2 * ((u >> (3 * k)) & 7) + 1
        return half_to_float(np.uint16(bits))
    return half_to_float(np.uint16(_u16(b, o)))


@jit
def _grid_task(kind, ts, sub, c, r0, r1, w, aq, ad, out):
    """Weight rows r0..r1-1 (`kind`: rawblocks' code) times every activation row. T < 8: the type's vec_dot
    (IQ1_S / IQ1_M: the grid values g and the delta signs in separate sums); T >= 8: the tiled kernel."""
    T = aq.shape[0]
    nb = aq.shape[1] // 256
    v = np.empty(256, np.int8)
    words = v.view(np.uint64)
    scf = np.empty(16, np.float32)
    isc = np.empty(16, np.int64)
    vs = np.empty(256, np.int16)  # sc * value (tiled, vec_dot) or sc * g (IQ1 vec_dot)
    vd = np.empty(256, np.int16)  # IQ1 vec_dot: sc * delta
    lanes = np.empty(8, np.int32)
    dlanes = np.empty(8, np.int32)
    scratch = np.empty(32, np.int32)
    acc = np.zeros((T, 8), np.float32)
    acc2 = np.zeros((T, 8), np.float32)
    tiled = T >= TILED_MIN_BATCH
    iq1 = kind >= 5
    cf = np.float32(c)
    for r in range(r0, r1):
        acc[:] = 0.0
        acc2[:] = 0.0
        for blk in range(nb):
            o = r * nb * ts + blk * ts
            _decode(kind, w, o, v, words, scf)
            d_w = _grid_scales(kind, w, o, isc)
            if iq1 and not tiled:  # v = 8 g + delta, delta = +-1: g = (v + 4) >> 3
                for j in range(256 // sub):
                    s = isc[j]
                    for k in range(sub * j, sub * j + sub):
                        g = (np.int64(v[k]) + 4) >> 3
                        vs[k] = s * g
                        vd[k] = s * (np.int64(v[k]) - 8 * g)
            else:
                for j in range(256 // sub):
                    s = np.int16(isc[j])
                    for k in range(sub * j, sub * j + sub):
                        vs[k] = s * np.int16(v[k])
            qo = 256 * blk
            if tiled:  # p = fl(f32(s1) * fl(d_w * c)); acc = fma(p, d_a, acc)
                dc = d_w * cf
                for t in range(T):
                    p = np.float32(_dot(vs, aq[t], qo, 256)) * dc
                    acc[t, 0] = fma_f32(p, ad[t, blk], acc[t, 0])
                continue
            for t in range(T):
                d = ad[t, blk] * d_w
                _lanes(vs, aq[t], qo, 256, lanes, scratch)
                for L in range(8):
                    acc[t, L] = fma_f32(d, np.float32(lanes[L]), acc[t, L])
                if iq1:
                    _lanes(vd, aq[t], qo, 256, dlanes, scratch)
                    if kind == 5:  # IQ1_S: one scalar accumulator of the delta sums
                        total = np.int32(0)
                        for L in range(8):
                            total += dlanes[L]
                        acc2[t, 0] = fma_f32(d, np.float32(total), acc2[t, 0])
                    else:
                        for L in range(8):
                            acc2[t, L] = fma_f32(d, np.float32(dlanes[L]), acc2[t, L])
        for t in range(T):
            if tiled:
                out[t, r] = acc[t, 0]
            elif kind == 5:
                out[t, r] = _hsum8(acc[t]) + np.float32(0.125) * acc2[t, 0]
            elif kind == 6:
                out[t, r] = _hsum8(acc[t]) + np.float32(0.125) * _hsum8(acc2[t])
            else:
                out[t, r] = cf * _hsum8(acc[t])


@jit(parallel=True)
def _mv_grid(nt, kind, ts, sub, c, w, aq, ad, out):
    previous = use_threads(nt)
    rows = out.shape[1]
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _grid_task(kind, ts, sub, c, r0, min(rows, r0 + ROWS_PER_TASK), w.reshape(-1), aq, ad, out)
    use_threads(previous)


# -- the ternary types: q = v + 1 in {0, 1, 2}, lanes of q * y minus the 32-element chunk sums ------------------
@jit
def _ternary_task(kind, ts, r0, r1, w, aq, ad, bsums, out):
    """`ggml_vec_dot_tq{1,2}_0_q8_K` (AVX2): I_L = sum_{lane L} q y - (bsum 2L + bsum 2L+1);
    acc[L] = fma(float(I_L), fl(d_a * d_w), acc[L]); y = hsum_float_8(acc)."""
    T = aq.shape[0]
    nb = aq.shape[1] // 256
    v = np.empty(256, np.int8)
    words = v.view(np.uint64)
    scf = np.empty(16, np.float32)
    vs = np.empty(256, np.int16)
    lanes = np.empty(8, np.int32)
    scratch = np.empty(32, np.int32)
    acc = np.zeros((T, 8), np.float32)
    for r in range(r0, r1):
        acc[:] = 0.0
        for blk in range(nb):
            _decode(kind, w, r * nb * ts + blk * ts, v, words, scf)  # scf[0]: the fp16 d
            for k in range(256):
                vs[k] = np.int16(v[k]) + np.int16(1)
            for t in range(T):
                d = ad[t, blk] * scf[0]
                _lanes(vs, aq[t], 256 * blk, 256, lanes, scratch)
                for L in range(8):
                    chunk = np.int32(bsums[t, 16 * blk + 2 * L]) + np.int32(bsums[t, 16 * blk + 2 * L + 1])
                    acc[t, L] = fma_f32(np.float32(lanes[L] - chunk), d, acc[t, L])
        for t in range(T):
            out[t, r] = _hsum8(acc[t])


@jit(parallel=True)
def _mv_ternary(nt, kind, ts, w, aq, ad, bsums, out):
    previous = use_threads(nt)
    rows = out.shape[1]
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _ternary_task(kind, ts, r0, min(rows, r0 + ROWS_PER_TASK), w.reshape(-1), aq, ad, bsums, out)
    use_threads(previous)


# -- the Q8_0 types: MXFP4 (32 per block), NVFP4 (64), Q1_0 (128) ------------------------------------------------
@jit
def _q8_0_task(kind, ts, bs, r0, r1, w, aq, ad, out):
    """Per weight row: MXFP4 repacked (out % 8 == 0: acc = fma(float(isum_b), fl(d_w d_a), acc), one lane) or
    its vec_dot (blocks alternating between two 8-lane accumulators, an odd last block added in scalar code);
    NVFP4 (lanes 0-3 scaled by the first 16-element sub-block, 4-7 by the second); Q1_0 (per Q1_0 block, its
    four Q8_0 blocks into blk = d_a0 * lane, then fma(d_a, lane, blk), then acc = fma(d_w, blk, acc))."""
    T = aq.shape[0]
    nbw = aq.shape[1] // bs  # weight blocks per row
    v = np.empty(256, np.int8)
    words = v.view(np.uint64)
    scf = np.empty(16, np.float32)
    vs = np.empty(128, np.int16)
    lanes = np.empty(8, np.int32)
    scratch = np.empty(32, np.int32)
    acc = np.zeros((T, 16), np.float32)  # MXFP4 vec_dot: two accumulators of 8 lanes
    blk8 = np.empty(8, np.float32)
    repacked = kind == 9 and out.shape[1] % 8 == 0
    for r in range(r0, r1):
        acc[:] = 0.0
        for blk in range(nbw):
            o = r * nbw * ts + blk * ts
            _decode(kind, w, o, v, words, scf)
            for k in range(bs):
                vs[k] = np.int16(v[k])
            qo = bs * blk
            nb32 = bs // 32
            for t in range(T):
                q = aq[t]
                if kind == 9:  # MXFP4
                    d = ad[t, blk] * scf[0]
                    if repacked:
                        acc[t, 0] = fma_f32(np.float32(_dot(vs, q, qo, 32)), d, acc[t, 0])
                    elif blk == nbw - 1 and nbw % 2:  # written into out below
                        continue
                    else:
                        _lanes(vs, q, qo, 32, lanes, scratch)
                        a0 = 8 * (blk % 2)
                        for L in range(8):
                            acc[t, a0 + L] = fma_f32(d, np.float32(lanes[L]), acc[t, a0 + L])
                elif kind == 10:  # NVFP4: Q8_0 blocks 2 blk, 2 blk + 1; sub-blocks of 16
                    for h in range(2):
                        _lanes(vs[32 * h :], q, qo + 32 * h, 32, lanes, scratch)
                        lo = ad[t, nb32 * blk + h] * scf[2 * h]
                        hi = ad[t, nb32 * blk + h] * scf[2 * h + 1]
                        for L in range(8):
                            acc[t, L] = fma_f32(lo if L < 4 else hi, np.float32(lanes[L]), acc[t, L])
                else:  # Q1_0: scf[0] is d
                    for k in range(4):
                        _lanes(vs[32 * k :], q, qo + 32 * k, 32, lanes, scratch)
                        da = ad[t, nb32 * blk + k]
                        for L in range(8):
                            if k == 0:
                                blk8[L] = da * np.float32(lanes[L])
                            else:
                                blk8[L] = fma_f32(da, np.float32(lanes[L]), blk8[L])
                    for L in range(8):
                        acc[t, L] = fma_f32(scf[0], blk8[L], acc[t, L])
        for t in range(T):
            if repacked:
                out[t, r] = acc[t, 0]
                continue
            if kind == 9:
                a = acc[t]
                for L in range(8):
                    a[L] = a[L] + a[8 + L]
                y = _hsum8(a)
                if nbw % 2:  # the odd last block: y + d * isum, an f32 multiply and an f32 add
                    o = r * nbw * ts + (nbw - 1) * ts
                    _decode(kind, w, o, v, words, scf)
                    for k in range(32):
                        vs[k] = np.int16(v[k])
                    d = ad[t, nbw - 1] * scf[0]
                    y = y + d * np.float32(_dot(vs, aq[t], 32 * (nbw - 1), 32))
                out[t, r] = y
            else:
                out[t, r] = _hsum8(acc[t])


@jit(parallel=True)
def _mv_q8_0(nt, kind, ts, bs, w, aq, ad, out):
    previous = use_threads(nt)
    rows = out.shape[1]
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _q8_0_task(kind, ts, bs, r0, min(rows, r0 + ROWS_PER_TASK), w.reshape(-1), aq, ad, out)
    use_threads(previous)


# -- the registry: int8dot calls kernel(nt, w, q, d, bsums, out) for Q8_K, kernel(nt, w, q, d, s, asum, out) ------
# type -> (rawblocks kind, block bytes, the vec_dot kernels' power-of-two factor c)
_GRID = {
    "IQ2_XXS": (66, 0.125),
    "IQ2_XS": (74, 0.125),
    "IQ2_S": (82, 0.125),
    "IQ3_XXS": (98, 0.25),
    "IQ3_S": (110, 1.0),
    "IQ1_S": (50, 0.125),
    "IQ1_M": (56, 0.125),
}
_TERNARY = {"TQ1_0": 54, "TQ2_0": 66}
_Q8_0_TYPES = {"MXFP4": 17, "NVFP4": 36, "Q1_0": 18}


def _grid_kernel(kind: int, ts: int, sub: int, c: float):
    def kernel(nt, w, aq, ad, bsums, out):
        _mv_grid(nt, kind, ts, sub, c, w, aq, ad, out)

    return kernel


def _ternary_kernel(kind: int, ts: int):
    def kernel(nt, w, aq, ad, bsums, out):
        _mv_ternary(nt, kind, ts, w, aq, ad, bsums, out)

    return kernel


def _q8_0_kernel(kind: int, ts: int, bs: int):
    def kernel(nt, w, aq, ad, s, asum, out):
        _mv_q8_0(nt, kind, ts, bs, w, aq, ad, out)

    return kernel


def _registry() -> dict:
    out = {}
    for name, (ts, c) in _GRID.items():
        f = BLOCK_TYPES[GGMLType[name]]
        out[GGMLType[name]] = (Q8_K, ts, 256, _grid_kernel(f.kind, ts, f.sub, c))
    for name, ts in _TERNARY.items():
        out[GGMLType[name]] = (Q8_K, ts, 256, _ternary_kernel(BLOCK_TYPES[GGMLType[name]].kind, ts))
    for name, ts in _Q8_0_TYPES.items():
        f = BLOCK_TYPES[GGMLType[name]]
        out[GGMLType[name]] = (Q8_0, ts, f.block_size, _q8_0_kernel(f.kind, ts, f.block_size))
    return out


KERNELS = _registry()
"""GGML type -> (activation format, block bytes, elements per block, kernel): `int8dot.INT8_TYPES` entries."""
