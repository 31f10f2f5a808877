"""The Markdown tables and the issue-20 checks of ``infer/bench.py compile`` (from its JSON)."""

from __future__ import annotations

GB, GIB, MB = 1e9, 2 ** 30, 1e6
# issue 20's bars; the xla attention train step's 16.55 GiB per v5p chip is the compiled figure of
# the code before the fused TPU kernel (this table shows today's beside it)
PLAIN_BYTES_BAR, PLAIN_TEMP_BAR, VERIFY_BAR, PACK_BAR = 1.05, 32e6, 1.10, 0.6
TRAIN_FLOPS_TOL, TRAIN_XLA_GIB, TRAIN_MEMORY_BAR = 0.05, 16.55, 0.6


def one_line(r: dict) -> str:
    if not r.get("compiled"):
        return f"NOT COMPILED: {r.get('error', '?')}"
    m = r["memory"]
    return (f"compiled in {r['compile_s']:.0f} s; peak {m['peak'] / GIB:.2f} GiB/device "
            f"({100 * r['memory_over_hbm']:.1f} % of HBM), temp {m['temp'] / MB:.1f} MB; "
            f"{r['flops'] / 1e9:.4g} GFLOP, {r['bytes'] / GB:.4g} GB; roofline {1e3 * r['roofline']['s']:.3f} ms")


def _find(progs: list[dict], name: str, backend: str | None = None) -> dict | None:
    for r in progs:
        if r.get("compiled") and r["program"] == name and (backend is None or r["backend"] == backend):
            return r
    return None


def checks(progs: list[dict]) -> list[dict]:
    """Issue 20's Done-when figures that this run's programs can show (each: figure, bar, met)."""
    out = []
    plain = _find(progs, "plain step", "pallas")
    verify = _find(progs, "verify round (async target side)", "pallas")
    if plain:
        ratio = plain["ideal"]["corrected_xla_bytes_over_weights_plus_cache"]
        out.append(_check("plain step (pallas): XLA-side bytes (lookup-corrected) / (weights + cache)",
                          ratio, PLAIN_BYTES_BAR))
        out.append(_check("plain step (pallas): temp memory, MB", plain["memory"]["temp"] / MB, PLAIN_TEMP_BAR / MB))
    if plain and verify:
        out.append(_check("16-token verify round / plain step, total bytes (lookup-corrected, + kernels)",
                          verify["bytes"] / plain["bytes"], VERIFY_BAR))
    pack = _find(progs, "branch pack, 1.7B drafter")
    if pack and verify:
        out.append(_check("1.7B branch pack flops / peak  over  8B verify bytes / bandwidth",
                          pack["roofline"]["flops_s"] / verify["roofline"]["bytes_s"], PACK_BAR))
    flops = _find(progs, "D3D-8B train step, flops")
    if flops:
        dev = abs(flops["ideal"]["flops_over_hand"] - 1)
        out.append(_check("D3D-8B train step: abs(flops / hand count − 1)", dev, TRAIN_FLOPS_TOL))
    train = _find(progs, "D3D-8B train step")
    if train:
        gib = train["memory"]["peak"] / GIB
        out.append(_check(f"D3D-8B train step ({train['backend']}): GiB per chip / {TRAIN_XLA_GIB}",
                          gib / TRAIN_XLA_GIB, TRAIN_MEMORY_BAR))
    return out


def _check(what: str, value: float, bar: float) -> dict:
    return {"check": what, "value": value, "bar": bar, "met": bool(value <= bar)}


def _ms(s: float) -> str:
    return f"{1e3 * s:.3f}"


def _ratio(r: dict) -> str:
    i = r.get("ideal", {})
    if r["kind"] == "train":
        plan = r["facts"].get("plan_GiB")
        return f"flops / hand {i['flops_over_hand']:.3f}; plan {plan:.2f} GiB" if plan else \
            f"flops / hand {i['flops_over_hand']:.3f}"
    return (f"XLA {i['xla_bytes_over_weights_plus_cache']:.3f}, corrected "
            f"{i['corrected_xla_bytes_over_weights_plus_cache']:.3f} of W+C; total / ideal {i['bytes_over_ideal']:.3f}")


def program_rows(progs: list[dict]) -> list[str]:
    head = ["| program | device | attention | compile s | peak GiB/device (of HBM) | temp MB | GFLOP XLA + kernels "
            "| GB XLA − lookup + kernels | roofline ms (bound) | vs ideal | custom calls |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for r in progs:
        dev = f"{r.get('chips', 1)} x {r['device']}"
        if not r.get("compiled"):
            rows.append(f"| {r['program']} | {dev} | {r['backend']} | {r.get('compile_s', 0):.0f} "
                        f"| **not compiled**: {r.get('error', '?')[:300]} ||||||")
            continue
        m, x = r["memory"], r["xla"]
        calls = sum(k["calls"] for k in r["kernel_calls"]) or r.get("tpu_custom_calls", 0)
        rows.append(
            f"| {r['program']} | {dev} | {r['backend']} | {r['compile_s']:.0f} "
            f"| {m['peak'] / GIB:.2f} ({100 * r['memory_over_hbm']:.1f} %) | {m['temp'] / MB:.1f} "
            f"| {x['flops'] / 1e9:.4g} + {r['kernel_flops'] / 1e9:.4g} "
            f"| {x['bytes'] / GB:.3f} − {r['lookup_overcount_bytes'] / GB:.3f} + {r['kernel_bytes'] / GB:.3f} "
            f"= {r['bytes'] / GB:.3f} | {_ms(r['roofline']['s'])} ({r['roofline']['bound']}) | {_ratio(r)} "
            f"| {calls} |")
    return head + rows


def kernel_rows(progs: list[dict]) -> list[str]:
    head = ["| program | kernel (PTX entry) | launches | CTAs | smem KB | registers | spills (st/ld B) "
            "| cp.async | wgmma | mma.sync |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for r in progs:
        for k in r.get("gpu_kernels", []):
            smem = "" if k["shared_memory"] is None else f"{k['shared_memory'] / 1024:.0f}"
            rows.append(f"| {r['program']} ({r['backend']}) | {k['symbol']} | {k['launches']} | {k['ctas']} "
                        f"| {smem} | {k.get('registers')} | {k.get('spill_stores')}/{k.get('spill_loads')} "
                        f"| {k['async_copies']} | {k['wgmma']} | {k['mma_sync']} |")
    return head + rows if rows else []


def estimate_rows(progs: list[dict]) -> list[str]:
    head = ["| program | kernel | calls | operands (q, k, v) | in a branch | GFLOP each | MB each (once) "
            "| MB each (issued) |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for r in progs:
        for k in r.get("kernel_calls", []):
            est = k["estimated"]
            rows.append(f"| {r['program']} ({r['backend']}) | {k['name']} | {k['calls']} | {', '.join(k['operands'])} "
                        f"| {'yes' if k['in_branch'] else 'no'} "
                        f"| {k['flops_each'] / 1e9:.4g} | {k['bytes_each'] / MB:.3g} "
                        f"| {k['issued_bytes_each'] / MB:.3g} |" if est else
                        f"| {r['program']} | {k['name']} ({k['target']}) | {k['calls']} | | | no estimate | | |")
    return head + rows if rows else []


def markdown(result: dict) -> str:
    env = result["environment"]
    la = ", ".join(f"{x:.1f}" for x in env["load_average"])
    lines = [f"# infer/bench.py compile ({env['date']}, jax {env['jax']}, {env['host_cpus']} host CPUs, "
             f"load average {la} at the start)", "",
             "Compile-only executables: memory per device and the cost of the optimized HLO; no "
             "autotuning, no timing (see the README).", ""]
    lines += program_rows(result["programs"]) + [""]
    for title, rows in (("GPU kernels (PTX)", kernel_rows(result["programs"])),
                        ("Kernel estimates", estimate_rows(result["programs"]))):
        if rows:
            lines += [f"## {title}", ""] + rows + [""]
    if result.get("checks"):
        lines += ["## Issue 20 checks", "", "| check | value | bar | met |", "|---|---|---|---|"]
        lines += [f"| {c['check']} | {c['value']:.4g} | {c['bar']:.4g} | {'yes' if c['met'] else '**no**'} |"
                  for c in result["checks"]] + [""]
    return "\n".join(lines)
