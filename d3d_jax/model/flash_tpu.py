"""The D3D flash-attention kernels for TPU (Mosaic): the tile steps of
:mod:`~d3d_jax.model.flash_kernels`, with the key tiles on the grid instead of a loop.

Grid ``(row, head, query tile, list position)``: the live-tile list and its count are scalar
prefetch (SMEM), so the index maps fetch only live K/V tiles, positions past the count repeat
the last live tile (Mosaic skips the copy of an unchanged block) and compute nothing.  Only one
key tile is in VMEM at a time, so a long cache fits (a whole K/V row did not at S = 32768).

Layouts are free views of the model's arrays: q/out ``[B, T, N*H]`` and k/v ``[B, S, K*H]``
(one head is a 128-lane column block, so ``H % 128 == 0``), a stacked cache ``[L, B, S, K*H]``,
per-query statistics as columns ``[B, N, T, 1]`` and, for the transposed dK/dV step, rows
``[B, N, 1, T]``; token metadata likewise as ``[B, T, 1]`` or ``[B, 1, T]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from d3d_jax.model import flash_kernels as fk

TPU_TILE = 512  # query and key tile cap (splash attention's default)
LANES = 128


def _call_kw(interpret: bool, *semantics) -> dict:
    """Mosaic compiler params, or the TPU interpreter (CPU tests of these very kernels)."""
    if interpret:
        return dict(interpret=pltpu.InterpretParams())
    return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=semantics))


def _pad_keys(x, tile, value=0):
    """Pad the key axis (axis 1) to whole tiles: a copy, for a ragged key length only."""
    extra = -x.shape[1] % tile
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _col(x):  # [B, L] -> [B, L, 1]
    return x[:, :, None]


def _row(x):  # [B, L] -> [B, 1, L]
    return x[:, None, :]


# --------------------------------------------------------------------------------------
# Forward (training pack, prefill, and the cache prefix of a verify)
# --------------------------------------------------------------------------------------
def _fwd_kernel(tiles_ref, count_ref, q_ref, k_ref, v_ref, qctx_ref, qbid_ref, kpos_ref, kbid_ref,
                o_ref, lse_ref, acc_ref, m_ref, l_ref):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        acc_ref[...], m_ref[...], l_ref[...] = fk.fwd_init(*acc_ref.shape)

    @pl.when(j < count_ref[b, i])
    def _():
        mask = fk.visible2d(qctx_ref[...], qbid_ref[...], kpos_ref[...], kbid_ref[...])
        carry = (acc_ref[...], m_ref[...], l_ref[...])
        acc_ref[...], m_ref[...], l_ref[...] = fk.fwd_step(carry, q_ref[...], k_ref[...], v_ref[...], mask)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        out, lse = fk.fwd_finish((acc_ref[...], m_ref[...], l_ref[...]))
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = lse


def _forward_call(q, k, v, layer, qctx, qbid, kpos, kbid, tiles, count, *, bq, bk, h, out_dtype, interpret):
    """``q [B,T,N*H]``; ``k``/``v`` ``[B,S,K*H]`` (layer None) or ``[L,B,S,K*H]`` with ``layer`` an
    int32 scalar (a third scalar prefetch, so the layer scan's step picks the cache layer)."""
    b, t, nh = q.shape
    n, kh = nh // h, k.shape[-1] // h
    g, nk = n // kh, tiles.shape[-1]
    lead = () if layer is None else (None,)
    at = (lambda ix, pre: ix) if layer is None else (lambda ix, pre: (pre[2][0], *ix))
    kv = pl.BlockSpec((*lead, None, bk, h), lambda b, n, i, j, *pre: at((b, pre[0][b, i, j], n // g), pre))
    krow = pl.BlockSpec((None, 1, bk), lambda b, n, i, j, *pre: (b, 0, pre[0][b, i, j]))
    qcol = pl.BlockSpec((None, bq, 1), lambda b, n, i, j, *pre: (b, i, 0))
    q_tile = pl.BlockSpec((None, bq, h), lambda b, n, i, j, *pre: (b, i, n))
    prefetch = (tiles, count) if layer is None else (tiles, count, jnp.reshape(layer, (1,)).astype(jnp.int32))
    kernel = _fwd_kernel if layer is None else (lambda tl, c, _layer, *refs: _fwd_kernel(tl, c, *refs))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch), grid=(b, n, t // bq, nk),
        in_specs=[q_tile, kv, kv, qcol, qcol, krow, krow],
        out_specs=[q_tile, pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j, *pre: (b, n, i, 0))],
        scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, 1), jnp.float32)])
    out, lse = pl.pallas_call(
        kernel, grid_spec=spec, name="d3d_flash_fwd",
        out_shape=[jax.ShapeDtypeStruct((b, t, nh), out_dtype), jax.ShapeDtypeStruct((b, n, t, 1), jnp.float32)],
        **_call_kw(interpret, "parallel", "parallel", "parallel", "arbitrary"),
    )(*prefetch, q, k, v, _col(qctx), _col(qbid), _row(kpos), _row(kbid))
    return out, lse[..., 0]


def _padded_keys(k, v, kpos, kbid, bk):
    return (_pad_keys(k, bk), _pad_keys(v, bk), _pad_keys(kpos, bk, fk.INT_MAX), _pad_keys(kbid, bk, fk.K_NO_BLOCK))


def forward(q, k, v, qctx, qbid, kpos, kbid, tiles, count, *, bq, bk, out_dtype, interpret=False):
    """``(out [B,T,N,H], lse [B,N,T])``, as :func:`~d3d_jax.model.flash_kernels.gpu_forward`."""
    b, t, n, h = q.shape
    k, v, kpos, kbid = _padded_keys(k, v, kpos, kbid, bk)  # a ragged key length only (prefill)
    s, kh = k.shape[1], k.shape[2]
    out, lse = _forward_call(q.reshape(b, t, n * h), k.reshape(b, s, kh * h), v.reshape(b, s, kh * h), None,
                             qctx, qbid, kpos, kbid, tiles, count, bq=bq, bk=bk, h=h, out_dtype=out_dtype,
                             interpret=interpret)
    return out.reshape(b, t, n, h), lse


def cache_forward(q, k_lbskh, v_lbskh, layer, qctx, qbid, kpos, kbid, live_tiles, visibility, *, out_dtype,
                  interpret=False, page_table=None):
    """``(out, lse)`` of ``q [B,T,N,H]`` over the first ``kpos.shape[1]`` slots of a stacked cache,
    read in place through the ``[L, B, S, K*H]`` view; with ``page_table`` over a paged pool
    ``[L, num_pages, page_size, K, H]`` (:func:`paged_forward`)."""
    from d3d_jax.model.flash_kernels import pad_rows, tile_size

    b, t, n, h = q.shape
    l_, _, s_max, kh, _ = k_lbskh.shape
    s = kpos.shape[1]
    bq, bk = tile_size(t, TPU_TILE, LANES), tile_size(s, TPU_TILE, LANES)
    if page_table is not None:
        bk = page_tile(k_lbskh.shape[2])
    elif s_max % bk:  # the view must be whole tiles: a copy, only for a cache length off the tile
        k_lbskh, v_lbskh = _pad_keys(k_lbskh.reshape(l_ * b, s_max, kh, h), bk), _pad_keys(
            v_lbskh.reshape(l_ * b, s_max, kh, h), bk)
        s_max = k_lbskh.shape[1]
    kpos, kbid = _pad_keys(kpos, bk, fk.INT_MAX), _pad_keys(kbid, bk, fk.K_NO_BLOCK)
    tp = -(-t // bq) * bq
    qctx, qbid = pad_rows(qctx, tp, fk.INT_MIN), pad_rows(qbid, tp, fk.Q_NO_BLOCK)
    tiles, count = live_tiles(visibility(qctx, qbid, kpos, kbid, bq, bk))
    kw = dict(bq=bq, bk=bk, h=h, out_dtype=out_dtype, interpret=interpret)
    q_flat = pad_rows(q, tp).reshape(b, tp, n * h)
    if page_table is not None:
        out, lse = paged_forward(q_flat, k_lbskh, v_lbskh, layer, page_table, qctx, qbid, kpos, kbid, tiles,
                                 count, **kw)
    else:
        view = lambda x: x.reshape(l_, b, s_max, kh * h)
        out, lse = _forward_call(q_flat, view(k_lbskh), view(v_lbskh), layer, qctx, qbid, kpos, kbid, tiles,
                                 count, **kw)
    return out.reshape(b, tp, n, h)[:, :t], lse[:, :, :t]


def page_tile(page_size: int) -> int:
    """The key tile over pages of ``page_size`` tokens: the page, or the largest tile that divides it."""
    return page_size if page_size <= TPU_TILE else TPU_TILE


def paged_forward(q, k_pool, v_pool, layer, table, qctx, qbid, kpos, kbid, tiles, count, *, bq, bk, h,
                  out_dtype, interpret):
    """The forward kernel over a paged pool ``[L, num_pages, page_size, K, H]``: the page table
    ``[B, max_pages]`` is scalar prefetch beside the tile list, so key tile ``j`` of row ``b`` is
    fetched from page ``table[b, j*bk // page_size]`` (a key tile lies in one page).  The keys'
    metadata is viewed ``[B, tiles, 1, bk]``, one tile a whole block whatever ``bk``."""
    b, t, nh = q.shape
    l_, pages, ps, kh, _ = k_pool.shape
    n, g, nk = nh // h, nh // h // kh, tiles.shape[-1]
    per = ps // bk  # key tiles per page

    def kv_at(b, n, i, j, tl, c, lay, tab):
        tile = tl[b, i, j]
        return lay[0], tab[b, tile // per], tile % per, n // g

    kv = pl.BlockSpec((None, None, bk, h), kv_at)
    krow = pl.BlockSpec((None, None, 1, bk), lambda b, n, i, j, tl, *_: (b, tl[b, i, j], 0, 0))
    qcol = pl.BlockSpec((None, bq, 1), lambda b, n, i, j, *_: (b, i, 0))
    q_tile = pl.BlockSpec((None, bq, h), lambda b, n, i, j, *_: (b, i, n))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(b, n, t // bq, nk),
        in_specs=[q_tile, kv, kv, qcol, qcol, krow, krow],
        out_specs=[q_tile, pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j, *_: (b, n, i, 0))],
        scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, 1), jnp.float32)])
    pool = lambda x: x.reshape(l_, pages, ps, kh * h)  # noqa: E731
    meta = lambda x: x.reshape(b, -1, 1, bk)  # noqa: E731
    out, lse = pl.pallas_call(
        lambda tl, c, _layer, _table, *refs: _fwd_kernel(tl, c, *refs), grid_spec=spec, name="d3d_flash_fwd",
        out_shape=[jax.ShapeDtypeStruct((b, t, nh), out_dtype), jax.ShapeDtypeStruct((b, n, t, 1), jnp.float32)],
        **_call_kw(interpret, "parallel", "parallel", "parallel", "arbitrary"),
    )(tiles, count, jnp.reshape(layer, (1,)).astype(jnp.int32), table, q, pool(k_pool), pool(v_pool), _col(qctx),
      _col(qbid), meta(kpos), meta(kbid))
    return out, lse[..., 0]


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------
def _dq_kernel(tiles_ref, count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qctx_ref, qbid_ref,
               kpos_ref, kbid_ref, dq_ref, acc_ref):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(j < count_ref[b, i])
    def _():
        mask = fk.visible2d(qctx_ref[...], qbid_ref[...], kpos_ref[...], kbid_ref[...])
        acc_ref[...] = fk.dq_step(acc_ref[...], q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...],
                                  delta_ref[...], mask)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        dq_ref[...] = acc_ref[...]


def _dkv_kernel(tiles_ref, count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qctx_ref, qbid_ref,
                kpos_ref, kbid_ref, dk_ref, dv_ref, dk_acc, dv_acc, *, nq):
    b, kt, jj = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(jj == 0)
    def _():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    @pl.when(jj % nq < count_ref[b, kt])
    def _():
        mask_t = fk.visible2d(qctx_ref[...], qbid_ref[...], kpos_ref[...], kbid_ref[...])
        dk_acc[...], dv_acc[...] = fk.dkv_step((dk_acc[...], dv_acc[...]), q_ref[...], k_ref[...], v_ref[...],
                                               do_ref[...], lse_ref[...], delta_ref[...], mask_t)

    @pl.when(jj == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def backward(q, k, v, do, lse, delta, qctx, qbid, kpos, kbid, q_lists, k_lists, *, bq, bk, interpret=False):
    """``(dq float32, dk, dv)`` as :func:`~d3d_jax.model.flash_kernels.gpu_backward`."""
    b, t, n, h = q.shape
    s0 = k.shape[1]
    k, v, kpos, kbid = _padded_keys(k, v, kpos, kbid, bk)
    s, kh = k.shape[1], k.shape[2]
    g, nq, nk = n // kh, t // bq, s // bk
    (q_tiles, q_count), (k_tiles, k_count) = q_lists, k_lists
    flat = lambda x: x.reshape(x.shape[0], x.shape[1], -1)
    qf, kf, vf, dof = flat(q), flat(k), flat(v), flat(do)
    # dQ: grid (row, head, query tile, live key tile)
    kv = pl.BlockSpec((None, bk, h), lambda b, n, i, j, tl, c: (b, tl[b, i, j], n // g))
    q_tile = pl.BlockSpec((None, bq, h), lambda b, n, i, j, tl, c: (b, i, n))
    stat_col = pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j, tl, c: (b, n, i, 0))
    qcol = pl.BlockSpec((None, bq, 1), lambda b, n, i, j, tl, c: (b, i, 0))
    krow = pl.BlockSpec((None, 1, bk), lambda b, n, i, j, tl, c: (b, 0, tl[b, i, j]))
    dq = pl.pallas_call(
        _dq_kernel, name="d3d_flash_dq",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, n, nq, q_tiles.shape[-1]),
            in_specs=[q_tile, kv, kv, q_tile, stat_col, stat_col, qcol, qcol, krow, krow], out_specs=q_tile,
            scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(qf.shape, jnp.float32),
        **_call_kw(interpret, "parallel", "parallel", "parallel", "arbitrary"),
    )(q_tiles, q_count, qf, kf, vf, dof, lse[..., None], delta[..., None], _col(qctx), _col(qbid), _row(kpos),
      _row(kbid))
    # dK/dV: grid (row, kv head, key tile, (group head, live query tile) pair), summed over the group
    pick = lambda tl, b, kt, jj: tl[b, kt, jj % nq]
    qh = pl.BlockSpec((None, bq, h), lambda b, m, kt, jj, tl, c: (b, pick(tl, b, kt, jj), m * g + jj // nq))
    k_tile = pl.BlockSpec((None, bk, h), lambda b, m, kt, jj, tl, c: (b, kt, m))
    stat_row = pl.BlockSpec((None, None, 1, bq),
                            lambda b, m, kt, jj, tl, c: (b, m * g + jj // nq, 0, pick(tl, b, kt, jj)))
    qrow = pl.BlockSpec((None, 1, bq), lambda b, m, kt, jj, tl, c: (b, 0, pick(tl, b, kt, jj)))
    kcol = pl.BlockSpec((None, bk, 1), lambda b, m, kt, jj, tl, c: (b, kt, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, nq=nq), name="d3d_flash_dkv",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, kh, nk, g * nq),
            in_specs=[qh, k_tile, k_tile, qh, stat_row, stat_row, qrow, qrow, kcol, kcol],
            out_specs=[k_tile, k_tile],
            scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, h), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(kf.shape, k.dtype)] * 2,
        **_call_kw(interpret, "parallel", "parallel", "parallel", "arbitrary"),
    )(k_tiles, k_count, qf, kf, vf, dof, lse[:, :, None, :], delta[:, :, None, :], _row(qctx), _row(qbid),
      _col(kpos), _col(kbid))
    unflat = lambda x, length: x.reshape(b, -1, x.shape[-1] // h, h)[:, :length]
    return unflat(dq, t), unflat(dk, s0), unflat(dv, s0)
