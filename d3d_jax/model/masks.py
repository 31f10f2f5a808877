"""Attention masks built from 1-D per-token metadata, inside attention (never a host [L, L]).

Every token carries a :class:`TokenMeta` row entry:

* ``positions``   – its RoPE position id;
* ``block_ids``   – ``-1`` for a *causal* (clean / committed / shared-prefix) token, ``>= 0`` for
  a token of a bidirectional drafting block (unique per block within a row);
* ``context_end`` – causal keys whose position is ``< context_end`` are visible to it.  For a
  causal token this is ``position + 1`` (itself and everything before); for a block token it is
  its block's anchor position (spec §2.3: the anchor enters only as slot 0);
* ``valid``       – padding is ``False`` (never visible, and sees nothing useful).

The rule (spec §2.3 and §5 in one line): query ``q`` sees key ``k`` iff both are valid and
either ``k`` is causal with ``pos_k < context_end_q``, or ``k`` is in the same block as ``q``.
Comparing positions rather than block ids means overlapping anchors cannot leak context, and
the same rule covers the packed training row ``[clean | block_1 … block_n]``, the cached
drafting forward ``[uncached committed | anchor, MASK…]`` and the branch-packed asynchronous
forward ``[shared prefix | branch_1 … branch_n]`` (branches are blocks anchored inside the
shared prefix).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

CAUSAL = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenMeta:
    positions: jax.Array  # [B, T] int32
    block_ids: jax.Array  # [B, T] int32, -1 causal
    context_end: jax.Array  # [B, T] int32
    valid: jax.Array  # [B, T] bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.positions.shape)  # type: ignore[return-value]


def causal_meta(positions: jax.Array, valid: jax.Array | None = None) -> TokenMeta:
    """All tokens causal at the given positions ([B, T])."""
    positions = jnp.asarray(positions, jnp.int32)
    if valid is None:
        valid = jnp.ones(positions.shape, bool)
    return TokenMeta(positions, jnp.full(positions.shape, CAUSAL, jnp.int32), positions + 1,
                     jnp.asarray(valid, bool))


def default_meta(batch: int, length: int) -> TokenMeta:
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return causal_meta(pos)


def block_meta(anchor_positions: jax.Array, block_size: int, first_block_id: int | jax.Array = 0,
               valid: jax.Array | None = None) -> TokenMeta:
    """Metadata of ``n`` blocks ``[anchor, MASK×(B-1)]`` anchored at ``anchor_positions`` [b, n].

    Returns metadata of shape ``[b, n * block_size]`` (blocks laid out one after another).
    """
    anchors = jnp.asarray(anchor_positions, jnp.int32)
    b, n = anchors.shape
    slot = jnp.arange(block_size, dtype=jnp.int32)
    pos = (anchors[:, :, None] + slot[None, None, :]).reshape(b, n * block_size)
    ids = (jnp.asarray(first_block_id, jnp.int32) + jnp.arange(n, dtype=jnp.int32))
    ids = jnp.broadcast_to(jnp.repeat(ids, block_size)[None], (b, n * block_size))
    ctx = jnp.repeat(anchors, block_size, axis=1)
    if valid is None:
        v = jnp.ones((b, n * block_size), bool)
    else:
        v = jnp.repeat(jnp.asarray(valid, bool), block_size, axis=1)
    return TokenMeta(pos, ids, ctx, v)


def concat_meta(parts: Sequence[TokenMeta]) -> TokenMeta:
    return TokenMeta(*(jnp.concatenate([getattr(p, f.name) for p in parts], axis=1)
                       for f in dataclasses.fields(TokenMeta)))


def cache_key_meta(lengths: jax.Array, cache_len: int) -> TokenMeta:
    """Metadata of a KV cache's keys: slot j holds the causal token at position j, valid iff j < length."""
    lengths = jnp.asarray(lengths, jnp.int32)
    b = lengths.shape[0]
    pos = jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (b, cache_len))
    return TokenMeta(pos, jnp.full((b, cache_len), CAUSAL, jnp.int32), pos + 1, pos < lengths[:, None])


def attention_mask(q: TokenMeta, k: TokenMeta) -> jax.Array:
    """``[B, Tq, Tk]`` boolean mask: True where query may attend to key."""
    k_causal = (k.block_ids == CAUSAL)[:, None, :]
    sees_context = k_causal & (k.positions[:, None, :] < q.context_end[:, :, None])
    same_block = (~k_causal) & (k.block_ids[:, None, :] == q.block_ids[:, :, None])
    return (sees_context | same_block) & q.valid[:, :, None] & k.valid[:, None, :]


# --------------------------------------------------------------------------------------
# Packed block-diffusion training row (spec §2.3)
# --------------------------------------------------------------------------------------
def packed_training_meta(clean_len: int, anchors: np.ndarray, block_size: int, packed_len: int,
                         clean_valid_len: int | None = None, anchor_valid: np.ndarray | None = None) -> dict:
    """Host-side (numpy) 1-D metadata of ``[clean (S) | block_1 … block_n | pad]`` for one example.

    ``anchors`` are anchor positions into the clean stream (n of them).  Returns numpy arrays
    ``positions, block_ids, context_end, valid`` of length ``packed_len`` (a data-loader helper;
    the mask itself is still built inside attention by :func:`attention_mask`).
    """
    anchors = np.asarray(anchors, np.int32)
    n = anchors.shape[0]
    need = clean_len + n * block_size
    if need > packed_len:
        raise ValueError(f"packed length {packed_len} < clean {clean_len} + {n} blocks × {block_size}")
    cv = clean_len if clean_valid_len is None else clean_valid_len
    positions = np.zeros(packed_len, np.int32)
    block_ids = np.full(packed_len, CAUSAL, np.int32)
    context_end = np.zeros(packed_len, np.int32)
    valid = np.zeros(packed_len, bool)
    positions[:clean_len] = np.arange(clean_len)
    context_end[:clean_len] = np.arange(clean_len) + 1
    valid[:cv] = True
    av = np.ones(n, bool) if anchor_valid is None else np.asarray(anchor_valid, bool)
    for b in range(n):
        sl = slice(clean_len + b * block_size, clean_len + (b + 1) * block_size)
        positions[sl] = anchors[b] + np.arange(block_size)
        block_ids[sl] = b
        context_end[sl] = anchors[b]
        valid[sl] = av[b]
    # padding past the blocks: give it a fresh block id so it never joins a real block
    if need < packed_len:
        block_ids[need:] = n
    return dict(positions=positions, block_ids=block_ids, context_end=context_end, valid=valid)
