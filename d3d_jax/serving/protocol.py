"""Request parsing and validation of the OpenAI-compatible API: every number bounded at the door.

Bodies are parsed by hand rather than by pydantic models: every problem becomes ONE
:class:`ApiError` (HTTP 400 with OpenAI's error JSON, naming the field), never FastAPI's 422.
Every field of OpenAI's completions and chat-completions request schemas is in :data:`FIELDS`:
served, or refused with a 400 naming it unless it holds its no-op value (``"n": 1`` is served,
``"audio": {...}`` is refused).  A field in no schema and not one of vLLM's extensions we serve
is refused too: nothing a client sends is silently ignored.

Extensions (as vLLM names them): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` and ``return_token_ids`` (each choice
then carries its token ids).
"""

from __future__ import annotations

import dataclasses
import json
import math

MAX_STOP = 16  # stop strings plus stop ids per request (the decoder's stop-id table is bounded too)
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # prompts x n per request
MAX_LOGPROBS = 20  # completions' `logprobs`, chat's `top_logprobs` (the decoder's table)
MAX_LOGIT_BIAS = 64  # entries of `logit_bias` (the decoder's per-row table)
MAX_DEPTH = 32  # JSON nesting: the deepest valid body is 5 levels deep
INT32 = 2 ** 31 - 1


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
    vocab_size: int | None = None  # token ids (prompt, stop, logit_bias) are checked against it

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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None  # None: none; k: the chosen token's plus k alternatives
    echo: bool = False
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    params: GenParams
    prompts: list = dataclasses.field(default_factory=list)  # completion: str or list of ids each
    messages: list[dict] | None = None


# --------------------------------------------------------------------------------------------
# The body: JSON, nesting, strings
# --------------------------------------------------------------------------------------------
def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(f"request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(f"request body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        _check_value(key, value)
    return body


def _check_value(key: str, value) -> None:
    """Nesting depth and lone UTF-16 surrogates (which no tokenizer or response can encode),
    walked without recursion; the error names the top-level field."""
    if _bad_text(key):
        raise ApiError("a field name is not valid Unicode (a lone surrogate)", param=None)
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(f"'{key}' is nested too deeply (at most {MAX_DEPTH} levels)", param=key)
        if isinstance(v, str) and _bad_text(v):
            raise ApiError(f"'{key}' holds a string that is not valid Unicode (a lone surrogate)",
                           param=key)
        if isinstance(v, dict):
            if any(_bad_text(k) for k in v):
                raise ApiError(f"'{key}' holds a key that is not valid Unicode", param=key)
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


def _bad_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


# --------------------------------------------------------------------------------------------
# Fields: served, or refused unless they hold their no-op value
# --------------------------------------------------------------------------------------------
SERVED = "served"
_COMMON = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
           "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user",
           # vLLM's extensions
           "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
           "skip_special_tokens", "return_token_ids")
# field -> values that mean "the default behaviour" (accepted); anything else is refused
_NOOP_COMPLETION = {"suffix": (None, ""), "best_of": (None, 1)}
_NOOP_CHAT = {
    "audio": (None,), "function_call": (None, "none"), "functions": (None, []), "tools": (None, []),
    "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "modalities": (None, ["text"]), "moderation": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    "response_format": (None, {"type": "text"}), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto", "default"), "prompt_cache_retention": (None,),
    "prompt_cache_options": (None,),
}
# identifiers and hints with no effect on the output: accepted as they are (strings or null)
_IDENTIFIERS = ("user", "safety_identifier", "prompt_cache_key")
FIELDS = {
    "completion": dict.fromkeys(_COMMON + ("prompt", "echo"), SERVED) | _NOOP_COMPLETION,
    "chat": dict.fromkeys(_COMMON + ("messages", "max_completion_tokens", "top_logprobs",
                                     "safety_identifier", "prompt_cache_key"), SERVED) | _NOOP_CHAT,
}
# what the README's refusal of a field says in a word
_WHY = {"best_of": "'best_of' other than 1 (send 'n' for several choices)", "suffix": "'suffix' (insertion)"}


def check_fields(body: dict, kind: str) -> None:
    """Every field is known to this route, and a refused one holds its no-op value."""
    table = FIELDS[kind]
    for key, value in body.items():
        rule = table.get(key)
        if rule is None:
            raise ApiError(f"'{key}' is not a field this server serves for "
                           f"{'/v1/chat/completions' if kind == 'chat' else '/v1/completions'}",
                           param=key)
        if rule is SERVED:
            if key in _IDENTIFIERS and value is not None and not isinstance(value, str):
                raise ApiError(f"'{key}' must be a string", param=key)
            continue
        if not any(value == ok and type(value) is type(ok) for ok in rule):
            what = _WHY.get(key, f"'{key}' = {json.dumps(value)[:80]}")
            raise ApiError(f"{what} is not supported by this server", param=key)


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------
def _number(body: dict, key: str, default, *, integer: bool = False, lo=None, hi=None,
            lo_open: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            integer and isinstance(v, float) and not v.is_integer()):
        raise ApiError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}"[:200],
                       param=key)
    if isinstance(v, float) and not math.isfinite(v):
        raise ApiError(f"'{key}' must be finite, got {v!r}", param=key)
    # compare as given (a huge int never becomes a float: no overflow)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ApiError(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {_short(v)}", param=key)
    if hi is not None and v > hi:
        raise ApiError(f"'{key}' must be <= {hi}, got {_short(v)}", param=key)
    return int(v) if integer else float(v)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:20] + f"...({len(s)} digits)"


def _flag(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{key}' must be a boolean, got {v!r}"[:200], param=key)
    return v


def _is_id(v, vocab: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (vocab or INT32)


def _stops(body: dict, vocab) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``stop``: a string or a list of strings and/or token ids; ``stop_token_ids``: ids."""
    stop, extra = body.get("stop"), body.get("stop_token_ids")
    items = [] if stop is None else stop if isinstance(stop, list) else [stop]
    if extra is not None and not (isinstance(extra, list) and all(_is_id(i, vocab) for i in extra)):
        raise ApiError(f"'stop_token_ids' must be a list of token ids in [0, {vocab or INT32})",
                       param="stop_token_ids")
    if not all((isinstance(s, str) and s) or _is_id(s, vocab) for s in items):
        raise ApiError("'stop' must be a non-empty string or a list of non-empty strings / token ids "
                       f"in [0, {vocab or INT32})", param="stop")
    texts = tuple(s for s in items if isinstance(s, str))
    ids = tuple(s for s in items if not isinstance(s, str)) + tuple(extra or ())
    if len(texts) + len(ids) > MAX_STOP:
        raise ApiError(f"at most {MAX_STOP} stop strings and ids, got {len(texts) + len(ids)}", param="stop")
    return texts, ids


def _logit_bias(body: dict, vocab) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}``, bias in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ApiError("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    out = {}
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit() and len(k) < 11 and _is_id(int(k), vocab)):
            raise ApiError(f"'logit_bias' key {k[:20]!r} is not a token id in [0, {vocab or INT32})",
                           param="logit_bias")
        out[int(k)] = _number({"logit_bias": v}, "logit_bias", 0.0, lo=-100.0, hi=100.0)
    return out


def _stream_options(body: dict) -> tuple[bool, bool]:
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    if not _flag(body, "stream"):
        raise ApiError("'stream_options' is only allowed with \"stream\": true", param="stream_options")
    unknown = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ApiError(f"'stream_options.{unknown[0]}' is not supported by this server",
                       param="stream_options")
    return _flag(opts, "include_usage"), _flag(opts, "continuous_usage_stats")


def _logprobs(body: dict, kind: str) -> int | None:
    if kind == "completion":
        return _number(body, "logprobs", None, integer=True, lo=0, hi=MAX_LOGPROBS)
    top = _number(body, "top_logprobs", None, integer=True, lo=0, hi=MAX_LOGPROBS)
    if not _flag(body, "logprobs"):
        if top is not None:
            raise ApiError("'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
        return None
    return top or 0


def parse_params(body: dict, kind: str, limits: Limits) -> GenParams:
    check_fields(body, kind)
    vocab = limits.vocab_size
    stop, stop_ids = _stops(body, vocab)
    include_usage, continuous = _stream_options(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    echo = kind == "completion" and _flag(body, "echo")
    max_tokens = _number(body, key, None, integer=True, lo=0 if echo else 1, hi=INT32)
    n = _number(body, "n", 1, integer=True, lo=1, hi=MAX_N)
    min_tokens = _number(body, "min_tokens", 0, integer=True, lo=0, hi=INT32)
    if max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(f"'min_tokens' ({min_tokens}) must be <= '{key}' ({max_tokens})", param="min_tokens")
    return GenParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, lo=0.0, hi=100.0),
        top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=max(0, _number(body, "top_k", 0, integer=True, lo=-1, hi=INT32)),  # vLLM: -1 = off
        min_p=_number(body, "min_p", 0.0, lo=0.0, hi=1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, lo=0.0, hi=2.0, lo_open=True),
        min_tokens=min_tokens, logit_bias=_logit_bias(body, vocab),
        stop=stop, stop_token_ids=stop_ids,
        seed=_number(body, "seed", None, integer=True, lo=-(2 ** 63), hi=2 ** 64 - 1),
        n=n, logprobs=_logprobs(body, kind), echo=echo,
        ignore_eos=_flag(body, "ignore_eos"), stream=_flag(body, "stream"),
        include_usage=include_usage, continuous_usage=continuous,
        return_token_ids=_flag(body, "return_token_ids"),
        skip_special_tokens=_flag(body, "skip_special_tokens", True))


class ModelNotFound(ApiError):
    def __init__(self, model: str, served: str):
        super().__init__(f"The model '{model[:200]}' does not exist; this server serves '{served}'",
                         status=404, param="model", code="model_not_found")


def _model(body: dict, served: str) -> str:
    model = body.get("model")
    if model is None:
        raise ApiError("'model' is required", param="model")
    if not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model")
    if model != served:
        raise ModelNotFound(model, served)
    return model


PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _prompts(prompt, vocab) -> list:
    """Completions' ``prompt`` in every form OpenAI accepts, as a list of prompts."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = list(prompt)
        for i, p in enumerate(prompts):
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise ApiError(f"'prompt[{i}]' must be a non-empty list of token ids", param="prompt")
    else:
        raise ApiError(f"'prompt' must be {PROMPT_FORMS} (non-empty), got "
                       f"{_describe(prompt)}", param="prompt")
    for i, p in enumerate(prompts):
        if isinstance(p, str) and not p:
            raise ApiError("'prompt' must not be empty" if len(prompts) == 1 else
                           f"'prompt[{i}]' must not be empty", param="prompt")
        if isinstance(p, list) and not all(_is_id(t, vocab) for t in p):
            bad = next(t for t in p if not _is_id(t, vocab))
            raise ApiError(f"'prompt' has token id {_short(bad)} outside the vocabulary "
                           f"[0, {vocab or INT32})", param="prompt")
    return prompts


def _describe(v) -> str:
    if isinstance(v, list):
        kinds = sorted({type(x).__name__ for x in v})
        return f"a list of {'/'.join(kinds)}" if v else "an empty list"
    return "null" if v is None else type(v).__name__


def parse_completion(body: dict, served_model: str, limits: Limits) -> ParsedRequest:
    model = _model(body, served_model)
    params = parse_params(body, "completion", limits)
    prompts = _prompts(body.get("prompt"), limits.vocab_size)
    if len(prompts) * params.n > MAX_CHOICES:
        raise ApiError(f"{len(prompts)} prompts x n = {params.n} is {len(prompts) * params.n} choices; "
                       f"at most {MAX_CHOICES} per request", param="prompt" if params.n == 1 else "n")
    return ParsedRequest("completion", model, params, prompts=prompts)


def parse_chat(body: dict, served_model: str, content_text, limits: Limits) -> ParsedRequest:
    """``content_text(content, where)`` turns a message's content (string or text parts) into text."""
    model = _model(body, served_model)
    params = parse_params(body, "chat", limits)
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
    return ParsedRequest("chat", model, params, messages=out)


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
        return max(min(limits.default_max_tokens, room), params.min_tokens)
    if params.max_tokens > room:
        raise ApiError(f"This model's maximum context length is {limits.context_len} tokens. However, "
                       f"you requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, "
                       f"{params.max_tokens} for the completion).", param="max_tokens",
                       code="context_length_exceeded")
    return params.max_tokens


def choice_seed(seed: int, k: int) -> int:
    """The seed of choice ``k`` (= prompt index x n + choice index): ``seed + k`` mod 2**31, so
    choice 0 of a one-prompt request samples with ``seed`` itself."""
    return (seed + k) % (2 ** 31)
