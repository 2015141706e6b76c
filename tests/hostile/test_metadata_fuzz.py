"""Fuzzing of metadata *semantics*: well-formed GGUF files whose keys the model and tokenizer read hold random
values (any GGUF type; 0, negatives, NaN, inf, huge, wrong lengths, missing). `ggufpy.load` must either raise a
`GGUFError` or give a model whose forward pass has finite logits: nothing else may come out.

The default run is short (GGUFPY_FUZZ_EXAMPLES, default 40 examples); a long run:
    GGUFPY_FUZZ_EXAMPLES=20000 nice -n 10 .venv/bin/python -m pytest tests/hostile/test_metadata_fuzz.py \
        -q --hypothesis-show-statistics
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ggufpy
from ggufpy import schema
from ggufpy.errors import GGUFError
from tests.hostile.model_craft import Crafted, base, with_spm

V = ggufpy.GGUFValueType
EXAMPLES = int(os.environ.get("GGUFPY_FUZZ_EXAMPLES", "40"))

# every key the model and tokenizer read, per architecture
KEYS = sorted(
    {"general.architecture"}
    | {k.name for k in schema.TOKENIZER_KEYS.values()}
    | {k.name.replace("{arch}", "ARCH") for k in schema.MODEL_KEYS.values()}
)

INT_RANGES = {
    V.UINT8: (0, 2**8 - 1),
    V.INT8: (-(2**7), 2**7 - 1),
    V.UINT16: (0, 2**16 - 1),
    V.INT16: (-(2**15), 2**15 - 1),
    V.UINT32: (0, 2**32 - 1),
    V.INT32: (-(2**31), 2**31 - 1),
    V.UINT64: (0, 2**64 - 1),
    V.INT64: (-(2**63), 2**63 - 1),
}
EDGE_INTS = [0, 1, -1, 2, 3, 4, 6, 7, 8, 15, 16, 17, 31, 32, 64, 255, 256, 268, 269, 270, 4096, 2**31 - 1, 2**31,
             2**32 - 1, 2**40, 2**63 - 1]  # fmt: skip
EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-6, 1e-45, 1e-50, 1e-300, 10000.0, 1e6, 3e38, 3.5e38, 1e300, math.nan,
               math.inf, -math.inf, 5e-324]  # fmt: skip
STRINGS = ["", "llama", "gpt2", "gemma2", "gemma3", "t5", "default", "smollm", "none", "linear", "yarn", "<s>",
           "a b", "▁", "{{ messages }}", "x" * 300]  # fmt: skip


def _int_value(vtype) -> st.SearchStrategy:
    lo, hi = INT_RANGES[vtype]
    return st.one_of(st.sampled_from([v for v in EDGE_INTS if lo <= v <= hi]), st.integers(lo, hi))


F32_MAX = float(np.finfo(np.float32).max)


def _fits(vtype, v: float) -> bool:
    """Whether the writer can store `v` in `vtype` (struct refuses finite floats beyond float32's range)."""
    return vtype == V.FLOAT64 or not math.isfinite(v) or abs(v) <= F32_MAX


def _float_value(vtype) -> st.SearchStrategy:
    edge = st.sampled_from([f for f in EDGE_FLOATS if _fits(vtype, f)])
    width = 64 if vtype == V.FLOAT64 else 32
    return st.one_of(edge, st.floats(width=width, allow_nan=True, allow_infinity=True))


def scalar(vtype) -> st.SearchStrategy:
    if vtype in INT_RANGES:
        return _int_value(vtype)
    if vtype in (V.FLOAT32, V.FLOAT64):
        return _float_value(vtype)
    if vtype == V.BOOL:
        return st.booleans()
    return st.one_of(st.sampled_from(STRINGS), st.text(max_size=20))


SCALAR_TYPES = [t for t in V if t != V.ARRAY]


@st.composite
def any_value(draw) -> tuple:
    """A fresh GGUF value of any type: a scalar, an array of scalars, or a nested array."""
    kind = draw(st.sampled_from(["scalar", "array", "nested"]))
    if kind == "scalar":
        vtype = draw(st.sampled_from(SCALAR_TYPES))
        return (vtype, draw(scalar(vtype)))
    elem = draw(st.sampled_from(SCALAR_TYPES))
    values = draw(st.lists(scalar(elem), max_size=6))
    if kind == "array":
        return (V.ARRAY, values, elem)
    return (V.ARRAY, [(elem, values)] * draw(st.integers(0, 3)), V.ARRAY)


def _near(v):
    """Values a plausible file could hold instead of `v`."""
    if isinstance(v, float):
        return [v * 2, v / 2, v * 1000, v / 1000, v + 1, 1.0, v * 1e30]
    return [v + 1, v - 1, v * 2, v // 2, 1, 2, v * 1000]


@st.composite
def mutated(draw, current: tuple) -> tuple:
    """A variation of the key's current value: same type, edge value; an array shortened, lengthened, retyped,
    or with one element replaced."""
    vtype = current[0]
    if vtype in INT_RANGES or vtype in (V.FLOAT32, V.FLOAT64):  # often near the valid value: deeper paths
        lo, hi = INT_RANGES.get(vtype, (-math.inf, math.inf))
        near = [v for v in _near(current[1]) if lo <= v <= hi and (vtype in INT_RANGES or _fits(vtype, v))]
        return (vtype, draw(st.one_of(st.sampled_from(near), scalar(vtype))))
    if vtype != V.ARRAY:
        return (vtype, draw(scalar(vtype)))
    values, elem = list(current[1]), current[2]
    how = draw(st.sampled_from(["cut", "grow", "poke", "retype", "empty"]))
    if how == "cut":
        return (V.ARRAY, values[: draw(st.integers(0, max(0, len(values) - 1)))], elem)
    if how == "grow":
        return (V.ARRAY, values + values[: draw(st.integers(1, 40))], elem)
    if how == "empty":
        return (V.ARRAY, [], elem)
    if how == "retype":
        new = draw(st.sampled_from([t for t in SCALAR_TYPES if t != elem]))
        return (V.ARRAY, [draw(scalar(new))] * len(values), new)
    if values:
        values[draw(st.integers(0, len(values) - 1))] = draw(scalar(elem))
    return (V.ARRAY, values, elem)


@st.composite
def hostile_models(draw) -> Crafted:
    arch = draw(st.sampled_from(["llama", "gemma2", "gemma3"]))
    model = with_spm(base(arch)) if draw(st.booleans()) else base(arch).copy()
    n_keys = draw(st.integers(1, 4))
    for key in draw(st.permutations(KEYS))[:n_keys]:  # distinct keys without rejection sampling
        key = key.replace("ARCH", arch)
        how = draw(st.sampled_from(["mutate", "mutate", "any", "drop"]))
        if how == "drop":
            model.drop(key)
        elif how == "mutate" and key in model.kv:
            model.kv[key] = draw(mutated(model.kv[key]))
        else:
            model.kv[key] = draw(any_value())
    return model


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(model=hostile_models())
def test_load_raises_a_gguf_error_or_runs_finite(model):
    with tempfile.TemporaryDirectory() as tmp:
        path = model.write(Path(tmp) / "fuzz.gguf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unknown tokenizer.ggml.pre warns and falls back, as llama.cpp
            try:
                loaded = ggufpy.load(path, backend="numpy")
            except GGUFError as e:
                event(f"refused: {type(e).__name__}")  # shown by --hypothesis-show-statistics
                return
            event("loaded and ran")
            tokens = np.array([1, 2, 3][: loaded.config.context_length])
            logits = loaded.logits(tokens)
            ids = loaded.tokenizer.encode("Hi there <s>", parse_special=True)  # the tokenizer that loaded works
            assert all(0 <= i < loaded.config.vocab_size for i in ids) and isinstance(loaded.tokenizer.decode(ids), str)
            loaded.file.close()
    assert np.isfinite(logits).all(), f"non-finite logits from a model that loaded: {model.kv}"
