"""The branch pack of asynchronous drafting (spec §5): one drafter forward for every likely outcome.

While the target verifies the block ``[anchor, d_1 … d_{B-1}]`` at positions ``s … s+B-1``, the
drafter runs ONE forward over

* the **shared prefix** ``[anchor, d_1 … d_{B-1}]`` at ``s … s+B-1``, causal and *kept*: its K/V
  are written to the drafter cache, so on a hit the accepted part is already committed cache and
  no catch-up forward is needed;
* for each rejection slot ``r = 1 … C-1`` and each of the drafter's top-``F`` alternatives ``c``
  to ``d_r`` (excluding ``d_r``), a **correction branch** ``[c, MASK×(B-1)]`` at ``s+r …``: a
  drafting block whose context ends at ``s+r`` (it sees committed cache and the shared prefix
  up to ``d_{r-1}``);
* the **all-accept branch** ``[d_L, MASK×(B-1)]`` at ``s+L`` (``L`` = number of real drafts,
  ``B-1`` normally): its slot 1 guesses the bonus token.

All of it is plain :class:`~d3d_jax.model.masks.TokenMeta` (branches are blocks anchored inside
the shared prefix), so the drafter is the unchanged Qwen3 with a different mask.  Budget:
``N_async = B·((C-1)·F + 2)`` tokens.

After verification (``a`` drafts accepted, target token ``c`` at slot ``a``) a branch **hits** iff
``a < L``, ``a+1 ≤ C-1`` and ``c`` is one of the alternatives at slot ``a+1``; or ``a = L`` and
``c`` equals the all-accept branch's slot-1 guess.  A correction-branch hit makes the branch the
next block as is.  An all-accept hit makes ``[bonus, slots 2 … B-1]`` the next block: one real
draft short, so ``L`` drops to ``B-2`` and the last slot is padding that verification must never
accept (static shapes: the pad stays, ``draft_len`` says how many drafts are real).

Per-slot "alternatives" (top-F excluding the draft) are computed on device for every branch, so
the next round's branches need no logits from the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# the pack's static shape is part of a decoder's config, so it is declared beside it
from d3d_jax.config.decoding import MAX_ASYNC_BUDGET, BranchLayout  # noqa: F401
from d3d_jax.model.kv_cache import KVCache
from d3d_jax.model.masks import CAUSAL, TokenMeta, block_meta, concat_meta

NO_TOKEN = -1  # never equal to a real token id: marks alternatives that must not hit
# --------------------------------------------------------------------------------------
# Alternatives and packing (pure, traceable)
# --------------------------------------------------------------------------------------
def slot_alternatives(slot_logits: jax.Array, drafts: jax.Array, fanout: int) -> jax.Array:
    """Top-``fanout`` tokens of each slot's logits excluding the slot's draft: ``[..., S, F]``."""
    v = slot_logits.shape[-1]
    is_draft = jnp.arange(v, dtype=jnp.int32) == drafts[..., None]
    masked = jnp.where(is_draft, -jnp.inf, slot_logits.astype(jnp.float32))
    return jax.lax.top_k(masked, fanout)[1].astype(jnp.int32)


def correction_alternatives(block_alts: jax.Array, draft_len: jax.Array, layout: BranchLayout
                            ) -> jax.Array:
    """Alternatives ``[b, C-1, F]`` for rejection slots r = 1 … C-1; ``NO_TOKEN`` where r > L.

    ``block_alts`` ``[b, B, F]`` holds each slot's alternatives (slot 0 unused).  A rejection
    at slot r needs r real drafts, so a branch past ``draft_len`` can never be the outcome.
    """
    alts = block_alts[:, 1:layout.positions]
    r = jnp.arange(1, layout.positions, dtype=jnp.int32)
    usable = (r[None, :] <= draft_len[:, None])[:, :, None]
    return jnp.where(usable, alts, NO_TOKEN)


def pack_branches(block: jax.Array, corr_alts: jax.Array, anchor_pos: jax.Array,
                  draft_len: jax.Array, layout: BranchLayout, mask_token_id: int
                  ) -> tuple[jax.Array, TokenMeta, jax.Array]:
    """Tokens ``[b, N_async]``, metadata and keep mask of the packed drafter input.

    Order: shared prefix (B) | correction branches (r-major, f-minor) | all-accept branch.
    """
    bsz, bs = block.shape
    slot = jnp.arange(bs, dtype=jnp.int32)
    # Shared prefix: causal, kept; a padded last slot (draft_len = B-2) is neither seen nor kept.
    prefix_pos = anchor_pos[:, None] + slot[None]
    prefix_valid = slot[None] <= draft_len[:, None]
    prefix_meta = TokenMeta(prefix_pos, jnp.full((bsz, bs), CAUSAL, jnp.int32), prefix_pos + 1,
                            prefix_valid)
    # Branch anchors: correction branch (r, f) at s+r with token alt; all-accept at s+L with d_L.
    r = jnp.repeat(jnp.arange(1, layout.positions, dtype=jnp.int32), layout.fanout)
    corr_tok = corr_alts.reshape(bsz, layout.num_correction)
    corr_tok = jnp.where(corr_tok == NO_TOKEN, mask_token_id, corr_tok)  # a real id for the embedding
    accept_tok = jnp.take_along_axis(block, draft_len[:, None], axis=1)
    anchor_tok = jnp.concatenate([corr_tok, accept_tok], axis=1)  # [b, nbr]
    anchor_off = jnp.concatenate([jnp.broadcast_to(r, (bsz, layout.num_correction)),
                                  draft_len[:, None]], axis=1)
    br_meta = block_meta(anchor_pos[:, None] + anchor_off, bs)
    br_tok = jnp.concatenate(
        [anchor_tok[:, :, None],
         jnp.full((bsz, layout.num_branches, bs - 1), mask_token_id, jnp.int32)], axis=2)
    tokens = jnp.concatenate([block, br_tok.reshape(bsz, -1)], axis=1).astype(jnp.int32)
    meta = concat_meta([prefix_meta, br_meta])
    keep = jnp.concatenate([prefix_valid, jnp.zeros((bsz, layout.num_branches * bs), bool)], axis=1)
    return tokens, meta, keep


# --------------------------------------------------------------------------------------
# The packed drafter forward
# --------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BranchDrafts:
    """Every branch's block: ``tokens [b, nbr, B]`` (slot 0 = branch anchor, slots ≥ 1 argmax
    drafts), ``alts [b, nbr, B, F]`` per-slot alternatives, ``logits [b, nbr, B, V]`` or None."""

    tokens: jax.Array
    alts: jax.Array
    logits: jax.Array | None


def packed_forward(model, cache: KVCache, block: jax.Array, block_alts: jax.Array,
                   anchor_pos: jax.Array, draft_len: jax.Array, layout: BranchLayout,
                   mask_token_id: int, with_logits: bool = False) -> tuple[BranchDrafts, KVCache]:
    """One drafter forward over the whole branch pack (traceable; a model drafter's ``branch_pack``).

    ``cache.lengths`` must equal ``anchor_pos`` (everything before the anchor committed); the
    returned cache holds the shared prefix's K/V at ``s … s+L`` with lengths unchanged.
    """
    bsz, bs = block.shape
    corr_alts = correction_alternatives(block_alts, draft_len, layout)
    tokens, meta, keep = pack_branches(block, corr_alts, anchor_pos, draft_len, layout, mask_token_id)
    logits, cache = model(tokens, meta, cache=cache, keep=keep)
    br_logits = logits[:, bs:].reshape(bsz, layout.num_branches, bs, -1)
    drafts = jnp.argmax(br_logits, axis=-1).astype(jnp.int32)
    anchors = tokens[:, bs::bs][:, :, None]
    br_tokens = jnp.concatenate([anchors, drafts[:, :, 1:]], axis=2)
    alts = slot_alternatives(br_logits, br_tokens, layout.fanout)
    return BranchDrafts(br_tokens, alts, br_logits if with_logits else None), cache


# --------------------------------------------------------------------------------------
# Hit matching and the next block
# --------------------------------------------------------------------------------------
def match_branch(block_alts: jax.Array, draft_len: jax.Array, all_accept_guess: jax.Array,
                 accepted: jax.Array, correction: jax.Array, layout: BranchLayout
                 ) -> tuple[jax.Array, jax.Array]:
    """``(hit [b] bool, branch index [b])`` for the verified outcome (``a`` accepted, token ``c``).

    ``block_alts`` are the alternatives of the block that was verified (the ones the pack used).
    """
    corr_alts = correction_alternatives(block_alts, draft_len, layout)  # [b, C-1, F]
    bsz = accepted.shape[0]
    r = accepted + 1
    in_range = (accepted < draft_len) & (r <= layout.positions - 1)
    r_idx = jnp.clip(r - 1, 0, max(layout.positions - 2, 0))
    if layout.num_correction:
        row = jnp.take_along_axis(corr_alts, r_idx[:, None, None], axis=1)[:, 0]  # [b, F]
        eq = row == correction[:, None]
        corr_hit = in_range & jnp.any(eq, axis=1)
        corr_branch = r_idx * layout.fanout + jnp.argmax(eq, axis=1).astype(jnp.int32)
    else:
        corr_hit = jnp.zeros((bsz,), bool)
        corr_branch = jnp.zeros((bsz,), jnp.int32)
    accept_hit = (accepted == draft_len) & (correction == all_accept_guess)
    hit = corr_hit | accept_hit
    branch = jnp.where(accept_hit, layout.all_accept_index, corr_branch).astype(jnp.int32)
    return hit, branch


def next_block_from_branch(drafts: BranchDrafts, branch: jax.Array, correction: jax.Array,
                           layout: BranchLayout, mask_token_id: int
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(block [b,B], block_alts [b,B,F], draft_len [b])`` of the next round after a hit.

    A correction branch is used as is (its anchor is the correction).  The all-accept branch is
    shifted by one: ``[bonus, slots 2 … B-1, pad]`` with ``draft_len = B-2``.
    """
    bs = layout.block_size
    tok = jnp.take_along_axis(drafts.tokens, branch[:, None, None], axis=1)[:, 0]  # [b, B]
    alts = jnp.take_along_axis(drafts.alts, branch[:, None, None, None], axis=1)[:, 0]  # [b,B,F]
    is_accept = branch == layout.all_accept_index
    pad_tok = jnp.full_like(tok[:, :1], mask_token_id)
    shifted_tok = jnp.concatenate([correction[:, None], tok[:, 2:], pad_tok], axis=1)
    pad_alts = jnp.full_like(alts[:, :1], NO_TOKEN)
    shifted_alts = jnp.concatenate([pad_alts, alts[:, 2:], pad_alts], axis=1)
    block = jnp.where(is_accept[:, None], shifted_tok, tok)
    block = block.at[:, 0].set(correction)
    block_alts = jnp.where(is_accept[:, None, None], shifted_alts, alts)
    draft_len = jnp.where(is_accept, bs - 2, bs - 1).astype(jnp.int32)
    return block, block_alts, draft_len
