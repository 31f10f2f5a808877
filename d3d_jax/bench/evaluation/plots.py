"""PNG plots of an evaluation: acceptance histogram, τ per slot, hit rate and speedup vs async budget."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure


def _figure(figsize: tuple[float, float]):
    """A figure and its axes, outside pyplot: no process-wide backend or figure registry to touch."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


def _save(fig, path: str | Path) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def acceptance_histogram(results: Mapping[str, Mapping[str, dict]], path: str | Path,
                         mode: str = "sync") -> str:
    """Fraction of rounds per acceptance length τ = 1..B, one bar group per benchmark."""
    benches = [b for b in results if results[b].get(mode, {}).get("accept_histogram")]
    fig, ax = _figure((8, 4))
    width = 0.8 / max(len(benches), 1)
    for i, b in enumerate(benches):
        h = np.asarray(results[b][mode]["accept_histogram"], float)
        x = np.arange(1, len(h) + 1)
        ax.bar(x + (i - (len(benches) - 1) / 2) * width, h / max(h.sum(), 1), width,
               label=f"{b} (τ={results[b][mode]['tau']:.2f})")
    ax.set_xlabel("acceptance length τ per round")
    ax.set_ylabel("fraction of rounds")
    ax.set_title(f"Acceptance histogram ({mode})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def tau_per_slot(results: Mapping[str, Mapping[str, dict]], path: str | Path, mode: str = "sync") -> str:
    """P(draft slot k accepted), k = 1..B-1: how far into the block the drafter stays right."""
    fig, ax = _figure((7, 4))
    for b, modes in results.items():
        rate = modes.get(mode, {}).get("slot_accept_rate")
        if rate:
            ax.plot(np.arange(1, len(rate) + 1), rate, marker="o", label=b)
    ax.set_xlabel("draft slot k")
    ax.set_ylabel("P(slot k accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Per-slot acceptance ({mode})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def budget_sweep(sweep: Sequence[dict], path: str | Path) -> str:
    """Hit rate and async speedup against the branch budget N_async = B·[(C-1)·F + 2]."""
    pts = sorted(sweep, key=lambda r: r["budget"])
    fig, ax1 = _figure((7, 4))
    x = [p["budget"] for p in pts]
    ax1.plot(x, [p.get("hit_rate", np.nan) for p in pts], "o-", color="tab:blue", label="hit rate")
    ax1.set_xlabel("async budget N_async (tokens per packed draft forward)")
    ax1.set_ylabel("hit rate", color="tab:blue")
    ax1.set_ylim(0, 1.02)
    ax2 = ax1.twinx()
    ax2.plot(x, [p.get("speedup", np.nan) for p in pts], "s--", color="tab:red", label="speedup")
    ax2.set_ylabel("speedup over plain", color="tab:red")
    for p in pts:
        ax1.annotate(f"C={p['C']},F={p['F']}", (p["budget"], p.get("hit_rate", 0) or 0), fontsize=7,
                     textcoords="offset points", xytext=(3, 4))
    ax1.set_title("Async drafting: hit rate and speedup vs budget")
    return _save(fig, path)


def tau_bars(rows: Sequence[tuple[str, float]], path: str | Path, title: str) -> str:
    """One bar per drafter variant (ablations)."""
    fig, ax = _figure((7, 3.5))
    names = [r[0] for r in rows]
    ax.bar(names, [r[1] for r in rows], color="tab:green")
    for i, (_, v) in enumerate(rows):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("τ")
    ax.set_title(title)
    for label in ax.get_xticklabels():
        label.set(rotation=15, ha="right", fontsize=8)
    return _save(fig, path)
