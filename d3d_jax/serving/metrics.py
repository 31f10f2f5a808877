"""Server-wide counters and histograms and their Prometheus text exposition (``GET /metrics``).

Written by the scheduler thread and the HTTP layer, read by the HTTP thread: one lock, plain
numbers.  Throughput is the generated tokens of the last ``window_s`` seconds; τ is the mean
tokens committed per slot per round (shown in sync and async mode only: plain decoding accepts
nothing), the hit rate counts async rounds whose branch pack held the outcome (async only).
Start-up warm-up requests are never recorded (the scheduler leaves them out).  Histograms: time
to first token, inter-token latency and end to end (seconds, as the HTTP layer sees them) and
tokens committed per request per round.  With a paged KV cache: the pool's usage and pages,
prefix-cache queried and hit prompt tokens, and preemptions.  ``vllm_names`` adds the same series
under vLLM's ``vllm:`` names so existing dashboards read them.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
HISTOGRAMS = {  # name -> (buckets, help, vLLM's name)
    "time_to_first_token_seconds": (_LATENCY_BUCKETS, "time from request arrival to its first token",
                                    "vllm:time_to_first_token_seconds"),
    "inter_token_latency_seconds": (_LATENCY_BUCKETS, "time between a request's tokens (a round's "
                                    "tokens share its interval)", "vllm:inter_token_latency_seconds"),
    "e2e_request_latency_seconds": (_LATENCY_BUCKETS + (160.0, 320.0), "request arrival to last token",
                                    "vllm:e2e_request_latency_seconds"),
    "tokens_per_round": (tuple(float(x) for x in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)),
                         "tokens committed per request per round", "vllm:spec_decode_tokens_per_step"),
}


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x
        self.count += 1

    def samples(self, labels: str = "") -> list[tuple[str, str, float]]:
        """(suffix, labels, value): cumulative ``_bucket`` counts, ``_sum`` and ``_count``."""
        out, acc = [], 0
        sep = labels + "," if labels else ""
        for le, n in zip(self.buckets + (float("inf"),), self.counts):
            acc += n
            out.append(("_bucket", f'{{{sep}le="{"+Inf" if le == float("inf") else f"{le:g}"}"}}', acc))
        brace = f"{{{labels}}}" if labels else ""
        return out + [("_sum", brace, self.sum), ("_count", brace, self.count)]


class ServerMetrics:
    def __init__(self, window_s: float = 10.0, clock=time.monotonic, vllm_names: bool = False):
        self._lock = threading.Lock()
        self._clock = clock
        self.window_s = window_s
        self.vllm_names = vllm_names
        self._recent: collections.deque = collections.deque()  # (time, tokens) per round
        self.started = clock()
        self.counters = collections.Counter()
        self.requests = collections.Counter()  # by outcome: stop, length, cancelled, error
        self.http_errors = collections.Counter()  # by status code
        self.decisions: dict = {}  # the decoder's rounds per geometry (serving.mode_metrics)
        self.histograms = {k: Histogram(b) for k, (b, _, _) in HISTOGRAMS.items()}

    def record_round(self, rows: int, tokens: int, accepted: int, hits: int = 0, misses: int = 0,
                     seconds: float = 0.0, per_row=None) -> None:
        now = self._clock()
        with self._lock:
            c = self.counters
            c["rounds"] += 1
            c["row_rounds"] += rows
            c["generation_tokens"] += tokens
            c["accepted"] += accepted
            c["hits"] += hits
            c["misses"] += misses
            c["step_seconds"] += seconds
            for n in per_row or ():
                self.histograms["tokens_per_round"].observe(n)
            self._recent.append((now, tokens))
            self._trim(now)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self.histograms[name].observe(value)

    def record_admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.counters["admitted"] += 1
            self.counters["prompt_tokens"] += prompt_tokens

    def record_preemption(self) -> None:
        with self._lock:
            self.counters["preemptions"] += 1

    def record_request(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def record_http_error(self, status: int) -> None:
        with self._lock:
            self.http_errors[status] += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def tokens_per_s(self) -> float:
        now = self._clock()
        with self._lock:
            self._trim(now)
            span = min(self.window_s, max(now - self.started, 1e-9))
            return sum(n for _, n in self._recent) / span

    def snapshot(self) -> dict:
        tps = self.tokens_per_s()
        with self._lock:
            c = dict(self.counters)
            rr, judged = c.get("row_rounds", 0), c.get("hits", 0) + c.get("misses", 0)
            return {"tokens_per_s": tps, "counters": c, "requests": dict(self.requests),
                    "http_errors": dict(self.http_errors),
                    "tau": (c.get("accepted", 0) + rr) / rr if rr else None,
                    "hit_rate": c.get("hits", 0) / judged if judged else None,
                    "histograms": {k: (list(h.counts), h.sum, h.count) for k, h in self.histograms.items()}}

    def render(self, active: int, queued: int, slots: int, mode: str, model: str = "",
               kv: dict | None = None) -> str:
        """Prometheus text format 0.0.4.  ``kv``: the paged pool's figures
        (``SpecDecoder.page_stats``), None for a dense cache."""
        s = self.snapshot()
        c = s["counters"]
        lines: list[str] = []
        vllm_label = f'model_name="{_escape(model)}"'

        def metric(name, kind, help_, samples, vllm=None):
            for full, extra in ((f"d3d_{name}", None), (vllm, vllm_label)):
                if full is None or (extra and not self.vllm_names):
                    continue
                lines.extend([f"# HELP {full} {help_}", f"# TYPE {full} {kind}"])
                for labels, value in samples:
                    if extra:
                        labels = "{" + extra + ("," + labels[1:-1] if labels else "") + "}"
                    lines.append(f"{full}{labels} {float(value):.6g}")

        metric("generation_tokens_per_second", "gauge",
               f"generated tokens per second over the last {self.window_s:g} s", [("", s["tokens_per_s"])])
        metric("active_slots", "gauge", "slots decoding a request", [("", active)], "vllm:num_requests_running")
        metric("queued_requests", "gauge", "requests waiting for a slot", [("", queued)],
               "vllm:num_requests_waiting")
        metric("slots", "gauge", f"decoder slots (mode {mode})", [(f'{{mode="{mode}"}}', slots)])
        if mode != "plain" and s["tau"] is not None:
            metric("acceptance_tau", "gauge", "mean tokens committed per slot per round (tau)", [("", s["tau"])])
        if mode == "async" and s["hit_rate"] is not None:
            metric("async_hit_rate", "gauge", "async rounds whose branch pack held the outcome",
                   [("", s["hit_rate"])])
        metric("generation_tokens_total", "counter", "generated tokens", [("", c.get("generation_tokens", 0))],
               "vllm:generation_tokens_total")
        metric("prompt_tokens_total", "counter", "prompt tokens of admitted requests",
               [("", c.get("prompt_tokens", 0))], "vllm:prompt_tokens_total")
        metric("admitted_requests_total", "counter", "requests that got a slot", [("", c.get("admitted", 0))])
        metric("rounds_total", "counter", "decoder rounds (step calls)", [("", c.get("rounds", 0))])
        if mode != "plain":
            metric("accepted_drafts_total", "counter", "draft tokens accepted", [("", c.get("accepted", 0))],
                   "vllm:spec_decode_num_accepted_tokens_total")
        metric("requests_total", "counter", "finished requests by outcome",
               [(f'{{outcome="{k}"}}', v) for k, v in sorted(s["requests"].items())])
        metric("http_errors_total", "counter", "error responses by status",
               [(f'{{status="{k}"}}', v) for k, v in sorted(s["http_errors"].items())])
        if kv is not None:
            _kv_metrics(metric, kv, c.get("preemptions", 0))
        for name, (_, help_, vllm) in HISTOGRAMS.items():
            for full, extra in ((f"d3d_{name}", ""), (vllm, vllm_label)):
                if extra and not self.vllm_names:
                    continue
                lines.extend([f"# HELP {full} {help_}", f"# TYPE {full} histogram"])
                h = self.histograms[name]
                with self._lock:
                    samples = h.samples(extra)
                lines.extend(f"{full}{suffix}{labels} {float(v):.6g}" for suffix, labels, v in samples)
        from d3d_jax.serving import mode_metrics

        lines += mode_metrics.render(self.decisions)
        return "\n".join(lines) + "\n"


def _kv_metrics(metric, kv: dict, preemptions: int) -> None:
    """The paged pool's series (the counters read 0 where the pool counts nothing yet)."""
    metric("kv_cache_usage_perc", "gauge", "share of KV cache pages held by requests (a fraction, as vLLM's)",
           [("", kv.get("kv_cache_usage_perc", 0.0))], "vllm:kv_cache_usage_perc")
    metric("kv_pages_total", "gauge", "pages of the KV cache pool", [("", kv.get("num_pages", 0))])
    metric("kv_pages_free", "gauge", "pages free or held only by the prefix cache",
           [("", kv.get("num_free_pages", 0))])
    metric("prefix_cache_queries_total", "counter", "prompt tokens looked up in the prefix cache",
           [("", kv.get("prefix_cache_queries", 0))], "vllm:prefix_cache_queries")
    metric("prefix_cache_hits_total", "counter", "prompt tokens found in the prefix cache",
           [("", kv.get("prefix_cache_hits", 0))], "vllm:prefix_cache_hits")
    metric("num_preemptions_total", "counter", "running requests preempted for lack of KV pages",
           [("", preemptions)], "vllm:num_preemptions")
    # each model's prefill work: the drafter's pages share the target's ids, so a hit spares both
    samples = [(f'{{model="{model}",source="{source}"}}', kv[key])
               for model, prefix in (("target", ""), ("drafter", "drafter_"))
               for source, name in (("computed", "computed"), ("cached", "reused"))
               if (key := f"{prefix}prefill_tokens_{name}") in kv]
    if samples:
        metric("prefill_tokens_total", "counter",
               "prompt tokens each model's KV cache prefilled (computed) or took from the prefix cache (cached)",
               samples)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
