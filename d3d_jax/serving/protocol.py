"""Request parsing, validation and response shapes of the OpenAI-compatible API.

Bodies are parsed by hand rather than by pydantic models: every problem becomes ONE
:class:`ApiError` (HTTP 400 with OpenAI's error JSON, naming the field), never FastAPI's 422, and
fields the server cannot honour (``n > 1``, ``logprobs``, penalties...) are refused instead of
silently ignored.  Unknown fields are ignored, as OpenAI's clients send extras.

Extensions (as vLLM names them): ``top_k``, ``stop_token_ids``, ``ignore_eos``,
``skip_special_tokens`` and ``return_token_ids`` (each choice then carries the token ids).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Any

MAX_STOP = 16  # stop strings plus stop ids per request (the decoder's stop-id table is bounded too)


class ApiError(Exception):
    """An error answered with OpenAI's error JSON; ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict:
        return error_body(str(self), self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for.  ``context_len``: prompt + completion tokens a slot holds."""

    context_len: int
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # default: context_len - 1
    default_max_tokens: int = 256

    @property
    def prompt_cap(self) -> int:
        cap = self.context_len - 1
        return cap if self.max_prompt_tokens is None else min(cap, self.max_prompt_tokens)


@dataclasses.dataclass
class GenParams:
    max_tokens: int | None = None  # None: the server's default, cut to the room left
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    params: GenParams
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------
def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _number(body: dict, key: str, default, *, integer: bool = False, lo=None, hi=None,
            lo_open: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise ApiError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", param=key)
    if not math.isfinite(v):
        raise ApiError(f"'{key}' must be finite, got {v!r}", param=key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ApiError(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v!r}", param=key)
    if hi is not None and v > hi:
        raise ApiError(f"'{key}' must be <= {hi}, got {v!r}", param=key)
    return int(v) if integer else float(v)


def _flag(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{key}' must be a boolean, got {v!r}", param=key)
    return v


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _stops(body: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``stop``: a string or a list of strings and/or token ids; ``stop_token_ids``: ids."""
    stop, extra = body.get("stop"), body.get("stop_token_ids")
    items = [] if stop is None else stop if isinstance(stop, list) else [stop]
    if extra is not None and not (isinstance(extra, list) and all(_is_id(i) for i in extra)):
        raise ApiError("'stop_token_ids' must be a list of token ids >= 0", param="stop_token_ids")
    if not all((isinstance(s, str) and s) or _is_id(s) for s in items):
        raise ApiError("'stop' must be a non-empty string or a list of non-empty strings / token ids >= 0",
                       param="stop")
    texts = tuple(s for s in items if isinstance(s, str))
    ids = tuple(s for s in items if not isinstance(s, str)) + tuple(extra or ())
    if len(texts) + len(ids) > MAX_STOP:
        raise ApiError(f"at most {MAX_STOP} stop strings and ids, got {len(texts) + len(ids)}", param="stop")
    return texts, ids


# Fields the server cannot honour: refused when set to anything but their no-op value.
_UNSUPPORTED = {"n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0),
                "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "logit_bias": (None, {}), "tools": (None, []), "functions": (None, [])}


def _refuse_unsupported(body: dict) -> None:
    for key, noop in _UNSUPPORTED.items():
        if key in body and not any(body[key] == v and type(body[key]) is type(v) or body[key] is v
                                   for v in noop):
            raise ApiError(f"'{key}' = {body[key]!r} is not supported by this server", param=key)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError("'response_format' other than {\"type\": \"text\"} is not supported",
                       param="response_format")


def parse_params(body: dict, max_tokens_key: str = "max_tokens") -> GenParams:
    _refuse_unsupported(body)
    stop, stop_ids = _stops(body)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    max_tokens = _number(body, max_tokens_key, None, integer=True)
    if max_tokens is not None and max_tokens <= 0:
        raise ApiError(f"'{max_tokens_key}' must be >= 1, got {max_tokens}", param=max_tokens_key)
    return GenParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, lo=0.0, hi=100.0),
        top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=max(0, _number(body, "top_k", 0, integer=True, lo=-1)),  # vLLM: -1 = off
        stop=stop, stop_token_ids=stop_ids,
        seed=_number(body, "seed", None, integer=True, lo=-(2 ** 63), hi=2 ** 64 - 1),
        ignore_eos=_flag(body, "ignore_eos"), stream=_flag(body, "stream"),
        include_usage=_flag(opts or {}, "include_usage"),
        return_token_ids=_flag(body, "return_token_ids"),
        skip_special_tokens=_flag(body, "skip_special_tokens", True))


def _model(body: dict, served: str) -> str:
    model = body.get("model")
    if model is None:
        raise ApiError("'model' is required", param="model")
    if model != served:
        raise ApiError(f"The model '{model}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")
    return model


def parse_completion(body: dict, served_model: str) -> ParsedRequest:
    model = _model(body, served_model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("'prompt' must not be empty", param="prompt")
        return ParsedRequest("completion", model, parse_params(body), prompt_text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return ParsedRequest("completion", model, parse_params(body), prompt_ids=list(prompt))
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError("one prompt per request: send a string or a list of token ids", param="prompt")
    raise ApiError("'prompt' must be a non-empty string or a list of token ids", param="prompt")


def parse_chat(body: dict, served_model: str, content_text) -> ParsedRequest:
    """``content_text(content, where)`` turns a message's content (string or text parts) into text."""
    model = _model(body, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(f"messages[{i}] must have a role of system, user or assistant", param="messages")
        try:
            text = content_text(m.get("content"), f"messages[{i}]")
        except ValueError as e:
            raise ApiError(str(e), param="messages") from None
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": text})
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return ParsedRequest("chat", model, parse_params(body, key), messages=out)


def resolve_max_tokens(n_prompt: int, params: GenParams, limits: Limits) -> int:
    """Completion budget after the prompt-length checks (the same messages as vLLM's)."""
    if n_prompt == 0:
        raise ApiError("the prompt is empty after tokenization", param="prompt")
    if n_prompt > limits.prompt_cap:
        raise ApiError(f"the prompt has {n_prompt} tokens; this server accepts at most "
                       f"{limits.prompt_cap} (maximum context length {limits.context_len})",
                       param="prompt", code="context_length_exceeded")
    room = limits.context_len - n_prompt
    if params.max_tokens is None:
        return min(limits.default_max_tokens, room)
    if params.max_tokens > room:
        raise ApiError(f"This model's maximum context length is {limits.context_len} tokens. However, "
                       f"you requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, "
                       f"{params.max_tokens} for the completion).", param="max_tokens",
                       code="context_length_exceeded")
    return params.max_tokens


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------
def finish_reason(reason: str | None) -> str | None:
    """The decoder's eos/stop/length (and a matched stop string) in OpenAI's vocabulary."""
    return None if reason is None else ("length" if reason == "length" else "stop")


@dataclasses.dataclass
class Formatter:
    """Builds the JSON objects of one response: streamed chunks or the whole completion."""

    kind: str
    model: str
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def _envelope(self, chunk: bool) -> dict:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        obj = ("chat.completion" + (".chunk" if chunk else "")) if self.kind == "chat" else "text_completion"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, token_ids, reason, chunk: bool, role: bool = False) -> dict:
        c: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            msg: dict[str, Any] = {"role": "assistant"} if role or not chunk else {}
            if text is not None:
                msg["content"] = text
            c["delta" if chunk else "message"] = msg
        else:
            c["text"] = text or ""
        c["logprobs"] = None
        c["finish_reason"] = finish_reason(reason)
        if token_ids is not None:
            c["token_ids"] = list(token_ids)
        return c

    def chunk(self, text: str | None, token_ids=None, reason: str | None = None,
              usage: dict | None = None, spec: dict | None = None, role: bool = False) -> dict:
        out = self._envelope(True) | {"choices": [self._choice(text, token_ids, reason, True, role)]}
        if usage is not None:
            out["usage"], out["spec_metrics"] = usage, spec
        return out

    def usage_chunk(self, usage: dict, spec: dict | None) -> dict:
        """The choice-less last chunk of ``stream_options.include_usage`` (OpenAI's shape)."""
        return self._envelope(True) | {"choices": [], "usage": usage, "spec_metrics": spec}

    def full(self, text: str, token_ids, reason: str | None, usage: dict, spec: dict | None) -> dict:
        return self._envelope(False) | {"choices": [self._choice(text, token_ids, reason, False)],
                                        "usage": usage, "spec_metrics": spec}


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()
