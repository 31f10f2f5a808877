"""Row windows and row swaps over the decoder's device state (any pytree of per-row arrays).

A round runs over a *window*: rows ``start … start+rows-1`` of the state, ``rows`` one of a few
static widths (:attr:`DecoderConfig.buckets`), ``start`` traced.  The live requests are kept
packed at the low rows (:class:`RowPlacement`), so a round's cost
follows the live requests, not the slots.  Rule for the pytrees: a
:class:`~d3d_jax.model.kv_cache.KVCache` becomes a :class:`~d3d_jax.model.kv_cache.KVWindow`
(read and written in place, never copied); a
:class:`~d3d_jax.model.paged_kv.PagedKVCache` keeps its pool whole and slices its page tables, so
moving a row moves its page-table row, not its K/V; every other array of rank >= 1 has its rows on axis
0 and is sliced; scalars pass through.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from d3d_jax.model.kv_cache import DENSE_CACHES, KVCache, KVWindow, LayerKVCache, LayerKVWindow
from d3d_jax.model.paged_kv import PagedKVCache


def _is_cache(x) -> bool:
    return isinstance(x, DENSE_CACHES + (KVWindow, LayerKVWindow, PagedKVCache))


def view(tree, start: jax.Array, rows: int):
    """The window's rows of ``tree`` (see the module doc)."""

    def one(x):
        if isinstance(x, KVCache):
            return KVWindow.of(x, start, rows)
        if isinstance(x, LayerKVCache):
            return LayerKVWindow.of(x, start, rows)
        if isinstance(x, PagedKVCache):
            return x.window(start, rows)
        if getattr(x, "ndim", 0) == 0:
            return x
        return jax.lax.dynamic_slice_in_dim(x, start, rows, axis=0)

    return jax.tree.map(one, tree, is_leaf=_is_cache)


def merge(full, window, keep: jax.Array, start: jax.Array):
    """``full`` with the window written back; rows where ``keep [rows]`` is False keep their old
    per-row values (caches: their lengths; what a skipped row's forward wrote sits past its
    length, where it is invalid whatever it holds)."""

    def one(old, new):
        if isinstance(old, DENSE_CACHES):
            return new.merged(old.lengths, keep)
        if isinstance(old, PagedKVCache):  # the window's pool, the full tables and merged lengths
            lengths = one(old.lengths, new.lengths)
            return PagedKVCache(new.k_lpskh, new.v_lpskh, old.page_table, lengths)
        if getattr(old, "ndim", 0) == 0:
            return new
        rows = new.shape[0]
        prev = jax.lax.dynamic_slice_in_dim(old, start, rows, axis=0)
        k = keep.reshape((rows,) + (1,) * (new.ndim - 1))
        return jax.lax.dynamic_update_slice_in_dim(old, jnp.where(k, new, prev), start, 0)

    return jax.tree.map(one, full, window, is_leaf=_is_cache)


def _swap(x: jax.Array, a: jax.Array, b: jax.Array, axis: int) -> jax.Array:
    # One gather of the two rows, one scatter back: written in place on a donated buffer.  Two
    # dynamic slices and two dynamic-update-slices made XLA fuse a read of ``x`` into the second
    # write and copy all of ``x`` (the whole K/V cache) per swap: 35-90 ms a row operation at 32
    # slots on a CPU, where this costs a few ms.
    rows = jnp.take(x, jnp.stack([a, b]), axis=axis)
    return x.at[(slice(None),) * axis + (jnp.stack([b, a]),)].set(rows)


SWAP_CHUNK = 64  # cache positions a step of a K/V swap moves


def _swap_prefix(x: jax.Array, a: jax.Array, b: jax.Array, n: jax.Array, row_axis: int = 1) -> jax.Array:
    """Rows ``a`` and ``b`` of ``x [L, B, S, K, H]`` (or, ``row_axis`` 0, one layer's
    ``[B, K, S, H]``) exchanged at positions ``[0, n)`` (rounded up to a chunk), a chunk a step,
    each step one gather and one scatter in place."""
    chunk = math.gcd(x.shape[2], SWAP_CHUNK)  # chunks tile S exactly: none is swapped twice
    idx = jnp.stack([a, b])[:, None]
    back = jnp.stack([b, a])[:, None]
    at = (lambda r, p: (r, slice(None), p)) if row_axis == 0 else (lambda r, p: (slice(None), r, p))

    def body(c, x):
        pos = (c * chunk + jnp.arange(chunk, dtype=jnp.int32))[None, :]
        return x.at[at(back, pos)].set(x[at(idx, pos)])

    return jax.lax.fori_loop(0, (n + chunk - 1) // chunk, body, x)


def _swap_cache(c, a: jax.Array, b: jax.Array):
    # Positions at or past a row's length are invalid whatever they hold (the cache's contract),
    # so only the longer row's valid prefix moves: a request of 150 tokens in a 1024-position
    # cache moves 1/6 of its rows (auto at 32 clients spent 0.5 of 7.1 s on row operations
    # moving whole rows of the demo target's cache, 8 MB a row).
    n = jnp.where(a == b, 0, jnp.minimum(jnp.maximum(c.lengths[a], c.lengths[b]), c.max_len))  # a free: none
    if isinstance(c, LayerKVCache):
        swap = lambda xs: tuple(_swap_prefix(x, a, b, n, row_axis=0) for x in xs)  # noqa: E731
        return LayerKVCache(swap(c.k_layers), swap(c.v_layers), _swap(c.lengths, a, b, 0))
    return KVCache(_swap_prefix(c.k_lbskh, a, b, n), _swap_prefix(c.v_lbskh, a, b, n),
                   _swap(c.lengths, a, b, 0))


def swap_rows(tree, a: jax.Array, b: jax.Array):
    """Rows ``a`` and ``b`` exchanged in every per-row array (in place on a donated tree)."""

    def one(x):
        if isinstance(x, DENSE_CACHES):
            return _swap_cache(x, a, b)
        if isinstance(x, PagedKVCache):
            return PagedKVCache(x.k_lpskh, x.v_lpskh, _swap(x.page_table, a, b, 0), _swap(x.lengths, a, b, 0))
        if getattr(x, "ndim", 0) == 0:
            return x
        return _swap(x, a, b, 0)

    return jax.tree.map(one, tree, is_leaf=_is_cache)


OP_SWAP, OP_FREE = 0, 1


def apply_row_ops(tree, ops: jax.Array, count: jax.Array, mark_done=None):
    """The first ``count`` row operations of ``ops [k, 3]`` (``a, b, kind``), in order: swap rows
    ``a`` and ``b``, or (``OP_FREE``) ``mark_done(tree, a)``.  A loop on the device: no copy per
    operation, and the order is the host's (a free refers to the row at that moment)."""

    def body(i, t):
        a, b, kind = ops[i, 0], ops[i, 1], ops[i, 2]
        if mark_done is not None:
            t = mark_done(t, a, kind == OP_FREE)
        return swap_rows(t, a, jnp.where(kind == OP_FREE, a, b))

    return jax.lax.fori_loop(0, count, body, tree)


def window_mask(start: jax.Array, rows: int, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """``[rows]`` bool: the window rows whose index lies in ``[lo, hi)`` (the round's rows)."""
    idx = start + jnp.arange(rows, dtype=jnp.int32)
    return (idx >= lo) & (idx < hi)


class RowPlacement:
    """Which device row holds which slot's request: live rows stay packed at the low rows, in
    class order (class 0, then class 1: auto's speculative and plain groups), so a round runs over
    a window of the live rows only.  Every change is a list of row swaps the device replays in
    order (host bookkeeping here, the swaps in :func:`~d3d_jax.decoding.window.apply_swaps`)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.row_of: dict[int, int] = {}  # slot -> row
        self.slot_at: list[int | None] = [None] * num_slots  # row -> slot
        self.cls: dict[int, int] = {}  # slot -> class (0 or 1)
        self.boundary = 0  # rows [0, boundary) are class 0

    @property
    def size(self) -> int:
        return len(self.row_of)

    def _swap(self, a: int, b: int, ops: list) -> None:
        if a == b:
            return
        sa, sb = self.slot_at[a], self.slot_at[b]
        self.slot_at[a], self.slot_at[b] = sb, sa
        for slot, row in ((sa, b), (sb, a)):
            if slot is not None:
                self.row_of[slot] = row
        ops.append((a, b))

    def place(self, slot: int, cls: int = 0) -> list[tuple[int, int]]:
        """``slot`` takes the next free row (moved into its class's range); returns the swaps."""
        ops: list = []
        row = self.size
        self.slot_at[row], self.row_of[slot], self.cls[slot] = slot, row, 1
        if cls == 0:
            self.set_class(slot, 0, ops)
        return ops

    def remove(self, slot: int) -> list[tuple[int, int]]:
        """``slot`` leaves; the rows above close the gap (its row ends up past the live ones)."""
        ops: list = []
        if self.cls[slot] == 0:
            self.set_class(slot, 1, ops)
        self._swap(self.row_of[slot], self.size - 1, ops)
        self.slot_at[self.row_of.pop(slot)] = None
        del self.cls[slot]
        return ops

    def set_class(self, slot: int, cls: int, ops: list | None = None) -> list[tuple[int, int]]:
        ops = [] if ops is None else ops
        if self.cls[slot] != cls:
            if cls == 0:  # to the first class-1 row, which becomes class 0
                self._swap(self.row_of[slot], self.boundary, ops)
                self.boundary += 1
            else:  # to the last class-0 row, which becomes class 1
                self.boundary -= 1
                self._swap(self.row_of[slot], self.boundary, ops)
            self.cls[slot] = cls
        return ops

    def groups(self) -> list[tuple[int, int, int]]:
        """``(lo, hi, class)`` of each non-empty class range of rows."""
        spans = [(0, self.boundary, 0), (self.boundary, self.size, 1)]
        return [g for g in spans if g[1] > g[0]]
