"""Fused block-diffusion attention in Pallas: the mask is computed per tile from token metadata.

No maintained JAX kernel evaluates the D3D mask's OR rule (a key is visible when it is causal
and before the query's ``context_end``, OR in the query's own block).  This kernel does: the
metadata of a query tile and a key tile are four int32 vectors, encoded so that

    visible(q, k) = kpos[k] < qctx[q]  OR  kbid[k] == qbid[q]

(:func:`encode_queries` / :func:`encode_keys` fold ``valid`` and the causal/block split into the
sentinels).  Before the kernel, XLA turns the tiles' min/max into a compacted list of the *live*
key tiles of every query tile (and of the live query tiles of every key tile, for dK/dV): the
kernels visit only those, with loop bounds from the list, never a branch around the loads.  The
list is exact at tile granularity for any layout (training pack, verify, branch pack, prefill).

Flash attention with online softmax over key tiles (forward) and the FlashAttention-2 backward
with recomputation (dQ over key tiles; dK/dV over query tiles, summed over the GQA group inside
the kernel).  Saved for the backward: q, k, v, the output and the log-sum-exp, all O(L).
Fully masked query rows give output 0 and log-sum-exp ``NEG`` (a finite -inf stand-in, so two
segments' results merge by log-sum-exp without NaNs).

Platforms: ``gpu`` (Triton; :mod:`~d3d_jax.model.flash_kernels`), ``tpu`` (Mosaic, keys on the
grid; :mod:`~d3d_jax.model.flash_tpu`), ``interpret`` (the GPU kernels run as plain JAX, CPU
tests).  The tile math is one source for all three.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from d3d_jax.model import flash_decode
from d3d_jax.model.flash_kernels import live_tiles, pad_rows, tile_size  # noqa: F401  (shared tiling)
from d3d_jax.model import flash_kernels as fk
from d3d_jax.model.masks import CAUSAL, TokenMeta

NEG = fk.NEG
PLATFORMS = ("gpu", "tpu", "interpret", "tpu_interpret")  # *interpret: the kernels run on a CPU


# --------------------------------------------------------------------------------------
# Metadata encoding and the tile tests
# --------------------------------------------------------------------------------------
def encode_queries(meta: TokenMeta) -> tuple[jax.Array, jax.Array]:
    """``(qctx, qbid)`` [B, T]: an invalid query has context -inf and no block."""
    qctx = jnp.where(meta.valid, meta.context_end, fk.INT_MIN).astype(jnp.int32)
    qbid = jnp.where(meta.valid & (meta.block_ids != CAUSAL), meta.block_ids, fk.Q_NO_BLOCK)
    return qctx, qbid.astype(jnp.int32)


def encode_keys(meta: TokenMeta) -> tuple[jax.Array, jax.Array]:
    """``(kpos, kbid)`` [B, S]: only a valid causal key has a position, only a valid block key a block."""
    causal = meta.block_ids == CAUSAL
    kpos = jnp.where(meta.valid & causal, meta.positions, fk.INT_MAX).astype(jnp.int32)
    kbid = jnp.where(meta.valid & ~causal, meta.block_ids, fk.K_NO_BLOCK).astype(jnp.int32)
    return kpos, kbid


def _tiles(x, n, fill):
    """``[B, L] -> [B, ceil(L/n), n]``, a ragged last tile filled with a sentinel."""
    extra = -x.shape[1] % n
    x = jnp.pad(x, ((0, 0), (0, extra)), constant_values=fill) if extra else x
    return x.reshape(x.shape[0], -1, n)


def _encoded_visibility(qctx, qbid, kpos, kbid, block_q: int, block_k: int) -> jax.Array:
    """``[B, nq, nk]``: False only where no (query, key) pair of the two tiles can be visible."""
    def summary(x, n, fill, drop):  # per tile: min, max, min over x >= 0 (block ids)
        t = _tiles(x, n, fill)
        return t.min(-1), t.max(-1), jnp.where(t >= 0, t, fk.INT_MAX).min(-1) if drop else None

    _, ctx_hi, _ = summary(qctx, block_q, fk.INT_MIN, False)
    _, qb_hi, qb_lo = summary(qbid, block_q, fk.Q_NO_BLOCK, True)
    kpos_lo, _, _ = summary(kpos, block_k, fk.INT_MAX, False)
    _, kb_hi, kb_lo = summary(kbid, block_k, fk.K_NO_BLOCK, True)
    causal = kpos_lo[:, None, :] < ctx_hi[:, :, None]
    same_block = (jnp.maximum(qb_lo[:, :, None], kb_lo[:, None, :])
                  <= jnp.minimum(qb_hi[:, :, None], kb_hi[:, None, :]))
    return causal | same_block


def tile_visibility(q_meta: TokenMeta, k_meta: TokenMeta, block_q: int, block_k: int) -> jax.Array:
    """``[B, ceil(T/block_q), ceil(S/block_k)]``: which tiles the kernel computes (it skips the rest)."""
    return _encoded_visibility(*encode_queries(q_meta), *encode_keys(k_meta), block_q, block_k)


# --------------------------------------------------------------------------------------
# The differentiable call
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FlashOptions:
    """Static kernel options: tiles, output dtype and the platform the kernels lower for."""

    block_q: int
    block_k: int
    out_dtype: str
    platform: str
    decode: bool = False  # forward by flash_decode (GQA rows stacked, keys split across CTAs)


def _forward(q, k, v, qctx, qbid, kpos, kbid, opts: FlashOptions):
    tpu = opts.platform.startswith("tpu")
    if opts.decode and not tpu:
        return flash_decode.decode_forward(q, k[None], v[None], 0, qctx, qbid, kpos, kbid, _encoded_visibility,
                                           block_k=opts.block_k, out_dtype=jnp.dtype(opts.out_dtype),
                                           interpret=opts.platform == "interpret")
    vis = _encoded_visibility(qctx, qbid, kpos, kbid, opts.block_q, opts.block_k)
    tiles, count = live_tiles(vis)
    kw = dict(bq=opts.block_q, bk=opts.block_k, out_dtype=jnp.dtype(opts.out_dtype))
    if tpu:
        from d3d_jax.model import flash_tpu

        return flash_tpu.forward(q, k, v, qctx, qbid, kpos, kbid, tiles, count,
                                 interpret=opts.platform == "tpu_interpret", **kw)
    return fk.gpu_forward(q, k, v, qctx, qbid, kpos, kbid, tiles, count, interpret=opts.platform == "interpret",
                          **kw)


def _backward(opts: FlashOptions, res, cts):
    q, k, v, qctx, qbid, kpos, kbid, out, lse = res
    do, dlse = cts
    # d lse / d score = p, so a log-sum-exp cotangent just shifts delta.
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    do = do.astype(q.dtype)
    t = q.shape[1]
    tp = -(-t // opts.block_q) * opts.block_q  # a decode forward ran on unpadded queries
    q, do, qctx = pad_rows(q, tp), pad_rows(do, tp), pad_rows(qctx, tp, fk.INT_MIN)
    qbid = pad_rows(qbid, tp, fk.Q_NO_BLOCK)
    lse, delta = (jnp.pad(x, ((0, 0), (0, 0), (0, tp - t))) for x in (lse, delta))
    vis = _encoded_visibility(qctx, qbid, kpos, kbid, opts.block_q, opts.block_k)
    lists = (live_tiles(vis), live_tiles(jnp.swapaxes(vis, 1, 2)))
    kw = dict(bq=opts.block_q, bk=opts.block_k)
    if opts.platform.startswith("tpu"):
        from d3d_jax.model import flash_tpu

        dq, dk, dv = flash_tpu.backward(q, k, v, do, lse, delta, qctx, qbid, kpos, kbid, *lists,
                                        interpret=opts.platform == "tpu_interpret", **kw)
    else:
        dq, dk, dv = fk.gpu_backward(q, k, v, do, lse, delta, qctx, qbid, kpos, kbid, *lists,
                                     interpret=opts.platform == "interpret", **kw)
    return dq[:, :t].astype(q.dtype), dk, dv, None, None, None, None


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
# Entry point
# --------------------------------------------------------------------------------------
def flash_attention(q, k, v, q_meta: TokenMeta, k_meta: TokenMeta, *, platform: str = "interpret",
                    out_dtype=None, block_q: int = 64, block_k: int = 64, decode: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
    """``(out [B,T,N,H], lse [B,N,T])`` of softmax attention, no scaling (scale ``q`` first).

    ``k``/``v`` are ``[B,S,K,H]`` with ``N % K == 0`` (query head n reads kv head n // (N/K)).
    Keys are read in place.  ``decode`` runs the forward as flash-decoding (few queries, long
    keys: :mod:`~d3d_jax.model.flash_decode`) on unpadded queries; otherwise queries are padded
    to whole tiles with invalid tokens (cut off again).  Differentiable either way.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"flash_attention: unknown platform {platform!r} (known: {', '.join(PLATFORMS)})")
    (_, t, _, _), s = q.shape, k.shape[1]
    tpu = platform.startswith("tpu")
    floor = 128 if tpu else 16  # TPU: a key tile is a 128-lane row of metadata
    if platform == "tpu":  # Mosaic: large tiles (VMEM holds one key tile at a time)
        from d3d_jax.model.flash_tpu import TPU_TILE

        block_q, block_k = TPU_TILE, TPU_TILE
    if platform == "gpu":  # what the compiled PTX says fits (float32 tiles spill at 64)
        cap = fk.GPU_TILE_CAP.get(jnp.dtype(q.dtype).name, 32)
        block_q, block_k = min(block_q, cap), min(block_k, cap)
    bq, bk = tile_size(t, block_q, floor), tile_size(s, block_k, floor)
    decode = decode and not tpu  # the TPU kernel has keys on its grid already
    tp = t if decode else -(-t // bq) * bq
    qctx, qbid = encode_queries(q_meta)
    kpos, kbid = encode_keys(k_meta)
    opts = FlashOptions(bq, bk, jnp.dtype(out_dtype or q.dtype).name, platform, decode)
    out, lse = _flash(pad_rows(q, tp), k, v, pad_rows(qctx, tp, fk.INT_MIN), pad_rows(qbid, tp, fk.Q_NO_BLOCK),
                      kpos, kbid, opts)
    return out[:, :t], lse[:, :, :t]


def flash_decode_cache(q, k_lbskh, v_lbskh, layer, q_meta: TokenMeta, k_meta: TokenMeta, *,
                       platform: str, out_dtype=None, block_k: int = 64, page_table=None
                       ) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of ``q`` over layer ``layer`` (int32 scalar) of a stacked cache ``[L, B, S_max, K, H]``,
    read in place: only the ``S = k_meta.shape[1]`` first slots, no slice copy (forward only).

    With ``page_table [B, max_pages]``, K/V are a paged pool ``[L, num_pages, page_size, K, H]``
    (:func:`reads_pages` says which page sizes) and each key tile is read from its row's page;
    entries outside the pool (unmapped pages) are clipped to some page, whose keys ``k_meta`` masks."""
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    qctx, qbid = encode_queries(q_meta)
    kpos, kbid = encode_keys(k_meta)
    if page_table is not None:
        if not reads_pages(k_lbskh.shape[2], platform):
            raise ValueError(f"flash_decode_cache: the {platform} kernel reads no page of {k_lbskh.shape[2]} tokens")
        page_table = jnp.clip(page_table, 0, k_lbskh.shape[1] - 1).astype(jnp.int32)
    if platform.startswith("tpu"):
        from d3d_jax.model import flash_tpu

        return flash_tpu.cache_forward(q, k_lbskh, v_lbskh, layer, qctx, qbid, kpos, kbid, live_tiles,
                                       _encoded_visibility, out_dtype=out_dtype,
                                       interpret=platform == "tpu_interpret", page_table=page_table)
    if platform == "gpu":
        block_k = min(block_k, fk.GPU_TILE_CAP.get(jnp.dtype(q.dtype).name, 32))
    return flash_decode.decode_forward(q, k_lbskh, v_lbskh, layer, qctx, qbid, kpos, kbid, _encoded_visibility,
                                       block_k=block_k, out_dtype=out_dtype, interpret=platform == "interpret",
                                       page_table=page_table)


def reads_pages(page_size: int, platform: str) -> bool:
    """Whether the decode kernel for ``platform`` reads a paged pool of ``page_size``-token pages
    itself: a key tile is a page or a power-of-two part of one (GPU: a tile >= 16 rows, Triton's
    smallest dot; TPU: a page of whole sublane groups, 16 rows of bfloat16)."""
    if platform.startswith("tpu"):
        from d3d_jax.model.flash_tpu import page_tile

        return page_size % 16 == 0 and page_size % page_tile(page_size) == 0
    return page_size >= 16 and page_size & (page_size - 1) == 0
