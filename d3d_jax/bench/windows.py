"""``infer/bench.py windows``: a round's cost follows the live requests, not the slots.

For each mode, a decoder with ``--slots`` slots and ``a`` active requests (``a`` in
``--active``) against one with exactly ``a`` slots: seconds per round over ``--rounds``
consecutive ``step()`` calls (the steady state a server sees), the minimum of ``--repeats`` runs
interleaved between the two decoders, compiles excluded by warm-up rounds.  The ratio
``many slots ÷ exactly a slots`` is ~1 when the round runs over a window of the live rows
(the goal: at 16 slots with 1 active, an async step costs <= 1.3 x an async step at 1 slot).

    python infer/bench.py --cpu-threads 2 windows --modes plain,sync,async --slots 16 --active 1,4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "artifacts" / "demo"


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.description = __doc__
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--target", default=str(DEMO / "models" / "target"))
    ap.add_argument("--drafter", default=str(DEMO / "drafters" / "small"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", default="plain,sync,async")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--active", default="1")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per timed run")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed runs (minimum taken)")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--max-cache-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    return ap


def _decoder(target, drafter, mode: str, slots: int, active: int, args):
    """A ``slots``-slot decoder with ``active`` requests running, compiled and warmed."""
    import numpy as np

    from d3d_jax.decoding.decoder import DecoderConfig, Request, SpecDecoder

    # long enough for every timed round even if each commits a whole block: a request that
    # finished inside a timed run would make its rounds free (they measured 0.0 ms)
    cfg = DecoderConfig(mode=mode, num_slots=slots)
    n_new = 4 + (args.repeats + 1) * args.rounds * cfg.width
    cfg = dataclasses.replace(cfg, max_cache_len=max(args.max_cache_len,
                                                     args.prompt_len + n_new + 2 * cfg.width))
    dec = SpecDecoder(target, None if mode == "plain" else drafter, cfg)
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, target.config.vocab_size - 1, args.prompt_len).tolist()
    dec.insert(dec.prefill([Request(prompt, n_new, index=i) for i in range(active)]),
               list(range(slots - active, slots)))  # the last slots: placement packs them
    for _ in range(3):  # compiles and warms
        dec.step()
    return dec


def _seconds_per_round(dec, rounds: int) -> float:
    import jax

    jax.block_until_ready(dec.carry)  # rounds queued ahead by step: not this run's
    t0 = time.perf_counter()
    finished = 0
    for _ in range(rounds):
        finished += sum(out.finished for out in dec.step().values())
    jax.block_until_ready(dec.carry)
    if finished:  # its later rounds would run fewer rows than the table says
        raise RuntimeError(f"{finished} request(s) finished inside a timed run")
    return (time.perf_counter() - t0) / rounds


def step_seconds(target, drafter, mode: str, active: int, args) -> tuple[float, float]:
    """Seconds per round with ``active`` requests at ``args.slots`` slots and at ``active``
    slots: the minimum over ``args.repeats`` interleaved runs of ``args.rounds`` rounds each
    (side by side, so the machine's load weighs on both alike)."""
    decs = [_decoder(target, drafter, mode, args.slots, active, args),
            _decoder(target, drafter, mode, active, active, args)]
    best = [float("inf")] * 2
    for _ in range(args.repeats):
        for i, dec in enumerate(decs):
            best[i] = min(best[i], _seconds_per_round(dec, args.rounds))
    return best[0], best[1]


def main(args) -> int:
    from d3d_jax.io.checkpoint import load_model

    target = load_model(args.target, dtype=args.dtype, stacked=False)  # as the commands load them
    drafter = load_model(args.drafter, dtype=args.dtype, stacked=False)
    rows, report = [], {"settings": {k: v for k, v in vars(args).items() if k != "func"},
                        "load_avg_start": os.getloadavg(), "results": []}
    for mode in [m for m in args.modes.split(",") if m]:
        for active in [int(a) for a in args.active.split(",") if a]:
            many, exact = step_seconds(target, drafter, mode, active, args)
            r = dict(mode=mode, active=active, slots=args.slots, step_ms=1e3 * many,
                     step_ms_exact=1e3 * exact, ratio=many / exact)
            report["results"].append(r)
            rows.append(f"| {mode} | {active} | {r['step_ms']:.1f} | {r['step_ms_exact']:.1f} | {r['ratio']:.2f} |")
            print(rows[-1], flush=True)
    report["load_avg_end"] = os.getloadavg()
    print(f"\n| mode | active | ms/round at {args.slots} slots | ms/round at `active` slots | ratio |\n"
          "|---|---|---|---|---|\n" + "\n".join(rows))
    print(json.dumps(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0
