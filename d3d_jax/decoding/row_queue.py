"""What a :class:`~d3d_jax.decoding.decoder.SpecDecoder` queues for its device rows between two
rounds: admissions and row operations (a leaving row's stop, the placement's swaps), replayed in
order right before the next round, consecutive ones of a kind in one dispatch; and the host
arrays a request's row is admitted with (:func:`row_input`, the chunked prefill's too).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from d3d_jax.decoding import window as W
from d3d_jax.decoding.core import MAX_STOP_IDS, RowInput
from d3d_jax.decoding.decoder_config import Request
from d3d_jax.decoding.strategies import OPS_PER_DISPATCH
from d3d_jax.decoding.verify import SamplingParams


def row_input(config, drafter, pages, requests: Sequence[Request], width: int, slots: Sequence[int] = (),
              n: int | None = None) -> RowInput:
    """Host arrays for ``n`` rows (every slot's), prompts ``width`` wide (their bucket); rows
    past the requests repeat the first (unused); ``slots``' page tables with a paged cache
    (``pages``; None: dense)."""
    n, cap = n or config.num_slots, config.max_cache_len
    reqs = [requests[r] if r < len(requests) else requests[0] for r in range(n)]
    prompt = np.zeros((n, width), np.int32)
    stop_ids = np.full((n, MAX_STOP_IDS), -1, np.int32)
    stop_is_eos = np.zeros((n, MAX_STOP_IDS), bool)
    for r, req in enumerate(reqs):
        prompt[r, : len(req.prompt)] = req.prompt
        eos = config.eos_token_ids if req.eos_token_ids is None else tuple(req.eos_token_ids)
        ids = [int(t) for t in eos] + [int(t) for t in req.stop_token_ids]
        stop_ids[r, : len(ids)] = ids
        stop_is_eos[r, : len(eos)] = True
    ints = lambda f: np.asarray([int(f(q)) for q in reqs], np.int32)  # noqa: E731
    data = None if drafter is None else drafter.request_data(reqs, cap)
    return RowInput(prompt, ints(lambda q: len(q.prompt)), ints(lambda q: q.seed),
                    ints(lambda q: q.index), ints(lambda q: q.max_new_tokens), stop_ids,
                    stop_is_eos, SamplingParams.stack([q.sampling for q in reqs]), data,
                    None if pages is None else pages.table(slots, n))


class RowQueue:
    """Admissions and row operations in the order they were asked for, until :meth:`replay`."""

    def __init__(self, config, pages):
        self.config, self.pages = config, pages
        self.entries: list[tuple] = []  # ("admit", slot, row) | ("op", a, b, kind), in order

    def __bool__(self) -> bool:
        return bool(self.entries)

    def admit(self, slot: int, row: int) -> None:
        self.entries.append(("admit", slot, row))

    def stop(self, row: int) -> None:
        """The request at ``row`` stops on the device (it left while still running)."""
        self.entries.append(("op", row, 0, W.OP_FREE))

    def swaps(self, swaps) -> None:
        self.entries += [("op", a, b, W.OP_SWAP) for a, b in swaps]

    def replay(self, strategy, carry, params, drafter, slots: dict, chunks, keep):
        """Run every queued entry on the device state ``carry``, handing each new state to
        ``keep`` as soon as it exists: a dispatch donates the state it reads, so a failure midway
        must leave the caller the last one made.  ``slots``: the decoder's records (an admitted
        slot freed since is skipped); with a paged cache's chunked admission (``chunks``) the
        admitted rows are handed to it instead, to prefill by chunks."""
        queue, self.entries = self.entries, []
        while queue:
            kind = queue[0][0]
            run = list(itertools.takewhile(lambda e: e[0] == kind, queue))
            queue = queue[len(run):]
            if kind == "admit" and chunks is not None:
                for _, s, _ in run:
                    if s in slots:
                        chunks.add(s, slots[s])
            elif kind == "admit":
                carry = self._admit(strategy, carry, params, drafter, slots, run, keep)
            else:
                carry = _row_ops(strategy, carry, run, keep)

    def _admit(self, strategy, carry, params, drafter, slots: dict, run: list[tuple], keep):
        """One dispatch per prompt bucket among the admitted rows (a program each, compiled when
        a bucket is first used)."""
        cfg = self.config
        by_bucket: dict[int, list[tuple[int, int]]] = {}
        for _, s, row in run:
            if s in slots:
                width = cfg.prompt_width(len(slots[s].request.prompt))
                by_bucket.setdefault(width, []).append((s, row))
        for width, live in sorted(by_bucket.items()):
            rows = row_input(cfg, drafter, self.pages, [slots[s].request for s, _ in live], width,
                             [s for s, _ in live])
            index = np.full((cfg.num_slots,), cfg.num_slots, np.int32)
            index[: len(live)] = [row for _, row in live]
            carry = strategy.admit(carry, params, rows, index, len(live))
            keep(carry)
        return carry


def _row_ops(strategy, carry, run: list[tuple], keep):
    for k in range(0, len(run), OPS_PER_DISPATCH):
        chunk = run[k: k + OPS_PER_DISPATCH]
        ops = np.zeros((OPS_PER_DISPATCH, 3), np.int32)
        ops[: len(chunk)] = [e[1:] for e in chunk]
        carry = strategy.row_ops(carry, ops, len(chunk))
        keep(carry)
    return carry
