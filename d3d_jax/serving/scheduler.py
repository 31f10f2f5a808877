"""Continuous batching around one :class:`~d3d_jax.decoding.contract.Decoder` (a ``SpecDecoder``).

One thread owns the decoder (JAX calls release the GIL, so the HTTP event loop stays responsive).
Each round it

1. frees the slots of cancelled requests (client gone, stop string matched) and drops cancelled
   requests still in the queue — a cancel takes effect at the next round;
2. admits queued requests into the slots it holds no request in (``prefill`` + ``insert``; first
   come, first served);
3. runs ``step()`` once for all active slots and hands each request its new tokens;
4. frees the slots whose request finished, and queues again (first in line) the requests the
   decoder preempted for lack of KV pages, as prompt + the tokens they got
   (:mod:`~d3d_jax.decoding.page_growth`): their clients see nothing but a pause.

Requests beyond the free slots wait in the queue (oversubscription queues, it does not fail), and
so does the first queued request while the decoder's free KV pages cannot hold it (a paged cache:
``can_admit``); first come, first served, so a long request is not passed over for ever.
Results go to a per-request ``sink(event)`` called on the scheduler thread; the HTTP layer's sink
forwards to its event loop.  :meth:`run_until_idle` drives the same rounds without a thread (the
evaluation harness's ``--concurrency``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable

from d3d_jax.decoding.contract import Decoder
from d3d_jax.serving.metrics import ServerMetrics

log = logging.getLogger("d3d_jax.serving")


@dataclasses.dataclass
class Event:
    """What one request receives: new tokens each round, then ``finished`` with the outcome."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # eos | stop | length | error | abort (the server shut down)
    metrics: dict | None = None  # on finish: tau, hit_rate, rounds, accepted, ttft_s, ...
    error: str | None = None
    logprobs: list | None = None  # per token (log-prob, alternatives) when the request asked


class QueueFull(RuntimeError):
    """More requests waiting for a slot than ``max_queue``: the HTTP layer answers 503."""


class Handle:
    """A submitted request.  ``cancel()`` is safe from any thread; the slot frees next round."""

    def __init__(self, rid: int, request: Any, sink: Callable[[Event], None], wake: Callable[[], None],
                 warmup: bool = False):
        self.id, self.request, self.sink = rid, request, sink
        self.warmup = warmup  # a start-up compile request: left out of every metric
        self._wake = wake
        self.cancelled = False
        self.done = False
        self.slot: int | None = None
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.n_out = self.rounds = self.accepted = self.hits = self.misses = 0
        self.token_ids: list[int] = []  # delivered so far (what a preempted request resumes from)
        self.original = request  # the request as submitted (``request`` changes when preempted)

    def cancel(self) -> None:
        if not self.done and not self.cancelled:
            self.cancelled = True
            self._wake()


def _request_metrics(h: Handle, slot_metrics: dict | None) -> dict:
    """τ and hit rate of one request: the decoder's own counts when it has them, else ours."""
    m = dict(slot_metrics or {})
    rounds = int(m.get("rounds", h.rounds) or 0)
    hits, misses = int(m.get("hits", h.hits) or 0), int(m.get("misses", h.misses) or 0)
    tau = m.get("tau")
    tau = float(tau) if tau is not None else ((h.accepted + h.rounds) / h.rounds if h.rounds else 0.0)
    now = time.perf_counter()
    hist = m.get("accept_hist")
    return {"tau": tau, "accept_hist": None if hist is None else [int(x) for x in hist], "hit_rate": hits / (hits + misses) if hits + misses else None,
            "rounds": rounds, "accepted_tokens": h.accepted, "hits": hits, "misses": misses,
            "modes": m.get("modes"),  # rounds per geometry: the request's mode mix
            "ttft_s": (h.t_first - h.t_submit) if h.t_first is not None else None,
            "latency_s": now - h.t_submit}


class Scheduler:
    def __init__(self, decoder: Decoder, *, metrics: ServerMetrics | None = None, max_queue: int = 4096,
                 idle_wait_s: float = 0.05):
        self.decoder = decoder
        self.metrics = metrics or ServerMetrics()
        self.max_queue = max_queue
        self.idle_wait_s = idle_wait_s
        self.num_slots = int(decoder.config.num_slots)
        self._queue: collections.deque[Handle] = collections.deque()
        self._active: dict[int, Handle] = {}  # slot -> handle (scheduler thread only)
        # slots held by a request, being prefilled or active: counted under the lock, because a
        # request popped for its prefill is in neither the queue nor _active for a while
        self._held = 0
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._draining = False  # shutting down: every request ends now, new ones are refused
        self.step_error: str | None = None  # the last round's failure; None once a round succeeds
        self.error: BaseException | None = None  # what killed the thread, if anything
        allow_preemption = getattr(decoder, "allow_preemption", None)
        if allow_preemption is not None:  # a paged decoder grows page by page; preempted requests come back here
            allow_preemption()

    # ---- any thread --------------------------------------------------------------------------
    def submit(self, request: Any, sink: Callable[[Event], None], warmup: bool = False) -> Handle:
        with self._cv:
            if self._draining:
                raise QueueFull("the server is shutting down")
            waiting = self._num_waiting()
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are already waiting for a slot (max_queue)")
            h = Handle(next(self._ids), request, sink, self._wake, warmup)
            self._queue.append(h)
            self._cv.notify()
        return h

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _num_waiting(self) -> int:
        """Queued requests that no free slot takes at the next round (the caller holds the lock):
        a request with a free slot is only waiting for the round, and ``max_queue`` bounds the
        ones that wait for another request to finish."""
        return max(0, len(self._queue) - (self.num_slots - self._held))

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """Running, and its last round (if any failed since) stepped: /health says 503 while
        every batch fails (a damaged program, a lost device), 200 again once one succeeds."""
        return self.alive and self.step_error is None

    def start(self) -> "Scheduler":
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="d3d-scheduler", daemon=True)
        self._thread.start()
        return self

    def drain(self) -> None:
        """Shutting down (SIGTERM, SIGINT): at the next round every running request finishes with
        ``finish_reason`` "abort" and the tokens it has, every queued one with none, so streams
        end with a final chunk and ``[DONE]`` and waiting clients get their response; new
        requests are refused (503)."""
        with self._cv:
            self._draining = True
            self._cv.notify()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- scheduler thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                if not self.run_round():
                    with self._cv:
                        if not self._stop and not self._queue:
                            self._cv.wait(self.idle_wait_s)
        except BaseException as e:  # a dead scheduler must not leave clients waiting forever
            log.exception("scheduler stopped")
            self.error = e
            self._fail_all(f"scheduler stopped: {type(e).__name__}: {e}")
            raise

    def run_until_idle(self, timeout_s: float | None = None) -> None:
        """Drive rounds on the calling thread until nothing is queued or active."""
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        while self.run_round() or self._queue:
            if t_end is not None and time.monotonic() > t_end:
                raise TimeoutError(f"requests still running after {timeout_s} s")

    def run_round(self) -> bool:
        """One scheduling round; False when there was nothing to decode."""
        self._reap_cancelled()
        if self._draining:
            self._abort_all()
            return False
        self._admit()
        if not self._active:
            return False
        t0 = time.perf_counter()
        try:
            outs = self.decoder.step()
        except Exception as e:  # noqa: BLE001 - reported to every request in the batch
            log.exception("decoder step failed")
            self.step_error = f"decoder step failed: {type(e).__name__}"
            # an OSError's text, not its path: the server's files are not the client's business
            detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:300]
            for slot in list(self._active):
                self._finish(slot, "error", error=f"decoder step failed: {type(e).__name__}: {detail}")
            return True
        self.step_error = None
        self._deliver(outs, time.perf_counter() - t0)
        self._requeue_preempted()
        self.metrics.decisions = self.decoder.decisions()  # a fresh copy each round: /metrics reads it
        return True

    def _reap_cancelled(self) -> None:
        with self._cv:
            if any(h.cancelled for h in self._queue):
                for h in [h for h in self._queue if h.cancelled]:
                    h.done = True
                    self.metrics.record_request("cancelled")
                self._queue = collections.deque(h for h in self._queue if not h.cancelled)
        for slot, h in list(self._active.items()):
            if h.cancelled:
                self._release(slot)
                self.metrics.record_request("cancelled")

    def _admit(self) -> None:
        free = [s for s in range(self.num_slots) if s not in self._active]  # the caller owns its slots
        while free:
            with self._cv:
                if not self._queue or not self._pages_hold(self._queue[0]):
                    return
                h = self._queue.popleft()
                self._held += 1
            try:
                prefix = self.decoder.prefill(h.request)
                slot = free.pop(0)
                self.decoder.insert(prefix, slot)
            except Exception as e:  # noqa: BLE001 - this request fails, the server goes on
                log.exception("prefill failed")
                with self._cv:
                    self._held -= 1
                h.done = True
                self.metrics.record_request("error")
                self._send(h, Event([], True, "error", error=f"prefill failed: {type(e).__name__}: {e}"))
                continue
            h.slot = slot
            self._active[slot] = h
            if not h.warmup and h.request is h.original:  # a resumed request was counted once
                self.metrics.record_admitted(len(h.request.prompt))

    def _pages_hold(self, h: Handle) -> bool:
        """Whether the decoder's free pages hold ``h``'s request now.  With nothing running every
        page is free: a request still not held then is one no pool holds, and its prefill is
        left to refuse it (an error event, not a wait for ever)."""
        can_admit = getattr(self.decoder, "can_admit", None)
        if can_admit is None or not self._active or h.cancelled:
            return True
        try:
            return bool(can_admit(h.request))
        except Exception:  # noqa: BLE001 - a malformed request: its prefill names the problem
            return True

    def kv_stats(self) -> dict | None:
        """The decoder's KV pool figures (/metrics), None for a dense cache."""
        page_stats = getattr(self.decoder, "page_stats", None)
        return page_stats() if page_stats is not None else None

    def _deliver(self, outs: dict, seconds: float) -> None:
        tokens = accepted = hits = misses = 0
        per_row = []
        for slot, out in outs.items():
            h = self._active.get(slot)
            if h is None:
                continue
            h.rounds += 1
            h.accepted += int(out.accepted)
            h.hits += out.hit is True
            h.misses += out.hit is False
            if not h.warmup:  # start-up compile requests stay out of the server's metrics
                hits += out.hit is True
                misses += out.hit is False
                accepted += int(out.accepted)
                tokens += len(out.token_ids)
                per_row.append(len(out.token_ids))
            if out.token_ids:
                h.t_first = h.t_first or time.perf_counter()
                h.n_out += len(out.token_ids)
                h.token_ids += out.token_ids
            if out.finished:
                self._finish(slot, out.finish_reason or "length", token_ids=list(out.token_ids),
                             logprobs=out.logprobs)
            elif out.token_ids and not h.cancelled:
                self._send(h, Event(list(out.token_ids), logprobs=out.logprobs))
        if per_row:
            self.metrics.record_round(len(per_row), tokens, accepted, hits, misses, seconds,
                                      per_row=per_row)

    def _requeue_preempted(self) -> None:
        take = getattr(self.decoder, "take_preempted", None)
        for slot in take() if take is not None else ():
            from d3d_jax.decoding.page_growth import resumed

            h = self._active.pop(slot)
            h.slot, h.request = None, resumed(h.original, h.token_ids)
            self.metrics.record_preemption()
            with self._cv:
                self._held -= 1
                self._queue.appendleft(h)

    def _finish(self, slot: int, reason: str, token_ids=(), error: str | None = None,
                logprobs: list | None = None) -> None:
        h = self._active[slot]
        try:
            sm = self.decoder.slot_metrics(slot) if error is None else None
        except Exception:  # noqa: BLE001 - metrics are best effort, the tokens are not
            sm = None
        self._release(slot)
        if not h.warmup:
            self.metrics.record_request(reason)
        if not h.cancelled:
            self._send(h, Event(list(token_ids), True, reason, _request_metrics(h, sm), error, logprobs))

    def _release(self, slot: int) -> None:
        h = self._active.pop(slot)
        h.done = True
        with self._cv:
            self._held -= 1
        try:
            self.decoder.free(slot)
        except Exception:  # noqa: BLE001
            log.exception("free(%d) failed", slot)

    def _send(self, h: Handle, ev: Event) -> None:
        try:
            h.sink(ev)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the batch
            log.exception("sink of request %d failed; cancelling it", h.id)
            h.cancelled = True

    def _abort_all(self) -> None:
        with self._cv:
            queued, self._queue = list(self._queue), collections.deque()
        for h in queued:
            h.done = True
            if not h.warmup:
                self.metrics.record_request("abort")
            self._send(h, Event([], True, "abort"))
        for slot in list(self._active):
            self._finish(slot, "abort")

    def _fail_all(self, message: str) -> None:
        with self._cv:
            queued, self._queue = list(self._queue), collections.deque()
        for h in queued + list(self._active.values()):
            h.done = True
            self._send(h, Event([], True, "error", error=message))
        self._active.clear()
        with self._cv:
            self._held = 0
