"""The request bodies of the OpenAI-compatible API, declared: every field's type, range and
whether it is served.

Each route's body is a pydantic model with ``extra="forbid"``: a field in no schema and not one
of vLLM's extensions we serve is refused, so nothing a client sends is silently ignored.  A field
of OpenAI's schemas this server does not serve is declared with :func:`Refused` and its no-op
values (``"n": 1`` is served, ``"audio": {...}`` is refused unless null).  Models are strict: a
JSON string is never a number, a number never a boolean.  Checks that need the server's limits
(the vocabulary) read the validation context ``{"vocab": size}``; checks across fields are the
models' ``after`` validators.  :func:`d3d_jax.serving.protocol.validation_error` turns any
failure into one 400 naming the field.

Extensions (as vLLM names them): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` and ``return_token_ids`` (each choice
then carries its token ids).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo
from pydantic import model_validator
from pydantic_core import PydanticCustomError

MAX_STOP = 16  # stop strings plus stop ids per request (the decoder's stop-id table is bounded too)
MAX_N = 16  # choices per prompt
MAX_LOGPROBS = 20  # completions' `logprobs`, chat's `top_logprobs` (the decoder's table)
MAX_LOGIT_BIAS = 64  # entries of `logit_bias` (the decoder's per-row table)
INT32 = 2 ** 31 - 1


class FieldError(ValueError):
    """A failed check that pydantic cannot place by itself: ``field`` is the one it blames
    (None: the field being validated), ``message`` follows the field's name."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message, self.field = message, field


# ---- value types --------------------------------------------------------------------------
def _integral(v):
    """A JSON number with no fraction (``3.0``) is the integer it spells, as in OpenAI's API."""
    return int(v) if isinstance(v, float) and math.isfinite(v) and v.is_integer() else v


def _int_as_float(v):
    """An integer too large for a float is out of every range, not of the wrong type."""
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:
            raise FieldError("is out of range (a number with more than 300 digits)") from None
    return v


def _in_vocab(t: int, info: ValidationInfo) -> int:
    vocab = (info.context or {}).get("vocab")
    if vocab is not None and t >= vocab:
        raise FieldError(f"has token id {t} outside the vocabulary [0, {vocab})")
    return t


Integer = Annotated[int, BeforeValidator(_integral)]
Number = Annotated[float, BeforeValidator(_int_as_float), Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=INT32 - 1), AfterValidator(_in_vocab)]
Text = Annotated[str, Field(min_length=1)]
Flag = Union[bool, None]


def Refused(*noop, why: str | None = None) -> Any:  # noqa: N802 - a type, spelled as one
    """A field of OpenAI's schema this server does not serve: accepted only holding one of its
    ``noop`` values (same value and JSON type), refused by name otherwise."""
    def check(v):
        if any(v == ok and type(v) is type(ok) for ok in noop):
            return v
        raise PydanticCustomError("refused", "is not supported by this server", {"why": why or ""})
    return Annotated[Any, Field(json_schema_extra={"refused": list(noop)}), AfterValidator(check)]


def is_refused(model: type[BaseModel], name: str) -> tuple | None:
    """The no-op values of a refused field, None for a served one."""
    extra = model.model_fields[name].json_schema_extra or {}
    return tuple(extra["refused"]) if "refused" in extra else None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


# ---- parts of a body ------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: Flag = None
    continuous_usage_stats: Flag = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolFunction(_Strict):
    """A tool's function: its name, and the JSON schema of its arguments."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Union[str, None] = None
    parameters: Union[dict[str, Any], None] = None
    strict: Flag = None


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class CalledFunction(_Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


class ToolCall(_Strict):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: Union[str, None] = None
    description: Union[str, None] = None
    schema_: Union[dict[str, Any], None] = Field(None, alias="schema")
    strict: Flag = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Union[JsonSchemaFormat, None] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldError("'json_schema' goes with \"type\": \"json_schema\", and only with it",
                             "response_format")
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``json_object``,
    ``regex`` or ``choice``."""

    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    json_object: Flag = None
    regex: Union[Text, None] = None
    choice: Union[Annotated[list[Text], Field(min_length=1)], None] = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_", "json_object", "regex", "choice") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise FieldError("'structured_outputs' needs exactly one of 'json', 'json_object', 'regex', 'choice'",
                             "structured_outputs")
        return self


class Message(_Strict):
    """A chat message; ``developer`` is read as ``system``.  An assistant turn may carry the
    ``tool_calls`` it made (then ``content`` may be null), a ``tool`` turn the result of one.
    The chat template has no place for a speaker's ``name`` or audio: refused, not dropped."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = Field(
        description="a string or a list of text parts (null only for an assistant's tool calls)")
    name: Refused(None) = None
    refusal: Refused(None) = None
    tool_calls: Union[list[ToolCall], None] = None
    tool_call_id: Union[str, None] = None
    reasoning_content: Union[str, None] = None  # vLLM's: an earlier turn's thought, for the template
    function_call: Refused(None) = None
    audio: Refused(None) = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError("'content' may be null only in an assistant message with 'tool_calls'", "messages")
        if self.tool_calls and self.role != "assistant":
            raise FieldError(f"'tool_calls' belong to an assistant message, not to a {self.role!r} one", "messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise FieldError("'tool_call_id' belongs to a 'tool' message, and a 'tool' message needs it", "messages")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it (Qwen3's: tool-call arguments as objects)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _json_or_text(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


def _json_or_text(text: str):
    """vLLM hands templates a call's arguments as an object when they parse as one."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


# ---- the bodies ---------------------------------------------------------------------------
PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"
Penalty = Annotated[Number, Field(ge=-2.0, le=2.0)]
Budget = Annotated[Integer, Field(ge=1, le=INT32)]


class _Generation(_Strict):
    """Fields both generation routes serve (OpenAI's and vLLM's extensions)."""

    model: str
    stream: Flag = None
    stream_options: Union[StreamOptions, None] = None
    max_tokens: Union[Budget, None] = None  # None: the server's default, cut to the room left
    temperature: Union[Annotated[Number, Field(ge=0.0, le=100.0)], None] = None
    top_p: Union[Annotated[Number, Field(gt=0.0, le=1.0)], None] = None
    seed: Union[Annotated[Integer, Field(ge=-(2 ** 63), le=2 ** 64 - 1)], None] = None
    stop: Union[Text, Annotated[list[Text], Field(max_length=MAX_STOP)], None] = Field(
        None, description="a non-empty string or a list of non-empty strings")
    n: Union[Annotated[Integer, Field(ge=1, le=MAX_N)], None] = None
    presence_penalty: Union[Penalty, None] = None
    frequency_penalty: Union[Penalty, None] = None
    logit_bias: Union[Annotated[dict[str, Annotated[Number, Field(ge=-100.0, le=100.0)]],
                                Field(max_length=MAX_LOGIT_BIAS)], None] = None
    user: Union[str, None] = None
    # vLLM's extensions
    top_k: Union[Annotated[Integer, Field(ge=-1, le=INT32)], None] = None  # -1 or 0: off
    min_p: Union[Annotated[Number, Field(ge=0.0, le=1.0)], None] = None
    repetition_penalty: Union[Annotated[Number, Field(gt=0.0, le=2.0)], None] = None
    min_tokens: Union[Annotated[Integer, Field(ge=0, le=INT32)], None] = None
    stop_token_ids: Union[Annotated[list[TokenId], Field(max_length=MAX_STOP)], None] = None
    ignore_eos: Flag = None
    skip_special_tokens: Flag = None
    return_token_ids: Flag = None

    def budget_field(self) -> str:
        return "max_tokens"

    @model_validator(mode="after")
    def _across_fields(self, info: ValidationInfo):
        if self.stream_options is not None and not self.stream:
            raise FieldError("'stream_options' is only allowed with \"stream\": true", "stream_options")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit() and len(key) < 11 and int(key) <= INT32 - 1):
                raise FieldError(f"'logit_bias' key {key[:20]!r} is not a token id in [0, {INT32})",
                                 "logit_bias")
            _in_vocab_field(int(key), info, "logit_bias")
        stops = (1 if isinstance(self.stop, str) else len(self.stop or ())) + len(self.stop_token_ids or ())
        if stops > MAX_STOP:
            raise FieldError(f"at most {MAX_STOP} stop strings and ids, got {stops}", "stop")
        key = self.budget_field()
        budget = getattr(self, key)
        if budget is not None and (self.min_tokens or 0) > budget:
            raise FieldError(f"'min_tokens' ({self.min_tokens}) must be <= '{key}' ({budget})", "min_tokens")
        return self


def _in_vocab_field(t: int, info: ValidationInfo, field: str) -> None:
    try:
        _in_vocab(t, info)
    except FieldError as e:
        raise FieldError(f"'{field}' {e.message}", field) from None


class CompletionRequest(_Generation):
    """``POST /v1/completions``."""

    prompt: Union[Text, Annotated[list[Text], Field(min_length=1)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]] = Field(
        description=PROMPT_FORMS + " (non-empty)")
    echo: Flag = None  # with echo, "max_tokens": 0 scores the prompt alone (protocol.parse_completion)
    logprobs: Union[Annotated[Integer, Field(ge=0, le=MAX_LOGPROBS)], None] = None
    suffix: Refused(None, "", why="'suffix' (insertion)") = None
    best_of: Refused(None, 1, why="'best_of' other than 1 (send 'n' for several choices)") = None

    def prompts(self) -> list:
        """The prompts, each a string or a list of ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return [p] if isinstance(p[0], int) else list(p)


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Union[Budget, None] = None
    logprobs: Flag = None
    top_logprobs: Union[Annotated[Integer, Field(ge=0, le=MAX_LOGPROBS)], None] = None
    # identifiers and hints with no effect on the output: accepted as they are
    safety_identifier: Union[str, None] = None
    prompt_cache_key: Union[str, None] = None
    # OpenAI's fields for tools, audio, structured output and the platform: no-op values only
    audio: Refused(None) = None
    function_call: Refused(None, "none") = None
    functions: Refused(None, []) = None
    tools: Union[list[Tool], None] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description='"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: Union[bool, None] = None
    # vLLM's: variables of the chat template (enable_thinking ...), over the server's defaults
    chat_template_kwargs: Union[dict[str, Any], None] = None
    modalities: Refused(None, ["text"]) = None
    moderation: Refused(None) = None
    prediction: Refused(None) = None
    reasoning_effort: Refused(None) = None
    verbosity: Refused(None) = None
    web_search_options: Refused(None) = None
    response_format: Union[ResponseFormat, None] = None
    structured_outputs: Union[StructuredOutputs, None] = None  # vLLM's
    store: Refused(None, False) = None
    metadata: Refused(None, {}) = None
    service_tier: Refused(None, "auto", "default") = None
    prompt_cache_retention: Refused(None) = None
    prompt_cache_options: Refused(None) = None

    def budget_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise FieldError("'tools' name a function twice", "tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError(f"'tool_choice' names the function {choice.function.name[:64]!r}, which is not "
                             f"in 'tools'", "tool_choice")
        if choice == "required" and not names:
            raise FieldError("'tool_choice' \"required\" needs 'tools'", "tool_choice")
        constraints = [k for k, on in (("response_format", self.response_format is not None
                                        and self.response_format.type != "text"),
                                       ("structured_outputs", self.structured_outputs is not None),
                                       ("tool_choice", choice == "required" or isinstance(choice, NamedToolChoice)))
                       if on]
        if len(constraints) > 1:
            raise FieldError(f"'{constraints[0]}' and '{constraints[1]}' each constrain the output: send one",
                             constraints[1])
        return self


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages through the template."""

    model: Union[str, None] = None
    prompt: Union[str, None] = None
    messages: Union[Annotated[list[Message], Field(min_length=1)], None] = None
    add_special_tokens: Flag = None
    tools: Union[list[Tool], None] = None
    chat_template_kwargs: Union[dict[str, Any], None] = None

    @model_validator(mode="after")
    def _one_input(self):
        if self.messages is None and self.prompt is None:
            raise FieldError("'prompt' must be a string (or send 'messages')", "prompt")
        return self


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``."""

    model: Union[str, None] = None
    tokens: Annotated[list[TokenId], Field(description="a list of token ids")]


BODIES = {"completion": CompletionRequest, "chat": ChatRequest, "tokenize": TokenizeRequest,
          "detokenize": DetokenizeRequest}
