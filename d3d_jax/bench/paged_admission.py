"""Prefix reuse and chunked prefill, measured through the scheduler the server runs, side by side
with another checkout's code (greedy, the demo target; plain mode, or sync with the demo drafter).

Each variant runs in a process of its own (``--base DIR`` puts another checkout's ``d3d_jax`` first
on the path for the ``base`` variant), one after the other, in one invocation:

* **chat**: a ~600-token system prompt and a 30-token question (turn 1, 48 tokens answered),
  then turn 2 (turn 1, its answer and another question): turn 2's time to first token, and its
  tokens (equal across variants);
* **arrival**: 4 streams running, a 900-token prompt arrives: the largest gap between two of the
  streams' deliveries from its arrival to its first token, and its time to first token.

``--set`` picks the variants: ``chunks`` (chunk budgets), ``prefix`` (plain, prefix caching on
and off) or ``sync`` (sync mode, prefix caching on and off: the drafter's pages are reused too).

    python d3d_jax/bench/paged_admission.py --base /tmp/base --set sync --out runs/bench_paged_admission
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {  # set: {name: (code, DecoderConfig fields)}
    "chunks": {
        "paged, budget 256 (default)": ("here", dict(kv_page_size=16)),
        "paged, budget 128": ("here", dict(kv_page_size=16, max_num_batched_tokens=128)),
        "paged, budget 512": ("here", dict(kv_page_size=16, max_num_batched_tokens=512)),
        "base, paged (chunks of 512)": ("base", dict(kv_page_size=16)),
    },
    "prefix": {
        "paged": ("here", dict(kv_page_size=16)),
        "paged, prefix caching off": ("here", dict(kv_page_size=16, enable_prefix_caching=False)),
        "base dense": ("base", {}),
    },
    "sync": {
        "sync, paged": ("here", dict(mode="sync", kv_page_size=16)),
        "sync, paged, prefix caching off": ("here", dict(mode="sync", kv_page_size=16,
                                                         enable_prefix_caching=False)),
        "base, sync, paged": ("base", dict(mode="sync", kv_page_size=16)),
    },
}


def _ids(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(16, vocab - 16, n).tolist()  # clear of the special tokens at either end


class Timed:
    """One request through the scheduler: the time of each delivery of tokens."""

    def __init__(self, sched, request):
        self.times, self.tokens, self.done = [], [], threading.Event()
        self.t0 = time.perf_counter()
        self.handle = sched.submit(request, self._sink)

    def _sink(self, ev) -> None:
        if ev.token_ids:
            self.times.append(time.perf_counter())
            self.tokens += ev.token_ids
        if ev.finished:
            self.done.set()

    @property
    def ttft(self) -> float:
        return self.times[0] - self.t0


def worker(args) -> dict:
    import numpy as np

    from d3d_jax.decoding.decoder import DecoderConfig, Request, SpecDecoder
    from d3d_jax.io.checkpoint import load_decoding_model
    from d3d_jax.serving.scheduler import Scheduler

    target = load_decoding_model(args.target, dtype="float32")
    vocab = target.config.vocab_size
    fields = {"mode": "plain", **json.loads(args.fields)}
    drafter = None if fields["mode"] == "plain" else load_decoding_model(args.drafter, dtype="float32")
    cfg = DecoderConfig(num_slots=8, max_cache_len=1024, **fields)
    dec = SpecDecoder(target, drafter, cfg)
    t = time.perf_counter()
    dec.warm_up()  # as the server does before READY
    warm_s = time.perf_counter() - t
    sched = Scheduler(dec).start()
    rng = np.random.default_rng(0)
    chats = []
    for _ in range(args.repeats if "chat" in args.parts else 0):
        system, q1, q2 = _ids(rng, 600, vocab), _ids(rng, 30, vocab), _ids(rng, 30, vocab)
        one = Timed(sched, Request(system + q1, 48))
        one.done.wait()
        two = Timed(sched, Request(system + q1 + one.tokens + q2, 48))
        two.done.wait()
        chats.append(dict(turn1_ttft_s=one.ttft, turn2_ttft_s=two.ttft, turn2_tokens=two.tokens))
    arrivals = []
    for _ in range(args.repeats if "arrival" in args.parts else 0):
        streams = [Timed(sched, Request(_ids(rng, 20, vocab), 1000 - 20 - 8)) for _ in range(4)]
        while min(len(s.times) for s in streams) < 8:
            time.sleep(0.01)
        long = Timed(sched, Request(_ids(rng, 900, vocab), 8))
        long.done.wait()
        end = long.times[0]
        gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if b > long.t0 and a < end]
        arrivals.append(dict(max_gap_s=max(gaps), ttft_s=long.ttft, long_tokens=long.tokens))
        for s in streams:
            s.handle.cancel()
        while sched.num_active or sched.num_queued:
            time.sleep(0.01)
    sched.stop()
    return dict(warm_up_s=warm_s, chats=chats, arrivals=arrivals, kv_stats=dec.page_stats() or {})


def driver(args) -> dict:
    out = {"loadavg_before": os.getloadavg(), "variants": {}}
    for name, (code, fields) in VARIANTS[args.set].items():
        if args.only and name not in args.only:
            continue
        env = dict(os.environ, PYTHONPATH=args.base if code == "base" else str(ROOT))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--target", args.target,
               "--drafter", args.drafter, "--repeats", str(args.repeats), "--parts", args.parts,
               "--fields", json.dumps(fields)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if res.returncode:
            raise SystemExit(f"{name}: {res.stderr[-3000:]}")
        out["variants"][name] = json.loads(res.stdout.strip().splitlines()[-1])
        out["variants"][name]["loadavg_after"] = os.getloadavg()
    return out


def summary(out: dict) -> str:
    rows = ["| variant | turn-2 TTFT (s) | turn-1 TTFT (s) | largest stream gap (s) | 900-token TTFT (s) | gap ÷ TTFT |",
            "|---|---|---|---|---|---|"]
    def med(values):
        values = list(values)
        return statistics.median(values) if values else float("nan")

    for name, v in out["variants"].items():
        gap, ttft = med(a["max_gap_s"] for a in v["arrivals"]), med(a["ttft_s"] for a in v["arrivals"])
        rows.append(f"| {name} | {med(c['turn2_ttft_s'] for c in v['chats']):.3f} | "
                    f"{med(c['turn1_ttft_s'] for c in v['chats']):.3f} | {gap:.3f} | {ttft:.3f} | {gap / ttft:.2f} |")
    texts = {name: [c["turn2_tokens"] for c in v["chats"]] + [a["long_tokens"] for a in v["arrivals"]]
             for name, v in out["variants"].items()}
    same = len({json.dumps(t) for t in texts.values()}) == 1
    work = [f"- {name}: prompt tokens the drafter's cache computed {kv['drafter_prefill_tokens_computed']}, "
            f"took from the prefix cache {kv['drafter_prefill_tokens_reused']}"
            for name, v in out["variants"].items() if "drafter_prefill_tokens_computed" in (kv := v["kv_stats"])]
    return ("\n".join(rows) + f"\n\nevery variant's turn-2 and 900-token outputs equal: {same}\n"
            + "".join(line + "\n" for line in work))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "artifacts" / "demo" / "models" / "target"))
    ap.add_argument("--base", default="/tmp/base", help="the other checkout (its d3d_jax) for 'base'")
    ap.add_argument("--drafter", default=str(ROOT / "artifacts" / "demo" / "drafters" / "small"))
    ap.add_argument("--set", choices=sorted(VARIANTS), default="prefix",
                    help="which variants: chunk budgets, prefix reuse (plain) or sync mode")
    ap.add_argument("--parts", default="chat,arrival", help="chat, arrival or both (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3, help="chats and arrivals per variant (medians)")
    ap.add_argument("--only", action="append", default=[], help="this variant only (a name; repeat for more)")
    ap.add_argument("--out", default="runs/bench_paged_admission")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fields", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    out = driver(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(out, indent=1))
    text = summary(out)
    (Path(args.out) / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # this folder's modules are not top-level ones
    main()
