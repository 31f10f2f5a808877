"""What a compile-only executable says about itself (``infer/bench.py compile``).

* memory: ``memory_analysis()`` per device (arguments, outputs, aliased, temporaries);
* XLA's cost: HLO cost analysis of the optimized module (``cost_analysis()`` is None for a
  compile-only executable).  It counts a custom kernel (Triton, Mosaic) as 0, takes the largest
  branch of a ``conditional`` for each figure and a ``while`` body once;
* :func:`walk` reads the optimized HLO text with the same rules and adds what that analysis
  misses: each kernel's own estimate (:mod:`~d3d_jax.bench.kernel_cost`) and the over-count of an
  embedding lookup that ``gather`` charges with the whole table;
* GPU kernels' machine facts from the dump (``--xla_dump_to``): per PTX entry, counted in that
  entry's body, the async copies (``cp.async``, TMA included, commits and waits not), ``wgmma``
  and ``mma.sync``; registers and spills (``ptxas -v``); per launch the grid (CTAs) and shared
  memory from the thunk sequence.  The one source of PTX facts (tests, ``bench compile``).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import numpy as np

from d3d_jax.bench import kernel_cost

_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_COMP = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_CALLEES = re.compile(r"(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def shapes_in(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every ``dtype[dims]`` in ``text``, in order."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(text)]


# --------------------------------------------------------------------------------------
# Memory and XLA's cost
# --------------------------------------------------------------------------------------
def memory(compiled) -> dict:
    """Per-device bytes; ``peak`` = arguments + outputs − aliased + temporaries, and
    ``compiler_peak`` the backend's own peak where it reports one (libtpu).  They differ for a
    program whose big buffers are ``while`` outputs (a scanned layer stack's saved inputs):
    libtpu's temp adds a "fragmentation" that counts those twice (docs/results/compile.md)."""
    m = compiled.memory_analysis()
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
    out = {k.replace("_size_in_bytes", ""): int(getattr(m, k, 0) or 0) for k in keys}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["compiler_peak"] = int(getattr(m, "peak_memory_in_bytes", 0) or 0) or None
    return out


def xla_cost(compiled) -> dict:
    """flops / transcendentals / bytes accessed of the optimized module (custom kernels: 0)."""
    ca = compiled.cost_analysis()
    if not isinstance(ca, dict):
        ca = _module_cost(compiled)
    return {"flops": float(ca.get("flops", 0.0)), "transcendentals": float(ca.get("transcendentals", 0.0)),
            "bytes": float(ca.get("bytes accessed", 0.0))}


def _module_cost(compiled) -> dict:
    """XLA's cost analysis of a compile-only (no device) executable, whose public
    ``cost_analysis()`` is None.  JAX offers no public call for this, so it is jaxlib's private
    ``_xla.hlo_module_cost_analysis`` run on the CPU client; ``tests/test_compile.py`` pins it
    (it must exist and agree with the public call on a CPU compile) so a jax upgrade fails there."""
    import jax
    from jaxlib import xla_client

    module = compiled.runtime_executable().hlo_modules()[0]
    return xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)


# --------------------------------------------------------------------------------------
# The HLO walk: kernels, lookups, loops, with the cost analysis's own rules
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Extras:
    """What one computation adds to (or takes from) XLA's cost, by the cost analysis's rules."""

    kernel_flops: float = 0.0
    kernel_bytes: float = 0.0
    lookup_overcount: float = 0.0  # bytes of embedding tables charged beyond the rows read

    def add(self, other: "Extras", scale: float = 1.0) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + scale * getattr(other, f.name))

    def max_with(self, other: "Extras") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, max(getattr(self, f.name), getattr(other, f.name)))


def parse_computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """``{computation: instruction lines}`` and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and line.strip():
            comps[current].append(line)
    return comps, entry


# A Mosaic call (``tpu_custom_call``) carries no kernel name of its own: the ``pallas_call``'s
# name is the innermost one of its op name, ``…/transpose(jvp(d3d_flash_dq))/pallas_call``.
_MOSAIC_NAME = re.compile(r'op_name="[^"]*?([A-Za-z_]\w*)\)*/pallas_call"')


def _kernel_call(line: str, out_type: str) -> dict:
    name = re.search(r'name = "([\w.\-]+)"', line) or _MOSAIC_NAME.search(line)
    operands = re.search(r"operand_layout_constraints=\{(.*?)\}(?:, [a-z_]+=|$)", line)
    grid = [int(g) for g in re.findall(r"grid_[xyz] = (\d+)", line)]
    target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
    shapes = shapes_in(operands.group(1)) if operands else []
    if len(shapes) > 2 and shapes[2] == ("s32", (1,)):
        # a stacked cache's layer index (the layer scan's step), after the live tiles and count
        shapes = shapes[:2] + shapes[3:]
        if len(shapes) > 2 and shapes[2][0] == "s32":  # a paged pool's page table (q is never s32)
            shapes = shapes[:2] + shapes[3:]
    return {"name": name.group(1) if name else target, "target": target, "operands": shapes,
            "results": shapes_in(out_type), "grid": grid}


def _lookup_overcount(line: str, out_type: str, shapes: dict, tables: set) -> float:
    """A ``gather`` from an embedding table is charged the whole table; it reads its rows."""
    first = line.split("gather(", 1)[1].split(",", 1)[0].strip().lstrip("%")
    src = shapes.get(first)
    if src is None or src not in tables:
        return 0.0
    out = shapes_in(out_type)
    return max(kernel_cost.nbytes(*src) - sum(kernel_cost.nbytes(*o) for o in out), 0)


def walk(hlo: str, tables: set = frozenset(), kernel_costs=None) -> tuple[Extras, list[dict]]:
    """Extras of the entry computation, and every kernel call (with ``branch_of`` set when it sits
    in a conditional branch).  ``tables``: ``(dtype, shape)`` of the embedding tables."""
    comps, entry = parse_computations(hlo)
    estimate = kernel_costs or kernel_cost.estimate
    calls: list[dict] = []
    memo: dict[str, Extras] = {}

    def visit(name: str, in_branch: bool) -> Extras:
        if name in memo:
            return memo[name]
        ex, shapes = Extras(), {}
        for line in comps.get(name, []):
            m = _INSTR.match(line)
            if not m:
                continue
            iname, out_type, op, rest = m.groups()
            if not out_type.startswith("("):
                found = shapes_in(out_type)
                if found:
                    shapes[iname] = found[0]
            if op == "custom-call" and "custom_call_target=" in rest:
                call = _kernel_call(rest, out_type)
                call.update(estimate(call), in_branch=in_branch)
                calls.append(call)
                ex.kernel_flops += call["flops"]
                ex.kernel_bytes += call["bytes"]
            elif op == "gather":
                ex.lookup_overcount += _lookup_overcount(op + "(" + rest, out_type, shapes, tables)
            branches = _BRANCHES.search(rest)
            names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
            names += [c for k, c in _CALLEES.findall(rest) if k in ("true_computation", "false_computation")]
            if names:  # the cost analysis takes the largest branch, figure by figure
                best = Extras()
                for b in names:
                    best.max_with(visit(b, True))
                ex.add(best)
            for kind, callee in _CALLEES.findall(rest):
                if kind in ("calls", "body", "condition"):
                    ex.add(visit(callee, in_branch))
        memo[name] = ex
        return ex

    return visit(entry, False), calls


# --------------------------------------------------------------------------------------
# GPU kernels from the dump
# --------------------------------------------------------------------------------------
_LAUNCH = re.compile(r"kCustomKernel .*?\] ([\w.\-]+) grid: \[(\d+), (\d+), (\d+)\] threads: "
                     r"\[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes")


def launches(dump: Path, names: tuple[str, ...]) -> list[dict]:
    """Each launch of a kernel whose symbol starts with one of ``names`` (grid, threads, smem)."""
    out = []
    for path in sorted(Path(dump).glob("*thunk_sequence.txt")):
        for m in _LAUNCH.finditer(path.read_text()):
            sym = m.group(1)
            if sym.startswith(names):
                g = [int(x) for x in m.group(2, 3, 4)]
                out.append({"symbol": sym, "grid": g, "ctas": int(np.prod(g)),
                            "threads": int(np.prod([int(x) for x in m.group(5, 6, 7)])),
                            "shared_memory": int(m.group(8))})
    return out


# PTX instruction prefixes per fact, and what a prefix match must not be: a commit or a wait of
# an async-copy group is bookkeeping, not a copy.
_PTX_OPS = {
    "async_copies": ("cp.async.", ("cp.async.commit", "cp.async.wait", "cp.async.bulk.commit",
                                   "cp.async.bulk.wait")),
    "wgmma": ("wgmma.mma_async", ()),
    "mma_sync": ("mma.sync", ()),
}


def ptx_counts(ptx: str, symbol: str) -> dict:
    """Instruction counts of one entry's body (not the whole file: a module may hold several):
    async copies (``cp.async``, TMA's ``cp.async.bulk`` included; commits and waits excluded),
    Hopper ``wgmma.mma_async`` and Ampere-style ``mma.sync``."""
    body = ptx.split(f".entry {symbol}(", 1)[1]
    body = body.split(".entry ", 1)[0]
    out = {}
    for fact, (prefix, exclude) in _PTX_OPS.items():
        ops = re.findall(rf"^\s*(?:@!?%p\d+\s+)?({re.escape(prefix)}[\w.:]*)", body, re.M)
        out[fact] = sum(not op.startswith(exclude) for op in ops) if exclude else len(ops)
    return out


def ptx_entries(dump: Path, names: tuple[str, ...]) -> dict[str, dict]:
    """PTX facts per entry (symbol) whose name starts with one of ``names``."""
    out = {}
    for path in sorted(Path(dump).glob("*.ptx")):
        text = path.read_text(errors="replace")
        syms = [s for s in re.findall(r"\.entry ([\w.\-]+)\(", text) if s.startswith(names) and s not in out]
        if not syms:
            continue
        target = _first(r"\.target (\w+)", text) or "sm_90a"
        report = ptxas_report(path, target)
        for sym in syms:
            out[sym] = {"file": path.name, "target": target, **ptx_counts(text, sym), **ptxas_facts(report, sym)}
    return out


def _first(pattern: str, text: str) -> str:
    m = re.search(pattern, text)
    return m.group(1) if m else ""


def ptxas_report(path: Path, target: str) -> str:
    """``ptxas -v``'s report of one PTX file (no GPU needed); an error text starts with ``!``."""
    try:
        res = subprocess.run(["ptxas", f"-arch={target}", "-v", str(path), "-o", "/dev/null"],
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"!{e}"
    return res.stderr if res.returncode == 0 else f"!{res.stderr.strip()[-300:]}"


def ptxas_facts(report: str, symbol: str) -> dict:
    """Registers and spill bytes of one entry from its file's ``ptxas -v`` report."""
    block = report.split(f"Compiling entry function '{symbol}'")
    if report.startswith("!") or len(block) < 2:
        return {"ptxas_error": report[1:] if report.startswith("!") else "entry not found"}
    info = block[1].split("Compiling entry function")[0]
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else None,
            "spill_loads": int(spills.group(2)) if spills else None}


def gpu_kernels(dump: Path, names: tuple[str, ...]) -> list[dict]:
    """One row per compiled kernel: its PTX facts, launches and largest grid."""
    runs = launches(dump, names)
    rows = []
    for sym, facts in ptx_entries(dump, names).items():
        mine = [r for r in runs if r["symbol"] == sym]
        rows.append({"symbol": sym, **facts, "launches": len(mine),
                     "ctas": max((r["ctas"] for r in mine), default=None),
                     "grid": mine[0]["grid"] if mine else None,
                     "shared_memory": max((r["shared_memory"] for r in mine), default=None)})
    return rows


def tpu_custom_calls(hlo: str) -> int:
    """Mosaic kernels (``tpu_custom_call``) in the optimized module."""
    return len(re.findall(r'custom_call_target="tpu_custom_call"', hlo))
