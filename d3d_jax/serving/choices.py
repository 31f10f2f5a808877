"""One API request as several decoder requests: a choice per (prompt, n), streamed or collected.

Choice ``k = prompt index x n + j`` is its own decoder request (its own slot) sampling with seed
:func:`~d3d_jax.serving.protocol.choice_seed` ``(seed, k)``, so it equals the same prompt sent
alone with that seed.  Every choice's events arrive on one queue, tagged with the choice index.
Usage counts each prompt once and every choice's tokens, and is sent exactly once: in the
response, or (streams) in the extra final chunk of ``stream_options.include_usage`` (plus a
running count in every chunk with ``continuous_usage_stats``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any, AsyncIterator, Callable

from d3d_jax.serving import protocol as P
from d3d_jax.serving import responses as R
from d3d_jax.serving.chat_output import ChatOutput
from d3d_jax.serving.reasoning import Qwen3Reasoning, prompt_ends_reasoning, think_tags
from d3d_jax.serving.scheduler import Event, Handle, _request_metrics
from d3d_jax.serving.textstream import TextStream

DISCONNECT_POLL_S = 0.25


@dataclasses.dataclass
class Choice:
    index: int
    prompt: int  # index of its prompt
    request: Any  # the decoder request
    text: TextStream
    handle: Handle | None = None
    entries: list = dataclasses.field(default_factory=list)  # (id, log-prob, alternatives) per token
    sent_tokens: int = 0  # tokens whose ids/log-probs went out
    offset: int = 0  # completions' text_offset of the next token
    done: bool = False
    reason: str | None = None
    spec: dict | None = None
    t_last: float | None = None
    chat: ChatOutput | None = None  # chat: the text split into reasoning, content and tool calls

    def take(self, ev: Event) -> str:
        if ev.logprobs is not None:
            self.entries += [(t, lp, top) for t, (lp, top) in zip(ev.token_ids, ev.logprobs)]
        return self.text.push(ev.token_ids)


@dataclasses.dataclass
class Run:
    """One admitted API request: its choices and what its responses are built from."""

    svc: Any
    fmt: R.Formatter
    params: P.GenParams
    prompts: list[list[int]]
    prompt_texts: list[str]
    choices: list[Choice]
    queue: asyncio.Queue
    prompt_entries: list | None = None  # echo + logprobs: per prompt
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    @staticmethod
    def create(svc, parsed: P.ParsedRequest, prompts: list[list[int]]) -> "Run":
        p = parsed.params
        base = p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little")
        texts = [pr if isinstance(pr, str) else svc.tokenizer.decode(ids)
                 for pr, ids in zip(parsed.prompts or [None], prompts)]
        choices = []
        for i, ids in enumerate(prompts):
            if p.max_tokens == 0:  # echo only: the prompt is scored, nothing is decoded
                P.resolve_max_tokens(len(ids), dataclasses.replace(p, max_tokens=None), svc.limits)
            for j in range(p.n):
                k = i * p.n + j
                request = None if p.max_tokens == 0 else svc.build(p, ids, P.choice_seed(base, k))
                chat = chat_output(svc, parsed, ids)
                keep = think_tags(svc.tokenizer) if chat is not None and chat.has_reasoning else None
                ts = TextStream(svc.tokenizer, ids, p.stop, p.skip_special_tokens, p.min_tokens, keep)
                choices.append(Choice(k, i, request, ts, done=request is None,
                                      reason="length" if request is None else None, chat=chat))
        return Run(svc, R.Formatter(parsed.kind, svc.model_name), p, prompts, texts, choices,
                   asyncio.Queue())

    # ---- scheduler side
    def submit(self, scheduler) -> None:
        loop = asyncio.get_running_loop()
        for c in self.choices:
            if c.request is not None:
                c.handle = scheduler.submit(c.request, _sink(loop, self.queue, c.index))

    def cancel(self) -> None:
        for c in self.choices:
            if c.handle is not None:
                c.handle.cancel()  # no-op when finished; frees the slot next round otherwise

    # ---- responses
    def token_text(self) -> Callable[[int], str]:
        tok, cache = self.svc.tokenizer, {}

        def text(t: int) -> str:
            if t not in cache:
                cache[t] = tok.decode([t])
            return cache[t]
        return text

    def n_completion(self) -> int:
        return sum(c.text.n_tokens for c in self.choices)

    def usage(self) -> dict:
        return R.usage(sum(len(ids) for ids in self.prompts), self.n_completion())

    def spec(self) -> dict | None:
        return R.merge_spec([c.spec if c.spec is not None else
                             (_request_metrics(c.handle, None) if c.handle is not None else None)
                             for c in self.choices])

    def echo_prefix(self, c: Choice) -> tuple[str, list]:
        """Completions with ``echo``: the prompt's text and (with logprobs) its entries."""
        if not self.params.echo:
            return "", []
        entries = self.prompt_entries[c.prompt] if self.prompt_entries is not None else []
        return self.prompt_texts[c.prompt], entries

    def logprobs(self, *segments: tuple[list, int]) -> dict | None:
        """The choice's log-probs object for ``(entries, text offset of the first)`` segments."""
        if self.params.logprobs is None:
            return None
        token_text = self.token_text()
        if self.fmt.kind == "chat":
            return R.chat_logprobs([e for entries, _ in segments for e in entries], token_text)
        parts = [R.completion_logprobs(entries, token_text, start) for entries, start in segments]
        return {key: [v for part in parts for v in part[key]] for key in parts[0]}

    def new_entries(self, c: Choice) -> tuple[list, list[int]]:
        """Log-prob entries and ids of the tokens consumed since the last chunk (cut at a stop)."""
        lo, hi = c.sent_tokens, c.text.n_tokens
        c.sent_tokens = hi
        return c.entries[lo:hi], c.text.output_ids[lo:hi]

    def finish(self, c: Choice, ev: Event | None) -> None:
        c.done = True
        c.reason = "stop" if c.text.stopped else (ev.finish_reason if ev and ev.finished else "stop")
        if ev is not None and ev.metrics:
            c.spec = ev.metrics
        if c.handle is not None:
            c.handle.cancel()

    def reason(self, c: Choice) -> str | None:
        """The finish reason: "tool_calls" for a chat choice that called a tool."""
        return c.chat.finish_reason(c.reason) if c.chat is not None else c.reason

    def record(self, c: Choice, n_new: int) -> None:
        """TTFT, inter-token latency (a round's tokens share its interval) and end to end."""
        if n_new <= 0:
            return
        now = time.perf_counter()
        m = self.svc.scheduler.metrics
        if c.t_last is None:
            m.observe("time_to_first_token_seconds", now - self.t0)
            n_new -= 1
        if n_new > 0:
            gap = (now - (c.t_last or now)) / n_new
            for _ in range(n_new):
                m.observe("inter_token_latency_seconds", gap)
        c.t_last = now


def chat_output(svc, parsed: P.ParsedRequest, prompt_ids: list[int]) -> ChatOutput | None:
    """The parsers a chat choice's text goes through: the thought (unless the prompt already
    ended it) and, when the request offered tools, their calls."""
    if parsed.kind != "chat":
        return None
    reasoning = None
    if svc.reasoning_parser == "qwen3":
        reasoning = Qwen3Reasoning(not prompt_ends_reasoning(svc.tokenizer.decode(prompt_ids)))
    forced = parsed.tool_choice if parsed.tool_choice == "required" or isinstance(parsed.tool_choice, dict) else None
    return ChatOutput(reasoning, svc.tool_call_parser == "hermes" and parsed.tool_choice == "auto", forced)


def _sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int) -> Callable[[Event], None]:
    def put(ev: Event) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (index, ev))
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    return put


def merge(ev: Event, later: list[Event]) -> Event:
    """``ev`` plus the choice's events that were already waiting: when the event loop falls
    behind the decoder, a client gets one chunk with several rounds' tokens."""
    for nxt in later:
        lps = None if ev.logprobs is None and nxt.logprobs is None else (ev.logprobs or []) + (nxt.logprobs or [])
        ev = Event(ev.token_ids + nxt.token_ids, nxt.finished, nxt.finish_reason, nxt.metrics, nxt.error, lps)
    return ev


async def events(run: Run, http) -> AsyncIterator[tuple[int, Event]]:
    """(choice, event) until every choice finished; stops early when the client disconnects."""
    open_ = {c.index for c in run.choices if not c.done}
    while open_:
        try:
            first = await asyncio.wait_for(run.queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                return
            continue
        waiting = [first]
        while not run.queue.empty():
            waiting.append(run.queue.get_nowait())
        for index in dict.fromkeys(i for i, _ in waiting):
            evs = [e for i, e in waiting if i == index]
            ev = merge(evs[0], evs[1:])
            if index in open_:
                yield index, ev
                if ev.finished or ev.error or run.choices[index].done:
                    open_.discard(index)


def _error(ev: Event) -> P.ApiError:
    exhausted = "RESOURCE_EXHAUSTED" in ev.error or "MemoryError" in ev.error
    return P.ApiError(ev.error, status=503 if exhausted else 500, type="server_error")


async def stream(run: Run, http) -> AsyncIterator[bytes]:
    fmt, p = run.fmt, run.params
    try:
        first = []
        for c in run.choices:
            text, entries = run.echo_prefix(c)
            if fmt.kind == "chat":
                first.append(fmt.choice(c.index, "", chunk=True, role=True))
            elif text or entries:
                first.append(fmt.choice(c.index, text, chunk=True, logprobs=run.logprobs((entries, 0))))
                c.offset = len(text)
        if first:
            yield R.sse(fmt.chunk(first, run.usage() if p.continuous_usage else None))
        for c in run.choices:
            if c.done:  # echo only (max_tokens 0)
                yield R.sse(fmt.chunk([fmt.choice(c.index, "", c.reason, chunk=True)]))
        async for index, ev in events(run, http):
            if ev.error:
                yield R.sse(_error(ev).body())
                return
            c = run.choices[index]
            before = c.text.n_tokens
            text = c.take(ev)
            run.record(c, c.text.n_tokens - before)
            if c.text.stopped or ev.finished:
                text += c.text.flush()
                run.finish(c, ev)
            entries, ids = run.new_entries(c)
            fields = c.chat.delta(c.chat.push(text, final=c.done)) if c.chat is not None else None
            if (fields if c.chat is not None else text) or ids or c.done:
                lp = run.logprobs((entries, c.offset))
                c.offset += sum(len(t) for t in (lp or {}).get("tokens", []))
                choice = fmt.choice(index, text, run.reason(c) if c.done else None, chunk=True, logprobs=lp,
                                    token_ids=ids if p.return_token_ids else None, fields=fields)
                yield R.sse(fmt.chunk([choice], run.usage() if p.continuous_usage else None))
        if not all(c.done for c in run.choices):
            return  # client gone: nothing more to send
        run.svc.scheduler.metrics.observe("e2e_request_latency_seconds", time.perf_counter() - run.t0)
        if p.include_usage:
            yield R.sse(fmt.usage_chunk(run.usage(), run.spec()))
        yield R.sse("[DONE]")
    finally:
        run.cancel()


async def collect(run: Run, http) -> dict | None:
    texts = {c.index: "" for c in run.choices}
    try:
        async for index, ev in events(run, http):
            if ev.error:
                raise _error(ev)
            c = run.choices[index]
            before = c.text.n_tokens
            texts[index] += c.take(ev)
            run.record(c, c.text.n_tokens - before)
            if c.text.stopped or ev.finished:
                texts[index] += c.text.flush()
                run.finish(c, ev)
        if not all(c.done for c in run.choices):
            return None  # client gone
    finally:
        run.cancel()
    run.svc.scheduler.metrics.observe("e2e_request_latency_seconds", time.perf_counter() - run.t0)
    choices = []
    for c in run.choices:
        prefix, prompt_entries = run.echo_prefix(c)
        entries, ids = c.entries[:c.text.n_tokens], c.text.output_ids[:c.text.n_tokens]
        lp = run.logprobs((prompt_entries, 0), (entries, len(prefix)))
        fields = None
        if c.chat is not None:
            c.chat.push(texts[c.index], final=True)
            fields = c.chat.message()
        choices.append(run.fmt.choice(c.index, prefix + texts[c.index], run.reason(c), chunk=False, logprobs=lp,
                                      token_ids=ids if run.params.return_token_ids else None, fields=fields))
    return run.fmt.full(choices, run.usage(), run.spec())
