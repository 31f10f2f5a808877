"""Fused block-diffusion attention in Pallas: the mask is computed per tile from token metadata.

No maintained JAX kernel evaluates the D3D mask's OR rule (a key is visible when it is causal
and before the query's ``context_end``, OR in the query's own block).  This kernel does: the
metadata of a query tile and a key tile are four int32 vectors, encoded so that

    visible(q, k) = kpos[k] < qctx[q]  OR  kbid[k] == qbid[q]

(:func:`encode_queries` / :func:`encode_keys` fold ``valid`` and the causal/block split into the
sentinels), and a whole key tile is skipped when the tile's min/max show no pair can pass.

Flash attention with online softmax over key tiles (forward) and the FlashAttention-2 backward
with recomputation (one kernel for dQ over key tiles, one for dK/dV over query tiles).  Saved
for the backward: q, k, v, the output and the log-sum-exp, all O(L), never an [L, L] array.
Fully masked query rows give output 0 and log-sum-exp ``NEG`` (a finite -inf stand-in, so two
segments' results merge by log-sum-exp without NaNs).

Written for the Triton lowering (2-D dots >= 16 wide, power-of-two tiles, ``lax.cond`` to skip
a tile) and run on CPU with ``interpret=True``.  The head dim is not padded: on GPU it must be
a power of two >= 16 (``ModelConfig.validate`` checks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from d3d_jax.model.masks import CAUSAL, TokenMeta

NEG = -1e30  # masked score / log-sum-exp of a fully masked row
_INT_MAX = int(jnp.iinfo(jnp.int32).max)
_INT_MIN = int(jnp.iinfo(jnp.int32).min)
_Q_NO_BLOCK = -3  # query sentinel: never equal to a key's block id
_K_NO_BLOCK = -2  # key sentinel: never equal to a query's block id
_BWD_TILE = 32


# --------------------------------------------------------------------------------------
# Metadata encoding and the tile tests
# --------------------------------------------------------------------------------------
def encode_queries(meta: TokenMeta) -> tuple[jax.Array, jax.Array]:
    """``(qctx, qbid)`` [B, T]: an invalid query has context -inf and no block."""
    qctx = jnp.where(meta.valid, meta.context_end, _INT_MIN).astype(jnp.int32)
    qbid = jnp.where(meta.valid & (meta.block_ids != CAUSAL), meta.block_ids, _Q_NO_BLOCK)
    return qctx, qbid.astype(jnp.int32)


def encode_keys(meta: TokenMeta) -> tuple[jax.Array, jax.Array]:
    """``(kpos, kbid)`` [B, S]: only a valid causal key has a position, only a valid block key a block."""
    causal = meta.block_ids == CAUSAL
    kpos = jnp.where(meta.valid & causal, meta.positions, _INT_MAX).astype(jnp.int32)
    kbid = jnp.where(meta.valid & ~causal, meta.block_ids, _K_NO_BLOCK).astype(jnp.int32)
    return kpos, kbid


def _mask(qctx, qbid, kpos, kbid):
    return (kpos[None, :] < qctx[:, None]) | (kbid[None, :] == qbid[:, None])


def _query_summary(qctx, qbid):
    """(latest context end, lowest and highest block id) of a query tile."""
    return jnp.max(qctx), jnp.min(jnp.where(qbid >= 0, qbid, _INT_MAX)), jnp.max(qbid)


def _tile_visible(qsum, kpos, kbid):
    """False only when no (query, key) pair of the two tiles can be visible."""
    ctx_hi, qb_lo, qb_hi = qsum
    kb_lo = jnp.min(jnp.where(kbid >= 0, kbid, _INT_MAX))
    causal = jnp.min(kpos) < ctx_hi
    same_block = jnp.maximum(qb_lo, kb_lo) <= jnp.minimum(qb_hi, jnp.max(kbid))
    return causal | same_block


def tile_visibility(q_meta: TokenMeta, k_meta: TokenMeta, block_q: int, block_k: int) -> jax.Array:
    """``[B, T/block_q, S/block_k]``: which tiles the kernel computes (the rest it skips)."""
    qctx, qbid = encode_queries(q_meta)
    kpos, kbid = encode_keys(k_meta)
    tiles = lambda x, n: x.reshape(x.shape[0], -1, n)
    qsum = jax.vmap(jax.vmap(_query_summary))(tiles(qctx, block_q), tiles(qbid, block_q))
    per_k = jax.vmap(_tile_visible, in_axes=(None, 0, 0))  # one query tile, every key tile
    per_qk = jax.vmap(per_k, in_axes=(0, None, None))
    return jax.vmap(per_qk)(qsum, tiles(kpos, block_k), tiles(kbid, block_k))


def _dot_nt(a, b):  # a @ b.T in float32
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):  # a.T @ b in float32
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _probs(q, k, lse, mask):
    """Recomputed softmax probabilities of a tile from the saved log-sum-exp."""
    return jnp.where(mask, jnp.exp(_dot_nt(q, k) - lse[:, None]), 0.0)


# --------------------------------------------------------------------------------------
# Kernels (one grid point: one row, one query head, one query or key tile)
# --------------------------------------------------------------------------------------
def _fwd_kernel(q_ref, k_ref, v_ref, qctx_ref, qbid_ref, kpos_ref, kbid_ref, o_ref, lse_ref, *, block_k):
    q, qctx, qbid = q_ref[...], qctx_ref[...], qbid_ref[...]
    qsum = _query_summary(qctx, qbid)

    def body(j, carry):
        sl = pl.ds(j * block_k, block_k)
        kpos, kbid = kpos_ref[sl], kbid_ref[sl]

        def visit(c):
            acc, m, l = c
            mask = _mask(qctx, qbid, kpos, kbid)
            s = _dot_nt(q, k_ref[sl, :])
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, NEG), axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            v = v_ref[sl, :]
            return acc * alpha[:, None] + _dot(p.astype(v.dtype), v), m_new, l * alpha + jnp.sum(p, axis=1)

        return lax.cond(_tile_visible(qsum, kpos, kbid), visit, lambda c: c, carry)

    bq, h = q.shape
    init = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, k_ref.shape[0] // block_k, body, init)
    seen = l > 0.0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qctx_ref, qbid_ref, kpos_ref, kbid_ref,
               dq_ref, *, block_k):
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    qctx, qbid = qctx_ref[...], qbid_ref[...]
    qsum = _query_summary(qctx, qbid)

    def body(j, dq):
        sl = pl.ds(j * block_k, block_k)
        kpos, kbid = kpos_ref[sl], kbid_ref[sl]

        def visit(dq):
            k, v = k_ref[sl, :], v_ref[sl, :]
            p = _probs(q, k, lse, _mask(qctx, qbid, kpos, kbid))
            ds = p * (_dot_nt(do, v) - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k)

        return lax.cond(_tile_visible(qsum, kpos, kbid), visit, lambda d: d, dq)

    dq = lax.fori_loop(0, k_ref.shape[0] // block_k, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qctx_ref, qbid_ref, kpos_ref, kbid_ref,
                dk_ref, dv_ref, *, block_q):
    k, v, kpos, kbid = k_ref[...], v_ref[...], kpos_ref[...], kbid_ref[...]

    def body(i, carry):
        sl = pl.ds(i * block_q, block_q)
        qctx, qbid = qctx_ref[sl], qbid_ref[sl]

        def visit(c):
            dk, dv = c
            q, do, lse, delta = q_ref[sl, :], do_ref[sl, :], lse_ref[sl], delta_ref[sl]
            p = _probs(q, k, lse, _mask(qctx, qbid, kpos, kbid))
            ds = p * (_dot_nt(do, v) - delta[:, None])
            return dk + _dot_tn(ds.astype(q.dtype), q), dv + _dot_tn(p.astype(do.dtype), do)

        visible = _tile_visible(_query_summary(qctx, qbid), kpos, kbid)
        return lax.cond(visible, visit, lambda c: c, carry)

    zero = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, q_ref.shape[0] // block_q, body, (zero, zero))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# --------------------------------------------------------------------------------------
# pallas_call wrappers
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FlashOptions:
    """Static kernel options: tile sizes, output dtype and interpret mode (CPU)."""

    block_q: int
    block_k: int
    out_dtype: str
    interpret: bool


def _call(kernel, name, opts: FlashOptions, grid, in_specs, out_specs, out_shape):
    params = None
    if not opts.interpret:
        from jax.experimental.pallas import triton as plgpu  # deferred: only the GPU path needs it

        params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=opts.interpret, compiler_params=params, name=name)


def _specs(t, s, h, g, bq, bk):
    """BlockSpecs by role; grid (row, query head, tile); kv head = query head // g (GQA)."""
    return dict(
        q_tile=pl.BlockSpec((None, bq, None, h), lambda b, n, i: (b, i, n, 0)),
        q_all=pl.BlockSpec((None, t, None, h), lambda b, n, i: (b, 0, n, 0)),
        kv_tile=pl.BlockSpec((None, bk, None, h), lambda b, n, i: (b, i, n // g, 0)),
        kv_all=pl.BlockSpec((None, s, None, h), lambda b, n, i: (b, 0, n // g, 0)),
        dkv_tile=pl.BlockSpec((None, bk, None, h), lambda b, n, i: (b, i, n, 0)),
        qm_tile=pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
        qm_all=pl.BlockSpec((None, t), lambda b, n, i: (b, 0)),
        km_tile=pl.BlockSpec((None, bk), lambda b, n, i: (b, i)),
        km_all=pl.BlockSpec((None, s), lambda b, n, i: (b, 0)),
        row_tile=pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
        row_all=pl.BlockSpec((None, None, t), lambda b, n, i: (b, n, 0)),
    )


def _forward(q, k, v, qctx, qbid, kpos, kbid, opts: FlashOptions):
    (b, t, n, h), s, g = q.shape, k.shape[1], q.shape[2] // k.shape[2]
    sp = _specs(t, s, h, g, opts.block_q, opts.block_k)
    out_shape = [jax.ShapeDtypeStruct((b, t, n, h), jnp.dtype(opts.out_dtype)),
                 jax.ShapeDtypeStruct((b, n, t), jnp.float32)]
    in_specs = [sp["q_tile"], sp["kv_all"], sp["kv_all"], sp["qm_tile"], sp["qm_tile"], sp["km_all"], sp["km_all"]]
    fn = _call(functools.partial(_fwd_kernel, block_k=opts.block_k), "d3d_flash_fwd", opts,
               (b, n, t // opts.block_q), in_specs, [sp["q_tile"], sp["row_tile"]], out_shape)
    return tuple(fn(q, k, v, qctx, qbid, kpos, kbid))


def _backward(opts: FlashOptions, res, cts):
    q, k, v, qctx, qbid, kpos, kbid, out, lse = res
    do, dlse = cts
    (b, t, n, h), s, kh = q.shape, k.shape[1], k.shape[2]
    g = n // kh
    # d lse / d score = p, so a log-sum-exp cotangent just shifts delta.
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    do = do.astype(q.dtype)
    # Smaller tiles than the forward (as jax's Pallas GPU attention): the backward holds two
    # float32 accumulators per tile.  Lengths are multiples of the forward tiles, so of these too.
    bq, bk = min(opts.block_q, _BWD_TILE), min(opts.block_k, _BWD_TILE)
    sp = _specs(t, s, h, g, bq, bk)
    args = (q, k, v, do, lse, delta, qctx, qbid, kpos, kbid)
    dq = _call(functools.partial(_dq_kernel, block_k=bk), "d3d_flash_dq", opts, (b, n, t // bq),
               [sp["q_tile"], sp["kv_all"], sp["kv_all"], sp["q_tile"], sp["row_tile"], sp["row_tile"],
                sp["qm_tile"], sp["qm_tile"], sp["km_all"], sp["km_all"]],
               sp["q_tile"], jax.ShapeDtypeStruct(q.shape, jnp.float32))(*args)
    per_head = jax.ShapeDtypeStruct((b, s, n, h), jnp.float32)  # summed over each GQA group below
    dk, dv = _call(functools.partial(_dkv_kernel, block_q=bq), "d3d_flash_dkv", opts, (b, n, s // bk),
                   [sp["q_all"], sp["kv_tile"], sp["kv_tile"], sp["q_all"], sp["row_all"], sp["row_all"],
                    sp["qm_all"], sp["qm_all"], sp["km_tile"], sp["km_tile"]],
                   [sp["dkv_tile"], sp["dkv_tile"]], [per_head, per_head])(*args)
    group = lambda x: x.reshape(b, s, kh, g, h).sum(axis=3).astype(k.dtype)
    return dq.astype(q.dtype), group(dk), group(dv), None, None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, qctx, qbid, kpos, kbid, opts: FlashOptions):
    return _forward(q, k, v, qctx, qbid, kpos, kbid, opts)


def _flash_fwd(q, k, v, qctx, qbid, kpos, kbid, opts: FlashOptions):
    out, lse = _forward(q, k, v, qctx, qbid, kpos, kbid, opts)
    return (out, lse), (q, k, v, qctx, qbid, kpos, kbid, out, lse)


_flash.defvjp(_flash_fwd, _backward)


def save_flash_forward(prim, *_, **params) -> bool:
    """Remat policy: keep the forward kernel's outputs (O(L): output and log-sum-exp).

    A ``checkpoint_name`` inside a custom VJP's forward rule is invisible to the policy, but the
    kernel's own ``pallas_call`` is not: saving its outputs spares the backward a second forward.
    """
    return prim.name == "pallas_call" and params.get("name") == "d3d_flash_fwd"


# --------------------------------------------------------------------------------------
# Entry point: padding to whole tiles
# --------------------------------------------------------------------------------------
def _tile(length: int, cap: int) -> int:
    """Power-of-two tile >= 16 (Triton's smallest dot), at most ``cap``."""
    return max(16, min(cap, pl.next_power_of_2(length)))


def _pad(x, length: int, value=0):
    extra = length - x.shape[1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def flash_attention(q, k, v, q_meta: TokenMeta, k_meta: TokenMeta, *, interpret: bool,
                    out_dtype=None, block_q: int = 64, block_k: int = 64) -> tuple[jax.Array, jax.Array]:
    """``(out [B,T,N,H], lse [B,N,T])`` of softmax attention, no scaling (scale ``q`` first).

    ``k``/``v`` are ``[B,S,K,H]`` with ``N % K == 0`` (query head n reads kv head n // (N/K)).
    Lengths are padded to whole tiles with invalid tokens and the padding is cut off again.
    """
    (_, t, _, _), s = q.shape, k.shape[1]
    bq, bk = _tile(t, block_q), _tile(s, block_k)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    qctx, qbid = encode_queries(q_meta)
    kpos, kbid = encode_keys(k_meta)
    opts = FlashOptions(bq, bk, jnp.dtype(out_dtype or q.dtype).name, bool(interpret))
    out, lse = _flash(_pad(q, tp), _pad(k, sp), _pad(v, sp), _pad(qctx, tp, _INT_MIN),
                      _pad(qbid, tp, _Q_NO_BLOCK), _pad(kpos, sp, _INT_MAX), _pad(kbid, sp, _K_NO_BLOCK), opts)
    return out[:, :t], lse[:, :, :t]
