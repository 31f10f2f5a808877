"""The speculative decoder: one long-lived object with a fixed set of slots (continuous batching).

``SpecDecoder(target, drafter, config)`` splits and places the parameters once, flattens them to
leaf lists once, and holds one round *strategy* (plain, sync, async or auto:
:mod:`~d3d_jax.decoding.strategies`) that owns its jitted programs.  The decoder keeps the slots,
their placement on device rows and the contract (:class:`~d3d_jax.decoding.contract.Decoder`,
JetStream's prefill / insert / generate; the caller picks free slots)::

    dec = SpecDecoder(target, drafter, DecoderConfig(mode="sync", num_slots=8, ...))
    dec.insert(dec.prefill(Request(prompt=[1, 2, 3], max_new_tokens=64)), slot)
    outs = dec.step()                         # one round for every active slot
    dec.free(slot)                            # finished or cancelled
    dec.run_until_done()                      # or: every active slot to its end

* **The caller's weights, read in place.** The decoder binds the models' own arrays and never
  copies them (on one device, or on a split when they were loaded onto its slices:
  ``parallel.sharding.model_meshes``; otherwise a split places each model's on its slice).  A model loaded
  one module per layer (``load_decoding_model``, ``stacked=False``: what the commands load) is
  what runs fastest; a stacked model (training's layout) is read as it is, its layers run by one
  scan that slices each layer's weights per step (slower on CPU and GPU, :mod:`~d3d_jax.model.qwen3`).
  Make the per-layer copy yourself (``qwen3.unstacked``) if you keep decoding a stacked model.
* **Placement.** Live requests sit packed at the low device rows
  (:class:`~d3d_jax.decoding.window.RowPlacement`); a round runs over the smallest bucketed
  window holding them, so its cost follows the live requests, not the slots.  Slots are stable
  names; rows move (device-side swaps) when a request leaves.
* **Admission.** ``prefill`` only checks and stages a request; the requests inserted between two
  rounds are prefilled into their rows in one dispatch when the next round starts.
* **Rounds without host waits.** ``step`` dispatches a round and returns the outcome of the
  oldest one not yet read; while some request is certain to go on, the next round is queued
  behind it first, so the device never waits on the host's reading (results one round behind).
  The outcome of each round is a few per-row arrays read in one copy; a request's metrics are
  counted on the host from them, so finishing one copies nothing from the device.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from d3d_jax.config import ConfigError
from d3d_jax.config.decoding import DEFAULT_CACHE_LEN, DEFAULT_NUM_SLOTS, check_drafter
from d3d_jax.decoding import metrics as M
from d3d_jax.decoding import window as W
from d3d_jax.decoding.async_loop import LiveRows
from d3d_jax.decoding.constrained import masked_rounds
from d3d_jax.decoding.core import FINISH_REASONS, MAX_STOP_IDS, RowInput
from d3d_jax.decoding.decoder_config import (DecoderConfig, Request, RequestError, SlotError,
                                             StepOutput, request_problem)
from d3d_jax.decoding.drafting import as_drafter
from d3d_jax.decoding.page_growth import PageGrowth
from d3d_jax.decoding.page_pool import SlotPages
from d3d_jax.decoding.paging import PagedAdmission
from d3d_jax.parallel.sharding import place_slices
from d3d_jax.decoding.programs import ProgramStore, decoder_salt
from d3d_jax.decoding.strategies import LOGPROB_KEYS, OPS_PER_DISPATCH, Context
from d3d_jax.decoding.verify import GREEDY, SamplingParams

__all__ = ["SpecDecoder", "DecoderConfig", "Request", "Prefix", "StepOutput", "RequestError",
           "SlotError", "SamplingParams"]


@dataclasses.dataclass
class Prefix:
    """Checked requests, ready for :meth:`SpecDecoder.insert` (prefilled when admitted)."""

    requests: list[Request]


@dataclasses.dataclass
class SlotInfo:
    """The host's record of one slot's request, counted from every round read."""

    request: Request
    hist: np.ndarray  # rounds per acceptance length
    n_out: int = 0
    finish_reason: str | None = None
    rounds: int = 0
    accepted: int = 0
    hits: int = 0
    misses: int = 0
    modes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    stats: dict = dataclasses.field(default_factory=dict)  # the strategy's own (auto)
    # a paged cache: its prompt is being prefilled by chunks, it is on no device row yet
    pending: bool = False
    cached: int = -1  # a paged cache: prompt tokens in its pages so far (-1: not looked up yet)
    tokens: list = dataclasses.field(default_factory=list)  # a paged cache: generated, as read
    drafted: int = 0  # a paged cache: of ``tokens``, those the drafter's cache holds at least


@dataclasses.dataclass
class _Round:
    parts: list  # [strategies.Part]
    snapshot: list  # row -> (slot, SlotInfo) when dispatched
    t_dispatch: float
    t_start: float  # before its admissions and row ops ran
    clean: bool  # no admission or row op ran just before it (its time is the round's own)
    host_work: bool = False  # its dispatch flushed admissions/row ops or compiled a program


def _strategy(ctx: Context):
    from d3d_jax.decoding.async_strategy import AsyncStrategy
    from d3d_jax.decoding.auto import AutoStrategy
    from d3d_jax.decoding.strategies import PlainStrategy, SyncStrategy

    return {"plain": PlainStrategy, "sync": SyncStrategy, "async": AsyncStrategy,
            "auto": AutoStrategy}[ctx.config.mode](ctx)


class SpecDecoder:
    """Plain, sync, async or auto decoding over a fixed set of slots (see the module doc)."""

    def __init__(self, target, drafter, config: DecoderConfig, program_dir=None):
        """``program_dir``: where compiled programs are kept across processes
        (:class:`~d3d_jax.decoding.programs.ProgramStore`; None: in memory only).  ``config``'s
        fields left None are derived with the library's defaults; here it meets the models."""
        self.config = cfg = config.resolved(num_slots=DEFAULT_NUM_SLOTS, max_cache_len=DEFAULT_CACHE_LEN)
        self.vocab_size = target.config.vocab_size
        self._trees = [None, None]
        self.strategy = _strategy(self._context(target, drafter, program_dir))
        self.programs: ProgramStore = self.strategy.ctx.programs  # read-only: the contract's view
        self._bind(nnx.state(target), drafter)
        self.placement = W.RowPlacement(cfg.num_slots)
        self.pages = SlotPages.of(cfg)  # a paged target cache's pages per slot (None: dense)
        self.growth: PageGrowth | None = None  # growth page by page: allow_preemption()
        self._preempted: list[int] = []  # slots preempted since take_preempted()
        self._tables_stale = False  # pages were mapped on the host since the device's tables were set
        # chunked prefill from a cached prefix, into the target's pages and a drafter's
        self._chunks = (PagedAdmission(self.pages, cfg, self.strategy.drafter_in_state
                                       and self.drafter.chunk_model(self.drafter.params) is not None)
                        if cfg.chunked_prefill else None)
        self._slots: dict[int, SlotInfo] = {}
        self.carry = None
        self._queue: list[tuple] = []  # ("admit", slot, row) | ("op", a, b, kind), in order
        self._pending: collections.deque[_Round] = collections.deque()
        self._last_read, self._busy = 0.0, False  # the last read; whether a request ran on after it
        self._tally: dict[str, collections.Counter] = {}  # per geometry: rounds, tokens, predicted
        self._stale = False  # after an on-device loop: host counts lag the device

    def _context(self, target, drafter, program_dir) -> Context:
        """The config meets the models (the drafter rule, the vocabulary), then the programs'
        store and the device slices (async's two, or the one a split asks the other modes to
        share): what the strategy is built from."""
        cfg, vocab = self.config, self.vocab_size
        check_drafter(cfg.mode, drafter is not None)
        if any(int(t) >= vocab for t in cfg.eos_token_ids):
            raise ConfigError(f"decoder.eos_token_ids: ids must be < vocab_size {vocab}")
        self.drafter = as_drafter(drafter, vocab)
        graphdef = nnx.graphdef(target)
        ctx = Context(cfg, graphdef, target.config, self.drafter,
                      lambda leaves: jax.tree.unflatten(self._trees[0], leaves),
                      lambda leaves: jax.tree.unflatten(self._trees[1], leaves),
                      programs=ProgramStore(program_dir, decoder_salt(cfg, graphdef, target.config, self.drafter)))
        self._t_place = self._d_place = lambda tree: tree  # noqa: E731
        if cfg.mode == "async" or cfg.target_devices is not None or cfg.drafter_devices is not None:
            sl = place_slices(cfg.target_devices, cfg.drafter_devices, mode=cfg.mode)
            self._t_place, ctx.t_put, self._d_place, ctx.d_put = (sl.place_target_params, sl.put_target,
                                                                   sl.place_drafter_params, sl.put_drafter)
            ctx.shared = sl.shared
        self.shared = ctx.shared
        return ctx

    # ------------------------------------------------------------ weights
    def _bind(self, target_params, drafter=None) -> None:
        """Bind the target's parameters (``nnx.state``) and the drafter: the structure this
        decoder was built for (:func:`load_weights`)."""
        t_leaves, t_tree = jax.tree.flatten(self._t_place(target_params))
        if self._trees[0] is not None and t_tree != self._trees[0]:
            raise ConfigError("target: its structure differs from the one this decoder was built for")
        d_leaves, d_tree = [], jax.tree.flatten(None)[1]
        if self.drafter is not None:  # every mode but plain (checked when it was built)
            d = as_drafter(drafter, self.vocab_size)
            if d.signature != self.drafter.signature:
                raise ConfigError("drafter: its structure differs from the one this decoder was built for")
            d_leaves, d_tree = jax.tree.flatten(self._d_place(d.params))
            if self._trees[1] is not None and d_tree != self._trees[1]:
                raise ConfigError("drafter: its parameters differ in structure from the loaded ones")
            # same signature, same traced programs; the host side (request data) is the new one's
            self.drafter = d
        self._trees = [t_tree, d_tree]
        self._params = (t_leaves, d_leaves)

    def param_leaves(self) -> tuple[list, list]:
        """The target's and the drafter's parameter arrays as the programs read them (placed on
        their slices); read-only."""
        return self._params

    # ------------------------------------------------------------ requests and slots
    def validate_request(self, request: Request) -> None:
        problem = request_problem(request, self.config, self.vocab_size)
        if problem:
            raise RequestError(problem)

    def prefill(self, request: Request | Sequence[Request]) -> Prefix:
        """Check one request (or several) for :meth:`insert`; the device prefill runs when it is
        admitted, together with every other request inserted before the same round."""
        requests = [request] if isinstance(request, Request) else list(request)
        if not requests:
            raise RequestError("no requests to prefill")
        for req in requests:
            self.validate_request(req)
        return Prefix(requests)

    def insert(self, prefix: Prefix, slot) -> None:
        """Put prefilled requests into free slots (one slot per request); joins between rounds."""
        slots = self._slot_list(slot)
        if len(slots) != len(prefix.requests) or len(set(slots)) != len(slots):
            raise SlotError(f"{len(prefix.requests)} requests need as many distinct slots, got {slots}")
        busy = [s for s in slots if s in self._slots]
        if busy:
            raise SlotError(f"slot {busy[0]} is busy with an active request: free it first "
                            f"(in use: {slots_in_use(self)})")
        if self.pages is not None:
            self.pages.hold_requests(slots, prefix.requests, self.config.max_cache_len,
                                     need=self.growth.first if self.growth else None,
                                     prefixes=self._chunks is not None)
            for s in slots if self.growth else ():
                self.growth.admitted(s)
        for s, req in zip(slots, prefix.requests):
            self._slots[s] = SlotInfo(req, np.zeros(self.config.width, np.int64),
                                      pending=self._chunks is not None)
            row = self.placement.size
            self._queue.append(("admit", s, row))
            cls = self.strategy.initial_class(req)
            self._slots[s].stats["class"] = cls
            self._queue_swaps(self.placement.place(s, cls))

    def can_admit(self, request: Request) -> bool:
        """Whether :meth:`insert` finds pages for ``request`` now (always, with a dense cache):
        the scheduler keeps a request queued until it does, rather than have it refused."""
        if self.growth is not None:
            return self.growth.fits(request, len(self._running()))
        return self.pages is None or self.pages.fits([request], self.config.max_cache_len)

    def allow_preemption(self) -> None:
        """A paged cache grows page by page from here on, and a running request may be preempted
        when a page is short: the caller takes those slots (:meth:`take_preempted`) and queues
        their requests again (:func:`~d3d_jax.decoding.page_growth.resumed`).  The scheduler does."""
        if self.pages is not None and self.growth is None:
            self.growth = PageGrowth(self.pages, self.config.width, self.config.max_cache_len)

    def take_preempted(self) -> list[int]:
        """The slots preempted since the last call (freed already; their outputs stop there)."""
        out, self._preempted = self._preempted, []
        return out

    def page_stats(self) -> dict | None:
        """The paged pool's usage and prefix-cache counts (:meth:`PagePool.stats`, plus
        ``num_pages`` and the prompt tokens prefilled and reused: :meth:`PagedAdmission.stats`);
        None with a dense cache."""
        if self.pages is None:
            return None
        return dict(self.pages.pool.stats(), num_pages=self.pages.pool.num_pages,
                    **(self._chunks.stats() if self._chunks is not None else {}))

    def free(self, slot) -> None:
        """The slot's request leaves (finished or cancelled); freeing a free slot does nothing.
        ``slot`` may be a sequence of slots."""
        for s in self._slot_list(slot):
            info = self._slots.pop(s, None)
            if info is None:
                continue
            if self._chunks is not None:  # its pages findable by a later turn, then released
                self._chunks.release(s, info)
            elif self.pages is not None:  # later rounds write nothing for it (core.verify)
                self.pages.release(s)
            if info.finish_reason is None:  # still running on the device: stop it there
                self._queue.append(("op", self.placement.row_of[s], 0, W.OP_FREE))
            self._queue_swaps(self.placement.remove(s))

    def _queue_swaps(self, swaps) -> None:
        self._queue += [("op", a, b, W.OP_SWAP) for a, b in swaps]

    def _slot_list(self, slot) -> list[int]:
        slots = [int(s) for s in (slot if isinstance(slot, Sequence) else [slot])]
        bad = [s for s in slots if not 0 <= s < self.config.num_slots]
        if bad:
            raise SlotError(f"slot {bad[0]} is out of range [0, {self.config.num_slots})")
        return slots

    def _running(self) -> list[int]:
        if self._stale:
            self._refresh()
        return [s for s, info in sorted(self._slots.items())
                if info.finish_reason is None and not info.pending]

    # ------------------------------------------------------------ device state
    def _ensure_state(self) -> None:
        if self.carry is None:
            self.carry = self.strategy.init(self.config.num_slots)

    def _row_input(self, requests: Sequence[Request], width: int, slots: Sequence[int] = (),
                   n: int | None = None) -> RowInput:
        """Host arrays for ``n`` rows (every slot's), prompts ``width`` wide (their bucket); rows
        past the requests repeat the first (unused); ``slots``' page tables with a paged cache."""
        n, cap = n or self.config.num_slots, self.config.max_cache_len
        reqs = [requests[r] if r < len(requests) else requests[0] for r in range(n)]
        prompt = np.zeros((n, width), np.int32)
        stop_ids = np.full((n, MAX_STOP_IDS), -1, np.int32)
        stop_is_eos = np.zeros((n, MAX_STOP_IDS), bool)
        for r, req in enumerate(reqs):
            prompt[r, : len(req.prompt)] = req.prompt
            eos = self.config.eos_token_ids if req.eos_token_ids is None else tuple(req.eos_token_ids)
            ids = [int(t) for t in eos] + [int(t) for t in req.stop_token_ids]
            stop_ids[r, : len(ids)] = ids
            stop_is_eos[r, : len(eos)] = True
        ints = lambda f: np.asarray([int(f(q)) for q in reqs], np.int32)  # noqa: E731
        data = None if self.drafter is None else self.drafter.request_data(reqs, cap)
        return RowInput(prompt, ints(lambda q: len(q.prompt)), ints(lambda q: q.seed),
                        ints(lambda q: q.index), ints(lambda q: q.max_new_tokens), stop_ids,
                        stop_is_eos, SamplingParams.stack([q.sampling for q in reqs]), data,
                        None if self.pages is None else self.pages.table(slots, n))

    def _flush(self, everything: bool = False) -> None:
        """Replay the queued admissions and row operations in order (consecutive ones of a kind
        in one dispatch); with a paged cache, then prefill chunks of up to
        ``max_num_batched_tokens`` tokens (``everything``: every waiting prompt)."""
        self._ensure_state()
        queue, self._queue = self._queue, []
        while queue:
            kind = queue[0][0]
            run = list(itertools.takewhile(lambda e: e[0] == kind, queue))
            queue = queue[len(run):]
            if kind == "admit" and self._chunks is not None:
                for _, s, _ in run:
                    if s in self._slots:
                        self._chunks.add(s, self._slots[s])
            elif kind == "admit":
                self._admit(run)
            else:
                self._row_ops(run)
        if self._chunks:
            self._chunks.run(self, everything)

    def _admit(self, run: list[tuple]) -> None:
        """One dispatch per prompt bucket among the admitted rows (a program each, compiled when
        a bucket is first used)."""
        by_bucket: dict[int, list[tuple[int, int]]] = {}
        for _, s, row in run:
            if s in self._slots:
                width = self.config.prompt_width(len(self._slots[s].request.prompt))
                by_bucket.setdefault(width, []).append((s, row))
        for width, live in sorted(by_bucket.items()):
            rows = self._row_input([self._slots[s].request for s, _ in live], width, [s for s, _ in live])
            index = np.full((self.config.num_slots,), self.config.num_slots, np.int32)
            index[: len(live)] = [row for _, row in live]
            self.carry = self.strategy.admit(self.carry, self._params, rows, index, len(live))

    def _row_ops(self, run: list[tuple]) -> None:
        for k in range(0, len(run), OPS_PER_DISPATCH):
            chunk = run[k: k + OPS_PER_DISPATCH]
            ops = np.zeros((OPS_PER_DISPATCH, 3), np.int32)
            ops[: len(chunk)] = [e[1:] for e in chunk]
            self.carry = self.strategy.row_ops(self.carry, ops, len(chunk))

    # ------------------------------------------------------------ rounds
    def _snapshot(self) -> list:
        """Each row's (slot, SlotInfo) now; a row still being prefilled has no info (its device
        row holds a stale request, done, which the round's outcome must not be read for)."""
        infos = [self._slots.get(s) if s is not None else None for s in self.placement.slot_at]
        return [(s, None if info is None or info.pending else info)
                for s, info in zip(self.placement.slot_at, infos)]

    def _dispatch(self) -> bool:
        """Dispatch one round over the live rows (nothing waits); False if none is running."""
        t_start = time.perf_counter()
        self._reclassify()
        # admissions or row ops (a first one compiles) run before it: their device time would
        # count as the round's (a swap moves two rows of every cache), so it is not timed
        self._grow_pages()
        flushed = bool(self._queue) or self._tables_stale or bool(self._chunks)
        self._flush()
        self._set_tables()
        if not self._running():
            return False
        groups = self.placement.groups()
        infos = [self._slots[s] for s in self.placement.slot_at[: self.placement.size]]
        t0 = time.perf_counter()
        if self._grammar_live():  # the host steps the round: decoding/constrained.py
            self.carry, parts = masked_rounds(self.strategy, self.vocab_size).dispatch(
                self.carry, self._params, groups, infos)
        else:
            self.carry, parts = self.strategy.dispatch(self.carry, self._params, groups, infos)
        self._pending.append(_Round(parts, self._snapshot(), t0, t_start, not flushed,
                                    flushed or any(p.fresh for p in parts)))
        return True

    def _grow_pages(self, full: bool = False) -> bool:
        """Pages for the running rows' next rounds (``full``: for all they can fill, preempting
        none; False if some could not grow)."""
        if self.growth is None:
            return True
        running = {s: self._slots[s] for s in self._running()}
        if full:
            ok = all([self.pages.grow(s, self.growth.full(i.request)) for s, i in running.items()])
            self._tables_stale = True
            return ok
        preempted, changed = self.growth.grow(running, len(self._pending))
        for s in preempted:
            self.free(s)
        self._preempted += preempted
        self._tables_stale |= changed
        return True

    def _set_tables(self) -> None:
        if self._tables_stale:
            self._ensure_state()
            self.carry = self.strategy.page_tables(self.carry, self.pages.rows_table(self.placement.slot_at))
            self._tables_stale = False

    def _grammar_live(self) -> bool:
        return any(i.request.grammar is not None and i.finish_reason is None for i in self._slots.values())

    def _reclassify(self) -> None:
        """Placement classes the strategy asks for (auto: requests set aside for plain rounds)."""
        running = {s: self._slots[s] for s in self._running()}
        for slot, cls in self.strategy.reclassify(running).items():
            running[slot].stats["class"] = cls
            self._queue_swaps(self.placement.set_class(slot, cls))

    def _can_run_ahead(self) -> bool:
        """Some request is sure to be running once every dispatched round has run."""
        ahead = sum(self.strategy.most_tokens(r.parts) for r in self._pending)
        return any(info.n_out + ahead < info.request.max_new_tokens
                   for info in self._slots.values() if info.finish_reason is None)

    def step(self) -> dict[int, StepOutput]:
        """One round for every active slot (the oldest dispatched round not yet read)."""
        if not self._pending and not self._dispatch():
            return {}
        if len(self._pending) == 1 and self._can_run_ahead() and not self._grammar_live():
            # queued behind the one read below: the device keeps busy
            if self._dispatch() and self._pending[-1].host_work:
                # that work ran on this thread before the read below: not the read round's time
                self._pending[0].clean = False
        return self._read(self._pending.popleft())

    def _read(self, rnd: _Round) -> dict[int, StepOutput]:
        wants = any(info is not None and info.request.sampling.logprobs >= 0
                    for _, info in rnd.snapshot)
        host = jax.device_get([p.out if wants else
                               {k: v for k, v in p.out.items() if k not in LOGPROB_KEYS}
                               for p in rnd.parts])
        now = time.perf_counter()
        seconds = now - max(rnd.t_dispatch, self._last_read) if rnd.clean else None
        # all the time since the last read while requests ran (host work, admissions, row ops)
        wall = now - (self._last_read if self._busy else rnd.t_start)
        self._last_read = now
        outs, prefills = {}, self.strategy.home.prefill_rounds
        for part, h in zip(rnd.parts, host):
            M.tally_round(self._tally.setdefault(part.label, collections.Counter()), part,
                          int(np.sum(h["count"])), seconds if len(rnd.parts) == 1 else None)
            for i, row in enumerate(range(part.start, part.start + part.rows)):
                slot, info = rnd.snapshot[row]
                if prefills and h["count"][i] == 0 and h["finish"][i] == 0:
                    continue  # a row caching its prompt: nothing for it yet (core.prefilling)
                if part.lo <= row < part.hi and info is not None and self._slots.get(slot) is info \
                        and info.finish_reason is None:
                    outs[slot] = self._count(info, part.label, {k: v[i] for k, v in h.items()})
                    if self._chunks is not None:
                        self._chunks.read(info, part.label, outs[slot].token_ids)
        self.strategy.observe(rnd.parts, host, seconds, rnd.snapshot, wall=wall)
        self._busy = any(info.finish_reason is None for info in self._slots.values())
        return outs

    @staticmethod
    def _count(info: SlotInfo, label: str, row: dict) -> StepOutput:
        n, accepted = int(row["count"]), int(row["accepted"])
        reason = FINISH_REASONS.get(int(row["finish"]))
        hit = None if "hit" not in row else bool(row["hit"])
        info.n_out += n
        info.finish_reason = reason
        info.rounds += 1
        info.accepted += accepted
        info.hist[accepted] += 1
        info.hits += bool(hit)
        info.misses += bool(row.get("miss", False))
        info.modes[label] += 1
        if info.request.grammar is not None:
            info.request.grammar.advance(row["tokens"][:n])
        return StepOutput([int(t) for t in row["tokens"][:n]], reason is not None, reason,
                          accepted, hit, M.row_logprobs(row, n, info.request.sampling.logprobs))

    def _drain(self) -> None:
        while self._pending:
            self._read(self._pending.popleft())

    def run_until_done(self, hook=None, loop=None, live_floor: int = 0, min_window: int = 0) -> dict:
        """Decode every active slot to the end and wait for it: plain/sync in one on-device
        loop, async by rounds that only dispatch (``hook`` sees each), auto by :meth:`step` (it
        picks each round's geometry on the host).  ``loop(strategy, carry, params, lo, hi,
        max_rounds) -> (carry, timings)`` replaces a plain/sync strategy's own loop (the
        benchmarks' phase-timed one, :mod:`d3d_jax.bench.phased`).  ``live_floor``: stop as soon
        as no more than that many slots run (plain/sync's loop and rounds by :meth:`step`; async
        runs to the end), so a caller with requests waiting refills the finished slots.
        ``min_window``: plain/sync's loop runs over at least this many rows (the finished ones
        idle), so a caller keeps one program while its rows thin out.  Returns the timings."""
        self._drain()
        self._flush(everything=True)
        if len(self._running()) <= live_floor:
            return {}
        if not self._grow_pages(full=True):  # the loop maps no page: rounds by step() instead
            self._set_tables()
            while len(self._running()) > live_floor:
                self.step()
            return {}
        self._set_tables()
        if not self.strategy.loops or self._grammar_live():  # a grammar needs the host every round
            while len(self._running()) > live_floor:
                self.step()
            return {}
        self.carry, timings = self._loop_to_end(hook, loop, live_floor, min_window)
        self._stale = True  # which slots finished: read when next needed
        jax.block_until_ready(self.carry)
        return timings

    def _loop_to_end(self, hook, loop, live_floor: int = 0, min_window: int = 0):
        """``(carry, timings)`` of the strategy's loop (or ``loop``) over the live rows' window."""
        running = self._running()
        rows = np.asarray([self.placement.row_of[s] for s in running])
        infos = [self._slots[s] for s in running]
        live = LiveRows(rows, np.asarray([len(i.request.prompt) - 1 for i in infos]),
                        np.asarray([i.request.max_new_tokens for i in infos]),
                        np.asarray([i.n_out for i in infos]))
        bound = int(max(live.max_new - live.n_out))  # every round commits >= 1 token per row
        if loop is not None:
            return loop(self.strategy, self.carry, self._params, 0, self.placement.size, bound)
        greedy = all(i.request.sampling == GREEDY for i in infos)  # the loop without sampling code
        hi = max(self.placement.size, min(int(min_window), self.config.num_slots))  # rows past size are free: done
        return self.strategy.run_until_done(self.carry, self._params, 0, hi, live=live,
                                            max_rounds=bound, hook=hook, greedy=greedy, live_floor=live_floor)

    def warm_up(self, widths: Sequence[int] | None = None, run: bool = True) -> float:
        """Compile (or read from the program store; auto also times) the admission, row-ops and
        round programs of every window width (``widths``: only those) before a client waits.
        ``run=False``: compile only, nothing dispatched, so it may run on another thread beside
        the rounds (the server's background warm-up); with no program store it does nothing."""
        self._ensure_state()
        t0 = time.perf_counter()
        widths = self.config.buckets if widths is None else tuple(widths)
        if run:
            self.carry = self.strategy.warm_up(self.carry, self._params, widths)
        else:  # the live state's types: its arrays may be donated by a round meanwhile
            types = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                                                weak_type=x.weak_type)
                                 if isinstance(x, jax.Array) else x, self.carry)
            self.strategy.compile_ahead(types, self._params, widths)
        return time.perf_counter() - t0

    def decisions(self) -> dict[str, dict]:
        """Per geometry (``plain``, ``sync/8``, ``async/12x2``): rounds run (step's, not the
        on-device loop's), tokens committed and, auto, the tokens its choice predicted; of the
        timed one-part rounds, their seconds and, auto, the seconds its choice predicted."""
        return {label: dict(t) for label, t in sorted(self._tally.items())}

    # ------------------------------------------------------------ results
    def _row_results(self, slots: Sequence[int]) -> dict:
        rows = np.asarray([self.placement.row_of[s] for s in slots], np.int32)
        return jax.device_get(self.strategy.row_results(self.carry, rows))

    def _refresh(self) -> None:
        """Host counts of the resident slots after an on-device loop (one small read)."""
        self._stale = False
        slots = sorted(self._slots)
        if not slots:
            return
        res = self._row_results(slots)
        for i, s in enumerate(slots):
            info = self._slots[s]
            info.n_out = int(res["n_out"][i])
            info.finish_reason = FINISH_REASONS.get(int(res["finish"][i]))
            info.hist = np.asarray(res["accept_hist"][i], np.int64)
            info.rounds = int(info.hist.sum())
            if "hits" in res:
                info.hits, info.misses = int(res["hits"][i]), int(res["misses"][i])

    def results(self, slots: Sequence[int]) -> list[dict]:
        """Per slot: generated ``token_ids``, ``finish_reason``, ``accept_hist``, async
        ``hits``/``misses`` (one device→host read of those rows)."""
        slots = list(slots)
        self._drain()
        self._flush(everything=True)
        res = self._row_results(slots)
        if self._stale:
            self._refresh()
        out = []
        for i, s in enumerate(slots):
            plen, n = int(res["prompt_len"][i]), int(res["n_out"][i])
            r = dict(token_ids=[int(t) for t in res["seq"][i, plen: plen + n]],
                     finish_reason=FINISH_REASONS.get(int(res["finish"][i]), "length"),
                     accept_hist=res["accept_hist"][i], modes=dict(self._slots[s].modes),
                     reasons=dict(self._slots[s].stats.get("reasons", {})))
            if "hits" in res:
                r.update(hits=int(res["hits"][i]), misses=int(res["misses"][i]),
                         sync_drafts=int(res["sync_drafts"]))
            out.append(r)
        return out

    def slot_metrics(self, slot) -> dict:
        """τ, acceptance histogram, rounds, tokens so far, async hits and misses, and the rounds
        per geometry (``modes``): counted on the host, nothing is read from the device."""
        if self._stale:
            self._refresh()
        info = self._slots.get(self._slot_list(slot)[0])
        if info is None:
            raise SlotError(f"slot {slot} holds no request")
        async_counts = self.config.mode in ("async", "auto")
        return dict(tau=M.tau_from_hist(info.hist), accept_hist=[int(x) for x in info.hist],
                    rounds=info.rounds, n_out=info.n_out, modes=dict(info.modes),
                    reasons=dict(info.stats.get("reasons", {})),
                    hits=info.hits if async_counts else None,
                    misses=info.misses if async_counts else None)


def load_weights(decoder: SpecDecoder, target, drafter=None) -> None:
    """(Re)bind ``decoder``'s weights: the structure it was built for (no recompile)."""
    decoder._bind(nnx.state(target), drafter)


def slots_in_use(decoder: SpecDecoder) -> list[int]:
    """The slots holding a request.  A caller that inserts knows its own; tools and tests ask."""
    return sorted(decoder._slots)


def running_slots(decoder: SpecDecoder) -> list[int]:
    """The slots whose request still decodes (one small read after an on-device loop): what a
    caller refilling finished slots between loops asks (:func:`~d3d_jax.decoding.engine.generate_stream`)."""
    return decoder._running()
