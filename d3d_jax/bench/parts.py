"""On-device timings of a decoding round's parts (``infer/bench.py gpu``): one ``fori_loop`` per
part, so neither dispatch nor the host is counted; each loop is compiled once and warmed up."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def median_s(fn, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` (which must block) after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _loop_timer(body, params, iters: int):
    """``carry -> seconds per iteration`` of ``body(params, i, carry) -> carry`` run ``iters``
    times in one ``fori_loop`` (``body`` makes its work depend on ``i``: nothing is hoisted).
    Compiled once; the first call per carry is an untimed warm-up."""
    run = jax.jit(lambda p, c: jax.lax.fori_loop(0, iters, lambda i, c: body(p, i, c), c))
    return lambda carry, repeats: median_s(
        lambda: jax.block_until_ready(run(params, carry)), repeats) / iters


def fixed_inputs(cfg, shape, seed):
    """Token ids below the mask id (a prompt or a block), the same for every run."""
    hi = cfg.mask_token_id if cfg.mask_token_id is not None else cfg.vocab_size
    return jnp.asarray(np.random.default_rng(seed).integers(0, hi, shape), jnp.int32)


def draft_seconds(drafter, ctx: int, cache_len: int, block: int, iters: int, repeats: int,
                  uncached: tuple[int, ...]) -> list[float]:
    """One sync draft (``ModelDrafter.propose``) from an anchor at ``ctx``, per count of
    committed tokens not yet in the drafter cache."""
    from d3d_jax.decoding.drafting import ModelDrafter
    from d3d_jax.decoding.verify import GREEDY, SamplingParams

    d = ModelDrafter(drafter)
    seq, anchor = fixed_inputs(drafter.config, (1, cache_len), 1), jnp.full((1,), ctx, jnp.int32)
    keys, sampling = jax.random.key(0)[None], SamplingParams.stack([GREEDY])

    def body(params, i, carry):
        cache, acc = carry
        out, new = d.propose(params, cache, (seq + i) % d.mask_token_id, anchor, keys, sampling,
                             block, False)
        return new.with_lengths(cache.lengths), acc + jnp.sum(out.drafts)

    timed = _loop_timer(body, d.params, iters)
    cache = d.init_state(1, cache_len)
    return [timed((cache.with_lengths(jnp.full((1,), ctx - u, jnp.int32)), jnp.int32(0)), repeats)
            for u in uncached]


def packed_seconds(drafter, ctx: int, cache_len: int, layout, iters: int, repeats: int) -> float:
    """One packed branch forward (``N_async`` tokens) over a cache of ``ctx`` tokens."""
    from d3d_jax.decoding.drafting import ModelDrafter

    d = ModelDrafter(drafter)
    b = layout.block_size
    block, alts = fixed_inputs(d.config, (1, b), 2), fixed_inputs(d.config, (1, b, layout.fanout), 3)
    anchor, dl = jnp.full((1,), ctx, jnp.int32), jnp.full((1,), b - 1, jnp.int32)

    def body(params, i, carry):
        cache, acc = carry
        out, cache = d.branch_pack(params, cache, (block + i) % d.mask_token_id, alts, anchor, dl,
                                   layout)
        return cache.with_lengths(anchor), acc + jnp.sum(out.tokens)

    cache = d.init_state(1, cache_len).with_lengths(anchor)
    return _loop_timer(body, d.params, iters)((cache, jnp.int32(0)), repeats)


def verify_seconds(target, ctx: int, cache_len: int, block: int, iters: int, repeats: int) -> float:
    """One B-token target forward over ``ctx`` cached tokens (``bench engine``'s timer)."""
    from d3d_jax.bench.engine import target_step_fn

    return median_s(target_step_fn(target, block, ctx, cache_len, iters), repeats, warmup=0) / iters
