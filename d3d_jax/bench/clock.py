"""Timing helpers for decode benchmarks: compile time to leave out, and phase timers.

JAX reports every trace, lowering and backend compile as a time span (``jax.monitoring``), and
the program store every executable it reads from disk.
:class:`CompileClock` adds up the union of those spans while it is open (it listens only then:
nothing is registered at import); a caller subtracts it from its wall time.
:class:`PhaseTimer` is what :mod:`d3d_jax.bench.phased` times drafting and verifying with.
"""

from __future__ import annotations

import contextlib
import threading
import time

import jax

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration",
           "/d3d_jax/programs/load")  # a program read from the store instead of compiled


class CompileClock:
    """``with CompileClock() as c: ...`` then ``c.seconds``: compile time inside the block (nested
    spans, e.g. an inner trace within an outer one, count once)."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def _on_span(self, event: str, start: float, end: float, **_):
        if event in _EVENTS:
            with self._lock:
                self.spans.append((start, end))

    def __enter__(self) -> "CompileClock":
        jax.monitoring.register_event_time_span_listener(self._on_span)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_time_span_listener(self._on_span)

    @property
    def seconds(self) -> float:
        total, reach = 0.0, float("-inf")
        for start, end in sorted(self.spans):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total


class PhaseTimer:
    """Wall seconds per named phase, compile time left out: ``with timer.phase("draft_s"): ...``;
    ``totals`` maps each phase to its seconds."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        with CompileClock() as clock:
            t0 = time.perf_counter()
            yield
            seconds = time.perf_counter() - t0 - clock.seconds
        self.totals[name] = self.totals.get(name, 0.0) + seconds
