"""The serving benchmark's report: speedups over plain, auto against the best fixed mode, and
the markdown tables (``infer/bench.py serve``; the measuring is in :mod:`d3d_jax.bench.serve`)."""

from __future__ import annotations

FIXED = ("plain", "sync", "async")
AUTO = "auto"
BASE = "auto-base"  # auto from --baseline's checkout


def fmt_rounds(geom: str, d: dict) -> str:
    pred = lambda k, f: f" / {d[k]:{f}}" if d.get(k) else ""  # noqa: E731
    ms = f"; {d['ms_per_round']:.1f}{pred('predicted_ms_per_round', '.1f')} ms" if "ms_per_round" in d else ""
    return f"{geom} {int(d['rounds'])} ({d['tokens_per_round']:.2f}{pred('predicted_per_round', '.2f')}{ms})"


def fmt_mix(mix: dict) -> str:
    return ", ".join(f"{g} {share:.0%}" for g, share in sorted(mix.items(), key=lambda kv: -kv[1])) or "–"


def tables(report: dict, levels: list[int]) -> str:
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    rows = ["| mode | clients | tokens/s | TTFT p50 (ms) | TPOT p50 (ms) | τ | hit rate | rounds (tokens/round"
            " measured / predicted; ms/round of timed rounds, measured / predicted) |", "|---|---|---|---|---|---|---|---|"]
    for mode, m in report["modes"].items():
        for c in levels:
            r = m["levels"][str(c)]
            rounds = "; ".join(fmt_rounds(g, d) for g, d in r["rounds"].items())
            rows.append(f"| {mode} | {c} | {r['tokens_per_s']:.1f} | {r['ttft_ms_p50']:.1f} | "
                        f"{fmt(r['tpot_ms_p50'], '.2f')} | {fmt(r['tau'], '.2f')} | {fmt(r['hit_rate'], '.2f')} | "
                        f"{rounds or '–'} |")
    head = "| method | " + " | ".join(f"@{c}" for c in levels) + " |"
    rows += ["", "Speedup over plain at each load (Table 2 form):", "", head,
             "|---|" + "---|" * len(levels)]
    spread = lambda v, vs: f"{v:.2f}" + (f" [{min(vs):.2f}–{max(vs):.2f}]" if len(vs) > 1 else "")  # noqa: E731
    for mode, sp in report["speedup"].items():
        rows.append(f"| {mode} | " + " | ".join(spread(sp[str(c)], report["speedup_runs"][mode][str(c)]) + "×"
                                              for c in levels) + " |")
    for auto in [m for m in (AUTO, BASE) if f"{m}_vs_best_fixed" in report]:
        rows.append(f"| {auto} ÷ best fixed | " + " | ".join(
            spread(report[f"{auto}_vs_best_fixed"][str(c)], report[f"{auto}_vs_best_fixed_runs"][str(c)])
            + f" ({report['best_fixed'][str(c)]})" for c in levels) + " |")
    rows.append("")
    rows.append("(all repeats pooled; [min–max] of the same ratio within each repeat)")
    titles = {"mixed": "half benchmark prompts, half random token ids", "random": "random token ids"}
    for key in _special_keys(report):
        rows += ["", f"Level {key} ({titles[key.split('@')[0]]}):", "", "| mode | tokens/s | mode mix: text prompts | "
                 "mode mix: random ids | texts ≠ plain's | rounds | rows by reason |", "|---|---|---|---|---|---|---|"]
        for mode, m in report["modes"].items():
            r = m.get(key)
            if r:
                k = r["mode_mix_by_kind"]
                rows.append(f"| {mode} | {r['tokens_per_s']:.1f} | {fmt_mix(k.get('text', {}))} | "
                            f"{fmt_mix(k.get('ids', {}))} | {fmt(r.get('texts_differ'), 'd')} | "
                            + "; ".join(fmt_rounds(g, d) for g, d in r.get("rounds", {}).items()) + " | "
                            + fmt_mix(r.get("reasons", {})) + " |")
        for auto in [m for m in (AUTO, BASE) if key in report.get(f"{m}_vs_best_fixed", {})]:
            rows.append(f"| {auto} ÷ best fixed | {spread(report[f'{auto}_vs_best_fixed'][key], report[f'{auto}_vs_best_fixed_runs'][key])}"
                        f" ({report['best_fixed'][key]}) | | | | | |")
    return "\n".join(rows)


def _special_keys(report: dict) -> list[str]:
    """The mixed and random-id levels every mode ran (``mixed@8``; ``mixed`` in older reports)."""
    modes = list(report["modes"].values())
    return [k for k in (modes[0] if modes else {}) if k.split("@")[0] in ("mixed", "random")
            and all(k in m for m in modes)]


def ratios(report: dict, levels: list[int]) -> None:
    """Speedups over plain and auto ÷ the best fixed mode, from each level's tokens/s over all its
    repeats; ``*_runs``: the same ratio within each repeat (the spread the table shows)."""
    keys = [str(c) for c in levels] + _special_keys(report)
    lv = lambda m, k: report["modes"][m]["levels"][k] if k.isdigit() else report["modes"][m][k]  # noqa: E731
    tps = {m: {k: lv(m, k)["tokens_per_s"] for k in keys} for m in report["modes"]}
    runs = {m: {k: lv(m, k).get("tokens_per_s_runs", [tps[m][k]]) for k in keys} for m in report["modes"]}
    per_run = lambda a, b, k: [x / y for x, y in zip(runs[a][k], runs[b][k])]  # noqa: E731
    report["concurrency_gain"] = {m: t[str(max(levels))] / t[str(min(levels))] for m, t in tps.items()}
    report["speedup"] = ({m: {k: t[k] / tps["plain"][k] for k in keys} for m, t in tps.items() if m != "plain"}
                         if "plain" in tps else {})
    report["speedup_runs"] = ({m: {k: per_run(m, "plain", k) for k in keys} for m in tps if m != "plain"}
                              if "plain" in tps else {})
    fixed = [m for m in tps if m in FIXED]
    if fixed:
        report["best_fixed"] = {k: max(fixed, key=lambda m: tps[m][k]) for k in keys}
    for auto in [m for m in (AUTO, BASE) if m in tps and fixed]:
        report[f"{auto}_vs_best_fixed"] = {k: tps[auto][k] / tps[report["best_fixed"][k]][k] for k in keys}
        report[f"{auto}_vs_best_fixed_runs"] = {k: per_run(auto, report["best_fixed"][k], k) for k in keys}


__all__ = ["BASE", "fmt_mix", "fmt_rounds", "ratios", "tables"]
