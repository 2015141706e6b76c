"""The OpenAI-compatible HTTP API over a `Scheduler` (FastAPI; streaming through sse-starlette).

    app = create_app(model, parallel=4, ctx_size=2048, api_key=None, model_id="smollm2")
    uvicorn.run(app, host="127.0.0.1", port=8080)

Routes: GET / (a chat page, `static/index.html`), GET /health, GET /v1/models, POST /v1/chat/completions,
POST /v1/completions, POST /v1/embeddings, POST /tokenize, POST /detokenize, GET /metrics. Errors are OpenAI's
`{"error": {"message", "type", "param", "code"}}` with 400 (bad body), 401 (API key), 404 (unknown model or
route), 413 (body too large); a client error is never a 500. Structured output (`response_format`, `grammar`)
is a per-request token mask (`constrain.py`); tools go through the chat template and come back as `tool_calls`
(`tools.py`). Documented in docs/server.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, PlainTextResponse
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import ChatTemplate, encode_chat
from ..sampling import Sampler, SamplingParams
from . import tools as toolcalls
from .constrain import Constraint, GrammarError, LazyConstraint, compile_grammar, lazy_grammar, token_table
from .http import APIError, Guard, error_response, prometheus
from .scheduler import Event, Job, Scheduler
from .schemas import ChatRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest

PAGE = Path(__file__).parent / "static" / "index.html"  # the chat page at /
DISCONNECT_POLL = 0.25  # seconds between checks that a non-streaming request's client is still there


def create_app(
    model,
    parallel: int = 4,
    ctx_size: int = 2048,
    api_key: str | None = None,
    model_id: str = "ggufpy",
    chat_template: ChatTemplate | None = None,
):
    """The FastAPI app serving `model` with `parallel` slots of `ctx_size` positions each; chats are rendered
    with `chat_template` (default: the one `ggufpy run` picks, `ChatTemplate.from_tokenizer` with the file's
    metadata); its stop strings (a plain-text format's "\nUser:") end every chat reply."""
    scheduler = Scheduler(model, parallel=parallel, ctx_size=ctx_size)
    tokenizer = model.tokenizer
    metadata = getattr(getattr(model, "file", None), "metadata", None)
    template = chat_template or ChatTemplate.from_tokenizer(tokenizer, metadata, warn=False)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="ggufpy", lifespan=lifespan)
    app.state.scheduler = scheduler

    # -- errors ------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _apierror_response(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        return error_response(400, f"{where}: {first.get('msg')} (got {first.get('input')!r:.80})", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind)

    app.add_middleware(Guard, api_key=api_key)

    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_id, "default", ""):
            raise APIError(404, f"model {name!r} is not served here; this server has {model_id!r}", param="model")

    # -- generation --------------------------------------------------------------------------------------
    def jobs(
        body, prompt: list[int], top: int | None, grammar: str | None, specials: bool = False, stops=(), lazy=None
    ) -> list[Job]:
        room = ctx_size - len(prompt)
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} tokens and the context holds {ctx_size} (--ctx-size): "
                f"it leaves no room for a generated token",
                param="messages" if isinstance(body, ChatRequest) else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = body.max_completion_tokens or body.max_tokens or room
        out = []
        for i in range(body.n):
            try:  # seeded choices get seeds seed, seed+1, ...: each its own reproducible generator
                seed = None if body.seed is None else body.seed + i
                params = SamplingParams(**body.sampling_fields(), seed=seed)
            except ValueError as e:
                raise APIError(400, str(e)) from None
            if params.logit_bias and not all(0 <= t < model.config.vocab_size for t in params.logit_bias):
                raise APIError(400, f"logit_bias: token ids must be in 0..{model.config.vocab_size - 1}", "logit_bias")
            job = Job(prompt, min(max_tokens, room), Sampler(params), stops, top, body.cache_prompt)
            if grammar is None:
                job.constraint = None
            elif lazy is None:
                job.constraint = Constraint(token_table(tokenizer), grammar)
            else:  # tool_choice "auto": the grammar holds from the call's trigger on
                job.constraint = LazyConstraint(token_table(tokenizer), tokenizer, grammar, lazy, prompt)
            job.specials = specials
            out.append(job)
        return out

    async def run(jobs_: list[Job]):
        """Yield (choice index, Event) for every event of these jobs until all are done; cancel on exit."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for i, job in enumerate(jobs_):
            scheduler.submit(job, lambda ev, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, ev)))
        open_ = len(jobs_)
        try:
            while open_:
                i, ev = await queue.get()
                if ev.kind != "text":
                    open_ -= 1
                yield i, ev
        finally:  # the client went away (or we are done): free the slots now
            for job in jobs_:
                job.cancel()

    def usage(events: list[Event]) -> dict[str, Any]:
        prompt = events[0].prompt_tokens if events else 0
        cached = min((e.cached_tokens for e in events), default=0)
        completion = sum(e.completion_tokens for e in events)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def piece(token: int) -> str:
        return tokenizer.decode([token])

    def chat_logprobs(ev: Event) -> dict:
        top = [{"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode())} for t, lp in ev.top_logprobs or []]
        tok = piece(ev.token)
        return {"token": tok, "logprob": ev.logprob, "bytes": list(tok.encode()), "top_logprobs": top}

    async def watch(request: Request, jobs_: list[Job]) -> None:
        """Cancel `jobs_` when the client of a non-streaming request disconnects (nothing else would notice)."""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL)
        for job in jobs_:
            job.cancel()

    async def compile_(spec: tuple[str, Any] | None, param: str) -> str | None:
        """The request's grammar (compiled off the event loop: the first one also builds the token table)."""
        if spec is None:
            return None
        try:
            return await asyncio.to_thread(lambda: compile_grammar(*spec, token_table(tokenizer)))
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    def grammar_spec(body) -> tuple[tuple[str, Any] | None, str]:
        try:
            spec = body.grammar_spec()
        except ValueError as e:
            raise APIError(400, str(e), param="response_format") from None
        return spec, "grammar" if body.grammar else "response_format"

    async def generate(request: Request, body, prompt: list[int], chat: bool, spec=None, tool_format=None, lazy=None):
        top = (body.top_logprobs or 0) if chat and body.logprobs else (body.logprobs if not chat else None)
        spec, param = (spec, "tools") if spec is not None else grammar_spec(body)
        if param == "response_format":  # harmony: in a final message (tools.structured)
            spec = toolcalls.structured(tool_format, spec)
        grammar = await compile_(spec, param)
        if lazy is not None and spec is None:  # a call the model begins (a request's own grammar wins)
            try:
                grammar = await compile_(("lark", lazy_grammar(lazy, tokenizer)), "tools")
            except APIError:  # parameters llguidance cannot take: the model's calls stay free, as before
                lazy = None
        else:
            lazy = None
        specials = tool_format is not None and tool_format.specials  # its reader tells tags by their tokens
        stops = body.stops() + (tuple(s for s in template.stop if s not in body.stops()) if chat else ())
        if grammar is None:
            jobs_ = jobs(body, prompt, top, None, specials, stops)
        else:  # building a grammar's matchers can take a while: not on the event loop
            jobs_ = await asyncio.to_thread(jobs, body, prompt, top, grammar, specials, stops, lazy)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": ident, "created": int(time.time()), "model": model_id, "system_fingerprint": "ggufpy"}
        stream = run(jobs_)
        if body.stream:
            return EventSourceResponse(stream_chunks(stream, jobs_, head, obj, chat, body, tool_format), ping=15)

        watcher = asyncio.create_task(watch(request, jobs_))
        try:
            return await collect(stream, jobs_, head, obj, chat, body, tool_format)
        finally:
            watcher.cancel()

    async def collect(stream, jobs_: list[Job], head, obj, chat: bool, body, tool_format=None) -> dict:
        texts: list[list[tuple[str, bool]]] = [[] for _ in jobs_]  # (text, is a special token's)
        lps: list[list[Event]] = [[] for _ in jobs_]
        ends: list[Event | None] = [None] * len(jobs_)
        async for i, ev in stream:
            if ev.kind == "text":
                texts[i].append((ev.text, ev.special))
                if ev.token >= 0 and ev.logprob is not None:
                    lps[i].append(ev)
            elif ev.kind == "error":
                raise APIError(500, ev.message, "server_error")
            elif ev.finish_reason == "cancelled":
                raise APIError(499, "the client closed the request", "cancelled")
            else:
                ends[i] = ev
        choices = []
        for i, end in enumerate(ends):
            text = "".join(t for t, _ in texts[i])
            finish = end.finish_reason
            if chat:
                lp = {"content": [chat_logprobs(e) for e in lps[i]]} if body.logprobs else None
                message = {"role": "assistant", "content": text}
                if tool_format is not None:  # calls, and reasoning (harmony), out of the text
                    message, finish = toolcalls.reply(tool_format, texts[i], finish)
                choice = {"index": i, "message": message, "logprobs": lp}
            else:
                lp = None
                if body.logprobs is not None:
                    lp = {
                        "tokens": [piece(e.token) for e in lps[i]],
                        "token_logprobs": [e.logprob for e in lps[i]],
                        "top_logprobs": [{piece(t): v for t, v in e.top_logprobs or []} for e in lps[i]],
                    }
                choice = {"index": i, "text": text, "logprobs": lp}
            choices.append({**choice, "finish_reason": finish})
        return {**head, "object": obj, "choices": choices, "usage": usage([e for e in ends if e])}

    async def stream_chunks(stream, jobs_: list[Job], head, obj, chat: bool, body, tool_format=None):
        try:
            async for chunk in _chunks(stream, head, obj, chat, body, tool_format):
                yield chunk
        finally:  # the client disconnected mid-stream (or the stream ended): free the slots at once
            for job in jobs_:
                job.cancel()

    async def _chunks(stream, head, obj, chat: bool, body, tool_format=None):
        obj += ".chunk" if chat else ""
        ends: list[Event] = []
        readers = [toolcalls.reader(tool_format) for _ in range(body.n)] if tool_format else None

        def deltas(i: int, pieces) -> list[str]:  # content, reasoning and tool-call deltas, as OpenAI streams them
            return [
                json.dumps({**head, "object": obj, "choices": [_choice(i, toolcalls.delta(p), None, chat)]})
                for p in pieces
            ]

        if chat:
            for i in range(body.n):
                delta = {"role": "assistant", "content": ""}
                yield json.dumps({**head, "object": obj, "choices": [_choice(i, delta, None, chat)]})
        async for i, ev in stream:
            if ev.kind == "error":
                yield json.dumps(
                    {"error": {"message": ev.message, "type": "server_error", "param": None, "code": None}}
                )
                return
            if ev.kind == "text":
                if not ev.text:
                    continue
                if readers is not None:
                    for chunk in deltas(i, readers[i].feed(ev.text, ev.special if tool_format.specials else None)):
                        yield chunk
                    continue
                lp = None
                if ev.logprob is not None and chat and body.logprobs:
                    lp = {"content": [chat_logprobs(ev)]}
                yield json.dumps({**head, "object": obj, "choices": [_choice(i, {"content": ev.text}, None, chat, lp)]})
            else:
                ends.append(ev)
                finish = ev.finish_reason
                if readers is not None:
                    for chunk in deltas(i, readers[i].close()):
                        yield chunk
                    finish = "tool_calls" if readers[i].calls and finish == "stop" else finish
                yield json.dumps({**head, "object": obj, "choices": [_choice(i, {}, finish, chat)]})
        if body.stream_options and body.stream_options.include_usage:
            yield json.dumps({**head, "object": obj, "choices": [], "usage": usage(ends)})
        yield "[DONE]"

    # -- routes ------------------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "slots_idle": parallel - scheduler.metrics.slots_busy}

    @app.get("/v1/models")
    async def models():
        entry = {"id": model_id, "object": "model", "created": created, "owned_by": "ggufpy"}
        return {"object": "list", "data": [{**entry, "meta": {"n_ctx": ctx_size, "n_vocab": model.config.vocab_size}}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        check_model(body.model)
        messages = [m.model_dump(exclude_none=True, by_alias=True) for m in body.messages]
        spec = None
        try:
            plan = toolcalls.plan(template.template, messages, body.tools, body.tool_choice, body.parallel_tool_calls)
        except ValueError as e:
            raise APIError(400, str(e), param="tools") from None
        if plan.grammar is not None:  # tool_choice forces a valid call, through structured output
            if body.grammar or (body.response_format and body.response_format.type != "text"):
                raise APIError(400, "tool_choice forces a call: it cannot be combined with a grammar", param="tools")
            spec = ("lark", plan.grammar)
        messages, kwargs, tool_format = plan.messages, {**body.template_variables(), "tools": plan.tools}, plan.format
        try:
            prompt = encode_chat(tokenizer, messages, template, **kwargs)
        except Exception as e:  # a template that rejects these messages (roles out of order, ...)
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        return await generate(request, body, prompt, chat=True, spec=spec, tool_format=tool_format, lazy=plan.lazy)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_model(body.model)
        if isinstance(body.prompt, str):
            prompt = tokenizer.encode(body.prompt, add_special=True, parse_special=True)
        else:
            prompt = list(body.prompt)
            if not all(0 <= t < model.config.vocab_size for t in prompt):
                raise APIError(400, f"prompt: token ids must be in 0..{model.config.vocab_size - 1}", param="prompt")
        if not prompt:
            raise APIError(400, "prompt: empty (no tokens to continue from)", param="prompt")
        return await generate(request, body, prompt, chat=False)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        check_model(body.model)
        items = body.input
        if isinstance(items, str) or (items and isinstance(items[0], int)):
            items = [items]
        ids = [tokenizer.encode(x, add_special=True) if isinstance(x, str) else list(x) for x in items]
        for i, x in enumerate(ids):
            if not x or len(x) > ctx_size or not all(0 <= t < model.config.vocab_size for t in x):
                raise APIError(400, f"input[{i}]: {len(x)} tokens; need 1..{ctx_size} valid token ids", param="input")
        vectors = [await asyncio.wrap_future(scheduler.run_exclusive(lambda m, x=x: _embed(m, x))) for x in ids]
        if body.encoding_format == "base64":  # little-endian float32 bytes, as OpenAI's (the openai client's default)
            vectors = [base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() for v in vectors]
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        n = sum(map(len, ids))
        return {"object": "list", "data": data, "model": model_id, "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return {
            "tokens": tokenizer.encode(body.content, add_special=body.add_special, parse_special=body.parse_special)
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if not all(0 <= t < model.config.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens: ids must be in 0..{model.config.vocab_size - 1}", param="tokens")
        return {"content": tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(scheduler, parallel))

    return app


def _choice(i: int, delta: dict, finish: str | None, chat: bool, logprobs=None) -> dict:
    if chat:
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": i, "text": delta.get("content", ""), "logprobs": logprobs, "finish_reason": finish}


def _embed(model, ids: list[int]) -> list[float]:
    """Mean over the tokens of the final normalized hidden state (`result_norm`), L2-normalized as OpenAI's."""
    trace: dict[str, np.ndarray] = {}
    model.forward(np.asarray(ids, dtype=np.int64), 0, model.new_cache(capacity=len(ids)), trace=trace)
    v = trace["result_norm"].astype(np.float64).mean(axis=0)
    return (v / (np.linalg.norm(v) or 1.0)).tolist()
