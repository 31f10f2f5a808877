"""HTTP layer: OpenAI-compatible routes over a :class:`~d3d_jax.serving.scheduler.Scheduler`.

``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream``), ``GET /v1/models``
and ``/v1/models/{id}``, ``POST /tokenize`` and ``/detokenize``, ``GET /version``, ``/ping``,
``GET|HEAD /health`` and ``/metrics``.  Every request is parsed, tokenized and validated before
anything is queued, so a bad one costs no decoder work and gets one 4xx naming the problem —
with ``stream: true`` too, before the stream starts.  A request becomes one decoder request per
choice (prompts x ``n``, :mod:`~d3d_jax.serving.choices`).  With an API key, every route but
``/health`` and ``/ping`` answers 401 unless ``Authorization: Bearer KEY`` (ASGI middleware,
before the body is read).  A client that disconnects, or whose output matched a stop string,
cancels its requests; the scheduler frees the slots at its next round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from d3d_jax.serving import protocol as P
from d3d_jax.serving import responses as R
from d3d_jax.serving.choices import Run, collect, stream
from d3d_jax.serving.scheduler import QueueFull, Scheduler

log = logging.getLogger("d3d_jax.serving")

VERSION = "0.1.0"
BODY_TIMEOUT_S = 60.0  # the whole request body must arrive in this (http_server.HEADER_TIMEOUT_S: the head)


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
    chat_encode: Callable | None = None  # (tokenizer, messages, tools=, **template kwargs) -> ids
    # (prompt ids, alternatives) -> per prompt token (log-prob or None, [(id, log-prob)] or None)
    score_prompt: Callable | None = None
    default_template_kwargs: dict = dataclasses.field(default_factory=lambda: {"enable_thinking": False})
    reasoning_parser: str = "qwen3"  # "none": the thought stays in content
    tool_call_parser: str = "hermes"  # "none": tool calls stay in content
    _template: Any = None
    _vocabulary: Any = None  # the grammar engine's view of the tokenizer (structured output)

    def matcher(self, params: P.GenParams):
        """A fresh grammar matcher for one choice of a constrained request (a 400 names the field
        whose grammar does not compile)."""
        from d3d_jax.decoding.grammar import Vocabulary

        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.tokenizer, self.limits.vocab_size or len(self.tokenizer))
        problem = self._vocabulary.check(params.grammar)
        if problem:
            raise P.ApiError(f"'{params.grammar_field}' gives a grammar that cannot be used: {problem}",
                             param=params.grammar_field)
        return self._vocabulary.matcher(params.grammar)

    def template_kwargs(self, asked: dict | None) -> dict:
        """The chat template's variables for a request (its own over the server's defaults)."""
        if self._template is None:
            from d3d_jax.serving.template import TemplateKwargs

            self._template = TemplateKwargs(self.tokenizer, self.default_template_kwargs)
        return self._template.resolve(asked)

    def encode_chat(self, messages, tools=None, template_kwargs: dict | None = None) -> list[int]:
        if self.chat_encode is None:
            from d3d_jax.io.chat import chat_prompt_ids

            self.chat_encode = chat_prompt_ids
        kwargs = self.template_kwargs(template_kwargs)
        try:
            return list(self.chat_encode(self.tokenizer, messages, tools=tools, **kwargs))
        except Exception as e:  # noqa: BLE001 - see below
            # raise_exception() in a template (roles out of order ...) raises TemplateError itself:
            # the request's problem.  Anything else (a syntax error, an undefined name) is a broken
            # template: the server's, and not the client's to fix.
            if type(e).__name__ == "TemplateError":
                raise P.ApiError(f"the chat template refuses these messages: {str(e)[:300]}",
                                 param="messages") from None
            log.error("the chat template failed: %s: %s", type(e).__name__, e)
            raise P.ApiError(f"the server's chat template failed ({type(e).__name__}); this is not a "
                             f"problem of the request", status=500, type="server_error") from None

    def encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def encode(self, req: P.ParsedRequest) -> list[list[int]]:
        """Token ids of every prompt of the request."""
        if req.messages is not None:
            return [self.encode_chat(req.messages, req.tools, req.template_kwargs)]
        return [self.encode_prompt(p) for p in req.prompts]

    def sampling(self, p: P.GenParams):
        from d3d_jax.decoding.verify import SamplingParams

        bias = sorted(p.logit_bias.items())
        return SamplingParams(p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty,
                              p.frequency_penalty, p.repetition_penalty, p.min_tokens,
                              tuple(i for i, _ in bias), tuple(v for _, v in bias),
                              -1 if p.logprobs is None else p.logprobs)

    def build(self, params: P.GenParams, ids: list[int], seed: int, max_new: int | None = None):
        """The decoder request, checked by the decoder's own validation (its error becomes a 400)."""
        max_new = P.resolve_max_tokens(len(ids), params, self.limits) if max_new is None else max_new
        stop_ids = tuple(dict.fromkeys(params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)))
        kw = dict(prompt=ids, max_new_tokens=max_new, stop_token_ids=stop_ids, seed=seed)
        if params.grammar is not None:
            kw["grammar"] = self.matcher(params)
        out = self.make_request(sampling=self.sampling(params), **kw)
        if self.validate_request is not None:
            try:
                self.validate_request(out)
            except ValueError as e:  # a grammar the mode cannot serve is the constraint's field's problem
                grammar = params.grammar is not None and "structured output" in str(e)
                raise P.ApiError(str(e), param=params.grammar_field if grammar else "prompt") from None
        return out


class _Auth:
    """Pure ASGI (no body buffering, streaming untouched): 401 without the right bearer key."""

    def __init__(self, app, key: str, open_paths=("/health", "/ping"), on_reject=None):
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


class ClientGone(Exception):
    """The client disconnected before its body arrived: nothing to answer, nothing to count."""


async def read_json(request: Request, limit: int) -> dict:
    encodings = [e.strip().lower() for h in request.headers.getlist("content-encoding") for e in h.split(",")]
    if any(e not in ("", "identity") for e in encodings):  # as vLLM: a compressed body is not read as JSON
        raise P.ApiError(f"Content-Encoding {', '.join(encodings)[:60]!r} is not supported; send the body "
                         "uncompressed (identity)", status=415)
    length = request.headers.get("content-length", "")
    if length and not (length.isascii() and length.isdigit()):
        raise P.ApiError(f"Content-Length {length[:40]!r} is not a byte count")
    if length and int(length) > limit:
        raise P.ApiError(f"request body of {length[:40]} bytes exceeds the limit of {limit}", status=413)
    buf = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):  # a client that stops sending holds no connection
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit:
                    raise P.ApiError(f"request body exceeds the limit of {limit} bytes", status=413)
    except ClientDisconnect:
        raise ClientGone() from None
    except TimeoutError:
        raise P.ApiError(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", status=408) from None
    return P.parse_json(bytes(buf))


def _prompt_entries(svc: Service, ids: list[int], top: int) -> list:
    """(id, log-prob, alternatives) per prompt token; the first has none (OpenAI: null)."""
    scored = svc.score_prompt(ids, top)
    return [(t, lp, alts) for t, (lp, alts) in zip(ids, scored)]


async def _generate(svc: Service, http: Request, kind: str):
    """Parse, tokenize, validate and build every choice's request; then queue, stream or collect."""
    body = await read_json(http, svc.limits.max_body_bytes)
    if kind == "chat":
        parsed = P.parse_chat(body, svc.model_name, svc.limits)
    else:
        parsed = P.parse_completion(body, svc.model_name, svc.limits)
    p = parsed.params
    try:
        prompts = await run_in_threadpool(svc.encode, parsed)
    except P.ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - the tokenizer refused this text
        raise P.ApiError(f"cannot tokenize the prompt: {e}", param="prompt") from None
    run = Run.create(svc, parsed, prompts)
    if p.echo and p.logprobs is not None:
        if svc.score_prompt is None:
            raise P.ApiError("'echo' with 'logprobs' is not supported by this server", param="echo")
        run.prompt_entries = [await run_in_threadpool(_prompt_entries, svc, ids, p.logprobs)
                              for ids in prompts]
    if not svc.scheduler.alive:
        raise P.ApiError("the decoder is not running", status=503, type="server_error")
    try:
        run.submit(svc.scheduler)
    except QueueFull as e:
        run.cancel()
        raise P.ApiError(str(e), status=503, type="server_error") from None
    if p.stream:
        return StreamingResponse(stream(run, http), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    out = await collect(run, http)
    return JSONResponse(out) if out is not None else PlainTextResponse("", 499)


def _tokenize_body(svc: Service, body: dict) -> list[int]:
    req = P.parse_tokenize(body, svc.model_name, svc.limits)
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        return svc.encode_chat([m.for_template() for m in req.messages], tools, req.chat_template_kwargs)
    if req.tools is not None or req.chat_template_kwargs is not None:
        raise P.ApiError("'tools' and 'chat_template_kwargs' need 'messages' (they shape the chat template)",
                         param="tools" if req.tools is not None else "chat_template_kwargs")
    return list(svc.tokenizer.encode(req.prompt, add_special_tokens=bool(req.add_special_tokens)))


def create_app(svc: Service) -> FastAPI:
    app = FastAPI(title="d3d-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = svc
    _add_error_handlers(app, svc.scheduler.metrics)
    _add_info_routes(app, svc)
    _add_token_routes(app, svc)

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await _generate(svc, http, "completion")

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        return await _generate(svc, http, "chat")

    if svc.api_key:
        app.add_middleware(_Auth, key=svc.api_key, on_reject=svc.scheduler.metrics.record_http_error)
    return app


def _add_error_handlers(app: FastAPI, metrics) -> None:
    """Every error a route raises ends as one OpenAI-shaped body, counted by status."""
    @app.exception_handler(P.ApiError)
    async def api_error(_req, e: P.ApiError):
        metrics.record_http_error(e.status)
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def invalid(_req, e):  # a declared model refused the input: 400 naming the field, never 422
        err = P.validation_error(e) if isinstance(e, ValidationError) else P.ApiError(
            f"invalid request: {str(e.errors()[:1])[:200]}")
        metrics.record_http_error(err.status)
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(ClientGone)
    async def client_gone(_req, _e):
        metrics.record_request("client_disconnected")
        return PlainTextResponse("", 499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_req, e: StarletteHTTPException):
        metrics.record_http_error(e.status_code)
        return JSONResponse(P.error_body(str(e.detail)), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_req, e: Exception):
        if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e):
            metrics.record_http_error(503)
            return JSONResponse(P.error_body(f"out of resources: {type(e).__name__}", type="server_error"), 503)
        log.exception("internal error")
        metrics.record_http_error(500)
        return JSONResponse(P.error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"), 500)


def _add_info_routes(app: FastAPI, svc: Service) -> None:
    """Health, version, models and the Prometheus metrics."""
    metrics = svc.scheduler.metrics

    def model_card() -> dict:
        return {"id": svc.model_name, "object": "model", "created": 0, "owned_by": "d3d-jax",
                "max_model_len": svc.limits.context_len}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        s = svc.scheduler
        ok = s.healthy
        status = "ok" if ok else (s.step_error or "scheduler stopped") if s.alive else "scheduler stopped"
        return JSONResponse({"status": status}, 200 if ok else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return Response(status_code=200 if svc.scheduler.alive else 503)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != svc.model_name:
            raise P.ModelNotFound(model_id, svc.model_name)
        return model_card()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        s = svc.scheduler
        return PlainTextResponse(metrics.render(s.num_active, s.num_queued, s.num_slots, svc.mode,
                                                model=svc.model_name, kv=s.kv_stats()),
                                 media_type="text/plain; version=0.0.4")


def _add_token_routes(app: FastAPI, svc: Service) -> None:
    """vLLM's /tokenize and /detokenize."""
    @app.post("/tokenize")
    async def tokenize(http: Request):
        body = await read_json(http, svc.limits.max_body_bytes)
        ids = await run_in_threadpool(_tokenize_body, svc, body)  # a long text must not stall streams
        return {"count": len(ids), "max_model_len": svc.limits.context_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: Request):
        tokens = P.parse_detokenize(await read_json(http, svc.limits.max_body_bytes), svc.model_name,
                                    svc.limits)
        return {"prompt": await run_in_threadpool(svc.tokenizer.decode, tokens)}  # off the event loop too


__all__ = ["Service", "create_app", "read_json", "R"]
