"""Pipeline-parallel inference on a Ray cluster: a model's layer ranges as Ray actors (docs/distributed.md).

    from ggufpy.distributed import RayPipeline
    with RayPipeline("smollm2", address="ray://head:10001", stages=2) as pipe:
        print(pipe.generate("The capital of France is", max_tokens=16).text)

Needs the `ray` extra (`pip install 'ggufpy[ray]'`); `plan` alone (placement, memory estimates) does not.
"""

from .plan import Node, PlanError, StageEstimate, StagePlan, estimate_stage, parse_ranges, plan_stages, split_by_memory

__all__ = [
    "Node",
    "PlanError",
    "RayPipeline",
    "StageEstimate",
    "StageFailedError",
    "StagePlan",
    "estimate_stage",
    "load",
    "parse_ranges",
    "plan_stages",
    "split_by_memory",
]


def __getattr__(name: str):
    # Ray is imported only when the pipeline itself is asked for
    if name in ("RayPipeline", "StageFailedError", "RemoteCache"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'ggufpy.distributed' has no attribute {name!r}")


def load(path=None, *, cluster: str | None = None, **options):
    """`ggufpy.load` for a cluster: a `RayPipeline` of `path` on the Ray cluster at `cluster` ("ray://host:10001",
    "host:6379", "auto"; None: the running Ray connection). Options as `RayPipeline`'s."""
    from .pipeline import RayPipeline

    address = cluster.removeprefix("ray+") if cluster else None  # tolerate "ray+ray://" spellings
    return RayPipeline(path, address=address, **options)
