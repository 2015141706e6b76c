"""Compilation options and thread control for every kernel: with `int8ir.py`, `int8ir_x8.py` (the LLVM IR of the
integer dot products) and `batched_ir.py` (the batched products), written against numba's intrinsic API, the only
modules that import numba.

Kernels are compiled lazily on first call and cached on disk (`cache=True`, in `__pycache__` next to the
source, or `NUMBA_CACHE_DIR`), stamped with a hash of every source they compile from (`_cache.py`). With
`NUMBA_DISABLE_JIT=1` the same functions run as plain Python (`prange` becomes `range`), which the test suite
uses on small shapes.
"""

from __future__ import annotations

import atexit
import os
import threading
import zlib

import numba
import numpy as np
from numba import prange

from . import _cache

_cache.install()  # before any kernel is decorated: numba picks a function's cache locator then

__all__ = [
    "DISABLED",
    "cache_is_cold",
    "call_native",
    "compile_in_background",
    "compiled_in_background",
    "default_threads",
    "fma_f32",
    "get_threads",
    "half_to_float",
    "jit",
    "load_cached",
    "native",
    "prange",
    "set_threads",
    "signature",
    "use_threads",
    "wait_for_compiles",
]

DISABLED = bool(numba.config.DISABLE_JIT)

# `reassoc` lets LLVM vectorize float reductions and `contract` fuse multiply-adds. Unlike fastmath=True it
# keeps NaN and inf semantics, so a NaN weight still poisons its output row as in the reference.
FAST = frozenset({"reassoc", "contract", "nsz"})
# A parallel kernel compiled with `reassoc` computed differently when compiled in this process than when
# loaded from numba's disk cache (its parfor body is optimized again where it is linked): two processes then
# disagreed in the last bits (issue 15, split == whole through Ray; tests/test_kernels_cache.py). So parallel
# kernels get `contract` only, and a reduction that must vectorize goes in a serial `fast` helper they call
# (`attention._dot`), which computes the same either way.


def jit(fn=None, *, parallel: bool = False, fast: bool = False, inline: bool = False):
    """`numba.njit` with ggufpy's options: on-disk cache, no GIL, NumPy error model (no ZeroDivisionError
    checks in inner loops). `fast` allows reassociation (reductions), which kernels that must be bit-exact
    (dequantization, activation quantization) do not use."""

    def wrap(f):
        options = {"cache": True, "nogil": True, "error_model": "numpy"}
        if parallel:
            options["parallel"] = True
        if fast:  # a parallel kernel without `reassoc`: see the comment at `FAST`
            options["fastmath"] = set(FAST - {"reassoc"} if parallel else FAST)
        if inline:
            options["inline"] = "always"
        return numba.njit(**options)(f)

    return wrap if fn is None else wrap(fn)


def _thread_count_intrinsics():
    """The threading layer's C `get_num_threads()` and `set_num_threads(int)`, called by symbol name.
    `numba.set_num_threads` inside a kernel goes through a ctypes pointer, which makes it uncacheable."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic
    from numba.np.ufunc.parallel import _launch_threads

    @intrinsic
    def get_count(typingctx):
        _launch_threads()  # registers the symbols

        def codegen(context, builder, signature, args):
            # declared as numba's parfor lowering declares it (returning intp); the C function returns an int
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(cgutils.intp_t, []), "get_num_threads")
            return builder.sext(builder.trunc(builder.call(fn, []), ir.IntType(32)), ir.IntType(64))

        return types.int64(), codegen

    @intrinsic
    def set_count(typingctx, n):
        _launch_threads()

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "set_num_threads")
            builder.call(fn, [builder.trunc(args[0], ir.IntType(32))])
            return context.get_dummy_value()

        return types.void(types.int64), codegen

    return get_count, set_count


def _half_to_float_intrinsic():
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def half_bits_to_float(typingctx, bits):
        """fp16 bits (uint16) -> float32 as LLVM `fpext half`: one `vcvtph2ps` per vector on F16C CPUs."""

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(types.uint16), codegen

    return half_bits_to_float


def _fma_f32_intrinsic():
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def fma_f32_llvm(typingctx, a, b, c):
        """a*b + c on float32, rounded once: LLVM's `llvm.fma.f32` (one `vfmadd` on FMA CPUs, else libm's
        fmaf). Never fused or split by fastmath flags, unlike `a * b + c` with `contract`."""

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
            return builder.call(fn, list(args))

        return types.float32(types.float32, types.float32, types.float32), codegen

    return fma_f32_llvm


def signature_key(types_) -> int:
    """A number naming a tuple of numba argument types (their printed form), for `call_native`'s check."""
    return zlib.crc32("|".join(str(t) for t in types_).encode()) & 0x7FFFFFFF


def _call_native_intrinsic():
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def call_native(typingctx, address, key, args):
        """Call the compiled function at `address` (from `native`) with the tuple `args`, as numba calls a
        compiled function: the caller compiles without the callee's code (nothing to link, optimize or
        generate again) and caches on disk, since the address is a run-time value. `key` must be the
        `signature_key` of the types `address` was compiled for; another raises TypeError."""
        if not isinstance(args, types.BaseTuple):
            return None
        argtys = tuple(args.types)
        expected = signature_key(argtys)

        def codegen(context, builder, signature, llargs):
            address, key, packed = llargs
            with cgutils.if_unlikely(builder, builder.icmp_signed("!=", key, ir.Constant(key.type, expected))):
                context.call_conv.return_user_exc(
                    builder, TypeError, ("call_native: the arguments' types differ from the compiled function's",)
                )
            fnty = context.call_conv.get_function_type(types.none, argtys)
            fn = builder.inttoptr(address, fnty.as_pointer())
            values = cgutils.unpack_tuple(builder, packed, len(argtys))
            status, _ = context.call_conv.call_function(builder, fn, types.none, argtys, values)
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            return context.get_dummy_value()

        return types.none(types.int64, types.int64, args), codegen

    return call_native


_PYTHON_FUNCTIONS: dict[int, object] = {}  # NUMBA_DISABLE_JIT: `native` addresses -> plain functions


def native(kernel, args: tuple) -> tuple[int, int]:
    """(address, key) of `kernel` (a `jit` function returning None) compiled for the types of `args`, for
    `call_native`: compiled now, or loaded from the disk cache, exactly for those types."""
    if DISABLED:
        _PYTHON_FUNCTIONS[id(kernel)] = kernel
        return id(kernel), 0
    sig = tuple(numba.typeof(a) for a in args)
    if sig not in kernel.overloads:  # (`compile` takes numba's compiler lock even when there is nothing to do)
        kernel.compile(sig)
    cres = kernel.overloads[sig]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name), signature_key(sig)


def signature(args: tuple) -> tuple:
    """The numba argument types of `args`: the key a kernel's compiled versions are stored under."""
    return tuple(numba.typeof(a) for a in args)


def load_cached(kernel, sig: tuple) -> bool:
    """Whether `kernel` is compiled for `sig` in this process, after loading it from the disk cache if it is
    there; never compiles (`Dispatcher.compile`'s cache branch, without its fall-through to the compiler)."""
    if DISABLED or sig in kernel.overloads:
        return True
    from numba.core.compiler_lock import global_compiler_lock

    with global_compiler_lock:
        if sig in kernel.overloads:
            return True
        cres = kernel._cache.load_overload(sig, kernel.targetctx)
        if cres is None:
            return False
        kernel._cache_hits[sig] += 1
        if not cres.objectmode:
            kernel.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
        kernel.add_overload(cres)
    return True


# Background compiles run in a worker process (`compile_worker`), not in a thread of this one: numba compiles
# under one lock per process, mostly in Python holding the GIL, so a compiling thread only delays the
# foreground's kernels; a second process compiles on the other core and this one loads its result from disk.
# Callers keep the two from compiling one function for different types at once: numba's cache index is read,
# extended and rewritten without a lock, so two writers could give both entries one data file.
ELSEWHERE = True

_JOBS: dict[tuple, threading.Event] = {}  # (kernel, argument types) -> set once compiled (or failed)
_JOBS_LOCK = threading.Lock()


def _compile(kernel, sig, done: threading.Event, check_cache: bool) -> None:
    from . import compile_worker

    try:
        if check_cache and load_cached(kernel, sig):
            return
        elsewhere = compile_worker.job(kernel, sig) if ELSEWHERE else None
        if elsewhere is None:
            kernel.compile(sig)
        else:  # load the worker's result, or compile here what it could not (not what it left: interrupted)
            elsewhere.wait()
            if not load_cached(kernel, sig) and getattr(elsewhere, "failed", False):
                kernel.compile(sig)
    except Exception:  # the caller's own call then compiles in the foreground and raises it
        pass
    finally:
        done.set()


def compile_in_background(kernel, sig: tuple, check_cache: bool = True) -> threading.Event:
    """Start loading `kernel` for the argument types `sig` from the disk cache (`check_cache`: a caller that
    just found it missing passes False), else compiling it in the worker process and then loading it, on a
    background thread; once per kernel and types. The event is set when this process has it."""
    with _JOBS_LOCK:
        done = _JOBS.get((kernel, sig))
        if done is None:
            done = _JOBS[kernel, sig] = threading.Event()
            if DISABLED or sig in kernel.overloads:
                done.set()
            else:
                thread = threading.Thread(
                    target=_compile, args=(kernel, sig, done, check_cache), name="ggufpy-compile", daemon=True
                )
                thread.start()
    return done


def compiled_in_background(kernel, args: tuple, wait: bool = False) -> bool:
    """Whether `kernel` is compiled for the types of `args`. If not, it is compiled (or loaded from the disk
    cache) in the background (`compile_in_background`), and this returns False until that is done (`wait`:
    block until then). For a caller that has an equivalent path to run meanwhile."""
    if DISABLED:
        return True
    sig = signature(args)
    if sig in kernel.overloads:
        return True
    done = compile_in_background(kernel, sig)
    if wait:
        done.wait()
    return done.is_set()


def cache_is_cold(kernels) -> bool:
    """Whether numba's disk cache holds nothing for one of these kernels (its index file is missing)."""
    try:
        return any(not os.path.exists(k._cache._cache_file._index_path) for k in kernels)
    except AttributeError:  # another numba's cache internals: assume it is warm
        return False


@atexit.register
def wait_for_compiles(timeout: float | None = None) -> bool:
    """Wait for the background compiles (at exit too, so that their code reaches the disk cache rather than
    being compiled again by the next process); False if some are still running after `timeout` seconds."""
    with _JOBS_LOCK:
        pending = [done for done in _JOBS.values() if not done.is_set()]
    return all(done.wait(timeout) for done in pending)


def _fma_f32_python(a, b, c):
    """Exact f32 FMA in plain Python (NUMBA_DISABLE_JIT): the float64 product of two f32 values is exact;
    the float64 sum, rounded to odd with the TwoSum error, then rounds to f32 as one rounding of a*b + c."""
    import math

    a, b, c = float(np.float32(a)), float(np.float32(b)), float(np.float32(c))
    p = a * b
    s = p + c
    if math.isfinite(s) and math.isfinite(p) and math.isfinite(c):
        bv = s - p
        err = (p - (s - bv)) + (c - bv)
        if err != 0 and (np.float64(s).view(np.uint64) & 1) == 0:
            s = math.nextafter(s, math.inf if err > 0 else -math.inf)
    with np.errstate(over="ignore"):
        return np.float32(s)


if DISABLED:

    def half_to_float(bits):
        """fp16 bits -> float32 (exact)."""
        return np.uint16(bits).view(np.float16).astype(np.float32)

    fma_f32 = _fma_f32_python

    def call_native(address, key, args):
        return _PYTHON_FUNCTIONS[address](*args)

    def use_threads(n: int) -> int:
        previous = numba.get_num_threads()
        numba.set_num_threads(n)
        return previous

else:
    call_native = _call_native_intrinsic()
    _get_count, _set_count = _thread_count_intrinsics()
    _half_bits_to_float = _half_to_float_intrinsic()

    @numba.njit(cache=True, nogil=True, inline="always")
    def half_to_float(bits):
        """fp16 bits (uint16) -> float32, exactly (inf and NaN included)."""
        return _half_bits_to_float(np.uint16(bits))

    _fma_f32_llvm = _fma_f32_intrinsic()

    @numba.njit(cache=True, nogil=True, inline="always")
    def fma_f32(a, b, c):
        """fma(a, b, c) = a*b + c with one rounding to float32 (`_mm512_fmadd_ps` / `vfmadd231ss`)."""
        return _fma_f32_llvm(np.float32(a), np.float32(b), np.float32(c))

    @numba.njit(cache=True, nogil=True, inline="always")
    def use_threads(n):
        """Inside a kernel: run its parallel loops on n threads; returns the count to restore afterwards
        (numba's count is a per-thread setting that outlives the call)."""
        previous = _get_count()
        _set_count(n)
        return previous


def default_threads() -> int:
    """The cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_threads(n: int | None) -> int:
    """Use `n` threads in parallel kernels (None: `default_threads()`, capped by numba's pool size)."""
    n = min(max(1, n or default_threads()), numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    return n


def get_threads() -> int:
    return numba.get_num_threads()
