"""Placement: which node runs which layers, and whether each stage fits in its node's memory.

Pure functions of the file's tensor table and the nodes' memory; nothing here imports Ray.

A stage's memory estimate (`StageEstimate`) is read from the GGUF header:

    weights  bytes of its layers' tensors (`blk.N.*`), plus `token_embd` on the first stage and the output head
             (`output`, or `token_embd` again when the head is tied) with `output_norm` on the last
    kv       2 (K, V) x its layers x context x n_kv_heads x head_dim x the KV dtype's size, per sequence held
    runtime  the process (Ray worker, NumPy, ggufpy: ~300 MB measured) plus what the backend adds: numba repacks
             the weights into anonymous memory (~1x their file bytes again, docs/exo.md), NumPy keeps a
             dequantized-weight cache of `cache_bytes` (256 MB by default)

Layers are dealt in proportion to the nodes' memory, as exo's ring memory-weighted partitioning did
(`exo/topology/ring_memory_weighted_partitioning_strategy.py`): node j gets the layers between the cumulative
fractions of memory before and after it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig

MB = 1 << 20
PROCESS_BYTES = 300 * MB  # a Ray worker with NumPy and ggufpy imported, before any weight (measured: 280-320 MB)
NUMBA_REPACK = 1.0  # numba's repacked weights, per byte of the file's weights (193 MB anon for 98 MB: docs/exo.md)
NUMPY_CACHE_BYTES = 256 * MB  # NumpyBackend's default dequantized-weight cache
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")


class PlanError(ValueError):
    """A pipeline plan that cannot run: bad ranges, too few nodes, or a stage that does not fit."""


@dataclass(frozen=True)
class Node:
    """A machine of the cluster as placement sees it: its Ray node id, address and memory for Ray (bytes)."""

    node_id: str
    address: str
    memory: int


@dataclass(frozen=True)
class StageEstimate:
    """Bytes a stage is expected to hold (see the module docstring)."""

    weights: int
    kv: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.runtime


@dataclass(frozen=True)
class StagePlan:
    """One stage: its layers (half-open, global numbers), the node it runs on and its memory estimate."""

    index: int
    layers: range
    node: Node | None
    estimate: StageEstimate

    @property
    def first_layer(self) -> int:
        return self.layers.start

    @property
    def last_layer(self) -> int:
        """The stage's last layer (inclusive, as `ggufpy.shard.Shard` and docs write ranges)."""
        return self.layers.stop - 1

    def describe(self) -> str:
        where = f" on {self.node.address} ({self.node.node_id[:8]})" if self.node else ""
        return (
            f"stage {self.index}: layers {self.first_layer}..{self.last_layer}{where}, "
            f"estimate {self.estimate.total / MB:.0f} MB (weights {self.estimate.weights / MB:.0f}, "
            f"kv {self.estimate.kv / MB:.0f}, runtime {self.estimate.runtime / MB:.0f})"
        )


def layer_bytes(tensors: dict, n_layers: int) -> tuple[np.ndarray, dict[str, int]]:
    """Bytes per layer (n_layers,) and of each global tensor (`token_embd`, `output`, ...) by base name."""
    per_layer = np.zeros(n_layers, dtype=np.int64)
    other: dict[str, int] = {}
    for name, info in tensors.items():
        m = _LAYER_TENSOR.match(name)
        if m:
            per_layer[int(m.group(1))] += info.nbytes
        else:
            base = name.removesuffix(".weight")
            other[base] = other.get(base, 0) + info.nbytes
    return per_layer, other


def estimate_stage(
    tensors: dict,
    cfg: ModelConfig,
    layers: range,
    context: int,
    sequences: int,
    backend: str = "numpy",
    kv_itemsize: int = 4,
    cache_bytes: int = NUMPY_CACHE_BYTES,
) -> StageEstimate:
    """The memory a stage running `layers` needs for `sequences` sequences of `context` positions."""
    per_layer, other = layer_bytes(tensors, cfg.n_layers)
    weights = int(per_layer[layers.start : layers.stop].sum())
    # small global tensors (rope_freqs...) are mapped by every stage
    weights += sum(v for k, v in other.items() if k not in ("token_embd", "output", "output_norm"))
    if layers.start == 0:
        weights += other.get("token_embd", 0)
    if layers.stop == cfg.n_layers:
        tied = "output" not in other  # the head is token_embd: mapped once when this stage also embeds
        head = other.get("token_embd", 0) if tied and layers.start > 0 else other.get("output", 0)
        weights += head + other.get("output_norm", 0)
    kv = 2 * len(layers) * context * cfg.n_kv_heads * cfg.head_dim * kv_itemsize * sequences
    extra = int(NUMBA_REPACK * weights) if backend == "numba" else cache_bytes
    return StageEstimate(weights=weights, kv=kv, runtime=PROCESS_BYTES + extra)


def split_by_memory(n_layers: int, memories: Sequence[int]) -> list[range]:
    """Layers dealt in proportion to `memories` (one stage per entry, in order), each stage at least one layer.

    Boundaries are the rounded cumulative memory fractions times `n_layers` (exo's ring partitioning), then
    moved where needed so that no stage is empty.
    """
    if not memories:
        raise PlanError("no stages to place")
    if len(memories) > n_layers:
        raise PlanError(f"{len(memories)} stages for a model of {n_layers} layers: at most one stage per layer")
    total = float(sum(memories))
    if total <= 0:
        raise PlanError(f"the nodes report no memory ({list(memories)})")
    cuts = [round(n_layers * sum(memories[: j + 1]) / total) for j in range(len(memories))]
    cuts[-1] = n_layers
    bounds = [0]
    for j, cut in enumerate(cuts):
        left = len(memories) - j - 1  # stages still to place, each needing one layer
        bounds.append(min(max(cut, bounds[-1] + 1), n_layers - left))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def split_even(n_layers: int, stages: int) -> list[range]:
    """`stages` ranges of (nearly) equal layer counts."""
    return split_by_memory(n_layers, [1] * stages)


def parse_ranges(text: str, n_layers: int) -> list[range]:
    """'0-14,15-29' (inclusive, as `ggufpy.shard.Shard`) into half-open ranges that must tile 0..n_layers-1."""
    ranges = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-|\.\.)\s*(\d+)\s*", part)
        if not m:
            raise PlanError(f"layer range {part!r} is not FIRST-LAST (inclusive), e.g. '0-14,15-29'")
        ranges.append(range(int(m.group(1)), int(m.group(2)) + 1))
    check_ranges(ranges, n_layers)
    return ranges


def check_ranges(ranges: Sequence[range], n_layers: int) -> None:
    """Refuse ranges that are empty, overlap, leave a gap, or do not cover the model's layers in order."""
    expect = 0
    for j, r in enumerate(ranges):
        if r.step != 1 or len(r) == 0 or r.start != expect:
            raise PlanError(
                f"stage {j} covers layers {r.start}..{r.stop - 1}; stages must be non-empty, in order and "
                f"contiguous, starting at layer {expect}"
            )
        expect = r.stop
    if expect != n_layers:
        raise PlanError(f"the stages cover layers 0..{expect - 1}, not all {n_layers} of the model")


def plan_stages(
    tensors: dict,
    cfg: ModelConfig,
    nodes: Sequence[Node],
    *,
    stages: int | None = None,
    ranges: Sequence[range] | None = None,
    context: int,
    sequences: int,
    backend: str = "numpy",
    kv_itemsize: int = 4,
    cache_bytes: int = NUMPY_CACHE_BYTES,
) -> list[StagePlan]:
    """Stages over `nodes`: explicit `ranges`, or `stages` (default: one per node) with layers in proportion to
    memory. The nodes with the most memory are used, one stage each, in that order. Raises `PlanError` naming
    every stage that does not fit its node."""
    if not nodes:
        raise PlanError("the cluster has no alive node")
    n = len(ranges) if ranges is not None else (stages or len(nodes))
    if n < 1:
        raise PlanError(f"stages = {n}: a pipeline needs at least one stage")
    if n > len(nodes):
        raise PlanError(
            f"{n} stages need {n} nodes (one stage per node) but the cluster has {len(nodes)}: "
            + ", ".join(f"{x.address} ({x.memory / MB:.0f} MB)" for x in nodes)
        )
    chosen = sorted(nodes, key=lambda x: -x.memory)[:n]
    if ranges is None:
        ranges = split_by_memory(cfg.n_layers, [x.memory for x in chosen])
    check_ranges(ranges, cfg.n_layers)
    plan = [
        StagePlan(
            j,
            r,
            node,
            estimate_stage(tensors, cfg, r, context, sequences, backend, kv_itemsize, cache_bytes),
        )
        for j, (r, node) in enumerate(zip(ranges, chosen, strict=True))
    ]
    too_big = [s for s in plan if s.estimate.total > s.node.memory]
    if too_big:
        lines = "; ".join(f"{s.describe()} > node memory {s.node.memory / MB:.0f} MB" for s in too_big)
        raise PlanError(
            f"the plan does not fit: {lines}. Add nodes or memory, use more stages, a shorter context "
            f"(--ctx-size) or fewer concurrent sequences"
        )
    return plan
