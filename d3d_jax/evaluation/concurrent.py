"""``--concurrency N`` for the evaluation harness: every benchmark driven through one long-lived
decoder per mode with N requests in flight (continuous batching), instead of batch 1.

Turns are run in waves: all first turns together, then all second turns (a later turn needs the
answer to the one before).  A wave's wall time is billed to the mode, so time per output token is
that of the whole loaded decoder, which is what a server sees at N concurrent requests.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence


def make_generate_fn(target, drafter, settings, eos_token_ids: Sequence[int], *,
                     decoder_factory: Callable | None = None, request_cls=None) -> Callable:
    """``fn(prompts, mode) -> [GenerationOutput]``; one decoder per mode, built on first use.

    ``decoder_factory(mode) -> decoder`` replaces the SpecDecoder (tests)."""
    from d3d_jax.serving import offline

    decoders: dict = {}

    def build(mode):
        from d3d_jax.decoding.decoder import SpecDecoder
        from d3d_jax.decoding.decoder_config import decoder_config

        cfg = decoder_config(mode, num_slots=settings.concurrency, max_cache_len=settings.max_cache_len,
                             block_size=settings.block_size, eos_token_ids=tuple(eos_token_ids),
                             **{"async": settings.async_options,
                                "auto": getattr(settings, "auto_options", {})}.get(mode, {}))
        return SpecDecoder(target, None if mode == "plain" else drafter, cfg)

    def fn(prompts, mode):
        if mode not in decoders:
            decoders[mode] = (decoder_factory or build)(mode)
        return offline.generate(decoders[mode], prompts, max_new_tokens=settings.max_new_tokens,
                                request_cls=request_cls)

    fn.concurrency = settings.concurrency
    return fn


def run_mode(generate_fn: Callable, tokenizer, samples, mode: str, encode_fn: Callable):
    """:func:`~d3d_jax.evaluation.benchmarks.run_mode` with the turns of all samples in flight.

    One untimed wave as wide as the decoder compiles first: as its requests finish, the rounds
    pass through every window width the timed waves use (one program per width)."""
    from d3d_jax.evaluation.benchmarks import ModeRun

    conversations: list[list[dict]] = [[] for _ in samples]
    outputs: list[list] = [[None] * len(s.turns) for s in samples]
    firsts = [encode_fn(tokenizer, [{"role": "user", "content": s.turns[0]}]) for s in samples]
    generate_fn(firsts[: getattr(generate_fn, "concurrency", 1)], mode)
    seconds = 0.0
    for t in range(max((len(s.turns) for s in samples), default=0)):
        idx = [i for i, s in enumerate(samples) if len(s.turns) > t]
        for i in idx:
            conversations[i].append({"role": "user", "content": samples[i].turns[t]})
        prompts = [encode_fn(tokenizer, conversations[i]) for i in idx]
        t0 = time.perf_counter()
        outs = generate_fn(prompts, mode)
        seconds += time.perf_counter() - t0
        for i, out in zip(idx, outs):
            outputs[i][t] = out
            conversations[i].append({"role": "assistant",
                                     "content": tokenizer.decode(out.token_ids, skip_special_tokens=True)})
    flat = [o for per in outputs for o in per]
    drop = () if mode in ("async", "auto") else ("hits", "misses", "hit_rate")  # no branch pack
    metrics = [{k: v for k, v in (o.metrics or {}).items() if k not in drop} for o in flat]
    return ModeRun(mode, [list(o.token_ids) for o in flat], seconds, metrics)
