"""A paged KV cache: K/V in a pool of fixed-size pages, each row reading its tokens through a page table.

Position ``p`` of row ``b`` lives at offset ``p % page_size`` of page ``page_table[b, p // page_size]``
of a pool ``[L, num_pages, page_size, K, H]`` shared by every row.  A row holds pages only for
the tokens it has, and rows with a common prefix may map the same full pages (the host's
:class:`~d3d_jax.decoding.page_pool.PagePool` decides who holds what).  Everything else follows
:class:`~d3d_jax.model.kv_cache.KVCache`'s contract: positions ``>= lengths[b]`` are invalid
whatever they hold, so rolling back is lowering ``lengths``, and a forward writes only at positions
at or past a row's length.  That is also why sharing is safe: a shared page is full, below every
sharer's length, so no sharer ever writes into it.

Page-table entries outside ``[0, num_pages)`` (:data:`UNMAPPED`) are pages a row does not hold:
a write there is dropped, a read of one is clipped to some page and masked by ``lengths``.  A
free or finished row with an unmapped table can therefore keep computing (masks, not branches)
without touching another row's pages.

The model sees "a cache" (``lengths``, ``max_len``, ``written``); only the attention prefix
differs: a :class:`~d3d_jax.model.attention.PagedLayer`, which the fused decode kernels read
through the table in place (a key tile is a page or part of one) and the ``xla`` reference
reads as a gather of the row's span.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from d3d_jax.config import ModelConfig
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model.attention import PagedLayer, PagedSpans
from d3d_jax.model.masks import TokenMeta, causal_meta

UNMAPPED = -1  # a page-table entry no page stands behind


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    k_lpskh: jax.Array  # [L, num_pages, page_size, K, H] the pool, shared by every row
    v_lpskh: jax.Array
    page_table: jax.Array  # [B, max_pages] int32, UNMAPPED where a row holds no page
    lengths: jax.Array  # [B] int32: number of valid (committed) positions per row

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_lpskh.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k_lpskh.shape[1]

    @property
    def max_len(self) -> int:
        """The longest a row can grow: its table's pages, full."""
        return self.page_table.shape[1] * self.page_size

    @property
    def num_layers(self) -> int:
        return self.k_lpskh.shape[0]

    def with_lengths(self, lengths: jax.Array) -> "PagedKVCache":
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def with_page_table(self, page_table: jax.Array) -> "PagedKVCache":
        return dataclasses.replace(self, page_table=jnp.asarray(page_table, jnp.int32))

    def written(self, write: kvc.PendingWrite) -> "PagedKVCache":
        """The cache with ``write``'s kept rows scattered to their pages (one scatter per K and V)."""
        page, offset = self.locate(write.positions_bt, write.keep_bt)
        return dataclasses.replace(self, k_lpskh=_scatter(self.k_lpskh, write.k_lbtkh, page, offset),
                                   v_lpskh=_scatter(self.v_lpskh, write.v_lbtkh, page, offset))

    def locate(self, positions_bt: jax.Array, keep_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(page, offset)`` of each row's positions; ``page = num_pages`` (dropped by a scatter)
        where a token is not kept, lies past the table or falls in an unmapped page."""
        ps, m = self.page_size, self.page_table.shape[1]
        slot = positions_bt // ps
        inside = keep_bt & (positions_bt >= 0) & (slot < m)
        page = jnp.take_along_axis(self.page_table, jnp.clip(slot, 0, m - 1), axis=1)
        mapped = inside & (page >= 0) & (page < self.num_pages)
        return jnp.where(mapped, page, self.num_pages), positions_bt % ps

    def inserted(self, rows, pages: jax.Array, slots: jax.Array) -> "PagedKVCache":
        """Prefilled rows joining ``slots``: dense rows (``[L, n, P, ...]``) get their page tables
        ``pages [n, max_pages]`` set and their valid positions scattered to those pages; rows
        prefilled in place through their own tables (a :class:`PagedKVCache` over this pool:
        :func:`prefilled`) only bring their tables and lengths."""
        put = lambda full, new: full.at[slots].set(new, mode="drop")  # noqa: E731
        if isinstance(rows, PagedKVCache):
            return PagedKVCache(self.k_lpskh, self.v_lpskh, put(self.page_table, rows.page_table),
                                put(self.lengths, rows.lengths))
        n, p = rows.batch, rows.max_len
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
        write = kvc.PendingWrite(rows.k_lbskh, rows.v_lbskh, pos, pos < rows.lengths[:, None])
        own = PagedKVCache(self.k_lpskh, self.v_lpskh, pages, rows.lengths).written(write)
        return PagedKVCache(own.k_lpskh, own.v_lpskh, put(self.page_table, pages),
                            put(self.lengths, rows.lengths))

    def only_rows(self, active: jax.Array) -> "PagedKVCache":
        """The cache with the tables of rows not ``active`` unmapped: they write nothing (their
        stale tables may map pages another request holds by now) and read masked garbage."""
        return self.with_page_table(jnp.where(active[:, None], self.page_table, UNMAPPED))

    def window(self, start: jax.Array, rows: int) -> "PagedKVCache":
        """Rows ``start … start+rows-1``: their tables and lengths over the same pool (no copy)."""
        table = jax.lax.dynamic_slice_in_dim(self.page_table, start, rows, axis=0)
        lengths = jax.lax.dynamic_slice_in_dim(self.lengths, start, rows)
        return PagedKVCache(self.k_lpskh, self.v_lpskh, table, lengths)

    def prefix_of(self, metas: tuple[TokenMeta, ...], index: jax.Array | None):
        """``i ->`` layer ``i``'s attention prefix: at one span, or at the device-chosen one of several."""
        if len(metas) == 1:
            return lambda i: PagedLayer(self.k_lpskh, self.v_lpskh, self.page_table, metas[0], i)
        return lambda i: PagedSpans(self.k_lpskh, self.v_lpskh, self.page_table, metas, index, i)


def prefilled(cache: PagedKVCache, pages: jax.Array, lengths: jax.Array) -> PagedKVCache:
    """Rows whose first ``lengths`` positions a chunked prefill wrote through their tables
    ``pages``, over ``cache``'s pool: what :meth:`PagedKVCache.inserted` takes to join them."""
    return PagedKVCache(cache.k_lpskh, cache.v_lpskh, pages, jnp.asarray(lengths, jnp.int32))


def _scatter(pool: jax.Array, new_lbtkh: jax.Array, page_bt: jax.Array, offset_bt: jax.Array) -> jax.Array:
    return pool.at[:, page_bt, offset_bt].set(new_lbtkh.astype(pool.dtype), mode="drop")


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int, batch: int, max_pages: int,
                     dtype: str | None = None) -> PagedKVCache:
    """An empty pool of ``num_pages`` pages and ``batch`` rows holding none."""
    if num_pages < 1 or page_size < 1 or max_pages < 1:
        raise ValueError(f"paged cache: num_pages {num_pages}, page_size {page_size} and "
                         f"max_pages {max_pages} must all be >= 1")
    dt = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return PagedKVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt),
                        jnp.full((batch, max_pages), UNMAPPED, jnp.int32), jnp.zeros((batch,), jnp.int32))


def page_bytes(cfg: ModelConfig, page_size: int, dtype: str | None = None) -> int:
    """Bytes one page of ``cfg``'s pool takes (K and V, every layer).  Target and drafter pools
    share page ids, so a page of the pair costs the sum of both models' figures."""
    dt = jnp.dtype(dtype or cfg.dtype)
    return 2 * cfg.num_layers * int(page_size) * cfg.num_kv_heads * cfg.head_dim * dt.itemsize


def only_rows(cache, active: jax.Array):
    """:meth:`PagedKVCache.only_rows` for a paged cache; any other state as it is."""
    return cache.only_rows(active) if isinstance(cache, PagedKVCache) else cache


def row_positions(cache: PagedKVCache, span: int) -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` ``[L, B, span, K, H]``: every row's first ``span`` positions read through its
    table (unmapped pages clipped; what they give is invalid) — for tests and for moving rows."""
    n = -(-span // cache.page_size)
    pages = jnp.clip(cache.page_table[:, :n], 0, cache.num_pages - 1)
    l, _, ps, k, h = cache.k_lpskh.shape
    b = cache.batch

    def read(pool):
        return pool[:, pages].reshape(l, b, n * ps, k, h)[:, :, :span]

    return read(cache.k_lpskh), read(cache.v_lpskh)


def prefill_chunk(model, cache: PagedKVCache, tokens_bc: jax.Array, count_b: jax.Array):
    """Chunked prefill ("extend"): row ``b``'s first ``count_b[b]`` of ``tokens_bc [B, C]`` at
    positions ``lengths[b] …``, attending to the row's cached positions and causally to each
    other, their K/V written to the row's pages.  Returns ``(logits [B, C, V], cache)`` with
    ``lengths + count``.

    Only ``C`` is static: the cache span is a device-chosen bucket
    (:func:`~d3d_jax.model.kv_cache.call_with_span`), so one program serves every prompt length
    and every offset, a prefix another row computed included.  The caller maps pages for the
    chunk's positions first; a token past them is not written (and its logits are garbage).
    """
    c = tokens_bc.shape[1]
    count_b = jnp.asarray(count_b, jnp.int32)
    pos = cache.lengths[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
    meta = causal_meta(pos, jnp.arange(c, dtype=jnp.int32)[None] < count_b[:, None])

    def forward(span, cache, tokens, meta):
        return model(tokens, meta, cache=cache, cache_span=span, defer_cache_write=True)

    logits, write = kvc.call_with_span(forward, jnp.max(cache.lengths), cache,
                                       jnp.asarray(tokens_bc, jnp.int32), meta)
    return logits, write.apply(cache).with_lengths(cache.lengths + count_b)
