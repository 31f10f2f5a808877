"""Request parsing of the OpenAI-compatible API: every body checked by its declared schema.

The bodies are the pydantic models of :mod:`~d3d_jax.serving.schema` (each field's type, range
and whether it is served, in one place).  Every problem becomes ONE :class:`ApiError` (HTTP 400
with OpenAI's error JSON, naming the field): :func:`validation_error` turns pydantic's errors
into it, so no failure ends as FastAPI's 422 or a 500.  The raw JSON is parsed here first, with
its numbers' lengths and its nesting bounded and lone surrogates refused, before any model sees it.
"""

from __future__ import annotations

import dataclasses
import json

from pydantic import ValidationError

from d3d_jax.config.limits import LongNumber, json_loads
from d3d_jax.serving import schema as S
from d3d_jax.serving.schema import INT32, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_STOP  # noqa: F401

MAX_CHOICES = 64  # prompts x n per request
MAX_DEPTH = 32  # JSON nesting: the deepest valid body is 5 levels deep


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
    grammar: object = None  # a decoding.grammar.GrammarSpec: the output is constrained to it
    grammar_field: str | None = None  # the request field it came from (errors name it)


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    params: GenParams
    prompts: list = dataclasses.field(default_factory=list)  # completion: str or list of ids each
    messages: list[dict] | None = None
    tools: list[dict] | None = None  # chat: the functions offered, as the template reads them
    tool_choice: str | dict | None = None  # chat: "none" | "auto" | "required" | {"name": ...}
    template_kwargs: dict | None = None  # chat: the request's chat_template_kwargs


# --------------------------------------------------------------------------------------------
# The body: JSON, nesting, strings
# --------------------------------------------------------------------------------------------
def parse_json(raw: bytes) -> dict:
    """The body's object; numbers are bounded before Python converts them (a longer one is a
    400 naming its field, :data:`~d3d_jax.config.limits.MAX_NUMBER_CHARS`)."""
    try:
        body = json_loads(raw)
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
    """Nesting depth, numbers too long to convert and lone UTF-16 surrogates (which no tokenizer
    or response can encode), walked without recursion; the error names the top-level field."""
    if _bad_text(key):
        raise ApiError("a field name is not valid Unicode (a lone surrogate)", param=None)
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(f"'{key}' is nested too deeply (at most {MAX_DEPTH} levels)", param=key)
        if isinstance(v, LongNumber):
            raise ApiError(f"'{key}' {'holds' if depth > 1 else 'is'} {v.problem()}", param=key)
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
# The declared bodies
# --------------------------------------------------------------------------------------------
SERVED = "served"
ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize",
          "detokenize": "/detokenize"}
# route -> field -> SERVED, or the no-op values a refused field may hold (read from the models)
FIELDS = {kind: {name: S.is_refused(model, name) or SERVED for name in model.model_fields}
          for kind, model in S.BODIES.items()}
_NAMES = frozenset(n for m in (*S.BODIES.values(), S.Message, S.StreamOptions, S.TextPart)
                   for n in m.model_fields)
_TYPE_WORDS = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
               "bool_type": "a boolean", "dict_type": "an object", "model_type": "an object",
               "model_attributes_type": "an object", "list_type": "a list", "none_required": "null",
               "int_from_float": "an integer"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def validate(kind: str, body: dict, limits: "Limits"):
    """The body as its route's declared model, or one :class:`ApiError` naming the field."""
    try:
        return S.BODIES[kind].model_validate(body, context={"vocab": limits.vocab_size})
    except ValidationError as e:
        raise validation_error(e, kind, body) from None


def validation_error(e: ValidationError, kind: str | None = None, body=None) -> "ApiError":
    """pydantic's first failure as one 400: the field in ``param``, a bounded value in the text.
    When no form of a union fits, one message lists the forms the field accepts."""
    errors = e.errors(include_url=False)
    first = errors[0]
    err = (first.get("ctx") or {}).get("error")
    if isinstance(err, S.FieldError) and err.field is not None:
        return ApiError(err.message, param=err.field)
    loc = _clean(first["loc"])
    field = loc[0] if loc and isinstance(loc[0], str) else None
    same = [x for x in errors if _clean(x["loc"])[:1] == loc[:1]]
    best = next((x for x in same if x["type"] not in _TYPE_WORDS), None)
    if best is None and len(same) > 1:  # a union: name the place all its failures share
        where = _common([_clean(x["loc"]) for x in same])
        value, found = body, True
        for part in where:
            try:
                value = value[part]
            except (KeyError, IndexError, TypeError):
                found = False
        forms = _description(kind, where) or " or ".join(dict.fromkeys(_TYPE_WORDS[x["type"]] for x in same))
        return ApiError(f"'{_path(where)}' must be {forms}, got {_describe(value) if found else 'another type'}",
                        param=field)
    return ApiError(_message(best or first, kind), param=field)


_MODEL_NAMES = frozenset(m.__name__ for m in (*S.BODIES.values(), S.Message, S.StreamOptions, S.TextPart))


def _clean(loc) -> tuple:
    """pydantic's location without its union-member tags (``'list[constrained-str]'``)."""
    return loc[:1] + tuple(p for p in loc[1:] if isinstance(p, int) or p in _NAMES or not (
        any(c in p for c in "[-(") or p in ("str", "int", "float", "bool") or p in _MODEL_NAMES))


def _common(locs: list[tuple]) -> tuple:
    out = []
    for parts in zip(*locs):
        if len(set(parts)) > 1:
            break
        out.append(parts[0])
    return tuple(out)


def _description(kind: str | None, where: tuple) -> str | None:
    names = [p for p in where if isinstance(p, str)]
    if not names or where[-1] != names[-1]:
        return None
    models = [S.BODIES[kind]] if kind in S.BODIES and len(names) == 1 else [S.Message, S.StreamOptions]
    for m in models:
        info = m.model_fields.get(names[-1])
        if info is not None and info.description:
            return info.description
    return None


def _path(loc) -> str:
    """``messages[0].role`` from a cleaned location; user-chosen keys cut short."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = part if len(part) <= 40 else part[:40] + "..."
            out += f".{part}" if out else part
    return out or "body"


def _message(x: dict, kind: str | None) -> str:
    path, kind_of, ctx, value = _path(_clean(x["loc"])), x["type"], x.get("ctx") or {}, x.get("input")
    where = f"'{path}'"
    if kind_of == "extra_forbidden":  # the client's own key, whatever it looks like
        path = _path(_clean(x["loc"][:-1]) + x["loc"][-1:])
        if len(x["loc"]) == 1:
            return f"'{path}' is not a field this server serves for {ROUTES.get(kind, 'this route')}"
        return f"'{path}' is not supported by this server"
    if kind_of == "refused":
        return f"{ctx.get('why') or where + ' = ' + _short(value)} is not supported by this server"
    if kind_of == "missing":
        return f"{where} is required"
    if kind_of in _BOUNDS:
        op, key = _BOUNDS[kind_of]
        return f"{where} must be {op} {ctx[key]}, got {_short(value)}"
    if kind_of in ("too_short", "string_too_short"):
        least = ctx.get("min_length", 1)
        return f"{where} must be non-empty" if least == 1 else f"{where} must have at least {least} items"
    if kind_of in ("too_long", "string_too_long"):  # pydantic leaves a mapping's length out
        n = ctx.get("actual_length") or (len(value) if hasattr(value, "__len__") else "too many")
        items = "entries" if isinstance(value, dict) else "characters" if isinstance(value, str) else "items"
        return f"{where} has {n} {items}; this server accepts at most {ctx.get('max_length')}"
    if kind_of == "finite_number":
        return f"{where} must be finite, got {_short(value)}"
    if kind_of == "literal_error":
        return f"{where} must be one of {ctx.get('expected')}, got {_short(value)}"
    if kind_of in _TYPE_WORDS:
        return f"{where} must be {_TYPE_WORDS[kind_of]}, got {_describe(value)}"
    if kind_of == "value_error" and isinstance(ctx.get("error"), S.FieldError):
        return f"{where} {ctx['error'].message}"
    return f"{where}: {x['msg'][:200]}"


def _short(v) -> str:
    s = json.dumps(v) if isinstance(v, (str, dict, list)) else repr(v)
    return s if len(s) <= 40 else s[:20] + f"...({len(s)} characters)"


def _describe(v) -> str:
    if isinstance(v, list):
        kinds = sorted({type(x).__name__ for x in v[:1000]})
        return f"a list of {'/'.join(kinds)}" if v else "an empty list"
    return "null" if v is None else f"{type(v).__name__} {_short(v)}"


class ModelNotFound(ApiError):
    def __init__(self, model: str, served: str):
        super().__init__(f"The model '{model[:200]}' does not exist; this server serves '{served}'",
                         status=404, param="model", code="model_not_found")


def _model(model: str | None, served: str) -> str:
    if model is not None and model != served:
        raise ModelNotFound(model, served)
    return served


def _params(req: S._Generation, kind: str, echo_only: bool = False) -> GenParams:
    """The decoder-facing settings of a validated body (defaults for what it left out)."""
    so = req.stream_options or S.StreamOptions()
    if kind == "completion":
        logprobs = req.logprobs
    else:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    stop = () if req.stop is None else (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    return GenParams(
        max_tokens=0 if echo_only else getattr(req, req.budget_field()),
        temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0), top_k=max(0, req.top_k or 0),
        min_p=_or(req.min_p, 0.0), presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0), repetition_penalty=_or(req.repetition_penalty, 1.0),
        min_tokens=req.min_tokens or 0, logit_bias=bias, stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()), seed=req.seed, n=_or(req.n, 1), logprobs=logprobs,
        echo=bool(getattr(req, "echo", False)) and kind == "completion", ignore_eos=bool(req.ignore_eos),
        stream=bool(req.stream), include_usage=bool(so.include_usage),
        continuous_usage=bool(so.continuous_usage_stats), return_token_ids=bool(req.return_token_ids),
        skip_special_tokens=_or(req.skip_special_tokens, True))


def _or(v, default):
    return default if v is None else v


def parse_completion(body: dict, served_model: str, limits: Limits) -> ParsedRequest:
    # with echo, "max_tokens": 0 asks for the prompt's scores alone (the only budget below 1)
    echo_only = body.get("echo") is True and body.get("max_tokens") == 0 and type(body["max_tokens"]) is int
    req = validate("completion", {k: v for k, v in body.items() if k != "max_tokens"} if echo_only else body,
                   limits)
    model = _model(req.model, served_model)
    params = _params(req, "completion", echo_only)
    if echo_only and params.min_tokens:
        raise ApiError(f"'min_tokens' ({params.min_tokens}) must be <= 'max_tokens' (0)", param="min_tokens")
    prompts = req.prompts()
    if len(prompts) * params.n > MAX_CHOICES:
        raise ApiError(f"{len(prompts)} prompts x n = {params.n} is {len(prompts) * params.n} choices; "
                       f"at most {MAX_CHOICES} per request", param="prompt" if params.n == 1 else "n")
    return ParsedRequest("completion", model, params, prompts=prompts)


def parse_chat(body: dict, served_model: str, limits: Limits) -> ParsedRequest:
    req = validate("chat", body, limits)
    model = _model(req.model, served_model)
    from d3d_jax.serving.structured import spec_of

    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    choice = ({"name": choice.function.name} if isinstance(choice, S.NamedToolChoice) else
              choice if choice == "required" else "none" if choice == "none" or not tools else "auto")
    try:
        spec, field = spec_of(req)
    except S.FieldError as e:
        raise ApiError(e.message, param=e.field) from None
    params = dataclasses.replace(_params(req, "chat"), grammar=spec, grammar_field=field)
    return ParsedRequest("chat", model, params, messages=[m.for_template() for m in req.messages],
                         tools=tools, tool_choice=choice, template_kwargs=req.chat_template_kwargs)


def parse_tokenize(body: dict, served_model: str, limits: Limits) -> S.TokenizeRequest:
    req = validate("tokenize", body, limits)
    _model(req.model, served_model)
    return req


def parse_detokenize(body: dict, served_model: str, limits: Limits) -> list[int]:
    req = validate("detokenize", body, limits)
    _model(req.model, served_model)
    return list(req.tokens)


def resolve_max_tokens(n_prompt: int, params: GenParams, limits: Limits) -> int:
    """Completion budget after the prompt-length checks (the same messages as vLLM's)."""
    if n_prompt == 0:
        raise ApiError("the prompt is empty after tokenization", param="prompt")
    if n_prompt > limits.prompt_cap:
        raise ApiError(f"the prompt has {n_prompt} tokens; this server accepts at most "
                       f"{limits.prompt_cap} (maximum context length {limits.context_len})",
                       param="prompt", code="context_length_exceeded")
    room = limits.context_len - n_prompt
    if params.min_tokens > room:
        raise ApiError(f"'min_tokens' ({params.min_tokens}) is more than the {room} tokens left after the "
                       f"{n_prompt}-token prompt (maximum context length {limits.context_len})",
                       param="min_tokens", code="context_length_exceeded")
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
