"""A chat choice's text split into the message's fields: ``reasoning_content``, ``content`` and
``tool_calls``, delta by delta (streams) and in total (whole responses).

The thought is split off first (:mod:`~d3d_jax.serving.reasoning`); tool calls are parsed from
what is left (:mod:`~d3d_jax.serving.tools`), so a ``<tool_call>`` written while thinking stays
part of the thought.  A choice that called a tool finishes with ``"tool_calls"`` (vLLM, OpenAI).
"""

from __future__ import annotations

import dataclasses

from d3d_jax.serving.reasoning import Qwen3Reasoning
from d3d_jax.serving.tools import HermesTools, tool_call


@dataclasses.dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutput:
    """``reasoning``: a :class:`Qwen3Reasoning` (None: no reasoning parser); ``tools``: whether
    tool calls are parsed (the request offered tools and did not say ``tool_choice: "none"``)."""

    def __init__(self, reasoning: Qwen3Reasoning | None, tools: bool, forced=None):
        """``forced``: the request's ``tool_choice`` when a grammar makes the output the calls
        themselves (``"required"`` or ``{"name": ...}``), sent once the output is whole."""
        self.reasoning = reasoning
        self.tools = HermesTools() if tools and forced is None else None
        self.forced, self._held = forced, ""
        self.total = Delta()
        self._n_calls = 0

    def push(self, text: str, final: bool = False) -> Delta:
        r, c = self.reasoning.push(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            r2, c2 = self.reasoning.flush()
            r, c = r + r2, c + c2
        calls: list = []
        if self.forced is not None:
            self._held, c = self._held + c, ""
            if final:
                from d3d_jax.serving.structured import forced_calls

                found = forced_calls(self._held, self.forced)
                c, calls = (self._held, []) if found is None else ("", [tool_call(f) for f in found])
        elif self.tools is not None:
            c, calls = self.tools.push(c)
            if final:
                c2, calls2 = self.tools.flush()
                c, calls = c + c2, calls + calls2
        out = Delta(r, c, [dict(call, index=self._n_calls + i) for i, call in enumerate(calls)])
        self._n_calls += len(calls)
        self.total.reasoning += r
        self.total.content += c
        self.total.tool_calls += calls
        return out

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.had_reasoning

    def finish_reason(self, reason: str | None) -> str | None:
        natural = reason is not None and reason not in ("length", "abort")
        return "tool_calls" if self.total.tool_calls and natural else reason

    def message(self) -> dict:
        """The whole message's fields (OpenAI: content null when there is none)."""
        t = self.total
        out: dict = {"content": t.content if t.content or not (t.tool_calls or self.has_reasoning) else None}
        if self.has_reasoning:
            out["reasoning_content"] = t.reasoning or None
        if t.tool_calls:
            out["tool_calls"] = t.tool_calls
        return out

    def delta(self, d: Delta) -> dict:
        """A stream chunk's delta fields (only those with something new)."""
        out: dict = {}
        if d.reasoning:
            out["reasoning_content"] = d.reasoning
        if d.content:
            out["content"] = d.content
        if d.tool_calls:
            out["tool_calls"] = d.tool_calls
        return out
