"""Time spent compiling, so decode timings can leave it out without ahead-of-time executables.

JAX reports every trace, lowering and backend compile as a time span (``jax.monitoring``).
:class:`CompileClock` adds up the union of those spans while it is open; a caller subtracts it
from its wall time.
"""

from __future__ import annotations

import threading

import jax

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration")
_lock = threading.Lock()
_open: list["CompileClock"] = []


def _on_span(event: str, start: float, end: float, **_):
    if event in _EVENTS and _open:
        with _lock:
            for clock in _open:
                clock.spans.append((start, end))


jax.monitoring.register_event_time_span_listener(_on_span)


class CompileClock:
    """``with CompileClock() as c: ...`` then ``c.seconds``: compile time inside the block (nested
    spans, e.g. an inner trace within an outer one, count once)."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []

    def __enter__(self) -> "CompileClock":
        with _lock:
            _open.append(self)
        return self

    def __exit__(self, *exc):
        with _lock:
            _open.remove(self)

    @property
    def seconds(self) -> float:
        total, reach = 0.0, float("-inf")
        for start, end in sorted(self.spans):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total
