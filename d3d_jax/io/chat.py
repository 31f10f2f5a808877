"""Prompt lines in the common chat formats, reduced to what the target must answer, and the chat
template that renders them (regeneration, training data, evaluation and the server all read prompts
through this module, which is why it is in ``io/`` rather than ``training/``).

Formats, one JSON object a line: ``{"messages": [{role, content}...]}`` (content may be OpenAI-style
text parts), ShareGPT ``{"conversations": [{from, value}...]}`` (human/gpt/system, as
Open-PerfectBlend uses), or ``{"prompt": str | messages, "system": str}``.

* **User side** = every system/user turn up to the first assistant answer.  Later turns are
  dropped: they were written in reply to the *original* answer, which the target replaces, so
  keeping them would train on a conversation the target never had.  (One prompt per line, one
  response per prompt.)
* **Ids**: the line's ``id`` field; without one, ``h`` + 16 hex digits of the SHA-256 of the
  user-side messages (a repeated identical prompt gets ``-1``, ``-2``… so nothing is merged).
  A repeated explicit id is reported as malformed: records are keyed by id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Sequence

from d3d_jax.errors import RecordError
from d3d_jax.io.records import decode_line, jsonl_lines

ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant",
    "bot": "assistant",
}


class MalformedPrompt(RecordError):
    """A prompt line that cannot be used; the message says why (it goes into the summary)."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict]  # user side only: [{"role": "system"|"user", "content": str}, ...]
    line: int  # 1-based line number in the prompt file


def content_text(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI-style parts ``[{"type": "text", "text": ...}]``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
    raise MalformedPrompt(f"{where}: content must be a string or text parts, got {type(content).__name__}")


def _turn_list(turns: Any, key: str, role_key: str, text_key: str) -> list[tuple[str, str]]:
    """``[(role, text)]`` from a list of ``{role_key, text_key}`` objects named ``key`` in errors."""
    if not isinstance(turns, list):
        raise MalformedPrompt(f"'{key}' must be a list of {{{role_key}, {text_key}}}")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or role_key not in t or text_key not in t:
            raise MalformedPrompt(f"{key}[{i}] must be an object with '{role_key}' and '{text_key}'")
        out.append((t[role_key], content_text(t[text_key], f"{key}[{i}]")))
    return out


def _turns(obj: dict) -> list[tuple[str, str]]:
    """(raw role, text) turns of a line in any supported format."""
    if "messages" in obj or ("prompt" in obj and isinstance(obj["prompt"], list)):
        key = "messages" if "messages" in obj else "prompt"
        return _turn_list(obj[key], key, "role", "content")
    if "conversations" in obj:
        return _turn_list(obj["conversations"], "conversations", "from", "value")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise MalformedPrompt("'prompt' must be a string or a list of messages")
        turns = []
        if "system" in obj:
            if not isinstance(obj["system"], str):
                raise MalformedPrompt("'system' must be a string")
            turns.append(("system", obj["system"]))
        return turns + [("user", obj["prompt"])]
    raise MalformedPrompt("no 'messages', 'conversations' or 'prompt' field")


def user_side(obj: dict) -> list[dict]:
    """System and user turns up to the first assistant answer (see the module docstring)."""
    kept = []
    for raw_role, text in _turns(obj):
        role = ROLE_ALIASES.get(str(raw_role).lower()) if isinstance(raw_role, str) else None
        if role == "assistant":
            break
        if role is None:
            raise MalformedPrompt(f"unsupported role {raw_role!r} before the first assistant answer")
        kept.append({"role": role, "content": text})
    if not any(m["role"] == "user" and m["content"].strip() for m in kept):
        raise MalformedPrompt("no non-empty user turn before the first assistant answer")
    return kept


def content_id(messages: Sequence[dict]) -> str:
    canon = json.dumps(list(messages), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "h" + hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def read_prompts(path: str | os.PathLike) -> tuple[list[Prompt], list[tuple[int, str]]]:
    """Every usable prompt of a JSONL file, and ``(line, reason)`` for each malformed line.

    Blank lines are not prompts and are ignored; every other line is either a prompt or listed.
    """
    prompts: list[Prompt] = []
    malformed: list[tuple[int, str]] = []
    first_line_of: dict[str, int] = {}
    repeats: dict[str, int] = {}
    for line_no, raw in jsonl_lines(path):
        try:
            obj = decode_line(raw)
            if not isinstance(obj, dict):
                raise MalformedPrompt(f"a line must be a JSON object, got {type(obj).__name__}")
            messages = user_side(obj)
            pid = obj.get("id")
            if pid is not None:
                if isinstance(pid, bool) or not isinstance(pid, (str, int)) or str(pid) == "":
                    raise MalformedPrompt(f"'id' must be a non-empty string or an integer, got {pid!r}")
                pid = str(pid)
            else:
                base = content_id(messages)
                n = repeats.get(base, 0)
                repeats[base] = n + 1
                pid = base if n == 0 else f"{base}-{n}"
            if pid in first_line_of:
                raise MalformedPrompt(f"duplicate id {pid!r} (first on line {first_line_of[pid]})")
        except RecordError as e:  # MalformedPrompt, or a line that is not UTF-8 JSON
            malformed.append((line_no, str(e)))
            continue
        first_line_of[pid] = line_no
        prompts.append(Prompt(pid, messages, line_no))
    return prompts, malformed


NON_THINKING = {"enable_thinking": False}  # the default: the drafters learn non-thinking responses


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    **template_kwargs) -> list[int]:
    """Token ids of ``messages`` + the assistant header, tokenized by the template itself (the
    server, evaluation and the demo's pretraining rows): non-thinking mode (Qwen3's template)
    unless ``template_kwargs`` set ``enable_thinking``; ``tools`` for a template that lists them."""
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                        add_generation_prompt=True, **{**NON_THINKING, **template_kwargs})
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def render_prompt(tokenizer, messages: Sequence[dict], template_kwargs: dict | None = None) -> list[int]:
    """The ids regeneration and the training data read prompts by: :func:`chat_prompt_ids` (the
    template tokenizes a rendered prompt without adding special tokens, as rendering then
    tokenizing did), ``template_kwargs`` passed to the template."""
    return chat_prompt_ids(tokenizer, list(messages), **(template_kwargs or {}))
