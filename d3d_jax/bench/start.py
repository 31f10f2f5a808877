"""``infer/bench.py start``: how long ``infer/serve.py`` takes to answer, on a cold cache and then
warm, side by side in one run.

One fresh ``--compile-cache`` directory; ``--starts`` starts of the same server command in a row
(the first cold: nothing compiled yet; the rest warm).  For each start: seconds until its
``READY`` line (process start included), the first request (a 4-token prompt, 24 tokens, greedy),
the same again, a 264-token prompt, and the files written anywhere under the cache directory (JAX's
compilation cache and the program store: every compile writes one) by the first request and in
the ``--settle`` seconds after ``READY`` (background reads and compiles).  Then warm ÷ cold.

    python infer/bench.py start                                   # the demo server (sync, 8 slots)
    python infer/bench.py start --starts 4 --server-args "--mode plain"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.description = __doc__
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--config", default=str(ROOT / "configs" / "serve" / "demo.yaml"), help="server --config")
    ap.add_argument("--server-args", default="", help="more server flags, one string")
    ap.add_argument("--starts", type=int, default=3, help="starts in a row (the first is cold)")
    ap.add_argument("--cache", default=None, help="cache directory (default: a fresh temporary one)")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds to watch the cache after the requests")
    ap.add_argument("--out", default="runs/bench_start", help="JSON and table go here")
    return ap


def _files(cache: Path) -> set:
    return {p for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".")}


def _complete(url: str, prompt_len: int) -> float:
    body = json.dumps({"model": _model(url), "prompt": [5] * prompt_len, "max_tokens": 24,
                       "temperature": 0}).encode()
    t0 = time.perf_counter()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    json.loads(urllib.request.urlopen(req, timeout=900).read())
    return time.perf_counter() - t0


def _model(url: str) -> str:
    return json.loads(urllib.request.urlopen(url + "/v1/models", timeout=60).read())["data"][0]["id"]


def one_start(argv: list[str], cache: Path, settle: float) -> dict:
    from d3d_jax.bench.serve import ServerProcess

    t0 = time.perf_counter()
    server = ServerProcess(argv, timeout_s=1800)
    try:
        row = dict(ready_s=time.perf_counter() - t0, load_avg=os.getloadavg()[0])
        before = _files(cache)
        row["first_request_s"] = _complete(server.url, 4)
        row["files_by_first_request"] = len(_files(cache) - before)
        row["second_request_s"] = _complete(server.url, 4)
        row["prompt_264_s"] = _complete(server.url, 264)
        time.sleep(settle)
        row["files_after_ready"] = len(_files(cache) - before)
    finally:
        server.stop()
    return row


def main(args) -> dict:
    from d3d_jax.errors import UsageError

    if args.starts < 2:
        raise UsageError(f"--starts {args.starts}: at least 2 (a cold start and a warm one)")
    cache = Path(args.cache or tempfile.mkdtemp(prefix="d3d-start-cache-"))
    if cache.exists() and any(cache.iterdir()):
        raise UsageError(f"--cache {cache}: not empty (the first start must be cold)")
    argv = ["--config", args.config, "--compile-cache", str(cache), *shlex.split(args.server_args)]
    rows = []
    for i in range(args.starts):
        rows.append(dict(start="cold" if i == 0 else f"warm {i}", **one_start(argv, cache, args.settle)))
        print(json.dumps(rows[-1]), flush=True)
    warm = [r["ready_s"] for r in rows[1:]]
    result = dict(command=argv, starts=rows, warm_ready_median_s=statistics.median(warm),
                  warm_over_cold=statistics.median(warm) / rows[0]["ready_s"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "start.json").write_text(json.dumps(result, indent=1))
    table = _table(rows, result)
    (out / "start.md").write_text(table)
    print(table)
    return result


def _table(rows: list[dict], result: dict) -> str:
    head = ("| start | READY (s) | first request (s) | second (s) | 264-token prompt (s) | "
            "files by the first request | files after READY | load |\n|---|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['start']} | {r['ready_s']:.1f} | {r['first_request_s']:.2f} | "
                   f"{r['second_request_s']:.2f} | {r['prompt_264_s']:.2f} | {r['files_by_first_request']} | "
                   f"{r['files_after_ready']} | {r['load_avg']:.1f} |\n" for r in rows)
    return head + body + (f"\nwarm READY median {result['warm_ready_median_s']:.1f} s = "
                          f"{result['warm_over_cold']:.3f} x cold\n")
