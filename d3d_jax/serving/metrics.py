"""Server-wide counters and their Prometheus text exposition (``GET /metrics``).

Written by the scheduler thread, read by the HTTP thread: one lock, plain numbers.  Throughput is
the generated tokens of the last ``window_s`` seconds; τ is the mean tokens committed per slot per
round (1 in plain mode) and the hit rate counts async rounds whose branch pack held the outcome.
"""

from __future__ import annotations

import collections
import threading
import time


class ServerMetrics:
    def __init__(self, window_s: float = 10.0, clock=time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self.window_s = window_s
        self._recent: collections.deque = collections.deque()  # (time, tokens) per round
        self.started = clock()
        self.counters = collections.Counter()
        self.requests = collections.Counter()  # by outcome: stop, length, cancelled, error
        self.http_errors = collections.Counter()  # by status code
        self.decisions: dict = {}  # the decoder's rounds per geometry (serving.mode_metrics)

    def record_round(self, rows: int, tokens: int, accepted: int, hits: int = 0, misses: int = 0,
                     seconds: float = 0.0) -> None:
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
            self._recent.append((now, tokens))
            self._trim(now)

    def record_admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.counters["admitted"] += 1
            self.counters["prompt_tokens"] += prompt_tokens

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
                    "tau": (c.get("accepted", 0) + rr) / rr if rr else 0.0,
                    "hit_rate": c.get("hits", 0) / judged if judged else 0.0}

    def render(self, active: int, queued: int, slots: int, mode: str) -> str:
        """Prometheus text format 0.0.4."""
        s = self.snapshot()
        c = s["counters"]
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.extend([f"# HELP d3d_{name} {help_}", f"# TYPE d3d_{name} {kind}"])
            for labels, value in samples:
                lines.append(f"d3d_{name}{labels} {float(value):.6g}")

        metric("generation_tokens_per_second", "gauge",
               f"generated tokens per second over the last {self.window_s:g} s", [("", s["tokens_per_s"])])
        metric("active_slots", "gauge", "slots decoding a request", [("", active)])
        metric("queued_requests", "gauge", "requests waiting for a slot", [("", queued)])
        metric("slots", "gauge", f"decoder slots (mode {mode})", [(f'{{mode="{mode}"}}', slots)])
        metric("acceptance_tau", "gauge", "mean tokens committed per slot per round (tau)", [("", s["tau"])])
        metric("async_hit_rate", "gauge", "async rounds whose branch pack held the outcome",
               [("", s["hit_rate"])])
        metric("generation_tokens_total", "counter", "generated tokens", [("", c.get("generation_tokens", 0))])
        metric("prompt_tokens_total", "counter", "prompt tokens of admitted requests",
               [("", c.get("prompt_tokens", 0))])
        metric("admitted_requests_total", "counter", "requests that got a slot", [("", c.get("admitted", 0))])
        metric("rounds_total", "counter", "decoder rounds (step calls)", [("", c.get("rounds", 0))])
        metric("accepted_drafts_total", "counter", "draft tokens accepted", [("", c.get("accepted", 0))])
        metric("requests_total", "counter", "finished requests by outcome",
               [(f'{{outcome="{k}"}}', v) for k, v in sorted(s["requests"].items())])
        metric("http_errors_total", "counter", "error responses by status",
               [(f'{{status="{k}"}}', v) for k, v in sorted(s["http_errors"].items())])
        from d3d_jax.serving import mode_metrics

        lines += mode_metrics.render(self.decisions)
        return "\n".join(lines) + "\n"
