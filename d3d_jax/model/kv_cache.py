"""A fixed-length, position-indexed KV cache shared by target and drafter.

Slot ``j`` of row ``b`` holds the K/V of the causal token at position ``j``; slots
``j >= lengths[b]`` are invalid (masked) whatever they contain, so rolling back rejected tokens
is just lowering ``lengths``.  Arrays are stacked over layers (``[L, B, S, K, H]``) so a whole
cache is three leaves that jitted cores can donate.

On CPU, for a model with as many KV heads as query heads, the reference attention reads a
:class:`LayerKVCache` instead: one heads-first array per layer (``[B, K, S, H]``).  XLA:CPU's dot takes whole buffers with the batch (head) dims major, so
a layer's span sliced out of the stacked arrays was copied per layer and step (8 / 8 heads at 576
slots: 1.7 ms of attention a step; 0.23 ms read in place).  Both kinds share one interface:
``batch``, ``max_len``, ``num_layers``, ``lengths``, ``with_lengths``, ``written``, ``inserted``,
``replaced`` and the stacked views ``k_lbskh`` / ``v_lbskh``.
"""

from __future__ import annotations

import contextlib
import contextvars
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

    def replaced(self, k_lbskh: jax.Array, v_lbskh: jax.Array, lengths: jax.Array) -> "KVCache":
        """A cache of this kind from stacked arrays (what row operations compute)."""
        return KVCache(k_lbskh, v_lbskh, lengths)

    def inserted(self, rows: "KVCache | LayerKVCache", slots: jax.Array) -> "KVCache":
        """``rows`` (``[L, n, P, ...]``, P <= S) written into ``slots`` of this cache."""
        p = rows.max_len
        return KVCache(self.k_lbskh.at[:, slots, :p].set(rows.k_lbskh, mode="drop"),
                       self.v_lbskh.at[:, slots, :p].set(rows.v_lbskh, mode="drop"),
                       self.lengths.at[slots].set(rows.lengths, mode="drop"))


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKVCache:
    """The dense cache as one heads-first array per layer (``[B, K, S, H]`` each): what the
    reference attention on CPU reads whole, in place (module doc).  Same contract and interface
    as :class:`KVCache`; ``k_lbskh`` / ``v_lbskh`` are stacked copies, for row operations."""

    k_layers: tuple[jax.Array, ...]  # L x [B, K, S, H]
    v_layers: tuple[jax.Array, ...]
    lengths: jax.Array  # [B] int32

    @property
    def batch(self) -> int:
        return self.k_layers[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k_layers[0].shape[2]

    @property
    def num_layers(self) -> int:
        return len(self.k_layers)

    @property
    def k_lbskh(self) -> jax.Array:
        return _stacked(self.k_layers)

    @property
    def v_lbskh(self) -> jax.Array:
        return _stacked(self.v_layers)

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """Layer ``i``'s ``(k, v)``, each ``[B, K, S, H]``; a traced ``i`` (a stacked model's
        layer scan) indexes a stacked copy."""
        if isinstance(i, int):
            return self.k_layers[i], self.v_layers[i]
        return jnp.stack(self.k_layers)[i], jnp.stack(self.v_layers)[i]

    def with_lengths(self, lengths: jax.Array) -> "LayerKVCache":
        return LayerKVCache(self.k_layers, self.v_layers, jnp.asarray(lengths, jnp.int32))

    def written(self, write: "PendingWrite", rows_b: jax.Array | None = None) -> "LayerKVCache":
        """The cache with ``write``'s kept rows scattered in (one scatter per layer, K and V)."""
        put = lambda xs, new: tuple(  # noqa: E731
            _write_layer(x, n, write.positions_bt, write.keep_bt, rows_b) for x, n in zip(xs, new))
        return LayerKVCache(put(self.k_layers, write.k_lbtkh), put(self.v_layers, write.v_lbtkh), self.lengths)

    def replaced(self, k_lbskh: jax.Array, v_lbskh: jax.Array, lengths: jax.Array) -> "LayerKVCache":
        return LayerKVCache(_layers(k_lbskh), _layers(v_lbskh), lengths)

    def inserted(self, rows: "KVCache | LayerKVCache", slots: jax.Array) -> "LayerKVCache":
        p = rows.max_len
        put = lambda xs, new: tuple(x.at[slots, :, :p].set(n, mode="drop")  # noqa: E731
                                    for x, n in zip(xs, _layers(new)))
        return LayerKVCache(put(self.k_layers, rows.k_lbskh), put(self.v_layers, rows.v_lbskh),
                            self.lengths.at[slots].set(rows.lengths, mode="drop"))


def _stacked(layers: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.stack([jnp.swapaxes(x, 1, 2) for x in layers])  # L x [B, K, S, H] -> [L, B, S, K, H]


def _layers(x_lbskh: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jnp.swapaxes(x, 1, 2) for x in x_lbskh)


def _write_layer(x_bksh, new_btkh, positions_bt, keep_bt, rows_b=None) -> jax.Array:
    b, t = positions_bt.shape
    idx = jnp.where(keep_bt, positions_bt, x_bksh.shape[2])  # out of range -> dropped
    rows_b = jnp.arange(b) if rows_b is None else rows_b
    rows = jnp.broadcast_to(rows_b[:, None], (b, t))
    return x_bksh.at[rows, :, idx].set(new_btkh.astype(x_bksh.dtype), mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKVWindow:
    """Rows ``start … start+rows-1`` of a :class:`LayerKVCache`, as :class:`KVWindow` is of a
    :class:`KVCache`; a window of every row reads the layers whole."""

    full: LayerKVCache
    lengths: jax.Array  # [rows]
    start: jax.Array  # [] int32
    rows: int = dataclasses.field(metadata=dict(static=True), default=1)

    batch = property(lambda self: self.rows)
    max_len = property(lambda self: self.full.max_len)
    num_layers = property(lambda self: self.full.num_layers)

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        k, v = self.full.layer(i)
        if self.rows == self.full.batch:
            return k, v
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, self.start, self.rows, axis=0)  # noqa: E731
        return cut(k), cut(v)

    def with_lengths(self, lengths: jax.Array) -> "LayerKVWindow":
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def written(self, write: "PendingWrite") -> "LayerKVWindow":
        rows = self.start + jnp.arange(self.rows, dtype=jnp.int32)
        return dataclasses.replace(self, full=self.full.written(write, rows))

    @staticmethod
    def of(cache: LayerKVCache, start: jax.Array, rows: int) -> "LayerKVWindow":
        lengths = jax.lax.dynamic_slice_in_dim(cache.lengths, start, rows)
        return LayerKVWindow(cache, lengths, jnp.asarray(start, jnp.int32), rows)

    def merged(self, full_lengths: jax.Array, keep: jax.Array) -> LayerKVCache:
        old = jax.lax.dynamic_slice_in_dim(full_lengths, self.start, self.rows)
        lengths = jax.lax.dynamic_update_slice_in_dim(
            full_lengths, jnp.where(keep, self.lengths, old), self.start, 0)
        return self.full.with_lengths(lengths)


DENSE_CACHES = (KVCache, LayerKVCache)  # both layouts of the dense cache (module doc)

_PLATFORM = contextvars.ContextVar("kv_cache_platform", default=None)


@contextlib.contextmanager
def caches_for(platform: str):
    """Caches made inside are laid out for ``platform`` (a compile-only program for another
    device), not for the host's default backend."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def per_layer(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s caches are :class:`LayerKVCache`: the reference attention on CPU with as
    many KV heads as query heads (fused kernels and accelerators read the stacked arrays in place;
    a GQA model's engine step at two threads was slower per layer, 0.66-0.74 against 0.46-0.48
    ms/token at 4 / 2 heads, where YNNPACK splits the stacked all-pairs products over threads)."""
    return (cfg.attention_backend == "xla" and cfg.num_heads == cfg.num_kv_heads
            and (_PLATFORM.get() or jax.default_backend()) == "cpu")


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None,
               layered: bool | None = None) -> KVCache | LayerKVCache:
    """An empty cache; ``layered`` (default :func:`per_layer`) picks :class:`LayerKVCache`."""
    dt = jnp.dtype(dtype or cfg.dtype)
    lengths = jnp.zeros((batch,), jnp.int32)
    if per_layer(cfg) if layered is None else layered:
        zeros = lambda: tuple(jnp.zeros((batch, cfg.num_kv_heads, max_len, cfg.head_dim), dt)  # noqa: E731
                              for _ in range(cfg.num_layers))
        return LayerKVCache(zeros(), zeros(), lengths)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt), lengths)


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
