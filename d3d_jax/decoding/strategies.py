"""Round strategies: how one round of every live request is computed (plain, sync, async; auto
in :mod:`~d3d_jax.decoding.auto`).

Every strategy works on the same slots and the same device state (:class:`Carry`) over the same
:class:`~d3d_jax.decoding.core.DecodeCore` (and :class:`~d3d_jax.decoding.async_core.AsyncCore`),
and owns its round: ``init`` (its state), ``admit`` (what prefill writes for it: one dispatch per
device slice), ``dispatch`` (one round over windows of the live rows, dispatch only) and, where
``loops``, ``run_until_done`` (rounds without the host choosing each).  The
:class:`~d3d_jax.decoding.decoder.SpecDecoder` keeps the slots, the placement and the contract;
it drives the rounds, and a strategy never calls back into it.

A round's outcome is a list of :class:`Part` s (one per dispatched window), each with per-row
device arrays in ``out`` (``tokens``, ``count``, ``finish``, ``accepted``, and whatever else a
strategy reports: ``hit`` for async), read by the decoder in one copy; the target's log-probs
(``LOGPROB_KEYS``) ride along in every mode and are copied only when some request asked.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from d3d_jax.decoding import window as W
from d3d_jax.decoding.admission import admit as admit_rows
from d3d_jax.decoding.admission import prefill_piece
from d3d_jax.decoding.core import MAX_STOP_IDS, DecodeCore, DecodeState, RoundResult, RowInput
from d3d_jax.decoding.decoder_config import Request, prompt_bucket
from d3d_jax.decoding.programs import ProgramStore
from d3d_jax.decoding.verify import GREEDY, SamplingParams
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model.paged_kv import UNMAPPED, PagedKVCache


def widths_upto(widths: tuple[int, ...], cap: int | None) -> tuple[int, ...]:
    """Of ascending padding ``widths``, those a length of up to ``cap`` is padded to (None: all)."""
    if cap is None:
        return widths
    last = prompt_bucket(cap, widths[-1], widths)  # the padding rule admission itself uses
    return tuple(w for w in widths if w <= last)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Carry:
    """Every slot's device state: the target side (with the drafter's state in sync and auto),
    and async's drafter side and its hand-off on the target slice."""

    state: DecodeState
    side: Any = None
    hand: Any = None
    prompt_score: Any = None  # auto: each row's prompt score [slots] (NaN: none)


@dataclasses.dataclass
class Part:
    """One dispatched window of a round: rows ``start … start+rows-1``, of which ``lo … hi-1``
    took part, in geometry ``label``; ``out`` holds per-row device arrays (window order)."""

    label: str
    start: int
    rows: int
    lo: int
    hi: int
    out: dict
    predicted: float | None = None  # auto: the tokens its choice expected of this part
    predicted_s: float | None = None  # auto: the seconds its choice expected of this part
    fresh: bool = False  # its program ran for the first time (its time includes the compile)
    gated: bool = False  # auto: an all-plain round the gate ran without asking the policy
    row_reasons: tuple = ()  # auto: why each row lo … hi-1 ran as it did (decoding/auto_reasons.py)


@dataclasses.dataclass
class Context:
    """What strategies are built from (the decoder makes it once)."""

    config: Any  # DecoderConfig
    target_graphdef: Any
    target_config: Any
    drafter: Any  # a Drafter or None
    tp: Callable  # target leaves -> parameters
    dp: Callable  # drafter leaves -> parameters (None for plain)
    t_put: Callable = lambda x: x  # noqa: E731  onto the target slice
    d_put: Callable = lambda x: x  # noqa: E731  onto the drafter slice
    shared: bool = True  # one slice: nothing moves between sides
    programs: ProgramStore = dataclasses.field(default_factory=lambda: ProgramStore(None))

    def core(self, width: int, with_drafter: bool, prefill_rounds: bool = False) -> DecodeCore:
        cfg = self.config
        return DecodeCore(self.target_graphdef, self.target_config,
                          self.drafter if with_drafter else None, width=width,
                          cache_len=cfg.max_cache_len, sample_drafts=cfg.sample_drafts,
                          acceptance_rule=cfg.acceptance_rule, override=cfg.acceptance_override,
                          page_size=cfg.kv_page_size, num_pages=cfg.kv_num_pages,
                          prefill_rounds=prefill_rounds)

    def window(self, lo: int, hi: int) -> tuple[int, int]:
        """``(start, rows)``: the smallest bucketed window holding rows ``lo … hi-1``."""
        rows = next(b for b in self.config.buckets if b >= hi - lo)
        return min(lo, self.config.num_slots - rows), rows


LOGPROB_KEYS = ("logprob", "top_ids", "top_logprobs")  # read only when some row asked
OPS_PER_DISPATCH = 64  # row operations per row-ops dispatch (fixed shape; more: several)


def result_out(res: RoundResult) -> dict:
    return dict(tokens=res.tokens, count=res.count, finish=res.finish, accepted=res.accepted,
                logprob=res.logprob, top_ids=res.top_ids, top_logprobs=res.top_logprobs)


def mark_done(state: DecodeState, row: jax.Array, flag: jax.Array) -> DecodeState:
    return dataclasses.replace(state, done=state.done.at[row].set(state.done[row] | flag))


def set_page_tables(state: DecodeState, table) -> DecodeState:
    """Every row's page table replaced, in the target's cache and a paged drafter's (one table)."""
    state = dataclasses.replace(state, target_cache=state.target_cache.with_page_table(table))
    if isinstance(state.drafter_state, PagedKVCache):
        state = dataclasses.replace(state, drafter_state=state.drafter_state.with_page_table(table))
    return state


def windowed(fn: Callable, rows: int, state, start, lo, hi, *args):
    """``fn(view, *args) -> (view, out)`` on the window; rows outside ``[lo, hi)`` are done for
    the round and keep every per-row value."""
    keep = W.window_mask(start, rows, lo, hi)
    v = W.view(state, start, rows)
    v, out = fn(dataclasses.replace(v, done=v.done | ~keep), *args)
    return W.merge(state, v, keep, start), out


class Strategy:
    """The shared machinery: one home core for the state layout, admission and row operations."""

    mode = "?"
    drafter_in_state = False  # sync/auto: the drafter's state rides in DecodeState
    prefill_rounds = False  # sync: a prompt is prefilled by its first rounds (DecodeCore.prefilling)
    # has run_until_done; auto does not: it picks each round on the host (the decoder steps it)
    loops = True

    def __init__(self, ctx: Context):
        self.ctx = ctx
        cfg = ctx.config
        self.home = ctx.core(cfg.width, self.drafter_in_state, self.prefill_rounds)
        self.compiled: set[tuple[str, int]] = set()  # (program, rows): a program each
        self._typed = threading.local()  # .on: this thread runs a compile-ahead pass (nothing runs)
        self._init = self.jit(self.home.init_state, static_argnums=0)
        self._admit = self.jit(self._admit_fn, donate_argnums=2)
        self._piece = self.jit(self._piece_fn, donate_argnums=2)  # a paged cache's chunked prefill
        self._ops = self.jit(lambda st, ops, n: W.apply_row_ops(st, ops, n, mark_done),
                             name="row_ops", donate_argnums=0)
        self._read_rows = self.jit(lambda fields, rows: {k: v[rows] for k, v in fields.items()},
                                   name="read_rows")
        self._tables = self.jit(set_page_tables, name="page_tables", donate_argnums=0)

    def jit(self, fn, name: str | None = None, **kw):
        """``jax.jit`` through the decoder's program store (kept on disk when it has a directory)."""
        return self.ctx.programs.jit(fn, name=f"{type(self).__name__}.{name or fn.__name__}", **kw)

    # ------------------------------------------------------------ state and admission
    def init(self, num_slots: int) -> Carry:
        return Carry(self.ctx.t_put(self._init(num_slots)))

    def _prefill_parts(self, t_leaves, d_leaves, row: RowInput):
        target = self.home.prefill_target(self.ctx.tp(t_leaves), row)
        drafter = (self.home.prefill_drafter(self.ctx.dp(d_leaves), row)
                   if self.drafter_in_state else None)
        return target, drafter

    def _admit_fn(self, t_leaves, d_leaves, state, rows: RowInput, index, count, *, prefill=None,
                  insert=None):
        """``prefill`` / ``insert``: a strategy's own (auto keeps a prompt score beside the state)."""
        cfg = self.ctx.config
        return admit_rows(state, rows, index, count,
                          prefill=prefill or (lambda r: self._prefill_parts(t_leaves, d_leaves, r)),
                          insert=insert or (lambda st, parts, slot: self.home.insert(st, *parts, slot)),
                          cache_len=cfg.max_cache_len)

    def admit(self, carry: Carry, params, rows: RowInput, index, count) -> Carry:
        """Prefill and insert ``count`` rows (one dispatch per device slice)."""
        t_leaves, d_leaves = params
        d_leaves = d_leaves if self.drafter_in_state else None
        state = self._admit(t_leaves, d_leaves, carry.state, self.ctx.t_put(rows), index, count)
        return dataclasses.replace(carry, state=state)

    def _piece_fn(self, t_leaves, d_leaves, state, rows: RowInput, tokens, start, count, slot):
        return self._piece_logits(t_leaves, d_leaves, state, rows, tokens, start, count, slot)[0]

    def _piece_logits(self, t_leaves, d_leaves, state, rows: RowInput, tokens, start, count, slot):
        """:func:`admission.prefill_piece` with this strategy's models: ``(state, logits per side)``."""
        dp = None if d_leaves is None else self.ctx.dp(d_leaves)
        sides = self.home.paged_sides(self.ctx.tp(t_leaves), dp)
        return prefill_piece(self.home, sides, state, rows, tokens, start, count, slot, dp)

    def prefill_piece(self, carry: Carry, params, rows: RowInput, tokens, start, count, slot) -> Carry:
        """One prefill chunk of one row into every paged cache (:func:`admission.prefill_piece`)."""
        t_leaves, d_leaves = params
        d_leaves = d_leaves if self.drafter_in_state else None
        put = self.ctx.t_put
        state = self._piece(t_leaves, d_leaves, carry.state, put(rows), put(tokens), put(start),
                            put(count), put(slot))
        return dataclasses.replace(carry, state=state)

    def row_ops(self, carry: Carry, ops, count) -> Carry:
        return dataclasses.replace(carry, state=self._ops(carry.state, self.ctx.t_put(ops), count))

    def page_tables(self, carry: Carry, table) -> Carry:
        """Every row's page table replaced (a paged target cache grown on the host)."""
        return dataclasses.replace(carry, state=self._tables(carry.state, self.ctx.t_put(table)))

    def row_results(self, carry: Carry, rows: np.ndarray) -> dict:
        """Host arrays of rows ``rows``: tokens, lengths, finish, histogram (and async counts),
        read by one program whatever the number of rows (eager indexing compiled a gather, a
        broadcast and a select per field at a decoder's first results)."""
        st, side = carry.state, carry.side
        padded = np.zeros((self.ctx.config.num_slots,), np.int32)
        padded[: len(rows)] = rows
        reads = [dict(seq=st.seq, prompt_len=st.prompt_len, n_out=st.n_out, finish=st.finish,
                      accept_hist=st.accept_hist)]
        if getattr(side, "hits", None) is not None:  # async: its side may live on other devices
            reads.append(dict(hits=side.hits, misses=side.misses))
        out = {k: v[: len(rows)] for r in jax.device_get([self._read_rows(r, padded) for r in reads])
               for k, v in r.items()}
        if len(reads) > 1:
            out["sync_drafts"] = jax.device_get(side.sync_drafts)
        return out

    # ------------------------------------------------------------ rounds
    def dispatch(self, carry: Carry, params, groups, rows_info) -> tuple[Carry, list[Part]]:
        raise NotImplementedError

    def observe(self, parts: list[Part], host_outs: list[dict], seconds: float | None,
                snapshot: list, wall: float | None = None) -> None:
        """The read outcome of a round (auto learns from it; the fixed strategies do not):
        ``seconds`` is its time on the device (None when an admission ran just before it),
        ``snapshot`` each row's (slot, SlotInfo) when it was dispatched, ``wall`` all the time
        since the read before it while requests ran (admissions and row ops included)."""

    def reclassify(self, infos: dict) -> dict:
        """slot -> new placement class, for the running requests (``infos``: slot -> SlotInfo)."""
        return {}

    def most_tokens(self, parts: list[Part]) -> int:
        """The most tokens a row can commit in a round of ``parts`` (the mode's width; auto: its
        widest geometry in them)."""
        return self.ctx.config.width

    def initial_class(self, request) -> int:
        """The placement class of a new request (auto: 0 speculates, 1 runs plain)."""
        return 0

    def note(self, key: tuple[str, int]) -> bool:
        """Record a (program, rows) about to run; True the first time (it compiles now).  A
        compile-ahead pass runs nothing: it records nothing."""
        if getattr(self._typed, "on", False):
            return False
        fresh = key not in self.compiled
        self.compiled.add(key)
        return fresh

    def warm_up(self, carry: Carry, params, widths: tuple[int, ...], prompt_cap: int | None = None) -> Carry:
        """Compile admission (for prompts of up to ``prompt_cap`` tokens; None: every prompt) and
        the round of each window width in ``widths`` (no-op rounds: no row takes part): every
        program first, several at once (``ProgramStore.ahead``, with a program store), then each
        runs once."""
        self.compile_ahead(carry, params, widths, prompt_cap)
        carry = self.warm_rounds(carry, params, widths, prompt_cap)
        jax.block_until_ready(carry)
        return carry

    def compile_ahead(self, carry, params, widths: tuple[int, ...], prompt_cap: int | None = None) -> int:
        """Compile :meth:`warm_up`'s programs with nothing run (``carry``: the state or its types),
        so beside a running scheduler too; how many were compiled (0 without a program store)."""
        self._typed.on = True
        try:
            return self.ctx.programs.ahead(lambda: self.warm_rounds(carry, params, widths, prompt_cap))
        finally:
            self._typed.on = False

    def warm_rounds(self, carry: Carry, params, widths: tuple[int, ...], prompt_cap: int | None = None) -> Carry:
        """The calls that compile every program of :meth:`warm_up` (no host reads: the
        compile-ahead pass runs them on types)."""
        carry = self.warm_admission(carry, params, prompt_cap)
        for width in widths:
            carry = self._noop(carry, params, width)
        return self.row_ops(carry, np.zeros((OPS_PER_DISPATCH, 3), np.int32), 0)

    def _noop(self, carry: Carry, params, rows: int) -> Carry:
        """One round over a window of ``rows`` rows in which no row takes part (compiles it)."""
        raise NotImplementedError

    def warm_admission(self, carry: Carry, params, prompt_cap: int | None = None) -> Carry:
        """Compile the admission of every prompt bucket, or with a paged cache the prefill of
        every chunk width (no row admitted); with ``prompt_cap``, only the widths a prompt of up
        to that many tokens is padded to (a longer prompt compiles its own when it comes)."""
        n, cfg = self.ctx.config.num_slots, self.ctx.config
        if cfg.chunked_prefill:
            one = np.ones((1,), np.int32)
            for width in widths_upto(cfg.chunk_widths, prompt_cap):
                carry = self.prefill_piece(carry, params, self._dummy_rows(1, cfg.max_cache_len),
                                           np.zeros((1, width), np.int32), one * 0, one * 0, one * n)
            return carry
        for width in widths_upto(cfg.prompt_buckets, prompt_cap):
            carry = self.admit(carry, params, self._dummy_rows(n, width), np.full((n,), n, np.int32), 0)
        return carry

    def _dummy_rows(self, n: int, width: int) -> RowInput:
        cfg, zeros = self.ctx.config, np.zeros((n,), np.int32)
        data = None
        if self.ctx.drafter is not None:
            data = self.ctx.drafter.request_data([Request([0], 1)] * n, cfg.max_cache_len)
        pages = np.full((n, cfg.kv_max_pages), UNMAPPED, np.int32) if cfg.kv_page_size else None
        return RowInput(np.zeros((n, width), np.int32), zeros + 1, zeros, zeros,
                        zeros + 1, np.full((n, MAX_STOP_IDS), -1, np.int32),
                        np.zeros((n, MAX_STOP_IDS), bool),
                        SamplingParams.stack([SamplingParams()] * n), data, pages)


class CoreStrategy(Strategy):
    """Plain or sync: a round is :meth:`DecodeCore.round` (one dispatch), and ``run_until_done``
    is the core's on-device loop."""

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.core = self.home
        self.label = self.mode if self.mode == "plain" else f"sync/{ctx.config.block_size}"
        self._round = self.jit(self._round_fn, static_argnames="rows", donate_argnums=2)
        self._loop = self.jit(self._loop_fn, static_argnames=("rows", "greedy"), donate_argnums=2)
        # the round in two programs, for a benchmark that times them apart (d3d_jax.bench.phased)
        self.draft = self.jit(self._draft_fn, static_argnames="rows", donate_argnums=1)
        self.verify = self.jit(self._verify_fn, static_argnames="rows", donate_argnums=1)

    def _round_fn(self, t_leaves, d_leaves, state, start, lo, hi, *, rows):
        tp, dp = self.ctx.tp(t_leaves), self.ctx.dp(d_leaves)
        return windowed(lambda v: self.core.round(tp, dp, v), rows, state, start, lo, hi)

    def _loop_fn(self, t_leaves, d_leaves, state, start, lo, hi, live_floor, *, rows, greedy):
        """``greedy``: every row is greedy with no logit processor nor logprobs, and the loop
        holds no sampling code (a third of a small model's loop compile)."""
        tp, dp = self.ctx.tp(t_leaves), self.ctx.dp(d_leaves)
        sampling = GREEDY if greedy else None
        return windowed(lambda v: (self.core.run_until_done(tp, dp, v, sampling, live_floor), None), rows,
                        state, start, lo, hi)[0]

    def dispatch(self, carry, params, groups, rows_info):
        lo, hi = groups[0][0], groups[-1][1]
        start, rows = self.ctx.window(lo, hi)
        self.note((self.label, rows))
        state, res = self._round(*params, carry.state, start, lo, hi, rows=rows)
        return (dataclasses.replace(carry, state=state),
                [Part(self.label, start, rows, lo, hi, result_out(res))])

    def _noop(self, carry, params, rows):
        self.note((self.label, rows))
        state, _ = self._round(*params, carry.state, 0, 0, 0, rows=rows)
        return dataclasses.replace(carry, state=state)

    def run_until_done(self, carry: Carry, params, lo: int, hi: int, *, greedy: bool = False,
                       live_floor: int = 0, **_) -> tuple[Carry, dict]:
        """The core's on-device loop over the window; ``greedy``: its rows are all plain greedy
        requests (:meth:`_loop_fn`); ``live_floor``: it stops once no more rows than that run."""
        start, rows = self.ctx.window(lo, hi)
        self.note((self.label + ("/loop/greedy" if greedy else "/loop"), rows))
        return dataclasses.replace(carry, state=self._loop(*params, carry.state, start, lo, hi,
                                                           int(live_floor), rows=rows, greedy=greedy)), {}

    def _draft_fn(self, d_leaves, state, start, lo, hi, *, rows):
        dp = self.ctx.dp(d_leaves)

        def draft(v):
            out, v = self.core.draft(dp, v)
            return v, (out.drafts, out.probs)

        state, (drafts, probs) = windowed(draft, rows, state, start, lo, hi)
        return state, drafts, probs

    def _verify_fn(self, t_leaves, state, drafts, probs, start, lo, hi, *, rows):
        tp, core = self.ctx.tp(t_leaves), self.core

        def verify(v):
            fed = drafts if drafts is not None else jnp.zeros((rows, core.width - 1), jnp.int32)
            accepted, nxt, cache, logprobs = core.verify(tp, v, fed, fed, probs)
            return core.commit(v, fed, accepted, nxt, cache, logprobs)

        return windowed(verify, rows, state, start, lo, hi)[0]


class PlainStrategy(CoreStrategy):
    mode = "plain"


class SyncStrategy(CoreStrategy):
    """Its admission only inserts a row, its prompt uncached: the row's first rounds feed the
    prompt W tokens at a time through the round's own forward (the drafter's uncached tokens
    follow a round behind, at most B), so the layers are compiled once, in the round program.
    A paged cache's chunked prefill (``prefill_piece``) still prefills as before."""

    mode = "sync"
    drafter_in_state = True
    prefill_rounds = True

    # prompt buckets up to this many blocks prefill by rounds; a longer prompt's first token would
    # wait a round per block, so its bucket compiles a prefill of its own, as before
    round_prefill_blocks = 8

    def _prefill_parts(self, t_leaves, d_leaves, row: RowInput):
        n, p = row.prompt.shape
        if p > self.round_prefill_blocks * self.ctx.config.width:
            return super()._prefill_parts(t_leaves, d_leaves, row)
        cache = kvc.init_cache(self.ctx.target_config, n, p)  # holds nothing: lengths 0
        target = dataclasses.replace(self.home.target_rows(row, cache), anchor=jnp.zeros((n,), jnp.int32))
        drafter = self.ctx.drafter
        if drafter.chunk_model(self.ctx.dp(d_leaves)) is None:  # no KV cache (a replay): its data
            return target, self.home.prefill_drafter(self.ctx.dp(d_leaves), row)
        return target, drafter.init_state(n, p)
