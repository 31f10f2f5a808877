"""Rounds' outcomes on the host, for :class:`~d3d_jax.decoding.decoder.SpecDecoder`: each slot's
record (:class:`SlotInfo`) counted from every round read, and the reading itself
(:class:`RoundReader`): one device→host copy of a round's per-row arrays, its time, the
per-geometry tally and what the strategy observes.  A request's metrics and results are answered
from these records, so finishing one copies nothing more from the device.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import numpy as np

from d3d_jax.decoding import metrics as M
from d3d_jax.decoding.core import FINISH_REASONS
from d3d_jax.decoding.decoder_config import Request, StepOutput
from d3d_jax.decoding.strategies import LOGPROB_KEYS


@dataclasses.dataclass
class SlotInfo:
    """The host's record of one slot's request, counted from every round read."""

    request: Request
    hist: np.ndarray  # rounds per acceptance length
    n_out: int = 0
    finish_reason: str | None = None
    rounds: int = 0
    accepted: int = 0
    hits: int = 0
    misses: int = 0
    modes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    stats: dict = dataclasses.field(default_factory=dict)  # the strategy's own (auto)
    # a paged cache: its prompt is being prefilled by chunks, it is on no device row yet
    pending: bool = False
    cached: int = -1  # a paged cache: prompt tokens in its pages so far (-1: not looked up yet)
    tokens: list = dataclasses.field(default_factory=list)  # a paged cache: generated, as read
    drafted: int = 0  # a paged cache: of ``tokens``, those the drafter's cache holds at least

    def count(self, label: str, row: dict) -> StepOutput:
        """One round's row (its part's geometry ``label``) counted into the record."""
        n, accepted = int(row["count"]), int(row["accepted"])
        reason = FINISH_REASONS.get(int(row["finish"]))
        hit = None if "hit" not in row else bool(row["hit"])
        self.n_out += n
        self.finish_reason = reason
        self.rounds += 1
        self.accepted += accepted
        self.hist[accepted] += 1
        self.hits += bool(hit)
        self.misses += bool(row.get("miss", False))
        self.modes[label] += 1
        if self.request.grammar is not None:
            self.request.grammar.advance(row["tokens"][:n])
        return StepOutput([int(t) for t in row["tokens"][:n]], reason is not None, reason,
                          accepted, hit, M.row_logprobs(row, n, self.request.sampling.logprobs))

    def refresh(self, res: dict, i: int) -> None:
        """The device's counts of row ``i`` of ``res`` (the strategy's row results) after an
        on-device loop, which the host read no round of."""
        self.n_out = int(res["n_out"][i])
        self.finish_reason = FINISH_REASONS.get(int(res["finish"][i]))
        self.hist = np.asarray(res["accept_hist"][i], np.int64)
        self.rounds = int(self.hist.sum())
        if "hits" in res:
            self.hits, self.misses = int(res["hits"][i]), int(res["misses"][i])

    def result(self, res: dict, i: int) -> dict:
        """Row ``i`` of ``res`` (the strategy's row results) as the decoder's ``results`` answers it."""
        plen, n = int(res["prompt_len"][i]), int(res["n_out"][i])
        r = dict(token_ids=[int(t) for t in res["seq"][i, plen: plen + n]],
                 finish_reason=FINISH_REASONS.get(int(res["finish"][i]), "length"),
                 accept_hist=res["accept_hist"][i], modes=dict(self.modes),
                 reasons=dict(self.stats.get("reasons", {})))
        if "hits" in res:
            r.update(hits=int(res["hits"][i]), misses=int(res["misses"][i]),
                     sync_drafts=int(res["sync_drafts"]))
        return r

    def metrics(self, async_counts: bool) -> dict:
        """τ, the acceptance histogram, rounds, tokens so far, the rounds per geometry and, where
        the mode has them (``async_counts``), hits and misses."""
        return dict(tau=M.tau_from_hist(self.hist), accept_hist=[int(x) for x in self.hist],
                    rounds=self.rounds, n_out=self.n_out, modes=dict(self.modes),
                    reasons=dict(self.stats.get("reasons", {})),
                    hits=self.hits if async_counts else None,
                    misses=self.misses if async_counts else None)


@dataclasses.dataclass
class Round:
    """A dispatched round, until it is read."""

    parts: list  # [strategies.Part]
    snapshot: list  # row -> (slot, SlotInfo) when dispatched
    t_dispatch: float
    t_start: float  # before its admissions and row ops ran
    clean: bool  # no admission or row op ran just before it (its time is the round's own)
    host_work: bool = False  # its dispatch flushed admissions/row ops or compiled a program


class RoundReader:
    """Reads dispatched rounds in order: their outcomes into the slots' records, their time, and
    per geometry the rounds, tokens and auto's predictions (the decoder's ``decisions``)."""

    def __init__(self):
        self.last_read, self.busy = 0.0, False  # the last read; whether a request ran on after it
        self.tally: dict[str, collections.Counter] = {}  # per geometry: rounds, tokens, predicted

    def read(self, rnd: Round, strategy, slots: dict[int, SlotInfo], chunks) -> dict[int, StepOutput]:
        """``rnd``'s outcome per slot still holding the request it was dispatched for
        (``slots``: the decoder's records; ``chunks``: its paged admission, or None)."""
        wants = any(info is not None and info.request.sampling.logprobs >= 0
                    for _, info in rnd.snapshot)
        host = jax.device_get([p.out if wants else
                               {k: v for k, v in p.out.items() if k not in LOGPROB_KEYS}
                               for p in rnd.parts])
        now = time.perf_counter()
        seconds = now - max(rnd.t_dispatch, self.last_read) if rnd.clean else None
        # all the time since the last read while requests ran (host work, admissions, row ops)
        wall = now - (self.last_read if self.busy else rnd.t_start)
        self.last_read = now
        outs, prefills = {}, strategy.home.prefill_rounds
        for part, h in zip(rnd.parts, host):
            M.tally_round(self.tally.setdefault(part.label, collections.Counter()), part,
                          int(np.sum(h["count"])), seconds if len(rnd.parts) == 1 else None)
            for i, row in enumerate(range(part.start, part.start + part.rows)):
                slot, info = rnd.snapshot[row]
                if prefills and h["count"][i] == 0 and h["finish"][i] == 0:
                    continue  # a row caching its prompt: nothing for it yet (core.prefilling)
                if part.lo <= row < part.hi and info is not None and slots.get(slot) is info \
                        and info.finish_reason is None:
                    outs[slot] = info.count(part.label, {k: v[i] for k, v in h.items()})
                    if chunks is not None:
                        chunks.read(info, part.label, outs[slot].token_ids)
        strategy.observe(rnd.parts, host, seconds, rnd.snapshot, wall=wall)
        self.busy = any(info.finish_reason is None for info in slots.values())
        return outs

    def decisions(self) -> dict[str, dict]:
        return {label: dict(t) for label, t in sorted(self.tally.items())}
