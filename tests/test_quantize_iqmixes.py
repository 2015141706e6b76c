"""llama.cpp's IQ mixes (IQ1_S/M, IQ2_XXS/XS/S/M, IQ3_XXS/XS/S/M) and Q2_K_S: the type of every tensor as
`llama_model_quantize` chooses it, and its refusal without an importance matrix.

Four synthetic models cover the branches of `llama_tensor_get_type_impl` (8 layers each, so that the first /
last eighth and "use more bits" layers differ):
- dense: llama, every row a multiple of 256, 2 heads sharing nothing (n_gqa 1), its own output head;
- gqa4: llama, n_gqa 4, tied output head, ffn_down rows of 288 (32-block fallback: IQ4_NL, Q4_0, ...) and
  attn_output rows of 272 (not even a multiple of 32: F16);
- moe4: qwen2moe, 4 experts and a shared expert (two ffn_down tensors per layer for the low-bit mixes' counter);
- moe8: qwen3moe, 8 experts (the n_expert == 8 rules);
and the real SmolLM2 and Gemma 3 (rows of 576 and 640: mostly fallbacks), from llama.cpp's dry runs.

llama.cpp's choices are recorded in tests/data/quantize/iqmixes.json (`python -m tests.test_quantize_iqmixes`
re-records them): with an importance matrix, the types of the file a real `llama_model_quantize` writes; without
one, a dry run's choices and the tensor llama.cpp refuses on. The live tests redo that when llama-cpp-python is
installed. ggufpy's own IQ quantizers are not run here (tests/test_quantize_iqgrid.py checks their bytes).
"""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path

import numpy as np
import pytest

from conformance.fixtures import ROLES, TinyLlama, write_tiny_llama
from conformance.fixtures_moe import TinyMoE
from ggufpy.constants import GGMLType
from ggufpy.errors import GGUFError
from ggufpy.workbench.imatrix_file import ImatrixEntry, ImatrixFile
from ggufpy.workbench.mixes import FTYPES, TypePlan, weight_order
from tests.models import MODELS as REAL_MODELS

GOLDEN = Path(__file__).parent / "data" / "quantize" / "iqmixes.json"
MIXES = ["IQ2_XXS", "IQ2_XS", "Q2_K_S", "IQ3_XS", "IQ3_XXS", "IQ1_S", "IQ3_S", "IQ3_M", "IQ2_S", "IQ2_M", "IQ1_M"]
EXTRA_MIXES = ["Q8_0", "IQ4_NL"]  # 32-block defaults on rows that are not a multiple of 32: F16
F16_EXPERTS = {**dict.fromkeys(ROLES, GGMLType.F32), "ffn": GGMLType.F16}  # halves the MoE files; types do not care
SPECS: dict[str, TinyLlama] = {
    "dense": TinyLlama(dim=256, hidden_dim=256, n_layers=8, n_heads=2, n_kv_heads=2, seed=31),
    "gqa4": TinyLlama(
        dim=256, hidden_dim=288, n_layers=8, n_heads=8, n_kv_heads=2, key_length=34, tied_output=True, seed=32
    ),
    "moe4": TinyMoE(
        dim=256, n_layers=8, n_heads=4, n_kv_heads=4, arch="qwen2moe", n_experts=4, expert_hidden_dim=256,
        hidden_dim=256, shared_hidden_dim=256, seed=33, types=F16_EXPERTS,
    ),
    "moe8": TinyMoE(
        dim=256, n_layers=8, n_heads=4, n_kv_heads=4, arch="qwen3moe", n_experts=8, expert_hidden_dim=256,
        hidden_dim=256, seed=34, types=F16_EXPERTS,
    ),
}  # fmt: skip


def write_model(directory: Path, model: str) -> Path:
    return write_tiny_llama(directory / f"{model}.gguf", SPECS[model])


def synthetic_imatrix(path: Path) -> ImatrixFile:
    """Random positive importances for every matrix in the blocks, one row per expert for the stacked ones."""
    import ggufpy

    rng = np.random.default_rng(7)
    entries = {}
    with ggufpy.open(path) as f:
        for name, info in f.tensors.items():
            if len(info.shape) >= 2 and name.startswith("blk.") and "ffn_gate_inp" not in name:
                n_mat = info.shape[0] if len(info.shape) == 3 else 1
                sums = (rng.standard_normal((n_mat, info.shape[-1])) ** 2 * 5).astype(np.float32)
                entries[name] = ImatrixEntry(sums, np.full(n_mat, 5, np.float32))
    return ImatrixFile(entries, ["synthetic"], chunk_count=1, chunk_size=64, name="synthetic.imatrix.gguf")


def plan_types(path: Path, mix: str, has_imatrix: bool) -> dict:
    """ggufpy's choice for every tensor, as a dry run: {"types": {name: type}, "imatrix_required": [names]}."""
    import ggufpy

    with ggufpy.open(path) as f:
        names = weight_order(f.tensors)
        plan = TypePlan.for_model(f.metadata, names, mix, has_imatrix=has_imatrix, dry_run=True)
        types = {n: plan.choose(n, f.tensors[n].shape, f.tensors[n].type).name for n in names}
    return {"types": types, "imatrix_required": plan.imatrix_required, "n_fallback": plan.n_fallback}


# --- llama.cpp ---------------------------------------------------------------------------------------------

_LOG_LINE = re.compile(r"\]\s+(\S+)\s+- \[[^\]]*\], type =\s+(\w+), size =\s+[\d.]+ MiB(?: ->\s+[\d.]+ MiB \((\w+)\))?")
_FALLBACKS = re.compile(r"(\d+) of \d+ tensor\(s\) required fallback quantization")
_OFFENDING = re.compile(r"offending tensor: (\S+)")


def _llama_run(src: Path, dst: Path, mix: str, imatrix: ImatrixFile | None, dry_run: bool) -> tuple[int, str]:
    """llama_model_quantize(src, dst, mix) (--allow-requantize, 1 thread): its return code and its log."""
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread, p.dry_run = FTYPES[mix].value, True, 1, dry_run
    keep = []
    if imatrix is not None:  # llama-quantize's rows: sums / counts, names in order, a null name last
        rows = (llama_cpp.llama_model_imatrix_data * (len(imatrix.entries) + 1))()
        for i, name in enumerate(sorted(imatrix.entries)):
            values = np.ascontiguousarray(imatrix.entries[name].values(), np.float32)
            keep.append(values)
            rows[i].name = name.encode()
            rows[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            rows[i].size = values.size
        p.imatrix = ctypes.cast(rows, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    chunks: list[str] = []

    @llama_cpp.llama_log_callback
    def on_log(level, text, user_data):
        chunks.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(on_log, ctypes.c_void_p())
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    finally:
        llama_cpp.llama_log_set(ctypes.cast(None, llama_cpp.llama_log_callback), ctypes.c_void_p())
    return rc, "".join(chunks)


def llama_choices(src: Path, tmp: Path, mix: str, imatrix: ImatrixFile, quantize: bool = False) -> dict:
    """What llama.cpp makes of `src` under `mix`: the types it chooses with the imatrix (those of the file a real
    run writes if `quantize`, else a dry run's), a dry run's types without one and its fallback count, and the
    tensor a real run without an imatrix refuses on (None if it does not)."""
    import ggufpy

    out = tmp / f"{src.stem}-{mix}.gguf"
    rc, log = _llama_run(src, out, mix, imatrix, dry_run=not quantize)
    assert rc == 0, f"llama_model_quantize({src.name}, {mix}) with an imatrix failed:\n{log[-2000:]}"
    if quantize:
        with ggufpy.open(out) as f:
            with_imatrix = [f.tensors[n].type.name for n in f.tensors]
        out.unlink()
    else:
        with_imatrix = [(m.group(3) or m.group(2)).upper() for m in _LOG_LINE.finditer(log)]
    rc, log = _llama_run(src, out, mix, None, dry_run=True)
    assert rc == 0, log[-2000:]
    fallbacks = _FALLBACKS.search(log)
    names = [m.group(1) for m in _LOG_LINE.finditer(log)]
    refused = None
    if quantize or "will require an imatrix" in log:  # the dry run's warning; a real run names the tensor
        rc, refusal = _llama_run(src, out, mix, None, dry_run=False)
        refused = _OFFENDING.search(refusal)
        assert (rc != 0) == (refused is not None) == ("will require an imatrix" in log), refusal[-2000:]
        out.unlink(missing_ok=True)
    return {
        "tensors": names,
        "imatrix": " ".join(with_imatrix),
        "none": " ".join((m.group(3) or m.group(2)).upper() for m in _LOG_LINE.finditer(log)),
        "n_fallback": int(fallbacks.group(1)) if fallbacks else 0,
        "refused_on": refused.group(1) if refused else None,
    }


def ours(path: Path, mix: str) -> dict:
    """ggufpy's side of `llama_choices`, in the same form."""
    with_imatrix, without = plan_types(path, mix, has_imatrix=True), plan_types(path, mix, has_imatrix=False)
    try:
        _plan_refusing(path, mix)
        refused_on = None
    except GGUFError as e:
        refused_on = re.search(r"tensor (\S+)", str(e)).group(1)
    return {
        "tensors": list(with_imatrix["types"]),
        "imatrix": " ".join(with_imatrix["types"].values()),
        "none": " ".join(without["types"].values()),
        "n_fallback": without["n_fallback"],
        "refused_on": refused_on,
    }


def _plan_refusing(path: Path, mix: str) -> None:
    import ggufpy

    with ggufpy.open(path) as f:
        plan = TypePlan.for_model(f.metadata, weight_order(f.tensors), mix)
        for n in weight_order(f.tensors):
            plan.choose(n, f.tensors[n].shape, f.tensors[n].type)


def record_model(path: Path, directory: Path, quantize: bool) -> dict:
    """llama.cpp's choices for one model under every mix (see `llama_choices`), the tensor names once."""
    im = synthetic_imatrix(path)
    mixes = {mix: llama_choices(path, directory, mix, im, quantize) for mix in MIXES + EXTRA_MIXES}
    names = mixes[MIXES[0]]["tensors"]
    assert all(m.pop("tensors") == names for m in mixes.values())
    return {"tensors": names, "mixes": mixes}


def record(directory: Path, which: list[str]) -> dict:
    """The golden: the synthetic models' choices from real quantizations with the synthetic imatrix ("synthetic",
    a few minutes), SmolLM2's and Gemma 3's from dry runs ("real"); the other part is kept from the file."""
    import llama_cpp

    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    golden["llama_cpp_python"] = llama_cpp.__version__
    if "synthetic" in which:
        golden["models"] = {m: record_model(write_model(directory, m), directory, quantize=True) for m in SPECS}
    if "real" in which:
        golden["real_models"] = {m: record_model(path(), directory, quantize=False) for m, path in REAL_MODELS.items()}
    return golden


# --- tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("iqmixes")
    return {model: write_model(d, model) for model in SPECS}


def _assert_same(model: str, path: Path, recorded: dict) -> None:
    """ggufpy's choices for `path` under every mix equal the recorded llama.cpp ones; the first differences shown."""
    for mix in MIXES + EXTRA_MIXES:
        got, expected = ours(path, mix), {"tensors": recorded["tensors"], **recorded["mixes"][mix]}
        assert got["tensors"] == expected["tensors"]  # llama.cpp's tensor order
        for key in ("imatrix", "none"):
            pairs = zip(got["tensors"], expected[key].split(), got[key].split(), strict=True)
            diff = [(n, e, g) for n, e, g in pairs if e != g]
            how = "with" if key == "imatrix" else "without"
            assert not diff, f"{model} {mix} ({how} an imatrix): (tensor, llama.cpp, ggufpy) {diff[:6]}"
        assert (got["n_fallback"], got["refused_on"]) == (expected["n_fallback"], expected["refused_on"]), mix


@pytest.mark.parametrize("model", list(SPECS))
def test_iq_mixes_match_llama_cpp_golden(golden, model_paths, model):
    """Every tensor's type under every IQ mix, with and without an imatrix, equal to llama.cpp's recorded one."""
    _assert_same(model, model_paths[model], golden["models"][model])


@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_iq_mixes_on_real_models_match_llama_cpp_golden(golden, model):
    """The same on SmolLM2 and Gemma 3 (576- and 640-wide rows: most tensors fall back to IQ4_NL / Q4_0 ...)."""
    _assert_same(model, REAL_MODELS[model](), golden["real_models"][model])


def test_refuses_without_a_required_imatrix(model_paths, tmp_path):
    """As llama-quantize: the first tensor (in llama.cpp's order) whose type needs an imatrix stops the plan,
    before any output file exists; a dry run lists every such tensor instead; the embeddings never need one."""
    from ggufpy.workbench.quantize import quantize_model

    with pytest.raises(
        GGUFError, match=r"^IQ2_XXS needs an importance matrix: tensor blk\.0\.attn_k\.weight would be IQ2_XXS"
    ):
        quantize_model(model_paths["dense"], tmp_path / "out.gguf", "IQ2_XXS")
    assert list(tmp_path.iterdir()) == []
    dry = plan_types(model_paths["dense"], "IQ2_XXS", has_imatrix=False)
    assert dry["types"]["token_embd.weight"] == "Q2_K" and dry["types"]["output.weight"] == "Q5_K"
    needing = [n for n, t in dry["types"].items() if t == "IQ2_XXS"]
    assert dry["imatrix_required"] == needing and len(needing) == 47
    # Q2_K needs one only inside a Q2_K_S file (the first eighth of ffn_down is Q4_K there)
    q2ks = plan_types(model_paths["dense"], "Q2_K_S", has_imatrix=False)
    assert q2ks["imatrix_required"] == [n for n, t in q2ks["types"].items() if t == "Q2_K" and n != "token_embd.weight"]
    assert q2ks["types"]["blk.0.ffn_down.weight"] == "Q4_K"
    assert plan_types(model_paths["dense"], "Q2_K", has_imatrix=False)["imatrix_required"] == []


def test_32_block_types_fall_back_to_f16(model_paths):
    """tensor_type_fallback: a 32-block type on rows that are not a multiple of 32 (gqa4's attn_output, 272
    wide) has nothing smaller to fall back to and becomes F16 (ggufpy used to raise for Q8_0)."""
    for mix in ("Q8_0", "Q4_0", "IQ4_NL"):
        types = plan_types(model_paths["gqa4"], mix, has_imatrix=False)["types"]
        assert {types[f"blk.{i}.attn_output.weight"] for i in range(8)} == {"F16"}, mix
    types = plan_types(model_paths["gqa4"], "IQ2_M", has_imatrix=True)["types"]
    assert types["blk.3.ffn_down.weight"] == "IQ4_NL"  # IQ2_S on rows of 288: the grid types' fallback


def _needs_llama_cpp():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'ggufpy[conformance]')")


@pytest.mark.conformance
@pytest.mark.parametrize("mix", MIXES + EXTRA_MIXES)
@pytest.mark.parametrize("model", list(SPECS) + list(REAL_MODELS))
def test_iq_mixes_match_llama_cpp_live(model_paths, tmp_path, model, mix):
    """The same against llama.cpp's dry runs (with and without the imatrix) and its refusal, live."""
    _needs_llama_cpp()
    path = model_paths[model] if model in SPECS else REAL_MODELS[model]()
    assert ours(path, mix) == llama_choices(path, tmp_path, mix, synthetic_imatrix(path))


@pytest.mark.slow
@pytest.mark.conformance
@pytest.mark.parametrize("model", list(SPECS))
def test_iq_mixes_quantized_files_live(model_paths, tmp_path, model):
    """The types in the files llama_model_quantize writes with the imatrix (what the golden records), live."""
    _needs_llama_cpp()
    path = model_paths[model]
    im = synthetic_imatrix(path)
    for mix in MIXES:
        assert ours(path, mix) == llama_choices(path, tmp_path, mix, im, quantize=True), f"{model} {mix}"


if __name__ == "__main__":  # re-record (needs llama-cpp-python): python -m tests.test_quantize_iqmixes [synthetic|real]
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        golden = record(Path(d), sys.argv[1:] or ["synthetic", "real"])
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
