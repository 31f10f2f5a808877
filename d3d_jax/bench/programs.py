"""``infer/bench.py programs``: where compile time goes, program by program.

Builds a decoder per ``--modes`` entry (random weights at ``--layers``/``--hidden`` ..., the
``engine`` benchmark's 4-layer model by default), runs one ``generate`` of ``--max-new-tokens``
(and, with ``--warm-up``, the server's start-up compiles: admission and every round width), and
lists every program compiled meanwhile: trace, lower and compile seconds (JAX's own compile
events), and from XLA's optimized HLO its instructions, fusions, ``while`` loops, conditionals
and custom calls (fused kernels).  Writes ``programs.json`` and prints a Markdown table.

For the compile-only H200 and TPU targets, ``infer/bench.py compile`` reports the same per
program.  Each checkout is measured in a fresh process with no compile cache; ``--compare-with
DIR`` measures another checkout (say, a ``git worktree`` of main) in the same run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# JAX's compile events, named here rather than imported from bench.clock: the measuring process
# imports d3d_jax from the checkout it measures (--compare-with), which may predate any new name
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from d3d_jax.bench.engine import add_model_arguments

    p.add_argument("--modes", default="plain,sync", help="comma-separated: plain, sync, async, auto")
    add_model_arguments(p)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--warm-up", action="store_true", help="also the server's start-up compiles")
    p.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                   help="also measure another checkout of this project (e.g. a git worktree of main), side by side")
    p.add_argument("--out", default="runs/bench_programs", help="folder for programs.json")


def hlo_facts(text: str) -> dict:
    """Counts of an optimized HLO module's text."""
    instructions = [ln for ln in text.splitlines() if " = " in ln and not ln.lstrip().startswith(("//", "HloModule"))]
    count = lambda pattern: sum(1 for ln in instructions if re.search(pattern, ln))  # noqa: E731
    return dict(hlo_lines=len(instructions), fusions=count(r"\bfusion\("), whiles=count(r"\bwhile\("),
                conditionals=count(r"\bconditional\("), custom_calls=count(r"\bcustom-call\("))


def dumped_modules(dump: Path) -> dict[str, list[dict]]:
    """``jit name -> [facts of each optimized module of that name]`` from an XLA dump folder."""
    out = collections.defaultdict(list)
    for f in sorted(dump.glob("module_*after_optimizations.txt")):
        name = f.name.split(".")[1]  # module_0056.jit__admit_fn.cpu_after_optimizations.txt
        out[name].append(hlo_facts(f.read_text()))
    return out


class EventLog:
    """Seconds per (program name, phase) from JAX's compile events while open."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(EVENTS.values(), 0.0))
        self.order: list[str] = []

    def _on(self, event: str, duration: float, fun_name: str | None = None, **_):
        if event in EVENTS and fun_name:
            inner = re.fullmatch(r"jit\((.*)\)", fun_name)  # lower/compile say jit(f), trace says f
            name = "jit_" + (inner.group(1) if inner else fun_name)  # as XLA's dump names the module
            if name not in self.seconds:
                self.order.append(name)
            self.seconds[name][EVENTS[event]] += duration

    def __enter__(self):
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._on)
        return self

    def __exit__(self, *exc):
        import jax

        jax.monitoring.unregister_event_duration_listener(self._on)


def _model(args, seed: int, layers: int):
    from d3d_jax.config import ModelConfig
    from d3d_jax.model.qwen3 import init_model, unstacked

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_layers=layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim, max_position_embeddings=4096, mask_token_id=args.vocab - 1)
    return unstacked(init_model(cfg, seed))  # as the commands load one


def measure(args) -> list[dict]:
    """One fresh decoder per mode; every program it compiles, in order."""
    import jax

    from d3d_jax.decoding import engine

    rows = []
    target = _model(args, 0, args.layers)
    drafter = _model(args, 1, max(1, args.layers // 2))
    prompt = [(7 * i + 3) % (args.vocab - 2) + 1 for i in range(args.prompt_len)]
    jax.block_until_ready(jax.tree.leaves((target, drafter)))
    for mode in [m for m in args.modes.split(",") if m]:
        with EventLog() as log:
            t0 = time.perf_counter()
            dec = engine.make_decoder(target, drafter if mode != "plain" else None, mode=mode,
                                      num_slots=args.slots, max_cache_len=engine.cache_len_for(
                                          [prompt], args.max_new_tokens), mask_token_id=args.vocab - 1)
            if args.warm_up:
                dec.warm_up()
            engine.generate(dec, [prompt], max_new_tokens=args.max_new_tokens)
            wall = time.perf_counter() - t0
        for name in log.order:
            rows.append(dict(mode=mode, program=name, **{k: round(v, 3) for k, v in log.seconds[name].items()}))
        rows.append(dict(mode=mode, program="(first generate, wall)", wall_s=round(wall, 3)))
    return rows


def table(rows: list[dict]) -> str:
    head = "| mode | program | trace s | lower s | compile s | HLO instr. | fusions | while | cond | custom calls |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if "wall_s" in r:
            lines.append(f"| {r['mode']} | **first generate, wall** | | | | | | | | {r['wall_s']:.2f} s |")
            continue
        h = r.get("hlo") or {}
        cells = [h.get(k, "") for k in ("hlo_lines", "fusions", "whiles", "conditionals", "custom_calls")]
        lines.append(f"| {r['mode']} | `{r['program']}` | {r['trace_s']:.2f} | {r['lower_s']:.2f} | "
                     f"{r['compile_s']:.2f} | " + " | ".join(str(c) for c in cells) + " |")
    totals = collections.defaultdict(float)
    for r in rows:
        for k in ("trace_s", "lower_s", "compile_s"):
            totals[(r["mode"], k)] += r.get(k, 0.0)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        lines.append(f"| {mode} | **all programs** | {totals[(mode, 'trace_s')]:.2f} | {totals[(mode, 'lower_s')]:.2f} | "
                     f"{totals[(mode, 'compile_s')]:.2f} | | | | | |")
    return "\n".join(lines)


def _child(args, root: Path) -> list[dict]:
    """:func:`measure` in a fresh process importing ``d3d_jax`` from ``root``, with an XLA dump and
    no compile cache (every program compiles there); rows with each program's HLO facts."""
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, D3D_COMPILE_CACHE="off", PYTHONPATH=str(root),
                   XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                              " --xla_dump_hlo_pass_re=NONE").strip())
        env.setdefault("JAX_PLATFORMS", "cpu")
        given = {k: v for k, v in vars(args).items() if k in CHILD_ARGS}
        res = subprocess.run([sys.executable, __file__, json.dumps(given)], env=env, capture_output=True,
                             text=True, cwd=root)
        found = [ln for ln in res.stdout.splitlines() if ln.startswith("ROWS ")]
        if res.returncode or not found:
            raise RuntimeError(f"the measuring process ({root}) failed ({res.returncode}): {res.stderr[-2000:]}")
        rows = json.loads(found[-1][5:])
        modules = dumped_modules(Path(dump))
    taken = collections.Counter()
    for r in rows:  # the n-th compile of a name is its n-th dumped module
        found = modules.get(r.get("program"), [])
        if taken[r.get("program")] < len(found):
            r["hlo"] = found[taken[r["program"]]]
        taken[r.get("program")] += 1
    return rows


def _total(rows: list[dict], mode: str) -> float:
    return sum(r.get("compile_s", 0.0) for r in rows if r["mode"] == mode)


def main(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parents[2]
    runs = {"this checkout": _child(args, here)}
    if args.compare_with:
        runs[f"compare: {args.compare_with}"] = _child(args, Path(args.compare_with).resolve())
    for label, rows in runs.items():
        print(f"\n### {label}\n\n{table(rows)}")
    if args.compare_with:
        (a, ra), (b, rb) = runs.items()
        print("\n| mode | XLA compile s, this | compare | ratio |\n|---|---|---|---|")
        for mode in dict.fromkeys(r["mode"] for r in ra):
            print(f"| {mode} | {_total(ra, mode):.2f} | {_total(rb, mode):.2f} | "
                  f"{_total(rb, mode) / max(_total(ra, mode), 1e-9):.2f}x |")
    result = dict(runs=runs, args={k: v for k, v in vars(args).items() if k != "func"},
                  load_average=os.getloadavg())
    (out / "programs.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nload average {os.getloadavg()[0]:.2f}; JSON: {out / 'programs.json'}")
    return result


CHILD_ARGS = ("modes", "layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "prompt_len",
              "max_new_tokens", "slots", "warm_up")

if __name__ == "__main__":  # the measuring process of _child
    print("ROWS " + json.dumps(measure(argparse.Namespace(**json.loads(sys.argv[1])))))
