"""Row windows and row swaps over the decoder's device state (any pytree of per-row arrays).

A round runs over a *window*: rows ``start … start+rows-1`` of the state, ``rows`` one of a few
static widths (:attr:`DecoderConfig.buckets`), ``start`` traced.  The live requests are kept
packed at the low rows (:class:`~d3d_jax.decoding.placement.RowPlacement`), so a round's cost
follows the live requests, not the slots.  Rule for the pytrees: a
:class:`~d3d_jax.model.kv_cache.KVCache` becomes a :class:`~d3d_jax.model.kv_cache.KVWindow`
(read and written in place, never copied); every other array of rank >= 1 has its rows on axis
0 and is sliced; scalars pass through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from d3d_jax.model.kv_cache import KVCache, KVWindow


def _is_cache(x) -> bool:
    return isinstance(x, (KVCache, KVWindow))


def view(tree, start: jax.Array, rows: int):
    """The window's rows of ``tree`` (see the module doc)."""

    def one(x):
        if isinstance(x, KVCache):
            return KVWindow.of(x, start, rows)
        if getattr(x, "ndim", 0) == 0:
            return x
        return jax.lax.dynamic_slice_in_dim(x, start, rows, axis=0)

    return jax.tree.map(one, tree, is_leaf=_is_cache)


def merge(full, window, keep: jax.Array, start: jax.Array):
    """``full`` with the window written back; rows where ``keep [rows]`` is False keep their old
    per-row values (caches: their lengths; what a skipped row's forward wrote sits past its
    length, where it is invalid whatever it holds)."""

    def one(old, new):
        if isinstance(old, KVCache):
            return new.merged(old.lengths, keep)
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


def swap_rows(tree, a: jax.Array, b: jax.Array):
    """Rows ``a`` and ``b`` exchanged in every per-row array (in place on a donated tree)."""

    def one(x):
        if isinstance(x, KVCache):
            return KVCache(_swap(x.k_lbskh, a, b, 1), _swap(x.v_lbskh, a, b, 1),
                           _swap(x.lengths, a, b, 0))
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
