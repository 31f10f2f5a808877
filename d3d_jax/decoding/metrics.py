"""Decoding metrics (spec §0, §6): τ per request and overall, acceptance histogram over 1..B,
per-slot acceptance rate, tokens/s, and time spent drafting and verifying.

Inputs are host numpy arrays produced by the engine: ``accept_hist[i]`` counts the rounds whose
acceptance length τ = a + 1 was ``i + 1`` (so its length is the block size B).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np


def tally_round(tally, part, tokens: int, seconds: float | None) -> None:
    """Count one round's part into its geometry's counters (``decoder.decisions()``): rounds,
    tokens and the tokens auto predicted, and its rows by auto's reason (``rows:<reason>``); with ``seconds`` (the round was timed and had this one
    part) also timed rounds, their seconds and the seconds auto predicted.  A prediction of inf (a
    program auto never timed: no warm-up) leaves the round untimed."""
    tally.update(rounds=1, tokens=tokens, predicted_tokens=part.predicted or 0.0,
                 gated_rounds=int(part.gated))
    tally.update(f"rows:{reason}" for reason in part.row_reasons)  # auto's row decisions
    predicted_s = part.predicted_s or 0.0
    if seconds is not None and math.isfinite(predicted_s):
        tally.update(timed_rounds=1, seconds=seconds, predicted_seconds=predicted_s)


def row_logprobs(row: dict, n: int, top: int) -> list | None:
    """One row's emitted tokens' log-probabilities (and ``top`` alternatives) from a round read
    (None when the request asked for none: ``top < 0``)."""
    if top < 0:
        return None
    return [(float(row["logprob"][k]),
             [(int(i), float(lp)) for i, lp in zip(row["top_ids"][k, :top], row["top_logprobs"][k, :top])])
            for k in range(n)]


def tau_from_hist(hist: np.ndarray) -> float:
    hist = np.asarray(hist, np.float64)
    rounds = hist.sum()
    return float((hist * np.arange(1, hist.shape[-1] + 1)).sum() / rounds) if rounds else float("nan")


def slot_accept_rate(hist: np.ndarray) -> list[float]:
    """P(draft slot k is accepted) for k = 1..B-1: the fraction of rounds with a >= k."""
    hist = np.asarray(hist, np.float64)
    rounds = hist.sum()
    if not rounds:
        return [float("nan")] * (hist.shape[-1] - 1)
    at_least = hist[::-1].cumsum()[::-1]  # at_least[i] = rounds with a >= i
    return [float(x) for x in at_least[1:] / rounds]


def request_metrics(hist: np.ndarray, num_tokens: int, wall_s: float, *, mode: str,
                    batch_index: int = 0, draft_s: float | None = None,
                    verify_s: float | None = None, cpu_s: float | None = None,
                    compile_s: float | None = None) -> dict:
    """Metrics of one request; ``wall_s`` is the decode time of the batch it ran in."""
    hist = np.asarray(hist, np.int64)
    return {
        "mode": mode,
        "num_tokens": int(num_tokens),
        "rounds": int(hist.sum()),
        "tau": tau_from_hist(hist),
        "accept_hist": [int(x) for x in hist],
        "slot_accept_rate": slot_accept_rate(hist),
        "batch_index": int(batch_index),
        "batch_wall_s": float(wall_s),
        "tokens_per_s": float(num_tokens / wall_s) if wall_s > 0 else float("nan"),
        "draft_s": draft_s,
        "verify_s": verify_s,
        "batch_cpu_s": cpu_s,  # process CPU time of the batch's decode; None when it compiled
        "compile_s": compile_s,
    }


def summarize(per_request: Iterable[Mapping], total_wall_s: float | None = None) -> dict:
    """Overall metrics over requests: pooled histogram, τ over all rounds, tokens and tokens/s.

    ``total_wall_s`` (end-to-end time of all batches) defaults to the sum of distinct batch times.
    """
    reqs = list(per_request)
    if not reqs:
        return {"requests": 0}
    width = max(len(r["accept_hist"]) for r in reqs)
    hist = np.zeros(width, np.int64)
    for r in reqs:
        hist[: len(r["accept_hist"])] += np.asarray(r["accept_hist"], np.int64)
    tokens = sum(int(r["num_tokens"]) for r in reqs)
    if total_wall_s is None:
        total_wall_s = float(sum({r.get("batch_index", 0): r["batch_wall_s"] for r in reqs}.values()))
    out = {
        "requests": len(reqs),
        "num_tokens": tokens,
        "rounds": int(hist.sum()),
        "tau": tau_from_hist(hist),
        "tau_per_request_mean": float(np.nanmean([r["tau"] for r in reqs])),
        "accept_hist": [int(x) for x in hist],
        "slot_accept_rate": slot_accept_rate(hist),
        "wall_s": float(total_wall_s),
        "tokens_per_s": float(tokens / total_wall_s) if total_wall_s else float("nan"),
    }
    for key in ("draft_s", "verify_s", "compile_s"):  # per batch, like the wall time (compile: apart from it)
        vals = {r.get("batch_index", 0): r[key] for r in reqs if r.get(key) is not None}
        out[key] = float(sum(vals.values())) if vals else None
    return out
