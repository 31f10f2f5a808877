"""The Markdown table of ``infer/bench.py gpu`` (:mod:`d3d_jax.bench.gpu`), from its JSON result."""

from __future__ import annotations

import math

from d3d_jax.bench import simulate


def _f(x, fmt=".2f", suffix="") -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:{fmt}}{suffix}"


def _speedups(r: dict | None) -> str:
    if not r:
        return "not run"
    return f"{_f(r['speedup'], '.2f', '×')} / {_f(r['decode_speedup'], '.2f', '×')} (τ {_f(r['tau'])})"


def target_rows(t: dict) -> list[tuple[str, str]]:
    pl, asy, pa, pr, roof = t["plain"], t.get("async"), t["parts_ms"], t["projected"], t["roofline"]
    ratios = t["parts_ratios"]
    rows = [
        ("plain, ms/token (decode phase)", _f(pl["round_ms"], ".3f")),
        ("roofline ms/token = weights ÷ copy bandwidth, measured / nominal",
         f"{_f(roof['ms_per_token_measured_bw'], '.3f')} / {_f(roof.get('ms_per_token_nominal_bw'), '.3f')}"),
        ("roofline ÷ plain, measured / nominal bandwidth",
         f"{_f(roof['ratio_measured_bw'], '.1%')} / {_f(roof.get('ratio_nominal_bw'), '.1%')}"),
        ("sync over plain: end to end / decode phase", _speedups(t["sync"])),
        ("async over plain, one shared device: end to end / decode phase", _speedups(asy)),
    ]
    if asy:
        rows += [("async ÷ sync (one device, end to end)", _f(asy["ratio_to_sync"], ".2f", "×")),
                 ("async hit rate; rounds with a sync draft / rounds",
                  f"{_f(asy['hit_rate'], '.3f')}; {asy['sync_drafts']} / {asy['rounds']}")]
    return rows + [
        ("verify, ms (device)", _f(pa["verify"], ".3f")),
        ("packed forward, ms (device) (÷ verify)", f"{_f(pa['packed'], '.3f')} ({_f(ratios['packed_over_verify'])})"),
        ("one sync draft, ms: sync loop / async miss (miss ÷ verify)",
         f"{_f(pa['draft'], '.3f')} / {_f(pa['draft_miss'], '.3f')} ({_f(ratios['draft_miss_over_verify'])})"),
        ("host CPU per async round, ms (main-thread thread_time)", _f(pa["host"], ".3f")),
        ("projected sync round, ms → speedup",
         f"{_f(pr['sync_round_ms'], '.3f')} → {_f(pr['sync_speedup'], '.2f', '×')}"),
        ("projected one-device async round, ms → speedup",
         f"{_f(pr['one_device_async_round_ms'], '.3f')} → {_f(pr['one_device_async_speedup'], '.2f', '×')}"),
        ("**projected two-device async round**, ms → speedup",
         f"{_f(pr['two_device_async_round_ms'], '.3f')} → {_f(pr['two_device_async_speedup'], '.2f', '×')}"),
        ("projected two-device async ÷ sync", _f(pr["two_device_async_over_sync"], ".2f", "×")),
    ]


def drafter_table(t: dict) -> list[str]:
    lines = ["", f"## Drafter size, target {t['label']} (projected from measured parts)", "",
             "| drafter | params GiB | draft ms | packed ms | verify ms | sync speedup | "
             "two-device async speedup | async ÷ sync |", "|---|---|---|---|---|---|---|---|"]
    for r in t["drafter_table"]:
        lines.append(f"| {r['drafter']} | {r['params_bytes'] / 2**30:.3f} | {_f(r['draft_ms'], '.3f')} | "
                     f"{_f(r['packed_ms'], '.3f')} | {_f(r['verify_ms'], '.3f')} | "
                     f"{_f(r['projected_sync_speedup'], '.2f', '×')} | "
                     f"{_f(r['projected_two_device_async_speedup'], '.2f', '×')} | "
                     f"{_f(r['two_device_async_over_sync'], '.2f', '×')} |")
    return lines


def format_markdown(result: dict) -> str:
    env, ts, st = result["environment"], result["targets"], result["settings"]
    lines = [f"# infer/bench.py gpu: {env['device_kind'] or env['platform']} ({result['shapes']})", "",
             f"- acceptance: {simulate.header(result['simulated_acceptance'])}",
             f"- jax {env['jax']}, flax {env['flax']}, Python {env['python']}; copy bandwidth "
             f"{result['copy_bandwidth_GBps']:.0f} GB/s (nominal {_f(result['nominal_bandwidth_GBps'], '.0f')})",
             f"- batch 1, prompt {st['prompt_len']}, {st['max_new']} new tokens, B={st['block_size']} "
             f"C={st['branch_positions']} F={st['branch_fanout']}; medians of {st['repeats']}", "",
             "| measure | " + " | ".join(f"{t['label']} + {t['drafter']} drafter" for t in ts) + " |",
             "|---|" + "---|" * len(ts)]
    rows = [target_rows(t) for t in ts]
    for i, (name, _) in enumerate(rows[0] if rows else []):
        lines.append(f"| {name} | " + " | ".join(r[i][1] for r in rows) + " |")
    ident = ts[0].get("identity") if ts else None
    if ident:
        lines += ["", f"Greedy output equal to plain, token for token, {ts[0]['label']} ({ident['acceptance']}): "
                      + ", ".join(f"{m} {ident[m]['same_as_plain']}/{ident['prompts']} prompts "
                                  f"(τ {ident[m]['tau']:.2f})" for m in ("sync", "async"))]
    if ts and ts[0].get("drafter_table"):
        lines += drafter_table(ts[0])
    vc = ts[0].get("verify_cost") if ts else None
    if vc:
        lines += ["", f"Verify with simulated vs real acceptance (compiled cost analysis): flops "
                      f"×{vc['flops_ratio']:.6f}, bytes ×{vc['bytes_ratio']:.6f}; median time "
                      f"{vc['simulated']['ms']:.3f} vs {vc['real']['ms']:.3f} ms (×{vc['time_ratio']:.3f})"]
    if result["skipped"]:
        lines += ["", "Skipped (not measured): " + "; ".join(result["skipped"])]
    return "\n".join(lines) + "\n"
