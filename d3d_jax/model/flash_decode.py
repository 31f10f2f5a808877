"""Flash-decoding for the short-query forwards: decode, verify, the drafting forward, the branch pack.

A few queries over a long KV cache give the training kernel's grid (one CTA per query head and
query tile) too few CTAs, each re-reading its kv head's whole cache.  Here instead:

* the ``g`` query heads of a GQA group are stacked into the query rows (row ``t * g + j`` is
  token ``t``, head ``j`` of the group), so a kv head's cache is read once for all of them;
* a row tile's live key tiles (the same compacted list as the training kernel's) are split
  evenly across ``splits`` CTAs (``split_count``: enough for every SM of the GPU), each writing
  a float32 partial output and its log-sum-exp, merged in XLA by log-sum-exp;
* the cache is read in place: K/V may be the whole stacked cache ``[L, B, S_max, K, H]`` with the
  layer index as data (the layer scan's step; no slice copy), rows and a ragged last key tile are
  masked loads (no pad);
* a paged cache is read through its page table: K/V are the whole pool ``[L, num_pages,
  page_size, K, H]`` and the row's table an operand, each key tile a page or a part of one
  (vLLM's PagedAttention layout), so paging costs no gather of the span.

Forward only; :func:`~d3d_jax.model.flash_attention.flash_attention` (``decode=True``) wraps it
with the training kernels' backward for inputs that need gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from d3d_jax.model import flash_kernels as fk

GPU_SMS = 132  # H200 / H100 SXM streaming multiprocessors: the CTA count to fill
DECODE_WARPS = 4


def split_count(key_tiles: int, other_ctas: int, sms: int = GPU_SMS) -> int:
    """Key splits per row tile: the fewest that give ``>= sms`` CTAs (each split >= 1 key tile)."""
    return max(1, min(key_tiles, -(-sms // max(other_ctas, 1))))


def _masked_rows(ref, start, size, rows, other=0):
    """``ref[start:start+size]`` along the row axis, rows ``>= rows`` read as ``other``."""
    if rows % size == 0:
        return ref[pl.ds(pl.multiple_of(start, size), size)]
    from jax.experimental.pallas import triton as plgpu

    inside = start + jnp.arange(size) < rows
    mask = inside if ref.ndim == 1 else inside[:, None]
    return plgpu.load(ref.at[pl.ds(start, size)], mask=mask, other=other)


def _store_rows(ref, x, start, rows):
    if rows % x.shape[0] == 0:
        ref[pl.ds(pl.multiple_of(start, x.shape[0]), x.shape[0])] = x
        return
    from jax.experimental.pallas import triton as plgpu

    inside = start + jnp.arange(x.shape[0]) < rows
    plgpu.store(ref.at[pl.ds(start, x.shape[0])], x, mask=inside if x.ndim == 1 else inside[:, None])


def _decode_kernel(tiles_ref, count_ref, layer_ref, *refs, br, bk, rows, s_len, splits, page_size):
    if page_size:  # a paged cache: its page table comes first
        table_ref, *refs = refs
    q_ref, k_ref, v_ref, qctx_ref, qbid_ref, kpos_ref, kbid_ref, o_ref, lse_ref = refs
    r0 = pl.program_id(2) * br
    q = _masked_rows(q_ref, r0, br, rows)
    qctx = _masked_rows(qctx_ref, r0, br, rows, fk.INT_MIN)
    qbid = _masked_rows(qbid_ref, r0, br, rows, fk.Q_NO_BLOCK)
    count = count_ref[...]
    per = (count + splits - 1) // splits  # this row tile's live tiles, spread over the splits
    lo = pl.program_id(3) * per
    layer = layer_ref[0]

    def body(j, carry):
        start = tiles_ref[j] * bk
        if page_size:
            k, v, kpos, kbid = _page_tile((k_ref, v_ref, kpos_ref, kbid_ref), table_ref, start, bk, s_len,
                                          layer, page_size)
        else:
            k, v, kpos, kbid = fk._key_tile((k_ref, v_ref, kpos_ref, kbid_ref), start, bk, s_len, layer)
        return fk.fwd_step(carry, q, k, v, fk.visible(qctx, qbid, kpos, kbid))

    out, lse = fk.fwd_finish(lax.fori_loop(lo, jnp.minimum(lo + per, count), body, fk.fwd_init(*q.shape)))
    _store_rows(o_ref, out, r0, rows)
    _store_rows(lse_ref, lse.reshape(br), r0, rows)


def _page_tile(refs, table_ref, start, bk, s_len, layer, page_size):
    """The key tile at position ``start`` of a paged cache: K/V from offset ``start % page_size``
    of page ``table[start // page_size]`` (a tile never straddles pages: ``bk`` divides the page
    size, and a page is whole, so K/V need no masked load), metadata by position as dense."""
    k_ref, v_ref, kpos_ref, kbid_ref = refs
    page = table_ref[start // page_size]
    offset = start % page_size
    return (fk._load(k_ref, offset, bk, None, 0, (layer, page)), fk._load(v_ref, offset, bk, None, 0, (layer, page)),
            fk._load(kpos_ref, start, bk, s_len, fk.INT_MAX), fk._load(kbid_ref, start, bk, s_len, fk.K_NO_BLOCK))


def decode_partials(q_bmrh, k, v, layer, qctx, qbid, kpos, kbid, tiles, count, *, br: int, bk: int,
                    splits: int, interpret: bool, page_table=None):
    """``(out [B, K, P, R, H] f32, lse [B, K, P, R])`` of stacked rows over split key ranges.

    ``k``/``v`` are ``[L, B, S_max, K, H]`` (layer ``layer``, an int32 scalar, is read); the
    keys' metadata covers the first ``S <= S_max`` slots, and only those are read.  With
    ``page_table [B, max_pages]`` (entries in the pool), ``k``/``v`` are a paged pool
    ``[L, num_pages, page_size, K, H]`` (``bk`` divides ``page_size``) and row ``b``'s position
    ``p`` is read at page ``page_table[b, p // page_size]``: the pool is the operand, no gather.
    """
    b, kh, rows, h = q_bmrh.shape
    s = kpos.shape[1]
    page_size = k.shape[2] if page_table is not None else 0
    s_max = page_table.shape[1] * page_size if page_size else k.shape[2]
    if s > s_max:
        raise ValueError(f"decode_partials: key metadata for {s} slots, the cache has {s_max}")
    if page_size % bk:
        raise ValueError(f"decode_partials: key tile {bk} does not divide the page size {page_size}")
    nr, nk = pl.cdiv(rows, br), tiles.shape[-1]
    kernel = functools.partial(_decode_kernel, br=br, bk=bk, rows=rows, splits=splits,
                               s_len=s if s % bk else None, page_size=page_size)
    if page_size:  # the whole pool of kv head m; the rows' tables pick its pages
        kv = pl.BlockSpec((k.shape[0], k.shape[1], page_size, None, h), lambda b, m, r, p: (0, 0, 0, m, 0))
        paged = [pl.BlockSpec((None, page_table.shape[1]), lambda b, m, r, p: (b, 0))]
    else:
        kv = pl.BlockSpec((k.shape[0], None, s_max, None, h), lambda b, m, r, p: (0, b, 0, m, 0))
        paged = []
    row_meta = pl.BlockSpec((None, rows), lambda b, m, r, p: (b, 0))
    key_meta = pl.BlockSpec((None, s), lambda b, m, r, p: (b, 0))
    in_specs = [pl.BlockSpec((None, None, nk), lambda b, m, r, p: (b, r, 0)),
                pl.BlockSpec((None, None), lambda b, m, r, p: (b, r)),
                pl.BlockSpec((1,), lambda b, m, r, p: (0,)), *paged,
                pl.BlockSpec((None, None, rows, h), lambda b, m, r, p: (b, m, 0, 0)),
                kv, kv, row_meta, row_meta, key_meta, key_meta]
    out_specs = [pl.BlockSpec((None, None, None, rows, h), lambda b, m, r, p: (b, m, p, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda b, m, r, p: (b, m, p, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, kh, splits, rows, h), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, splits, rows), jnp.float32)]
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=DECODE_WARPS, num_stages=fk.GPU_STAGES)
    table = [] if page_table is None else [page_table.astype(jnp.int32)]
    return pl.pallas_call(kernel, grid=(b, kh, nr, splits), in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=interpret, compiler_params=params,
                          name="d3d_flash_decode")(tiles, count, jnp.reshape(layer, (1,)).astype(jnp.int32), *table,
                                                   q_bmrh, k, v, qctx, qbid, kpos, kbid)


def merge_splits(out, lse):
    """Log-sum-exp merge over axis 2 of ``decode_partials``: ``(out [B,K,R,H] f32, lse [B,K,R])``."""
    m = jnp.max(lse, axis=2)
    w = jnp.exp(lse - m[:, :, None])  # a row no split saw: every weight 1, every output 0
    total = jnp.sum(w, axis=2)
    merged = jnp.sum(w[..., None] * out, axis=2) / total[..., None]
    return merged, jnp.where(m > fk.NEG / 2, m + jnp.log(total), fk.NEG)


def decode_forward(q, k, v, layer, qctx, qbid, kpos, kbid, vis_fn, *, block_k: int, out_dtype,
                   interpret: bool, sms: int = GPU_SMS, page_table=None):
    """``(out [B,T,N,H], lse [B,N,T])`` with the group's heads stacked into rows and keys split.

    ``k``/``v``: ``[L, B, S_max, K, H]``, or with ``page_table`` a pool ``[L, num_pages,
    page_size, K, H]`` read through it (key tiles no larger than a page);
    ``vis_fn(qctx, qbid, kpos, kbid, block_r, block_k)`` is
    the tile test (rows carry their token's metadata).
    """
    from d3d_jax.model.flash_kernels import live_tiles, tile_size

    b, t, n, h = q.shape
    kh = k.shape[3]
    g = n // kh
    rows = t * g
    q_bmrh = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, rows, h)
    row_ctx, row_bid = jnp.repeat(qctx, g, axis=1), jnp.repeat(qbid, g, axis=1)
    br, bk = tile_size(rows, 64), tile_size(kpos.shape[1], block_k)
    if page_table is not None:
        bk = min(bk, k.shape[2])
    tiles, count = live_tiles(vis_fn(row_ctx, row_bid, kpos, kbid, br, bk))
    splits = split_count(tiles.shape[-1], b * kh * pl.cdiv(rows, br), sms)
    parts = decode_partials(q_bmrh, k, v, layer, row_ctx, row_bid, kpos, kbid, tiles, count, br=br, bk=bk,
                            splits=splits, interpret=interpret, page_table=page_table)
    out, lse = merge_splits(*parts)
    out = out.reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(out_dtype)
    return out, lse.reshape(b, kh, t, g).transpose(0, 1, 3, 2).reshape(b, n, t)
