"""Per-round timing of async decoding (spec §5: draft/verify/idle time per round), as a hook of
the dispatch-only round loop: ``engine.generate(dec, prompts, hook=AsyncTimeline())``.

For every round the hook records when each dispatch returned and, from helper threads (off the
main thread), when each part's result was ready; :meth:`AsyncTimeline.finish` reads the per-row
hit/miss flags once at the end and turns the marks into one dict per round (``rounds``) and the
per-round means: verify, packed forward, synchronous draft, the host-induced gap between rounds,
and the share of the packed forward that overlapped the verify.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import jax

from d3d_jax.decoding.async_core import V_ACCEPTED, V_DRAFT_LEN, V_HIT, V_MISS


def _ready_at(x) -> float:
    jax.block_until_ready(x)
    return time.perf_counter()


class AsyncTimeline:
    """A ``hook(t_dispatch, t_dispatched, decision, drafts, view)`` for async rounds."""

    def __init__(self, shared: bool = True):
        self.shared = shared  # one device slice: the pack cannot start before the verify ends
        self.rounds: list[dict] = []
        self._marks: list[dict] = []
        self._pool = cf.ThreadPoolExecutor(max_workers=3)

    def __call__(self, td, t_dispatched, decision, drafts, view) -> None:
        self._marks.append(dict(dispatch=td, dispatched=t_dispatched, view=view,
                                verify=self._pool.submit(_ready_at, decision),
                                packed=self._pool.submit(_ready_at, drafts.tokens),
                                select=self._pool.submit(_ready_at, view),
                                verify_devices=decision.devices(),
                                packed_devices=drafts.tokens.devices()))

    def finish(self) -> dict:
        """Per-round means of the rounds seen since the last call (``rounds`` gets one dict each)."""
        marks, self._marks = self._marks, []
        self._pool.shutdown(wait=True)
        self._pool = cf.ThreadPoolExecutor(max_workers=3)
        return _summary(marks, self.rounds, self.shared)


def _one_round(k: int, marks: list[dict], v, prev_select: float, shared: bool):
    m = marks[k]
    tv, tp, ts = m["verify"].result(), m["packed"].result(), m["select"].result()
    start = max(m["dispatch"], prev_select)  # the verify needs the previous hand-off
    packed_start = max(m["dispatched"], prev_select, tv if shared else float("-inf"))
    # the packed forward's time while this round's verify was in flight (spec §5: hidden)
    overlap = max(0.0, min(tv, tp) - max(start, packed_start))
    sync = bool(v[:, V_MISS].any())
    sync_s = ts - max(tv, tp) if sync else 0.0
    gap = max(0.0, marks[k + 1]["dispatch"] - ts) if k + 1 < len(marks) else 0.0
    # (a small pack can be ready before its dispatch call returns: it then counts 0, not < 0)
    parts = dict(verify_s=tv - start, packed_s=max(0.0, tp - packed_start), sync_s=sync_s,
                 gap_s=gap, overlap_s=overlap)
    row = dict(verify_dispatch=m["dispatch"], verify_ready=tv, packed_dispatch=m["dispatch"],
               packed_dispatched=m["dispatched"], packed_ready=tp, select_ready=ts, sync_s=sync_s,
               gap_s=gap, overlap_s=overlap, sync_draft=sync, hit=v[:, V_HIT].astype(bool).tolist(),
               active=(v[:, 0] == 0).tolist(), accepted=v[:, V_ACCEPTED].tolist(),
               draft_len=v[:, V_DRAFT_LEN].tolist(), verify_devices=m["verify_devices"],
               packed_devices=m["packed_devices"])
    return parts, row, ts


def _summary(marks: list[dict], rounds: list, shared: bool) -> dict:
    views = jax.device_get([m["view"] for m in marks])
    totals = dict(verify_s=0.0, packed_s=0.0, sync_s=0.0, gap_s=0.0, overlap_s=0.0)
    prev_select, sync_rounds, gap_max = float("-inf"), 0, 0.0
    for k, v in enumerate(views):
        parts, row, prev_select = _one_round(k, marks, v, prev_select, shared)
        for key, val in parts.items():
            totals[key] += val
        gap_max = max(gap_max, parts["gap_s"])
        sync_rounds += row["sync_draft"]
        rounds.append(row)
    n = max(len(marks), 1)
    out = {f"round_{k}": v / n for k, v in totals.items()}
    devices = lambda key: sorted(str(d) for d in marks[0][key]) if marks else []  # noqa: E731
    out.update(round_gap_max_s=gap_max, sync_s=totals["sync_s"], packed_s=totals["packed_s"],
               verify_s=totals["verify_s"], overlap_s=totals["overlap_s"],
               overlap_fraction=totals["overlap_s"] / totals["packed_s"] if totals["packed_s"] > 0 else 0.0,
               span_s=(marks[-1]["select"].result() - marks[0]["dispatch"]) if marks else 0.0,
               draft_s=totals["packed_s"] + totals["sync_s"],
               verify_devices=devices("verify_devices"), packed_devices=devices("packed_devices"),
               sync_draft_s=totals["sync_s"] / sync_rounds if sync_rounds else 0.0)
    return out
