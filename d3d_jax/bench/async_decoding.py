"""Benchmark of asynchronous drafting (spec §5, the paper's Figure 3): ``infer/bench.py async``.

One run: plain, sync and async decoding of the same prompts (tokens/s, τ, hit rate, per-round
times), then a sweep over branch positions C × fan-out F, saved as JSON and as a PNG of speedup
and hit rate against the branch budget ``N_async = B·((C-1)·F + 2)``.

Weights are random, so acceptance is set, not learned: a :class:`CostedReplayDrafter` proposes the
target's own greedy continuation with a per-token error rate chosen for the requested τ, and its
branch alternatives catch the target's token at the requested hit rate — while running the real
drafter model's forwards (``cost_model``), so every timing is a true cost.
Compilation is excluded: each configuration is warmed up on the same shapes first.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from d3d_jax.bench import simulate

DEFAULT_OUT = "runs/bench_async"


def error_rate_for_tau(tau: float, block_size: int) -> float:
    """Per-token error rate e with expected acceptance length Σ_{k<B} (1-e)^k = ``tau``."""
    if not 1.0 <= tau <= block_size:
        raise ValueError(f"--tau must be in [1, block size {block_size}], got {tau}")

    def expected(e):
        return sum((1 - e) ** k for k in range(block_size))

    lo, hi = 0.0, 1.0  # expected() falls from B to 1
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) > tau else (lo, mid)
    return (lo + hi) / 2


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--target", default="tiny", help="model config name/YAML for the target")
    p.add_argument("--drafter", default="tiny-drafter", help="model config name/YAML for the drafter")
    p.add_argument("--dtype", default=None, help="compute/param dtype for both (e.g. bfloat16)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tau", type=float, default=7.9, help="target acceptance length of the replay")
    p.add_argument("--hit-rate", type=float, default=0.7,
                   help="replay: P(first alternative is the target's token); geometric after")
    p.add_argument("--branch-positions", type=int, default=12, help="C")
    p.add_argument("--branch-fanout", type=int, default=2, help="F")
    p.add_argument("--sweep-c", default="4,8,12,16")
    p.add_argument("--sweep-f", default="1,2,3")
    p.add_argument("--target-devices", type=int, default=0)
    p.add_argument("--drafter-devices", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT)
    simulate.add_arguments(p)  # instead of the replay: the real drafter, simulated acceptance
    return p


def _model(name: str, dtype: str | None, seed: int):
    from d3d_jax.config import load_model_config
    from d3d_jax.model.qwen3 import init_model, unstacked

    overrides = [f"dtype={dtype}", f"param_dtype={dtype}"] if dtype else []
    return unstacked(init_model(load_model_config(name, overrides), seed))  # as the commands load one


def _summary(outs) -> dict:
    from d3d_jax.decoding import metrics as M

    s = M.summarize([o.metrics for o in outs])
    m0 = outs[0].metrics
    for k in ("hit_rate_batch", "sync_drafts", "async_rounds", "n_async", "round_verify_s",
              "round_packed_s", "round_sync_s", "round_wait_s", "round_host_s", "round_gap_s",
              "round_gap_max_s", "sync_draft_s", "loop_s"):
        if k in m0:
            s[k] = m0[k] if k == "n_async" else (
                float(np.mean([o.metrics[k] for o in outs])) if k.startswith("round") else m0[k])
    hits = [o.metrics["hits"] for o in outs if "hits" in o.metrics]
    judged = [o.metrics["hits"] + o.metrics["misses"] for o in outs if "hits" in o.metrics]
    if judged and sum(judged):
        s["hit_rate"] = sum(hits) / sum(judged)
    return s


class _Bench:
    """Models, prompts and the generate calls of one benchmark run (compiled once per shape)."""

    def __init__(self, args):
        from d3d_jax.parallel.sharding import resolve_slices

        self.args, B = args, args.block_size
        self.devices = (None, None) if args.target_devices == 0 and args.drafter_devices == 0 else (
            args.target_devices, args.drafter_devices)
        # fail now on bad slices and simulation flags, before building models
        self.t_devs, self.d_devs = resolve_slices(*self.devices)
        self.sim = simulate.from_args(args)
        if self.sim is not None:
            self.sim.check_block(B, asynchronous=True)
        self.err = error_rate_for_tau(args.tau, B)
        self.target = _model(args.target, args.dtype, args.seed)
        self.drafter_model = _model(args.drafter, args.dtype, args.seed + 1)
        if self.target.config.vocab_size != self.drafter_model.config.vocab_size:
            raise ValueError("target and drafter configs must share vocab_size")
        self.vocab = self.target.config.vocab_size
        mask = self.drafter_model.config.mask_token_id
        self.mask = self.vocab - 1 if mask is None else mask
        rng = np.random.default_rng(args.seed)
        self.prompts = [rng.integers(0, self.mask, args.prompt_len).tolist() for _ in range(args.prompts)]
        cache_len = -(-(args.prompt_len + args.max_new + 2 * B) // 16) * 16
        self.common = dict(max_cache_len=cache_len, batch_size=args.batch_size, block_size=B)
        self.refs = None
        from d3d_jax.bench.generator import Generator

        self.generate = Generator()  # the decoders of every run, each compiled once

    def timed(self, mode, drafter=None, warm=None, warm_up=True, **kw):
        generate = self.generate
        a = self.args
        if mode != "plain" and self.sim is not None:
            kw = dict(kw, acceptance_override=self.sim, mask_token_id=self.mask)
        if warm_up:
            generate(self.target, self.prompts, mode=mode, drafter=warm or drafter,
                     max_new_tokens=min(a.max_new, 2 * a.block_size + 1), **self.common, **kw)
        t0 = time.perf_counter()
        outs = generate(self.target, self.prompts, mode=mode, drafter=drafter,
                        max_new_tokens=a.max_new, **self.common, **kw)
        s = _summary(outs)
        s["call_s"] = time.perf_counter() - t0
        if mode == "plain":
            self.refs = [o.token_ids for o in outs]
        return s

    def replay(self, hit_rate):
        from d3d_jax.decoding.async_replay import CostedReplayDrafter

        if self.sim is not None:  # the real drafter; acceptance and hits come from the simulation
            return self.drafter_model
        return CostedReplayDrafter(self.refs, self.vocab, self.drafter_model, error_rate=self.err,
                                   hit_rate=hit_rate, seed=self.args.seed, mask_token_id=self.mask)

    def run_async(self, lay, profile=True, warm_up=True):
        """``profile``: a timeline (ready times from helper threads) for the per-round parts; a
        lean run (no timeline) measures tokens/s and the main thread's CPU per round as used."""
        dev_kw = {} if self.devices == (None, None) else dict(
            target_devices=self.args.target_devices, drafter_devices=self.args.drafter_devices)
        return self.timed("async", self.replay(self.args.hit_rate), warm=self.replay(0.0),
                          warm_up=warm_up, timeline=[] if profile else None,
                          branch_positions=lay.positions, branch_fanout=lay.fanout, **dev_kw)


def _acceptance(args, bench) -> str:
    if bench.sim is not None:
        return simulate.header(bench.sim)
    return f"replay drafter: τ≈{args.tau} (error rate {bench.err:.4f}), hit rate {args.hit_rate}"


def _print_main(rows: list[dict], main: dict, acceptance: str) -> None:
    print(f"\nacceptance: {acceptance}\n{'mode':<18}{'tokens/s':>10}{'tau':>7}{'hit rate':>10}{'speedup':>9}")
    for r in rows:
        hr = "" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        print(f"{r['mode']:<18}{r['tokens_per_s']:>10.1f}{r['tau']:>7.2f}{hr:>10}{r['speedup']:>9.2f}")
    print("async per-round means (s): " + ", ".join(
        f"{k[6:]}={main[k]:.4f}" for k in ("round_verify_s", "round_packed_s", "round_sync_s",
                                           "round_wait_s"))
          + f"; one sync draft {main['sync_draft_s']:.4f}; sync drafts {main['sync_drafts']} of "
          f"{main['async_rounds']} rounds; N_async={main['n_async']}; round loop per batch "
          f"{main['loop_s']:.4f} s", flush=True)
    print(f"async host: main-thread CPU per round (thread_time) {1e3 * main['round_host_s']:.3f} ms "
          f"({1e3 * main['round_host_profiled_s']:.3f} ms with the timeline); idle gap between "
          f"rounds (next verify dispatched after the previous round was ready) mean "
          f"{1e3 * main['round_gap_s']:.3f} ms, max {1e3 * main['round_gap_max_s']:.3f} ms",
          flush=True)


def _sweep(bench: _Bench, layouts, plain: dict, sync: dict) -> list[dict]:
    try:
        from tqdm import tqdm
        it = tqdm(layouts, desc="C×F sweep")
    except ImportError:  # pragma: no cover
        it = layouts
    sweep = []
    for lay in it:
        s = bench.run_async(lay)
        sweep.append(dict(C=lay.positions, F=lay.fanout, budget=lay.budget,
                          tokens_per_s=s["tokens_per_s"], tau=s["tau"], hit_rate=s.get("hit_rate"),
                          speedup=s["tokens_per_s"] / plain["tokens_per_s"],
                          speedup_vs_sync=s["tokens_per_s"] / sync["tokens_per_s"],
                          round_verify_s=s["round_verify_s"], round_packed_s=s["round_packed_s"],
                          round_sync_s=s["round_sync_s"], round_wait_s=s["round_wait_s"]))
    print(f"\n{'C':>3}{'F':>3}{'budget':>8}{'tok/s':>9}{'speedup':>9}{'hit rate':>10}{'packed s':>10}")
    for r in sweep:
        print(f"{r['C']:>3}{r['F']:>3}{r['budget']:>8}{r['tokens_per_s']:>9.1f}{r['speedup']:>9.2f}"
              f"{r['hit_rate'] if r['hit_rate'] is not None else float('nan'):>10.3f}"
              f"{r['round_packed_s']:>10.4f}")
    return sweep


def run(args) -> dict:
    from d3d_jax.decoding.branches import BranchLayout

    B = args.block_size
    layouts = [BranchLayout(B, c, f) for c in map(int, args.sweep_c.split(","))
               for f in map(int, args.sweep_f.split(","))]
    main_layout = BranchLayout(B, args.branch_positions, args.branch_fanout)
    for lay in [main_layout] + layouts:
        lay.validate(prefix="bench")
    bench = _Bench(args)
    acceptance = _acceptance(args, bench)
    print(f"bench async: target={args.target} drafter={args.drafter} B={B}; {acceptance}; target "
          f"devices {[d.id for d in bench.t_devs]}, drafter devices {[d.id for d in bench.d_devs]}",
          flush=True)
    plain = bench.timed("plain")
    sync = bench.timed("sync", bench.replay(args.hit_rate))
    main = bench.run_async(main_layout, profile=False)
    parts = bench.run_async(main_layout, warm_up=False)
    main.update({k: v for k, v in parts.items() if k.startswith("round_") and k != "round_host_s"},
                sync_draft_s=parts["sync_draft_s"], round_host_profiled_s=parts["round_host_s"])
    rows = [dict(mode=name, tokens_per_s=s["tokens_per_s"], tau=s["tau"], hit_rate=s.get("hit_rate"),
                 speedup=s["tokens_per_s"] / plain["tokens_per_s"])
            for name, s in (("plain", plain), ("sync", sync),
                            (f"async C={main_layout.positions} F={main_layout.fanout}", main))]
    _print_main(rows, main, acceptance)
    sweep = _sweep(bench, layouts, plain, sync)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(args=vars(args), simulated_acceptance=simulate.record(bench.sim),
                  replay_error_rate=None if bench.sim else bench.err, plain=plain, sync=sync,
                  async_main=main, table=rows, sweep=sweep,
                  devices=dict(target=[d.id for d in bench.t_devs], drafter=[d.id for d in bench.d_devs],
                               platform=bench.t_devs[0].platform))
    (out / "bench_async.json").write_text(json.dumps(result, indent=2, default=str))
    png = plot_sweep(sweep, out / "bench_async.png",
                     title=f"{args.target} + {args.drafter}, B={B}; {acceptance[:60]}")
    print(f"\nwrote {out / 'bench_async.json'} and {png}")
    return result


def plot_sweep(sweep: list[dict], path: Path, title: str = "") -> Path:
    """Speedup and hit rate against the branch budget, one line per fan-out F (Figure 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for f in sorted({r["F"] for r in sweep}):
        pts = sorted((r for r in sweep if r["F"] == f), key=lambda r: r["budget"])
        x = [r["budget"] for r in pts]
        for ax, key in zip(axes, ("speedup", "hit_rate")):
            y = [np.nan if r[key] is None else r[key] for r in pts]
            ax.plot(x, y, marker="o", label=f"F={f}")
            for r, yy in zip(pts, y):
                ax.annotate(f"C={r['C']}", (r["budget"], yy), textcoords="offset points",
                            xytext=(3, 4), fontsize=7)
    axes[0].set_ylabel("speedup vs plain decoding")
    axes[1].set_ylabel("branch hit rate")
    for ax in axes:
        ax.set_xlabel("N_async = B·((C−1)·F + 2) tokens")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> dict:
    """Entry point of ``infer/bench.py async`` (parsed by :func:`add_arguments`)."""
    return run(args)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(add_arguments(argparse.ArgumentParser(prog="bench.py async")).parse_args())
