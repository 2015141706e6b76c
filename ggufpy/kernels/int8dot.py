"""Integer dot products for the llamacpp numerics: int8 activations times the weight's blocks as stored.

    iw = int8dot.weight(w)                 # None: no integer kernel for this type / shape / CPU
    y = int8dot.linear(x, iw, threads=2)   # x (T, in) f32 -> (T, out) f32, bit-identical to vecdot.linear_x86

llama.cpp never multiplies quantized weights by f32 activations: each activation row is quantized to the
weight's vec_dot type (Q8_0, Q8_1 or Q8_K) and the block dots are integer (`vpmaddubsw`, `vpmaddwd`), then
scaled per block in f32. The kernels here do the same (`int8ir.py`: AVX2 IR, one weight row . one activation
row per call) over the GGUF rows as stored, each weight byte read once per call, and 32 multiply-adds per
instruction instead of unpacking every weight to f32. Q4_0, Q4_K and Q8_0 (out % 8 == 0) are the exception:
they are copied into groups of eight rows that stream as one (`interleaved`, as ggml repacks them), and the
file's pages are released after the copy, so they too are resident once (1.0x). Measured at 1B on one thread,
decode was 1.7x (Q4_0) and 2x (Q4_K_M) the GGUF-row kernels: eight short row streams (1152 bytes each at dim
2048) starve the hardware prefetcher, one long stream does not (docs/performance.md). Q8_0 keeps ggml's
per-row vec_dot (llama.cpp does not repack it on x86): its groups give eight independent FMA chains
(`int8ir_q8_0_x8`). For prefill, the grouped Q4_K gemm and
Q6_K's tiled kernel unpack each weight block once for all activation rows (`int8ir_x8_gemm.py`, as ggml's
repacked gemm does for four). Since the integer sums are
exact and the f32 steps follow the ggml kernel that `ggufpy.quants.x86` replays for the type and shape
(`ggufpy.quants.x86.kernel_for`), the result equals the NumPy backend's llamacpp numerics bit for bit, for
every T (decode and prefill):

    type        vec_dot  kernel replayed (ggufpy.quants.x86)                      module
    Q4_0        Q8_0     repacked 8x8 gemv/gemm (out % 8 == 0), else vec_dot        repack_q8_0, llamafile
    Q5_0, Q8_0  Q8_0     vec_dot / tinyBLAS (the same rounding sequence)            llamafile
    Q4_1, Q5_1  Q8_1     vec_dot                                                    legacy
    Q4_K        Q8_K     repacked 8x8 gemm (rows < T - T % 4) / gemv (out % 8 == 0) repack
    Q6_K        Q8_K     vec_dot (T < 8), tiled (T >= 8)                            kquants, tiled
    Q5_K, Q3_K  Q8_K     vec_dot (T < 8), tiled (T >= 8) (`int8ir_k5.py`)           kquants, tiled
    issue 12's  ...      `int8lowbit.KERNELS` (IQ1-IQ3, TQ, MXFP4, NVFP4, Q1_0)     their modules

Other types (Q2_K, IQ4_NL, IQ4_XS ...; Q4_K with out % 8 != 0, whose vec_dot has its own lane order) keep the
f32-lane kernels of `matvec.py`. The activations are quantized here as
`ggufpy.quants.vecdot.quantize_activations` does (x86 Q8_0/Q8_1, reference Q8_K), in the arrays the intrinsics
read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import GGMLType
from ..weights import QuantTensor
from ._numba import DISABLED, get_threads, jit, prange, use_threads
from .activations import f16_bits_to_f32, f32_to_f16_bits
from .layout import release_pages

__all__ = ["AVAILABLE", "INT8_TYPES", "Activations", "Int8Weight", "interleaved", "linear", "quantize", "weight"]

Q8_0, Q8_1, Q8_K = "Q8_0", "Q8_1", "Q8_K"  # activation formats (ggml vec_dot types)


def _avx2() -> bool:
    """Whether the CPU numba compiles for has AVX2 (the intrinsics' `vpmaddubsw` / `vpmaddwd`)."""
    try:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        return bool(llvm.get_host_cpu_features().get("avx2"))
    except Exception:  # no feature string on this platform: keep the f32 kernels
        return False


AVAILABLE = not DISABLED and _avx2()

# type -> (activation format, block bytes, elements per block)
INT8_TYPES = {
    GGMLType.Q4_0: (Q8_0, 18, 32),
    GGMLType.Q5_0: (Q8_0, 22, 32),
    GGMLType.Q8_0: (Q8_0, 34, 32),
    GGMLType.Q4_1: (Q8_1, 20, 32),
    GGMLType.Q5_1: (Q8_1, 24, 32),
    GGMLType.Q4_K: (Q8_K, 144, 256),
    GGMLType.Q6_K: (Q8_K, 210, 256),
}


# -- activations ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Activations:
    """T rows quantized to `fmt`: q int8 (T, C); d f32 (T, nb) (fp16 values for Q8_0/Q8_1, f32 for Q8_K);
    s f32 (T, nb) Q8_1's fp16 d * sum q; asum int32 (T, C / 4) sums of 4 quants (Q8_0, for the zero points of
    Q4_0/Q5_0); bsums int16 (T, C / 16) (Q8_K)."""

    fmt: str
    q: np.ndarray
    d: np.ndarray
    s: np.ndarray
    asum: np.ndarray
    bsums: np.ndarray


@jit(inline=True)
def _f16(x):
    """x rounded to fp16 and back (`GGML_CPU_FP16_TO_FP32(GGML_CPU_FP32_TO_FP16(x))`)."""
    return f16_bits_to_f32(f32_to_f16_bits(x))


@jit
def _quantize_q8_0(x, with_s, q, d, s, asum):
    """arch/x86/quants.c `quantize_row_q8_0` / `_q8_1`: d = amax / 127, q = rint(x * (127 / amax))."""
    T, C = x.shape
    for t in range(T):
        for b in range(C // 32):
            o = 32 * b
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[t, o + j]))
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            total = 0
            for j in range(0, 32, 4):
                lane = 0
                for k in range(4):
                    v = np.int32(np.rint(x[t, o + j + k] * inv))
                    q[t, o + j + k] = v
                    lane += v
                asum[t, (o + j) // 4] = lane
                total += lane
            dv = amax / np.float32(127.0)
            d[t, b] = _f16(dv)
            s[t, b] = _f16(dv * np.float32(total)) if with_s else np.float32(0.0)


@jit
def _quantize_q8_k(x, q, d, bsums):
    """`quantize_row_q8_K_ref`: iscale = -127 / (the signed absmax, first on ties), q = min(127, rint(iscale
    * x)), d = 1 / iscale; bsums over 16 quants. All-zero blocks: d = 0, q = 0."""
    T, C = x.shape
    for t in range(T):
        for b in range(C // 256):
            o = 256 * b
            amax = np.float32(0.0)
            peak = np.float32(0.0)
            for j in range(256):
                ax = abs(x[t, o + j])
                if ax > amax:
                    amax = ax
                    peak = x[t, o + j]
            iscale = np.float32(-127.0) / peak if amax != 0 else np.float32(0.0)
            d[t, b] = np.float32(1.0) / iscale if amax != 0 else np.float32(0.0)
            for g in range(16):
                total = 0
                for k in range(o + 16 * g, o + 16 * g + 16):
                    v = np.int32(min(np.rint(iscale * x[t, k]), np.float32(127.0)))
                    q[t, k] = v
                    total += v
                bsums[t, (o >> 4) + g] = total


_NONE_F32 = np.zeros((1, 1), np.float32)
_NONE_I32 = np.zeros((1, 1), np.int32)
_NONE_I16 = np.zeros((1, 1), np.int16)


def quantize(x: np.ndarray, fmt: str) -> Activations:
    """f32 rows (T, C) -> `Activations` in `fmt`, the values `vecdot.quantize_activations` stores."""
    x = np.ascontiguousarray(x, np.float32)
    T, C = x.shape
    q = np.empty((T, C), np.int8)
    if fmt == Q8_K:
        d, bsums = np.empty((T, C // 256), np.float32), np.empty((T, C // 16), np.int16)
        _quantize_q8_k(x, q, d, bsums)
        return Activations(fmt, q, d, _NONE_F32, _NONE_I32, bsums)
    d, s = np.empty((T, C // 32), np.float32), np.empty((T, C // 32), np.float32)
    asum = np.empty((T, C // 4), np.int32)
    _quantize_q8_0(x, fmt == Q8_1, q, d, s, asum)
    return Activations(fmt, q, d, s, asum, _NONE_I16)


# -- the kernels: weight rows in parallel, each row against every activation row ----------------------------------
if AVAILABLE:
    from . import int8ir, int8ir_x8, int8ir_x8_gemm

    _Q4_0_BLOCK8 = int8ir_x8.q4_0_dot8()
    _Q4_0_X8 = int8ir_x8.q4_0x8_dot()
    _block_major = jit(int8ir_x8_gemm.block_major)
    _Q4_0_LANES = int8ir.q0_dot("q4_0", lanes=True)
    _Q5_0 = int8ir.q0_dot("q5_0", lanes=True)
    _Q8_0 = int8ir.q0_dot("q8_0", lanes=True)
    _Q4_1 = int8ir.q0_dot("q4_1", lanes=True)
    _Q5_1 = int8ir.q0_dot("q5_1", lanes=True)
    _Q4_K_GEMV8 = int8ir_x8.q4_k_dot8()
    _Q4_K_GEMM = int8ir.q4_k_dot(64)
    _Q4_K_GEMV8_X8 = int8ir_x8.q4_k_dot8(grouped=True)
    _Q4_K_GEMM_X8 = int8ir_x8_gemm.q4_kx8_gemm()
    _Q6_K_LANES = int8ir.q6_k_dot(lanes=True)
    _Q6_K_TILED = int8ir_x8_gemm.q6_k_gemm()

    # One kernel per (type, kernel variant): numba compiles only those a model's types call.
    @jit(parallel=True)
    def _mv_q4_0_block(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        nb = aq.shape[1] // 32
        for r8 in prange(w.shape[0] // 8):
            for t in range(aq.shape[0]):
                _Q4_0_BLOCK8(w, 8 * r8, aq, t, ad, s, asum, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _mv_q4_0x8(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        nb = aq.shape[1] // 32
        for g in prange(w.shape[0]):
            for t in range(aq.shape[0]):
                _Q4_0_X8(w, g, aq, t, ad, s, asum, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _mv_q4_0_lanes(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        nb = aq.shape[1] // 32
        for r in prange(w.shape[0]):
            for t in range(aq.shape[0]):
                out[t, r] = _Q4_0_LANES(w, r, aq, t, ad, s, asum, nb)
        use_threads(previous)

    @jit(parallel=True)
    def _mv_q5_0(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        nb = aq.shape[1] // 32
        for r in prange(w.shape[0]):
            for t in range(aq.shape[0]):
                out[t, r] = _Q5_0(w, r, aq, t, ad, s, asum, nb)
        use_threads(previous)

    @jit(parallel=True)
    def _mv_q8_0(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        nb = aq.shape[1] // 32
        for r in prange(w.shape[0]):
            for t in range(aq.shape[0]):
                out[t, r] = _Q8_0(w, r, aq, t, ad, s, asum, nb)
        use_threads(previous)

    @jit(parallel=True)
    def _mv_q4_1(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        nb = aq.shape[1] // 32
        for r in prange(w.shape[0]):
            for t in range(aq.shape[0]):
                out[t, r] = _Q4_1(w, r, aq, t, ad, s, asum, nb)
        use_threads(previous)

    @jit(parallel=True)
    def _mv_q5_1(nt, w, aq, ad, s, asum, out):
        previous = use_threads(nt)
        nb = aq.shape[1] // 32
        for r in prange(w.shape[0]):
            for t in range(aq.shape[0]):
                out[t, r] = _Q5_1(w, r, aq, t, ad, s, asum, nb)
        use_threads(previous)

    @jit(parallel=True)
    def _mv_q4_k(nt, w, aq, ad, bsums, out):
        """Rows t < T - T % 4 as the repacked gemm (one FMA per 64 elements), the rest as its gemv."""
        previous = use_threads(nt)
        T = aq.shape[0]
        nb = aq.shape[1] // 256
        n_gemm = T - T % 4
        for r8 in prange(w.shape[0] // 8):
            for t in range(n_gemm):
                for r in range(8 * r8, 8 * r8 + 8):
                    out[t, r] = _Q4_K_GEMM(w, r, aq, t, ad, bsums, nb)
            for t in range(n_gemm, T):
                _Q4_K_GEMV8(w, 8 * r8, aq, t, ad, bsums, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _mv_q4_kx8(nt, w, aq, ad, bsums, out):
        """`_mv_q4_k` over eight-row groups (`interleaved`)."""
        previous = use_threads(nt)
        T = aq.shape[0]
        nb = aq.shape[1] // 256
        n_gemm = T - T % 4
        if n_gemm:  # each super-block of a group decoded once for all n_gemm rows
            aqb, adb = _block_major(aq, n_gemm, 256), np.ascontiguousarray(ad[:n_gemm].T)
            bsb = _block_major(bsums, n_gemm, 16)
        for g in prange(w.shape[0]):
            if n_gemm:
                _Q4_K_GEMM_X8(w, g, aqb, n_gemm, adb, bsb, nb, out, np.empty((n_gemm, 8), np.float32))
            for t in range(n_gemm, T):
                _Q4_K_GEMV8_X8(w, 8 * g, aq, t, ad, bsums, nb, out)
        use_threads(previous)

    @jit(parallel=True)
    def _mv_q6_k(nt, w, aq, ad, bsums, out):
        """T < 8: vec_dot (8 f32 lanes); T >= 8: the tiled kernel (one f32 lane per output), each block of a
        row unpacked once for all T rows."""
        previous = use_threads(nt)
        T = aq.shape[0]
        nb = aq.shape[1] // 256
        if T >= 8:
            aqb, adb, bsb = _block_major(aq, T, 256), np.ascontiguousarray(ad.T), _block_major(bsums, T, 16)
        for r in prange(w.shape[0]):
            if T < 8:
                for t in range(T):
                    out[t, r] = _Q6_K_LANES(w, r, aq, t, ad, bsums, nb)
            else:
                _Q6_K_TILED(w, r, aqb, T, adb, bsb, nb, out)
        use_threads(previous)

    _Q0_KERNELS = {
        GGMLType.Q4_0: _mv_q4_0_lanes,
        GGMLType.Q5_0: _mv_q5_0,
        GGMLType.Q8_0: _mv_q8_0,
        GGMLType.Q4_1: _mv_q4_1,
        GGMLType.Q5_1: _mv_q5_1,
    }
    _K_KERNELS = {GGMLType.Q4_K: _mv_q4_k, GGMLType.Q6_K: _mv_q6_k}
    _GROUPED = {GGMLType.Q4_0: _mv_q4_0x8, GGMLType.Q4_K: _mv_q4_kx8}  # the kernels of `interleaved` weights
    from . import int8ir_q8_0_x8

    _GROUPED[GGMLType.Q8_0] = int8ir_q8_0_x8.q8_0x8_kernel  # ggml's vec_dot per row, eight rows in one stream
    _GROUP_COPIES = {GGMLType.Q8_0: int8ir_q8_0_x8.interleave_q8_0}  # group copies kept beside their kernel
    from . import int8ir_fp4_x8

    _GROUPED[GGMLType.MXFP4] = int8ir_fp4_x8.mxfp4x8_kernel  # the repacked gemv / gemm's order, as the rows' kernel
    _GROUP_COPIES[GGMLType.MXFP4] = int8ir_fp4_x8.interleave_mxfp4

    # issue 12's types (IQ1-IQ3, TQ, MXFP4, NVFP4, Q1_0): type -> (format, block bytes, elements, kernel)
    from .int8lowbit import KERNELS as _LOWBIT

    INT8_TYPES.update({t: k[:3] for t, k in _LOWBIT.items()})
    _K_KERNELS.update({t: k[3] for t, k in _LOWBIT.items()})  # Q8_0 ones too: `weight` looks up both dicts
    from .int8ir_k5 import KERNELS as _K5_K3  # Q5_K, Q3_K: vec_dot (T < 8), tiled (T >= 8), as Q6_K

    INT8_TYPES.update({t: k[:3] for t, k in _K5_K3.items()})
    _K_KERNELS.update({t: k[3] for t, k in _K5_K3.items()})


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """A weight's GGUF rows, u8 (rows, row_bytes) (a view of the file), and the kernel that multiplies them."""

    type: GGMLType
    rows: int
    cols: int
    fmt: str
    raw: np.ndarray
    kernel: object
    k_type: bool  # Q8_K activations: the kernel takes bsums, not s / asum

    def __post_init__(self):
        # read-only always, as a file's pages are: numba compiles a kernel once per argument type, and a
        # writable weight (a copy, a test's array) is another type (~57 s of duplicate compiles per cold run)
        if self.raw.flags.writeable:
            raw = self.raw.view()
            raw.flags.writeable = False
            object.__setattr__(self, "raw", raw)


def weight(w: QuantTensor, interleave: bool = True) -> Int8Weight | None:
    """The integer-kernel form of `w`, or None when it has none (type, shape, CPU): then the f32 kernels run.
    Q4_0 with out % 8 == 0 is repacked by llama.cpp (one lane per output); Q4_K with out % 8 != 0 runs a
    vec_dot whose lanes are not written here. `interleave`: copy Q4_0, Q4_K and Q8_0 into eight-row groups
    (`interleaved`); False keeps the GGUF rows (the kernels before, for comparison: scripts/bench_int8.py)."""
    if not AVAILABLE or w.type not in INT8_TYPES or len(w.shape) != 2:
        return None
    rows, cols = w.shape
    fmt, size, block = INT8_TYPES[w.type]
    if cols % block or (w.type == GGMLType.Q4_K and rows % 8):
        return None
    if w.type == GGMLType.Q4_0 and rows % 8 == 0:
        kernel = _mv_q4_0_block
    else:
        kernel = _Q0_KERNELS.get(w.type) or _K_KERNELS[w.type]
    raw = np.asarray(w.raw).reshape(-1).view(np.uint8).reshape(rows, cols // block * size)
    iw = Int8Weight(w.type, rows, cols, fmt, raw, kernel, fmt == Q8_K)
    return (interleave and interleaved(iw)) or iw


def interleaved(iw: Int8Weight) -> Int8Weight | None:
    """Q4_0, Q4_K or Q8_0 rows copied into groups of eight that stream as one (`int8ir_x8`: Q4_0's layout is
    drawn there, Q4_K's is block b of the eight rows side by side; Q8_0's in `int8ir_q8_0_x8`), or None for
    other types and shapes. Same products bit for bit; the file's pages are released after the copy (1.0x its
    bytes resident, not 2x)."""
    if iw.type not in _GROUPED or iw.rows % 8 or iw.raw.shape[0] != iw.rows:
        return None
    if iw.type in _GROUP_COPIES:  # Q8_0 (`int8ir_q8_0_x8`): copied chunk by chunk, pages released as it goes
        out = _GROUP_COPIES[iw.type](iw.raw)
        release_pages(iw.raw)
        return Int8Weight(iw.type, iw.rows, iw.cols, iw.fmt, out, _GROUPED[iw.type], iw.k_type)
    word = np.dtype(np.uint16 if iw.type == GGMLType.Q4_0 else np.uint64)  # fewer, wider element copies
    G, size = iw.rows // 8, INT8_TYPES[iw.type][1] // word.itemsize
    nb = iw.raw.shape[1] // word.itemsize // size
    blocks = iw.raw.view(word).reshape(G, 8, nb, size)  # (group, row in group, block, words)
    out = np.empty((G, nb, 8 * size), word)
    if iw.type == GGMLType.Q4_0:  # int8ir_x8's layout: 8 d, then the qs of rows (0, 4), (1, 5), (2, 6), (3, 7)
        out[:, :, :8] = blocks[..., 0].transpose(0, 2, 1)
        qs = blocks[..., 1:].reshape(G, 2, 4, nb, 8).transpose(0, 3, 2, 1, 4)  # (G, nb, 4, 2, 8)
        out[:, :, 8:].reshape(G, nb, 4, 2, 8)[:] = qs
    else:  # Q4_K: block b of rows 8g..8g+7 side by side
        out.reshape(G, nb, 8, size)[:] = blocks.transpose(0, 2, 1, 3)
    out = out.reshape(G, -1).view(np.uint8)
    release_pages(iw.raw)
    return Int8Weight(iw.type, iw.rows, iw.cols, iw.fmt, out, _GROUPED[iw.type], iw.k_type)


def product(a: Activations, iw: Int8Weight, threads: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """Quantized activation rows times the weight: f32 (T, rows)."""
    T = a.q.shape[0]
    if out is None:
        out = np.empty((T, iw.rows), np.float32)
    nt = threads or get_threads()
    if iw.k_type:
        iw.kernel(nt, iw.raw, a.q, a.d, a.bsums, out)
    else:
        iw.kernel(nt, iw.raw, a.q, a.d, a.s, a.asum, out)
    return out


def linear(x: np.ndarray, iw: Int8Weight, threads: int = 0) -> np.ndarray:
    """x (T, cols) f32 times the weight transposed: (T, rows) f32, as `vecdot.linear_x86`."""
    return product(quantize(x, iw.fmt), iw, threads)
