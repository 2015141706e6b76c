"""The cold-start machinery of `ggufpy.kernels._numba`: calls through a compiled function's address
(`native` / `call_native`, what lets the fused decode block compile without its kernels' code) and compiles on
a background thread (`compiled_in_background`)."""

from __future__ import annotations

import numpy as np
import pytest

from ggufpy.kernels import _numba
from ggufpy.kernels._numba import DISABLED, call_native, compiled_in_background, jit, native, wait_for_compiles

pytestmark = pytest.mark.skipif(DISABLED, reason="compiled code only (NUMBA_DISABLE_JIT)")


@jit
def _axpy(a, x, out):
    for i in range(x.shape[0]):
        out[i] = a * x[i] + out[i]


@jit
def _twice(address, key, a, x, out):
    call_native(address, key, (a, x, out))
    call_native(address, key, (a, x, out))
    return out


def test_call_native_runs_the_function_at_the_address():
    x = np.arange(4, dtype=np.float32)
    address, key = native(_axpy, (np.float32(2), x, x.copy()))
    out = _twice(address, key, np.float32(2), x, np.ones(4, np.float32))
    assert np.array_equal(out, 1 + 4 * x)


def test_call_native_refuses_other_types():
    """A key from other argument types (f64 `a`) raises instead of calling code compiled for f32."""
    x = np.arange(4, dtype=np.float32)
    address, key = native(_axpy, (2.0, x, x.copy()))
    out = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="differ from the compiled function"):
        _twice(address, key, np.float32(2), x, out)
    assert np.array_equal(out, np.ones(4, np.float32))  # nothing was called


def test_compiled_in_background():
    from numba.core.compiler_lock import global_compiler_lock

    @jit
    def square(x, out):  # a fresh function: never compiled before this test
        for i in range(x.shape[0]):
            out[i] = x[i] * x[i]

    x = np.arange(3, dtype=np.float64)
    with global_compiler_lock:  # the background thread cannot compile before this block ends
        assert not compiled_in_background(square, (x, x))
        assert not compiled_in_background(square, (x, x))  # one job, not two
    assert wait_for_compiles(timeout=120)
    assert compiled_in_background(square, (x, x))
    assert len(square.overloads) == 1
    out = np.empty_like(x)
    square(x, out)
    assert np.array_equal(out, x * x)
    assert not [j for j in _numba._JOBS.values() if not j.is_set()]
