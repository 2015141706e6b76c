"""The batched decode (`Model.decode_batch`: `kernels/batched.py`'s products, `attention_rows`) equals decoding
each sequence alone, bit for bit, whether its kernels were compiled in this process or loaded from numba's disk
cache: two fresh processes on one empty cache directory, the first compiles, the second loads (as
tests/test_kernels_cache.py does for the single-row kernels). The server's batch invariance rests on it.
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
from ggufpy.kernels import attention, batched
from tests.models import smollm2_path

model = ggufpy.load(smollm2_path(), backend="numba")
prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time there was a"]
caches, tokens = [], []
for p in prompts:  # different lengths: the rows of a step sit at different positions
    cache = model.new_cache(capacity=64)
    logits = model.forward(np.asarray(model.tokenizer.encode(p, add_special=True)), 0, cache)
    caches.append(cache)
    tokens.append(int(np.argmax(logits[-1])))
alone = []
for t, cache in zip(tokens, caches):
    copy = model.new_cache(capacity=64)
    for i in copy.layers:
        copy.k[i][:], copy.v[i][:] = cache.k[i], cache.v[i]
    copy.advance(cache.length)
    alone.append(model.forward(np.asarray([t]), cache.length, copy)[-1])
batch = model.decode_batch(np.asarray(tokens), [c.length for c in caches], caches)
np.savez(sys.argv[1], batch=batch, alone=np.stack(alone))
kernels = [batched._rows_nib, batched._rows_i8, batched._sub_sums, attention._attention_rows]
print(json.dumps({"hits": sum(sum(k.stats.cache_hits.values()) for k in kernels),
                  "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels)}))
"""


def _run(tmp_path: Path, name: str) -> tuple[dict[str, np.ndarray], dict]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(ROOT)}
    out = tmp_path / f"{name}.npz"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads(done.stdout.strip().splitlines()[-1])


def test_batched_decode_equals_alone_compiled_and_cached(tmp_path):
    compiled, first = _run(tmp_path, "compiled")
    cached, second = _run(tmp_path, "cached")
    assert first["misses"] > 0 and first["hits"] == 0, first  # the first process compiled the batched kernels
    assert second["hits"] > 0 and second["misses"] == 0, second  # the second loaded them all
    for run in (compiled, cached):
        assert run["batch"].tobytes() == run["alone"].tobytes()
    assert compiled["batch"].tobytes() == cached["batch"].tobytes()
