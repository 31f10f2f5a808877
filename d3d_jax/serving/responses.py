"""Response shapes of the OpenAI-compatible API: choices, chunks, usage and log-probabilities.

Log-probabilities come in OpenAI's two shapes: completions' ``{tokens, token_logprobs,
top_logprobs, text_offset}`` (the first prompt token's entries ``null`` under ``echo``), chat's
``{content: [{token, logprob, bytes, top_logprobs}]}``.  A log-probability of a token the
request's filters removed is -inf, which JSON cannot carry: it is sent as -9999.0 (vLLM's value).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Callable

NEG_LOGPROB = -9999.0

# One token's entry: (token id, log-prob or None, [(id, log-prob)] alternatives or None)
Entry = tuple


def _lp(x) -> float:
    x = float(x)
    return x if x >= NEG_LOGPROB else NEG_LOGPROB  # -inf and nan alike


def finish_reason(reason: str | None) -> str | None:
    """The decoder's eos/stop/length (and a matched stop string) in OpenAI's vocabulary; a request
    the server ended as it shut down says "abort" (vLLM's word), never a natural stop; a chat
    choice that called a tool, "tool_calls"."""
    if reason is None:
        return None
    return reason if reason in ("length", "abort", "tool_calls") else "stop"


def completion_logprobs(entries: list[Entry], token_text: Callable[[int], str], offset: int) -> dict:
    """Completions' shape; ``offset``: where the first entry's text starts in the choice's text.
    ``top_logprobs`` holds the alternatives plus the chosen token (vLLM: up to n + 1 keys)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, top in entries:
        text = token_text(tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if lp is None else _lp(lp))
        if top is None:
            out["top_logprobs"].append(None)
        else:
            alts = {token_text(i): _lp(v) for i, v in top}
            alts.setdefault(text, _lp(lp))
            out["top_logprobs"].append(alts)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: list[Entry], token_text: Callable[[int], str]) -> dict:
    def item(tid, lp):
        text = token_text(tid)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [item(tid, lp) | {"top_logprobs": [item(i, v) for i, v in top or ()]}
                        for tid, lp, top in entries]}


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion}


def merge_spec(specs: list[dict | None]) -> dict | None:
    """One request's speculative metrics: a choice's own, or the sum over several choices."""
    specs = [s for s in specs if s]
    if len(specs) <= 1:
        return specs[0] if specs else None
    rounds = sum(s.get("rounds") or 0 for s in specs)
    acc = sum(s.get("accepted_tokens") or 0 for s in specs)
    hits, misses = sum(s.get("hits") or 0 for s in specs), sum(s.get("misses") or 0 for s in specs)
    ttft = [s["ttft_s"] for s in specs if s.get("ttft_s") is not None]
    return {"tau": (acc + rounds) / rounds if rounds else 0.0, "rounds": rounds, "accepted_tokens": acc,
            "hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else None,
            "ttft_s": min(ttft) if ttft else None,
            "latency_s": max(s.get("latency_s") or 0.0 for s in specs), "choices": len(specs)}


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

    def choice(self, index: int, text: str | None, reason: str | None = None, *, chunk: bool,
               role: bool = False, logprobs: dict | None = None, token_ids=None,
               fields: dict | None = None) -> dict:
        """``fields``: a chat message's (or delta's) own fields, in place of ``content: text``."""
        c: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            msg: dict[str, Any] = {"role": "assistant"} if role or not chunk else {}
            if fields is not None:
                msg.update(fields)
            elif text is not None:
                msg["content"] = text
            c["delta" if chunk else "message"] = msg
        else:
            c["text"] = text or ""
        c["logprobs"] = logprobs
        c["finish_reason"] = finish_reason(reason)
        if token_ids is not None:
            c["token_ids"] = list(token_ids)
        return c

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = self._envelope(True) | {"choices": choices}
        if usage is not None:  # continuous_usage_stats only
            out["usage"] = usage
        return out

    def usage_chunk(self, usage: dict, spec: dict | None) -> dict:
        """The choice-less last chunk of ``stream_options.include_usage`` (OpenAI's shape)."""
        return self._envelope(True) | {"choices": [], "usage": usage, "spec_metrics": spec}

    def full(self, choices: list[dict], usage: dict, spec: dict | None) -> dict:
        return self._envelope(False) | {"choices": choices, "usage": usage, "spec_metrics": spec}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()
