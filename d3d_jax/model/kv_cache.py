"""A fixed-length, position-indexed KV cache shared by target and drafter.

Slot ``j`` of row ``b`` holds the K/V of the causal token at position ``j``; slots
``j >= lengths[b]`` are invalid (masked) whatever they contain, so rolling back rejected tokens
is just lowering ``lengths``.  Arrays are stacked over layers (``[L, B, S, K, H]``) so a whole
cache is three leaves that jitted cores can donate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from d3d_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k_lbskh: jax.Array  # [L, B, S, K, H]
    v_lbskh: jax.Array  # [L, B, S, K, H]
    lengths: jax.Array  # [B] int32: number of valid (committed) positions per row

    @property
    def batch(self) -> int:
        return self.k_lbskh.shape[1]

    @property
    def max_len(self) -> int:
        return self.k_lbskh.shape[2]

    @property
    def num_layers(self) -> int:
        return self.k_lbskh.shape[0]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return KVCache(self.k_lbskh, self.v_lbskh, jnp.asarray(lengths, jnp.int32))

    def written(self, write: "PendingWrite") -> "KVCache":
        """The cache with ``write``'s kept rows scattered in (one scatter per K and V)."""
        return KVCache(write_all(self.k_lbskh, write.k_lbtkh, write.positions_bt, write.keep_bt),
                       write_all(self.v_lbskh, write.v_lbtkh, write.positions_bt, write.keep_bt),
                       self.lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVWindow:
    """Rows ``start … start+rows-1`` of a full cache, read and written in place.

    A round over a few live rows of a many-slot cache must not copy the cache: ``k_lbskh`` slices
    lazily (the model slices it again per layer and span, and XLA fuses both slices into one
    read), and :meth:`written` scatters into the full arrays at the window's rows.  ``lengths``
    are the window's own rows.  Anything that reads a :class:`KVCache` reads a window alike.
    """

    k_full: jax.Array  # [L, B, S, K, H] the whole cache
    v_full: jax.Array
    lengths: jax.Array  # [rows]
    start: jax.Array  # [] int32 first row of the window
    rows: int = dataclasses.field(metadata=dict(static=True), default=1)

    @property
    def k_lbskh(self) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(self.k_full, self.start, self.rows, axis=1)

    @property
    def v_lbskh(self) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(self.v_full, self.start, self.rows, axis=1)

    @property
    def batch(self) -> int:
        return self.rows

    @property
    def max_len(self) -> int:
        return self.k_full.shape[2]

    @property
    def num_layers(self) -> int:
        return self.k_full.shape[0]

    def with_lengths(self, lengths: jax.Array) -> "KVWindow":
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def written(self, write: "PendingWrite") -> "KVWindow":
        rows = self.start + jnp.arange(self.rows, dtype=jnp.int32)
        k = write_all(self.k_full, write.k_lbtkh, write.positions_bt, write.keep_bt, rows)
        v = write_all(self.v_full, write.v_lbtkh, write.positions_bt, write.keep_bt, rows)
        return dataclasses.replace(self, k_full=k, v_full=v)

    @staticmethod
    def of(cache: KVCache, start: jax.Array, rows: int) -> "KVWindow":
        lengths = jax.lax.dynamic_slice_in_dim(cache.lengths, start, rows)
        return KVWindow(cache.k_lbskh, cache.v_lbskh, lengths, jnp.asarray(start, jnp.int32), rows)

    def merged(self, full_lengths: jax.Array, keep: jax.Array) -> KVCache:
        """The full cache again; window rows where ``keep`` is False keep their old lengths."""
        old = jax.lax.dynamic_slice_in_dim(full_lengths, self.start, self.rows)
        lengths = jax.lax.dynamic_update_slice_in_dim(
            full_lengths, jnp.where(keep, self.lengths, old), self.start, 0)
        return KVCache(self.k_full, self.v_full, lengths)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> KVCache:
    dt = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros((batch,), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PendingWrite:
    """New K/V rows of one forward, not yet scattered into a cache (see ``defer_cache_write``)."""

    k_lbtkh: jax.Array
    v_lbtkh: jax.Array
    positions_bt: jax.Array
    keep_bt: jax.Array

    def pad_to(self, t: int) -> "PendingWrite":
        """Pad to ``t`` tokens (not kept), so branches of different widths return one shape."""
        extra = t - self.positions_bt.shape[1]
        if extra == 0:
            return self
        pad5 = ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0))
        return PendingWrite(jnp.pad(self.k_lbtkh, pad5), jnp.pad(self.v_lbtkh, pad5),
                            jnp.pad(self.positions_bt, ((0, 0), (0, extra))),
                            jnp.pad(self.keep_bt, ((0, 0), (0, extra))))

    def apply(self, cache):
        """``cache`` (a :class:`KVCache` or a :class:`KVWindow`) with these rows written."""
        return cache.written(self)


def write_all(cache_lbskh: jax.Array, new_lbtkh: jax.Array, positions_bt: jax.Array,
              keep_bt: jax.Array, rows_b: jax.Array | None = None) -> jax.Array:
    """One scatter of every layer's new K or V rows into the stacked cache.

    Writing once after the layer loop (instead of per layer, then stacking) keeps XLA from
    copying the whole cache once per layer: on CPU that copy made a 4-layer step at batch 8
    and 1024 slots ~10x slower than the attention itself.
    """
    b, t = positions_bt.shape
    s = cache_lbskh.shape[2]
    idx = jnp.where(keep_bt, positions_bt, s)  # out of range -> dropped
    rows_b = jnp.arange(b) if rows_b is None else rows_b  # a window writes its own rows
    rows = jnp.broadcast_to(rows_b[:, None], (b, t))
    return cache_lbskh.at[:, rows, idx].set(new_lbtkh.astype(cache_lbskh.dtype), mode="drop")


MIN_SPAN = 128  # smallest attention span bucket (slots)


def span_buckets(cache_len: int, min_span: int = MIN_SPAN) -> tuple[int, ...]:
    """Static attention spans for a cache of ``cache_len`` slots: ``min_span`` doubling, then the
    whole cache.  A span within 1.5x of the cache is no bucket: it would save under a third of the
    attention it serves, and each bucket is one more attention per layer in every decode program
    (a sync loop of the demo models compiled in 7.0 s with (128, 176), 4.9 s with (176,))."""
    spans, s = [], min_span
    while 3 * s <= 2 * cache_len:
        spans.append(s)
        s *= 2
    return tuple(spans) + (cache_len,)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpanChoice:
    """The smallest of ``spans`` (static buckets) that holds every valid cache slot, picked on the
    device by ``index``: a model given it as ``cache_span`` switches its attention alone."""

    index: jax.Array  # [] int32 into spans
    spans: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @staticmethod
    def of(needed: jax.Array, cache_len: int) -> "SpanChoice | int":
        spans = span_buckets(cache_len)
        if len(spans) == 1:
            return spans[0]
        index = jnp.searchsorted(jnp.asarray(spans, jnp.int32), jnp.asarray(needed, jnp.int32))
        return SpanChoice(jnp.minimum(index, len(spans) - 1).astype(jnp.int32), spans)


def call_with_span(fn, needed: jax.Array, cache: KVCache, *operands):
    """``fn(span, cache, *operands) -> (out, PendingWrite)`` with ``span`` a :class:`SpanChoice`
    of the smallest bucketed span ``>= needed`` (a traced scalar), for the model's ``cache_span``.

    Attention over a fixed-length cache otherwise costs every slot every step (at 576 slots and
    ~200 committed tokens most of the work is masked out).  Only the attention over the cache
    switches between buckets (inside the layer scan): the projections, MLP and head are in the
    program once, whatever the number of buckets.  Fused kernels visit only live key tiles, so
    they take the whole cache and no switch at all.
    """
    return fn(SpanChoice.of(needed, cache.max_len), cache, *operands)
