"""The numba kernels compute the same whether compiled in this process or loaded from numba's disk cache.

They did not: a parallel kernel compiled with `reassoc` was optimized again where its parfor body is linked,
so a process that compiled the kernels and one that loaded them disagreed in the last bits of every product
(tests/test_ray.py's split == whole failed whenever the test process compiled and the Ray stages loaded). Two
fresh processes on one empty cache directory: the first compiles (and writes the cache), the second loads; the
SmolLM2 logits of a prefill and two decode steps must be bit-identical, and the counters must show which did what.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ggufpy.kernels import AVAILABLE, JIT_DISABLED

pytestmark = [
    pytest.mark.slow,  # two cold starts of the kernels SmolLM2 uses
    pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here"),
]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, sys
import numpy as np
import ggufpy
from ggufpy.kernels import attention, batched, matvec
from tests.models import smollm2_path

model = ggufpy.load(smollm2_path(), backend="numba")
cache = model.new_cache(capacity=64)
ids = model.tokenizer.encode("The capital of France is", add_special=True)
out = [model.forward(np.asarray(ids), 0, cache)]
for _ in range(2):
    out.append(model.forward(np.asarray([int(np.argmax(out[-1][-1]))]), cache.length, cache))
np.savez(sys.argv[1], *out)
kernels = [matvec._mv_nib_pairs, matvec._mv_nib_row, batched._rows_nib, batched._rows_i8, batched._sub_sums,
           attention._attention]
print(json.dumps({"hits": sum(sum(k.stats.cache_hits.values()) for k in kernels),
                  "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels)}))
"""


def _run(tmp_path: Path, name: str) -> tuple[list[np.ndarray], dict]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(ROOT)}
    out = tmp_path / f"{name}.npz"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as z:
        logits = [z[k] for k in sorted(z.files, key=lambda k: int(k.split("_")[1]))]
    return logits, json.loads(done.stdout.strip().splitlines()[-1])


def test_compiled_and_cached_kernels_compute_the_same(tmp_path):
    compiled, first = _run(tmp_path, "compiled")
    cached, second = _run(tmp_path, "cached")
    assert first["misses"] > 0 and first["hits"] == 0  # the first process compiled
    assert second["hits"] > 0 and second["misses"] == 0  # the second loaded every one of them
    assert len(compiled) == len(cached) == 3
    for a, b in zip(compiled, cached, strict=True):
        assert a.dtype == np.float32 and np.array_equal(a, b)
