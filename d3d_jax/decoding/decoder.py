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
  counted on the host from them (:mod:`~d3d_jax.decoding.outcomes`), so finishing one copies
  nothing from the device.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from d3d_jax.config import ConfigError
from d3d_jax.config.decoding import DEFAULT_CACHE_LEN, DEFAULT_NUM_SLOTS, check_drafter
from d3d_jax.decoding import window as W
from d3d_jax.decoding.async_loop import LiveRows
from d3d_jax.decoding.constrained import masked_rounds
from d3d_jax.decoding.decoder_config import (DecoderConfig, Request, RequestError, SlotError,
                                             StepOutput, request_problem)
from d3d_jax.decoding.drafting import as_drafter
from d3d_jax.decoding.outcomes import Round, RoundReader, SlotInfo
from d3d_jax.decoding.page_growth import PageGrowth
from d3d_jax.decoding.page_pool import SlotPages
from d3d_jax.decoding.paging import PagedAdmission
from d3d_jax.parallel.sharding import place_slices
from d3d_jax.decoding.programs import ProgramStore, decoder_salt
from d3d_jax.decoding.row_queue import RowQueue
from d3d_jax.decoding.strategies import Context
from d3d_jax.decoding.verify import GREEDY, SamplingParams

__all__ = ["SpecDecoder", "DecoderConfig", "Request", "Prefix", "StepOutput", "RequestError",
           "SlotError", "SamplingParams"]


@dataclasses.dataclass
class Prefix:
    """Checked requests, ready for :meth:`SpecDecoder.insert` (prefilled when admitted)."""

    requests: list[Request]


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
        self._queue = RowQueue(cfg, self.pages)  # admissions and row ops until the next round
        self._pending: collections.deque[Round] = collections.deque()
        self._reader = RoundReader()  # what rounds read counted: times, tallies per geometry
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
            self._queue.admit(s, row)
            cls = self.strategy.initial_class(req)
            self._slots[s].stats["class"] = cls
            self._queue.swaps(self.placement.place(s, cls))

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
                self._queue.stop(self.placement.row_of[s])
            self._queue.swaps(self.placement.remove(s))

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

    def _flush(self, everything: bool = False) -> None:
        """Replay the queued admissions and row operations in order (consecutive ones of a kind
        in one dispatch); with a paged cache, then prefill chunks of up to
        ``max_num_batched_tokens`` tokens (``everything``: every waiting prompt)."""
        self._ensure_state()
        self._queue.replay(self.strategy, self.carry, self._params, self.drafter, self._slots, self._chunks,
                           keep=lambda carry: setattr(self, "carry", carry))
        if self._chunks:
            self._chunks.run(self, everything)

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
        self._pending.append(Round(parts, self._snapshot(), t0, t_start, not flushed,
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
            self._queue.swaps(self.placement.set_class(slot, cls))

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

    def _read(self, rnd: Round) -> dict[int, StepOutput]:
        return self._reader.read(rnd, self.strategy, self._slots, self._chunks)

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

    def warm_up(self, widths: Sequence[int] | None = None, run: bool = True,
                prompt_cap: int | None = None) -> float:
        """Compile (or read from the program store; auto also times) the admission, row-ops and
        round programs of every window width (``widths``: only those; ``prompt_cap``: admission
        only for prompts of up to that many tokens) before a client waits.
        ``run=False``: compile only, nothing dispatched, so it may run on another thread beside
        the rounds (the server's background warm-up); with no program store it does nothing."""
        self._ensure_state()
        t0 = time.perf_counter()
        widths = self.config.buckets if widths is None else tuple(widths)
        if run:
            self.carry = self.strategy.warm_up(self.carry, self._params, widths, prompt_cap)
        else:  # the live state's types: its arrays may be donated by a round meanwhile
            types = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                                                weak_type=x.weak_type)
                                 if isinstance(x, jax.Array) else x, self.carry)
            self.strategy.compile_ahead(types, self._params, widths, prompt_cap)
        return time.perf_counter() - t0

    def decisions(self) -> dict[str, dict]:
        """Per geometry (``plain``, ``sync/8``, ``async/12x2``): rounds run (step's, not the
        on-device loop's), tokens committed and, auto, the tokens its choice predicted; of the
        timed one-part rounds, their seconds and, auto, the seconds its choice predicted."""
        return self._reader.decisions()

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
            self._slots[s].refresh(res, i)

    def results(self, slots: Sequence[int]) -> list[dict]:
        """Per slot: generated ``token_ids``, ``finish_reason``, ``accept_hist``, async
        ``hits``/``misses`` (one device→host read of those rows)."""
        slots = list(slots)
        self._drain()
        self._flush(everything=True)
        res = self._row_results(slots)
        if self._stale:
            self._refresh()
        return [self._slots[s].result(res, i) for i, s in enumerate(slots)]

    def slot_metrics(self, slot) -> dict:
        """τ, acceptance histogram, rounds, tokens so far, async hits and misses, and the rounds
        per geometry (``modes``): counted on the host, nothing is read from the device."""
        if self._stale:
            self._refresh()
        info = self._slots.get(self._slot_list(slot)[0])
        if info is None:
            raise SlotError(f"slot {slot} holds no request")
        return info.metrics(async_counts=self.config.mode in ("async", "auto"))


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
