"""A paged decoder's host side of admission and prefix reuse, beside
:class:`~d3d_jax.decoding.decoder.SpecDecoder` (which owns the slots and the device state).

* **Admission by chunks** (:class:`~d3d_jax.decoding.admission.ChunkedAdmission`): a row's prompt
  is looked up in the page pool right before its first chunk, and the rest is prefilled in chunks
  that fill every paged cache of the state, the target's and a drafter's alike (their pools share
  page ids, so one hit covers both).
* **Registration when a row leaves**: its full pages become findable for a later turn, prompt and
  generated tokens, up to the position both caches hold.  The target's cache holds every
  committed token but the last (the anchor); a drafter's lags behind it (after a round that ran
  the drafter it holds the tokens before that round's anchor, after plain rounds less), so the
  host keeps, per row, the generated tokens before the anchor of the last round read that ran the
  drafter: a lower bound of what its cache holds (it only grows while the row runs).
* **Counts** of prompt tokens prefilled and taken from the cache, the drafter's shown apart.
"""

from __future__ import annotations

import numpy as np

from d3d_jax.decoding.admission import ChunkedAdmission
from d3d_jax.decoding.page_pool import SlotPages
from d3d_jax.decoding.row_queue import row_input


class PagedAdmission:
    """Chunked admission, prefix registration and prefill counts of one paged decoder.

    ``drafter_pages``: the drafter keeps a paged KV cache over the target's pages (its chunks and
    its hits are the target's, and what a row leaves behind stops where its drafter cache does)."""

    def __init__(self, pages: SlotPages, config, drafter_pages: bool):
        self.pages, self.drafter_pages = pages, bool(drafter_pages)
        self.chunks = ChunkedAdmission(pages, config.max_num_batched_tokens, config.chunk_widths)

    def __len__(self) -> int:
        return len(self.chunks)

    def add(self, slot: int, info) -> None:
        self.chunks.add(slot, info)

    def run(self, dec, everything: bool) -> None:
        """Prefill chunks of the waiting rows into decoder ``dec``'s state
        (:meth:`ChunkedAdmission.run`): the step's budget less the next round's decode tokens
        (each running row's width); ``everything``: every waiting prompt."""
        decoding = 0 if everything else len(dec._running()) * dec.config.width
        self.chunks.run(lambda *chunk: _piece(dec, *chunk), lambda s, info: dec._slots.get(s) is info,
                        everything, decoding=decoding)

    def read(self, info, label: str, tokens: list[int]) -> None:
        """A round read for a running row: its ``tokens``; a round that ran the drafter (not
        ``plain``) left the drafter's cache holding every generated token before its anchor."""
        if label != "plain":
            info.drafted = len(info.tokens)
        info.tokens += tokens

    def release(self, slot: int, info) -> None:
        """The row leaves: its full pages registered (unless its prompt was still being
        prefilled: those were registered chunk by chunk), then released."""
        if not info.pending:
            held = min(len(info.tokens), info.drafted) if self.drafter_pages else len(info.tokens)
            prompt = list(info.request.prompt)
            self.pages.register(slot, (prompt + info.tokens)[:len(prompt) - 1 + held])
        self.pages.release(slot)

    def stats(self) -> dict[str, int]:
        """Prompt tokens prefilled by chunks and taken from the prefix cache, the target's
        (``prefill_tokens_*``) and, with a paged drafter, the drafter's (``drafter_prefill_tokens_*``)."""
        out = dict(prefill_tokens_computed=self.chunks.computed, prefill_tokens_reused=self.chunks.reused)
        if self.drafter_pages:
            out.update({f"drafter_{k}": v for k, v in out.items()})
        return out


def _piece(dec, slot: int, info, start: int, count: int, width: int, last: bool) -> None:
    """One chunk of ``slot``'s prompt into ``dec``'s state; with its last, the row joins at its
    current device row (the placement's swaps since its insert already ran)."""
    prompt = np.asarray(info.request.prompt, np.int32)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :count] = prompt[start:start + count]
    rows = row_input(dec.config, dec.drafter, dec.pages, [info.request], dec.config.max_cache_len, [slot], n=1)
    one = lambda v: np.asarray([v], np.int32)  # noqa: E731
    row = dec.placement.row_of[slot] if last else dec.config.num_slots  # out of range: not yet
    dec.carry = dec.strategy.prefill_piece(dec.carry, dec.param_leaves(), rows, tokens, one(start),
                                           one(count), one(row))
