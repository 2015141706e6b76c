"""The GGUF reader: round trips against gguf-py's writer, split models, and a table of malformed files."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ggufpy
import ggufpy.reader
from ggufpy import GGMLType, GGUFError, GGUFUnsupportedError
from ggufpy.errors import GGUFFormatError
from ggufpy.reader import StringArray
from tests.gguf_bytes import GGUFBytes, V, gguf_string, small_valid

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, data: bytes, name="m.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_small_valid_file_reads_every_value_type(tmp_path):
    with ggufpy.open(write(tmp_path, small_valid().build())) as f:
        m = f.metadata
        assert m["general.architecture"] == "llama"
        assert (m["test.uint8"], m["test.int8"], m["test.uint16"], m["test.int16"]) == (7, -7, 700, -700)
        assert (m["test.uint32"], m["test.int32"], m["test.uint64"], m["test.int64"]) == (
            70000,
            -70000,
            2**40,
            -(2**40),
        )
        assert m["test.float32"] == 1.5 and m["test.float64"] == 2.25 and m["test.bool"] is True
        assert m["test.strings"] == ["a", "bé", "中"]
        assert m["test.ints"] == [0, 1, 2, 3, 4]
        assert m["test.nested"] == [[1, 2], ["x"]]
        assert list(f.tensors) == ["token_embd.weight", "blk.0.attn_q.weight", "output.weight"]
        emb = f.tensors["token_embd.weight"]
        assert emb.type == GGMLType.F32 and emb.shape == (4, 8) and emb.nbytes == 128
        assert f.tensors["output.weight"].shape == (2, 32)
        assert f.raw("output.weight").dtype == np.uint8 and f.raw("output.weight").size == 68
        assert not f.raw("output.weight").flags.writeable


def _write_with_gguf_py(path, tensors, kv):
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in kv.items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
        else:
            w.add_uint32(k, v)
    for name, (arr, qtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_matches_gguf_py_on_a_file_it_wrote(tmp_path):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 64)).astype(np.float32)
    q = gguf.quants.quantize(rng.standard_normal((5, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path / "w.gguf"
    kv = {"llama.block_count": 2, "test.vocab": [f"tok{i}" for i in range(1000)], "test.scores": [0.5] * 100}
    _write_with_gguf_py(path, {"a": (a, None), "b": (q, gguf.GGMLQuantizationType.Q8_0)}, kv)
    ref = gguf.GGUFReader(str(path))
    with ggufpy.open(path) as f:
        assert f.metadata["llama.block_count"] == 2
        assert f.metadata["test.vocab"] == kv["test.vocab"]
        np.testing.assert_array_equal(f.metadata["test.scores"], np.full(100, 0.5, np.float32))
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert info.type == t.tensor_type
            assert info.shape == tuple(int(d) for d in reversed(t.shape))
            assert np.array_equal(f.raw(t.name), np.asarray(t.data).view(np.uint8).reshape(-1))
        np.testing.assert_array_equal(f.dequantize("a"), a)


def test_split_model_opens_as_one(tmp_path):
    rng = np.random.default_rng(2)
    arrays = {f"blk.{i}.ffn_up.weight": rng.standard_normal((2, 32)).astype(np.float32) for i in range(5)}
    names = list(arrays)
    groups = [names[:2], names[2:4], names[4:]]
    for i, group in enumerate(groups):
        g = GGUFBytes()
        if i == 0:
            g.add("general.architecture", V.STRING, "llama")
        g.add("split.no", V.UINT16, i).add("split.count", V.UINT16, 3).add("split.tensors.count", V.INT32, 5)
        for n in group:
            g.add_tensor(n, GGMLType.F32, [32, 2], arrays[n].tobytes())
        write(tmp_path, g.build(), f"model-{i + 1:05d}-of-00003.gguf")
    for opened in ("model-00001-of-00003.gguf", "model-00003-of-00003.gguf"):
        with ggufpy.open(tmp_path / opened) as f:
            assert f.architecture == "llama"
            assert sorted(f.tensors) == sorted(names)
            for n in names:
                np.testing.assert_array_equal(f.dequantize(n), arrays[n])
    (tmp_path / "model-00002-of-00003.gguf").unlink()
    with pytest.raises(GGUFError, match="split part 2 of 3 is missing"):
        ggufpy.open(tmp_path / "model-00001-of-00003.gguf")


def _bad(mutate) -> GGUFBytes:
    g = small_valid()
    mutate(g)
    return g


def _set_header(data: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def _first_tensor_info_offset(data: bytes) -> int:
    return data.index(b"token_embd.weight") - 8


VALID = small_valid().build()
TI = _first_tensor_info_offset(VALID)

# (id, bytes, regex the message must contain)
BAD_FILES = [
    ("empty", b"", "empty"),
    ("short", b"GGU", "truncated"),
    ("bad magic", b"GGML" + VALID[4:], "magic"),
    ("version 1", _set_header(VALID, 4, "<I", 1), "version 1 used 32-bit"),
    ("version 4", _set_header(VALID, 4, "<I", 4), "versions 2 and 3"),
    ("version 0", _set_header(VALID, 4, "<I", 0), "versions 2 and 3"),
    ("big endian", _set_header(VALID, 4, "<I", 0x03000000), "big-endian"),
    ("truncated header", VALID[:20], "truncated"),
    ("truncated metadata", VALID[: TI - 10], "truncated|past the end"),
    ("truncated tensor infos", VALID[: TI + 20], "truncated|past the end"),
    ("truncated data", VALID[:-40], "past the end"),
    ("kv count too large", _set_header(VALID, 16, "<Q", 2**62), "cannot fit"),
    ("tensor count too large", _set_header(VALID, 8, "<Q", 2**40), "cannot fit"),
    ("string length past end", _set_header(VALID, 24, "<Q", 2**63), "past the end"),
    ("unknown value type", GGUFBytes(kv=[("k", struct.pack("<I", 13))]).build(), "unknown value type 13"),
    ("invalid utf-8 key", GGUFBytes(kv=[(b"\xff\xfe", struct.pack("<IB", 0, 1))]).build(), "not valid UTF-8"),
    ("invalid utf-8 value", GGUFBytes().add("k", V.STRING, b"\xc3\x28").build(), "not valid UTF-8"),
    ("array count too large", GGUFBytes(kv=[("k", struct.pack("<IIQ", 9, 4, 2**60))]).build(), "cannot fit"),
    ("string array past end", GGUFBytes(kv=[("k", struct.pack("<IIQQ", 9, 8, 1, 2**40))]).build(), "past the end"),
    ("bool not 0/1", GGUFBytes().add("k", V.BOOL, 2).build(), "must be 0 or 1"),
    ("duplicate key", GGUFBytes().add("k", V.UINT8, 1).add("k", V.UINT8, 2).build(), "duplicate key"),
    ("empty key", GGUFBytes().add("", V.UINT8, 1).build(), "key is empty"),
    ("alignment not power of 2", GGUFBytes().add("general.alignment", V.UINT32, 48).build(), "power of two"),
    ("alignment zero", GGUFBytes().add("general.alignment", V.UINT32, 0).build(), "power of two"),
    ("alignment wrong type", GGUFBytes().add("general.alignment", V.UINT64, 32).build(), "UINT32"),
    ("n_dims 0", GGUFBytes().add_tensor("t", GGMLType.F32, []).build(), "n_dims"),
    ("n_dims 5", GGUFBytes().add_tensor("t", GGMLType.F32, [1, 1, 1, 1, 1]).build(), "n_dims"),
    ("zero dim", GGUFBytes().add_tensor("t", GGMLType.F32, [4, 0], b"").build(), "must all be >= 1"),
    ("overflowing dims", GGUFBytes().add_tensor("t", GGMLType.I8, [2**62, 4], b"").build(), "below 2\\*\\*63"),
    ("unknown type", GGUFBytes().add_tensor("t", 4, [32], b"").build(), "unknown GGML type id 4"),
    ("type out of range", GGUFBytes().add_tensor("t", 99, [32], b"").build(), "unknown GGML type id 99"),
    ("row not multiple of block", GGUFBytes().add_tensor("t", GGMLType.Q4_0, [48, 1]).build(), "block size 32"),
    (
        "misaligned offset",
        GGUFBytes().add_tensor("t", GGMLType.F32, [4], offset=4).build(),
        "multiple of the alignment",
    ),
    (
        "data past end",
        GGUFBytes(with_data=False).add_tensor("t", GGMLType.F32, [4], offset=2**40).build(),
        "past the end",
    ),
    (
        "overlap",
        GGUFBytes()
        .add_tensor("a", GGMLType.F32, [16], offset=0)
        .add_tensor("b", GGMLType.F32, [16], offset=32)
        .build(),
        "overlaps",
    ),
    (
        "duplicate tensor",
        GGUFBytes().add_tensor("t", GGMLType.F32, [4]).add_tensor("t", GGMLType.F32, [4]).build(),
        "duplicate tensor name",
    ),
    ("empty tensor name", GGUFBytes().add_tensor("", GGMLType.F32, [4]).build(), "name must be"),
    ("long tensor name", GGUFBytes().add_tensor("x" * 64, GGMLType.F32, [4]).build(), "name must be"),
    ("deep nesting", GGUFBytes(kv=[("k", struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 20)]).build(), "nested"),
]


@pytest.mark.parametrize("name,data,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_file_raises_gguf_error_naming_file_and_rule(tmp_path, name, data, message):
    path = write(tmp_path, data)
    with pytest.raises(GGUFError) as err:
        ggufpy.open(path).close()
    assert str(path) in str(err.value)
    if message:
        assert err.match(message)


def test_unsupported_version_is_unsupported_error(tmp_path):
    with pytest.raises(GGUFUnsupportedError):
        ggufpy.open(write(tmp_path, _set_header(VALID, 4, "<I", 1)))


def test_version_2_is_read(tmp_path):
    with ggufpy.open(write(tmp_path, _set_header(VALID, 4, "<I", 2))) as f:
        assert f.version == 2 and len(f.tensors) == 3


def _check_only_gguf_error(tmp_path, data: bytes):
    path = write(tmp_path, data)
    try:
        with ggufpy.open(path) as f:
            for name in f.tensors:
                f.raw(name)
    except GGUFError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, len(VALID)))
def test_fuzz_truncation_only_ever_gives_gguf_error(tmp_path, cut):
    _check_only_gguf_error(tmp_path, VALID[:cut])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(
        st.tuples(
            st.integers(0, len(VALID) - 1),
            st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x01, 0x40, 0x05, 0x09, 0x0C]),
            st.sampled_from([1, 4, 8]),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_fuzz_mutation_only_ever_gives_gguf_error(tmp_path, edits):
    b = bytearray(VALID)
    for pos, byte, width in edits:
        b[pos : pos + width] = bytes([byte]) * len(b[pos : pos + width])
    _check_only_gguf_error(tmp_path, bytes(b))


def test_close_releases_the_map(tmp_path):
    f = ggufpy.open(write(tmp_path, VALID))
    f.close()
    assert all(p.map.closed for p in f._parts)


# --- long string arrays: a compact StringArray that behaves like the list ----------------------------------------


def _string_array_file(tmp_path, strings: list, name="s.gguf"):
    return write(tmp_path, GGUFBytes().add("k", V.ARRAY, strings, V.STRING).build(), name)


def test_long_string_array_is_compact_and_behaves_like_the_list(tmp_path):
    strings = ["", "a", "bé", "中文", "\0x\0", "emoji 🙂", " ", "x" * 1000] * 20  # 160 > SMALL_ARRAY
    with ggufpy.open(_string_array_file(tmp_path, strings)) as f:
        v = f.metadata["k"]
    assert isinstance(v, StringArray) and len(v) == 160
    assert v == strings and strings == v and v != strings[:-1] and v != ["z"] * 160
    assert v.tolist() == list(v) == [v[i] for i in range(160)] == strings
    assert (v[0], v[1], v[3], v[4], v[-1], v[-8]) == ("", "a", "中文", "\0x\0", "x" * 1000, "")
    assert v[2:6] == strings[2:6] and v[::-40] == strings[::-40]
    with pytest.raises(IndexError):
        v[160]
    assert repr(v) == "StringArray(['', 'a', 'bé', ...], 160 strings)"
    # the bytes of the strings plus one separator and one offset per string, not a Python str each
    assert v.nbytes == sum(len(s.encode()) for s in strings) + 160 + 161 * 4


def test_string_array_without_nul_decodes_in_one_split(tmp_path):
    strings = [f"tok{i}é" if i % 3 else "" for i in range(500)]
    with ggufpy.open(_string_array_file(tmp_path, strings)) as f:
        v = f.metadata["k"]
        assert v._plain and v.tolist() == strings
        assert f.metadata == {"k": strings}  # a dict of StringArrays compares equal to one of lists


@pytest.mark.parametrize(
    "strings,bad",
    [
        (["ok"] * 70 + [b"\xff"] + ["ok"] * 5, 70),
        # each half alone is invalid, joined they would be "é": every string must be valid on its own
        (["ok"] * 80 + [b"\xc3", b"\xa9"], 80),
        ([b"\xa9"] + ["ok"] * 80, 0),
        (["ok"] * 99 + [b"ok\xe4\xb8"], 99),
    ],
)
def test_string_array_element_with_invalid_utf8_is_named(tmp_path, strings, bad):
    path = _string_array_file(tmp_path, strings)
    with pytest.raises(GGUFFormatError, match=rf"metadata 'k'\[{bad}\] at offset \d+: string is not valid UTF-8"):
        ggufpy.open(path)


def test_vocab_of_a_real_model_reads_as_before(smollm2_file):
    """The tokens of SmolLM2, decoded one by one from the raw bytes, against the StringArray."""
    with ggufpy.open(smollm2_file) as f:
        tokens = f.metadata["tokenizer.ggml.tokens"]
        merges = f.metadata["tokenizer.ggml.merges"]
        data = bytes(f._parts[0].map[: f.parts[0].data_offset])
    assert isinstance(tokens, StringArray) and len(tokens) == 49152 and len(merges) == 48900
    key = b"tokenizer.ggml.tokens"
    pos = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 16
    expected = []
    for _ in range(len(tokens)):
        (n,) = struct.unpack_from("<Q", data, pos)
        expected.append(data[pos + 8 : pos + 8 + n].decode())
        pos += 8 + n
    assert tokens.tolist() == expected and tokens[100] == expected[100] and tokens[-1] == expected[-1]
    assert merges[0] == "Ġ t" and all(" " in m for m in merges[:1000])


# --- limits: sparse files and amplification ----------------------------------------------------------------------


def _sparse(tmp_path, head: bytes, size: int, name="sparse.gguf"):
    """A file of apparent `size` bytes whose only written bytes are `head` (the rest is a hole)."""
    p = tmp_path / name
    p.write_bytes(head)
    os.truncate(p, size)
    return p


def _kv_head(key: str, encoded: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string(key) + encoded


SPARSE = 4 * 2**30  # apparent size: 4 GiB on disk as one 4 KB block


def _run_limited(code: str, data_limit: int = 2**30) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter whose heap (RLIMIT_DATA) is capped: an over-allocation fails there."""
    prelude = f"import resource; resource.setrlimit(resource.RLIMIT_DATA, ({data_limit}, {data_limit}))\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@pytest.mark.parametrize(
    "encoded,message",
    [
        (struct.pack("<IQ", V.STRING, SPARSE - 100), "string length 4294967196 is above the limit of 67108864"),
        (struct.pack("<IIQ", V.ARRAY, V.UINT8, SPARSE - 100), "4294967196 elements is above the limit of 16777216"),
        # 16M u64 elements (128 MiB) pass the array limit, and 2 x 128 MiB would pass the header limit
        (struct.pack("<IIQ", V.ARRAY, V.UINT64, 2**24) + b"", None),
    ],
    ids=["string", "u8 array", "u64 array at the count limit"],
)
def test_sparse_file_values_are_capped_before_any_allocation(tmp_path, encoded, message):
    path = _sparse(tmp_path, _kv_head("k", encoded), SPARSE)
    r = _run_limited(f"""
        import ggufpy
        try:
            with ggufpy.open({str(path)!r}) as f:
                v = f.metadata["k"]
                print("OK", type(v).__name__, len(v), v.nbytes)
        except ggufpy.GGUFError as e:
            print("GGUFError", e)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    if message is None:  # at the limits: read, as one 128 MiB NumPy array (a copy, within the heap cap)
        assert r.stdout.split() == ["OK", "ndarray", str(2**24), str(8 * 2**24)]
    else:
        assert r.stdout.startswith("GGUFError") and message in r.stdout and "'k'" in r.stdout


def test_sparse_file_header_limit(tmp_path):
    # two 128 MiB arrays: each within the array limit, together past the 256 MiB header limit
    big = struct.pack("<IIQ", V.ARRAY, V.UINT64, 2**24)
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + gguf_string("a") + big
    path = _sparse(tmp_path, head, SPARSE)
    with path.open("r+b") as f:  # the second key after the first array's 128 MiB of zeros
        f.seek(len(head) + 8 * 2**24)
        f.write(gguf_string("b") + big)
    with pytest.raises(GGUFFormatError, match=r"metadata 'b' count .*past the header limit.*first 268435456 bytes"):
        ggufpy.open(path)


def test_string_array_amplification_is_bounded(tmp_path):
    """200k two-byte tokens (a 2 MB array): the reader's peak was 10.2x the file and it kept 5.9x (a Python str
    per token); now the peak is 1.8x and it keeps 0.7x (3 bytes per token and a 4-byte offset)."""
    n = 200_000
    body = struct.pack("<IIQ", V.ARRAY, V.STRING, n) + (struct.pack("<Q", 2) + b"ab") * n
    path = write(tmp_path, _kv_head("tokenizer.ggml.tokens", body))
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with ggufpy.open(path) as f:
            tokens = f.metadata["tokenizer.ggml.tokens"]
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(tokens) == n and tokens[n - 1] == "ab"
    assert tokens.nbytes < size
    assert peak < 2.5 * size, f"peak {peak / size:.1f}x the file"


def test_nested_arrays_are_bounded(tmp_path):
    # 65,537 empty arrays in one array (786 KB): each would become a Python list; the file-wide limit is 65,536
    n = 2**16 + 1
    path = write(tmp_path, _kv_head("k", struct.pack("<IIQ", V.ARRAY, V.ARRAY, n) + struct.pack("<IQ", 0, 0) * n))
    with pytest.raises(GGUFFormatError, match=r"metadata 'k'\[65536\] .*more than 65536 arrays inside arrays"):
        ggufpy.open(path)
    three = struct.pack("<IIQ", V.ARRAY, V.ARRAY, 1) + struct.pack("<IQ", V.ARRAY, 1) + struct.pack("<IQ", 0, 0)
    with pytest.raises(GGUFFormatError, match=r"metadata 'k'\[0\]\[0\] .*nested deeper than 2 levels"):
        ggufpy.open(write(tmp_path, _kv_head("k", three), "three.gguf"))


# --- a file truncated or rewritten while open (SIGBUS) -----------------------------------------------------------


def _one_tensor_file(tmp_path, n=2**18) -> tuple[Path, np.ndarray]:
    """A file with one 1 MiB F32 tensor, so that truncating to the data section removes whole pages."""
    values = np.arange(n, dtype=np.float32)
    path = write(tmp_path, GGUFBytes().add_tensor("t", GGMLType.F32, [n], values.tobytes()).build(), "t.gguf")
    return path, values


def _truncate_then(path, action: str, mmap: bool = True) -> subprocess.CompletedProcess:
    """In a subprocess: open, truncate the file to its header, then run `action` on `f` and print the outcome."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import os, ggufpy, ggufpy.reader
                f = ggufpy.reader.open({str(path)!r}, mmap={mmap})
                early = f.raw("t")  # a view taken before the truncation
                os.truncate({str(path)!r}, f.parts[0].data_offset)
                try:
                    out = {action}
                    print("OK", float(out.sum()) if hasattr(out, "sum") else out)
                except ggufpy.GGUFError as e:
                    print("GGUFError", e)
            """),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.parametrize("action", ['f.dequantize("t")', 'f.raw("t")', "f.check()"])
def test_truncated_after_open_is_a_gguf_error_not_sigbus(tmp_path, action):
    path, _ = _one_tensor_file(tmp_path)
    with ggufpy.open(path) as f:
        before, after = f.parts[0].size, f.parts[0].data_offset
    r = _truncate_then(path, action)
    assert r.returncode == 0, f"exit {r.returncode} (-7 is SIGBUS): {r.stderr[-1000:]}"
    assert r.stdout.startswith("GGUFError") and "the file changed after it was opened" in r.stdout
    assert f"(size {before} -> {after} bytes" in r.stdout


@pytest.mark.parametrize("action", ['f.dequantize("t")', "early.view(np.float32)"])
def test_mmap_false_reads_the_data_so_truncation_cannot_hurt(tmp_path, action):
    path, values = _one_tensor_file(tmp_path)
    r = _truncate_then(path, action.replace("np.", "__import__('numpy')."), mmap=False)
    assert r.returncode == 0, r.stderr[-1000:]
    assert r.stdout.split() == ["OK", repr(float(values.sum()))]


def test_a_view_taken_before_the_truncation_still_faults(tmp_path):
    """The documented limit of the mmap mode: a view handed out earlier cannot be checked (docs/security.md)."""
    path, _ = _one_tensor_file(tmp_path)
    r = _truncate_then(path, "early")
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stdout)


def test_rewritten_in_place_is_detected(tmp_path):
    path, values = _one_tensor_file(tmp_path)
    with ggufpy.open(path) as f:
        np.testing.assert_array_equal(f.dequantize("t"), values)
        data = path.read_bytes()
        st = path.stat()
        path.write_bytes(data[:-8] + b"\x01" * 8)  # same size, new contents
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(GGUFFormatError, match="changed after it was opened"):
            f.dequantize("t")


def test_mmap_false_matches_mmap(tmp_path):
    path = write(tmp_path, VALID)
    with ggufpy.open(path) as a, ggufpy.reader.open(path, mmap=False) as b:
        assert a.mapped and not b.mapped
        assert a.metadata == b.metadata and a.tensors == b.tensors
        for name in a.tensors:
            assert np.array_equal(a.raw(name), b.raw(name)) and not b.raw(name).flags.writeable
            np.testing.assert_array_equal(a.dequantize(name), b.dequantize(name))
    assert b.raw("output.weight").size == 68  # the in-memory copy outlives close()
    with pytest.raises(ValueError, match="closed"):
        a.raw("output.weight")


# --- split models: every part agrees with the first, and the named file is one of them -------------------------


def _write_split(tmp_path, count=3, name_count=None, edit=None, prefix="m"):
    """`count` parts of a split model holding one tensor each; `edit(i, g)` may change part i before writing."""
    paths = []
    for i in range(count):
        g = GGUFBytes()
        if i == 0:
            g.add("general.architecture", V.STRING, "llama")
        g.add("split.no", V.UINT16, i).add("split.count", V.UINT16, count).add("split.tensors.count", V.INT32, count)
        g.add_tensor(f"blk.{i}.ffn_up.weight", GGMLType.F32, [32, 2])
        if edit:
            edit(i, g)
        paths.append(write(tmp_path, g.build(), f"{prefix}-{i + 1:05d}-of-{name_count or count:05d}.gguf"))
    return paths


def _set(key, vtype, value, part=1):
    def edit(i, g):
        if i == part:
            g.kv = [(k, v) for k, v in g.kv if k != key]
            g.add(key, vtype, value)

    return edit


def _aligned(alignment, part):
    def edit(i, g):
        if i == part:
            g.add("general.alignment", V.UINT32, alignment)
            g.alignment = alignment

    return edit


def test_split_named_file_must_be_the_part_its_name_says(tmp_path):
    # m-00001-of-00003.gguf whose metadata says split.count 2 used to open m-*-of-00002 instead
    _write_split(tmp_path, count=2, prefix="m")  # m-00001-of-00002, m-00002-of-00002: another model
    (named,) = _write_split(tmp_path, count=1, prefix="m", edit=_set("split.count", V.UINT16, 2, part=0))[:1]
    os.rename(named, tmp_path / "m-00001-of-00003.gguf")
    with pytest.raises(GGUFFormatError, match=r"file name says part 1 of 3 but the metadata says part 1 of 2"):
        ggufpy.open(tmp_path / "m-00001-of-00003.gguf")
    paths = _write_split(tmp_path, count=3, prefix="n")
    os.rename(paths[1], tmp_path / "n-00003-of-00003.gguf.tmp")
    os.rename(paths[2], paths[1])
    os.rename(tmp_path / "n-00003-of-00003.gguf.tmp", paths[2])  # parts 2 and 3 swapped by name
    with pytest.raises(GGUFFormatError, match=r"file name says part 2 of 3 but the metadata says part 3 of 3"):
        ggufpy.open(paths[1])


@pytest.mark.parametrize(
    "edit,message",
    [
        (_set("split.count", V.UINT16, 4), r"'split.count' is 4 \(UINT16\) but the first part .* has 3 \(UINT16\)"),
        (_set("general.architecture", V.STRING, "qwen2"), r"'general.architecture' is 'qwen2' .* has 'llama'"),
        (_aligned(64, part=2), r"'general.alignment' is 64 .*: the parts disagree"),
        (_set("split.tensors.count", V.INT32, 7, part=2), r"'split.tensors.count' is 7 .* has 3"),
        (lambda i, g: setattr(g, "version", 2) if i == 1 else None, r"GGUF version 2, but the first .* is version 3"),
        (lambda i, g: setattr(g, "kv", [kv for kv in g.kv if kv[0] != "split.count"]) if i == 2 else None,
         r"-00003-of-00003.gguf: metadata '(split.count' is missing|split.no' is 2: must be an integer in 0..0)"),
        # a bad first part: named, its own value is refused; reached from another part, it disagrees or mismatches
        (_set("split.no", V.UINT16, 5, part=0), r"'split.no' is 5(: must be an integer in 0..2|, expected 0 for)"),
        (_set("split.count", V.STRING, "3", part=0),
         r"'split.count' is ('3': must be an integer in 1..65535|3 \(UINT16\) but the first .* has '3' \(STRING\))"),
        (_set("split.count", V.BOOL, True, part=0),
         r"'split.count' is (True: must be an integer|3 \(UINT16\) but the first .* has True \(BOOL\))"),
    ],
    ids=["count", "architecture", "alignment", "tensors.count", "version", "count missing", "no range", "count str",
         "count bool"],
)  # fmt: skip
def test_split_parts_must_agree_with_the_first(tmp_path, edit, message):
    paths = _write_split(tmp_path, edit=edit)
    for named in (paths[0], paths[2]):
        with pytest.raises(GGUFFormatError, match=message):
            ggufpy.open(named)


def test_split_parts_agreeing_open_from_any_part(tmp_path):
    paths = _write_split(tmp_path, edit=_aligned(32, part=1))
    for named in paths:
        with ggufpy.open(named) as f:
            assert f.paths == paths and len(f.tensors) == 3 and f.architecture == "llama"
            assert [f.tensors[f"blk.{i}.ffn_up.weight"].part for i in range(3)] == [0, 1, 2]
