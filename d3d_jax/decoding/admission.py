"""Admission: the requests inserted between two rounds are prefilled and written into their rows
in ONE dispatch.

The program loops over the admitted rows on the device (a ``fori_loop`` with a traced count, so
one program serves 1 or 32 arrivals).  Its rows share one prompt-length bucket
(:func:`~d3d_jax.decoding.decoder_config.prompt_buckets`): the decoder admits each bucket's rows
in a dispatch of their own, so a short prompt never pays for a long one, and a program holds one
prefill, not one branch per bucket (those were most of a small model's first compile).  One
program per decoder side and bucket, compiled when first used: none per arrival count.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from d3d_jax.decoding.core import RowInput
from d3d_jax.model.kv_cache import KVCache


def row_at(rows: RowInput, i: jax.Array) -> RowInput:
    """Row ``i`` of every per-row input (a batch of one)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=0), rows)


def pad_caches(tree, length: int):
    """Every :class:`KVCache` in ``tree`` padded to ``length`` slots (one shape for all buckets)."""

    def pad(x):
        if not isinstance(x, KVCache):
            return x
        extra = ((0, 0), (0, 0), (0, length - x.max_len), (0, 0), (0, 0))
        return KVCache(jnp.pad(x.k_lbskh, extra), jnp.pad(x.v_lbskh, extra), x.lengths)

    return jax.tree.map(pad, tree, is_leaf=lambda x: isinstance(x, KVCache))


def admit(tree, rows: RowInput, index: jax.Array, count: jax.Array, *, prefill: Callable,
          insert: Callable, cache_len: int):
    """``tree`` with rows ``index[:count]`` filled by ``insert(tree, prefill(row), slot [1])``.

    ``prefill(row)`` gets one request at the rows' prompt width (their bucket); its caches are
    padded to ``cache_len``, the state's length, and written in place."""

    def body(i, t):
        parts = pad_caches(prefill(row_at(rows, i)), cache_len)
        return insert(t, parts, jax.lax.dynamic_slice_in_dim(index, i, 1))

    return jax.lax.fori_loop(0, count, body, tree)
