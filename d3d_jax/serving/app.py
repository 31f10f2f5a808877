"""HTTP layer: OpenAI-compatible routes over a :class:`~d3d_jax.serving.scheduler.Scheduler`.

``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream``), ``GET /v1/models``,
``GET /health``, ``GET /metrics``.  Every request is parsed, tokenized and validated before it is
queued, so a bad one costs no decoder work and gets one 400 naming the problem.  With an API key,
every route but ``/health`` answers 401 unless ``Authorization: Bearer KEY`` (checked in ASGI
middleware, before the body is read).  A client that disconnects, or whose output matched a stop
string, cancels its request; the scheduler frees the slot at its next round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from d3d_jax.serving import protocol as P
from d3d_jax.serving.scheduler import Event, Handle, QueueFull, Scheduler, _request_metrics
from d3d_jax.serving.textstream import TextStream

log = logging.getLogger("d3d_jax.serving")

DISCONNECT_POLL_S = 0.25


@dataclasses.dataclass
class Service:
    """Everything the routes need besides the scheduler's decoder."""

    scheduler: Scheduler
    tokenizer: Any
    model_name: str
    limits: P.Limits
    eos_token_ids: tuple[int, ...]
    make_request: Callable  # (prompt, max_new_tokens, sampling, stop_token_ids, seed) -> decoder Request
    validate_request: Callable | None = None  # the decoder's RequestError check
    api_key: str | None = None
    mode: str = "plain"
    chat_encode: Callable | None = None  # (tokenizer, messages) -> ids; default: non-thinking template

    def encode(self, req: P.ParsedRequest) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if req.messages is not None:
            if self.chat_encode is None:
                from d3d_jax.demo import chat_prompt_ids

                self.chat_encode = chat_prompt_ids
            try:
                return self.chat_encode(self.tokenizer, req.messages)
            except Exception as e:  # noqa: BLE001 - a template error is the request's problem
                raise P.ApiError(f"cannot apply the chat template: {e}", param="messages") from None
        return list(self.tokenizer.encode(req.prompt_text, add_special_tokens=False))

    def build(self, req: P.ParsedRequest, ids: list[int]):
        """The decoder request, checked by the decoder's own validation (its error becomes a 400)."""
        from d3d_jax.decoding.verify import SamplingParams

        p = req.params
        max_new = P.resolve_max_tokens(len(ids), p, self.limits)
        stop_ids = tuple(dict.fromkeys(p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)))
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little")
        out = self.make_request(prompt=ids, max_new_tokens=max_new,
                                sampling=SamplingParams(p.temperature, p.top_p, p.top_k),
                                stop_token_ids=stop_ids, seed=seed % (2 ** 31))
        if self.validate_request is not None:
            try:
                self.validate_request(out)
            except ValueError as e:
                raise P.ApiError(str(e), param="prompt") from None
        return out


class _Auth:
    """Pure ASGI (no body buffering, streaming untouched): 401 without the right bearer key."""

    def __init__(self, app, key: str, open_paths=("/health",), on_reject=None):
        self.app, self.key, self.open_paths, self.on_reject = app, key.encode(), open_paths, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                if self.on_reject:
                    self.on_reject(401)
                body = P.error_body("Unauthorized: a valid 'Authorization: Bearer <key>' header is required",
                                    type="authentication_error", code="invalid_api_key")
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_json(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise P.ApiError(f"request body of {length} bytes exceeds the limit of {limit}", status=413)
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise P.ApiError(f"request body exceeds the limit of {limit} bytes", status=413)
    return P.parse_json(bytes(buf))


def _sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[Event], None]:
    def put(ev: Event) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, ev)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    return put


def _merge(ev: Event, queue: asyncio.Queue) -> Event:
    """``ev`` plus every event already waiting: when the event loop falls behind the decoder, a
    client gets one chunk with several rounds' tokens instead of one chunk per round."""
    while not ev.finished and not queue.empty():
        nxt = queue.get_nowait()
        ev = Event(ev.token_ids + nxt.token_ids, nxt.finished, nxt.finish_reason, nxt.metrics, nxt.error)
    return ev


async def _events(queue: asyncio.Queue, http: Request) -> AsyncIterator[Event]:
    """The request's events until it finishes; stops early when the client disconnects."""
    while True:
        try:
            ev = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                return
            continue
        ev = _merge(ev, queue)
        yield ev
        if ev.finished:
            return


@dataclasses.dataclass
class _Run:
    """One admitted request as the routes see it."""

    handle: Handle
    queue: asyncio.Queue
    fmt: P.Formatter
    text: TextStream
    params: P.GenParams
    n_prompt: int
    sent_ids: int = 0

    def new_ids(self) -> list[int] | None:
        if not self.params.return_token_ids:
            return None
        ids = self.text.output_ids[self.sent_ids:self.text.n_tokens]
        self.sent_ids = self.text.n_tokens
        return ids

    def final(self, ev: Event | None) -> tuple[str, dict, dict]:
        """(finish reason, usage, speculative metrics) once the output ended."""
        reason = "stop" if self.text.stopped else (ev.finish_reason if ev else "stop")
        spec = ev.metrics if ev is not None and ev.metrics else _request_metrics(self.handle, None)
        return reason, P.usage(self.n_prompt, self.text.n_tokens), spec


async def _stream(run: _Run, http: Request) -> AsyncIterator[bytes]:
    try:
        if run.fmt.kind == "chat":
            yield P.sse(run.fmt.chunk("", role=True))
        async for ev in _events(run.queue, http):
            if ev.error:
                yield P.sse(P.error_body(ev.error, type="server_error"))
                break
            text = run.text.push(ev.token_ids)
            if run.text.stopped or ev.finished:
                run.handle.cancel()
                text += run.text.flush()
                reason, usage, spec = run.final(ev if ev.finished else None)
                yield P.sse(run.fmt.chunk(text, run.new_ids(), reason, usage, spec))
                if run.params.include_usage:
                    yield P.sse(run.fmt.usage_chunk(usage, spec))
                break
            ids = run.new_ids()
            if text or ids:
                yield P.sse(run.fmt.chunk(text, ids))
        else:
            return  # client gone: nothing more to send
        yield P.sse("[DONE]")
    finally:
        run.handle.cancel()  # no-op when finished; frees the slot next round otherwise


async def _collect(run: _Run, http: Request) -> dict | None:
    text, last = "", None
    try:
        async for ev in _events(run.queue, http):
            if ev.error:
                raise P.ApiError(ev.error, status=500, type="server_error")
            text += run.text.push(ev.token_ids)
            if run.text.stopped or ev.finished:
                last = ev
                break
        else:
            return None  # client gone
    finally:
        run.handle.cancel()
    text += run.text.flush()
    reason, usage, spec = run.final(last if last.finished else None)
    return run.fmt.full(text, run.text.output_ids[:run.text.n_tokens] if run.params.return_token_ids
                        else None, reason, usage, spec)


async def _generate(svc: Service, http: Request, kind: str):
    """Parse, tokenize and validate, then queue; stream or collect the result."""
    body = await _read_json(http, svc.limits.max_body_bytes)
    if kind == "chat":
        from d3d_jax.training.chat_prompts import content_text

        parsed = P.parse_chat(body, svc.model_name, content_text)
    else:
        parsed = P.parse_completion(body, svc.model_name)
    ids = await run_in_threadpool(svc.encode, parsed)
    request = svc.build(parsed, ids)
    if not svc.scheduler.alive:
        raise P.ApiError("the decoder is not running", status=503, type="server_error")
    queue: asyncio.Queue = asyncio.Queue()
    try:
        handle = svc.scheduler.submit(request, _sink(asyncio.get_running_loop(), queue))
    except QueueFull as e:
        raise P.ApiError(str(e), status=503, type="server_error") from None
    p = parsed.params
    run = _Run(handle, queue, P.Formatter(kind, svc.model_name),
               TextStream(svc.tokenizer, ids, p.stop, p.skip_special_tokens), p, len(ids))
    if p.stream:
        return StreamingResponse(_stream(run, http), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    out = await _collect(run, http)
    return JSONResponse(out) if out is not None else PlainTextResponse("", 499)


def create_app(svc: Service) -> FastAPI:
    app = FastAPI(title="d3d-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = svc
    metrics = svc.scheduler.metrics

    @app.exception_handler(P.ApiError)
    async def api_error(_req, e: P.ApiError):
        metrics.record_http_error(e.status)
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_req, e: StarletteHTTPException):
        metrics.record_http_error(e.status_code)
        return JSONResponse(P.error_body(str(e.detail)), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_req, e: Exception):
        metrics.record_http_error(500)
        return JSONResponse(P.error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"), 500)

    @app.get("/health")
    async def health():
        ok = svc.scheduler.alive
        return JSONResponse({"status": "ok" if ok else "scheduler stopped"}, 200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": 0,
                                            "owned_by": "d3d-jax", "max_model_len": svc.limits.context_len}]}

    @app.get("/metrics")
    async def prometheus():
        s = svc.scheduler
        return PlainTextResponse(metrics.render(s.num_active, s.num_queued, s.num_slots, svc.mode),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await _generate(svc, http, "completion")

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        return await _generate(svc, http, "chat")

    if svc.api_key:
        app.add_middleware(_Auth, key=svc.api_key, on_reject=metrics.record_http_error)
    return app
