"""A chat request's output constraint as a grammar (:class:`~d3d_jax.decoding.grammar.GrammarSpec`),
as vLLM builds it: ``response_format`` ``json_object`` / ``json_schema``, vLLM's
``structured_outputs`` (``json``, ``json_object``, ``regex``, ``choice``), and the tool choices
the output must obey: a named function (the output is its arguments, an object valid against the
function's ``parameters``) or ``"required"`` (a JSON array of ``{"name", "parameters"}`` calls
of the offered functions, at least one; exactly one with ``parallel_tool_calls: false``).
"""

from __future__ import annotations

import json

from d3d_jax.decoding.grammar import GrammarSpec
from d3d_jax.serving import schema as S

ANY_OBJECT = {"type": "object"}


def _parameters(tool: S.Tool) -> dict:
    return tool.function.parameters or ANY_OBJECT


def spec_of(req: S.ChatRequest) -> tuple[GrammarSpec | None, str | None]:
    """(the grammar, the field it came from) for a validated chat body; (None, None) without one."""
    rf, so, choice = req.response_format, req.structured_outputs, req.tool_choice
    if rf is not None and rf.type == "json_object":
        return GrammarSpec("json_object"), "response_format"
    if rf is not None and rf.type == "json_schema":
        return GrammarSpec("json_schema", rf.json_schema.schema_ or ANY_OBJECT), "response_format"
    if so is not None:
        if so.json_ is not None:
            schema = so.json_ if isinstance(so.json_, dict) else _json_text(so.json_)
            return GrammarSpec("json_schema", schema), "structured_outputs"
        if so.json_object:
            return GrammarSpec("json_object"), "structured_outputs"
        if so.regex is not None:
            return GrammarSpec("regex", so.regex), "structured_outputs"
        return GrammarSpec("choice", tuple(so.choice)), "structured_outputs"
    if isinstance(choice, S.NamedToolChoice):
        tool = next(t for t in req.tools if t.function.name == choice.function.name)
        return GrammarSpec("json_schema", _parameters(tool)), "tool_choice"
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in req.tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if req.parallel_tool_calls is False:  # OpenAI: at most one call
            array["maxItems"] = 1
        return GrammarSpec("json_schema", array), "tool_choice"
    return None, None


def _json_text(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise S.FieldError(f"'structured_outputs.json' is not JSON ({e})", "structured_outputs") from None
    if not isinstance(value, dict):
        raise S.FieldError("'structured_outputs.json' must be a JSON schema object", "structured_outputs")
    return value


def forced_calls(text: str, tool_choice) -> list[dict] | None:
    """The tool calls a constrained output spells: a named function's arguments, or
    ``"required"``'s array; None if the text is not one (the output was cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(tool_choice, dict):
        return [{"name": tool_choice["name"], "arguments": json.dumps(value, ensure_ascii=False)}]
    if not isinstance(value, list):
        return None
    return [{"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)} for c in value]
