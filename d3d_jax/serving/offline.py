"""Many prompts through one decoder with its slots kept full: the scheduler's rounds on the calling
thread, no HTTP.  At most ``num_slots`` requests are in flight; the rest queue and join as slots
free (continuous batching), which is what the evaluation harness's ``--concurrency N`` measures and
what data regeneration runs (:func:`finished_rounds`, records written as each request ends)."""

from __future__ import annotations

import itertools
import time
from typing import Iterable, Iterator, Sequence

from d3d_jax.decoding.contract import Decoder
from d3d_jax.serving.scheduler import Event, Scheduler


def generate(decoder: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling=None,
             seed: int = 0, stop_token_ids: Sequence[int] = (), request_cls=None,
             timeout_s: float | None = None) -> list:
    """One :class:`~d3d_jax.decoding.engine.GenerationOutput` per prompt, in order.

    ``metrics`` holds the request's τ, accept histogram (when the decoder keeps one), rounds,
    hits/misses and latency.  Request ``i`` samples with seed ``seed + i``."""
    from d3d_jax.decoding.verify import SamplingParams

    if request_cls is None:
        from d3d_jax.decoding.decoder import Request as request_cls
    sampling = sampling or SamplingParams()
    requests = [request_cls(prompt=list(p), max_new_tokens=max_new_tokens, sampling=sampling,
                            stop_token_ids=tuple(stop_token_ids), seed=seed + i)
                for i, p in enumerate(prompts)]
    for r in requests:  # every problem surfaces before any decoding starts
        decoder.validate_request(r)
    outputs: list = [None] * len(requests)
    failed = []
    for finished in finished_rounds(decoder, requests, timeout_s=timeout_s):
        for i, out, error in finished:
            outputs[i] = out
            if error:
                failed.append((i, error))
    if failed:
        failed.sort()
        raise RuntimeError(f"{len(failed)} requests failed, first: #{failed[0][0]}: {failed[0][1]}")
    return outputs


def finished_rounds(decoder: Decoder, requests: Iterable, *,
                    timeout_s: float | None = None) -> Iterator[list[tuple[int, object, str | None]]]:
    """Drive the scheduler's rounds over ``requests`` on this thread; after each round that ended
    some, yield them as ``(i, GenerationOutput, error)`` (``i``: the request's position in
    ``requests``; ``error``: why it failed, else None).

    Requests are drawn as slots free, the queue kept one round's admissions deep: every slot is
    busy while requests remain, a finished row's slot goes to the next request at the next round,
    and a generator of a million requests is never held whole.  Closing the iterator early (the
    caller stopped or raised) ends the requests still running and frees their slots."""
    from d3d_jax.decoding.engine import GenerationOutput

    slots = int(decoder.config.num_slots)
    sched = Scheduler(decoder, max_queue=slots + 1)
    source = iter(enumerate(requests))
    tokens: dict[int, list[int]] = {}
    done: list = []

    def sink(i: int):
        def put(ev: Event) -> None:
            tokens[i].extend(ev.token_ids)
            if ev.finished:
                done.append((i, GenerationOutput(tokens.pop(i), ev.finish_reason, dict(ev.metrics or {})),
                             ev.error))
        return put

    t_end = None if timeout_s is None else time.monotonic() + timeout_s
    more = True  # the source may hold more requests
    try:
        while True:
            want = max(0, slots - sched.num_queued) if more else 0
            new = list(itertools.islice(source, want))
            more = more and len(new) == want
            for i, r in new:
                tokens[i] = []
                sched.submit(r, sink(i))
            sched.run_round()
            if done:
                yield list(done)
                done.clear()
            if not tokens and not more:
                return
            if t_end is not None and time.monotonic() > t_end:
                raise TimeoutError(f"requests still running after {timeout_s} s")
    finally:
        if sched.num_active or sched.num_queued:
            sched.drain()  # the next round ends every request and frees its slot
            sched.run_round()
