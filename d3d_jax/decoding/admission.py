"""Admission: the requests inserted between two rounds are prefilled and written into their rows
in ONE dispatch.

The program loops over the admitted rows on the device (a ``fori_loop`` with a traced count, so
one program serves 1 or 32 arrivals).  Its rows share one prompt-length bucket
(:func:`~d3d_jax.decoding.decoder_config.prompt_buckets`): the decoder admits each bucket's rows
in a dispatch of their own, so a short prompt never pays for a long one, and a program holds one
prefill, not one branch per bucket (those were most of a small model's first compile).  One
program per decoder side and bucket, compiled when first used: none per arrival count.

A paged cache is prefilled differently (:func:`prefill_piece`): one chunk of one row's prompt per
dispatch, from the row's cached prefix on, written through the row's own page table, the row
joining the decode state with its last chunk.  The host (the decoder) picks the chunks, at most
``max_num_batched_tokens`` tokens between two rounds, and a chunk's width is one of a few fixed
ones (``DecoderConfig.chunk_widths``), so no prompt length compiles a program.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from d3d_jax.decoding.core import DecodeCore, DecodeState, RowInput
from d3d_jax.model.kv_cache import DENSE_CACHES
from d3d_jax.model.paged_kv import PagedKVCache, prefill_chunk


def row_at(rows: RowInput, i: jax.Array) -> RowInput:
    """Row ``i`` of every per-row input (a batch of one)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=0), rows)


def pad_caches(tree, length: int):
    """Every dense cache in ``tree`` padded to ``length`` slots (one shape for all buckets)."""

    def pad(x):
        if not isinstance(x, DENSE_CACHES):
            return x
        extra = ((0, 0), (0, 0), (0, length - x.max_len), (0, 0), (0, 0))
        return x.replaced(jnp.pad(x.k_lbskh, extra), jnp.pad(x.v_lbskh, extra), x.lengths)

    return jax.tree.map(pad, tree, is_leaf=lambda x: isinstance(x, DENSE_CACHES))


def admit(tree, rows: RowInput, index: jax.Array, count: jax.Array, *, prefill: Callable,
          insert: Callable, cache_len: int):
    """``tree`` with rows ``index[:count]`` filled by ``insert(tree, prefill(row), slot [1])``.

    ``prefill(row)`` gets one request at the rows' prompt width (their bucket); its caches are
    padded to ``cache_len``, the state's length, and written in place."""

    def body(i, t):
        parts = pad_caches(prefill(row_at(rows, i)), cache_len)
        return insert(t, parts, jax.lax.dynamic_slice_in_dim(index, i, 1))

    return jax.lax.fori_loop(0, count, body, tree)


def prefill_piece(core: DecodeCore, sides: list, state: DecodeState, rows: RowInput,
                  tokens: jax.Array, start: jax.Array, count: jax.Array, slot: jax.Array,
                  drafter_params=None) -> tuple[DecodeState, list]:
    """One chunk of one row's prompt in every paged cache of ``sides``
    (:meth:`DecodeCore.paged_sides`): ``tokens [1, C]``, the first ``count [1]`` real, at
    positions ``start [1] …``, through the row's own table ``rows.pages`` (the state's tables
    are untouched: the row is not on the device yet).  ``slot [1]``: the device row it joins
    when this chunk is its last, with ``lengths = prompt_len - 1``; out of range: not yet.
    Returns the state and each side's chunk logits ``[1, C, V]`` (XLA drops those unused)."""
    logits = []
    for model, get, put in sides:
        cache = get(state)
        own = PagedKVCache(cache.k_lpskh, cache.v_lpskh, rows.pages, start)
        out, own = prefill_chunk(model, own, tokens, count)
        logits.append(out)
        state = put(state, PagedKVCache(own.k_lpskh, own.v_lpskh, cache.page_table, cache.lengths))
    return core.join_prefilled(state, rows, drafter_params, slot), logits


class ChunkedAdmission:
    """The host side of a paged cache's admission: rows waiting for their prompts' chunks, first
    come first served, one row at a time, so a row's prompt is looked up in the page pool only
    after every row before it registered its pages (the ``n`` choices of one request, or a
    system prompt that arrives twice, hit the first one's pages).

    ``pages`` (:class:`~d3d_jax.decoding.page_pool.SlotPages`) holds each slot's pages; a chunk
    holds at most ``budget`` tokens and is padded to the smallest of ``widths`` holding it."""

    def __init__(self, pages, budget: int, widths: Sequence[int]):
        self.pages, self.budget, self.widths = pages, int(budget), tuple(widths)
        self._rows: collections.deque = collections.deque()  # (slot, info), oldest first
        self.computed = self.reused = 0  # prompt tokens prefilled by chunks, and found cached

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, slot: int, info) -> None:
        """A row whose ``info.request.prompt`` is to be prefilled (``info.cached`` starts at -1)."""
        self._rows.append((slot, info))

    def run(self, dispatch: Callable, alive: Callable, everything: bool = False, decoding: int = 0) -> None:
        """Dispatch chunks until the step's budget is spent (``everything``: until no row waits):
        ``dispatch(slot, info, start, count, width, last)``.  ``alive(slot, info)``: the row still
        wants them (a cancelled one is dropped).  Each chunk's full pages are registered once it is
        dispatched: later dispatches (another row's prefix hit) run after it on the device.

        ``decoding``: the tokens the round after these chunks feeds (running rows x width).  As in
        vLLM, ``budget`` covers a step's decode tokens and its prefill chunk together, since a
        stream waits for both between two of its tokens; the chunk keeps at least the smallest
        width, so prompts progress however many rows decode."""
        budget = max(self.budget - int(decoding), min(self.widths[0], self.budget))
        spent = 0
        while self._rows and (everything or spent < budget):
            slot, info = self._rows[0]
            if not alive(slot, info):
                self._rows.popleft()
                continue
            prompt = list(info.request.prompt)
            if info.cached < 0:  # its first chunk: start after the longest cached prefix
                info.cached = self.pages.reuse_prefix(slot, prompt[:-1])
                self.reused += info.cached
            todo = len(prompt) - 1 - info.cached
            count = min(todo, budget if everything else budget - spent)
            width = next(w for w in self.widths if w >= min(max(count, 1), self.widths[-1]))
            last = count == todo
            dispatch(slot, info, info.cached, count, width, last)
            self.computed += count
            info.cached += count
            self.pages.register(slot, prompt[:info.cached])
            spent += max(count, 1)
            if last:
                info.pending = False
                self._rows.popleft()
