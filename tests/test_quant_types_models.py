"""A model per quant type of issue 12: a small synthetic llama (dim 256, so every 256-block type applies to
every tensor) with all its matrices in that type, run through `ggufpy run` on both backends, with the numba
logits against the NumPy reference's.

Weights come from ggufpy's reference quantizer where there is one (TQ1_0, TQ2_0, MXFP4), else from ggml's
`ggml_quantize_chunk` with an importance matrix of ones (llama.cpp refuses IQ1/IQ2 without one) when
llama-cpp-python is installed, else they are random valid blocks scaled to the weights' size: the tests here
check that the types load, decode and multiply, not how well they approximate the weights.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from conformance import fixtures as fx
from ggufpy import kernels
from ggufpy.constants import GGMLType
from ggufpy.quants import QUANT_TYPES, dequantize, quant_type, quantize

T = GGMLType
NEW_TYPES = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0, T.MXFP4]
NEW_TYPES += [T[name] for name in ("NVFP4", "Q1_0") if name in T.__members__ and T[name] in QUANT_TYPES]
IDS = [5, 60, 7, 200, 31, 9, 100, 3, 17, 250, 41, 8, 90, 12, 64, 77, 120, 33, 2, 48]  # 20: a BLAS prefill
needs_numba = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"numba unavailable: {kernels.IMPORT_ERROR}")

# byte offset of the fp16 d of each block (ggml-common.h) for the random fallback; IQ1_M spreads its d
FP16_D = {T.IQ2_XXS: 0, T.IQ2_XS: 0, T.IQ2_S: 0, T.IQ3_XXS: 0, T.IQ3_S: 0, T.IQ1_S: 0}


def _ggml_quantize_with_imatrix(data: np.ndarray, t: GGMLType) -> np.ndarray | None:
    """ggml's `ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix)` with an imatrix of ones;
    None without llama-cpp-python."""
    from conformance import llamacpp

    if not llamacpp.available():
        return None
    fn = llamacpp._ggml_base().ggml_quantize_chunk
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    fn.argtypes += [ctypes.c_void_p]
    fn.restype = ctypes.c_size_t
    x = np.ascontiguousarray(data, np.float32)
    rows, cols = x.shape
    out = np.zeros((rows, quant_type(t).row_bytes(cols)), np.uint8)
    imatrix = np.ones(cols, np.float32)
    written = fn(int(t), x.ctypes.data, out.ctypes.data, 0, rows, cols, imatrix.ctypes.data)
    assert written == out.nbytes
    return out


def _with_d(blocks: np.ndarray, t: GGMLType, d: float) -> np.ndarray:
    blocks = blocks.copy()
    half = np.full(len(blocks), d, "<f2").view(np.uint16)
    if t == T.IQ1_M:  # bits 12-15 of the four scale u16 at bytes 48..55 hold d's nibbles
        for i in range(4):
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((half >> (4 * i)) & 15) << 4).astype(np.uint8)
    elif t.name == "NVFP4":  # UE4M3 scales: code 0x38 is 1.0 (stored halved); d then multiplies the tensor
        blocks[:, 0:4] = 0x38
    else:
        blocks[:, FP16_D[t] : FP16_D[t] + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks


def _random_blocks(data: np.ndarray, t: GGMLType, seed: int) -> np.ndarray:
    """Random valid blocks whose dequantized values have the standard deviation of `data`."""
    qt = quant_type(t)
    rows, cols = data.shape
    n = rows * cols // qt.block_size
    blocks = np.random.default_rng(seed).integers(0, 256, (n, qt.type_size), dtype=np.uint8)
    unit = dequantize(_with_d(blocks, t, 1.0), t, (n * qt.block_size,)).std()
    if t.name == "NVFP4":
        return _with_d(blocks, t, 1.0).reshape(rows, -1)  # its scales have no fp16 d to set: std ~ 3
    return _with_d(blocks, t, float(data.std() / unit)).reshape(rows, -1)


def _quantize(data: np.ndarray, t: GGMLType) -> np.ndarray:
    if quant_type(t).quantize_blocks is not None:
        return quantize(data, t)
    out = _ggml_quantize_with_imatrix(data, t)
    return _random_blocks(data, t, seed=data.size + int(t)) if out is None else out


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    made = {}

    def make(t: GGMLType):
        if t not in made:
            spec = fx.TinyLlama(dim=256, hidden_dim=256, n_layers=2, types=dict.fromkeys(fx.ROLES, t))
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(fx, "_quantize", _quantize)
                made[t] = fx.write_tiny_llama(tmp_path_factory.mktemp(t.name) / f"tiny-{t.name.lower()}.gguf", spec)
        return made[t]

    return make


@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_fixture_holds_the_type(model_file, t):
    import ggufpy

    with ggufpy.open(model_file(t)) as f:
        matrices = [info for name, info in f.tensors.items() if not name.endswith("norm.weight")]
        assert {info.type for info in matrices} == {t}
        assert len(matrices) == 2 + 2 * 7  # token_embd, output, and 7 per layer


@pytest.mark.parametrize("backend", ["numpy", pytest.param("numba", marks=needs_numba)])
@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_run_generates_on_both_backends(model_file, t, backend, capsys):
    from ggufpy.cli import main

    argv = ["run", "-m", str(model_file(t)), "-p", "the", "--max-tokens", "4", "--temp", "0", "--backend", backend]
    assert main(argv) == 0
    assert "tok/s" in capsys.readouterr().err


@needs_numba
@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_numba_logits_match_the_numpy_reference(model_file, t):
    import ggufpy

    path = model_file(t)
    ref = ggufpy.load(path, tokenizer=False).logits(IDS)
    assert np.isfinite(ref).all() and ref.std() > 0
    model = ggufpy.load(path, backend="numba", tokenizer=False)
    model.numerics = dataclasses.replace(model.numerics, attention=model.backend.attention)
    got = model.logits(IDS)  # 20 rows: the BLAS path, from tiles unpacked bit-identically
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    cache = model.new_cache(capacity=len(IDS))  # and decoding, through the fused kernels
    model.forward(np.array(IDS[:-1]), 0, cache)
    last = model.forward(np.array(IDS[-1:]), len(IDS) - 1, cache)
    np.testing.assert_allclose(last[0], ref[-1], rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_inspect_shows_the_type_and_its_bits_per_weight(model_file, t, capsys):
    import ggufpy
    from ggufpy.cli import main
    from ggufpy.cli.inspect import describe

    with ggufpy.open(model_file(t)) as f:
        report = describe(f)
    qt = QUANT_TYPES[t]
    assert report["types"][t.name]["bits_per_weight"] == round(8 * qt.type_size / qt.block_size, 4)  # IQ2_XXS: 2.0625
    assert main(["inspect", str(model_file(t))]) == 0
    assert t.name in capsys.readouterr().out


@needs_numba
@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_numba_llamacpp_numerics_run_the_int8_path(model_file, t):
    """Activations quantized to the type's vec_dot format (Q8_K for IQ/TQ, Q8_0 for MXFP4) and integer block
    dots: close to the exact logits, not equal (the bit-exact replay of llama.cpp is a later step)."""
    import ggufpy
    from ggufpy.kernels import int8dot
    from ggufpy.kernels.backend import VEC_DOT

    if t not in VEC_DOT and t not in int8dot.INT8_TYPES:
        pytest.skip(f"{t.name}: no vec_dot activation format in the numba backend")
    path = model_file(t)
    ref = ggufpy.load(path, tokenizer=False).logits(IDS)
    got = ggufpy.load(path, backend="numba", numerics="llamacpp", tokenizer=False).logits(IDS)
    assert np.isfinite(got).all()
    assert 0 < np.mean((got - ref) ** 2) / np.mean(ref**2) < 1e-2  # measured 1-4e-4
