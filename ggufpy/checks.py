"""Checks of the values callers hand to the adapters (shard engine, exo engine, HF facade).

Each raises an error that names the value and the rule, before anything is computed: a float where an id is
expected would otherwise be truncated, an id past the vocabulary would fail deep in NumPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_request_id", "check_token_ids", "is_int", "is_real"]


def is_int(value: Any) -> bool:
    """A Python or NumPy integer, not a bool (True is not a layer number)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """A Python or NumPy int or float, not a bool (NaN and inf included: range checks follow)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_request_id(request_id: Any) -> str:
    """Request ids are strings (exo's are uuids): anything else is a caller's mistake."""
    if not isinstance(request_id, str):
        raise TypeError(f"a request id must be a str, got {request_id!r} ({type(request_id).__name__})")
    return request_id


def check_token_ids(ids: np.ndarray, vocab_size: int, what: str = "token id") -> None:
    """Refuse ids outside the vocabulary (an integer array of any shape)."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)].flat[0]
        raise ValueError(f"{what} {bad} is outside the vocabulary [0, {vocab_size})")
