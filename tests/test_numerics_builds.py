"""The llamacpp numerics replay the x86 build llama.cpp was compiled for: AVX-512 ("llamacpp") or AVX2
("llamacpp-avx2"), and only that build.

Why this file exists: on an AVX2 machine ggufpy's llamacpp mode (a replay of the AVX-512 build the conformance
goldens come from) parted from llama.cpp at SmolLM2's `kqv_out-8` on a 5-token prompt and drifted along the
perplexity chunks (PPL 31.161 against llama.cpp's 31.053). The cause was the build, not the sequence length:
llama.cpp's softmax (`ggml_v_expf`, its block sums), SiLU and F16/F32 products run 8 lanes wide on AVX2 and
round differently from the 16-lane AVX-512 code (ggufpy/quants/x86: `isa`). The goldens here were recorded by
llama.cpp on an AVX2 machine (their manifest holds its system info) on the first perplexity chunk of
ggufpy/data/eval.txt (64 tokens); each is reproduced bit for bit by the mode `llamacpp_mode(system_info)`
names, and not by the other build's replay.

Record again (on an AVX2 machine, llama-cpp-python installed) with `python tests/test_numerics_builds.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conformance.compare import Reference, bit_differences
from ggufpy.numerics import LLAMACPP_MODES, NUMERICS, llamacpp_mode
from ggufpy.quants.x86.simd import isa_of
from tests.models import MODELS

GOLDEN_DIR = Path(__file__).parent / "data" / "numerics"
PERPLEXITY = Path(__file__).parent / "data" / "perplexity"
KEEP_LAYERS = (0, 8, 29)  # SmolLM2's l_out kept (of 30): the first, the first that parted, the last
TOP_K = 256
PREFIX = 8  # positions of the quick test (the tiled k-quant kernel needs 8 rows; see Reference.prefix)


def _model(name: str, mode: str):
    import ggufpy

    return ggufpy.load(MODELS[name](), backend="numpy", tokenizer=False, numerics=mode)


def _golden(name: str) -> Reference:
    return Reference.load(name, GOLDEN_DIR)


# -- the build record ----------------------------------------------------------------------------------------------


def test_system_info_names_the_build():
    avx512 = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 |"
    avx2 = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 |"
    assert (llamacpp_mode(avx512), llamacpp_mode(avx2)) == ("llamacpp", "llamacpp-avx2")
    with pytest.raises(ValueError, match="no replay of its kernels"):
        isa_of("CPU : NEON = 1 | ARM_FMA = 1 |")
    for isa, mode in LLAMACPP_MODES.items():
        assert NUMERICS[mode].x86_isa == isa and NUMERICS[mode].x86_kernels


# -- SmolLM2 on the perplexity text, against llama.cpp's AVX2 build -------------------------------------------------


def test_golden_was_recorded_on_avx2_from_the_perplexity_chunk():
    ref = _golden("smollm2_eval")
    assert llamacpp_mode(ref.meta["llama_cpp"]["system_info"]) == "llamacpp-avx2"
    g = json.loads((PERPLEXITY / "smollm2.json").read_text())
    assert ref.tokens.tolist() == g["tokens"][: g["n_ctx"]]
    assert ref.meta["settings"]["flash_attn"] is False and ref.meta["settings"]["kv_type"] == "F16"


def test_prefix_is_bit_exact_in_the_recording_builds_mode():
    """Failed before the AVX2 replay existed: the llamacpp mode differed from layer 8 on."""
    ref = _golden("smollm2_eval")
    model = _model("smollm2", llamacpp_mode(ref.meta["llama_cpp"]["system_info"]))
    diffs = bit_differences(model, ref.prefix(PREFIX))
    assert len(diffs) == len(KEEP_LAYERS) + 2  # the kept l_out, result_norm, the logits
    assert not {k: n for k, n in diffs.items() if n}, "elements that differ from llama.cpp's, per tensor"


def test_the_other_builds_replay_differs():
    """The golden tells the builds apart: the AVX-512 replay does not reproduce it (SmolLM2 parts at layer 8)."""
    ref = _golden("smollm2_eval").prefix(PREFIX)
    diffs = bit_differences(_model("smollm2", "llamacpp"), ref)
    assert diffs["l_out-0"] == 0 and diffs["l_out-8"] > 0 and diffs["result_output"] > 0


@pytest.mark.slow  # the NumPy replay: ~1 CPU second per position
def test_every_position_is_bit_exact():
    ref = _golden("smollm2_eval")
    diffs = bit_differences(_model("smollm2", llamacpp_mode(ref.meta["llama_cpp"]["system_info"])), ref)
    assert not {k: n for k, n in diffs.items() if n}, "elements that differ from llama.cpp's, per tensor"


# -- recording ---------------------------------------------------------------------------------------------------


def record(directory: Path = GOLDEN_DIR) -> None:
    """SmolLM2 on the first perplexity chunk: llama.cpp's top-256 logits and log-sum-exp at every position,
    `result_norm`, and `l_out` of KEEP_LAYERS (all 30 would take 4 MB)."""
    from conformance.fixtures import sha256
    from conformance.llamacpp import SETTINGS, versions

    g = json.loads((PERPLEXITY / "smollm2.json").read_text())
    tokens = np.asarray(g["tokens"][: g["n_ctx"]], np.int32)
    path = MODELS["smollm2"]()
    ref = Reference.from_llamacpp(path, tokens, n_continue=0, top_k=TOP_K, name="smollm2_eval")
    keep = {f"l_out-{i}" for i in KEEP_LAYERS} | {"result_norm"}
    ref.tensors = {k: v for k, v in ref.tensors.items() if k in keep}
    directory.mkdir(parents=True, exist_ok=True)
    ref.save(directory / "smollm2_eval.npz")
    manifest = {
        "smollm2_eval": {
            "file": "smollm2_eval.npz",
            "model": "packaged:smollm2",
            "text": "ggufpy/data/eval.txt, the first perplexity chunk (tests/data/perplexity/smollm2.json)",
            "top_k": TOP_K,
            "sha256": sha256(path),
            "n_tokens": len(tokens),
            "llama_cpp": versions(),
            "settings": SETTINGS.as_dict(),
        }
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent))
    record()
    print(f"wrote {GOLDEN_DIR}: {sorted(p.name for p in GOLDEN_DIR.iterdir())}")


def test_host_mode_follows_the_cpu_flags(tmp_path):
    """AVX-512 F and DQ: the AVX-512 replay; one of them missing, or no cpuinfo: the AVX2 replay."""
    from ggufpy.numerics import host_llamacpp_mode

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma avx512f avx512dq avx512bw\n")
    assert host_llamacpp_mode(str(info)) == "llamacpp"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma avx512f\n")
    assert host_llamacpp_mode(str(info)) == "llamacpp-avx2"
    assert host_llamacpp_mode(str(tmp_path / "missing")) == "llamacpp-avx2"
