"""The D3D flash-attention tile math, shared by every platform, and its GPU (Triton) kernels.

One tile step is plain JAX on arrays (:func:`fwd_step`, :func:`dq_step`, :func:`dkv_step`): the
GPU kernels here loop over a query tile's *live* key tiles inside the kernel, the TPU kernels
(:mod:`~d3d_jax.model.flash_tpu`) put the key tiles on the grid; both call the same steps.

Live tiles come as a compacted list per query tile (``tiles[j]`` for ``j < count``, built in
XLA from the tile metadata by :func:`~d3d_jax.model.flash_attention.live_tiles`).  The loop
``fori_loop(0, count)`` has no branch around its loads, so Triton software-pipelines the K/V
loads (``cp.async``); a dead tile is never visited, so its memory is never read.

Layouts: q/out ``[B, T, N, H]``, k/v ``[B, S, K, H]`` (query head ``n`` reads kv head
``n // g``), lse/delta ``[B, N, T]`` float32, metadata ``[B, T]`` / ``[B, S]`` int32.  A key
length that is not a tile multiple is read with masked loads (no padded copy of K/V).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NEG = -1e30  # masked score / log-sum-exp of a fully masked row
INT_MAX = int(jnp.iinfo(jnp.int32).max)
INT_MIN = int(jnp.iinfo(jnp.int32).min)
Q_NO_BLOCK = -3  # query sentinel: never equal to a key's block id
K_NO_BLOCK = -2  # key sentinel: never equal to a query's block id


def visible2d(qctx, qbid, kpos, kbid):
    """The tile mask ``kpos < qctx  OR  kbid == qbid`` of broadcasting 2-D operands: query
    columns ``[tq, 1]`` with key rows ``[1, tk]`` give ``[tq, tk]``; query rows with key
    columns give the transposed mask ``[tk, tq]`` (built so, never transposed)."""
    return (kpos < qctx) | (kbid == qbid)


def visible(qctx, qbid, kpos, kbid):
    """``[tq, tk]`` mask of one tile from 1-D metadata vectors."""
    return visible2d(qctx[:, None], qbid[:, None], kpos[None, :], kbid[None, :])


def visible_t(kpos, kbid, qctx, qbid):
    """The same mask transposed, ``[tk, tq]``."""
    return visible2d(qctx[None, :], qbid[None, :], kpos[:, None], kbid[:, None])


def _prec(x):
    # float32 dots at full precision: the default lowers to TF32 on a GPU (~1e-3 error).  Other
    # dtypes explicitly at the default, whatever jax_default_matmul_precision says: Mosaic
    # rejects a float32 contraction of bfloat16 operands ("Bad lhs type").
    return lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT


def dot_nt(a, b):  # a @ b.T in float32
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_prec(a),
                           preferred_element_type=jnp.float32)


def dot(a, b):  # a @ b in float32
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_prec(a),
                           preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------------------
# Tile steps (platform independent)
# --------------------------------------------------------------------------------------
# Per-row statistics are columns ``[rows, 1]`` (``lse``/``delta`` of the transposed dK/dV step are
# rows ``[1, rows]``): they broadcast against a ``[rows, keys]`` tile as they are, and a TPU keeps
# a 2-D array in its native layout where a 1-D one would need a relayout.
def fwd_init(rows: int, h: int):
    return (jnp.zeros((rows, h), jnp.float32), jnp.full((rows, 1), NEG, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))


def fwd_step(carry, q, k, v, mask):
    """Online softmax over one key tile: ``(acc, running max, running sum)``."""
    acc, m, l = carry
    s = dot_nt(q, k)
    m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, NEG), axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    return acc * alpha + dot(p.astype(v.dtype), v), m_new, l * alpha + jnp.sum(p, axis=1, keepdims=True)


def fwd_finish(carry):
    """``(out float32, lse [rows, 1])``; a row that saw no key gives 0 and ``NEG``."""
    acc, m, l = carry
    seen = l > 0.0
    safe = jnp.where(seen, l, 1.0)
    return acc / safe, jnp.where(seen, m + jnp.log(safe), NEG)


def dq_step(dq, q, k, v, do, lse, delta, mask):
    """dQ of one query tile from one key tile (``lse``/``delta``: ``[rows, 1]``)."""
    p = jnp.where(mask, jnp.exp(dot_nt(q, k) - lse), 0.0)
    ds = p * (dot_nt(do, v) - delta)
    return dq + dot(ds.astype(k.dtype), k)


def dkv_step(carry, q, k, v, do, lse, delta, mask_t):
    """dK/dV of one key tile from one query tile, computed transposed (``[keys, queries]``;
    ``lse``/``delta``: ``[1, queries]``) so every dot has the key tile as its M side: no
    transposes, and 64-row tiles reach ``wgmma``."""
    dk, dv = carry
    p_t = jnp.where(mask_t, jnp.exp(dot_nt(k, q) - lse), 0.0)
    ds_t = p_t * (dot_nt(v, do) - delta)
    return dk + dot(ds_t.astype(q.dtype), q), dv + dot(p_t.astype(do.dtype), do)


# --------------------------------------------------------------------------------------
# GPU kernels: a fori_loop over the live tile list
# --------------------------------------------------------------------------------------
def _load(ref, start, size, length, other, lead=()):
    """``ref[*lead, start:start+size]`` (``lead``: scalar indices before the sliced axis, one
    indexer: Triton takes no view of a view), masked past ``length`` when the array is not a
    whole number of tiles (the static ``length`` is None when it is)."""
    index = (*lead, pl.ds(pl.multiple_of(start, size), size))
    if length is None:
        return ref[index]
    from jax.experimental.pallas import triton as plgpu  # deferred: GPU-only module

    inside = start + jnp.arange(size) < length
    mask = inside if ref.ndim - len(lead) == 1 else inside[:, None]
    return plgpu.load(ref.at[index], mask=mask, other=other)


def _key_tile(refs, start, bk, s_len, layer=None):
    """K, V and their metadata of one key tile; ``layer``: K/V are ``[L, S, H]`` (a stacked
    cache's rows), read at that layer."""
    k_ref, v_ref, kpos_ref, kbid_ref = refs
    lead = () if layer is None else (layer,)
    return (_load(k_ref, start, bk, s_len, 0, lead), _load(v_ref, start, bk, s_len, 0, lead),
            _load(kpos_ref, start, bk, s_len, INT_MAX), _load(kbid_ref, start, bk, s_len, K_NO_BLOCK))


def gpu_fwd_kernel(tiles_ref, count_ref, q_ref, k_ref, v_ref, qctx_ref, qbid_ref, kpos_ref, kbid_ref,
                   o_ref, lse_ref, *, bk, s_len):
    q, qctx, qbid = q_ref[...], qctx_ref[...], qbid_ref[...]

    def body(j, carry):
        k, v, kpos, kbid = _key_tile((k_ref, v_ref, kpos_ref, kbid_ref), tiles_ref[j] * bk, bk, s_len)
        return fwd_step(carry, q, k, v, visible(qctx, qbid, kpos, kbid))

    out, lse = fwd_finish(lax.fori_loop(0, count_ref[...], body, fwd_init(*q.shape)))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse.reshape(lse.shape[0])


def gpu_dq_kernel(tiles_ref, count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qctx_ref,
                  qbid_ref, kpos_ref, kbid_ref, dq_ref, *, bk, s_len):
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...][:, None], delta_ref[...][:, None]
    qctx, qbid = qctx_ref[...], qbid_ref[...]

    def body(j, dq):
        k, v, kpos, kbid = _key_tile((k_ref, v_ref, kpos_ref, kbid_ref), tiles_ref[j] * bk, bk, s_len)
        return dq_step(dq, q, k, v, do, lse, delta, visible(qctx, qbid, kpos, kbid))

    dq = lax.fori_loop(0, count_ref[...], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def gpu_dkv_kernel(tiles_ref, count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qctx_ref,
                   qbid_ref, kpos_ref, kbid_ref, dk_ref, dv_ref, *, bq, bk, s_len, group):
    """One key tile of one kv head: dK/dV summed over the ``group`` query heads that read it,
    in one float32 accumulator (the loop runs over (head, live query tile) pairs)."""
    start = pl.program_id(2) * bk
    k, v, kpos, kbid = _key_tile((k_ref, v_ref, kpos_ref, kbid_ref), start, bk, s_len)
    count = count_ref[...]

    def body(j, carry):
        head = j // count
        sl = pl.ds(pl.multiple_of(tiles_ref[j - head * count] * bq, bq), bq)
        mask_t = visible_t(kpos, kbid, qctx_ref[sl], qbid_ref[sl])
        return dkv_step(carry, q_ref[sl, head, :], k, v, do_ref[sl, head, :], lse_ref[head, sl][None, :],
                        delta_ref[head, sl][None, :], mask_t)

    zero = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group * count, body, (zero, zero))
    _store(dk_ref, dk, start, s_len)
    _store(dv_ref, dv, start, s_len)


def _store(ref, x, start, length):
    """``ref[start:start+len(x)] = x`` (leading axis), masked past a ragged ``length``."""
    sl = pl.ds(pl.multiple_of(start, x.shape[0]), x.shape[0])
    x = x.astype(ref.dtype)
    if length is None:
        ref[sl] = x
        return
    from jax.experimental.pallas import triton as plgpu

    plgpu.store(ref.at[sl], x, mask=(start + jnp.arange(x.shape[0]) < length)[:, None])


# --------------------------------------------------------------------------------------
# GPU pallas_calls
# --------------------------------------------------------------------------------------
# Per dtype, from the compiled PTX of the training pack (H200, head 128; ``infer/bench.py
# compile``, d3d_jax/bench/compile_facts.py): bfloat16 64-row tiles reach wgmma with pipelined loads and no
# spills; float32 dots run at full precision (IEEE FMA, no tensor cores), which spills at 64-row
# tiles (64 KB) and fits at 32-row tiles on 8 warps.
GPU_TILE_CAP = {"bfloat16": 64, "float16": 64, "float32": 32}
GPU_WARPS = {"bfloat16": {"d3d_flash_fwd": 4, "d3d_flash_dq": 4, "d3d_flash_dkv": 8}}
GPU_STAGES = 2


def _warps(name: str, dtype) -> int:
    return GPU_WARPS.get(jnp.dtype(dtype).name, {}).get(name, 8)


def _gpu_call(kernel, name, grid, in_specs, out_specs, out_shape, interpret, dtype, cost=None):
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu  # deferred: only the GPU path needs it

        params = plgpu.CompilerParams(num_warps=_warps(name, dtype), num_stages=GPU_STAGES)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, compiler_params=params, name=name, cost_estimate=cost)


def _tail(length: int, tile: int) -> int | None:
    return None if length % tile == 0 else length


def gpu_forward(q, k, v, qctx, qbid, kpos, kbid, tiles, count, *, bq, bk, out_dtype, interpret, cost=None):
    """``(out [B,T,N,H], lse [B,N,T])``; ``T`` is a multiple of ``bq``, ``S`` need not be of ``bk``."""
    (b, t, n, h), s, g = q.shape, k.shape[1], q.shape[2] // k.shape[2]
    nk = tiles.shape[-1]
    kv_all = pl.BlockSpec((None, s, None, h), lambda b, n, i: (b, 0, n // g, 0))
    km_all = pl.BlockSpec((None, s), lambda b, n, i: (b, 0))
    q_tile = pl.BlockSpec((None, bq, None, h), lambda b, n, i: (b, i, n, 0))
    qm_tile = pl.BlockSpec((None, bq), lambda b, n, i: (b, i))
    in_specs = [pl.BlockSpec((None, None, nk), lambda b, n, i: (b, i, 0)),
                pl.BlockSpec((None, None), lambda b, n, i: (b, i)),
                q_tile, kv_all, kv_all, qm_tile, qm_tile, km_all, km_all]
    out_specs = [q_tile, pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))]
    out_shape = [jax.ShapeDtypeStruct((b, t, n, h), out_dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)]
    kernel = functools.partial(gpu_fwd_kernel, bk=bk, s_len=_tail(s, bk))
    fn = _gpu_call(kernel, "d3d_flash_fwd", (b, n, t // bq), in_specs, out_specs, out_shape, interpret, q.dtype, cost)
    return tuple(fn(tiles, count, q, k, v, qctx, qbid, kpos, kbid))


def gpu_backward(q, k, v, do, lse, delta, qctx, qbid, kpos, kbid, q_lists, k_lists, *, bq, bk, interpret):
    """``(dq float32, dk, dv)``: dq over each query tile's live key tiles, dk/dv over each key
    tile's live query tiles of every head in its group (summed in the kernel)."""
    (b, t, n, h), s, kh = q.shape, k.shape[1], k.shape[2]
    g = n // kh
    (q_tiles, q_count), (k_tiles, k_count) = q_lists, k_lists
    args = (q, k, v, do, lse, delta, qctx, qbid, kpos, kbid)
    kv_all = pl.BlockSpec((None, s, None, h), lambda b, n, i: (b, 0, n // g, 0))
    km_all = pl.BlockSpec((None, s), lambda b, n, i: (b, 0))
    q_tile = pl.BlockSpec((None, bq, None, h), lambda b, n, i: (b, i, n, 0))
    qm_tile = pl.BlockSpec((None, bq), lambda b, n, i: (b, i))
    row_tile = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    dq = _gpu_call(functools.partial(gpu_dq_kernel, bk=bk, s_len=_tail(s, bk)), "d3d_flash_dq", (b, n, t // bq),
                   [pl.BlockSpec((None, None, q_tiles.shape[-1]), lambda b, n, i: (b, i, 0)),
                    pl.BlockSpec((None, None), lambda b, n, i: (b, i)),
                    q_tile, kv_all, kv_all, q_tile, row_tile, row_tile, qm_tile, qm_tile, km_all, km_all],
                   q_tile, jax.ShapeDtypeStruct(q.shape, jnp.float32), interpret, q.dtype)(q_tiles, q_count, *args)
    # grid (row, kv head, key tile): q/do blocks hold the whole group's heads
    group_all = pl.BlockSpec((None, t, g, h), lambda b, m, j: (b, 0, m, 0))
    # K/V blocks are the whole row (a ragged last tile is a masked load, never a padded copy)
    kv_row = pl.BlockSpec((None, s, None, h), lambda b, m, j: (b, 0, m, 0))
    km_row = pl.BlockSpec((None, s), lambda b, m, j: (b, 0))
    qm_all = pl.BlockSpec((None, t), lambda b, m, j: (b, 0))
    rows_all = pl.BlockSpec((None, g, t), lambda b, m, j: (b, m, 0))
    kernel = functools.partial(gpu_dkv_kernel, bq=bq, bk=bk, s_len=_tail(s, bk), group=g)
    dk, dv = _gpu_call(kernel, "d3d_flash_dkv", (b, kh, pl.cdiv(s, bk)),
                       [pl.BlockSpec((None, None, k_tiles.shape[-1]), lambda b, m, j: (b, j, 0)),
                        pl.BlockSpec((None, None), lambda b, m, j: (b, j)),
                        group_all, kv_row, kv_row, group_all, rows_all, rows_all, qm_all, qm_all, km_row, km_row],
                       [kv_row, kv_row], [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2, interpret, q.dtype)(
        k_tiles, k_count, *args)
    return dq, dk, dv


# --------------------------------------------------------------------------------------
# Tiling shared by the training, decode and TPU kernels' callers
# --------------------------------------------------------------------------------------
def tile_size(length: int, cap: int, floor: int = 16) -> int:
    """Power-of-two tile >= ``floor`` (Triton's smallest dot: 16), at most ``cap``."""
    return max(floor, min(cap, pl.next_power_of_2(length)))


def pad_rows(x, length: int, value=0):
    """Pad axis 1 to ``length``."""
    extra = length - x.shape[1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def live_tiles(vis: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Compacted live-tile lists of ``vis [B, M, N]``: ``(tiles [B, M, N] int32, count [B, M])``.

    ``tiles[b, m, :count]`` are the live tiles in increasing order; entries past the count repeat
    the last live one (a grid that walks the list then re-requests the same block: no new DMA).
    """
    n = vis.shape[-1]
    order = jnp.argsort(~vis, axis=-1, stable=True).astype(jnp.int32)
    count = vis.sum(-1, dtype=jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    return jnp.where(jnp.arange(n) < count[..., None], order, last), count
