"""Growth page by page and preemption, for a decoder whose caller requeues what it preempts.

A request holds the pages its tokens fill: its prompt and a few rounds at insert, then, before each
dispatch, what the rounds in flight and the next one can write (the host knows every row's
output count from each round it read).  When a running row needs a page and none is free, the
newest running request is preempted: its pages go back to the pool and the caller (the
scheduler) queues it again with prompt + the tokens it got as its prompt, same seed and index.
Randomness is keyed by (seed, index, position), so it goes on with the tokens it would have
produced, as vLLM's recompute preemption does.

A request whose tokens depend on where its prompt ends (presence, frequency or repetition
penalties count output tokens only; a grammar's state) would not: it holds every page it can
fill from insert, needs no growth and is never preempted.
"""

from __future__ import annotations

import dataclasses
import itertools

from d3d_jax.decoding.page_pool import SlotPages

LOOKAHEAD_ROUNDS = 2  # rounds a row can run before its next growth: the one dispatched ahead, and one more


def resumable(request) -> bool:
    """Whether ``request`` decodes the same tokens when resumed from prompt + its output."""
    s = request.sampling
    return (request.grammar is None and s.presence_penalty == 0 and s.frequency_penalty == 0
            and s.repetition_penalty == 1)


def resumed(request, token_ids: list[int]):
    """``request`` preempted after ``token_ids``: those joined to its prompt, the rest to go
    (``min_tokens`` counts from the new prompt's end, so it shrinks by as many)."""
    n = len(token_ids)
    sampling = dataclasses.replace(request.sampling, min_tokens=max(int(request.sampling.min_tokens) - n, 0))
    return dataclasses.replace(request, prompt=list(request.prompt) + list(token_ids),
                               max_new_tokens=int(request.max_new_tokens) - n, sampling=sampling)


class PageGrowth:
    """The growth and preemption policy over one decoder's :class:`SlotPages`."""

    def __init__(self, pages: SlotPages, width: int, cap: int):
        self.pages, self.width, self.cap = pages, int(width), int(cap)
        self._order: dict[int, int] = {}  # slot -> admission number (the newest is preempted first)
        self._count = itertools.count()

    def full(self, request) -> int:
        return SlotPages.need(request, self.cap)

    def first(self, request) -> int:
        """Tokens a request's pages are held for at insert."""
        if not resumable(request):
            return self.full(request)
        return min(len(request.prompt) + (LOOKAHEAD_ROUNDS + 1) * self.width, self.full(request))

    def admitted(self, slot: int) -> None:
        self._order[slot] = next(self._count)

    def fits(self, request, running: int) -> bool:
        """Free pages hold ``request``'s first pages and one page per running row (a watermark,
        so an admission does not at once preempt the request it admits)."""
        return self.pages.pool.pages_for(self.first(request)) + running <= self.pages.pool.num_free

    def grow(self, running: dict, in_flight: int) -> tuple[list[int], bool]:
        """Map each running row's next positions (``running``: slot -> SlotInfo, ``in_flight``:
        rounds dispatched and not read), oldest first.  Returns the slots preempted (their pages
        released) and whether any table changed."""
        preempted, changed = [], False
        live = sorted(running, key=lambda s: self._order.get(s, -1))
        for slot in list(live):
            info = running[slot]
            if slot in preempted or not resumable(info.request):
                continue
            need = min(len(info.request.prompt) + info.n_out + (in_flight + 1) * self.width, self.full(info.request))
            held = self.pages.held_tokens(slot)
            while not self.pages.grow(slot, need):
                victim = next(s for s in reversed(live) if s not in preempted and resumable(running[s].request))
                preempted.append(victim)
                self.pages.release(victim)
                changed = True
                if victim == slot:
                    break
            changed |= slot not in preempted and self.pages.held_tokens(slot) != held
        return preempted, changed
