"""`ggufpy inspect`: text and JSON reports checked against facts computed from the reader, and clean errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import pytest

import ggufpy
from ggufpy.cli import main
from ggufpy.cli.inspect import human_count
from ggufpy.packaged import ModelNotInstalledError, smollm2_path
from tests.gguf_bytes import GGUFBytes, V, small_valid


@pytest.fixture(scope="module")
def smollm2():
    try:
        return smollm2_path()
    except ModelNotInstalledError as e:
        pytest.skip(str(e))


def facts(path) -> dict:
    """What the report must say, computed from the reader alone."""
    with ggufpy.open(path) as f:
        counts = Counter(t.type.name for t in f.tensors.values())
        nbytes, params = Counter(), Counter()
        for t in f.tensors.values():
            nbytes[t.type.name] += t.nbytes
            params[t.type.name] += t.n_elements
        return {
            "arch": f.architecture,
            "blocks": f.metadata[f"{f.architecture}.block_count"],
            "tokens": f.metadata["tokenizer.ggml.tokens"],
            "template": f.metadata["tokenizer.chat_template"],
            "counts": dict(counts),
            "bytes": dict(nbytes),
            "params": dict(params),
            "tensors": {n: (t.type.name, t.shape, t.nbytes) for n, t in f.tensors.items()},
        }


def inspect(capsys, *args) -> tuple[int, str, str]:
    code = main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_report_on_smollm2(smollm2, capsys):
    want = facts(smollm2)
    assert (want["arch"], want["blocks"]) == ("llama", 30)
    assert want["counts"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    code, out, err = inspect(capsys, smollm2)
    assert code == 0 and err == ""
    assert re.search(r"^architecture:\s+llama$", out, re.M)
    assert re.search(rf"^blocks:\s+{want['blocks']}$", out, re.M)
    assert f"llama.block_count: {want['blocks']}" in out
    for name, count in want["counts"].items():
        row = rf"^\s+{name}\s+{count}\s+{want['bytes'][name]:,}\s+{re.escape(human_count(want['params'][name]))}\s"
        assert re.search(row, out, re.M), f"no summary row for {name}"
    total = sum(want["params"].values())
    assert f"parameters: {human_count(total)} ({total:,})" in out
    assert human_count(total) == "134.5M"
    bpw = 8 * sum(want["bytes"].values()) / total
    assert f"bits per weight: {bpw:.2f}" in out
    tokens = want["tokens"]
    assert f"tokenizer.ggml.tokens: [{len(tokens)} x str] [{tokens[0]!r}, {tokens[1]!r}," in out
    template_line = next(line for line in out.splitlines() if "tokenizer.chat_template" in line)
    assert template_line.endswith(f"... ({len(want['template'])} chars)") and len(template_line) < 200
    assert "blk.0.attn_q.weight" not in out  # the tensor table only comes with --tensors


def test_json_report_on_smollm2(smollm2, capsys):
    want = facts(smollm2)
    code, out, _ = inspect(capsys, smollm2, "--json")
    assert code == 0
    report = json.loads(out)
    assert {name: s["tensors"] for name, s in report["types"].items()} == want["counts"]
    assert {name: s["bytes"] for name, s in report["types"].items()} == want["bytes"]
    assert {name: s["parameters"] for name, s in report["types"].items()} == want["params"]
    assert report["parameters"] == sum(want["params"].values())
    assert report["bits_per_weight"] == pytest.approx(8 * sum(want["bytes"].values()) / report["parameters"], 1e-4)
    assert (report["architecture"], report["block_count"]) == ("llama", want["blocks"])
    assert report["paths"] == [str(smollm2)] and report["file_size"] == smollm2.stat().st_size
    tokens = report["metadata"]["tokenizer.ggml.tokens"]
    assert tokens["length"] == len(want["tokens"]) and tokens["element_type"] == "str"
    assert tokens["head"] == want["tokens"][: len(tokens["head"])]
    assert report["metadata"]["tokenizer.chat_template"] == want["template"]  # JSON keeps strings whole
    assert {t["name"]: (t["type"], tuple(t["shape"]), t["bytes"]) for t in report["tensors"]} == want["tensors"]


def test_short_name_resolves_to_the_packaged_model(smollm2, capsys):
    code, out, _ = inspect(capsys, "smollm2", "--json")
    assert code == 0 and json.loads(out)["paths"] == [str(smollm2)]


def test_tensor_table_on_a_small_file(tmp_path, capsys):
    path = tmp_path / "small.gguf"
    path.write_bytes(small_valid().build())
    code, out, _ = inspect(capsys, path, "--tensors")
    assert code == 0
    with ggufpy.open(path) as f:
        infos = list(f.tensors.values())
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("tensors ("))
    assert lines[start + 1].split() == ["name", "type", "shape", "bytes"]
    table = lines[start + 2 :]
    assert len(table) == len(infos)
    for line, t in zip(table, infos, strict=True):
        assert line.split() == [t.name, t.type.name, *" x ".join(map(str, t.shape)).split(), f"{t.nbytes:,}"]
    assert "test.nested: [2 x array] [[2 x int] [1, 2], [1 x str] ['x']]" in out
    assert "test.float32: 1.5" in out and "test.bool: True" in out


def test_json_summarises_long_arrays(tmp_path, capsys):
    g = small_valid()
    g.add("test.long_ints", V.ARRAY, list(range(100)), V.INT32)
    g.add("test.long_floats", V.ARRAY, [0.1] * 100, V.FLOAT32)
    g.add("test.long_strings", V.ARRAY, [f"s{i}" for i in range(20)], V.STRING)
    g.add("test.eps", V.FLOAT32, 1e-5)
    path = tmp_path / "long.gguf"
    path.write_bytes(g.build())
    code, out, _ = inspect(capsys, path, "--json")
    assert code == 0
    m = json.loads(out)["metadata"]
    assert m["test.long_ints"] == {"length": 100, "element_type": "i32", "head": [0, 1, 2, 3]}
    assert m["test.long_floats"] == {"length": 100, "element_type": "f32", "head": [0.1] * 4}
    assert m["test.long_strings"] == {"length": 20, "element_type": "str", "head": ["s0", "s1", "s2", "s3"]}
    assert m["test.eps"] == 1e-5  # FLOAT32 printed as the shortest decimal of the float32, not 9.99999974e-06
    assert m["test.nested"] == [[1, 2], ["x"]] and m["test.strings"] == ["a", "bé", "中"]
    code, out, _ = inspect(capsys, path)
    assert "test.long_ints: [100 x i32] [0, 1, 2, 3, ...]" in out


def test_split_model_lists_every_part(tmp_path, capsys):
    paths = []
    for i in range(3):
        g = GGUFBytes()
        if i == 0:
            g.add("general.architecture", V.STRING, "llama")
        g.add("split.no", V.UINT16, i).add("split.count", V.UINT16, 3).add("split.tensors.count", V.INT32, 3)
        g.add_tensor(f"blk.{i}.ffn_up.weight", ggufpy.GGMLType.F32, [32, 2])
        paths.append(tmp_path / f"model-{i + 1:05d}-of-00003.gguf")
        paths[-1].write_bytes(g.build())
    code, out, _ = inspect(capsys, paths[1], "--json")
    report = json.loads(out)
    assert code == 0 and report["paths"] == list(map(str, paths)) and report["tensor_count"] == 3
    assert report["file_size"] == sum(p.stat().st_size for p in paths)
    assert [t["part"] for t in report["tensors"]] == [0, 1, 2]
    code, out, _ = inspect(capsys, paths[0], "--tensors")
    assert code == 0 and "parts:        3" in out
    assert all(str(p) in out for p in paths)
    assert re.search(r"^\s+blk\.2\.ffn_up\.weight\s+F32\s+2 x 32\s+256\s+3$", out, re.M)


def test_bad_magic_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(28))
    for extra in ([], ["--json"]):
        code, out, err = inspect(capsys, bad, *extra)
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and err.startswith("ggufpy: error: ")
        assert str(bad) in err and "magic" in err and "Traceback" not in err


def test_missing_file_is_exit_2(tmp_path, capsys):
    missing = tmp_path / "missing.gguf"
    code, out, err = inspect(capsys, missing)
    assert code == 2 and out == "" and err.count("\n") == 1 and str(missing) in err


def test_python_dash_m_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(28))
    proc = subprocess.run(
        [sys.executable, "-m", "ggufpy", "inspect", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "magic" in proc.stderr and "Traceback" not in proc.stderr


def test_usage_errors_return_2_and_help_returns_0(capsys):
    assert main([]) == 2
    assert main(["inspect"]) == 2
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
