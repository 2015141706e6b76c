"""Placement for `ggufpy.distributed` (no Ray needed): layers in proportion to node memory, per-stage memory
estimates read from the file, explicit ranges checked, plans that do not fit refused with the facts."""

from __future__ import annotations

import numpy as np
import pytest

import ggufpy
from ggufpy.distributed.plan import (
    MB,
    PROCESS_BYTES,
    Node,
    PlanError,
    estimate_stage,
    layer_bytes,
    parse_ranges,
    plan_stages,
    split_by_memory,
    split_even,
)
from ggufpy.loading import file_config
from tests.models import smollm2_path

GB = 1 << 30


@pytest.mark.parametrize(
    ("n_layers", "memories", "want"),
    [
        (30, [1, 1], [(0, 15), (15, 30)]),
        (30, [2, 1], [(0, 20), (20, 30)]),
        (30, [1, 2], [(0, 10), (10, 30)]),
        (30, [1, 1, 1], [(0, 10), (10, 20), (20, 30)]),
        (18, [16, 8, 8], [(0, 9), (9, 14), (14, 18)]),
        (4, [100, 1, 1], [(0, 2), (2, 3), (3, 4)]),  # every stage keeps at least one layer
        (3, [1, 1, 1], [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_split_by_memory(n_layers, memories, want):
    got = split_by_memory(n_layers, memories)
    assert [(r.start, r.stop) for r in got] == want


def test_split_even_and_too_many_stages():
    assert [len(r) for r in split_even(30, 4)] == [8, 7, 7, 8]
    with pytest.raises(PlanError, match="5 stages for a model of 4 layers"):
        split_by_memory(4, [1] * 5)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("0-14,15-29", None),
        ("0..9, 10..19, 20..29", None),
        ("0-14,16-29", "stage 1 covers layers 16..29; .* starting at layer 15"),
        ("0-14,10-29", "stage 1 covers layers 10..29"),
        ("0-14", "cover layers 0..14, not all 30"),
        ("0-14,x", "'x' is not FIRST-LAST"),
        ("5-4,5-29", "stage 0 covers layers 5..4"),
    ],
)
def test_parse_ranges(text, error):
    if error is None:
        assert parse_ranges(text, 30)[-1] == range(parse_ranges(text, 30)[-1].start, 30)
    else:
        with pytest.raises(PlanError, match=error):
            parse_ranges(text, 30)


@pytest.fixture(scope="module")
def smollm2_header():
    with ggufpy.open(smollm2_path()) as f:
        return dict(f.tensors), file_config(f)


def test_estimate_reads_the_layers_bytes(smollm2_header):
    """SmolLM2 Q4_1: 30 layers of 2,216,448 bytes, token_embd 30,081,024 bytes (the tied output head)."""
    tensors, cfg = smollm2_header
    per_layer, other = layer_bytes(tensors, cfg.n_layers)
    assert per_layer.tolist() == [2216448] * 30 and other["token_embd"] == 30081024
    first = estimate_stage(tensors, cfg, range(0, 15), context=256, sequences=8)
    last = estimate_stage(tensors, cfg, range(15, 30), context=256, sequences=8)
    assert first.weights == 15 * 2216448 + 30081024
    assert last.weights == 15 * 2216448 + 30081024 + other["output_norm"]  # tied head: token_embd again
    # K and V, 15 layers x 256 positions x 3 kv heads x 64 x float32, for 8 sequences
    assert first.kv == 2 * 15 * 256 * 3 * 64 * 4 * 8 == 47185920
    assert first.runtime == PROCESS_BYTES + 256 * MB
    numba = estimate_stage(tensors, cfg, range(0, 15), context=256, sequences=8, backend="numba", kv_itemsize=2)
    assert numba.runtime == PROCESS_BYTES + first.weights and numba.kv == first.kv // 2
    whole = estimate_stage(tensors, cfg, range(0, 30), context=256, sequences=1)
    assert whole.weights == sum(t.nbytes for t in tensors.values())


def test_plan_places_by_memory_and_refuses_what_does_not_fit(smollm2_header):
    tensors, cfg = smollm2_header
    nodes = [Node("a" * 32, "10.0.0.1", 2 * GB), Node("b" * 32, "10.0.0.2", 4 * GB), Node("c" * 32, "10.0.0.3", GB)]
    plan = plan_stages(tensors, cfg, nodes, stages=2, context=256, sequences=8)
    assert [(s.node.address, s.layers) for s in plan] == [("10.0.0.2", range(0, 20)), ("10.0.0.1", range(20, 30))]
    plan = plan_stages(tensors, cfg, nodes, ranges=[range(0, 5), range(5, 30)], context=256, sequences=1)
    assert [s.layers for s in plan] == [range(0, 5), range(5, 30)]
    refused = r"does not fit: .*stage 2: layers 26\.\.29 on 10\.0\.0\.3 .* > node memory 1024 MB"
    with pytest.raises(PlanError, match=refused):
        plan_stages(tensors, cfg, nodes, stages=3, context=8192, sequences=16)
    with pytest.raises(PlanError, match=r"4 stages need 4 nodes .* the cluster has 3: 10\.0\.0\.1 \(2048 MB\)"):
        plan_stages(tensors, cfg, nodes, stages=4, context=256, sequences=1)
    with pytest.raises(PlanError, match="no alive node"):
        plan_stages(tensors, cfg, [], context=256, sequences=1)


def test_estimate_grows_with_layers_not_the_model(smollm2_header):
    tensors, cfg = smollm2_header
    sizes = [estimate_stage(tensors, cfg, range(0, k), 256, 1).weights for k in (1, 10, 29)]
    assert np.all(np.diff(sizes) == np.array([9, 19]) * 2216448)
