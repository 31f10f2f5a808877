"""Tool calls in Qwen3's output, parsed into OpenAI's ``tool_calls`` as vLLM's ``hermes`` parser does.

Qwen3 calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(its chat template tells it to).  Text before the first ``<tool_call>`` is the message's
content; each complete tag whose body is a JSON object with a string ``name`` and an object
``arguments`` becomes one call (``arguments`` re-serialised as the JSON string OpenAI sends);
text between or after calls is dropped, as vLLM drops it.  A body that does not parse is not
lost: it goes out as content, tags and all.  A stream holds back only the text that could still
become a tag, and sends each call whole once its ``</tool_call>`` arrived.
"""

from __future__ import annotations

import json
import uuid

from d3d_jax.serving.reasoning import held_prefix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


def as_call(body: str) -> dict | None:
    """``{"name", "arguments"}`` (arguments a JSON string) from a tag's body, None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}


def tool_call(function: dict) -> dict:
    """One entry of a message's ``tool_calls``."""
    return {"id": call_id(), "type": "function", "function": function}


class HermesTools:
    """Content deltas in, ``(content, [tool_call])`` deltas out."""

    def __init__(self):
        self._buf = ""
        self._calling = False  # the first <tool_call> was seen: text outside calls is dropped
        self.calls: list[dict] = []

    def push(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        content, calls = "", []
        while True:
            if not self._calling:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = held_prefix(self._buf, OPEN)
                    content += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content, self._buf, self._calling = content + self._buf[:i], self._buf[i:], True
            start = self._buf.find(OPEN)
            if start < 0:  # text after a call that opens no other: dropped, as vLLM drops it
                self._buf = self._buf[len(self._buf) - held_prefix(self._buf, OPEN):]
                break
            end = self._buf.find(CLOSE, start)
            if end < 0:
                self._buf = self._buf[start:]
                break
            body, raw = self._buf[start + len(OPEN):end], self._buf[start:end + len(CLOSE)]
            self._buf = self._buf[end + len(CLOSE):]
            function = as_call(body)
            if function is None:
                content += raw
            else:
                calls.append(tool_call(function))
        self.calls += calls
        return content, calls

    def flush(self) -> tuple[str, list[dict]]:
        """An unclosed ``<tool_call>`` at the end: a call if its body parses, else content."""
        rest, self._buf = self._buf, ""
        if self._calling and rest.startswith(OPEN):
            function = as_call(rest[len(OPEN):])
            if function is not None:
                self.calls.append(tool_call(function))
                return "", [self.calls[-1]]
            return rest, []
        return ("" if self._calling else rest), []
