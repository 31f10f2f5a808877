"""Asynchronous drafting (spec §5) as two device-side steps that never wait on the host.

Each round is three dispatches, none of which needs a host read:

* target side, :meth:`AsyncCore.target_step`: the core's verify and commit of the block handed
  over by the drafter side, plus the round's *decision* ``[b, 4]`` (accepted, target token, new
  anchor, done) for the drafter side;
* drafter side, :meth:`AsyncCore.packed`: the branch pack (``drafter.branch_pack``), one forward
  that drafts the next block for every likely outcome; dispatched right behind the verify, so the
  two run at once on disjoint device slices;
* drafter side, :meth:`AsyncCore.select`: match the decision against the branches per row.  Hit:
  the branch is the row's next block, and the drafter cache already holds the accepted tokens.
  Miss: one synchronous draft, computed under ``lax.cond`` only when some active row missed, and
  kept only for the rows that missed.  Returns the next *hand-off* ``[b, B+1]`` (block and real
  draft count) for the next verify.

Drafts are always the drafter's argmax (point masses), as the branch alternatives assume.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from d3d_jax.decoding import branches as br
from d3d_jax.decoding.core import DecodeCore, DecodeState, RowInput, key_data
from d3d_jax.decoding.verify import GREEDY

# Columns of the decision (target -> drafter) and of the per-round view (drafter -> host).
D_ACCEPTED, D_NEXT, D_ANCHOR, D_DONE = range(4)
V_DONE, V_HIT, V_MISS, V_ACCEPTED, V_DRAFT_LEN = range(5)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AsyncDraftState:
    """The drafter side of every slot: drafter state and the block it drafted next."""

    dstate: Any  # the drafter's per-slot state (cache committed through ``anchor``)
    block: jax.Array  # [b, B] next block to verify: [anchor, d_1 … d_{B-1}]
    alts: jax.Array  # [b, B, F] per-slot alternatives of that block (slot 0 unused)
    draft_len: jax.Array  # [b] real drafts in the block (B-2 after an all-accept hit)
    anchor: jax.Array  # [b] position of the block's anchor
    key_data: jax.Array  # [b, ...] raw PRNG key data (as DecodeState's)
    hits: jax.Array  # [b] rounds whose outcome a branch anticipated
    misses: jax.Array  # [b] rounds that needed a synchronous draft
    sync_drafts: jax.Array  # [] rounds in which the synchronous draft ran

    @property
    def row_keys(self) -> jax.Array:
        return jax.random.wrap_key_data(self.key_data)


def handoff(block: jax.Array, draft_len: jax.Array) -> jax.Array:
    """The drafter side's one array for the target side: ``[b, B+1]`` (block, real drafts)."""
    return jnp.concatenate([block, draft_len[:, None]], axis=1).astype(jnp.int32)


def verify_inputs(block: jax.Array, draft_len: jax.Array, mask_token_id: int):
    """Drafts fed to the target (padding as a real id) and compared by the rule (padding never
    matches): a shortened block's last slot can never be accepted."""
    drafts = block[:, 1:]
    real = jnp.arange(1, block.shape[1], dtype=jnp.int32)[None] <= draft_len[:, None]
    return jnp.where(real, drafts, mask_token_id), jnp.where(real, drafts, br.NO_TOKEN)


class AsyncCore:
    """Async decoding over :class:`DecodeCore` (target side, drafter-free) and a drafter."""

    def __init__(self, core: DecodeCore, drafter, layout: br.BranchLayout):
        self.core = core
        self.drafter = drafter
        self.layout = layout

    # ---------------------------------------------------------------- drafter side
    def init_state(self, num_slots: int) -> AsyncDraftState:
        b, lay = num_slots, self.layout
        zeros = jnp.zeros((b,), jnp.int32)
        return AsyncDraftState(
            self.drafter.init_state(b, self.core.cache_len),
            jnp.zeros((b, lay.block_size), jnp.int32),
            jnp.full((b, lay.block_size, lay.fanout), br.NO_TOKEN, jnp.int32),
            jnp.full((b,), lay.block_size - 1, jnp.int32), zeros, key_data(zeros, zeros), zeros,
            zeros, jnp.int32(0))

    def sync_block(self, params, dstate, anchor_tok, anchor_pos, keys):
        """One synchronous draft from each row's anchor: ``(block, alts, draft_len)``.  The cache
        already holds every committed token before the anchor, so the draft writes nothing."""
        b, bs = anchor_tok.shape[0], self.layout.block_size
        seq = jnp.zeros((b, self.core.cache_len), jnp.int32).at[jnp.arange(b), anchor_pos].set(
            anchor_tok, mode="drop")
        out, _ = self.drafter.propose(params, dstate, seq, anchor_pos, keys, GREEDY, bs, False,
                                      self.layout.fanout)
        block = jnp.concatenate([anchor_tok[:, None], out.drafts], axis=1).astype(jnp.int32)
        return block, out.alts, jnp.full((b,), bs - 1, jnp.int32)

    def prefill_drafter(self, params, rows: RowInput) -> AsyncDraftState:
        """Prefilled drafter rows with their first block (a synchronous draft)."""
        plen = rows.prompt_len - 1
        dstate = self.drafter.prefill(params, rows.drafter_data, rows.prompt, plen)
        keys = key_data(rows.seed, rows.index)
        anchor_tok = jnp.take_along_axis(rows.prompt, plen[:, None], axis=1)[:, 0]
        block, alts, dl = self.sync_block(params, dstate, anchor_tok, plen,
                                          jax.random.wrap_key_data(keys))
        zeros = jnp.zeros_like(plen)
        return AsyncDraftState(dstate, block, alts, dl, plen, keys, zeros, zeros, jnp.int32(0))

    def insert(self, side: AsyncDraftState, rows: AsyncDraftState, slots: jax.Array):
        """Rows join the drafter side; returns ``(side, hand-off)``."""
        put = lambda full, new: full.at[slots].set(new, mode="drop")  # noqa: E731
        side = AsyncDraftState(
            self.drafter.insert(side.dstate, rows.dstate, slots), put(side.block, rows.block),
            put(side.alts, rows.alts), put(side.draft_len, rows.draft_len),
            put(side.anchor, rows.anchor), put(side.key_data, rows.key_data),
            put(side.hits, rows.hits), put(side.misses, rows.misses), side.sync_drafts)
        return side, handoff(side.block, side.draft_len)

    def packed(self, params, side: AsyncDraftState):
        """The branch pack for the block being verified (its own dispatch: it overlaps the verify)."""
        drafts, dstate = self.drafter.branch_pack(params, side.dstate, side.block, side.alts,
                                                  side.anchor, side.draft_len, self.layout)
        return drafts, dataclasses.replace(side, dstate=dstate)

    def select(self, params, side: AsyncDraftState, drafts: br.BranchDrafts, decision: jax.Array):
        """Hit/miss per row and the next block; the synchronous draft only if some row missed.
        Returns ``(side, hand-off, view [b, 5])``."""
        lay = self.layout
        accepted, next_token = decision[:, D_ACCEPTED], decision[:, D_NEXT]
        new_anchor, done = decision[:, D_ANCHOR], decision[:, D_DONE].astype(bool)
        guess = drafts.tokens[:, lay.all_accept_index, 1]
        hit, branch = br.match_branch(side.alts, side.draft_len, guess, accepted, next_token, lay)
        override = self.core.override
        if override is not None:
            hit, branch = override.hit(hit, branch, accepted, next_token, side.anchor,
                                       side.row_keys, lay)
        block, alts, dl = br.next_block_from_branch(drafts, branch, next_token, lay,
                                                    self.drafter.mask_token_id)
        # the shared prefix already wrote the accepted tokens' K/V: commit through the new anchor
        dstate = self.drafter.commit(side.dstate, new_anchor)
        active = ~done
        miss = active & ~hit

        def redraft(ops):
            block, alts, dl, count = ops
            s_block, s_alts, s_dl = self.sync_block(params, dstate, next_token, new_anchor,
                                                    side.row_keys)
            keep = miss[:, None]
            return (jnp.where(keep, s_block, block), jnp.where(keep[..., None], s_alts, alts),
                    jnp.where(miss, s_dl, dl), count + 1)

        block, alts, dl, count = jax.lax.cond(jnp.any(miss), redraft, lambda ops: ops,
                                              (block, alts, dl, side.sync_drafts))
        view = jnp.stack([done, hit & active, miss, accepted, side.draft_len], axis=1)
        side = AsyncDraftState(dstate, block, alts, dl, new_anchor, side.key_data,
                               side.hits + (hit & active), side.misses + miss, count)
        return side, handoff(block, dl), view.astype(jnp.int32)

    # ---------------------------------------------------------------- target side
    def target_step(self, target_params, state: DecodeState, hand: jax.Array):
        """Verify and commit the handed-over block; returns ``(state, decision, result)``."""
        core = self.core
        block, draft_len = hand[:, :-1], hand[:, -1]
        fed, compared = verify_inputs(block, draft_len, self.drafter.mask_token_id)
        accepted, next_token, cache, logprobs = core.verify(target_params, state, fed, compared)
        state, result = core.commit(state, fed, accepted, next_token, cache, logprobs)
        decision = jnp.stack([accepted, next_token, state.anchor_pos, state.done.astype(jnp.int32)],
                             axis=1).astype(jnp.int32)
        return state, decision, result
