"""Stage 7: online τ of every drafter, the pruned ones included, at the trained block size on the
held-out suites: greedy sync decoding with the target, each output checked against plain.

τ of greedy decoding depends on the weights alone, not on the machine, so it is measured once,
while all the weights exist, and shipped (``out_dir/online_tau.json``); the benchmark (stage 8)
times only the drafters that ship."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from d3d_jax.pipeline import measure
from d3d_jax.pipeline.common import log, write_json
from d3d_jax.pipeline.context import Context
from d3d_jax.pipeline.prune import pruned_names

KEPT = ("tau", "rounds", "new_tokens", "equals_plain", "mismatched_outputs", "accept_histogram")


def candidates(p: Context) -> dict[str, Path | None]:
    """Every drafter's weights (None where they are gone, as in a fresh clone)."""
    out: dict[str, Path | None] = {v.name: p.weights_dir(v.name) for v in p.cfg.drafters}
    for name, export in pruned_names(p).items():
        hf = Path(export) / "hf" if export else None
        out[name] = hf if hf is not None and (hf / "model.safetensors").exists() else None
    return out


def _existing(p: Context) -> dict:
    if not p.online_path.exists():
        return {}
    return json.loads(p.online_path.read_text()).get("drafters", {})


def measured(p: Context) -> bool:
    """Done when every drafter whose weights exist has a row (none can be added without them)."""
    have = _existing(p)
    return p.online_path.exists() and all(n in have or w is None for n, w in candidates(p).items())


def measure_online(p: Context) -> None:
    c = p.cfg
    have = _existing(p)
    todo = {n: w for n, w in candidates(p).items() if n not in have and w is not None}
    target = p.load(p.model_dir("target"))
    suites = measure.suites(p)
    settings = dataclasses.replace(measure.eval_settings(p, has_async=False), block_size=c.block_size,
                                   drafter_share_samples=0)
    plain = measure.plain_runs(p, target, suites, settings)
    for name, weights in todo.items():
        summ = measure.sync_against(p, target, p.load(weights), suites, settings, plain)
        have[name] = {s: {k: summ[s].get(k) for k in KEPT} for s in suites}
        log(f"online τ at B = {c.block_size}, {name}: "
            + ", ".join(f"{s} {have[name][s]['tau']:.2f}" for s in suites))
        write_json({"block_size": c.block_size, "max_new_tokens": c.eval_max_new_tokens,
                    "samples": {s: len(v) for s, v in suites.items()}, "drafters": have}, p.online_path)
    if not p.online_path.exists():  # nothing had weights: record that the stage ran
        write_json({"block_size": c.block_size, "samples": {}, "drafters": have}, p.online_path)
