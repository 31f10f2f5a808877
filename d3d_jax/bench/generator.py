"""For benchmarks and tests that try many shapes: a :class:`Generator` the caller keeps holds one
decoder per (target, drafter, config), built on first use, so each compiles its programs once.

    gen = Generator()
    outs = gen(target, prompts, mode="sync", drafter=drafter, max_new_tokens=64, batch_size=4)

Arguments are ``engine.make_decoder``'s (``batch_size`` is ``num_slots``, default: every prompt
at once; ``max_cache_len`` default: what the call needs) and ``engine.generate``'s, plus
``timeline=[...]`` (async rounds timed by :class:`~d3d_jax.bench.timeline.AsyncTimeline`, one
dict per round appended) and ``loop="host"`` (drafting and verifying timed apart).
"""

from __future__ import annotations

from d3d_jax.decoding import engine

GENERATE_ARGS = ("sampling", "max_new_tokens", "eos_token_ids", "stop_token_ids", "seed",
                 "row_seeds", "hook", "timer", "clock")


class Generator:
    def __init__(self):
        self.decoders: dict = {}

    def decoder(self, target, prompts, *, mode="plain", drafter=None, batch_size=None,
                block_size=16, max_cache_len=None, max_new_tokens=128, mask_token_id=None,
                **fields):
        """The decoder for this shape; one built before for the same structure is rebound to
        these weights (``load_weights``: drafters that differ only in traced parameters share it)."""
        from flax import nnx

        from d3d_jax.decoding.decoder import load_weights
        from d3d_jax.decoding.drafting import as_drafter

        cache = engine.cache_len_for(prompts, max_new_tokens, block_size, max_cache_len)
        slots = max(len(prompts), 1) if batch_size is None else int(batch_size)
        if drafter is not None:
            drafter = as_drafter(drafter, target.config.vocab_size, mask_token_id)
        key = (nnx.graphdef(target), None if drafter is None else drafter.signature, mode, slots,
               cache, block_size, tuple(sorted((k, repr(v)) for k, v in fields.items())))
        if key not in self.decoders:
            self.decoders[key] = engine.make_decoder(
                target, drafter, mode=mode, num_slots=slots, max_cache_len=cache,
                block_size=block_size, **fields)
        else:
            load_weights(self.decoders[key], target, drafter)
        return self.decoders[key]

    def __call__(self, target, prompts, *, timeline: list | None = None, loop: str = "device",
                 **kw):
        gen = {k: kw.pop(k) for k in GENERATE_ARGS if k in kw}
        dec = self.decoder(target, prompts, max_new_tokens=gen.get("max_new_tokens", 128), **kw)
        if timeline is not None:
            from d3d_jax.bench.timeline import AsyncTimeline

            gen["hook"] = AsyncTimeline(dec.shared)
        if loop == "host":
            from d3d_jax.bench.phased import host_loop

            gen["loop"] = host_loop(dec.config.mode)
        outs = engine.generate(dec, prompts, **gen)
        if timeline is not None:
            timeline += gen["hook"].rounds
        return outs
