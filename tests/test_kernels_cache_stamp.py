"""numba's disk cache of ggufpy's kernels is keyed on all the sources they compile from (`kernels/_cache.py`):
an edit to a module a kernel inlines from recompiles the kernel in the next process, where numba's own stamp
(the kernel's file alone) loaded the old machine code."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_kernels import needs_numba

ROOT = Path(__file__).resolve().parent.parent

CALLER = """
from ._numba import jit
from ._probe_value import value


@jit
def probe():
    return value()
"""
VALUE = """
from ._numba import jit


@jit(inline=True)
def value():
    return {n}
"""
RUN = "from ggufpy.kernels._probe import probe; print(probe())"


@needs_numba
def test_our_kernels_get_the_package_stamp_and_others_keep_numbas():
    import numba
    from numba.core import caching

    from ggufpy.kernels import _cache, ops

    ops._rms_norm.enable_caching()  # the dispatcher's cache: built with the locator numba picks for it
    locator = ops._rms_norm._cache._impl._locator
    assert isinstance(locator, _cache._PackageStamp)
    assert locator.get_source_stamp() == _cache.source_stamp()

    @numba.njit(cache=True)
    def outside(x):
        return x + 1

    outside.enable_caching()
    theirs = outside._cache._impl._locator
    assert not isinstance(theirs, _cache._PackageStamp)
    assert type(theirs).__module__ == caching.__name__  # one of numba's own


@needs_numba
@pytest.mark.parametrize("cache_dir", [False, True], ids=["in-tree", "NUMBA_CACHE_DIR"])
def test_an_edit_to_an_inlined_module_recompiles_the_kernel(tmp_path, cache_dir):
    """A copy of the package with a kernel in one file inlining a function of another: run, edit only the other
    file, run again in a new process. The second run must see the edit (numba's own stamp gave the old value)."""
    shutil.copytree(ROOT / "ggufpy", tmp_path / "ggufpy", ignore=shutil.ignore_patterns("__pycache__"))
    kernels = tmp_path / "ggufpy" / "kernels"
    (kernels / "_probe.py").write_text(textwrap.dedent(CALLER))
    (kernels / "_probe_value.py").write_text(textwrap.dedent(VALUE.format(n=1)))
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    if cache_dir:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", RUN], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert run() == "1"
    assert run() == "1"  # from the cache
    (kernels / "_probe_value.py").write_text(textwrap.dedent(VALUE.format(n=2)))  # the caller's file untouched
    assert run() == "2"
