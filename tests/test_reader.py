"""The GGUF reader: round trips against gguf-py's writer, split models, and a table of malformed files."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ggufpy
from ggufpy import GGMLType, GGUFError, GGUFUnsupportedError
from tests.gguf_bytes import GGUFBytes, V, small_valid


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
