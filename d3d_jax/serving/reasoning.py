"""Qwen3's thought, separated from the answer as vLLM's ``qwen3`` reasoning parser does.

Qwen3 thinks between ``<think>`` and ``</think>``; the response carries that text in
``reasoning_content`` and the rest in ``content``.  Whether the output starts inside a thought
is read from the prompt, as vLLM's streaming path does (``is_reasoning_end``): a prompt whose
last think tag is ``</think>`` (the empty block the template adds for ``enable_thinking=False``)
has ended the reasoning, so the whole output is content.  Otherwise the output is reasoning up
to its first ``</think>`` (a ``<think>`` the model writes itself is dropped; a template that put
it in the prompt leaves only the end tag to find), and content after it; an output cut before
``</think>`` is all reasoning.  One state machine serves streams and whole responses, so the
concatenated deltas always equal the whole response's fields.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def prompt_ends_reasoning(prompt_text: str) -> bool:
    """True when the prompt's last think tag closes a thought (or opens none and ends one)."""
    return prompt_text.rfind(END) > prompt_text.rfind(START)


def think_tags(tokenizer) -> dict[int, str]:
    """The think tags that are single tokens, by id: a tokenizer that marks them special (the
    demo's does; Qwen3's does not) would drop them from the text the parser reads."""
    out = {}
    for tag in (START, END):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) == 1:
            out[ids[0]] = tag
    return out


def held_prefix(text: str, *tags: str) -> int:
    """Length of the longest end of ``text`` that could begin one of ``tags``: held back
    until the next delta shows whether the tag follows."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class Qwen3Reasoning:
    """Text deltas in, ``(reasoning, content)`` deltas out."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self._buf = ""
        self._opened = False  # a <think> was seen (and dropped)
        self.had_reasoning = in_reasoning  # the response carries reasoning_content (maybe empty)

    def push(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        self._buf += text
        if not self._opened:
            i = self._buf.find(START)
            end = self._buf.find(END)
            if i >= 0 and (end < 0 or i < end):
                self._buf, self._opened = self._buf[:i] + self._buf[i + len(START):], True
        end = self._buf.find(END)
        if end >= 0:
            reasoning, content = self._buf[:end], self._buf[end + len(END):]
            self._buf, self.in_reasoning = "", False
            return reasoning, content
        keep = held_prefix(self._buf, END) if self._opened else held_prefix(self._buf, START, END)
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out, ""

    def flush(self) -> tuple[str, str]:
        """At the end of the output: a thought never closed is all reasoning (cut short)."""
        out, self._buf = self._buf, ""
        return out, ""
