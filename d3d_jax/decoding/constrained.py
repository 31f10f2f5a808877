"""Rounds for a batch that holds a grammar-constrained request: draft, masks on the host, verify.

A grammar lives on the host (:mod:`~d3d_jax.decoding.grammar`), and a slot's mask depends on
the drafts before it, so such a round is two programs with the host between them: the drafter's
forward (its drafts copied back), then each constrained row's matcher walked along its drafts
for a ``[rows, W, words]`` bitmask (each draft first replaced by the best of the drafter's
top-K that the grammar allows there), then the target's verify and commit with that mask.  Rows
without a grammar ride along unmasked (all bits set) and decode exactly as in any other round.
No round is dispatched ahead while a grammar is live: the next round's masks need this one's
committed tokens; within a round only slot 0's masks depend on no draft, and they are built
while the drafter's program runs.  Plain rounds (W = 1) skip the drafter.  Auto runs each placement class in
its own part: the rows it speculates on in its widest sync geometry, the rows it set aside
(constrained requests by default: their drafts are mostly rejected) in plain rounds
(:meth:`~d3d_jax.decoding.auto.AutoStrategy.masked_label`).  Async rounds have no grammar path
(their next block is drafted before the host sees the verdict), so the decoder refuses
constrained requests in async mode.

The host's share is reported per round in ``seconds_host`` (mask building, the drafts' copy).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from d3d_jax.decoding.grammar import words
from d3d_jax.decoding.strategies import Part, result_out, windowed

PROPOSAL_CANDIDATES = 8  # the drafter's top-K a constrained row's draft is chosen from


def masked_rounds(strategy, vocab_size: int) -> "MaskedRounds":
    """The strategy's constrained rounds, made once (their programs compile when first run)."""
    if getattr(strategy, "_masked_rounds", None) is None:
        strategy._masked_rounds = MaskedRounds(strategy, vocab_size)
    return strategy._masked_rounds


def geometry(strategy, label: str | None = None) -> tuple[str, object, bool]:
    """(label, core, catch_up) a constrained round runs with: a fixed mode's own; auto's
    ``label`` (default its widest sync geometry)."""
    cores = getattr(strategy, "cores", None)
    if cores is None:  # plain or sync
        return strategy.label, strategy.core, False
    if label is None:
        syncs = sorted((c.width, lab) for lab, c in cores.items() if lab.startswith("sync/"))
        label = syncs[-1][1] if syncs else "plain"
    return label, cores[label], label != "plain"


class MaskedRounds:
    """A strategy's constrained rounds: one part per placement class where the strategy gives
    the classes different geometries (auto), else one part over every live row."""

    def __init__(self, strategy, vocab_size: int):
        self.strategy, self.vocab_size = strategy, vocab_size
        self.geometries: dict = {}
        self.host_seconds: list[float] = []

    def _geometry(self, label: str | None) -> "MaskedGeometry":
        if label not in self.geometries:
            self.geometries[label] = MaskedGeometry(self.strategy, self.vocab_size, label, self.host_seconds)
        return self.geometries[label]

    def dispatch(self, carry, params, groups, rows_info) -> tuple[object, list[Part]]:
        """One round over the live rows (``rows_info``: each placement row's SlotInfo)."""
        label_of = getattr(self.strategy, "masked_label", None)
        if label_of is None:
            return self._geometry(None).dispatch(carry, params, groups, rows_info)
        parts = []
        for lo, hi, cls in groups:
            carry, part = self._geometry(label_of(cls, hi - lo)).dispatch(carry, params, [(lo, hi, cls)], rows_info)
            parts += part
        return carry, parts


class MaskedGeometry:
    """The two programs of a constrained round in one geometry, and its host step."""

    def __init__(self, strategy, vocab_size: int, label: str | None, host_seconds: list):
        self.strategy = strategy
        self.label, self.core, self.catch_up = geometry(strategy, label)
        self.words = words(vocab_size)
        suffix = "" if label is None else "_" + label  # auto: a program per geometry
        self._draft = strategy.jit(self._draft_fn, name="grammar_draft" + suffix, static_argnames="rows",
                                   donate_argnums=1)
        self._verify = strategy.jit(self._verify_fn, name="grammar_verify" + suffix, static_argnames="rows",
                                    donate_argnums=1)
        self.host_seconds = host_seconds  # shared by a strategy's geometries

    def _draft_fn(self, d_leaves, state, start, lo, hi, *, rows):
        dp, core = self.strategy.ctx.dp(d_leaves), self.core

        def draft(v):
            if self.catch_up:
                d = core.drafter.catch_up(dp, v.drafter_state, v.seq, v.anchor_pos, ~v.done, core.width)
                v = dataclasses.replace(v, drafter_state=d)
            out, v = core.draft(dp, v)
            cands = out.drafts[..., None]
            if out.logits is not None:  # the drafter's ranking, for the host's masked choice
                top = jax.lax.top_k(out.logits, PROPOSAL_CANDIDATES)[1].astype(jnp.int32)
                cands = jnp.concatenate([cands, top], axis=-1)
            return v, (out.drafts, out.probs, cands)

        return windowed(draft, rows, state, start, lo, hi)

    def _verify_fn(self, t_leaves, state, drafts, probs, mask, masked_rows, start, lo, hi, *, rows):
        tp, core = self.strategy.ctx.tp(t_leaves), self.core
        if probs is not None:  # a host-chosen draft is a point mass: verified as one, lossless
            point = jax.nn.one_hot(drafts, probs.shape[-1], dtype=probs.dtype)
            probs = jnp.where(masked_rows[:, None, None], point, probs)

        def verify(v):
            accepted, nxt, cache, logprobs = core.verify(tp, v, drafts, drafts, probs, token_mask=mask)
            return core.commit(v, drafts, accepted, nxt, cache, logprobs)

        return windowed(verify, rows, state, start, lo, hi)

    def dispatch(self, carry, params, groups, rows_info) -> tuple[object, list[Part]]:
        """One round over the rows of ``groups`` (``rows_info``: each placement row's SlotInfo)."""
        lo, hi = groups[0][0], groups[-1][1]
        matchers = {row: i.request.grammar for row, i in enumerate(rows_info)
                    if lo <= row < hi and i.request.grammar is not None and i.finish_reason is None}
        start, rows = self.strategy.ctx.window(lo, hi)
        width = self.core.width
        self.strategy.note((self.label + "/grammar", rows))
        state = carry.state
        plain = self.core.drafter is None
        if plain and state.drafter_state is not None:  # auto keeps the drafter's state aside
            kept, state = state.drafter_state, dataclasses.replace(state, drafter_state=None)
        if plain:
            drafts, probs = np.zeros((rows, width - 1), np.int32), None
            cands = np.zeros((rows, width - 1, 1), np.int32)
        else:
            state, (drafts, probs, cands) = self._draft(params[1], state, start, lo, hi, rows=rows)
        t0 = time.perf_counter()
        mask = np.full((rows, width, self.words), -1, np.int32)
        for row, matcher in matchers.items():  # slot 0's masks while the drafter runs
            matcher.mask_into(mask[row - start, 0])
        drafts, cands = (np.array(a) for a in jax.device_get((drafts, cands)))
        masked_rows = np.zeros(rows, bool)
        for row, matcher in matchers.items():
            drafts[row - start], mask[row - start] = matcher.block(drafts[row - start], width, cands[row - start],
                                                                   first=mask[row - start, 0].copy())
            masked_rows[row - start] = True
        self.host_seconds.append(time.perf_counter() - t0)
        state, res = self._verify(params[0], state, jnp.asarray(drafts), probs, jnp.asarray(mask),
                                  jnp.asarray(masked_rows), start, lo, hi, rows=rows)
        if plain and carry.state.drafter_state is not None:
            state = dataclasses.replace(state, drafter_state=kept)
        out = result_out(res)
        if carry.prompt_score is not None:  # auto reads each row's prompt score from its rounds
            from d3d_jax.decoding import window as W

            out["prompt_score"] = W.view(carry.prompt_score, start, rows)
        reasons = getattr(self.strategy, "row_reasons", None)  # auto: why each row runs so
        return (dataclasses.replace(carry, state=state),
                [Part(self.label, start, rows, lo, hi, out, fresh=True,
                      row_reasons=reasons(rows_info, lo, hi, self.label) if reasons else ())])
