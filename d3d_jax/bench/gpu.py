"""``infer/bench.py gpu``: every GPU measure of the decoder, in one command, on whatever
accelerator is present (on a CPU it falls back to the tiny shapes).

Per target shape (Qwen3-8B and Qwen3-1.7B, random weights, batch 1, 64-token prompt):

* plain ms/token (decode phase: ``(T(n) - T(1)) / (n - 1)``, prefill excluded) against the HBM
  roofline ``weights bytes ÷ bandwidth`` (a device-to-device copy measured once, and the vendor's
  nominal figure where the device is known);
* sync and async (one shared device) speedups over plain with a real drafter's forwards and
  SIMULATED acceptance (τ 7.9, hit rate 0.7 by default: :mod:`~d3d_jax.bench.simulate`; random
  weights have no meaningful acceptance): end to end for the same n tokens (prefills included),
  and decode phase, ``τ · plain ms/token ÷ ms per round`` (rounds after the first);
* per-round parts on the device alone (``fori_loop`` timings, no dispatch): verify, packed branch
  forward, one sync draft; and the host's CPU per async round (``thread_time``);
* the projected two-device async round ``max(verify, packed) + (1 − hit)·draft + host`` and the
  one-device one ``verify + packed + (1 − hit)·draft + host`` (which explains the measured async).

Plus a drafter-size table for the first target: draft, packed and verify times per drafter and
the projected sync (``draft + verify``) and two-device async speedups over plain
(``τ · plain ms/token ÷ round``).  Timings: warm-up first (compilation excluded), then the median
of ``--repeats``.  Models are built one at a time and freed; a section that would not fit the
device memory or the time budget is skipped and recorded as such (never estimated).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d3d_jax.bench import gpu_report, simulate
from d3d_jax.bench.parts import (draft_seconds, fixed_inputs, median_s, packed_seconds,
                                  verify_seconds)

DEFAULT_OUT = "runs/bench_gpu"
# vendor datasheet HBM bandwidth (bytes/s), by device_kind substring; a lead, not a measurement
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "B200": 8.0e12}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    label: str
    config: str
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    targets: tuple[tuple[ModelSpec, ModelSpec], ...]  # (target, its drafter)
    table_drafters: tuple[ModelSpec, ...]  # drafter-size table, for the first target
    max_new: int
    bandwidth_mib: int
    identity_prompts: int  # prompts of the greedy-identity check (first target)


_MASK = ("mask_token_id=151669",)
GPU_PLAN = Plan(
    targets=((ModelSpec("Qwen3-8B", "qwen3-8b"), ModelSpec("1.7B", "d3d-drafter-1.7b")),
             (ModelSpec("Qwen3-1.7B", "qwen3-1.7b"), ModelSpec("1.7B", "d3d-drafter-1.7b"))),
    table_drafters=(ModelSpec("1.7B", "d3d-drafter-1.7b"), ModelSpec("4B", "qwen3-4b", _MASK),
                    ModelSpec("8B, 31 layers", "d3d-drafter-8b", ("num_layers=31",))),
    max_new=128, bandwidth_mib=2048, identity_prompts=20)
_TINY_MASK = ("mask_token_id=4095",)
CPU_PLAN = Plan(
    targets=((ModelSpec("tiny", "tiny"), ModelSpec("tiny-drafter", "tiny-drafter", _TINY_MASK)),),
    table_drafters=(ModelSpec("tiny-drafter", "tiny-drafter", _TINY_MASK),
                    ModelSpec("tiny, 3 layers", "tiny", ("num_layers=3",) + _TINY_MASK)),
    max_new=32, bandwidth_mib=64, identity_prompts=2)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--shapes", choices=("auto", "gpu", "cpu"), default="auto",
                   help="gpu: Qwen3-8B/1.7B shapes; cpu: tiny; auto: gpu shapes on an accelerator")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=None, help="tokens per timed run (default: 128 gpu, 32 cpu)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--branch-positions", type=int, default=12, help="C")
    p.add_argument("--branch-fanout", type=int, default=2, help="F")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measure (median)")
    p.add_argument("--loop-iters", type=int, default=8, help="forwards per on-device part timing")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip (and record) later sections once this much wall time is spent")
    p.add_argument("--skip-async", action="store_true", help="no measured async run")
    p.add_argument("--identity-prompts", type=int, default=None,
                   help="prompts of the greedy check: sync/async output == plain, real acceptance "
                        "(default 20 gpu, 2 cpu; 0 skips)")
    p.add_argument("--compile-cache", default=None,
                   help="persistent XLA cache on an accelerator (default OUT/xla_cache: a rerun "
                        "skips compiling; timings never include compilation either way); 'off'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for bench_gpu.json and bench_gpu.md")
    simulate.add_arguments(p, tau=7.9, hit_rate=0.7)
    return p


# --------------------------------------------------------------------------------------
# Timing and memory helpers
# --------------------------------------------------------------------------------------
def copy_bandwidth(mib: int, repeats: int) -> float:
    """Bytes/s of an elementwise pass over ``mib`` MiB (read + write counted), once per run."""
    x = jnp.ones((mib * 2 ** 20 // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * mib * 2 ** 20 / median_s(lambda: jax.block_until_ready(f(x)), max(repeats, 5), warmup=2)


def nominal_bandwidth(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in NOMINAL_BANDWIDTH.items() if k.lower() in kind.lower()), None)


def tree_bytes(tree) -> int:
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def free_device_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None  # CPU: no limit reported
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


class Budget:
    """Wall-time and memory gate for the optional sections; what it refuses is recorded."""

    def __init__(self, seconds: float):
        self.t0, self.seconds, self.skipped = time.perf_counter(), seconds, []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allow(self, name: str, est_s: float = 0.0, need_bytes: int = 0) -> bool:
        free = free_device_bytes()
        if free is not None and need_bytes > 0.9 * free:
            self.skipped.append(f"{name}: needs {need_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            return False
        if self.elapsed() + est_s > self.seconds:
            self.skipped.append(f"{name}: time budget ({self.elapsed():.0f} s spent + ~{est_s:.0f} s "
                                f"> {self.seconds:.0f} s)")
            return False
        return True


def model_config(spec: ModelSpec):
    from d3d_jax.config import load_model_config

    return load_model_config(spec.config, list(spec.overrides))


def param_bytes(spec: ModelSpec) -> int:
    """Parameter bytes of a model from its shapes alone (nothing allocated)."""
    from d3d_jax.model.qwen3 import abstract_model

    return tree_bytes(nnx.state(abstract_model(model_config(spec))))


def build(spec: ModelSpec, seed: int):
    from d3d_jax.model.qwen3 import init_model, unstacked

    model = unstacked(init_model(model_config(spec), seed))  # as the commands load one (decoders read it in place)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    return model


# --------------------------------------------------------------------------------------
# End-to-end decoding (the engine, compilation excluded)
# --------------------------------------------------------------------------------------
def decode_runs(target, prompt, n: int, repeats: int, *, cache_len: int, block: int, **kw) -> dict:
    """Median seconds of ``n``-token and 1-token runs (each shape warmed up first).  The decode
    phase (prefill excluded) is their difference: ``round_ms`` = ms per round after the first."""
    from d3d_jax.bench.generator import Generator

    generate = Generator()  # one decoder per shape, kept for the repeats

    def once(k):
        return generate(target, [prompt], max_new_tokens=k, max_cache_len=cache_len,
                        block_size=block, **kw)[0]

    med = {}
    for k in (n, 1):
        once(k)  # warm-up: compiles, never inside a timed run
        runs = [once(k) for _ in range(repeats)]
        med[k] = (float(np.median([r.metrics["batch_wall_s"] for r in runs])), runs[-1].metrics)
    (t_n, m), (t_1, m_1) = med[n], med[1]
    # a decode phase shorter than the timing noise has no round time (n/a), not a negative one
    round_ms = 1e3 * (t_n - t_1) / max(m["rounds"] - m_1["rounds"], 1) if t_n > t_1 else math.nan
    return {"s": t_n, "s_1_token": t_1, "tau": m["tau"], "tokens": m["num_tokens"], "rounds": m["rounds"],
            "round_ms": round_ms, "metrics": m}


def run_modes(target, drafter, prompt, args, sim, cache_len: int) -> dict:
    """Plain, sync and async (one shared device) decoding of one prompt, ``args.max_new`` tokens.
    Speedups: end to end (prefill included) and decode phase (τ · plain ms/token ÷ round ms)."""
    common = dict(cache_len=cache_len, block=args.block_size)
    kw = {"acceptance_override": sim} if sim is not None else {}
    modes = {"plain": {}, "sync": dict(mode="sync", drafter=drafter, **kw)}
    if not args.skip_async:
        modes["async"] = dict(mode="async", drafter=drafter, **kw,
                              branch_positions=args.branch_positions, branch_fanout=args.branch_fanout)
    res = {name: decode_runs(target, prompt, args.max_new, args.repeats, **common, **opts)
           for name, opts in modes.items()}
    plain = res["plain"]
    for name, r in res.items():
        m = r.pop("metrics")
        r["speedup"] = plain["s"] / r["s"]
        r["decode_speedup"] = r["tau"] * plain["round_ms"] / r["round_ms"]
        if name == "async":
            r.update(ratio_to_sync=res["sync"]["s"] / r["s"], hit_rate=m.get("hit_rate"),
                     sync_drafts=m.get("sync_drafts"), host_ms=1e3 * m.get("round_host_s", np.nan))
    return res


# --------------------------------------------------------------------------------------
# Parts and projection
# --------------------------------------------------------------------------------------
def measure_parts(target, drafter, ctx, cache_len, layout, args, verify_ms=None) -> dict:
    """Device-only ms of verify (once per target), the packed forward and one sync draft:
    ``draft`` after a round that committed ~τ tokens (as in the sync loop), ``draft_miss`` from
    a committed drafter cache (an async miss)."""
    it, rep, b = args.loop_iters, args.repeats, args.block_size
    if verify_ms is None:
        verify_ms = 1e3 * verify_seconds(target, ctx, cache_len, b, it, rep)
    committed = min(b, max(int(round(args.simulate_tau or b)), 1))
    draft, miss = draft_seconds(drafter, ctx, cache_len, b, it, rep, (committed, 0))
    return {"verify": verify_ms, "packed": 1e3 * packed_seconds(drafter, ctx, cache_len, layout, it, rep),
            "draft": 1e3 * draft, "draft_miss": 1e3 * miss}


def project(parts_ms: dict, tau: float, plain_ms: float, hit: float) -> dict:
    """Rounds from measured parts (ms) and the speedups they imply (τ tokens per round)."""
    v, p, host = parts_ms["verify"], parts_ms["packed"], parts_ms["host"]
    miss = parts_ms["draft_miss"]
    two = max(v, p) + (1 - hit) * miss + host
    one = v + p + (1 - hit) * miss + host  # one device: verify and packed run in series
    sync = parts_ms["draft"] + v  # the fused sync loop: no host work per round
    return {"hit_rate": hit, "tau": tau, "plain_ms_per_token": plain_ms, "sync_round_ms": sync,
            "two_device_async_round_ms": two, "one_device_async_round_ms": one,
            "sync_speedup": tau * plain_ms / sync, "two_device_async_speedup": tau * plain_ms / two,
            "one_device_async_speedup": tau * plain_ms / one, "two_device_async_over_sync": sync / two}


# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Setup:
    args: argparse.Namespace
    sim: simulate.SimulatedAcceptance | None
    layout: object
    budget: Budget
    bandwidth: float  # measured bytes/s
    nominal: float | None
    identity_prompts: int = 0


def measure_target(tspec: ModelSpec, dspec: ModelSpec, st: Setup, table: tuple = ()):
    """Every core measure of one target shape, plus the drafter-size table for ``table`` (the
    drafters besides ``dspec``).  Returns ``(result, target)``: the caller frees the target."""
    a = st.args
    target, drafter = build(tspec, a.seed), build(dspec, a.seed + 1)
    wbytes = tree_bytes(nnx.state(target))
    cache_len = cache_length(a)
    prompt = fixed_inputs(drafter.config, (a.prompt_len,), a.seed).tolist()
    ctx = a.prompt_len + a.max_new // 2  # a representative context: halfway through the output
    res = {"label": tspec.label, "config": tspec.config, "drafter": dspec.label, "weights_bytes": wbytes,
           "cache_len": cache_len, "context_for_parts": ctx}
    res.update(run_modes(target, drafter, prompt, a, st.sim, cache_len))
    plain_ms = res["plain"]["round_ms"]
    res["roofline"] = {"ms_per_token_measured_bw": 1e3 * wbytes / st.bandwidth}
    if st.nominal:
        res["roofline"]["ms_per_token_nominal_bw"] = 1e3 * wbytes / st.nominal
    for k in list(res["roofline"]):
        res["roofline"][k.replace("ms_per_token", "ratio")] = res["roofline"][k] / plain_ms
    parts = measure_parts(target, drafter, ctx, cache_len, st.layout, a)
    del drafter
    gc.collect()
    parts["host"] = res.get("async", {}).get("host_ms", float("nan"))
    res["parts_ms"] = parts
    res["parts_ratios"] = {"packed_over_verify": parts["packed"] / parts["verify"],
                           "draft_miss_over_verify": parts["draft_miss"] / parts["verify"]}
    tau, hit = res["sync"]["tau"], _hit_rate(st, res)
    res["projected"] = project(parts, tau, plain_ms, hit)
    if table:
        res["drafter_table"] = [_row(dspec, parts, tau, plain_ms, hit)] + drafter_rows(
            target, table, parts, tau, plain_ms, hit, ctx, cache_len, st)
    return res, target


def cache_length(args) -> int:
    return -(-(args.prompt_len + args.max_new + 2 * args.block_size) // 16) * 16


def measure_extras(res: dict, target, st: Setup) -> None:
    """The first target's checks, last (each skipped if the budget is spent): greedy identity
    with real acceptance, and the verify's cost with and without the simulation."""
    a = st.args
    if st.identity_prompts and st.budget.allow("greedy identity", est_s=60.0):
        res["identity"] = identity_counts(target, st.identity_prompts, a, cache_length(a))
    if st.sim is not None and st.budget.allow("verify cost comparison"):
        res["verify_cost"] = simulate.verify_cost_comparison(
            target, st.sim, block_size=a.block_size, context=a.prompt_len + a.max_new // 2,
            cache_len=cache_length(a), repeats=max(a.repeats, 20))


def identity_counts(target, n: int, args, cache_len: int) -> dict:
    """How many of ``n`` prompts decode to plain's exact greedy tokens in sync and async mode,
    with REAL acceptance: a replay drafter proposes plain's own output, so every round accepts
    long runs and any rounding difference between a 1-token and a B-token forward shows."""
    from d3d_jax.bench.generator import Generator
    from d3d_jax.decoding.async_replay import AsyncReplayDrafter
    from d3d_jax.decoding.engine import summarize_outputs

    generate = Generator()
    vocab = target.config.vocab_size
    rng = np.random.default_rng(args.seed + 7)
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(n)]
    common = dict(max_new_tokens=args.max_new, max_cache_len=cache_len, block_size=args.block_size,
                  batch_size=1)
    plain = [o.token_ids for o in generate(target, prompts, **common)]
    drafter = AsyncReplayDrafter(plain, vocab, hit_rate=0.7, seed=args.seed)
    out = {"prompts": n, "acceptance": "real acceptance, a replay of plain's output"}
    for mode, kw in (("sync", {}), ("async", dict(branch_positions=args.branch_positions,
                                                  branch_fanout=args.branch_fanout))):
        outs = generate(target, prompts, mode=mode, drafter=drafter, **common, **kw)
        out[mode] = {"same_as_plain": sum(o.token_ids == p for o, p in zip(outs, plain)),
                     "tau": summarize_outputs(outs)["tau"]}
    return out


def _hit_rate(st: Setup, res: dict) -> float:
    """The hit rate of the projection: the simulated one, else the measured one."""
    if st.sim is not None and st.sim.hit_rate is not None:
        return st.sim.hit_rate
    return res.get("async", {}).get("hit_rate") or float("nan")


def _row(spec: ModelSpec, parts: dict, tau: float, plain_ms: float, hit: float) -> dict:
    proj = project(parts, tau, plain_ms, hit)
    return {"drafter": spec.label, "config": spec.config, "overrides": list(spec.overrides),
            "params_bytes": param_bytes(spec), **{f"{k}_ms": v for k, v in parts.items()},
            "projected_sync_speedup": proj["sync_speedup"],
            "projected_two_device_async_speedup": proj["two_device_async_speedup"],
            "two_device_async_over_sync": proj["two_device_async_over_sync"]}


def drafter_rows(target, specs, main_parts, tau, plain_ms, hit, ctx, cache_len, st: Setup) -> list:
    """One row per drafter (built, timed, freed one at a time); verify and host are target-side:
    as measured with the main drafter."""
    rows, last_s = [], 0.0
    for spec in specs:
        if not st.budget.allow(f"drafter table: {spec.label}", est_s=last_s, need_bytes=param_bytes(spec)):
            continue
        t0 = time.perf_counter()
        drafter = build(spec, st.args.seed + 2)
        parts = measure_parts(target, drafter, ctx, cache_len, st.layout, st.args,
                              verify_ms=main_parts["verify"])
        parts["host"] = main_parts["host"]
        del drafter
        gc.collect()
        rows.append(_row(spec, parts, tau, plain_ms, hit))
        last_s = time.perf_counter() - t0
    return rows


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------
def _environment() -> dict:
    import flax

    dev = jax.devices()[0]
    return {"platform": dev.platform, "device_kind": getattr(dev, "device_kind", ""),
            "device_count": jax.device_count(), "jax": jax.__version__, "flax": flax.__version__,
            "python": platform.python_version()}


def run(args: argparse.Namespace) -> dict:
    from d3d_jax.decoding.branches import BranchLayout

    sim = simulate.from_args(args)  # bad flags fail here, before any model is built
    layout = BranchLayout(args.block_size, args.branch_positions, args.branch_fanout)
    layout.validate(prefix="bench gpu")
    if sim is not None:
        sim.check_block(args.block_size, asynchronous=not args.skip_async)
    on_cpu = jax.devices()[0].platform == "cpu"
    if not on_cpu and args.compile_cache != "off":
        jax.config.update("jax_compilation_cache_dir", args.compile_cache or str(Path(args.out) / "xla_cache"))
    plan = CPU_PLAN if args.shapes == "cpu" or (args.shapes == "auto" and on_cpu) else GPU_PLAN
    args.max_new = args.max_new or plan.max_new
    budget = Budget(args.budget_s)
    st = Setup(args, sim, layout, budget, copy_bandwidth(plan.bandwidth_mib, args.repeats),
               nominal_bandwidth(jax.devices()[0]),
               plan.identity_prompts if args.identity_prompts is None else args.identity_prompts)
    result = {"environment": _environment(), "simulated_acceptance": simulate.record(sim),
              "settings": {k: v for k, v in vars(args).items() if k != "func"},
              "shapes": "tiny CPU fallback" if plan is CPU_PLAN else "Qwen3 shapes",
              "copy_bandwidth_GBps": st.bandwidth / 1e9,
              "nominal_bandwidth_GBps": st.nominal / 1e9 if st.nominal else None, "targets": []}
    print(f"bench gpu: {result['environment']}\n{simulate.header(sim)}", flush=True)
    last_s, first = 0.0, None
    for i, (tspec, dspec) in enumerate(plan.targets):
        need = param_bytes(tspec) + param_bytes(dspec)
        if not budget.allow(f"target {tspec.label}", est_s=last_s, need_bytes=need):
            continue
        t0 = time.perf_counter()
        table = tuple(s for s in plan.table_drafters if s != dspec) if i == 0 else ()
        res, target = measure_target(tspec, dspec, st, table=table)
        result["targets"].append(res)
        if i == 0:  # kept for the extras, which come last: every target's core measures first
            first = (res, target)
        del target
        gc.collect()
        last_s = (time.perf_counter() - t0) * 0.5  # later targets are smaller, without the table
        print(f"  {tspec.label}: done at {budget.elapsed():.0f} s", flush=True)
    if first is not None:
        measure_extras(*first, st)
        del first
    result["skipped"] = budget.skipped
    result["elapsed_s"] = budget.elapsed()
    return result


def main(args: argparse.Namespace) -> dict:
    """Entry point of ``infer/bench.py gpu``."""
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(result, indent=2, default=str))
    md = gpu_report.format_markdown(result)
    (out / "bench_gpu.md").write_text(md)
    print("\n" + md + f"\nwrote {out / 'bench_gpu.json'} and {out / 'bench_gpu.md'} "
          f"in {result['elapsed_s']:.0f} s", flush=True)
    return result
