"""The async round loop: the host only dispatches (spec §5): rounds never wait for the host.

Round k+1's verify and branch pack are dispatched right behind round k's: everything a round
needs (the hand-off block, the decision, the drafter state) stays on the devices.  The host reads
one small array (the round's decision: done flags and anchors) every :data:`STOP_CHECK_EVERY`
rounds — always of the round *before* the one it just dispatched, so the device queue is never
empty while it waits — and stops once every row is done.  Reads come sooner only when the
progress measured so far says every row may be done sooner, so few no-op rounds (a done row
commits nothing) follow the last row's end.

``hook(t_dispatch, t_dispatched, decision, drafts, view)``, when given, sees every round's
device arrays as they are dispatched (``d3d_jax.bench.timeline`` times the parts from them).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import numpy as np

from d3d_jax.decoding.async_core import D_ANCHOR, D_DONE

STOP_CHECK_EVERY = 4  # rounds between two reads of the done flags


@dataclasses.dataclass
class LiveRows:
    """The host's view of the running rows (row indices of the state): where each started, how
    many tokens it may and did produce."""

    rows: np.ndarray  # [n] int
    first_anchor: np.ndarray  # [n] anchor at insert: prompt length - 1
    max_new: np.ndarray  # [n]
    n_out: np.ndarray  # [n]

    def shifted(self, start: int, width: int) -> "LiveRows":
        """The same rows, indexed within a window starting at ``start``."""
        inside = (self.rows >= start) & (self.rows < start + width)
        return LiveRows(self.rows[inside] - start, self.first_anchor[inside],
                        self.max_new[inside], self.n_out[inside])


class _StopCheck:
    """Which round's decision to read next: :data:`STOP_CHECK_EVERY` rounds on, or sooner when
    every running row may have finished sooner at the pace (tokens per round) it has kept."""

    def __init__(self, live: LiveRows):
        self.live = live
        self.n_out = live.n_out.astype(np.int64).copy()
        self.round = -1

    def next(self, r: int, decision: np.ndarray) -> int | None:
        """After reading round ``r``'s decision: None once every row is done."""
        live = self.live
        running = decision[live.rows, D_DONE] == 0
        if not running.any():
            return None
        rows = live.rows[running]
        n_out = decision[rows, D_ANCHOR] - live.first_anchor[running]
        pace = np.maximum((n_out - self.n_out[running]) / (r - self.round), 1.0)
        rounds_left = int(np.ceil((live.max_new[running] - n_out) / pace).max())
        self.round = r
        self.n_out[running] = n_out
        return r + min(max(rounds_left, 1), STOP_CHECK_EVERY)


def run_rounds(dispatch: Callable, live: LiveRows, max_rounds: int, hook: Callable | None = None,
               wait: Callable | None = None) -> dict:
    """Call ``dispatch() -> (decision, drafts, view)`` until every row of ``live`` is done;
    returns the loop's host-side metrics."""
    stop, read_round, reads = _StopCheck(live), 0, 0
    pending, rounds, wait_s = None, 0, 0.0
    t0, host0 = time.perf_counter(), time.thread_time()
    try:
        for r in range(max_rounds):  # every round commits >= 1 token per active row
            td = time.perf_counter()
            decision, drafts, view = dispatch()
            rounds += 1
            if hook is not None:
                hook(td, time.perf_counter(), decision, drafts, view)
            if pending is not None:  # the previous round's: the queue holds this one
                tw = time.perf_counter()
                read_round = stop.next(r - 1, jax.device_get(pending))
                wait_s += time.perf_counter() - tw
                pending, reads = None, reads + 1
                if read_round is None:
                    break
            if r == read_round:
                pending = decision
                decision.copy_to_host_async()
    finally:
        host_s = time.thread_time() - host0
        if wait is not None:
            wait()
        loop_s = time.perf_counter() - t0
    return dict(async_rounds=rounds, done_reads=reads, round_host_s=host_s / max(rounds, 1),
                loop_s=loop_s, wait_s=wait_s, round_wait_s=wait_s / max(rounds, 1))
