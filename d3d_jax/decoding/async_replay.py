"""Replay drafters for asynchronous decoding: a chosen hit rate, and optionally real drafter cost.

* :class:`AsyncReplayDrafter` – a :class:`~d3d_jax.decoding.drafting.ReplayDrafter` whose branch
  alternatives contain the reference token with probability ``hit_rate`` per rank, so a chosen
  fraction of rounds hit.
* :class:`CostedReplayDrafter` – the same tokens, while also running a real drafter model's
  forwards (sync draft, branch pack) and discarding their tokens, so benchmarks pay true drafting
  costs with a controlled τ and hit rate.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from d3d_jax.decoding import branches as br
from d3d_jax.decoding.drafting import DraftOutput, ModelDrafter, ReplayDrafter


class AsyncReplayDrafter(ReplayDrafter):
    """A :class:`ReplayDrafter` whose branch alternatives hit at a chosen rate.

    ``error_rate`` sets τ (each draft token wrong with that probability).  ``hit_rate`` h sets
    how well the branch pack anticipates the target's token at a position: it is the drafter's
    first alternative with probability h, else the second with probability h, and so on (rank
    geometric), so fan-out F catches it with probability 1-(1-h)^F and the all-accept guess
    (one guess) with probability h.  h = 1: every outcome inside the C branch positions hits;
    h = 0: none does.  All coins are keyed by (seed, request index, position).
    """

    def __init__(self, continuations: Sequence[Sequence[int]], vocab_size: int,
                 error_rate: float = 0.0, hit_rate: float = 0.0, seed: int = 0):
        super().__init__(continuations, vocab_size, error_rate, seed)
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"AsyncReplayDrafter hit_rate must be in [0, 1], got {hit_rate}")
        # traced, not part of the signature: one compile serves every hit rate
        self.params = {"hit_rate": jnp.float32(hit_rate)}


def _tie(tokens: jax.Array, logits: jax.Array) -> jax.Array:
    """``tokens``, made to depend on ``logits`` so the compiler cannot drop the forward."""
    return jnp.where(jnp.isnan(jnp.sum(logits)), 0, tokens).astype(jnp.int32)


class CostedReplayDrafter(AsyncReplayDrafter):
    """Replay tokens, real drafter compute: ``cost_model`` (a Qwen3 drafter) runs every forward a
    model drafter would (its KV cache included) and its outputs are discarded."""

    def __init__(self, continuations: Sequence[Sequence[int]], vocab_size: int, cost_model, *,
                 error_rate: float = 0.0, hit_rate: float = 0.0, seed: int = 0,
                 mask_token_id: int | None = None):
        super().__init__(continuations, vocab_size, error_rate, hit_rate, seed)
        self.model = ModelDrafter(cost_model, mask_token_id)
        if self.model.vocab_size != self.vocab_size:
            raise ValueError(f"cost_model vocab_size {self.model.vocab_size} != replay vocab_size "
                             f"{self.vocab_size}")
        self.mask_token_id = self.model.mask_token_id
        self.params = dict(self.params, model=self.model.params)

    @property
    def signature(self):
        return super().signature + (self.model.signature,)

    def init_state(self, num_rows: int, cache_len: int, paging=None) -> dict:
        return dict(super().init_state(num_rows, cache_len),
                    cache=self.model.init_state(num_rows, cache_len, paging))

    def prefill(self, params, data, prompt_bt, prefill_len) -> dict:
        return dict(super().prefill(params, data, prompt_bt, prefill_len),
                    cache=self.model.prefill(params["model"], None, prompt_bt, prefill_len))

    def insert(self, state: dict, rows: dict, slots, pages=None) -> dict:
        return dict(super().insert(state, rows, slots),
                    cache=self.model.insert(state["cache"], rows["cache"], slots, pages))

    def commit(self, state: dict, lengths) -> dict:
        return dict(state, cache=self.model.commit(state["cache"], lengths))

    def catch_up(self, params, state: dict, seq, upto, active, limit: int) -> dict:
        return dict(state, cache=self.model.catch_up(params["model"], state["cache"], seq, upto,
                                                     active, limit))

    def propose(self, params, state: dict, seq, anchor_pos, row_keys, sampling, block_size: int,
                sample_drafts: bool, fanout: int = 0):
        real, cache = self.model.propose(params["model"], state["cache"], seq, anchor_pos, row_keys,
                                         sampling, block_size, False)
        out, state = super().propose(params, state, seq, anchor_pos, row_keys, sampling,
                                     block_size, sample_drafts, fanout)
        return (DraftOutput(_tie(out.drafts, real.logits), out.probs, out.logits, out.alts),
                dict(state, cache=cache))

    def branch_pack(self, params, state: dict, block, block_alts, anchor_pos, draft_len, layout):
        drafts, state = super().branch_pack(params, state, block, block_alts, anchor_pos,
                                            draft_len, layout)
        real, cache = self.model.branch_pack(params["model"], state["cache"], block, block_alts,
                                             anchor_pos, draft_len, layout, with_logits=True)
        return (br.BranchDrafts(_tie(drafts.tokens, real.logits), drafts.alts, None),
                dict(state, cache=cache))
