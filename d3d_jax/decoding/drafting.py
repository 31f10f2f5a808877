"""The drafter protocol (spec §4, §5), the model drafter and a replay drafter for tests and benchmarks.

A drafter is used through one protocol, :class:`Drafter`, so the decode core never asks which
kind it holds.  Its methods are pure and traceable: the core calls them inside its jitted steps
with the drafter's ``params`` (a pytree: weights, or a few scalars) and its per-slot ``state``
(a KV cache, a reference continuation, ...).  Everything else a drafter holds is static.

* :class:`ModelDrafter` – one forward per block: the committed tokens it has not cached yet
  (causal, kept; 0..B of them, padded with ``valid=False``) followed by ``[anchor, MASK×(B-1)]``
  anchored at the last committed position ``s`` (bidirectional, sees committed context < s; never
  kept).  Drafts are the argmax of slots 1..B-1 (point mass) or samples from ``q``.  Its branch
  pack is :func:`~d3d_jax.decoding.branches.packed_forward`.  Its cache is dense, or paged over
  the target's page ids and tables (:mod:`~d3d_jax.model.paged_kv`): the model reads either.
* :class:`ReplayDrafter` – proposes a given continuation, each token wrong with probability
  ``error_rate``: sets τ at will without a trained drafter.  Its branch alternatives catch the
  reference token with probability ``params["hit_rate"]`` (0 here; see
  :class:`~d3d_jax.decoding.async_replay.AsyncReplayDrafter`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d3d_jax.decoding import branches as br
from d3d_jax.decoding import verify as V
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model import paged_kv as pkv
from d3d_jax.model.masks import block_meta, causal_meta, concat_meta


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftOutput:
    drafts: jax.Array  # [b, B-1] int32 proposals for positions s+1 .. s+B-1
    probs: jax.Array | None  # [b, B-1, V] q for sampled drafts, else None
    logits: jax.Array | None  # [b, B-1, V] per-slot logits, or None
    alts: jax.Array | None = None  # [b, B, F] per-slot alternatives (slot 0 NO_TOKEN), async only


@runtime_checkable
class Drafter(Protocol):
    """What the decode core needs from a drafter.  ``b`` = rows (slots, or requests being
    prefilled); ``S`` = cache length; every array method is traceable."""

    vocab_size: int
    mask_token_id: int  # a real id fed where a slot holds no token (padding)
    params: Any  # pytree passed to the methods below (placed on the drafter's devices)
    # structural identity: drafters with equal signatures trace to the same computation
    signature: Hashable

    def init_state(self, num_rows: int, cache_len: int, paging: tuple[int, int] | None = None) -> Any:
        """Empty per-slot state (device arrays); ``paging = (num_pages, page_size)``: a cache, if
        the drafter keeps one, paged as the target's (:mod:`~d3d_jax.model.paged_kv`)."""

    def request_data(self, requests: Sequence[Any], cache_len: int) -> Any:
        """Host data per request (numpy pytree with a leading row axis, or None)."""

    def prefill(self, params, data, prompt_bt: jax.Array, prefill_len: jax.Array) -> Any:
        """Rows' state after caching the first ``prefill_len[b]`` prompt tokens."""

    def insert(self, state, rows, slots: jax.Array, pages: jax.Array | None = None) -> Any:
        """``state`` with prefilled ``rows`` written into ``slots`` (out-of-range slots dropped);
        ``pages [n, max_pages]``: the rows' page tables, for a paged cache."""

    def chunk_model(self, params) -> Any:
        """The model whose causal forward writes this drafter's KV cache (a chunked prefill runs
        it over the paged state, beside the target), or None when its state is no KV cache."""

    def propose(self, params, state, seq, anchor_pos, row_keys, sampling: V.SamplingParams,
                block_size: int, sample_drafts: bool, fanout: int = 0
                ) -> tuple[DraftOutput, Any]:
        """One block from each row's anchor; the state caches every committed token before it.
        ``fanout > 0`` also returns each slot's top-``fanout`` alternatives (async)."""

    def branch_pack(self, params, state, block, block_alts, anchor_pos, draft_len,
                    layout: br.BranchLayout) -> tuple[br.BranchDrafts, Any]:
        """Every branch's block for the block being verified (spec §5)."""

    def commit(self, state, lengths: jax.Array) -> Any:
        """The state with everything before ``lengths[b]`` committed (caches roll back/forward)."""

    def catch_up(self, params, state, seq, upto: jax.Array, active: jax.Array, limit: int) -> Any:
        """The state holding every committed token before ``upto[b]`` but at most ``limit`` of
        them (active rows): after plain rounds, which never run the drafter (auto mode)."""


def insert_cache_rows(cache: kvc.KVCache, rows: kvc.KVCache, slots: jax.Array) -> kvc.KVCache:
    """Write the rows' caches (``[L, n, P, ...]``, P <= S) into ``slots`` of a cache ``[L, b, S, ...]``."""
    return cache.inserted(rows, slots)


def insert_leading(full: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """Write ``rows`` (leading row axis) into ``slots`` of ``full``."""
    return full.at[slots].set(rows, mode="drop")


def as_drafter(drafter, target_vocab: int, mask_token_id: int | None = None):
    """A :class:`Drafter` (as given), a Qwen3 drafter wrapped in :class:`ModelDrafter`, or None."""
    if drafter is None:
        return None
    d = drafter if isinstance(drafter, Drafter) else ModelDrafter(drafter, mask_token_id)
    if d.vocab_size != target_vocab:
        raise ValueError(f"drafter vocab_size {d.vocab_size} differs from target vocab_size "
                         f"{target_vocab}: they must share one tokenizer")
    return d


def prompt_score(logits_btv: jax.Array, prompt_bt: jax.Array, prefill_len: jax.Array) -> jax.Array:
    """``[b]``: the share of prompt positions ``1 … prefill_len[b]`` whose token is the argmax of
    the logits one position before (NaN where ``prefill_len`` is 0)."""
    hit = jnp.argmax(logits_btv[:, :-1], axis=-1).astype(jnp.int32) == prompt_bt[:, 1:]
    valid = jnp.arange(prompt_bt.shape[1] - 1)[None, :] < prefill_len[:, None]
    n = jnp.sum(valid, axis=1)
    return jnp.where(n > 0, jnp.sum(hit & valid, axis=1) / jnp.maximum(n, 1), jnp.nan).astype(jnp.float32)


def chunk_score(logits_bcv: jax.Array, prompt_bt: jax.Array, start_b: jax.Array, count_b: jax.Array
                ) -> jax.Array:
    """:func:`prompt_score` of a prefill chunk: the share of its ``count_b`` positions from
    ``start_b`` on whose next prompt token is the argmax of their logits (NaN for none)."""
    c = logits_bcv.shape[1]
    padded = jnp.pad(prompt_bt, ((0, 0), (0, c)))
    nxt = jax.vmap(lambda p, s: jax.lax.dynamic_slice_in_dim(p, s + 1, c))(padded, start_b)
    hit = jnp.argmax(logits_bcv, axis=-1).astype(jnp.int32) == nxt
    valid = jnp.arange(c)[None, :] < count_b[:, None]
    n = jnp.sum(valid, axis=1)
    return jnp.where(n > 0, jnp.sum(hit & valid, axis=1) / jnp.maximum(n, 1), jnp.nan).astype(jnp.float32)


def prefill_scored(drafter, params, data, prompt_bt: jax.Array, prefill_len: jax.Array):
    """``(state, score [b])``: the drafter's prefill and its prompt score
    (:meth:`ModelDrafter.prefill_scored`); NaN scores for a drafter that has none (a replay)."""
    if hasattr(drafter, "prefill_scored"):
        return drafter.prefill_scored(params, data, prompt_bt, prefill_len)
    return (drafter.prefill(params, data, prompt_bt, prefill_len),
            jnp.full((prompt_bt.shape[0],), jnp.nan, jnp.float32))


CATCH_UP_CHUNK = 16  # committed tokens a catch-up forward caches per row


# --------------------------------------------------------------------------------------
# Model drafter
# --------------------------------------------------------------------------------------
class ModelDrafter:
    """A Qwen3 drafter (NNX module) used with its ``<|MASK|>`` id."""

    def __init__(self, model, mask_token_id: int | None = None):
        cfg = model.config
        mask = mask_token_id if mask_token_id is not None else cfg.mask_token_id
        if mask is None:
            raise ValueError("drafter mask_token_id is unknown: pass mask_token_id= (config.json has none)")
        if not 0 <= int(mask) < cfg.vocab_size:
            raise ValueError(f"drafter mask_token_id {mask} is outside its vocabulary [0, {cfg.vocab_size})")
        # the model's own arrays, never a copy (a decoder reads them in place; the decoder doc)
        self.graphdef, self.params = nnx.split(model)
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.mask_token_id = int(mask)
        self.signature = ("model", self.graphdef, self.mask_token_id)

    def init_state(self, num_rows: int, cache_len: int, paging: tuple[int, int] | None = None):
        if paging is None:
            return kvc.init_cache(self.config, num_rows, cache_len)
        num_pages, page_size = paging
        return pkv.init_paged_cache(self.config, num_pages, page_size, num_rows, -(-cache_len // page_size))

    def request_data(self, requests, cache_len: int):
        return None

    def prefill(self, params, data, prompt_bt: jax.Array, prefill_len: jax.Array) -> kvc.KVCache:
        """A prompt-length cache holding the first ``prefill_len[b]`` prompt tokens (causal)."""
        # the score is dropped, and under jit XLA drops the LM head with it: the compiled prefill
        # holds no vocabulary-wide op (tests/test_drafting.py), so this costs a cache-only prefill
        return self.prefill_scored(params, data, prompt_bt, prefill_len)[0]

    def prefill_scored(self, params, data, prompt_bt: jax.Array, prefill_len: jax.Array
                       ) -> tuple[kvc.KVCache, jax.Array]:
        """:meth:`prefill`, and from the same forward each row's prompt score ``[b]``: the share
        of prompt tokens ``1 … prefill_len`` the drafter predicts (its top-1 after the tokens
        before), NaN for a prompt of one token.  Auto mode's first evidence of a request."""
        model = nnx.merge(self.graphdef, params)
        b, p = prompt_bt.shape
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        meta = causal_meta(pos, pos < prefill_len[:, None])
        # nothing cached yet: attend to one (masked) slot instead of the whole cache
        logits, cache = model(prompt_bt, meta, cache=kvc.init_cache(self.config, b, p), cache_span=1)
        return cache.with_lengths(prefill_len), prompt_score(logits, prompt_bt, prefill_len)

    def insert(self, state, rows, slots, pages=None):
        if isinstance(state, pkv.PagedKVCache):  # the target's pages: the same table
            return state.inserted(rows, pages, slots)
        return insert_cache_rows(state, rows, slots)

    def chunk_model(self, params):
        return nnx.merge(self.graphdef, params)

    def commit(self, state: kvc.KVCache, lengths: jax.Array) -> kvc.KVCache:
        return state.with_lengths(lengths)

    def catch_up(self, params, state: kvc.KVCache, seq, upto, active, limit: int):
        """Causal forwards of :data:`CATCH_UP_CHUNK` committed tokens per lagging row (exactly
        the K/V a prefill of them writes) until no active row lags by more than ``limit``."""
        model = nnx.merge(self.graphdef, params)
        c, s = CATCH_UP_CHUNK, seq.shape[1]

        def lag(st):
            return jnp.where(active, upto - st.lengths, 0)

        def forward(span, cache, tokens, meta):
            return model(tokens, meta, cache=cache, logits_start=c - 1, cache_span=span,
                         defer_cache_write=True)

        def body(st):
            pos = st.lengths[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
            valid = (lag(st) > limit)[:, None] & (pos < upto[:, None])
            tokens = jnp.take_along_axis(seq, jnp.minimum(pos, s - 1), axis=1)
            _, write = kvc.call_with_span(forward, jnp.max(st.lengths), st, tokens,
                                          causal_meta(pos, valid))
            return write.apply(st).with_lengths(st.lengths + valid.sum(axis=1).astype(jnp.int32))

        return jax.lax.while_loop(lambda st: jnp.max(lag(st)) > limit, body, state)

    def propose(self, params, state: kvc.KVCache, seq, anchor_pos, row_keys, sampling,
                block_size: int, sample_drafts: bool, fanout: int = 0):
        model = nnx.merge(self.graphdef, params)
        bs = block_size
        # One forward, the uncached part padded to B.  A narrow variant for rounds that commit
        # few tokens (switched on the device) doubled the drafter in every round program, a third
        # of a sync loop's compile, and decoded no faster on CPU (docs/results/compile.md).
        slot_logits, write = self._block_forward(model, bs, state, seq, anchor_pos, bs)
        cache = write.apply(state)  # in place, no cache copy
        argmax = jnp.argmax(slot_logits, axis=-1).astype(jnp.int32)
        drafts, probs = argmax, None  # q is needed only to verify sampled drafts
        if sample_drafts:
            probs = V.processed_probs(slot_logits, sampling)
            positions = anchor_pos[:, None] + 1 + jnp.arange(bs - 1, dtype=jnp.int32)[None]
            sampled = V.sample_keyed(V.position_keys(row_keys, positions, V.SALT_DRAFT), probs)
            drafts = jnp.where(jnp.reshape(sampling.greedy, (-1, 1)), argmax, sampled)
        alts = None
        if fanout:
            alts = br.slot_alternatives(slot_logits, drafts, fanout)
            alts = jnp.concatenate([jnp.full_like(alts[:, :1], br.NO_TOKEN), alts], axis=1)
        return DraftOutput(drafts, probs, slot_logits, alts), cache.with_lengths(anchor_pos)

    def _block_forward(self, model, n_u: int, state: kvc.KVCache, seq, anchor_pos, bs: int):
        """Committed tokens at positions cached_len .. s-1 (at most B: one round's commit), padded
        to ``n_u`` slots with valid=False, then the block; logits of block slots 1..B-1."""
        b = seq.shape[0]
        anchor = jnp.take_along_axis(seq, anchor_pos[:, None], axis=1)
        tok_blk = jnp.concatenate([anchor, jnp.full((b, bs - 1), self.mask_token_id, jnp.int32)], 1)
        pos_u = state.lengths[:, None] + jnp.arange(n_u, dtype=jnp.int32)[None]
        valid_u = pos_u < anchor_pos[:, None]
        tok_u = jnp.take_along_axis(seq, jnp.minimum(pos_u, seq.shape[1] - 1), axis=1)
        meta = concat_meta([causal_meta(pos_u, valid_u), block_meta(anchor_pos[:, None], bs)])

        def with_span(span, cache, tokens, meta):
            return model(tokens, meta, cache=cache, logits_start=n_u + 1, cache_span=span,
                         defer_cache_write=True)

        logits, write = kvc.call_with_span(with_span, jnp.max(state.lengths), state,
                                           jnp.concatenate([tok_u, tok_blk], axis=1), meta)
        return logits, write.pad_to(2 * bs)

    def branch_pack(self, params, state, block, block_alts, anchor_pos, draft_len, layout,
                    with_logits: bool = False):
        model = nnx.merge(self.graphdef, params)
        return br.packed_forward(model, state, block, block_alts, anchor_pos, draft_len, layout,
                                 self.mask_token_id, with_logits=with_logits)


# --------------------------------------------------------------------------------------
# Replay drafter
# --------------------------------------------------------------------------------------
SALT_HIT = 5  # the replay drafter's hit coin (verify.py uses salts 0..4)


class ReplayDrafter:
    """Proposes ``continuations[i]`` (generated ids after the prompt of request ``index`` i) with
    a per-token error rate.  Errors and hits are keyed by (seed, request index, position)."""

    mask_token_id = 0  # any real id: only fed where verification never accepts

    def __init__(self, continuations: Sequence[Sequence[int]], vocab_size: int,
                 error_rate: float = 0.0, seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"ReplayDrafter error_rate must be in [0, 1], got {error_rate}")
        self.continuations = [list(map(int, c)) for c in continuations]
        self.vocab_size = int(vocab_size)
        self.error_rate = float(error_rate)
        self.seed = int(seed)
        # the branch alternatives' hit rate is a traced parameter (0 here: they never hit)
        self.params: Any = {"hit_rate": jnp.float32(0.0)}

    @property
    def signature(self):
        return (type(self).__name__, self.vocab_size, self.error_rate, self.seed)

    def init_state(self, num_rows: int, cache_len: int, paging=None) -> dict:
        return {"ref": jnp.full((num_rows, cache_len), -1, jnp.int32),
                "row": jnp.zeros((num_rows,), jnp.int32)}

    def request_data(self, requests, cache_len: int) -> dict:
        ref = np.full((len(requests), cache_len), -1, np.int32)
        for r, req in enumerate(requests):
            if not 0 <= req.index < len(self.continuations):
                raise ValueError(f"ReplayDrafter has {len(self.continuations)} continuations, "
                                 f"prompt {req.index} needs one")
            full = (list(req.prompt) + self.continuations[req.index])[:cache_len]
            ref[r, : len(full)] = full
        return {"ref": ref, "row": np.asarray([req.index for req in requests], np.int32)}

    def prefill(self, params, data, prompt_bt, prefill_len) -> dict:
        return {"ref": jnp.asarray(data["ref"]), "row": jnp.asarray(data["row"])}

    def insert(self, state: dict, rows: dict, slots, pages=None) -> dict:
        return dict(state, ref=insert_leading(state["ref"], rows["ref"], slots),
                    row=insert_leading(state["row"], rows["row"], slots))

    def commit(self, state, lengths):
        return state

    def chunk_model(self, params):
        return None  # a replay drafter caches nothing

    def catch_up(self, params, state, seq, upto, active, limit: int):
        return state  # a replay drafter caches nothing

    def _keys(self, state: dict, positions: jax.Array, salt: int) -> jax.Array:
        base = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(self.seed), i))(
            state["row"].astype(jnp.uint32))
        return V.position_keys(base, positions, salt)

    def _reference(self, state: dict, positions: jax.Array) -> jax.Array:
        ref_bs = state["ref"]
        tok = jnp.take_along_axis(ref_bs, jnp.clip(positions, 0, ref_bs.shape[1] - 1), axis=1)
        return jnp.where((positions < ref_bs.shape[1]) & (tok >= 0), tok, 0)

    def _drafts(self, state: dict, anchor_pos: jax.Array, block_size: int) -> jax.Array:
        """Reference token at each position; wrong (a different token) with prob ``error_rate``."""
        positions = anchor_pos[:, None] + 1 + jnp.arange(block_size - 1, dtype=jnp.int32)[None]
        ref = self._reference(state, positions)
        keys = self._keys(state, positions, V.SALT_REPLAY)
        coin = V.uniform_keyed(keys)
        shift = 1 + jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 1), (), 0,
                                                          max(self.vocab_size - 1, 1)))(keys.reshape(-1))
        wrong = (ref + shift.reshape(ref.shape)) % self.vocab_size
        return jnp.where(coin < self.error_rate, wrong, ref).astype(jnp.int32)

    def alternatives(self, params, state: dict, positions: jax.Array, fanout: int) -> jax.Array:
        """``[b, K, F]`` alternatives for the tokens at ``positions [b, K]``: the reference token at
        a geometric rank (success probability ``hit_rate``) when that rank is < F; elsewhere
        tokens that differ from it."""
        vocab = self.vocab_size
        tok = self._reference(state, positions)
        keys = self._keys(state, positions, SALT_HIT)
        h = params["hit_rate"]
        u = V.uniform_keyed(keys)
        ratio = jnp.log(u) / jnp.log1p(-jnp.clip(h, 1e-7, 1 - 1e-7))  # geometric rank by inversion
        rank = jnp.where(h >= 1.0, 0, jnp.where(
            h <= 0.0, fanout, jnp.floor(jnp.minimum(ratio, fanout)).astype(jnp.int32)))
        off = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 1), (), 0, max(vocab - 1, 1)))(
            keys.reshape(-1)).reshape(positions.shape)
        j = jnp.arange(fanout, dtype=jnp.int32)
        wrong = (tok[..., None] + 1 + (off[..., None] + j) % max(vocab - 1, 1)) % vocab
        return jnp.where(j == rank[..., None], tok[..., None], wrong).astype(jnp.int32)

    def propose(self, params, state: dict, seq, anchor_pos, row_keys, sampling, block_size: int,
                sample_drafts: bool, fanout: int = 0):
        drafts = self._drafts(state, anchor_pos, block_size)
        probs = jax.nn.one_hot(drafts, self.vocab_size, dtype=jnp.float32) if sample_drafts else None
        alts = None
        if fanout:
            pos = anchor_pos[:, None] + jnp.arange(block_size, dtype=jnp.int32)[None]
            alts = self.alternatives(params, state, pos, fanout)
        return DraftOutput(drafts, probs, None, alts), state

    def branch_pack(self, params, state: dict, block, block_alts, anchor_pos, draft_len, layout):
        """Each branch is the reference from its own anchor (errors keyed by position, so a
        branch equals the synchronous draft from that anchor); the all-accept guess follows the
        hit coin."""
        b, bs = block.shape
        corr = br.correction_alternatives(block_alts, draft_len, layout).reshape(b, layout.num_correction)
        r = jnp.repeat(jnp.arange(1, layout.positions, dtype=jnp.int32), layout.fanout)
        offsets = jnp.concatenate([jnp.broadcast_to(r, (b, layout.num_correction)),
                                   draft_len[:, None]], axis=1)
        starts = anchor_pos[:, None] + offsets  # [b, nbr]
        anchors = jnp.concatenate([corr, jnp.take_along_axis(block, draft_len[:, None], axis=1)], 1)
        drafts = jax.vmap(lambda ap: self._drafts(state, ap, bs), in_axes=1, out_axes=1)(starts)
        pos = starts[:, :, None] + jnp.arange(bs, dtype=jnp.int32)[None, None]
        alts = self.alternatives(params, state, pos.reshape(b, -1), layout.fanout)
        alts = alts.reshape(b, layout.num_branches, bs, layout.fanout)
        drafts = drafts.at[:, -1, 0].set(alts[:, -1, 1, 0])  # the all-accept branch's guess
        tokens = jnp.concatenate([anchors[:, :, None], drafts], axis=2).astype(jnp.int32)
        return br.BranchDrafts(tokens, alts, None), state
