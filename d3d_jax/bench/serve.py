"""``infer/bench.py serve``: the paper's Table 2 form — concurrent clients against the real server
on localhost, for plain, sync, async and auto decoding.

For each mode one ``infer/serve.py`` subprocess is started (``--port 0``, its ``READY`` line gives
the address; its start-up compiles every round program, and auto times them), one after another,
and all stay up.  Then every level runs on every mode side by side, ``--repeats`` times, the
modes' order reversed each time (:func:`schedule`): a ratio is never between runs that were
minutes apart on a machine whose speed drifts (two sequential runs of this benchmark, mode after
mode, gave auto 1.11× and 0.94× plain at 16 clients with the same choices).  Each of ``c``
clients (the official ``openai`` async client, streaming chat completions) sends
``--requests-per-client`` requests one after another (more at low concurrency, so every level has
``--min-requests``); every request decodes exactly ``--max-tokens`` tokens greedily
(``ignore_eos``), so all modes do the same work.

Reported per (mode, clients), over the repeats: throughput (completion tokens / wall time), time to
first token and time per output token (p50 over requests; TPOT = (last token − first) / (n − 1)),
τ, the rounds per mode and geometry with the tokens they committed against the tokens auto
predicted (the server's ``/metrics``, before and after the level), and the requests' mode mix.
Then speedup = mode tokens/s ÷ plain tokens/s at the same concurrency, auto ÷ the best fixed mode,
each with its range over the repeats.

``--mixed N``: one more level at N clients where half the requests are the benchmark's prompts
and half random token ids, sampled at ``--mixed-temperature`` (default 1; each request with its
own seed, the same in every mode): total tokens/s per mode, and auto's mode mix per kind of
request.  Sampled, because greedy the drafter is not useless on them: the demo target's
greedy continuation of random ids falls into a repeated phrase that drafter ``small`` predicts
(1.94 tokens a row per sync/4 round, against 2.27 for the Shakespeare prompts and 1.03 for the
same ids sampled at temperature 1; 48 tokens each, 16 rows).  ``--mixed-temperature 0`` gives
the greedy level.  ``--random N``: a level at N clients of random token ids only (same sampling).
Every request's text is compared with plain mode's for the same prompt (``texts_differ``).
``--baseline DIR``: one more server, ``auto-base``, in auto mode from the checkout ``DIR`` (its
code, the same models), side by side with the others: a change to auto against the code before it.

    python infer/bench.py --cpu-threads 2 serve                      # demo target + drafter `small`
    python infer/bench.py serve --target T --drafter D --tokenizer T --max-tokens 256 --num-slots 32
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from d3d_jax.bench.serve_report import BASE, fmt_mix, fmt_rounds, ratios, tables
from d3d_jax.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "artifacts" / "demo"
MODES = ("plain", "sync", "async", "auto")
COUNTERS = ("rounds", "tokens", "predicted_tokens", "timed_rounds", "seconds", "predicted_seconds")


class IdPrompt(NamedTuple):
    """Token ids sent as a completion, sampled at ``temperature`` with ``seed`` (0: greedy)."""

    ids: list
    temperature: float = 0.0
    seed: int = 0


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.description = __doc__
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--target", default=str(DEMO / "models" / "target"))
    ap.add_argument("--drafter", default=str(DEMO / "drafters" / "small"))
    ap.add_argument("--tokenizer", default=str(DEMO / "tokenizer"))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--concurrency", default="1,4,8,16,32", help="client counts, comma-separated")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=12,
                    help="at least this many requests per level (more per client at low concurrency)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="each level this many times per mode, the modes' order reversed every other time")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (EOS ignored)")
    ap.add_argument("--num-slots", type=int, default=None, help="default: the highest concurrency")
    ap.add_argument("--dtype", default="float32", help="server --dtype (the demo models run in float32 on a CPU)")
    ap.add_argument("--prompts", default="shakespeare", help="benchmark whose first turns are the prompts")
    ap.add_argument("--passage-chars", type=int, default=300, help="prompt size for shakespeare/stdlib")
    ap.add_argument("--mixed", default="", metavar="N[,N...]",
                    help="also a level at N clients (each N), half of the requests random token ids")
    ap.add_argument("--mixed-temperature", type=float, default=1.0, metavar="T",
                    help="sampling temperature of the mixed level's random-id requests (0: greedy)")
    ap.add_argument("--random", default="", metavar="N[,N...]",
                    help="also a level at N clients (each N), every request random token ids")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help=f"also run auto from the checkout DIR (mode {BASE!r}), side by side")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra infer/serve.py argument (repeatable), e.g. --server-arg=--max-model-len=2048")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode (server start + load)")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    proj = ap.add_argument_group("projection (nothing runs: d3d_jax/bench/serve_projection.py)")
    proj.add_argument("--project", default=None, metavar="COSTS.json",
                      help="project the table from infer/bench.py compile's JSON instead of measuring")
    proj.add_argument("--tau", type=float, default=7.9, help="simulated τ at B = 16")
    proj.add_argument("--hit-rate", type=float, default=0.7, help="simulated async hit rate")
    proj.add_argument("--project-devices", type=int, default=1, help="1: verify and pack serialize")
    return ap


def _prompts(args, n: int) -> list[str]:
    from d3d_jax.bench.evaluation import benchmarks as B

    samples = B.load_benchmark(args.prompts, template="plain", passage_chars=args.passage_chars, limit=n)
    if not samples:
        raise UsageError(f"benchmark {args.prompts!r} gave no prompts")
    return [s.turns[0] for s in samples]


class ServerProcess:
    """``infer/serve.py`` in a subprocess; ``url`` once it printed its READY line."""

    def __init__(self, argv: list[str], timeout_s: float, env: dict | None = None, root: Path = ROOT):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="d3d-serve-", suffix=".log", delete=False)
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, str(Path(root) / "infer" / "serve.py"), "--port", "0", *argv],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=root)
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
                    self.ready = line.strip()  # what the server says it runs (mode, attention, ...)
                    return line.split()[1]
        self.log.flush()
        self.log.seek(0)
        tail = self.log.read()[-4000:]  # before stop() closes and removes the log
        self.stop()
        raise RuntimeError(f"server did not become ready (exit {self.proc.returncode}):\n{tail}")

    def wait_for_log(self, text: str, timeout_s: float = 600.0) -> str:
        """The server's log once it holds ``text`` (or once ``timeout_s`` has passed)."""
        t_end = time.monotonic() + timeout_s
        while True:
            self.log.flush()
            log = Path(self.log.name).read_text()
            if text in log or time.monotonic() > t_end:
                return log
            time.sleep(0.2)

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


async def _one(client, model: str, prompt, max_tokens: int) -> dict:
    """One streaming request: chat for a text prompt (greedy), a completion for an
    :class:`IdPrompt`."""
    t0 = time.perf_counter()
    first = last = None
    usage = spec = None
    pieces = []
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if isinstance(prompt, str):
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        common.update(temperature=prompt.temperature, seed=prompt.seed)
        stream = await client.completions.create(prompt=list(prompt.ids), **common)
    async for ch in stream:
        text = (ch.choices[0].delta.content if hasattr(ch.choices[0], "delta") else ch.choices[0].text) \
            if ch.choices else None
        if text:
            pieces.append(text)
            last = time.perf_counter()
            first = first or last
        if ch.usage is not None:
            usage, spec = ch.usage, (ch.model_extra or {}).get("spec_metrics") or {}
    n = usage.completion_tokens if usage else 0
    return {"tokens": n, "ttft_s": (first or time.perf_counter()) - t0,
            "tpot_s": (last - first) / (n - 1) if first is not None and n > 1 else None,
            "tau": spec.get("tau") if spec else None, "hit_rate": spec.get("hit_rate") if spec else None,
            "modes": (spec or {}).get("modes") or {}, "kind": "text" if isinstance(prompt, str) else "ids",
            "text": "".join(pieces)}


def _reasons(url: str) -> collections.Counter:
    """auto's row-rounds by ``geometry: reason`` (``d3d_mode_row_rounds_total``)."""
    out: collections.Counter = collections.Counter()
    for line in urllib.request.urlopen(url + "/metrics", timeout=30).read().decode().splitlines():
        if line.startswith("d3d_mode_row_rounds_total{"):
            labels, _, value = line[len("d3d_mode_row_rounds_total{"):].rpartition("} ")
            f = {k: v.strip('"') for k, v in (kv.split("=") for kv in labels.split(","))}
            out[f["mode"] + ("" if f["geometry"] == "-" else "/" + f["geometry"]) + ": " + f["reason"]] += float(value)
    return out


def _scrape(url: str) -> dict:
    """``d3d_mode_*`` counters of ``/metrics``: {geometry: {rounds, tokens, predicted_tokens}}."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out: dict = collections.defaultdict(dict)
    names = {"d3d_mode_rounds_total": "rounds", "d3d_mode_tokens_total": "tokens",
             "d3d_mode_predicted_tokens_total": "predicted_tokens", "d3d_mode_timed_rounds_total": "timed_rounds",
             "d3d_mode_round_seconds_total": "seconds", "d3d_mode_predicted_round_seconds_total": "predicted_seconds"}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in names:
            labels, _, value = rest.rpartition("} ")
            fields = dict(kv.split("=") for kv in labels.split(","))
            geom = fields["mode"].strip('"') + ("" if fields["geometry"] == '"-"' else "/" + fields["geometry"].strip('"'))
            out[geom][names[name]] = float(value)
    return dict(out)


def _delta(before: dict, after: dict) -> dict:
    out = {}
    for geom, c in after.items():
        d = {k: v - before.get(geom, {}).get(k, 0.0) for k, v in c.items()}
        if d.get("rounds", 0) > 0:
            d["tokens_per_round"] = d["tokens"] / d["rounds"]
            d["predicted_per_round"] = d.get("predicted_tokens", 0.0) / d["rounds"]
            if d.get("timed_rounds", 0) > 0:  # ms a timed round took, and what auto expected
                d["ms_per_round"] = 1e3 * d["seconds"] / d["timed_rounds"]
                d["predicted_ms_per_round"] = 1e3 * d.get("predicted_seconds", 0.0) / d["timed_rounds"]
            out[geom] = d
    return out


def _mix(reqs: list[dict]) -> dict:
    """Rounds per geometry over the requests, as shares."""
    total = collections.Counter()
    for r in reqs:
        total.update(r["modes"])
    n = sum(total.values())
    return {g: c / n for g, c in sorted(total.items())} if n else {}


async def run_level(url: str, model: str, prompts: list, clients: int, per_client: int,
                    max_tokens: int, api_key: str = "none", timeout_s: float = 600.0) -> dict:
    """``clients`` concurrent clients, each sending ``per_client`` requests in a row: the
    requests' records and the wall time (:func:`summarize` makes the level's figures)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s)

    async def worker(w: int) -> list[dict]:
        idx = [(w * per_client + k) % len(prompts) for k in range(per_client)]
        return [dict(await _one(client, model, prompts[i], max_tokens), prompt=i) for i in idx]

    t0 = time.perf_counter()
    per_worker = await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(clients))), timeout_s)
    wall = time.perf_counter() - t0
    await client.close()
    return {"clients": clients, "reqs": [r for rs in per_worker for r in rs], "wall_s": wall}


def summarize(runs: list[dict]) -> dict:
    """One level's figures over its repeats (:func:`run_level` results): tokens/s = all tokens ÷
    all wall time, p50s over every request, rounds summed; ``tokens_per_s_runs`` per repeat."""
    reqs = [r for run in runs for r in run["reqs"]]
    wall = sum(run["wall_s"] for run in runs)
    tokens = sum(r["tokens"] for r in reqs)
    taus = [r["tau"] for r in reqs if r["tau"] is not None]
    hits = [r["hit_rate"] for r in reqs if r["hit_rate"] is not None]
    tpots = [r["tpot_s"] for r in reqs if r["tpot_s"] is not None]
    rounds: dict = {}
    for run in runs:
        for geom, d in run.get("rounds", {}).items():
            acc = rounds.setdefault(geom, collections.Counter())
            acc.update({k: v for k, v in d.items() if k in COUNTERS})
    by_kind = {k: _mix([r for r in reqs if r["kind"] == k]) for k in sorted({r["kind"] for r in reqs})}
    return {"clients": runs[0]["clients"], "requests": len(reqs), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "tokens_per_s_runs": [sum(r["tokens"] for r in run["reqs"]) / run["wall_s"] for run in runs],
            "ttft_ms_p50": 1e3 * statistics.median(r["ttft_s"] for r in reqs),
            "tpot_ms_p50": 1e3 * statistics.median(tpots) if tpots else None,
            "tau": statistics.mean(taus) if taus else None,
            "hit_rate": statistics.mean(hits) if hits else None, "mode_mix": _mix(reqs),
            "mode_mix_by_kind": by_kind, "rounds": _delta({}, {g: dict(c) for g, c in rounds.items()}),
            "reasons": _mix([{"modes": run.get("reasons", {})} for run in runs])}


def _server_argv(args, mode: str, slots: int) -> list[str]:
    # --warmup-wait: every prefill bucket compiled before READY, so no level shares the CPU with
    # the server's background warm-up (it did: plain at 4 clients ran at 1/3 of its 8-client rate)
    argv = ["--target", args.target, "--mode", "auto" if mode == BASE else mode, "--num-slots", str(slots), "--tokenizer", args.tokenizer,
            "--served-model-name", "bench", "--dtype", args.dtype, "--warmup-wait"]
    return argv + (["--drafter", args.drafter] if mode != "plain" else []) + list(args.server_arg)


def _level(server, args, prompts, clients: int, max_tokens: int) -> dict:
    before, why = _scrape(server.url), _reasons(server.url)
    res = asyncio.run(run_level(server.url, "bench", prompts, clients, per_client(args, clients),
                                max_tokens, timeout_s=args.timeout))
    res["rounds"] = _delta(before, _scrape(server.url))
    res["reasons"] = dict(_reasons(server.url) - why)
    return res


def per_client(args, clients: int) -> int:
    """Requests each client sends at this level: ``--requests-per-client``, more at low
    concurrency so that every level has at least ``--min-requests`` (one request's TTFT at 1
    client is a third of a 3-request level's p50)."""
    return max(args.requests_per_client, -(-args.min_requests // clients))


def schedule(modes: list[str], levels: list, repeats: int) -> list[tuple]:
    """``(level, repeat, mode)`` in the order they run: each level's modes side by side, the
    order reversed on every other repeat (A B C D, D C B A), so a drift of the machine's speed
    during a level weighs on every mode alike and the ratios, which are what the table claims,
    are taken within minutes of each other."""
    return [(level, rep, mode) for level in levels for rep in range(repeats)
            for mode in (modes if rep % 2 == 0 else modes[::-1])]


def start_servers(args, modes: list[str], slots: int, prompts: list[str], levels: list[int]) -> dict:
    """Every mode's server, started one after another (auto times its programs at start-up: on a
    machine where another server compiles, its prices would be wrong), each warmed by one untimed
    pass of every prompt at full load."""
    servers: dict = {}
    try:
        for mode in modes:
            t0 = time.perf_counter()
            root = Path(args.baseline) if mode == BASE else ROOT
            servers[mode] = ServerProcess(_server_argv(args, mode, slots), args.timeout, root=root)
            servers[mode].start_s = time.perf_counter() - t0
            print(f"[serve] {mode} server ready in {servers[mode].start_s:.0f} s", flush=True)
            asyncio.run(run_level(servers[mode].url, "bench", prompts, max(levels), args.requests_per_client, 2,
                                  timeout_s=args.timeout))
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


def measure(args, modes: list[str], levels: list[int], prompts: list[str], special: dict) -> dict:
    """Every mode at every level (and each ``special`` level: key -> (clients, prompts), the mixed
    and random-id ones), interleaved by :func:`schedule`."""
    slots = args.num_slots or max(levels + [c for c, _ in special.values()])
    servers = start_servers(args, modes, slots, prompts, levels)
    runs: dict = collections.defaultdict(list)
    try:
        keys = levels + list(special)
        for level, rep, mode in schedule(modes, keys, args.repeats):
            clients, texts = special[level] if level in special else (level, prompts)
            res = _level(servers[mode], args, texts, clients, args.max_tokens)
            runs[(mode, level)].append(res)
            tps = sum(r["tokens"] for r in res["reqs"]) / res["wall_s"]
            print(f"[serve] {mode:6s} {level!s:>5} ({clients} clients, repeat {rep + 1}): {tps:8.1f} tok/s  "
                  f"mix {fmt_mix(_mix(res['reqs']))}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    out = {}
    for mode in modes:
        out[mode] = {"server_start_s": servers[mode].start_s, "slots": slots,
                     "levels": {str(c): summarize(runs[(mode, c)]) for c in levels}}
        for k in special:
            out[mode][k] = summarize(runs[(mode, k)])
    for key in keys:
        for mode in modes:
            lv = out[mode][key] if key in special else out[mode]["levels"][str(key)]
            lv["texts_differ"] = texts_differ(runs[(mode, key)], runs.get(("plain", key)))
    return out


def texts_differ(runs: list[dict], plain: list[dict] | None) -> int | None:
    """Requests whose text is not plain mode's for the same prompt (None without plain)."""
    if not plain:
        return None
    ref = {r["prompt"]: r["text"] for run in plain for r in run["reqs"]}
    return sum(r["text"] != ref.get(r["prompt"], r["text"]) for run in runs for r in run["reqs"])


def _mixed_prompts(args, prompts: list[str]) -> list:
    """Alternating: a benchmark prompt, then as many random token ids as it has characters / 4
    (sampled at ``--mixed-temperature``, seed = its index)."""
    from d3d_jax.io.hf import load_tokenizer

    vocab = len(load_tokenizer(args.tokenizer)[0])
    rng = random.Random(0)
    out: list = []
    for i, p in enumerate(prompts):
        ids = [rng.randrange(4, vocab) for _ in range(max(len(p) // 4, 8))]
        out += [p, IdPrompt(ids, args.mixed_temperature, i)]
    return out


def _projection(args, levels: list[int]) -> int:
    from d3d_jax.bench import serve_projection as SP

    p = SP.project(args.project, levels, args.tau, args.hit_rate, devices=args.project_devices)
    print(SP.markdown(p, levels))
    print(json.dumps(p))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(p, indent=1))
    return 0


def main(args) -> int:
    levels = sorted({int(c) for c in args.concurrency.split(",") if c})
    if args.project:
        return _projection(args, levels)
    modes = [m for m in args.modes.split(",") if m]
    if not levels or min(levels) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        raise UsageError("--concurrency, --requests-per-client and --max-tokens must be >= 1")
    if any(m not in MODES for m in modes):
        raise UsageError(f"--modes: {', '.join(MODES)}, got {args.modes!r}")
    if args.baseline:
        if not (Path(args.baseline) / "infer" / "serve.py").is_file():
            raise UsageError(f"--baseline {args.baseline!r}: no infer/serve.py there (a checkout of this project)")
        modes.append(BASE)
    if args.repeats < 1 or args.min_requests < 0:
        raise UsageError("--repeats must be >= 1 and --min-requests >= 0")
    if not 0.0 <= args.mixed_temperature <= 2.0:
        raise UsageError(f"--mixed-temperature must be in [0, 2] (the API's range), got {args.mixed_temperature}")
    mixed, rand = (sorted({int(c) for c in v.split(",") if c}) for v in (args.mixed, args.random))
    if min(mixed + rand, default=1) < 1:
        raise UsageError(f"--mixed and --random are client counts >= 1, got {args.mixed!r} and {args.random!r}")
    prompts = _prompts(args, max(c * per_client(args, c) for c in levels + mixed + rand))
    special = {f"mixed@{c}": (c, _mixed_prompts(args, prompts[: max(c * per_client(args, c) // 2, 1)]))
               for c in mixed}
    # every other one of as many mixed prompts as the level sends: the random ids only
    special.update({f"random@{c}": (c, _mixed_prompts(args, prompts[: c * per_client(args, c)])[1::2])
                    for c in rand})
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "modes": {},
                    "load_avg_start": os.getloadavg()}
    report["modes"] = measure(args, modes, levels, prompts, special)
    report["load_avg_end"] = os.getloadavg()
    ratios(report, levels)
    print(tables(report, levels))
    print(json.dumps(report, default=float))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=float))
    return 0
