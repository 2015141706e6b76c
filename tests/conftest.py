"""Shared fixtures: tiny synthetic models (written once per session) and the real packaged models."""

from __future__ import annotations

import os

# Before NumPy loads OpenBLAS (conformance.fixtures imports it through gguf): the llamacpp numerics' replay runs
# many small matrix products, which cost 2-7x the CPU on two BLAS threads (measured on SmolLM2's layer 0).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest

from conformance.fixtures import TinyLlama, write_tiny_llama
from ggufpy import packaged
from tests.models import _find, smollm2_path


def pytest_configure(config):
    """Assemble Gemma 3 once, here in pytest-xdist's controller (or the only process), before any worker starts:
    two workers joining its chunks into the same ~/.cache file at once would race."""
    if not hasattr(config, "workerinput"):
        _find(packaged.gemma3_path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_path):
    import ggufpy

    return ggufpy.load(tiny_llama_path)


@pytest.fixture(scope="session")
def tiny_llama_spec():
    return TinyLlama()


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    import ggufpy

    return ggufpy.load(smollm2_file)


@pytest.fixture(scope="session")
def smollm2_file():
    return smollm2_path()
