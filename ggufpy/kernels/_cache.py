"""numba's disk cache for ggufpy's kernels, invalidated when any source they compile from changes.

numba keys a cached kernel on its own file's modification time and size only. A kernel inlines functions and
freezes global tables from other modules (`int8grid.py` compiles `int8ir_iqgrid.py`'s IR and `quants/`'s grids),
so after an edit to one of those, a kernel whose own file did not change was loaded stale from the cache: old
code, without an error (met while developing issue 12's kernels). The locators here give every kernel of this
package one stamp, a hash of all those sources, in place of its file's: any edit recompiles them all, and an
unchanged tree still loads from the cache in every process. Other libraries' numba functions keep numba's
locators (`from_function` returns None for files outside the package).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching

_PACKAGE = Path(__file__).resolve().parent.parent  # ggufpy/
# what a kernel's machine code can depend on: the kernels, the quant tables and replays, their constants
_SOURCES = ("kernels/**/*.py", "quants/**/*.py", "constants.py", "numerics.py")
_KERNELS = _PACKAGE / "kernels"


@functools.cache
def source_stamp() -> str:
    """A hash of every source file a kernel may compile from (their paths and contents)."""
    h = hashlib.sha256()
    for pattern in _SOURCES:
        for path in sorted(_PACKAGE.glob(pattern)):
            h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _ours(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(_KERNELS)
    except OSError:
        return False


class _PackageStamp:
    """Mixed into numba's file-backed locators: the package's stamp, only for this package's kernels."""

    def get_source_stamp(self):
        return source_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        return super().from_function(py_func, py_file) if _ours(py_file) else None


def _numba_class(name: str) -> type:
    """numba's class `name` (public since numba 0.61, `_name` before)."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


class UserDirLocator(_PackageStamp, _numba_class("UserProvidedCacheLocator")):
    """`NUMBA_CACHE_DIR` set: the cache there."""


class InTreeLocator(_PackageStamp, _numba_class("InTreeCacheLocator")):
    """The cache in `__pycache__` next to the kernel's source."""


class UserWideLocator(_PackageStamp, _numba_class("UserWideCacheLocator")):
    """A read-only install: the cache in the user's cache directory."""


def install() -> None:
    """Put the locators first in numba's list (once), before any kernel of this package is decorated."""
    classes = _numba_class("CacheImpl")._locator_classes
    if UserDirLocator not in classes:
        classes[:0] = [UserDirLocator, InTreeLocator, UserWideLocator]
