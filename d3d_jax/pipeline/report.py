"""The benchmark's report: ``results.json``, the Markdown tables (Table 1, the ablations with
their seeds, pruning by depth and rule, drafting latency by depth) and the plots."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from d3d_jax.bench.evaluation import benchmarks as B
from d3d_jax.bench.evaluation import plots
from d3d_jax.pipeline.context import Context


def flattening(curve: list[dict], steps: int) -> float | None:
    """Relative fall of the dev loss over the last 20 % of steps, read from a least-squares line
    through every eval from the one nearest 80 % of the steps to the end (two evals alone when
    there are no more). One eval to the next moves by about 2 % on the demo's dev set, as much
    as the fall it measures, so two single evals decide nothing."""
    pts = [c for c in curve if c.get("dev_loss") is not None]
    if len(pts) < 2:
        return None
    at = min(range(len(pts)), key=lambda i: abs(pts[i]["step"] - 0.8 * steps))
    tail = pts[at:] if len(pts) - at >= 2 else pts[-2:]
    x = np.array([c["step"] for c in tail], float)
    y = np.array([c["dev_loss"] for c in tail], float)
    slope, intercept = np.polyfit(x, y, 1)
    start = slope * x[0] + intercept
    return float(slope * (x[0] - x[-1]) / start)


def _online(built: dict, name: str, suites: list[str]) -> list[float | None]:
    rows = built.get("online_tau", {}).get("drafters", {})
    return [(rows.get(name, {}).get(s) or {}).get("tau") for s in suites]


def _f(x, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def ablation_rows(built: dict, suites: list[str]) -> list[dict]:
    out = []
    for name, r in built.get("drafters", {}).items():
        v = r["variant"]
        seed = r.get("seed", v.get("seed") or 0)  # older result.json files keep it in variant
        out.append({"name": name, "init": v["init"], "ar_weight": v["ar_weight"], "seed": seed,
                    "steps": r["steps"], "offline_tau": r["offline_tau_dev"]["tau"],
                    "online": _online(built, name, suites), "flattening": flattening(r.get("curve", []), r["steps"])})
    return out


def ablation_table(built: dict, suites: list[str]) -> str:
    b = built.get("online_tau", {}).get("block_size", "?")
    head = ("| Drafter | init | λ | seed | steps | offline τ (dev) | "
            + " | ".join(f"{s} τ (B = {b})" for s in suites) + " | dev loss, last 20 % of steps |")
    lines = [head, "|" + "---|" * (7 + len(suites))]
    for r in ablation_rows(built, suites):
        lines.append(f"| {r['name']} | {r['init']} | {r['ar_weight']} | {r['seed']} | {r['steps']} | "
                     f"{r['offline_tau']:.2f} | " + " | ".join(_f(t) for t in r["online"])
                     + " | " + ("–" if r["flattening"] is None else f"{-100 * r['flattening']:+.1f} %") + " |")
    return (f"**Drafters and ablations** (online τ: greedy sync decoding at the trained B = {b})\n"
            + "\n".join(lines))


def arm_table(built: dict, suites: list[str]) -> str:
    """Mean and the individual seeds of each (init, λ) arm trained at the same budget."""
    arms: dict[tuple, list[dict]] = {}
    for r in ablation_rows(built, suites):
        arms.setdefault((r["init"], r["ar_weight"], r["steps"]), []).append(r)
    lines = ["| arm (init, λ, steps) | seeds | offline τ: mean (seeds) | "
             + " | ".join(f"{s} τ: mean (seeds)" for s in suites) + " |", "|" + "---|" * (3 + len(suites))]
    for (init, lam, steps), rs in arms.items():
        def cell(vals):
            vals = [v for v in vals if v is not None]
            return f"{np.mean(vals):.2f} ({', '.join(f'{v:.2f}' for v in vals)})" if vals else "–"
        lines.append(f"| {init}, λ = {lam}, {steps} | {len(rs)} | {cell([r['offline_tau'] for r in rs])} | "
                     + " | ".join(cell([r["online"][i] for r in rs]) for i in range(len(suites))) + " |")
    return "**Ablation arms**\n" + "\n".join(lines)


def pruning_table(built: dict, suites: list[str]) -> str | None:
    pr = built.get("pruning")
    if not pr:
        return None
    src, tau0 = pr["source"], pr["initial_offline_tau"]
    online0 = _online(built, src, suites)
    lines = ["| depth | rule | layers removed | offline τ | of unpruned | "
             + " | ".join(f"{s} τ (of unpruned)" for s in suites) + " | τ rise, 2nd half of recovery |",
             "|" + "---|" * (6 + len(suites)),
             f"| {pr['initial_depth']} | unpruned | – | {tau0:.2f} | 100 % | "
             + " | ".join(_f(t) for t in online0) + " | – |"]
    for row in pr["depths"]:
        for rule in ("acceptance", "shortgpt"):
            line = row[rule]
            removed = sorted(set(range(pr["initial_depth"])) - set(line["layers"]))
            onl = _online(built, f"{src}_{rule}_{row['depth']}", suites)
            cells = [f"{_f(t)} ({_f(None if t is None or not t0 else 100 * t / t0, '.0f')} %)"
                     for t, t0 in zip(onl, online0)]
            lines.append(f"| {row['depth']} | {'τ-guided' if rule == 'acceptance' else 'ShortGPT'}"
                         f"{' (same layers)' if line['shared'] else ''} | {removed} | {line['offline_tau']:.2f} | "
                         f"{100 * line['retention']:.1f} % | " + " | ".join(cells)
                         + f" | {_f(line['rise_second_half'], '+.3f')} |")
    return (f"**Pruning `{src}`** ({pr['recover_steps_per_round']} recovery steps per removed layer, "
            "both rules)\n" + "\n".join(lines))


def latency_table(lat: dict | None) -> str | None:
    if not lat:
        return None
    lines = ["| drafter depth | drafting forward (ms) | in plain target steps |", "|---|---|---|"]
    for d, ms in lat["depth_ms"].items():
        lines.append(f"| {d} | {ms:.2f} | {lat['depth_in_plain_steps'][d]:.2f} |")
    m = lat["main_drafter"]
    lines.append(f"| `{m['name']}` ({m['layers']} layers, hidden {m['hidden']}) | {m['ms']:.2f} | "
                 f"{m['ms'] / lat['plain_step_ms']:.2f} |")
    tail = (f"\nplain target step (1 token): {lat['plain_step_ms']:.2f} ms; saving per removed layer "
            f"{lat.get('saving_ms_per_layer', float('nan')):.2f} ms "
            f"({100 * lat.get('saving_per_layer_fraction', float('nan')):.1f} % of the unpruned drafter)")
    return (f"**Drafting-forward latency by depth** (batch 1, B = {lat['block']}, {lat['context']} cached tokens)\n"
            + "\n".join(lines) + tail)


def best_online(built: dict, suites: list[str]) -> dict | None:
    """The drafter with the highest mean online τ over the suites (stage 7's measurements)."""
    rows = built.get("online_tau", {}).get("drafters", {})
    scored = {n: [r[s]["tau"] for s in suites if s in r] for n, r in rows.items()}
    scored = {n: t for n, t in scored.items() if len(t) == len(suites)}
    if not scored:
        return None
    name = max(scored, key=lambda n: float(np.mean(scored[n])))
    return {"name": name, "block_size": built["online_tau"].get("block_size"), **dict(zip(suites, scored[name]))}


def _timed(timed: dict | None, suites: list[str]) -> str:
    """The best drafter's sync speed against plain, as the line after its τ."""
    if not timed:
        return "; not timed (its weights are not here)"
    return "".join(f"; sync at B = {b}, timed here: " + ", ".join(
        f"{s} {res[s]['speedup']:.2f}× plain (τ {res[s]['tau']:.2f}, {res[s]['time_per_token_ms']:.2f} ms/token)"
        for s in suites) for b, res in timed["blocks"].items())


def all_equal(out: dict) -> bool:
    ok = True
    for d in out["drafters"].values():
        for modes in d["results"].values():
            for m, r in modes.items():
                if isinstance(r, dict) and (m.startswith("sync") or m == "async") and "error" not in r:
                    ok = ok and bool(r.get("equals_plain", False))
    for r in out.get("async_sweep", []):
        ok = ok and bool(r.get("equals_plain"))
    for res in ((out.get("best_timed") or {}).get("blocks") or {}).values():
        ok = ok and all(bool(r.get("equals_plain")) for r in res.values())
    for rows in out.get("built", {}).get("online_tau", {}).get("drafters", {}).values():
        ok = ok and all(bool(r.get("equals_plain")) for r in rows.values())
    return ok


def dev_curves_plot(built: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in built.get("drafters", {}).items():
        curve = [c for c in r.get("curve", []) if c.get("dev_loss") is not None]
        if curve:
            ax.plot([c["step"] for c in curve], [c["dev_loss"] for c in curve],
                    "--" if (r.get("seed") or r["variant"].get("seed")) else "-", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("dev loss (D3D objective)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(p: Context, out: dict, suites: list[str]) -> dict:
    c, eval_dir = p.cfg, p.eval_dir
    methods = ("plain", "sync", *(f"sync_b{b}" for b in c.eval_compare_blocks), "async", "hf_assisted")
    tables = [B.table1(d["results"], methods=methods,
                       title=f"**Drafter `{name}` ({d['layers']} layers), B = {c.eval_block}**")
              for name, d in out["drafters"].items()]
    built = out["built"]
    tables += [t for t in (ablation_table(built, suites), arm_table(built, suites),
                           pruning_table(built, suites), latency_table(out.get("drafter_latency"))) if t]
    best = out["best_online"]  # the benchmark's choice, the one it timed
    if best:
        tables.append(f"Best drafter online (B = {best['block_size']}): `{best['name']}`, "
                      + ", ".join(f"{s} τ {best[s]:.2f}" for s in suites) + _timed(out.get("best_timed"), suites))
    text = "\n\n".join(tables)
    B.write_json(out, eval_dir / "results.json")
    (eval_dir / "table.md").write_text(text + "\n")
    res_main = out["drafters"][c.eval_drafters[0]]["results"]
    plots.acceptance_histogram(res_main, eval_dir / "acceptance_histogram.png")
    plots.tau_per_slot(res_main, eval_dir / "tau_per_slot.png")
    if out["async_sweep"]:
        plots.budget_sweep(out["async_sweep"], eval_dir / "async_budget.png")
    plots.tau_bars([(r["name"], r["offline_tau"]) for r in ablation_rows(built, suites)],
                   eval_dir / "ablations_offline_tau.png", "Offline τ on the dev split per drafter")
    dev_curves_plot(built, eval_dir / "dev_curves.png")
    print(text, flush=True)
    print(f"all sync/async outputs equal plain greedy: {out['all_outputs_equal_plain']}", flush=True)
    print(f"[pipeline] results in {eval_dir}", flush=True)
    if p.update_artifacts:
        copy_results(eval_dir, p.shipped_eval_dir)
    return out


def copy_results(src: Path, dst: Path) -> None:
    """Replace the shipped reference results with this run's (``--update-artifacts``)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    print(f"[pipeline] --update-artifacts: shipped results in {dst} replaced", flush=True)
