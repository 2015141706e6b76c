"""A cold numba cache: the first token waits only for the prompt's kernels, and the tokens do not depend on it.

`prepare_kernels` compiles the prompt's path here and hands the head's and the decode step's kernels to a
worker process (`_numba.compile_in_background`), which writes them to the disk cache this process then loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ggufpy
from conformance.fixtures import TinyLlama, write_tiny_llama
from ggufpy.constants import GGMLType
from ggufpy.kernels import AVAILABLE, JIT_DISABLED

pytestmark = pytest.mark.skipif(not AVAILABLE or JIT_DISABLED, reason="the numba kernels are not compiled here")

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ["run", "--chat", "-p", "What is the capital of France?", "-n", "8"]


@pytest.fixture(scope="module")
def quantized_path(tmp_path_factory):
    """SmolLM2 Q4_1's mix in small: Q4_1 layers (the "nib" kernels), a Q8_0 embedding and head ("i8")."""
    types = {"embd": GGMLType.Q8_0, "output": GGMLType.Q8_0, "attn": GGMLType.Q4_1, "ffn": GGMLType.Q4_1}
    return write_tiny_llama(tmp_path_factory.mktemp("cold") / "q4_1.gguf", TinyLlama(types=types))


def _kernels():
    """The decode step's row kernels (`batched`: one row of the exact numerics), then the prefill's."""
    from ggufpy.kernels import attention, batched, matvec

    rows = [getattr(batched, n) for n in ("_rows_nib", "_sub_sums", "_rows_i8")]
    prefill = [getattr(matvec, n) for n in ("_mv_nib_row", "_mv_nib_pairs", "_mv_i8_row", "_mv_i8_pairs", "_unpack_t")]
    return rows + prefill + [attention._attention]


def test_the_listed_kernels_are_those_the_decode_step_calls(quantized_path):
    """After `prepare_kernels` (and its background compiles), prefill and decode compile nothing more: the
    signatures `row_kernels` lists are the ones the one-row products (`batched.matvec_rows`) and `attention`
    use, so nothing compiles twice."""
    from ggufpy.cli.run import prepare_kernels

    model = ggufpy.load(quantized_path, backend="numba")
    prepare_kernels(model, 20)
    model.backend.await_compiles()
    assert not model.backend._pending
    before = {k: set(k.overloads) for k in _kernels()}
    cache = model.new_cache(capacity=32)
    logits = model.forward(np.arange(1, 21), 0, cache, last_only=True)
    for _ in range(2):
        logits = model.forward(np.asarray([int(np.argmax(logits[-1]))]), cache.length, cache)
    after = {k: set(k.overloads) for k in _kernels()}
    assert after == before
    assert all(before[k] for k in _kernels()[:3])  # the nib and i8 row kernels and the sums were prepared


def test_row_kernels_lists_one_entry_per_kernel_and_types(quantized_path):
    model = ggufpy.load(quantized_path, backend="numba")
    w = model.weights
    listed = model.backend.row_kernels([lw.ffn_down for lw in w.layers.values()] + [w.output, None], attention=True)
    kernels = [k.py_func.__name__ for k, _ in listed]
    assert sorted(kernels) == ["_attention", "_rows_i8", "_rows_nib", "_sub_sums"]
    llamacpp = ggufpy.load(quantized_path, backend="numba", numerics="llamacpp")
    assert llamacpp.backend.row_kernels([w.output], attention=True) == []  # its paths are warmed by running them


WORKER = """
import json, numpy as np
from ggufpy.kernels import _numba, compile_worker, ops
x = np.ones((2, 8), np.float32); w = np.full(8, 2.0, np.float32); out = np.empty_like(x)
sig = _numba.signature((x, w, np.float32(1e-5), out))
first = _numba.load_cached(ops._rms_norm, sig)
_numba.compile_in_background(ops._rms_norm, sig).wait()
ops._rms_norm(x, w, np.float32(1e-5), out)
s = ops._rms_norm.stats
print(json.dumps({"first": first, "hits": sum(s.cache_hits.values()), "misses": sum(s.cache_misses.values()),
                  "worker": bool(compile_worker._WORKER and compile_worker._WORKER[0]), "out": out.tolist()}))
"""


def test_a_background_compile_runs_in_the_worker_and_is_loaded_from_the_disk_cache(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    # not in the empty cache; compiled by the worker process; this one only loaded it (one hit, no compile)
    assert r == {**r, "first": False, "worker": True, "hits": 1, "misses": 0}
    assert np.allclose(r["out"], 2.0, rtol=1e-5)


def _run(cache_dir: Path, argv: list[str]) -> str:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "import sys; from ggufpy.cli import main; sys.exit(main(sys.argv[1:]))", *argv]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # two cold starts of SmolLM2's kernels: ~40 CPU s each (minutes on a busy machine)
@pytest.mark.parametrize("sampling", [[], ["--temp", "0.9", "--seed", "7"]], ids=["greedy", "seeded"])
def test_a_cold_run_prints_the_tokens_of_a_warm_run(tmp_path, sampling):
    """The README's command on an empty numba cache, then again on the cache it left: the same text."""
    cold = _run(tmp_path / "numba", [*QUESTION, *sampling])
    warm = _run(tmp_path / "numba", [*QUESTION, *sampling])
    assert cold == warm
    assert cold.strip()
    if not sampling:
        assert cold.startswith("The capital of France is Paris.")


def _packed_types():
    from ggufpy.kernels.layout import PACKED_TYPES
    from ggufpy.kernels.rawblocks import BLOCK_TYPES

    return sorted(PACKED_TYPES - set(BLOCK_TYPES), key=lambda t: t.name)


@pytest.mark.parametrize("t", _packed_types(), ids=lambda t: t.name)
def test_numpy_unpack_is_bit_identical_to_the_kernel(t):
    """The tiles a cold prefill takes from NumPy are the bits `matvec.unpack` gives once compiled."""
    from ggufpy.kernels import matvec, unpack_numpy
    from ggufpy.kernels.layout import pack
    from tests.test_kernels import random_weight

    rows = 192 if t.name.endswith("_K") or t.name == "IQ4_XS" else 160  # a partial last group
    cols = 512
    p = pack(random_weight(t, rows, cols, seed=5), release=False)
    for g0, g1 in [(0, p.groups), (1, p.groups)]:
        want = matvec.unpack(p, g0, g1)
        got = unpack_numpy.unpack(p, g0, g1, np.full_like(want, np.nan))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (g0, g1)


def test_a_prefill_while_the_unpack_kernel_compiles_gives_the_same_logits(quantized_path, monkeypatch):
    """While `_unpack_t` is pending, the BLAS tiles come from NumPy; the logits are those of the kernel's tiles."""
    import threading

    from ggufpy.kernels import matvec, unpack_numpy

    ids = np.arange(3, 23)  # 20 rows: the BLAS path
    warm = ggufpy.load(quantized_path, backend="numba")
    want = warm.forward(ids, 0, warm.new_cache(capacity=32))
    cold = ggufpy.load(quantized_path, backend="numba")
    compiling = threading.Event()  # never set here: the kernel stays "in the worker"
    cold.backend._pending[matvec._unpack_t] = [compiling]
    calls = []
    real = unpack_numpy.unpack
    monkeypatch.setattr(unpack_numpy, "unpack", lambda *a: calls.append(a[0].type) or real(*a))
    got = cold.forward(ids, 0, cold.new_cache(capacity=32))
    assert set(calls) == {GGMLType.Q4_1, GGMLType.Q8_0}  # the layers' tiles and the head's (20 rows of logits)
    assert np.array_equal(got, want)
    compiling.set()  # compiled: the kernel again, and the pending entry is gone
    cold.forward(ids, 0, cold.new_cache(capacity=32))
    assert matvec._unpack_t not in cold.backend._pending
