"""The HTTP side of the server that is not a route: OpenAI's error object, the guard every request passes
(body size, API key), and the Prometheus text of /metrics."""

from __future__ import annotations

from fastapi.responses import JSONResponse

MAX_BODY_BYTES = 8 << 20  # a request body past this is refused with 413 before it is parsed


class APIError(Exception):
    """An error the client caused (or may retry), shown to it as OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class Guard:
    """Refuses, before any route runs, a body over MAX_BODY_BYTES (413) and a missing or wrong API key (401).
    Plain ASGI, not `@app.middleware("http")`: that wrapper hides a client's disconnect from the routes."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            length = headers.get(b"content-length", b"0").decode("latin-1")
            refusal = None
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                refusal = error_response(413, f"request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}")
            elif self.api_key is not None and scope["path"] not in ("/health", "/"):
                if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                    refusal = error_response(
                        401, "missing or incorrect API key (Authorization: Bearer KEY)", code="invalid_api_key"
                    )
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def prometheus(scheduler, parallel: int) -> str:
    m = scheduler.metrics
    rate = m.decode_tokens_total / m.decode_seconds_total if m.decode_seconds_total else 0.0
    lines = [
        ("ggufpy_requests_total", "counter", "requests accepted", m.requests_total),
        ("ggufpy_prompt_tokens_total", "counter", "prompt tokens of finished requests", m.prompt_tokens_total),
        ("ggufpy_completion_tokens_total", "counter", "generated tokens", m.completion_tokens_total),
        ("ggufpy_decode_steps_total", "counter", "batched decode steps", m.decode_steps_total),
        ("ggufpy_requests_processing", "gauge", "busy slots", m.slots_busy),
        ("ggufpy_requests_waiting", "gauge", "requests queued for a slot", m.queue_length),
        ("ggufpy_slots", "gauge", "slots (--parallel)", parallel),
        (
            "ggufpy_decode_tokens_per_second",
            "gauge",
            "aggregate rate of the last decode step",
            m.last_decode_tokens_per_second,
        ),
        ("ggufpy_decode_tokens_per_second_avg", "gauge", "decoded tokens per second of decode-step time", rate),
    ]
    out = []
    for name, kind, help_, value in lines:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    out += [
        "# HELP ggufpy_requests_finished_total finished requests by reason",
        "# TYPE ggufpy_requests_finished_total counter",
    ]
    out += [f'ggufpy_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(m.requests_finished.items())]
    return "\n".join(out) + "\n"
