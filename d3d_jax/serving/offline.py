"""Many prompts through one decoder with its slots kept full: the scheduler's rounds on the calling
thread, no HTTP.  At most ``num_slots`` requests are in flight; the rest queue and join as slots
free (continuous batching), which is what the evaluation harness's ``--concurrency N`` measures."""

from __future__ import annotations

from typing import Sequence

from d3d_jax.decoding.contract import Decoder
from d3d_jax.serving.scheduler import Event, Scheduler


def generate(decoder: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling=None,
             seed: int = 0, stop_token_ids: Sequence[int] = (), request_cls=None,
             timeout_s: float | None = None) -> list:
    """One :class:`~d3d_jax.decoding.engine.GenerationOutput` per prompt, in order.

    ``metrics`` holds the request's τ, accept histogram (when the decoder keeps one), rounds,
    hits/misses and latency.  Request ``i`` samples with seed ``seed + i``."""
    from d3d_jax.decoding.engine import GenerationOutput
    from d3d_jax.decoding.verify import SamplingParams

    if request_cls is None:
        from d3d_jax.decoding.decoder import Request as request_cls
    sampling = sampling or SamplingParams()
    requests = [request_cls(prompt=list(p), max_new_tokens=max_new_tokens, sampling=sampling,
                            stop_token_ids=tuple(stop_token_ids), seed=seed + i)
                for i, p in enumerate(prompts)]
    for r in requests:  # every problem surfaces before any decoding starts
        decoder.validate_request(r)
    tokens: list[list[int]] = [[] for _ in requests]
    final: list[Event | None] = [None] * len(requests)

    def sink(i):
        def put(ev: Event) -> None:
            tokens[i].extend(ev.token_ids)
            if ev.finished:
                final[i] = ev
        return put

    sched = Scheduler(decoder, max_queue=max(len(requests), 1))
    for i, r in enumerate(requests):
        sched.submit(r, sink(i))
    sched.run_until_idle(timeout_s)
    failed = [(i, ev.error) for i, ev in enumerate(final) if ev is None or ev.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: #{failed[0][0]}: {failed[0][1]}")
    return [GenerationOutput(token_ids=t, finish_reason=ev.finish_reason, metrics=dict(ev.metrics or {}))
            for t, ev in zip(tokens, final)]
