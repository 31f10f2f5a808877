"""Admission: the requests inserted between two rounds are prefilled and written into their rows
in ONE dispatch (issue 26 item 7).

The program loops over the admitted rows on the device (a ``fori_loop`` with a traced count, so
one program serves 1 or 32 arrivals).  Each row is prefilled at its own prompt-length bucket
(:func:`~d3d_jax.decoding.decoder_config.prompt_buckets`, one ``lax.switch`` branch per bucket:
a short prompt never pays for a long one) and written into the state in place.  One program per
decoder side, compiled once: no compile per arrival count or prompt length.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from d3d_jax.decoding.core import RowInput
from d3d_jax.model.kv_cache import KVCache


def row_at(rows: RowInput, i: jax.Array) -> RowInput:
    """Row ``i`` of every per-row input (a batch of one)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=0), rows)


def cut_prompt(rows: RowInput, length: int) -> RowInput:
    return dataclasses.replace(rows, prompt=rows.prompt[:, :length])


def pad_caches(tree, length: int):
    """Every :class:`KVCache` in ``tree`` padded to ``length`` slots (one shape for all buckets)."""

    def pad(x):
        if not isinstance(x, KVCache):
            return x
        extra = ((0, 0), (0, 0), (0, length - x.max_len), (0, 0), (0, 0))
        return KVCache(jnp.pad(x.k_lbskh, extra), jnp.pad(x.v_lbskh, extra), x.lengths)

    return jax.tree.map(pad, tree, is_leaf=lambda x: isinstance(x, KVCache))


def admit(tree, rows: RowInput, index: jax.Array, count: jax.Array, *, prefill: Callable,
          insert: Callable, buckets: tuple[int, ...], cache_len: int):
    """``tree`` with rows ``index[:count]`` filled by ``insert(tree, prefill(row), slot [1])``.

    ``prefill(row)`` gets one request cut to its prompt bucket; its caches are padded to
    ``cache_len`` so every bucket's branch returns one shape (the write happens outside the
    switch, in place, never inside a branch, where XLA would copy the state first)."""
    edges = jnp.asarray(buckets, jnp.int32)

    def branch(length):
        return lambda r: pad_caches(prefill(cut_prompt(r, length)), cache_len)

    def body(i, t):
        r = row_at(rows, i)
        k = jnp.minimum(jnp.searchsorted(edges, r.prompt_len[0]), len(buckets) - 1)
        parts = jax.lax.switch(k, [branch(b) for b in buckets], r)
        return insert(t, parts, jax.lax.dynamic_slice_in_dim(index, i, 1))

    return jax.lax.fori_loop(0, count, body, tree)
