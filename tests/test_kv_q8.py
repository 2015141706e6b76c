"""The Q8_0 KV cache (`model.new_cache(kv_type="q8_0")`, llama.cpp's `-ctk q8_0 -ctv q8_0 -fa on`).

Oracle: tests/data/kv_q8_smollm2.npz, recorded from llama-cpp-python 0.3.36 (ggml 0c1e570, AVX2 build) on
SmolLM2 with flash attention and a q8_0 cache (`python tests/test_kv_q8.py` records it again):
- layer 0's Qcur/Kcur/Vcur and kqv_out with `LLAMA_ATTN_ROT_DISABLE=1` (no Hadamard rotation): the flash
  attention replay must give kqv_out bit for bit from llama.cpp's own Q, K, V;
- the last row of the logits without the rotation: the whole model in the llamacpp-avx2 numerics, bit for bit;
- with the rotation (llama.cpp's default): the argmax of every row, and the logits within a measured bound (the
  rotation's f32 products are not replayed bit for bit yet: `quants.x86.flash_attention`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ggufpy.kvcache import Q8Cache, attention_q8
from ggufpy.numerics import NUMERICS
from ggufpy.quants.x86.flash_attention import (
    dequantize_q8_0_rows,
    flash_attention_q8_0,
    hadamard,
    quantize_q8_0_rows,
    rotate,
)

GOLDEN = Path(__file__).parent / "data" / "kv_q8_smollm2.npz"
f32 = np.float32


def _qkv(T: int, start: int, H: int, G: int, E: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    S = start + T
    return (rng.standard_normal((T, H, E), f32), rng.standard_normal((S, G, E), f32),
            rng.standard_normal((S, G, E), f32))  # fmt: skip


def test_cache_stores_q8_0_blocks():
    cache = Q8Cache(range(2), 16, 3, 64)
    k = np.random.default_rng(0).standard_normal((5, 3, 64), f32)
    keys, values = cache.update(1, 0, k, -k)
    assert keys.shape == (5, 3, 68) and keys.dtype == np.uint8
    assert np.array_equal(dequantize_q8_0_rows(keys), dequantize_q8_0_rows(quantize_q8_0_rows(k)))
    assert np.abs(dequantize_q8_0_rows(values) + k).max() <= np.abs(k).max() / 127  # half a step per block, at most
    assert cache.nbytes == 2 * 2 * 16 * 3 * 68  # 34/128 of an f32 cache
    cache.advance(5)
    grown = cache.resized(32)
    assert grown.capacity == 32 and np.array_equal(grown.k[1][:5], keys)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8Cache(range(1), 4, 1, 48)


def test_rotation_is_orthonormal_and_its_own_inverse():
    h = hadamard()
    assert np.array_equal(h, h.T) and set(np.unique(h)) == {f32(-0.125), f32(0.125)}
    x = np.random.default_rng(1).standard_normal((3, 128), f32)
    np.testing.assert_allclose(rotate(rotate(x)), x, atol=1e-6)
    q, k, _ = _qkv(1, 4, 2, 1, 64)
    np.testing.assert_allclose(rotate(q)[0, 0] @ rotate(k)[:, 0].T, q[0, 0] @ k[:, 0].T, atol=1e-5)  # scores kept


@pytest.mark.parametrize("extra", [{}, {"window": 3}, {"sinks": np.array([0.3, -2.0], f32)}])
def test_exact_numerics_attend_over_the_dequantized_rows(extra):
    q, k, v = _qkv(4, 5, 2, 1, 64)
    attend = attention_q8(NUMERICS["exact"])
    got = attend(q, quantize_q8_0_rows(k), quantize_q8_0_rows(v), 5, 0.125, **extra)
    from ggufpy import ops

    k8, v8 = dequantize_q8_0_rows(quantize_q8_0_rows(k)), dequantize_q8_0_rows(quantize_q8_0_rows(v))
    assert np.array_equal(got, ops.attention(q, k8, v8, 5, 0.125, **extra))


def test_a_backend_kernel_is_preferred_and_the_rotation_wraps_it():
    calls = []

    def kernel(q, k, v, start, scale, **extra):
        calls.append(q.copy())
        return q.reshape(q.shape[0], -1)

    cache = Q8Cache(range(1), 8, 1, 64, rotation="f32")
    attend = attention_q8(NUMERICS["llamacpp"], SimpleNamespace(attention_q8=kernel), cache)
    q = np.random.default_rng(2).standard_normal((1, 2, 64), f32)
    out = attend(q, None, None, 0, 1.0)
    assert np.array_equal(calls[0], rotate(q))  # Q rotated like the stored keys
    np.testing.assert_allclose(out.reshape(q.shape), q, atol=1e-6)  # and the output rotated back


def test_flash_attention_equals_llamacpp_on_its_own_inputs():
    g = np.load(GOLDEN)
    q, k, v = g["Qcur_0"], g["Kcur_0"], g["Vcur_0"]
    got = flash_attention_q8_0(q, quantize_q8_0_rows(k), quantize_q8_0_rows(v), 0, f32(1) / np.sqrt(f32(64)))
    assert np.array_equal(got.view(np.uint32), g["kqv_out_0"].view(np.uint32))


@pytest.fixture(scope="module")
def smollm2_llamacpp(smollm2_file):
    import ggufpy

    return ggufpy.load(smollm2_file, backend="numpy", numerics="llamacpp-avx2")


@pytest.mark.slow  # a NumPy replay of the whole model, or numba kernels to compile
def test_model_with_q8_cache_equals_llamacpp_bit_for_bit(smollm2_llamacpp):
    g = np.load(GOLDEN)
    model = smollm2_llamacpp
    cache = model.new_cache(32, kv_type="q8_0")
    assert cache.rotation == "avx2"  # llama.cpp's default; the golden's first run had it off
    cache.rotation = None
    logits = model.forward(g["tokens"], 0, cache, last_only=True)
    assert np.array_equal(logits[0].view(np.uint32), g["logits_last"].view(np.uint32))


@pytest.mark.slow  # a NumPy replay of the whole model, or numba kernels to compile
def test_model_with_rotated_q8_cache_is_close_to_llamacpp(smollm2_llamacpp):
    g = np.load(GOLDEN)
    cache = smollm2_llamacpp.new_cache(32, kv_type="q8_0")
    logits = smollm2_llamacpp.forward(g["tokens"], 0, cache)
    assert np.array_equal(logits.argmax(1), g["rot_argmax"])
    # measured 0.95 on a logit scale of ~20 (the last bits of the rotation products differ: module docstring)
    assert np.abs(logits[-1] - g["rot_logits_last"]).max() < 2.0


def test_new_cache_refuses_unknown_kv_types(tiny_llama):
    with pytest.raises(ValueError, match="unknown KV cache type 'q4_0'"):
        tiny_llama.new_cache(8, kv_type="q4_0")


@pytest.mark.slow  # a NumPy replay of the whole model, or numba kernels to compile
def test_exact_model_with_q8_cache_is_close_to_f32(tiny_llama):
    tokens = np.arange(1, 9)
    ref = tiny_llama.forward(tokens, 0, tiny_llama.new_cache(16))
    cache = tiny_llama.new_cache(16, kv_type="q8_0")
    got = tiny_llama.forward(tokens[:5], 0, cache)
    steps = [tiny_llama.forward(tokens[i : i + 1], i, cache) for i in range(5, 8)]
    got = np.concatenate([got, *steps])
    assert cache.length == 8 and cache.k[0].dtype == np.uint8
    np.testing.assert_allclose(got, ref, atol=0.05 * np.abs(ref).max())
    assert not np.array_equal(got, ref)  # the cache's rounding shows


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize(("T", "start", "H", "G", "E"), [(1, 40, 9, 3, 64), (5, 17, 4, 2, 64), (1, 300, 4, 1, 256)])
def test_numba_kernel_equals_the_replay_and_the_f32_kernel(T, start, H, G, E, window):
    pytest.importorskip("numba")
    from ggufpy.kernels import attention_q8
    from ggufpy.kernels.attention import attention as attention_f32

    q, k, v = _qkv(T, start, H, G, E)
    kb, vb = quantize_q8_0_rows(k), quantize_q8_0_rows(v)
    ref = flash_attention_q8_0(q, kb, vb, start, f32(0.125), window=window)
    assert np.array_equal(attention_q8.attention(q, kb, vb, start, 0.125, window=window, ggml=True), ref)
    f = attention_f32(q, dequantize_q8_0_rows(kb), dequantize_q8_0_rows(vb), start, 0.125, window=window)
    assert np.array_equal(attention_q8.attention(q, kb, vb, start, 0.125, window=window, ggml=False), f)


_RECORD = r"""
import os, sys, dataclasses, numpy as np
if sys.argv[1] == "norot":
    os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
from ggufpy import packaged
from ggufpy.constants import GGMLType
import conformance.llamacpp as L
st = dataclasses.replace(L.SETTINGS, flash_attn=True, kv_type=GGMLType.Q8_0)
with L.LlamaCpp(packaged.smollm2_path(), st) as ll:
    toks = ll.tokenize("The quick brown fox jumps over the lazy dog. Once upon a time")
    logits, cap = ll.run(toks, {"Qcur-0", "Kcur-0", "Vcur-0", "kqv_out-0"})
np.savez(sys.argv[2], tokens=np.array(toks), logits_last=logits[-1], argmax=logits.argmax(1),
         **{k.replace("-", "_"): v for k, v in cap.items()})
"""


def record(out: Path = GOLDEN) -> None:
    """Run llama.cpp without and with the rotation (a process each: the switch is read at context creation)."""
    runs = {}
    root = Path(__file__).parent.parent
    for mode in ("norot", "rot"):
        path = out.with_suffix(f".{mode}.npz")
        env = {**os.environ, "PYTHONPATH": str(root)}
        subprocess.run([sys.executable, "-c", _RECORD, mode, str(path)], check=True, env=env)
        runs[mode] = dict(np.load(path))
        path.unlink()
    n, r = runs["norot"], runs["rot"]
    keep = ("tokens", "Qcur_0", "Kcur_0", "Vcur_0", "kqv_out_0", "logits_last")
    np.savez_compressed(out, **{k: n[k] for k in keep}, rot_logits_last=r["logits_last"], rot_argmax=r["argmax"])


if __name__ == "__main__":
    record()
