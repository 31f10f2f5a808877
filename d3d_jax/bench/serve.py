"""``infer/bench.py serve``: the paper's Table 2 form — 1, 4 and 16 concurrent clients against the
real server on localhost, for plain, sync and async decoding.

For each mode one ``infer/serve.py`` subprocess is started (``--port 0``, its ``READY`` line gives
the address).  Each of ``c`` clients (the official ``openai`` async client, streaming chat
completions) sends ``--requests-per-client`` requests one after another; every request decodes
exactly ``--max-tokens`` tokens greedily (``ignore_eos``), so all modes do the same work.

Reported per (mode, clients): throughput (completion tokens / wall time of the level), time to
first token and time per output token (p50 over requests; TPOT = (last token − first) / (n − 1)),
and τ.  Then speedup = mode tokens/s ÷ plain tokens/s at the same concurrency, and the
concurrency gain = tokens/s at the highest level ÷ at 1.

    python infer/bench.py --cpu-threads 2 serve                      # demo target + drafter `small`
    python infer/bench.py serve --target T --drafter D --tokenizer T --max-tokens 256 --num-slots 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from d3d_jax.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "artifacts" / "demo"


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.description = __doc__
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--target", default=str(DEMO / "models" / "target"))
    ap.add_argument("--drafter", default=str(DEMO / "drafters" / "small"))
    ap.add_argument("--tokenizer", default=str(DEMO / "tokenizer"))
    ap.add_argument("--modes", default="plain,sync,async")
    ap.add_argument("--concurrency", default="1,4,16", help="client counts, comma-separated")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (EOS ignored)")
    ap.add_argument("--num-slots", type=int, default=None, help="default: the highest concurrency")
    ap.add_argument("--prompts", default="shakespeare", help="benchmark whose first turns are the prompts")
    ap.add_argument("--passage-chars", type=int, default=300, help="prompt size for shakespeare/stdlib")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra infer/serve.py argument (repeatable), e.g. --server-arg=--max-model-len=2048")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mode (server start + load)")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    return ap


def _prompts(args, n: int) -> list[str]:
    from d3d_jax.evaluation import benchmarks as B

    samples = B.load_benchmark(args.prompts, template="plain", passage_chars=args.passage_chars, limit=n)
    if not samples:
        raise UsageError(f"benchmark {args.prompts!r} gave no prompts")
    return [s.turns[0] for s in samples]


class ServerProcess:
    """``infer/serve.py`` in a subprocess; ``url`` once it printed its READY line."""

    def __init__(self, argv: list[str], timeout_s: float, env: dict | None = None):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="d3d-serve-", suffix=".log", delete=False)
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "infer" / "serve.py"), "--port", "0", *argv],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT)
        self.url = self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                break
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if line.startswith("READY "):
                    return line.split()[1]
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"server did not become ready (exit {self.proc.returncode}):\n{self.log.read()[-4000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        os.unlink(self.log.name)


async def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    usage = spec = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if ch.usage is not None:
            usage, spec = ch.usage, (ch.model_extra or {}).get("spec_metrics") or {}
    n = usage.completion_tokens if usage else 0
    return {"tokens": n, "ttft_s": (first or time.perf_counter()) - t0,
            "tpot_s": (last - first) / (n - 1) if first is not None and n > 1 else None,
            "tau": spec.get("tau") if spec else None, "hit_rate": spec.get("hit_rate") if spec else None}


async def run_level(url: str, model: str, prompts: list[str], clients: int, per_client: int,
                    max_tokens: int, api_key: str = "none", timeout_s: float = 600.0) -> dict:
    """``clients`` concurrent clients, each sending ``per_client`` requests in a row."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s)

    async def worker(w: int) -> list[dict]:
        return [await _one(client, model, prompts[(w * per_client + k) % len(prompts)], max_tokens)
                for k in range(per_client)]

    t0 = time.perf_counter()
    per_worker = await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(clients))), timeout_s)
    wall = time.perf_counter() - t0
    await client.close()
    reqs = [r for rs in per_worker for r in rs]
    tokens = sum(r["tokens"] for r in reqs)
    taus = [r["tau"] for r in reqs if r["tau"] is not None]
    hits = [r["hit_rate"] for r in reqs if r["hit_rate"] is not None]
    tpots = [r["tpot_s"] for r in reqs if r["tpot_s"] is not None]
    return {"clients": clients, "requests": len(reqs), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_ms_p50": 1e3 * statistics.median(r["ttft_s"] for r in reqs),
            "tpot_ms_p50": 1e3 * statistics.median(tpots) if tpots else None,
            "tau": statistics.mean(taus) if taus else None,
            "hit_rate": statistics.mean(hits) if hits else None}


def _server_argv(args, mode: str, slots: int) -> list[str]:
    argv = ["--target", args.target, "--mode", mode, "--num-slots", str(slots), "--tokenizer", args.tokenizer,
            "--served-model-name", "bench"]
    return argv + (["--drafter", args.drafter] if mode != "plain" else []) + list(args.server_arg)


def measure_mode(args, mode: str, levels: list[int], prompts: list[str]) -> dict:
    slots = args.num_slots or max(levels)
    t0 = time.perf_counter()
    server = ServerProcess(_server_argv(args, mode, slots), args.timeout)
    try:
        started = time.perf_counter() - t0
        # untimed: every prompt once at full load, so each prompt-length bucket is compiled
        asyncio.run(run_level(server.url, "bench", prompts, max(levels), args.requests_per_client, 2,
                              timeout_s=args.timeout))
        out = {"server_start_s": started, "slots": slots, "levels": {}}
        for c in levels:
            res = asyncio.run(run_level(server.url, "bench", prompts, c, args.requests_per_client,
                                        args.max_tokens, timeout_s=args.timeout))
            out["levels"][str(c)] = res
            print(f"[serve] {mode:6s} {c:3d} clients: {res['tokens_per_s']:8.1f} tok/s  "
                  f"TTFT {res['ttft_ms_p50']:7.1f} ms  TPOT {res['tpot_ms_p50'] or 0:6.2f} ms", flush=True)
        return out
    finally:
        server.stop()


def tables(report: dict, levels: list[int]) -> str:
    rows = ["| mode | clients | tokens/s | TTFT p50 (ms) | TPOT p50 (ms) | τ | hit rate |", "|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for mode, m in report["modes"].items():
        for c in levels:
            r = m["levels"][str(c)]
            rows.append(f"| {mode} | {c} | {r['tokens_per_s']:.1f} | {r['ttft_ms_p50']:.1f} | "
                        f"{fmt(r['tpot_ms_p50'], '.2f')} | {fmt(r['tau'], '.2f')} | {fmt(r['hit_rate'], '.2f')} |")
    lo, hi = min(levels), max(levels)
    rows += ["", f"| method | speedup @{lo} | speedup @{hi} |", "|---|---|---|"]
    for mode, sp in report["speedup"].items():
        rows.append(f"| {mode} | {sp[str(lo)]:.2f}× | {sp[str(hi)]:.2f}× |")
    rows += ["", "concurrency gain (tokens/s at %d ÷ at %d): " % (hi, lo)
             + ", ".join(f"{m} {g:.2f}×" for m, g in report["concurrency_gain"].items())]
    return "\n".join(rows)


def main(args) -> int:
    levels = sorted({int(c) for c in args.concurrency.split(",") if c})
    modes = [m for m in args.modes.split(",") if m]
    if not levels or min(levels) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        raise UsageError("--concurrency, --requests-per-client and --max-tokens must be >= 1")
    if any(m not in ("plain", "sync", "async") for m in modes):
        raise UsageError(f"--modes: plain, sync or async, got {args.modes!r}")
    prompts = _prompts(args, max(levels) * args.requests_per_client)
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "modes": {}}
    for mode in modes:
        report["modes"][mode] = measure_mode(args, mode, levels, prompts)
    tps = {m: {str(c): r["levels"][str(c)]["tokens_per_s"] for c in levels} for m, r in report["modes"].items()}
    report["concurrency_gain"] = {m: t[str(max(levels))] / t[str(min(levels))] for m, t in tps.items()}
    if "plain" in tps:
        report["speedup"] = {m: {c: t[c] / tps["plain"][c] for c in t} for m, t in tps.items() if m != "plain"}
    else:
        report["speedup"] = {}
    print(tables(report, levels))
    print(json.dumps(report, default=float))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=float))
    return 0
