"""The async round loop: the host only dispatches (spec §5; issue 16, "rounds that never wait").

Round k+1's verify and branch pack are dispatched right behind round k's: everything a round
needs (the hand-off block, the decision, the drafter state) stays on the devices.  The host reads
one small array (the round's decision: done flags and anchors) every :data:`STOP_CHECK_EVERY`
rounds — always of the round *before* the one it just dispatched, so the device queue is never
empty while it waits — and stops once every row is done.  Reads come sooner only when the
progress measured so far says every row may be done sooner, so few no-op rounds (a done row
commits nothing) follow the last row's end.

With ``timeline`` (a list) the loop also records, per round, when each dispatch returned and (from
helper threads, off the main thread) when its result was ready, plus per-row hit/miss flags read
once at the end.  Per-round means and the host-induced gap between rounds come from those.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import jax
import numpy as np

from d3d_jax.decoding.async_core import D_ANCHOR, D_DONE, V_ACCEPTED, V_DRAFT_LEN, V_HIT, V_MISS

STOP_CHECK_EVERY = 4  # rounds between two reads of the done flags


def _ready_at(x) -> float:
    jax.block_until_ready(x)
    return time.perf_counter()


class _StopCheck:
    """Which round's decision to read next: :data:`STOP_CHECK_EVERY` rounds on, or sooner when
    every running row may have finished sooner at the pace (tokens per round) it has kept."""

    def __init__(self, dec):
        n = dec.config.num_slots
        self.running = np.asarray(dec._running())
        self.first_anchor = np.zeros(n, np.int64)  # anchor at insert: prompt length - 1
        self.max_new, self.n_out = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for s in self.running:
            info = dec._slots[s]
            self.first_anchor[s] = len(info.request.prompt) - 1
            self.max_new[s], self.n_out[s] = info.request.max_new_tokens, info.n_out
        self.round = -1

    def next(self, r: int, decision: np.ndarray) -> int | None:
        """After reading round ``r``'s decision: None once every row is done."""
        rows = self.running[decision[self.running, D_DONE] == 0]
        if rows.size == 0:
            return None
        n_out = decision[rows, D_ANCHOR] - self.first_anchor[rows]
        pace = np.maximum((n_out - self.n_out[rows]) / (r - self.round), 1.0)
        rounds_left = int(np.ceil((self.max_new[rows] - n_out) / pace).max())
        self.round, self.n_out[rows] = r, n_out
        return r + min(max(rounds_left, 1), STOP_CHECK_EVERY)


def run_rounds(dec, max_rounds: int, timeline: list | None = None) -> dict:
    """Dispatch async rounds of ``dec`` until every row is done; returns the batch's metrics."""
    pool = cf.ThreadPoolExecutor(max_workers=3) if timeline is not None else None
    marks: list[dict] = []
    stop, read_round, reads = _StopCheck(dec), 0, 0
    pending, rounds, wait_s = None, 0, 0.0
    t0, host0 = time.perf_counter(), time.thread_time()
    try:
        for r in range(max_rounds):  # every round commits >= 1 token per active row
            td = time.perf_counter()
            decision, drafts, view, _ = dec.dispatch_async_round()
            rounds += 1
            if pool is not None:
                marks.append(dict(dispatch=td, dispatched=time.perf_counter(), view=view,
                                  verify=pool.submit(_ready_at, decision),
                                  packed=pool.submit(_ready_at, drafts.tokens),
                                  select=pool.submit(_ready_at, view),
                                  verify_devices=decision.devices(),
                                  packed_devices=drafts.tokens.devices()))
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
        jax.block_until_ready(dec._hand)
        loop_s = time.perf_counter() - t0
        if pool is not None:
            pool.shutdown(wait=True)
    metrics = dict(async_rounds=rounds, done_reads=reads, round_host_s=host_s / max(rounds, 1),
                   loop_s=loop_s,
                   wait_s=wait_s, round_wait_s=wait_s / max(rounds, 1), n_async=dec.config.layout.budget,
                   branch_positions=dec.config.branch_positions, branch_fanout=dec.config.branch_fanout)
    if pool is not None:
        metrics.update(_timeline(marks, timeline, dec.shared))
    return {"metrics": metrics, "draft_s": metrics.get("draft_s"), "verify_s": metrics.get("verify_s")}


def _timeline(marks: list[dict], timeline: list, shared: bool) -> dict:
    """Fill ``timeline`` (one dict per round) and return per-round means of the parts."""
    views = jax.device_get([m["view"] for m in marks])
    totals = dict(verify_s=0.0, packed_s=0.0, sync_s=0.0, gap_s=0.0, gap_max_s=0.0, overlap_s=0.0)
    prev_select = float("-inf")
    sync_rounds = 0
    for k, (m, v) in enumerate(zip(marks, views)):
        tv, tp, ts = m["verify"].result(), m["packed"].result(), m["select"].result()
        start = max(m["dispatch"], prev_select)  # the verify needs the previous hand-off
        packed_start = max(m["dispatched"], prev_select, tv if shared else float("-inf"))
        # the packed forward's time while this round's verify was in flight (spec §5: hidden)
        overlap = max(0.0, min(tv, tp) - max(start, packed_start))
        sync = bool(v[:, V_MISS].any())
        sync_s = ts - max(tv, tp) if sync else 0.0
        gap = max(0.0, marks[k + 1]["dispatch"] - ts) if k + 1 < len(marks) else 0.0
        totals["verify_s"] += tv - start
        # (a small pack can be ready before its dispatch call returns: it then counts 0, not < 0)
        totals["packed_s"] += max(0.0, tp - packed_start)
        totals["sync_s"] += sync_s
        totals["gap_s"] += gap
        totals["overlap_s"] += overlap
        totals["gap_max_s"] = max(totals["gap_max_s"], gap)
        sync_rounds += sync
        prev_select = ts
        timeline.append(dict(
            verify_dispatch=m["dispatch"], verify_ready=tv, packed_dispatch=m["dispatch"],
            packed_dispatched=m["dispatched"], packed_ready=tp, select_ready=ts, sync_s=sync_s,
            gap_s=gap, overlap_s=overlap, sync_draft=sync, hit=v[:, V_HIT].astype(bool).tolist(),
            active=(v[:, 0] == 0).tolist(), accepted=v[:, V_ACCEPTED].tolist(),
            draft_len=v[:, V_DRAFT_LEN].tolist(), verify_devices=m["verify_devices"],
            packed_devices=m["packed_devices"]))
    n = max(len(marks), 1)
    out = {f"round_{k}": v / n for k, v in totals.items() if k != "gap_max_s"}
    out.update(round_gap_max_s=totals["gap_max_s"], sync_s=totals["sync_s"],
               packed_s=totals["packed_s"], verify_s=totals["verify_s"], overlap_s=totals["overlap_s"],
               overlap_fraction=totals["overlap_s"] / totals["packed_s"] if totals["packed_s"] > 0 else 0.0,
               span_s=(marks[-1]["select"].result() - marks[0]["dispatch"]) if marks else 0.0,
               draft_s=totals["packed_s"] + totals["sync_s"],
               verify_devices=sorted(str(d) for d in marks[0]["verify_devices"]) if marks else [],
               packed_devices=sorted(str(d) for d in marks[0]["packed_devices"]) if marks else [],
               sync_draft_s=totals["sync_s"] / sync_rounds if sync_rounds else 0.0)
    return out

