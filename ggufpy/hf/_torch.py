"""NumPy in, NumPy out; torch in, torch out (torch is never imported by ggufpy itself)."""

from __future__ import annotations

from typing import Any

import numpy as np


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if _is_torch(x) else np.asarray(x)


def _like(a: np.ndarray, as_torch: bool):
    if not as_torch:
        return a
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))
