"""`ggufpy quantize` against llama.cpp's quantizer: the same type for every tensor, the same bytes.

- the mixes' type choices on SmolLM2 and Gemma 3 (every mix) against llama.cpp's dry runs: recorded in
  tests/data/quantize/goldens.json, and live when llama-cpp-python is installed;
- a synthetic llama model with dims that are multiples of 256: the whole output file byte-identical to
  `llama_model_quantize`'s (live), and each tensor's sha256 equal to the recorded one (golden), with and
  without an importance matrix;
- SmolLM2 to Q4_K_M, whole file, live (slow: minutes in NumPy);
- the CLI, the atomic write and the errors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from conformance.fixtures import TinyLlama, write_tiny_llama
from ggufpy.constants import GGMLType
from ggufpy.errors import GGUFError
from ggufpy.workbench.imatrix_file import ImatrixEntry, ImatrixFile
from ggufpy.workbench.mixes import FTYPES, MixOptions, TypePlan, weight_order
from ggufpy.workbench.quantize import quantize_model
from tests import models

GOLDENS = Path(__file__).parent / "data" / "quantize" / "goldens.json"
MIXES = ["Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "Q6_K", "Q8_0"]
MIXES += ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]
SYNTHETIC_MIXES = ["Q4_K_M", "Q3_K_S", "IQ4_XS", "Q5_1"]
SYNTHETIC_IMATRIX_MIXES = ["Q4_K_S", "IQ4_NL", "Q4_0"]


def synthetic_model(directory: Path) -> Path:
    """A llama model whose rows are all multiples of 256 (no fallbacks), 8 layers so that the mixes'
    per-layer rules (first/last eighth, every third) differ between layers; F32 weights."""
    spec = TinyLlama(dim=256, hidden_dim=256, n_layers=8, n_heads=2, n_kv_heads=1, seed=17)
    return write_tiny_llama(directory / "synthetic-f32.gguf", spec)


def synthetic_imatrix(model: Path) -> ImatrixFile:
    """Random positive importances for every matrix of `model` (a count of 5 tokens), some exactly 0."""
    import ggufpy

    rng = np.random.default_rng(5)
    entries = {}
    with ggufpy.open(model) as f:
        for name, info in f.tensors.items():
            if len(info.shape) == 2 and name.startswith("blk."):
                sums = (rng.standard_normal((1, info.shape[-1])) ** 2 * 5).astype(np.float32)
                sums[0, ::13] = 0
                entries[name] = ImatrixEntry(sums, np.array([5], np.float32))
    return ImatrixFile(entries, ["synthetic"], chunk_count=3, chunk_size=64, name="synthetic.imatrix.gguf")


def file_digests(path: Path) -> dict:
    """sha256 of the whole file and of each tensor's bytes (with its type), for the goldens."""
    import ggufpy

    with ggufpy.open(path) as f:
        tensors = {
            n: f"{t.type.name}:{hashlib.sha256(np.asarray(f.raw(n)).tobytes()).hexdigest()}"
            for n, t in f.tensors.items()
        }
    return {"file": hashlib.sha256(path.read_bytes()).hexdigest(), "tensors": tensors}


@pytest.fixture(scope="module")
def goldens():
    return json.loads(GOLDENS.read_text())


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return synthetic_model(tmp_path_factory.mktemp("quantize"))


def _plan_types(path: Path, mix: str) -> dict[str, str]:
    import ggufpy

    with ggufpy.open(path) as f:
        names = weight_order(f.tensors)
        plan = TypePlan.for_model(f.metadata, names, mix)
        return {n: plan.choose(n, f.tensors[n].shape, f.tensors[n].type).name for n in names}


def _needs_llama_cpp():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'ggufpy[conformance]')")


# --- type choices ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("mix", MIXES)
def test_mix_types_match_llama_cpp_golden(goldens, model, mix):
    expected = goldens["types"][model][mix]
    ours = _plan_types(getattr(models, f"{model}_path")(), mix)
    assert list(ours) == list(expected)  # llama.cpp's tensor order
    assert ours == expected


@pytest.mark.conformance
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M", "IQ4_XS", "Q2_K"])
def test_mix_types_match_llama_cpp_live(mix):
    _needs_llama_cpp()
    from tests.quantize_oracle import llama_types

    for model in ("smollm2", "gemma3"):
        path = getattr(models, f"{model}_path")()
        assert _plan_types(path, mix) == llama_types(path, mix), model


def test_use_more_bits_layers_get_q6_k(synthetic):
    """Q4_K_M on 8 layers: attn_v and ffn_down of layers 0, 3, 6, 7 (first/last eighth, every third) get Q6_K."""
    types = _plan_types(synthetic, "Q4_K_M")
    assert [i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == [0, 3, 6, 7]
    assert [i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == [0, 3, 6, 7]
    assert types["blk.1.attn_q.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_norm.weight"] == "F32"


def test_fallbacks_and_overrides():
    """SmolLM2's 576-wide rows fall back from K-quants to 32-blocks; the options apply before the mix."""
    types = _plan_types(models.smollm2_path(), "Q4_K_M")
    assert types["blk.5.attn_q.weight"] == "Q5_0" and types["blk.0.attn_v.weight"] == "Q8_0"  # Q4_K, Q6_K
    assert types["blk.4.ffn_down.weight"] == "Q4_K"  # rows of 1536 = 6 x 256; layer 5 is a "more bits" one
    import ggufpy

    with ggufpy.open(models.smollm2_path()) as f:
        names = weight_order(f.tensors)
        opts = MixOptions(tensor_types=(("attn_q", GGMLType.Q8_0),), token_embedding_type=GGMLType.F16, pure=True)
        plan = TypePlan.for_model(f.metadata, names, "Q4_K", options=opts)
        chosen = {n: plan.choose(n, f.tensors[n].shape, f.tensors[n].type) for n in names}
    assert plan.ftype.name == "Q4_K_M"  # the alias
    assert chosen["blk.3.attn_q.weight"] == GGMLType.Q8_0 and chosen["token_embd.weight"] == GGMLType.F16
    assert chosen["blk.0.attn_v.weight"] == GGMLType.Q5_0  # --pure: Q4_K (not Q6_K), then the fallback
    with pytest.raises(GGUFError, match=r"unsupported quantization mix 'MXFP4_MOE'.*Q4_K_M"):
        TypePlan.for_model(f.metadata, names, "MXFP4_MOE")


# --- whole files -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", SYNTHETIC_MIXES)
def test_synthetic_quantize_matches_golden(goldens, synthetic, tmp_path, mix):
    recorded = goldens["synthetic"]
    if hashlib.sha256(synthetic.read_bytes()).hexdigest() != recorded["input_sha256"]:
        pytest.skip("the synthetic fixture's bytes changed (conformance/fixtures.py): re-record the goldens")
    out = quantize_model(synthetic, tmp_path / "out.gguf", mix)
    assert file_digests(tmp_path / "out.gguf") == recorded[mix]
    assert out.n_fallback == 0 and {t.new_type for t in out.tensors} >= {FTYPES[mix].default}


@pytest.mark.parametrize("mix", SYNTHETIC_IMATRIX_MIXES)
def test_synthetic_quantize_with_imatrix_matches_golden(goldens, synthetic, tmp_path, mix):
    recorded = goldens["synthetic"]
    if hashlib.sha256(synthetic.read_bytes()).hexdigest() != recorded["input_sha256"]:
        pytest.skip("the synthetic fixture's bytes changed (conformance/fixtures.py): re-record the goldens")
    im = synthetic_imatrix(synthetic)
    out = quantize_model(synthetic, tmp_path / "out.gguf", mix, imatrix=im)
    # the tensors are llama.cpp's; the metadata adds llama-quantize's quantize.imatrix.* keys
    assert file_digests(tmp_path / "out.gguf")["tensors"] == recorded[f"{mix}+imatrix"]["tensors"]
    assert any(t.imatrix for t in out.tensors)
    import ggufpy

    with ggufpy.open(tmp_path / "out.gguf") as f:
        assert f.metadata["quantize.imatrix.file"] == "synthetic.imatrix.gguf"
        assert f.metadata["quantize.imatrix.dataset"] == "synthetic"
        assert f.metadata["quantize.imatrix.entries_count"] == len(im.entries)
        assert f.metadata["quantize.imatrix.chunks_count"] == 3


@pytest.mark.conformance
@pytest.mark.parametrize("mix", ["Q4_K_M", "IQ4_XS"])
def test_synthetic_quantize_matches_llama_cpp_live(synthetic, tmp_path, mix):
    _needs_llama_cpp()
    from tests.quantize_oracle import llama_quantize

    quantize_model(synthetic, tmp_path / "ours.gguf", mix)
    llama_quantize(synthetic, tmp_path / "theirs.gguf", mix)
    assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "theirs.gguf").read_bytes()


@pytest.mark.slow
@pytest.mark.conformance
def test_smollm2_q4_k_m_matches_llama_cpp_live(tmp_path):
    """Requantizing SmolLM2 (Q4_1/Q8_0) to Q4_K_M: every byte of the file as llama.cpp writes it (~4 min)."""
    _needs_llama_cpp()
    from tests.quantize_oracle import llama_quantize

    quantize_model(models.smollm2_path(), tmp_path / "ours.gguf", "Q4_K_M")
    llama_quantize(models.smollm2_path(), tmp_path / "theirs.gguf", "Q4_K_M")
    assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "theirs.gguf").read_bytes()


# --- imatrix files, CLI, atomic write ----------------------------------------------------------------------


def test_imatrix_file_round_trip(synthetic, tmp_path):
    im = synthetic_imatrix(synthetic)
    back = ImatrixFile.load(im.save(tmp_path / "im.gguf"))
    assert back.datasets == ["synthetic"] and back.chunk_count == 3 and back.chunk_size == 64
    name = "blk.2.ffn_down.weight"
    assert np.array_equal(back.entries[name].sums, im.entries[name].sums)
    values = back.weights(name)
    assert np.array_equal(values, im.entries[name].sums[0] / np.float32(5)) and values.dtype == np.float32
    zero_count = ImatrixEntry(np.ones((2, 4), np.float32), np.array([0, 2], np.float32))
    assert zero_count.values().tolist() == [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5]  # count 0: weight 1


def test_cli_quantize_writes_a_runnable_model(synthetic, tmp_path, capsys):
    import ggufpy
    from ggufpy.cli import main

    out = tmp_path / "q.gguf"
    assert main(["quantize", str(synthetic), str(out), "q8_0", "--tensor-type", "ffn_down=q6_k", "-q"]) == 0
    with ggufpy.open(out) as f:
        assert f.metadata["general.file_type"] == 7
        assert f.tensors["blk.4.ffn_down.weight"].type == GGMLType.Q6_K
        assert f.tensors["blk.4.ffn_up.weight"].type == GGMLType.Q8_0
    model = ggufpy.load(out)
    logits = model.forward(np.array([1, 2, 3]), 0, model.new_cache())
    assert np.isfinite(logits).all()
    assert main(["quantize", str(synthetic), str(tmp_path / "x.gguf"), "q4_k_m", "--tensor-type", "oops"]) == 2
    assert "expected PATTERN=TYPE" in capsys.readouterr().err


def test_failed_quantize_leaves_no_file(synthetic, tmp_path, monkeypatch):
    from ggufpy.workbench import quantize as q

    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")
        yield

    monkeypatch.setattr(q, "_tensor_bytes", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        quantize_model(synthetic, tmp_path / "out.gguf", "Q8_0")
    assert list(tmp_path.iterdir()) == []
