"""The speculative decoder: one long-lived object with a fixed set of slots (continuous batching).

``SpecDecoder(target, drafter, config)`` splits and places the parameters once, flattens them to
leaf lists once, and jits its methods with everything static bound in (tunix's sampler style):
calling a method hashes nothing.  It owns the slots and the target and drafter state.  The
contract (JetStream's prefill / insert / generate)::

    dec = SpecDecoder(target, drafter, DecoderConfig(mode="sync", num_slots=8, ...))
    prefix = dec.prefill(Request(prompt=[1, 2, 3], max_new_tokens=64))
    dec.insert(prefix, dec.free_slots()[0])   # between rounds
    outs = dec.step()                         # one round for every active slot
    dec.free(slot)                            # finished or cancelled

Plain and sync rounds are :meth:`DecodeCore.round`; :meth:`run_until_done` runs them in a
``lax.while_loop`` on the device.  Async rounds are :class:`AsyncCore`'s three dispatches;
``run_until_done`` drives them without waiting on the host (:mod:`async_loop`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d3d_jax.config import ConfigError
from d3d_jax.decoding import metrics as M
from d3d_jax.decoding.async_core import AsyncCore
from d3d_jax.decoding.core import FINISH_REASONS, MAX_STOP_IDS, DecodeCore, RowInput, TargetRows
from d3d_jax.decoding.decoder_config import (DecoderConfig, Request, RequestError, SlotError,
                                             StepOutput, request_problem)
from d3d_jax.decoding.drafting import as_drafter
from d3d_jax.decoding.placement import placer, resolve_slices
from d3d_jax.decoding.verify import SamplingParams

__all__ = ["SpecDecoder", "DecoderConfig", "Request", "Prefix", "StepOutput", "RequestError",
           "SlotError", "SamplingParams"]

# CPU backends cannot donate; the warning says nothing useful there.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


@dataclasses.dataclass
class Prefix:
    """Prefilled requests (rows), ready for :meth:`SpecDecoder.insert`."""

    requests: list[Request]
    target: TargetRows
    drafter: Any  # sync: drafter rows; async: AsyncDraftState rows; plain: None


@dataclasses.dataclass
class _Slot:
    request: Request
    n_out: int = 0
    finish_reason: str | None = None


def _logprobs(res, slot: int, n: int, top: int) -> list | None:
    """One slot's emitted tokens' log-probabilities from a host copy of a round's result."""
    if top < 0:
        return None
    return [(float(res.logprob[slot, k]),
             [(int(i), float(lp)) for i, lp in zip(res.top_ids[slot, k, :top], res.top_logprobs[slot, k, :top])])
            for k in range(n)]


def _bucket(n: int, cap: int) -> int:
    """Prompt-length bucket: the next power of two >= n (at least 16), capped at the cache."""
    return min(cap, max(16, 1 << (max(n, 1) - 1).bit_length()))


class SpecDecoder:
    """Plain, sync or async speculative decoding over a fixed set of slots (see module doc)."""

    def __init__(self, target, drafter, config: DecoderConfig):
        config.validate()
        self.config = cfg = config
        vocab = target.config.vocab_size
        if cfg.mode == "plain" and drafter is not None:
            raise ConfigError("drafter: mode plain takes no drafter")
        if cfg.mode != "plain" and drafter is None:
            raise ConfigError(f"drafter: mode {cfg.mode} needs a drafter")
        self.drafter = as_drafter(drafter, vocab)
        if any(int(t) >= vocab for t in cfg.eos_token_ids):
            raise ConfigError(f"decoder.eos_token_ids: ids must be < vocab_size {vocab}")
        self.vocab_size = vocab
        self.core = DecodeCore(nnx.graphdef(target), target.config,
                               self.drafter if cfg.mode == "sync" else None, width=cfg.width,
                               cache_len=cfg.max_cache_len, sample_drafts=cfg.sample_drafts,
                               acceptance_rule=cfg.acceptance_rule,
                               override=cfg.acceptance_override)
        self.async_core = AsyncCore(self.core, self.drafter, cfg.layout) if cfg.mode == "async" else None
        self._slices(cfg)
        self._jit()
        self._t_tree = self._d_tree = None
        self.load(target, drafter)
        self._slots: list[_Slot | None] = [None] * cfg.num_slots
        self._state = self._side = self._hand = None
        self._stale = False

    # ------------------------------------------------------------ set-up
    def _slices(self, cfg: DecoderConfig) -> None:
        if cfg.mode != "async":
            ident = lambda tree: tree  # noqa: E731  plain/sync: parameters stay where they are
            self._t_place = self._d_place = self._t_put = self._d_put = ident
            self.shared = True
            return
        t_devs, d_devs = resolve_slices(cfg.target_devices, cfg.drafter_devices)
        self.target_devices, self.drafter_devices = t_devs, d_devs
        self.shared = list(t_devs) == list(d_devs)  # one slice: nothing moves between sides
        self._t_place, self._t_put = placer(t_devs)
        self._d_place, self._d_put = placer(d_devs)

    def _jit(self) -> None:
        # jitted so every field is its own buffer (eager zeros may share one; fields are donated)
        self._init_state = jax.jit(self.core.init_state, static_argnums=0)
        if self.async_core is not None:
            self._init_side = jax.jit(self.async_core.init_state, static_argnums=0)
        self._prefill_target = jax.jit(self._prefill_target_fn)
        self._prefill_drafter = jax.jit(self._prefill_drafter_fn)
        self._insert = jax.jit(self.core.insert, donate_argnums=0)
        self._admit = jax.jit(self._admit_fn, donate_argnums=2)
        self._admit_run = jax.jit(self._admit_run_fn, donate_argnums=2)
        self._free = jax.jit(self.core.free, donate_argnums=0)
        self._round = jax.jit(self._round_fn, donate_argnums=2)
        self._loop = jax.jit(self._loop_fn, donate_argnums=2)
        self._draft = jax.jit(self._draft_fn, donate_argnums=1)
        self._verify_commit = jax.jit(self._verify_commit_fn, donate_argnums=1)
        if self.async_core is not None:
            self._insert_drafter = jax.jit(self.async_core.insert, donate_argnums=0)
            self._admit_drafter = jax.jit(self._admit_drafter_fn, donate_argnums=1)
            self._target_step = jax.jit(self._target_step_fn, donate_argnums=1)
            self._packed = jax.jit(self._packed_fn, donate_argnums=1)
            self._select = jax.jit(self._select_fn, donate_argnums=1)

    def load(self, target, drafter=None) -> None:
        """(Re)bind weights: same structure as at construction (no recompile)."""
        self.load_params(nnx.state(target), drafter)

    def load_params(self, target_params, drafter=None) -> None:
        """:meth:`load` from the target's parameters (``nnx.state``) instead of the module."""
        t_leaves, t_tree = jax.tree.flatten(self._t_place(target_params))
        if self._t_tree is not None and t_tree != self._t_tree:
            raise ConfigError("target: its structure differs from the one this decoder was built for")
        self._t_leaves, self._t_tree = t_leaves, t_tree
        if self.config.mode == "plain":
            self._d_leaves, self._d_tree = jax.tree.flatten(None)
            return
        d = as_drafter(drafter, self.vocab_size)
        if d.signature != self.drafter.signature:
            raise ConfigError("drafter: its structure differs from the one this decoder was built for")
        self.drafter = d
        self.core.drafter = d if self.config.mode == "sync" else None
        if self.async_core is not None:
            self.async_core.drafter = d
        d_leaves, d_tree = jax.tree.flatten(self._d_place(d.params))
        if self._d_tree is not None and d_tree != self._d_tree:
            raise ConfigError("drafter: its parameters differ in structure from the loaded ones")
        self._d_leaves, self._d_tree = d_leaves, d_tree

    def unload(self) -> None:
        """Drop parameters and state (memory), keep the compiled methods; :meth:`load` rebinds."""
        self._t_leaves = self._d_leaves = None
        self._state = self._side = self._hand = None
        self._slots = [None] * self.config.num_slots
        self._stale = False

    # ------------------------------------------------------------ traced bodies
    def _tp(self, leaves):
        return jax.tree.unflatten(self._t_tree, leaves)

    def _dp(self, leaves):
        return jax.tree.unflatten(self._d_tree, leaves)

    def _prefill_target_fn(self, t_leaves, rows: RowInput):
        return self.core.prefill_target(self._tp(t_leaves), rows)

    def _prefill_drafter_fn(self, d_leaves, rows: RowInput):
        if self.async_core is not None:
            return self.async_core.prefill_drafter(self._dp(d_leaves), rows)
        return self.core.prefill_drafter(self._dp(d_leaves), rows)

    def _admit_fn(self, t_leaves, d_leaves, state, rows: RowInput, slots):
        target = self._prefill_target_fn(t_leaves, rows)
        drafter = self._prefill_drafter_fn(d_leaves, rows) if self.config.mode == "sync" else None
        return self.core.insert(state, target, drafter, slots)

    def _admit_run_fn(self, t_leaves, d_leaves, state, rows: RowInput, slots):
        state = self._admit_fn(t_leaves, d_leaves, state, rows, slots)
        return self._loop_fn(t_leaves, d_leaves, state)

    def _admit_drafter_fn(self, d_leaves, side, rows: RowInput, slots):
        return self.async_core.insert(side, self._prefill_drafter_fn(d_leaves, rows), slots)

    def _round_fn(self, t_leaves, d_leaves, state):
        return self.core.round(self._tp(t_leaves), self._dp(d_leaves), state)

    def _loop_fn(self, t_leaves, d_leaves, state):
        return self.core.run_until_done(self._tp(t_leaves), self._dp(d_leaves), state)

    def _draft_fn(self, d_leaves, state):
        return self.core.draft(self._dp(d_leaves), state)

    def _verify_commit_fn(self, t_leaves, state, drafts, probs):
        accepted, next_token, cache, lp = self.core.verify(self._tp(t_leaves), state, drafts, drafts,
                                                           probs)
        return self.core.commit(state, drafts, accepted, next_token, cache, lp)[0]

    def _target_step_fn(self, t_leaves, state, hand):
        return self.async_core.target_step(self._tp(t_leaves), state, hand)

    def _packed_fn(self, d_leaves, side):
        return self.async_core.packed(self._dp(d_leaves), side)

    def _select_fn(self, d_leaves, side, drafts, decision):
        return self.async_core.select(self._dp(d_leaves), side, drafts, decision)

    # ------------------------------------------------------------ requests and slots
    def validate_request(self, request: Request) -> None:
        problem = request_problem(request, self.config, self.vocab_size)
        if problem:
            raise RequestError(problem)

    def _row_input(self, requests: Sequence[Request], pad_len: int, num_rows: int) -> RowInput:
        """Host arrays for ``num_rows`` rows; rows past the requests repeat the first (dummies)."""
        reqs = [requests[r] if r < len(requests) else requests[0] for r in range(num_rows)]
        prompt = np.zeros((num_rows, pad_len), np.int32)
        stop_ids = np.full((num_rows, MAX_STOP_IDS), -1, np.int32)
        stop_is_eos = np.zeros((num_rows, MAX_STOP_IDS), bool)
        for r, req in enumerate(reqs):
            prompt[r, : len(req.prompt)] = req.prompt
            eos = self.config.eos_token_ids if req.eos_token_ids is None else tuple(req.eos_token_ids)
            ids = [int(t) for t in eos] + [int(t) for t in req.stop_token_ids]
            stop_ids[r, : len(ids)] = ids
            stop_is_eos[r, : len(eos)] = True
        ints = lambda f: np.asarray([int(f(q)) for q in reqs], np.int32)  # noqa: E731
        data = None if self.drafter is None else self.drafter.request_data(reqs, self.config.max_cache_len)
        return RowInput(prompt, ints(lambda q: len(q.prompt)), ints(lambda q: q.seed),
                        ints(lambda q: q.index), ints(lambda q: q.max_new_tokens), stop_ids,
                        stop_is_eos, SamplingParams.stack([q.sampling for q in reqs]), data)

    def prefill(self, request: Request) -> Prefix:
        """Target (and drafter) prefill of one request; its prompt length is bucketed."""
        return self.prefill_batch([request])

    def prefill_batch(self, requests: Sequence[Request], pad_len: int | None = None,
                      num_rows: int | None = None) -> Prefix:
        """Prefill of several requests at once, prompts padded to ``pad_len`` (default: a power-
        of-two bucket) and to ``num_rows`` rows (dummies), so shapes repeat across calls."""
        rows = self._rows_for(requests, pad_len, num_rows)
        target = self._prefill_target(self._t_leaves, self._t_put(rows))
        drafter = None
        if self.drafter is not None:
            drafter = self._prefill_drafter(self._d_leaves, self._d_put(rows))
        return Prefix(list(requests), target, drafter)

    def _rows_for(self, requests: Sequence[Request], pad_len, num_rows) -> RowInput:
        if not requests:
            raise RequestError("no requests to prefill")
        for req in requests:
            self.validate_request(req)
        longest = max(len(r.prompt) for r in requests)
        pad_len = _bucket(longest, self.config.max_cache_len) if pad_len is None else int(pad_len)
        return self._row_input(requests, pad_len, num_rows or len(requests))

    def _ensure_state(self) -> None:
        if self._state is None:
            b = self.config.num_slots
            self._state = self._t_put(self._init_state(b))
            if self.async_core is not None:
                self._side = self._d_put(self._init_side(b))

    def _slot_index(self, slot) -> int:
        if not 0 <= int(slot) < self.config.num_slots:
            raise SlotError(f"slot {slot} is out of range [0, {self.config.num_slots})")
        return int(slot)

    def _claim(self, slot, n: int, rows: int) -> tuple[list[int], np.ndarray]:
        """Check ``n`` distinct free slots; the row -> slot index for ``rows`` rows (dummy rows go
        to an out-of-range slot: dropped)."""
        slots = [self._slot_index(s) for s in (slot if isinstance(slot, Sequence) else [slot])]
        if len(slots) != n or len(set(slots)) != len(slots):
            raise SlotError(f"{n} requests need as many distinct slots, got {slots}")
        busy = [s for s in slots if self._slots[s] is not None]
        if busy:
            raise SlotError(f"slot {busy[0]} is busy with an active request: free it first "
                            f"(free slots: {self.free_slots()})")
        index = np.full((rows,), self.config.num_slots, np.int32)
        index[: len(slots)] = slots
        self._ensure_state()
        return slots, index

    def insert(self, prefix: Prefix, slot) -> None:
        """Put prefilled requests into free slots (one slot per request); joins between rounds."""
        slots, index = self._claim(slot, len(prefix.requests), prefix.target.seq.shape[0])
        drafter_rows = prefix.drafter if self.config.mode == "sync" else None
        self._state = self._insert(self._state, prefix.target, drafter_rows, index)
        if self.async_core is not None:
            self._side, self._hand = self._insert_drafter(self._side, prefix.drafter, index)
        for s, req in zip(slots, prefix.requests):
            self._slots[s] = _Slot(req)

    def insert_requests(self, requests: Sequence[Request], slot, pad_len: int | None = None,
                        num_rows: int | None = None) -> None:
        """:meth:`prefill_batch` and :meth:`insert` in one dispatch per side (no prefix is kept)."""
        rows = self._rows_for(requests, pad_len, num_rows)
        slots, index = self._claim(slot, len(requests), rows.prompt.shape[0])
        # async: the drafter's leaves live on its own slice, and the target side never needs them
        d_leaves = self._d_leaves if self.config.mode == "sync" else None
        self._state = self._admit(self._t_leaves, d_leaves, self._state, self._t_put(rows), index)
        if self.async_core is not None:
            self._side, self._hand = self._admit_drafter(self._d_leaves, self._side,
                                                         self._d_put(rows), index)
        for s, req in zip(slots, requests):
            self._slots[s] = _Slot(req)

    def free(self, slot) -> None:
        """The slot's request leaves (finished or cancelled); freeing a free slot does nothing.
        ``slot`` may be a sequence of slots (one dispatch)."""
        slots = [self._slot_index(s) for s in (slot if isinstance(slot, Sequence) else [slot])]
        slots = [s for s in slots if self._slots[s] is not None]
        running = [s for s in slots if self._slots[s].finish_reason is None]
        for s in slots:
            self._slots[s] = None
        if not running:  # a finished row is already done on the device
            return
        slots = running
        index = np.full((self.config.num_slots,), self.config.num_slots, np.int32)  # one shape
        index[: len(slots)] = slots
        self._state = self._free(self._state, index)

    def active_slots(self) -> list[int]:
        return [s for s, info in enumerate(self._slots) if info is not None]

    def free_slots(self) -> list[int]:
        return [s for s, info in enumerate(self._slots) if info is None]

    def _running(self) -> list[int]:
        if self._stale:
            self._refresh()
        return [s for s, info in enumerate(self._slots) if info is not None and info.finish_reason is None]

    # ------------------------------------------------------------ rounds
    def _to_target(self, x):
        return x if self.shared else self._t_put(x)  # device to device, never through the host

    def _to_drafter(self, x):
        return x if self.shared else self._d_put(x)

    def dispatch_async_round(self):
        """Dispatch one async round (verify, branch pack, selection); waits on nothing.
        Returns ``(decision, branch drafts, view, result)`` (device arrays)."""
        self._state, decision, result = self._target_step(self._t_leaves, self._state,
                                                          self._to_target(self._hand))
        drafts, self._side = self._packed(self._d_leaves, self._side)
        self._side, self._hand, view = self._select(self._d_leaves, self._side, drafts,
                                                    self._to_drafter(decision))
        return decision, drafts, view, result

    def step(self) -> dict[int, StepOutput]:
        """One round for every active slot; one device→host read of the round's result."""
        running = self._running()
        if not running:
            return {}
        view = None
        if self.async_core is not None:
            _, _, view, result = self.dispatch_async_round()
        else:
            self._state, result = self._round(self._t_leaves, self._d_leaves, self._state)
        res, view = jax.device_get((result, view))
        outs = {}
        for s in running:
            n = int(res.count[s])
            reason = FINISH_REASONS.get(int(res.finish[s]))
            info = self._slots[s]
            info.n_out += n
            info.finish_reason = reason
            outs[s] = StepOutput([int(t) for t in res.tokens[s, :n]], reason is not None, reason,
                                 int(res.accepted[s]), None if view is None else bool(view[s, 1]),
                                 _logprobs(res, s, n, info.request.sampling.logprobs))
        return outs

    def run_until_done(self, timeline: list | None = None) -> dict:
        """Decode every active slot to the end: plain/sync in one on-device loop, async by rounds
        that only dispatch.  Returns timings (async: per-round metrics)."""
        running = self._running()
        timings: dict = {}
        if running:
            if self.async_core is not None:
                from d3d_jax.decoding.async_loop import run_rounds

                bound = max(self._slots[s].request.max_new_tokens - self._slots[s].n_out
                            for s in running)
                timings = run_rounds(self, bound, timeline)
            else:
                self._state = self._loop(self._t_leaves, self._d_leaves, self._state)
        self._stale = True  # which slots finished: read when next needed (results() reads it)
        return timings

    def run_requests(self, requests: Sequence[Request], slot, pad_len: int | None = None,
                     num_rows: int | None = None) -> None:
        """Plain/sync: prefill, insert and decode to the end in ONE dispatch (generate's batches:
        one executable per prompt-length bucket, no host round trip in between)."""
        if self.async_core is not None:
            raise ConfigError("decoder.mode: run_requests serves plain and sync; async decodes "
                              "with insert_requests + run_until_done")
        rows = self._rows_for(requests, pad_len, num_rows)
        slots, index = self._claim(slot, len(requests), rows.prompt.shape[0])
        self._state = self._admit_run(self._t_leaves, self._d_leaves, self._state, rows, index)
        for s, req in zip(slots, requests):
            self._slots[s] = _Slot(req)
        self._stale = True

    def wait(self) -> None:
        """Block until everything dispatched so far has run."""
        jax.block_until_ready((self._state, self._side, self._hand))

    def run_timed(self) -> dict:
        """Plain/sync rounds driven from the host, timing drafting and verifying apart (slower:
        one wait per phase; compilation is left out)."""
        from d3d_jax.decoding.clock import CompileClock

        draft_s = verify_s = 0.0
        for _ in range(max((self._slots[s].request.max_new_tokens for s in self._running()), default=0)):
            if bool(np.all(jax.device_get(self._state.done))):
                break
            with CompileClock() as c1:
                t0 = time.perf_counter()
                if self.drafter is None:
                    drafts = jnp.zeros((self.config.num_slots, 0), jnp.int32)
                    probs = None
                else:
                    out, self._state = self._draft(self._d_leaves, self._state)
                    drafts, probs = jax.block_until_ready((out.drafts, out.probs))
                t1 = time.perf_counter()
            with CompileClock() as c2:
                self._state = jax.block_until_ready(
                    self._verify_commit(self._t_leaves, self._state, drafts, probs))
                t2 = time.perf_counter()
            draft_s += t1 - t0 - c1.seconds
            verify_s += t2 - t1 - c2.seconds
        self._refresh()
        return {"draft_s": draft_s if self.drafter is not None else 0.0, "verify_s": verify_s}

    def _refresh(self, n_out=None, finish=None) -> None:
        """Host view of which slots finished (one small read, unless given)."""
        self._stale = False
        if self._state is None:
            return
        if n_out is None:
            n_out, finish = jax.device_get((self._state.n_out, self._state.finish))
        for s in self._running():
            self._slots[s].n_out = int(n_out[s])
            self._slots[s].finish_reason = FINISH_REASONS.get(int(finish[s]))

    # ------------------------------------------------------------ results
    def results(self, slots: Sequence[int]) -> list[dict]:
        """Per slot: generated ``token_ids``, ``finish_reason``, ``accept_hist``, async
        ``hits``/``misses`` (one device→host read)."""
        st, side = self._state, self._side
        side_rows = (side.hits, side.misses, side.sync_drafts) if side is not None else None
        seq, plen, n_out, finish, hist, side_h = jax.device_get(
            (st.seq, st.prompt_len, st.n_out, st.finish, st.accept_hist, side_rows))
        if self._stale:
            self._refresh(n_out, finish)
        out = []
        for s in slots:
            r = dict(token_ids=[int(t) for t in seq[s, plen[s]: plen[s] + n_out[s]]],
                     finish_reason=FINISH_REASONS.get(int(finish[s]), "length"),
                     accept_hist=hist[s])
            if side_h is not None:
                r.update(hits=int(side_h[0][s]), misses=int(side_h[1][s]),
                         sync_drafts=int(side_h[2]))
            out.append(r)
        return out

    def slot_metrics(self, slot) -> dict:
        """τ, acceptance histogram, rounds, tokens so far, and (async) hits and misses."""
        r = self.results([self._slot_index(slot)])[0]
        hist = r["accept_hist"]
        return dict(tau=M.tau_from_hist(hist), accept_hist=[int(x) for x in hist],
                    rounds=int(hist.sum()), n_out=len(r["token_ids"]), hits=r.get("hits"),
                    misses=r.get("misses"))
