"""Plain or sync rounds driven from the host with drafting and verifying timed apart: where a
round's time goes.  Slower than the decoder's on-device loop (a wait per phase), so it is a
benchmark's ``loop`` for :meth:`~d3d_jax.decoding.decoder.SpecDecoder.run_until_done`, never the
decoder's own."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


def phased(timer):
    """A ``loop`` that times each round's phases with ``timer`` (its ``phase(name)`` context and
    ``totals``: :class:`~d3d_jax.bench.clock.PhaseTimer`); its timings are ``draft_s`` and
    ``verify_s``."""

    def loop(strategy, carry, params, lo: int, hi: int, max_rounds: int):
        start, rows = strategy.ctx.window(lo, hi)
        state = carry.state
        for _ in range(max_rounds):
            if bool(np.all(jax.device_get(state.done[start:start + rows]))):
                break
            state = _round(strategy, params, state, (start, lo, hi), rows, timer)
        return dataclasses.replace(carry, state=state), dict(dict(draft_s=0.0, verify_s=0.0), **timer.totals)

    return loop


def _round(strategy, params, state, window, rows: int, timer):
    t_leaves, d_leaves = params
    drafts = probs = None
    if strategy.core.drafter is not None:
        with timer.phase("draft_s"):
            state, drafts, probs = jax.block_until_ready(strategy.draft(d_leaves, state, *window, rows=rows))
    with timer.phase("verify_s"):
        return jax.block_until_ready(strategy.verify(t_leaves, state, drafts, probs, *window, rows=rows))


def host_loop(mode: str):
    """A fresh :func:`phased` loop (its own :class:`~d3d_jax.bench.clock.PhaseTimer`) for a plain
    or sync decoder; None for the others (async dispatches without waits, auto steps)."""
    from d3d_jax.bench.clock import PhaseTimer

    return phased(PhaseTimer()) if mode in ("plain", "sync") else None
