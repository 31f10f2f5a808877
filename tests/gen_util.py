"""What the tests' callers of ``engine.generate`` hold: one decoder per (target, drafter, config),
built on first use and kept by the :class:`Generator` (a test module keeps one), so a test module
compiles each decoder's programs once, as a long-lived caller would."""

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
        cache = engine.cache_len_for(prompts, max_new_tokens, block_size, max_cache_len)
        slots = len(prompts) if batch_size is None else int(batch_size)
        key = (id(target), id(drafter), mode, slots, cache, block_size, mask_token_id,
               tuple(sorted((k, repr(v)) for k, v in fields.items())))
        if key not in self.decoders:
            self.decoders[key] = (engine.make_decoder(
                target, drafter, mode=mode, num_slots=slots, max_cache_len=cache,
                block_size=block_size, mask_token_id=mask_token_id, **fields), target, drafter)
        return self.decoders[key][0]

    def __call__(self, target, prompts, *, timeline: list | None = None, loop: str = "device",
                 **kw):
        gen = {k: kw.pop(k) for k in GENERATE_ARGS if k in kw}
        dec = self.decoder(target, prompts, max_new_tokens=gen.get("max_new_tokens", 128), **kw)
        if timeline is not None:
            from d3d_jax.bench.timeline import AsyncTimeline

            gen["hook"] = AsyncTimeline(dec.shared)
        if loop == "host":
            from d3d_jax.bench.clock import PhaseTimer

            gen["timer"] = PhaseTimer()
        outs = engine.generate(dec, prompts, **gen)
        if timeline is not None:
            timeline += gen["hook"].rounds
        return outs
