"""Split models (llama.cpp's `gguf-split`): finding the parts from the named file, and checking they belong together.

A split model is `<prefix>-00001-of-0000N.gguf` ... `<prefix>-0000N-of-0000N.gguf`, each part holding `split.no`
(0-based) and `split.count`, the first also the model's metadata. The reader (`ggufpy.reader.open`) opens the
parts; these functions decide which files they are and refuse parts that disagree (docs/reader.md, Split models).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

from .constants import GGUFValueType
from .errors import GGUFFormatError

__all__ = ["check_agrees", "split_int", "split_paths"]

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class Part(Protocol):
    """What these checks read of a parsed part (`ggufpy.reader._Part`)."""

    path: Path
    version: int
    alignment: int
    metadata: dict[str, Any]
    value_types: dict[str, GGUFValueType]


# Keys each part of a split model must agree on with the first part when it carries them: gguf-split writes
# the model's metadata into the first part only, and split.no / split.count / split.tensors.count into every part.
_SPLIT_SHARED = ("split.count", "split.tensors.count", "general.architecture", "general.alignment")


def split_int(part: Part, key: str, default: int | None, lo: int, hi: int) -> int:
    """The integer `key` of a part (its `default` when absent), refused unless in `lo..hi` (a bool is refused)."""
    value = part.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise GGUFFormatError(f"{part.path}: metadata {key!r} is {value!r}: must be an integer in {lo}..{hi}")
    return value


def split_paths(path: Path, no: int, count: int) -> list[Path]:
    """Every part's path, derived from the named one, which must be part `no + 1` of `count` by its name too."""
    m = _SPLIT_NAME.match(path.name)
    if not m:
        raise GGUFFormatError(
            f"{path}: metadata 'split.count' is {count} but the file name does not follow "
            "'<prefix>-00001-of-0000N.gguf', so the other parts cannot be found"
        )
    if (int(m["no"]), int(m["count"])) != (no + 1, count):
        raise GGUFFormatError(
            f"{path}: the file name says part {int(m['no'])} of {int(m['count'])} but the metadata says part "
            f"{no + 1} of {count} (split.no {no}, split.count {count}): a renamed part or parts of different models"
        )
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def check_agrees(first: Part, part: Part) -> None:
    """A part of a split model must be the same GGUF version as the first, and each shared key it carries must
    hold the first part's value (for general.alignment: the first part's alignment, 32 when it has no key)."""
    if part.version != first.version:
        raise GGUFFormatError(
            f"{part.path}: GGUF version {part.version}, but the first part {first.path.name} is version {first.version}"
        )
    if "split.count" not in part.metadata:
        raise GGUFFormatError(f"{part.path}: metadata 'split.count' is missing: every part of a split model has it")
    for key in _SPLIT_SHARED:
        if key not in part.metadata:
            continue
        mine = (part.metadata[key], part.value_types[key].name)
        if key == "general.alignment":
            theirs = (first.alignment, GGUFValueType.UINT32.name)
        elif key in first.metadata:
            theirs = (first.metadata[key], first.value_types[key].name)
        else:
            theirs = ("no such key", "-")
        if mine != theirs:
            raise GGUFFormatError(
                f"{part.path}: metadata {key!r} is {mine[0]!r} ({mine[1]}) but the first part {first.path.name} "
                f"has {theirs[0]!r} ({theirs[1]}): the parts disagree"
            )
