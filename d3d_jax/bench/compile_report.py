"""The Markdown tables and the goal checks of ``infer/bench.py compile`` (from its JSON)."""

from __future__ import annotations

GB, GIB, MB = 1e9, 2 ** 30, 1e6
# the compile-only goals' bars; the xla attention train step's 16.55 GiB per v5p chip is the compiled figure of
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
    """The compile-only goals' figures that this run's programs can show (each: figure, bar, met)."""
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
    for pack in _packs(progs):  # the 1.7B drafter has the bar; the other sizes are shown beside it
        if verify:
            ratio = pack["roofline"]["flops_s"] / verify["roofline"]["bytes_s"]
            what = f"{pack['program']} flops / peak  over  8B verify bytes / bandwidth"
            out.append(_check(what, ratio, PACK_BAR) if pack["program"] == PACK_WITH_BAR else _shown(what, ratio))
    out += train_checks(progs) + split_checks(progs)
    return out + _ptx_program_checks(progs)


SPLIT_DEVICE_BAR = 80e9  # an H100's memory: the split must fit the smaller card
SPLIT_PARAMS_BAR = 0.6  # the target's parameter bytes on one device / the whole (half + norms)


def split_checks(progs: list[dict]) -> list[dict]:
    """A target over several devices: its peak per device against an H100 and its parameter
    bytes per device against the whole (the one-device plan's weights)."""
    out = []
    for r in progs:
        per = r.get("compiled") and r["facts"].get("target_param_bytes_per_device")
        if per:
            out.append(_check(f"{r['program']} ({r['backend']}): peak GB per device, of an 80 GB H100",
                              r["memory"]["peak"] / 1e9, SPLIT_DEVICE_BAR / 1e9))
            out.append(_check(f"{r['program']}: target parameter bytes per device / whole",
                              per / r["facts"]["target_weights_bytes"], SPLIT_PARAMS_BAR))
    return out


# What the PTX of the new kernels must show: pipelined loads in all three training kernels,
# Hopper tensor cores in the forward, no spills anywhere, and enough CTAs to fill the SMs in
# batch-1 decode and verify.
ASYNC_KERNELS = ("d3d_flash_fwd", "d3d_flash_dq", "d3d_flash_dkv")
WGMMA_KERNELS = ("d3d_flash_fwd",)
DECODE_KERNEL, MIN_DECODE_CTAS = "d3d_flash_decode", 132


def ptx_checks(kernels: list[dict], where: str = "", training: bool = False,
               min_ctas: int | None = None) -> list[dict]:
    """The PTX bars over one compile's ``compile_facts.gpu_kernels`` rows (each: figure, bar,
    met): 0 spill bytes summed over every entry; ``training``: async copies in the three
    training kernels and ``wgmma`` in the forward (a kernel missing is a failed check, not a
    silent pass; the decoding programs' 16-row forwards are below wgmma's 64 rows);
    ``min_ctas``: the decode kernel's largest launch."""
    by = {k["symbol"]: k for k in kernels}
    out = []
    for fact, names in (("async_copies", ASYNC_KERNELS), ("wgmma", WGMMA_KERNELS)):
        for name in names if training else ():
            n = by.get(name, {}).get(fact, 0)
            out.append({"check": f"{where}: {name} {fact}", "value": n, "bar": "> 0", "met": n > 0})
    unknown = [k["symbol"] for k in kernels if k.get("spill_stores") is None or k.get("spill_loads") is None]
    spills = sum((k.get("spill_stores") or 0) + (k.get("spill_loads") or 0) for k in kernels)
    out.append({"check": f"{where}: spill bytes, {len(kernels)} PTX entries", "bar": "0",
                "value": spills if not unknown else f"? ({', '.join(unknown[:3])})",
                "met": bool(kernels) and not unknown and spills == 0})
    if min_ctas is not None:  # one PTX entry per layer and span bucket: the full span's launch
        ctas = max((k.get("ctas") or 0 for k in kernels if _base(k["symbol"]) == DECODE_KERNEL), default=0)
        out.append({"check": f"{where}: {DECODE_KERNEL} CTAs (largest launch)", "value": ctas,
                    "bar": f">= {min_ctas}", "met": ctas >= min_ctas})
    return out


def _base(symbol: str) -> str:
    """A PTX entry's kernel name: XLA suffixes ``__N`` to each specialisation (layer, span)."""
    return symbol.split("__", 1)[0]


def _ptx_program_checks(progs: list[dict]) -> list[dict]:
    out = []
    for r in progs:
        if not r.get("compiled") or "gpu_kernels" not in r:
            continue
        decode = r["backend"] == "pallas" and r["program"].startswith(("plain step", "verify round"))
        out += ptx_checks(r["gpu_kernels"], r["program"], training=r["kind"] == "kernels",
                          min_ctas=MIN_DECODE_CTAS if decode else None)
    return out


def _check(what: str, value: float, bar: float) -> dict:
    return {"check": what, "value": value, "bar": bar, "met": bool(value <= bar)}


def _shown(what: str, value) -> dict:
    """A figure the table shows beside the bars, with no bar of its own."""
    return {"check": what, "value": value, "bar": "(shown)", "met": None}


def _packs(progs: list[dict]) -> list[dict]:
    return [r for r in progs if r.get("compiled") and r["program"].startswith("branch pack, ")]


# --------------------------------------------------------------------------------------
# The D3D-8B pod step: compiled at its depth, or at reduced depths and extrapolated
# --------------------------------------------------------------------------------------
POD, PACK_WITH_BAR = "D3D-8B train step", "branch pack, 1.7B drafter"


def _pod(progs: list[dict], flops: bool, backend: str | None = None) -> list[dict]:
    return [r for r in progs if r.get("compiled") and r["program"].startswith(POD)
            and r["program"].startswith(POD + ", flops") == flops and backend in (None, r["backend"])]


def depth_line(rows: list[dict], figure) -> dict | None:
    """Least-squares line of ``figure(row)`` over the rows' depths, and its value at the config's
    depth (None below two depths).  With three depths or more, ``max_residual`` says how far the
    measured points sit from a line; with two it is 0 by construction (a line, not a test of one)."""
    pts = sorted({r["facts"]["model_layers"]: figure(r) for r in rows}.items())
    full = rows[0]["facts"].get("config_layers") if rows else None
    if len(pts) < 2 or not full:
        return None
    n, sx, sy = len(pts), sum(x for x, _ in pts), sum(y for _, y in pts)
    sxx, sxy = sum(x * x for x, _ in pts), sum(x * y for x, y in pts)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    icpt = (sy - slope * sx) / n
    return {"depths": [x for x, _ in pts], "values": [y for _, y in pts], "per_layer": slope,
            "intercept": icpt, "full_layers": full, "at_full": icpt + slope * full,
            "max_residual": max(abs(y - icpt - slope * x) for x, y in pts)}


def _at_full(rows: list[dict], figure) -> tuple[float, str] | None:
    """A figure at the config's depth: compiled there, else extrapolated along the depths' line."""
    full = [r for r in rows if r["facts"]["model_layers"] == r["facts"].get("config_layers")]
    if full:
        return figure(full[0]), f"{full[0]['facts']['model_layers']} layers, compiled"
    line = depth_line(rows, figure)
    if line is None:
        return None
    return line["at_full"], (f"{line['full_layers']} layers, extrapolated from "
                             f"{', '.join(map(str, line['depths']))}")


def train_checks(progs: list[dict]) -> list[dict]:
    """The pod step's flops against the hand count (each depth), its memory per chip against
    today's 16.55 GiB with ``xla`` attention (at the config's depth, or extrapolated), the two
    backends side by side at each depth, and the flops-based step-time floor."""
    out = []
    for r in _pod(progs, flops=True):
        dev = abs(r["ideal"]["flops_over_hand"] - 1)
        out.append(_check(f"{r['program']} ({r['backend']}): abs(flops / hand count − 1)", dev, TRAIN_FLOPS_TOL))
    peak = lambda r: r["memory"]["peak"] / GIB  # noqa: E731
    backends = list(dict.fromkeys(r["backend"] for r in _pod(progs, flops=False)))
    for b in backends:
        got = _at_full(_pod(progs, False, b), peak)
        if got:
            what = f"{POD} ({b}, {got[1]}): GiB per chip / {TRAIN_XLA_GIB}"
            out.append(_check(what, got[0] / TRAIN_XLA_GIB, TRAIN_MEMORY_BAR) if b == "pallas" else
                       _shown(what, got[0] / TRAIN_XLA_GIB))
    if {"xla", "pallas"} <= set(backends):
        xla = {r["facts"]["model_layers"]: peak(r) for r in _pod(progs, False, "xla")}
        for r in _pod(progs, False, "pallas"):
            d = r["facts"]["model_layers"]
            if d in xla:
                out.append(_shown(f"{POD}, {d} layers: pallas / xla GiB per chip, same depth", peak(r) / xla[d]))
    flops = _pod(progs, flops=True)
    got, tflop = _at_full(flops, lambda r: r["roofline"]["flops_s"]), _at_full(flops, lambda r: r["flops"] / 1e12)
    hand = _at_full(flops, lambda r: r["facts"]["hand_flops"]["total"] / r["chips"] / 1e12)
    if tflop and not tflop[1].endswith("compiled"):  # the flops and the hand count, both on their lines
        out.append(_check(f"{POD} ({flops[0]['backend']}, {tflop[1]}): abs(flops / hand count − 1)",
                          abs(tflop[0] / hand[0] - 1), TRAIN_FLOPS_TOL))
    if got:  # flops / peak is linear in depth as the flops are
        out.append(_shown(f"{POD} ({flops[0]['backend']}, {got[1]}): flops-based step-time floor, s "
                          f"({tflop[0]:.1f} TFLOP per chip ÷ dense bf16 peak)", got[0]))
    return out


def depth_rows(progs: list[dict]) -> list[str]:
    """One row per backend (and the flops compile) with a line through its measured depths."""
    rows = []
    series = [(f"{b} memory", _pod(progs, False, b), lambda r: r["memory"]["peak"] / GIB, "GiB")
              for b in dict.fromkeys(r["backend"] for r in _pod(progs, False))]
    series += [(f"{b} flops", _pod(progs, True, b), lambda r: r["flops"] / 1e12, "TFLOP")
               for b in dict.fromkeys(r["backend"] for r in _pod(progs, True))]
    series += [(f"{b} hand count", _pod(progs, True, b),
                lambda r: r["facts"]["hand_flops"]["total"] / r["chips"] / 1e12, "TFLOP")
               for b in dict.fromkeys(r["backend"] for r in _pod(progs, True))]
    for what, rs, fig, unit in series:
        line = depth_line(rs, fig)
        if line is None:
            continue
        pts = ", ".join(f"{d}: {v:.4g}" for d, v in zip(line["depths"], line["values"]))
        rows.append(f"| {what} ({unit} per chip) | {pts} | {line['per_layer']:.4g} | {line['intercept']:.4g} "
                    f"| {line['max_residual']:.3g} | {line['full_layers']}: **{line['at_full']:.4g}** |")
    head = ["| D3D-8B pod step | measured (layers: value) | per layer | at 0 layers | max residual "
            "| extrapolated (layers: value) |", "|---|---|---|---|---|---|"]
    return head + rows if rows else []


def _num(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _ms(s: float) -> str:
    return f"{1e3 * s:.3f}"


def _ratio(r: dict) -> str:
    i = r.get("ideal", {})
    if r["kind"] == "kernels":
        return "kernels alone"
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
        # the project's kernels (a TPU program also has XLA's own custom calls: AllocateBuffer...)
        calls = r.get("tpu_custom_calls") or sum(k["calls"] for k in r["kernel_calls"] if k["estimated"])
        rows.append(
            f"| {r['program']} | {dev} | {r['backend']} | {r['compile_s']:.0f} "
            f"| {m['peak'] / GIB:.2f} ({100 * r['memory_over_hbm']:.1f} %) | {m['temp'] / MB:.1f} "
            f"| {x['flops'] / 1e9:.4g} + {r['kernel_flops'] / 1e9:.4g} "
            f"| {x['bytes'] / GB:.3f} − {r['lookup_overcount_bytes'] / GB:.3f} + {r['kernel_bytes'] / GB:.3f} "
            f"= {r['bytes'] / GB:.3f} | {_ms(r['roofline']['s'])} ({r['roofline']['bound']}) | {_ratio(r)} "
            f"| {calls} |")
    return head + rows


def kernel_rows(progs: list[dict]) -> list[str]:
    """One row per kernel and identical facts: XLA compiles a kernel per layer and span bucket
    (``name__N``), which differ only in their grid."""
    head = ["| program | kernel (PTX entries) | launches | CTAs | smem KB | registers | spills (st/ld B) "
            "| cp.async | wgmma | mma.sync |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for r in progs:
        groups: dict = {}
        for k in r.get("gpu_kernels", []):
            key = (_base(k["symbol"]), k.get("registers"), k.get("spill_stores"), k.get("spill_loads"),
                   k["async_copies"], k["wgmma"], k["mma_sync"])
            groups.setdefault(key, []).append(k)
        for (name, regs, st, ld, cpa, wg, mma), ks in groups.items():
            ctas = sorted({k["ctas"] for k in ks if k["ctas"] is not None})
            smem = [k["shared_memory"] for k in ks if k["shared_memory"] is not None]
            span = "" if not ctas else str(ctas[0]) if len(ctas) == 1 else f"{ctas[0]}-{ctas[-1]}"
            rows.append(f"| {r['program']} ({r['backend']}) | {name} ({len(ks)}) | {sum(k['launches'] for k in ks)} "
                        f"| {span} | {max(smem) / 1024 if smem else 0:.0f} | {regs} | {st}/{ld} | {cpa} | {wg} | {mma} |")
    return head + rows if rows else []


KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton")


def estimate_rows(progs: list[dict]) -> list[str]:
    head = ["| program | kernel | calls | operands (q, k, v) | in a branch | GFLOP each | MB each (once) "
            "| MB each (issued) |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for r in progs:
        for k in r.get("kernel_calls", []):
            est = k["estimated"]
            if not est and k["target"] not in KERNEL_TARGETS:  # XLA's own (AllocateBuffer, ...)
                continue
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
    for title, rows in (("Train steps by depth (a line through the measured depths)", depth_rows(result["programs"])),
                        ("GPU kernels (PTX)", kernel_rows(result["programs"])),
                        ("Kernel estimates", estimate_rows(result["programs"]))):
        if rows:
            lines += [f"## {title}", ""] + rows + [""]
    if result.get("checks"):
        lines += ["## Goal checks", "", "| check | value | bar | met |", "|---|---|---|---|"]
        met = {True: "yes", False: "**no**", None: "—"}
        lines += [f"| {c['check']} | {_num(c['value'])} | {_num(c['bar'])} | {met[c['met']]} |"
                  for c in result["checks"]] + [""]
    return "\n".join(lines)
