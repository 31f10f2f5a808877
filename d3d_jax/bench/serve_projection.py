"""``infer/bench.py serve --project COSTS.json``: the serve table *projected* for an accelerator
that is not here, from compiled round costs (``infer/bench.py compile``'s JSON) and simulated
acceptance.  Nothing runs: it is arithmetic on the compiler's roofline estimates.

Costs.  The compile JSON holds batch-1 programs (``plain step``: 1 target token; ``verify round
(async target side)``: B target tokens; ``sync round``: a drafter block forward plus that verify;
``branch pack, … drafter``: N_async drafter tokens; the selection).  Each program's ``roofline``
gives its seconds as max(flops / peak, bytes / bandwidth); weights are read once per forward
whatever the tokens, so a forward of ``t`` tokens is projected as
``max(flops_1·t / peak, (W + (bytes_1 − W)·t) / bandwidth)`` from a one-token point
(``bytes_1``, ``flops_1``) that the two target programs (1 and B tokens) and the two drafter
programs (the sync draft and the pack) fix.  A round of ``n`` requests feeds ``n·t`` tokens.

Rounds.  plain: target(n); sync b: drafter(n·2b) + target(n·b); async (C, F) on one device:
target(n·B) + drafter(n·N_async) + (1 − h)·drafter(n·2B) (no overlap on one chip; on two,
``--project-devices 2`` takes the max of the first two).  Tokens per round per request:
``1 + Σ_{k<w} c^k`` with ``c`` the per-slot acceptance of ``--tau`` at B (geometric), as
auto's own prior.  Auto = the best geometry at each load (what its policy picks with exact
costs): a projection of the choice, not a measurement of it.
"""

from __future__ import annotations

import json
from pathlib import Path

from d3d_jax.decoding.auto_policy import geometric_rate

SYNC_BLOCKS = (4, 8, 16)
ASYNC = ((4, 2), (12, 2))


class Forward:
    """Seconds of a forward of ``t`` tokens from a one-token point and the weights' bytes."""

    def __init__(self, weights: float, bytes_1: float, flops_1: float, peak: float, bw: float):
        self.w, self.b1, self.f1, self.peak, self.bw = weights, bytes_1, flops_1, peak, bw

    def __call__(self, tokens: float) -> float:
        return max(self.f1 * tokens / self.peak, (self.w + (self.b1 - self.w) * tokens) / self.bw)


def _program(progs: list[dict], name: str) -> dict:
    hit = [p for p in progs if p.get("program", "").startswith(name) and p.get("compiled")]
    if not hit:
        raise SystemExit(f"error: the compile JSON has no compiled program {name!r} "
                         f"(has: {sorted({p.get('program') for p in progs})})")
    return hit[0]


def _device(p: dict) -> tuple[float, float]:
    """(peak flop/s, bytes/s) implied by a program's roofline."""
    r = p["roofline"]
    return p["flops"] / r["flops_s"], p["bytes"] / r["bytes_s"]


def _line(p1: dict, t1: float, p2: dict, t2: float, weights: float) -> tuple[float, float]:
    """One-token (bytes, flops) of the line through two programs of t1 and t2 tokens."""
    b_per = (p2["bytes"] - p1["bytes"]) / (t2 - t1)
    f_per = (p2["flops"] - p1["flops"]) / (t2 - t1)
    return weights + max(b_per, 0.0), max(f_per, 0.0)


def forwards(progs: list[dict], block: int, budget: int) -> tuple[Forward, Forward]:
    """(target, drafter) forward models from the compiled programs."""
    plain, verify = _program(progs, "plain step"), _program(progs, "verify round")
    peak, bw = _device(verify)
    tw = plain["facts"]["target_weights_bytes"]
    target = Forward(tw, *_line(plain, 1, verify, block, tw), peak, bw)
    pack = _program(progs, "branch pack")
    dw = pack["facts"]["drafter_weights_bytes"]
    try:  # the sync round's drafter part: its block forward of 2B tokens (uncached + block)
        sync = _program(progs, "sync round")
        draft = dict(bytes=sync["bytes"] - verify["bytes"] + tw, flops=sync["flops"] - verify["flops"])
        b1, f1 = _line(draft, 2 * block, pack, budget, dw)
    except SystemExit:  # no sync round compiled: the pack alone, weights read once
        b1, f1 = dw + (pack["bytes"] - dw) / budget, pack["flops"] / budget
    return target, Forward(dw, b1, f1, peak, bw)


def project(costs_path: str, levels: list[int], tau: float, hit_rate: float, block: int = 16,
            devices: int = 1) -> dict:
    progs = json.loads(Path(costs_path).read_text())["programs"]
    budgets = {cf: block * ((cf[0] - 1) * cf[1] + 2) for cf in ASYNC}
    target, drafter = forwards(progs, block, budgets[(12, 2)])
    c = geometric_rate(tau, block)
    tokens = lambda w: 1 + sum(c ** k for k in range(1, w))  # noqa: E731

    def rounds(n: int) -> dict[str, tuple[float, float]]:
        out = {"plain": (1.0, target(n))}
        for b in SYNC_BLOCKS:
            out[f"sync/{b}"] = (tokens(b), drafter(2 * b * n) + target(b * n))
        for (cc, f), nb in budgets.items():
            parts = (target(block * n), drafter(nb * n))
            both = max(parts) if devices > 1 else sum(parts)
            out[f"async/{cc}x{f}"] = (tokens(block), both + (1 - hit_rate) * drafter(2 * block * n))
        return out

    table = {}
    for n in levels:
        rates = {g: n * t / s for g, (t, s) in rounds(n).items()}
        fixed = {"plain": rates["plain"], "sync": rates[f"sync/{block}"], "async": rates["async/12x2"]}
        best = max(rates, key=rates.get)
        table[str(n)] = dict(tokens_per_s=dict(fixed, auto=rates[best]), auto_picks=best,
                             tpot_ms={g: 1e3 / (r / n) for g, r in dict(fixed, auto=rates[best]).items()})
    return dict(costs=str(costs_path), device=progs[0].get("device"), tau=tau, hit_rate=hit_rate,
                devices=devices, levels=table, projection=True)


def markdown(p: dict, levels: list[int]) -> str:
    modes = ("plain", "sync", "async", "auto")
    rows = [f"**Projection** (not measured): {p['device']}, from `{p['costs']}`, simulated τ = {p['tau']} "
            f"at B = 16, hit rate {p['hit_rate']}, {p['devices']} device(s)", "",
            "| method | " + " | ".join(f"@{c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for m in modes[1:]:
        rows.append(f"| {m} | " + " | ".join(
            f"{p['levels'][str(c)]['tokens_per_s'][m] / p['levels'][str(c)]['tokens_per_s']['plain']:.2f}×"
            for c in levels) + " |")
    rows.append("| auto picks | " + " | ".join(p["levels"][str(c)]["auto_picks"] for c in levels) + " |")
    rows += ["", "| mode | " + " | ".join(f"tok/s @{c} | TPOT ms @{c}" for c in levels) + " |",
             "|---|" + "---|" * (2 * len(levels))]
    for m in modes:
        rows.append(f"| {m} | " + " | ".join(
            f"{p['levels'][str(c)]['tokens_per_s'][m]:.0f} | {p['levels'][str(c)]['tpot_ms'][m]:.2f}"
            for c in levels) + " |")
    return "\n".join(rows)
