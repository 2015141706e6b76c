"""`ggufpy serve`: an OpenAI-compatible HTTP server with continuous batching (docs/server.md).

`scheduler` (the slot scheduler, no web dependencies), `schemas` (request bodies), `constrain` (structured output
through llguidance), `tools` (tool calls in and out of the chat template), `app` and `http` (FastAPI routes, errors,
/metrics; need the `server` extra: fastapi, uvicorn, sse-starlette, llguidance), `bench` (`ggufpy bench --server`)
and `bench_llamacpp` (its llama.cpp batched engine).
"""

from __future__ import annotations

__all__ = ["create_app"]


def create_app(*args, **kwargs):
    """`app.create_app`, imported on first use (FastAPI is an optional dependency)."""
    from .app import create_app

    return create_app(*args, **kwargs)
