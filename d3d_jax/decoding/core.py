"""The one decode core (spec §4): prefill, verify and commit, shared by plain, sync and async decoding.

A round feeds the target ``[anchor, d_1 … d_{W-1}]`` at positions ``s … s+W-1`` (``W = 1`` for
plain decoding: no drafts), a rule from :mod:`~d3d_jax.decoding.verify` returns
``(accepted, next_token)``, and :meth:`DecodeCore.commit` writes the accepted drafts plus the
target's token, cut at the first EOS/stop token and at ``max_new_tokens`` exactly where
one-token-at-a-time decoding would cut.

State is a fixed set of rows (slots).  A row joins by :meth:`DecodeCore.insert` of prefilled rows
and leaves by :meth:`DecodeCore.free`; a finished or free row keeps computing but commits nothing
(masks, not branches).  Everything about a request — prompt length, ``max_new_tokens``, stop ids,
sampling parameters, random key — is per-row data, so one compiled program serves every mix.

Caches follow the model's convention: the target cache holds positions ``< s`` (``lengths = s``),
the anchor at ``s`` is committed but fed next round.  Prefill therefore caches the prompt minus its
last token, which becomes the first anchor (a round then decides the first generated token too).

The core is plain Python over pure functions; :class:`~d3d_jax.decoding.decoder.SpecDecoder`
binds it (static) into its jitted methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from d3d_jax.config.limits import MAX_STOP_IDS
from d3d_jax.decoding import verify as V
from d3d_jax.decoding.drafting import DraftOutput, insert_cache_rows
from d3d_jax.decoding.grammar import unpack
from d3d_jax.decoding.verify import SamplingParams
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model import paged_kv as pkv
from d3d_jax.model.masks import causal_meta

RUNNING, FINISH_EOS, FINISH_STOP, FINISH_LENGTH = 0, 1, 2, 3
FINISH_REASONS = {FINISH_EOS: "eos", FINISH_STOP: "stop", FINISH_LENGTH: "length"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Every slot's decoding state (target side; the drafter's state rides along in sync mode)."""

    target_cache: kvc.KVCache  # lengths = anchor_pos
    drafter_state: Any  # sync: the drafter's per-slot state; plain/async: None
    seq: jax.Array  # [b, S] every committed token by position (prompt + generated)
    anchor_pos: jax.Array  # [b] s: position of the last committed token
    prompt_len: jax.Array  # [b]
    n_out: jax.Array  # [b] generated tokens so far
    done: jax.Array  # [b] bool: finished or free (commits nothing)
    finish: jax.Array  # [b] RUNNING / FINISH_*
    key_data: jax.Array  # [b, ...] raw PRNG key data of fold_in(key(seed), index)
    accept_hist: jax.Array  # [b, W] rounds per acceptance length 1..W
    max_new: jax.Array  # [b] max new tokens
    stop_ids: jax.Array  # [b, K] EOS and stop ids, -1 padded
    stop_is_eos: jax.Array  # [b, K] bool: finish reason "eos" (else "stop")
    sampling: SamplingParams  # per-row arrays [b]

    @property
    def row_keys(self) -> jax.Array:
        return jax.random.wrap_key_data(self.key_data)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowInput:
    """``n`` requests as arrays (built on the host by the decoder, one prompt-length bucket)."""

    prompt: jax.Array  # [n, P] right-padded
    prompt_len: jax.Array  # [n]
    seed: jax.Array  # [n] int32
    index: jax.Array  # [n] int32: key = fold_in(key(seed), index)
    max_new: jax.Array  # [n]
    stop_ids: jax.Array  # [n, K]
    stop_is_eos: jax.Array  # [n, K]
    sampling: SamplingParams  # [n] arrays
    drafter_data: Any  # the drafter's request_data (or None)
    pages: Any = None  # [n, max_pages] int32: each row's page table (a paged target cache only)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetRows:
    """Prefilled target-side rows, ready for :meth:`DecodeCore.insert`."""

    cache: kvc.KVCache  # [L, n, P, ...]; lengths = prompt_len - 1
    seq: jax.Array  # [n, S]
    prompt_len: jax.Array
    max_new: jax.Array
    key_data: jax.Array
    stop_ids: jax.Array
    stop_is_eos: jax.Array
    sampling: SamplingParams
    pages: Any = None  # [n, max_pages] (a paged target cache only)
    anchor: Any = None  # [n] the first anchor (None: prompt_len - 1, the prompt cached)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundResult:
    """What one round committed per slot: read in one small device→host copy."""

    tokens: jax.Array  # [b, W] the first ``count`` are committed
    count: jax.Array  # [b]
    finish: jax.Array  # [b] RUNNING / FINISH_*
    accepted: jax.Array  # [b] drafts accepted (0 for inactive rows)
    # the target's log-probabilities of ``tokens`` and each slot's most likely alternatives
    # (zeros unless some row asked: SamplingParams.logprobs)
    logprob: jax.Array  # [b, W]
    top_ids: jax.Array  # [b, W, N]
    top_logprobs: jax.Array  # [b, W, N]


def key_data(seed: jax.Array, index: jax.Array) -> jax.Array:
    """Per-request keys: randomness depends on (seed, index, position), never on the slot.
    Raw key data: typed key arrays would send every jitted call down JAX's slow Python path."""
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
        seed.astype(jnp.int32), index.astype(jnp.uint32))
    return jax.random.key_data(keys)


def _insert(full: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    return full.at[slots].set(rows, mode="drop")


def insert_target_rows(cache, rows: TargetRows, slots: jax.Array):
    """The prefilled rows' caches written into ``slots``: dense rows as they are, or, into a paged
    cache, the rows' page tables set and their valid positions scattered to those pages."""
    if not isinstance(cache, pkv.PagedKVCache):
        return insert_cache_rows(cache, rows.cache, slots)
    return cache.inserted(rows.cache, rows.pages, slots)


def emitted_tokens(fed: jax.Array, accepted: jax.Array, next_token: jax.Array) -> jax.Array:
    """``[b, W]``: the accepted drafts, then the target's token (the first ``accepted + 1`` count)."""
    b, w = fed.shape[0], fed.shape[1] + 1
    idx = jnp.arange(w, dtype=jnp.int32)[None]
    padded = jnp.concatenate([fed, jnp.zeros((b, 1), jnp.int32)], axis=1)
    return jnp.where(idx < accepted[:, None], padded, next_token[:, None])


def _match(tokens: jax.Array, ids: jax.Array) -> jax.Array:
    """``[b, ..., K]`` equality of ``tokens [b, ...]`` against each row's (-1 padded) id list."""
    ids = ids.reshape(ids.shape[:1] + (1,) * (tokens.ndim - 1) + ids.shape[1:])
    return (tokens[..., None] == ids) & (ids >= 0)


def _unless_all_prefilling(decide: Callable, x: jax.Array, idle: jax.Array, kept: jax.Array):
    """``decide(x) -> (accepted, next_token, logprobs)``, or, when every row is ``idle`` (caching
    prompt tokens or done), ``kept`` and zeros without it: such a round needs no LM head, rule
    nor log-probs, and XLA runs only the branch taken (a prompt's prefill rounds cost its
    forward alone, about what an admission's prefill cost)."""
    def skip(x):
        shapes = jax.eval_shape(decide, x)
        return (kept,) + jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes[1:])

    return jax.lax.cond(jnp.all(idle), skip, decide, x)


class DecodeCore:
    """Prefill / draft / verify / commit on a fixed set of slots.

    ``drafter`` is the drafter whose state rides in :class:`DecodeState` (sync mode); None for
    plain decoding and for the target side of async decoding.  ``acceptance_rule(logits, drafts,
    draft_probs, anchor_pos, row_keys, sampling)``; ``override`` is the benchmark-only
    ``acceptance_override`` (applied after the rule; None costs nothing).  ``page_size > 0``
    keeps the target's cache paged (:mod:`~d3d_jax.model.paged_kv`), ``num_pages`` of them, and a
    model drafter's too: a second pool of the same pages, read through the same page table (page
    ``p`` of either pool holds the same positions), so a row's pages and a prefix hit cover both
    caches.  The host hands each admitted row its pages (:attr:`RowInput.pages`).
    """

    def __init__(self, target_graphdef, target_config, drafter, *, width: int, cache_len: int,
                 sample_drafts: bool = False, acceptance_rule: Callable | None = None,
                 override: Any = None, page_size: int = 0, num_pages: int = 0,
                 prefill_rounds: bool = False):
        self.target_graphdef = target_graphdef
        self.target_config = target_config
        self.drafter = drafter
        self.width = int(width)
        self.cache_len = int(cache_len)
        self.sample_drafts = bool(sample_drafts)
        self.rule = acceptance_rule or V.default_rule(self.sample_drafts)
        self.override = override
        self.page_size, self.num_pages = int(page_size), int(num_pages)
        # rows may join with their prompts uncached and prefill W tokens a round (prefilling);
        # never over pages (chunks prefill them), so a paged round carries none of it
        self.prefill_rounds = bool(prefill_rounds) and not self.page_size

    @property
    def paging(self) -> tuple[int, int] | None:
        """``(num_pages, page_size)`` of a paged cache, None for a dense one."""
        return (self.num_pages, self.page_size) if self.page_size else None

    # ---------------------------------------------------------------- slots
    def init_state(self, num_slots: int) -> DecodeState:
        b, s = num_slots, self.cache_len
        zeros = jnp.zeros((b,), jnp.int32)
        if self.page_size:
            cache = pkv.init_paged_cache(self.target_config, self.num_pages, self.page_size, b,
                                         -(-s // self.page_size))
        else:
            cache = kvc.init_cache(self.target_config, b, s)
        return DecodeState(
            target_cache=cache,
            drafter_state=None if self.drafter is None else self.drafter.init_state(b, s, self.paging),
            seq=jnp.zeros((b, s), jnp.int32), anchor_pos=zeros, prompt_len=zeros, n_out=zeros,
            done=jnp.ones((b,), bool), finish=zeros, key_data=key_data(zeros, zeros),
            accept_hist=jnp.zeros((b, self.width), jnp.int32), max_new=zeros,
            stop_ids=jnp.full((b, MAX_STOP_IDS), -1, jnp.int32),
            stop_is_eos=jnp.zeros((b, MAX_STOP_IDS), bool),
            sampling=SamplingParams.rows(b))

    def prefill_target(self, target_params, rows: RowInput) -> TargetRows:
        """Cache each prompt minus its last token (that token is the first anchor)."""
        target = nnx.merge(self.target_graphdef, target_params)
        n, p = rows.prompt.shape
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
        cached_len = rows.prompt_len - 1
        # the fresh cache holds nothing valid: attend to one (masked) slot, not all of them, which
        # XLA would otherwise constant-fold over the whole zero cache at compile time
        _, cache = target(rows.prompt, causal_meta(pos, pos < cached_len[:, None]),
                          cache=kvc.init_cache(self.target_config, n, p), cache_span=1)
        return self.target_rows(rows, cache.with_lengths(cached_len))

    def target_rows(self, rows: RowInput, cache) -> TargetRows:
        """``rows`` ready to join, their prompts cached in ``cache`` (``lengths = prompt_len - 1``)."""
        n, p = rows.prompt.shape
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
        seq = jnp.zeros((n, self.cache_len), jnp.int32).at[:, :p].set(
            jnp.where(pos < rows.prompt_len[:, None], rows.prompt, 0))
        return TargetRows(cache, seq, rows.prompt_len, rows.max_new,
                          key_data(rows.seed, rows.index), rows.stop_ids, rows.stop_is_eos,
                          rows.sampling, rows.pages)

    def paged_sides(self, target_params, drafter_params) -> list:
        """Every paged cache of the state as ``(model, get(state), put(state, cache))``, the
        target's first: what a chunked prefill fills from a row's cached prefix on.  A drafter
        that keeps a KV cache (``chunk_model``) has its own pool over the same pages, so a prefix
        hit and each chunk cover both caches."""
        if not self.page_size:
            return []
        target = nnx.merge(self.target_graphdef, target_params)
        sides = [(target, lambda st: st.target_cache,
                  lambda st, c: dataclasses.replace(st, target_cache=c))]
        drafter = None if drafter_params is None else self.drafter.chunk_model(drafter_params)
        if drafter is not None:
            sides.append((drafter, lambda st: st.drafter_state,
                          lambda st, c: dataclasses.replace(st, drafter_state=c)))
        return sides

    def join_prefilled(self, state: DecodeState, rows: RowInput, drafter_params, slot: jax.Array
                       ) -> DecodeState:
        """Rows whose prompts (but the last token) chunks wrote into their pages join ``slot``
        (out of range: not yet); a drafter without a KV cache (a replay) is prefilled here."""
        cached = rows.prompt_len - 1
        target = self.target_rows(rows, pkv.prefilled(state.target_cache, rows.pages, cached))
        drafter = None
        if self.drafter is not None:
            d = state.drafter_state
            drafter = (pkv.prefilled(d, rows.pages, cached) if isinstance(d, pkv.PagedKVCache)
                       else self.prefill_drafter(drafter_params, rows))
        return self.insert(state, target, drafter, slot)

    def prefill_drafter(self, drafter_params, rows: RowInput):
        return self.drafter.prefill(drafter_params, rows.drafter_data, rows.prompt,
                                    rows.prompt_len - 1)

    def insert(self, state: DecodeState, rows: TargetRows, drafter_rows, slots: jax.Array
               ) -> DecodeState:
        """Rows join: every per-row field of ``slots`` is overwritten (a freed slot is reset)."""
        n = slots.shape[0]
        zeros = jnp.zeros((n,), jnp.int32)
        put = lambda full, new: _insert(full, new, slots)  # noqa: E731
        dstate = state.drafter_state
        if self.drafter is not None:
            dstate = self.drafter.insert(dstate, drafter_rows, slots, rows.pages)
        return DecodeState(
            target_cache=insert_target_rows(state.target_cache, rows, slots),
            drafter_state=dstate, seq=put(state.seq, rows.seq),
            anchor_pos=put(state.anchor_pos, rows.prompt_len - 1 if rows.anchor is None else rows.anchor),
            prompt_len=put(state.prompt_len, rows.prompt_len), n_out=put(state.n_out, zeros),
            done=put(state.done, jnp.zeros((n,), bool)), finish=put(state.finish, zeros),
            key_data=put(state.key_data, rows.key_data),
            accept_hist=put(state.accept_hist, jnp.zeros((n, self.width), jnp.int32)),
            max_new=put(state.max_new, rows.max_new), stop_ids=put(state.stop_ids, rows.stop_ids),
            stop_is_eos=put(state.stop_is_eos, rows.stop_is_eos),
            sampling=jax.tree.map(put, state.sampling, rows.sampling))

    def free(self, state: DecodeState, slots: jax.Array) -> DecodeState:
        return dataclasses.replace(state, done=_insert(state.done, True, slots))

    # ---------------------------------------------------------------- one round
    def prefilling(self, state: DecodeState):
        """``[b]``: running rows whose prompt is not all cached yet (``prefill_rounds`` only; None
        otherwise).  Such a round feeds the next W prompt tokens in place of ``[anchor, drafts]``
        and commits them to the cache, emitting nothing: the round's own forward is the prefill,
        so a decoder's admission holds no layers (most of a sync decoder's first compile)."""
        if not self.prefill_rounds:
            return None
        return ~state.done & (state.anchor_pos < state.prompt_len - 1)

    def draft(self, drafter_params, state: DecodeState) -> tuple[DraftOutput, DecodeState]:
        """One drafter forward: drafts for positions s+1..s+W-1 of every row."""
        # inactive rows draft from position 0: their stale lengths must not widen the
        # drafter's cache span or its uncached-token variant
        anchor = jnp.where(state.done, 0, state.anchor_pos)
        out, dstate = self.drafter.propose(drafter_params, state.drafter_state, state.seq, anchor,
                                           state.row_keys, state.sampling, self.width,
                                           self.sample_drafts)
        return out, dataclasses.replace(state, drafter_state=dstate)

    def verify(self, target_params, state: DecodeState, fed: jax.Array, compared: jax.Array,
               draft_probs=None, sampling: SamplingParams | None = None, token_mask=None):
        """Target forward over ``[anchor, fed]`` (cache span bucketed by the active rows), each
        row's logit processors (bias, min_tokens, penalties: :func:`verify.adjust_logits`), the
        rule on ``compared``; returns ``(accepted, next_token, cache, logprobs)``.  ``sampling``
        (default: the rows' own) may be :data:`verify.GREEDY`, static, when every row is greedy
        with no processor: the program then holds no sampling code at all.  ``token_mask``
        ``[b, W, words]``: a grammar's allowed tokens per slot as bits
        (:mod:`~d3d_jax.decoding.grammar`); the rest get -inf before the rule."""
        sampling = state.sampling if sampling is None else sampling
        target = nnx.merge(self.target_graphdef, target_params)
        s = state.anchor_pos
        anchor = jnp.take_along_axis(state.seq, s[:, None], axis=1)
        pos = s[:, None] + jnp.arange(self.width, dtype=jnp.int32)[None]
        cache_in = state.target_cache
        prefilling = self.prefilling(state)
        if prefilling is not None:  # the prompt's next tokens, all kept (written to the cache)
            prompt = jnp.take_along_axis(state.seq, jnp.minimum(pos[:, 1:], state.seq.shape[1] - 1), axis=1)
            fed = jnp.where(prefilling[:, None], prompt, fed)

        def forward(span, cache, tokens, pos):
            return target(tokens, causal_meta(pos), cache=cache, cache_span=span,
                          defer_cache_write=True, return_hidden_states=prefilling is not None)

        needed = jnp.max(jnp.where(state.done, 0, cache_in.lengths))
        out = kvc.call_with_span(forward, needed, cache_in, jnp.concatenate([anchor, fed], axis=1), pos)
        write = out[1]
        if isinstance(cache_in, pkv.PagedKVCache):  # a done row's pages may be another's by now
            write = dataclasses.replace(write, keep_bt=write.keep_bt & ~state.done[:, None])
        cache = write.apply(cache_in)
        kept = None if prefilling is None else jnp.minimum(self.width, state.prompt_len - 1 - s) - 1

        def decide(logits):
            logits = V.adjust_logits(logits, sampling, state.seq, state.prompt_len, s,
                                     state.n_out, state.stop_ids, fed)
            if token_mask is not None:
                logits = jnp.where(unpack(token_mask, logits.shape[-1]), logits, -jnp.inf)
            accepted, next_token = self.rule(logits, compared, draft_probs, s, state.row_keys,
                                             sampling)
            if self.override is not None:
                accepted, next_token = self.override.accept(accepted, next_token, s,
                                                            state.row_keys, self.width)
            if prefilling is not None:  # commit keeps positions s .. s + accepted, emits nothing
                accepted = jnp.where(prefilling, kept, accepted)
            logprobs = V.emitted_logprobs(logits, emitted_tokens(fed, accepted, next_token),
                                          sampling)
            return accepted, next_token, logprobs

        if prefilling is None:
            accepted, next_token, logprobs = decide(out[0])
        else:
            accepted, next_token, logprobs = _unless_all_prefilling(
                lambda x: decide(target.logits(target.norm(x))), out[2][-1], prefilling | state.done,
                jnp.where(prefilling, kept, 0))
        return accepted, next_token, cache, logprobs

    def commit(self, state: DecodeState, fed: jax.Array, accepted: jax.Array,
               next_token: jax.Array, target_cache: kvc.KVCache, logprobs=None
               ) -> tuple[DecodeState, RoundResult]:
        """Append ``fed[:a] + [next_token]`` per active row, cut at EOS/stop and max_new_tokens;
        ``logprobs``: :meth:`verify`'s (None: zeros)."""
        w = self.width
        b = state.seq.shape[0]
        idx = jnp.arange(w, dtype=jnp.int32)[None]
        emitted = emitted_tokens(fed, accepted, next_token)
        count = accepted + 1
        is_stop = jnp.any(_match(emitted, state.stop_ids), axis=-1) & (idx < count[:, None])
        first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), w)
        active = ~state.done
        prefilling = self.prefilling(state)
        if prefilling is not None:  # its prompt's tokens cached, nothing emitted (verify)
            active = active & ~prefilling
        n_emit = jnp.where(active, jnp.minimum(jnp.minimum(count, first_stop + 1),
                                               state.max_new - state.n_out), 0)
        write_pos = jnp.where(idx < n_emit[:, None], state.anchor_pos[:, None] + 1 + idx,
                              state.seq.shape[1])
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, w))
        seq = state.seq.at[rows, write_pos].set(emitted, mode="drop")
        hit_stop = active & (first_stop < n_emit)
        stop_tok = jnp.take_along_axis(emitted, jnp.minimum(first_stop, w - 1)[:, None], axis=1)[:, 0]
        n_out = state.n_out + n_emit
        out_of_room = active & ~hit_stop & (n_out >= state.max_new)
        is_eos = jnp.any(_match(stop_tok, state.stop_ids) & state.stop_is_eos, axis=-1)
        finish = jnp.where(hit_stop, jnp.where(is_eos, FINISH_EOS, FINISH_STOP), state.finish)
        finish = jnp.where(out_of_room, FINISH_LENGTH, finish).astype(jnp.int32)
        anchor_pos = state.anchor_pos + n_emit
        if prefilling is not None:
            anchor_pos = jnp.where(prefilling, state.anchor_pos + count, anchor_pos)
        # the histogram may be wider than this round (auto mixes widths in one state)
        hist = state.accept_hist + jax.nn.one_hot(accepted, state.accept_hist.shape[1],
                                                  dtype=jnp.int32) * active[:, None]
        state = dataclasses.replace(
            state, target_cache=target_cache.with_lengths(anchor_pos), seq=seq,
            anchor_pos=anchor_pos, n_out=n_out, done=state.done | hit_stop | out_of_room,
            finish=finish, accept_hist=hist)
        if logprobs is None:
            n = min(V.MAX_TOP_LOGPROBS, state.seq.shape[1])
            logprobs = (jnp.zeros((b, w)), jnp.zeros((b, w, n), jnp.int32), jnp.zeros((b, w, n)))
        return state, RoundResult(emitted, n_emit, finish, jnp.where(active, accepted, 0), *logprobs)

    def round(self, target_params, drafter_params, state: DecodeState,
              sampling: SamplingParams | None = None) -> tuple[DecodeState, RoundResult]:
        """Plain (no drafter) or sync: draft, verify (``sampling``: :meth:`verify`'s), commit."""
        if self.drafter is None:
            draft = DraftOutput(jnp.zeros((state.seq.shape[0], self.width - 1), jnp.int32), None, None)
        else:
            draft, state = self.draft(drafter_params, state)
        accepted, next_token, cache, logprobs = self.verify(target_params, state, draft.drafts,
                                                            draft.drafts, draft.probs, sampling)
        return self.commit(state, draft.drafts, accepted, next_token, cache, logprobs)

    def run_until_done(self, target_params, drafter_params, state: DecodeState,
                       sampling: SamplingParams | None = None, live_floor=0) -> DecodeState:
        """Rounds in a ``lax.while_loop`` on the device until every row is done, or (``live_floor``,
        traced) until no more than ``live_floor`` rows run: a caller with prompts waiting then
        refills the finished rows, and one program serves every floor."""
        # every round commits >= 1 token per active row, so this many rounds always suffice
        todo = state.max_new - state.n_out
        if self.prefill_rounds:  # and a round per W uncached prompt tokens
            todo = todo + jnp.maximum(state.prompt_len - 1 - state.anchor_pos + self.width - 1, 0) // self.width
        limit = jnp.max(jnp.where(state.done, 0, todo))

        def cond(carry):
            i, st = carry
            return (i < limit) & (jnp.sum(~st.done) > live_floor)

        def body(carry):
            i, st = carry
            return i + 1, self.round(target_params, drafter_params, st, sampling)[0]

        return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]
