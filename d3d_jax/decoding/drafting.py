"""Synchronous block drafting (spec §4) and a replay drafter for tests and benchmarks.

A drafter is split like an NNX model: a hashable *spec* (static under ``jit``) with pure
methods, its *params* (a pytree: model weights, or nothing) and a per-batch *state* (the
drafter's KV cache, or the reference continuation).  The engine passes all three into its jitted
cores, so drafting runs inside the on-device round loop.

* :class:`ModelDrafter` – one forward per block: the committed tokens it has not cached yet
  (causal, kept; 0..B of them, padded to B with ``valid=False``) followed by ``[anchor, MASK×(B-1)]``
  anchored at the last committed position ``s`` (bidirectional, sees committed context < s; never
  kept).  Drafts are the argmax of slots 1..B-1 (point mass) or samples from ``q``.
* :class:`ReplayDrafter` – proposes a given continuation, each token wrong with probability
  ``error_rate``: sets τ at will without a trained drafter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d3d_jax.decoding import verify as V
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model.masks import block_meta, causal_meta, concat_meta


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftOutput:
    drafts: jax.Array  # [b, B-1] int32 proposals for positions s+1 .. s+B-1
    probs: jax.Array | None  # [b, B-1, V] q for sampled drafts, else None
    logits: jax.Array | None  # [b, B-1, V] per-slot logits (async alternatives) or None


UNCACHED_NARROW = 4  # uncached committed tokens fed by the drafter's narrow variant


# --------------------------------------------------------------------------------------
# Model drafter
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelDraftSpec:
    graphdef: Any
    mask_token_id: int

    def prefill(self, params, state: kvc.KVCache, prompt_bt: jax.Array, prefill_len: jax.Array):
        """Cache the first ``prefill_len[b]`` prompt tokens (causal)."""
        model = nnx.merge(self.graphdef, params)
        b, p = prompt_bt.shape
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        meta = causal_meta(pos, pos < prefill_len[:, None])
        # nothing cached yet: attend to one (masked) slot instead of the whole cache
        _, cache = model(prompt_bt, meta, cache=state.with_lengths(jnp.zeros_like(prefill_len)),
                         cache_span=1)
        return cache.with_lengths(prefill_len)

    def propose(self, params, state: kvc.KVCache, seq: jax.Array, anchor_pos: jax.Array,
                row_keys: jax.Array, sampling: V.SamplingParams, block_size: int,
                sample_drafts: bool):
        model = nnx.merge(self.graphdef, params)
        b = seq.shape[0]
        bs = block_size
        anchor = jnp.take_along_axis(seq, anchor_pos[:, None], axis=1)
        tok_blk = jnp.concatenate([anchor, jnp.full((b, bs - 1), self.mask_token_id, jnp.int32)], 1)
        meta_blk = block_meta(anchor_pos[:, None], bs)

        def forward(n_u, state):
            # committed tokens at positions cached_len .. s-1 (at most B: one round's commit),
            # padded to n_u slots with valid=False
            pos_u = state.lengths[:, None] + jnp.arange(n_u, dtype=jnp.int32)[None]
            valid_u = pos_u < anchor_pos[:, None]
            tok_u = jnp.take_along_axis(seq, jnp.minimum(pos_u, seq.shape[1] - 1), axis=1)
            meta = concat_meta([causal_meta(pos_u, valid_u), meta_blk])

            def with_span(span, cache, tokens, meta):
                # logits only for block slots 1..B-1 -> positions s+1..s+B-1
                return model(tokens, meta, cache=cache, logits_start=n_u + 1, cache_span=span,
                             defer_cache_write=True)

            logits, write = kvc.call_with_span(with_span, jnp.max(state.lengths), state,
                                               jnp.concatenate([tok_u, tok_blk], axis=1), meta)
            return logits, write.pad_to(2 * bs)

        # Most rounds commit a few tokens: padding the uncached part to B would spend most of
        # the drafter's layer work on padding, so a narrow variant serves rounds that fit it.
        if bs > UNCACHED_NARROW:
            wide = jnp.max(anchor_pos - state.lengths) > UNCACHED_NARROW
            slot_logits, write = jax.lax.switch(
                wide.astype(jnp.int32), [lambda st: forward(UNCACHED_NARROW, st),
                                         lambda st: forward(bs, st)], state)
        else:
            slot_logits, write = forward(bs, state)
        cache = write.apply(state)  # outside the switches: in place, no cache copy
        probs = None  # q is needed only to verify sampled drafts
        if sample_drafts and not sampling.greedy:
            probs = V.processed_probs(slot_logits, sampling)
            positions = anchor_pos[:, None] + 1 + jnp.arange(bs - 1, dtype=jnp.int32)[None]
            drafts = V.sample_keyed(V.position_keys(row_keys, positions, V.SALT_DRAFT), probs)
        else:
            drafts = jnp.argmax(slot_logits, axis=-1).astype(jnp.int32)
        return DraftOutput(drafts, probs, slot_logits), cache.with_lengths(anchor_pos)


class ModelDrafter:
    """A Qwen3 drafter (NNX module) used with its ``<|MASK|>`` id."""

    def __init__(self, model, mask_token_id: int | None = None):
        cfg = model.config
        mask = mask_token_id if mask_token_id is not None else cfg.mask_token_id
        if mask is None:
            raise ValueError("drafter mask_token_id is unknown: pass mask_token_id= (config.json has none)")
        if not 0 <= int(mask) < cfg.vocab_size:
            raise ValueError(f"drafter mask_token_id {mask} is outside its vocabulary [0, {cfg.vocab_size})")
        graphdef, params = nnx.split(model)
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.spec = ModelDraftSpec(graphdef, int(mask))
        self.params = params

    def init_state(self, prompt_tokens: np.ndarray, prompt_lens: np.ndarray, row_ids: np.ndarray,
                   cache_len: int):
        return kvc.init_cache(self.config, prompt_tokens.shape[0], cache_len)


# --------------------------------------------------------------------------------------
# Replay drafter
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReplayDraftSpec:
    vocab_size: int
    error_rate: float
    seed: int

    def prefill(self, params, state, prompt_bt, prefill_len):
        return state

    def propose(self, params, state: dict, seq, anchor_pos, row_keys, sampling, block_size,
                sample_drafts):
        """Reference token at each position; wrong (a different token) with prob ``error_rate``."""
        del params, seq, row_keys
        ref_bs = state["ref"]
        positions = anchor_pos[:, None] + 1 + jnp.arange(block_size - 1, dtype=jnp.int32)[None]
        ref = jnp.take_along_axis(ref_bs, jnp.minimum(positions, ref_bs.shape[1] - 1), axis=1)
        ref = jnp.where((positions < ref_bs.shape[1]) & (ref >= 0), ref, 0)
        # errors keyed by (replay seed, prompt index, position): independent of batching
        base = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(self.seed), i))(
            state["row"].astype(jnp.uint32))
        keys = V.position_keys(base, positions, V.SALT_REPLAY)
        coin = V.uniform_keyed(keys)
        shift = 1 + jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 1), (), 0,
                                                          max(self.vocab_size - 1, 1)))(keys.reshape(-1))
        wrong = (ref + shift.reshape(ref.shape)) % self.vocab_size
        drafts = jnp.where(coin < self.error_rate, wrong, ref).astype(jnp.int32)
        probs = None
        if sample_drafts and not sampling.greedy:  # a point mass: q(d) = 1
            probs = jax.nn.one_hot(drafts, self.vocab_size, dtype=jnp.float32)
        return DraftOutput(drafts, probs, None), state


class ReplayDrafter:
    """Proposes ``continuations[i]`` (generated ids, after prompt i) with a per-token error rate."""

    def __init__(self, continuations: Sequence[Sequence[int]], vocab_size: int,
                 error_rate: float = 0.0, seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"ReplayDrafter error_rate must be in [0, 1], got {error_rate}")
        self.continuations = [list(map(int, c)) for c in continuations]
        self.vocab_size = int(vocab_size)
        self.spec = ReplayDraftSpec(int(vocab_size), float(error_rate), int(seed))
        self.params = None

    def init_state(self, prompt_tokens: np.ndarray, prompt_lens: np.ndarray, row_ids: np.ndarray,
                   cache_len: int):
        ref = np.full((prompt_tokens.shape[0], cache_len), -1, np.int32)
        for r, (row, plen) in enumerate(zip(row_ids, prompt_lens)):
            if row < 0:
                continue
            if row >= len(self.continuations):
                raise ValueError(f"ReplayDrafter has {len(self.continuations)} continuations, "
                                 f"prompt {row} needs one")
            full = list(prompt_tokens[r, :plen]) + self.continuations[row]
            full = full[:cache_len]
            ref[r, : len(full)] = full
        return {"ref": jnp.asarray(ref), "row": jnp.asarray(np.maximum(row_ids, 0), jnp.int32)}
