"""Auto mode's choice (host side, plain Python): before every round, the plan with the most
expected tokens per second for the current batch.

* **Expected tokens per round** of a request in a geometry of width ``w`` (plain: 1; sync
  ``b``; async ``B``): ``1 + Σ_{k<w} P(a ≥ k)``, with ``P(a ≥ k) = Π_{j≤k} c_j`` and ``c_j`` the
  request's own rate of accepting draft slot ``j`` once slots ``< j`` were accepted
  (:class:`Acceptance`), counted from its rounds, starting from the drafter's offline τ as a
  prior worth a few rounds.  Never more than the tokens the request has left.
* **Round cost** of a geometry at a window width (:class:`Costs`): measured at start-up
  (calibration), then a running mean of the rounds that ran, per (geometry, width).
* **Plans**: every row in one geometry, or (*split*) the requests worth speculating on in the
  best speculative geometry and the rest in plain rounds over their own window.  A request is
  put aside for plain rounds when speculation would cost it more than it gives
  (:meth:`Policy.classes`), so a useless drafter costs a request nothing after a few rounds.
"""

from __future__ import annotations

import collections
import dataclasses
import math

PRIOR_ROUNDS = 3.0  # weight of the offline-τ prior, in rounds of a request's own history
EMA = 0.25  # weight of a new measurement in a round cost
SWITCH_MARGIN = 0.03  # another plan must be this much better to replace the current one
PLAIN_MARGIN = 0.15  # a request runs plain once speculation pays this much less than plain
MIN_ROUNDS_TO_SET_ASIDE = 3  # of the request's own speculative rounds
EXPLORE_EVERY = 32  # plain rounds in a row after which one speculative round is tried
# A round-time sample counts at most this many times the estimate: one host stall (a GC, the
# server's burst of stream writes, another program's compile) priced a geometry out of the choice
# for good — a geometry that looks too dear is never run again, so it is never re-measured.
OUTLIER = 2.0


def geometric_rate(tau: float, width: int) -> float:
    """The per-slot acceptance ``c`` with ``1 + Σ_{k=1}^{w-1} c^k = τ`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        c = (lo + hi) / 2
        if 1 + sum(c ** k for k in range(1, width)) < tau:
            lo = c
        else:
            hi = c
    return (lo + hi) / 2


class Acceptance:
    """One request's acceptance by draft slot (censored by the width of each round)."""

    def __init__(self, width: int, prior_rate: float):
        self.tested = [0] * width  # index k: rounds in which draft slot k was judged
        self.accepted = [0] * width
        self.prior = prior_rate
        self.rounds = 0
        self._curve: list[float] | None = None  # expected tokens by width (until a new record)

    def record(self, width: int, accepted: int) -> None:
        """A round of ``width`` tokens fed (``width - 1`` drafts) that accepted ``accepted``."""
        if width < 2:
            return
        self.rounds += 1
        self._curve = None
        for k in range(1, min(accepted, width - 1) + 1):
            self.tested[k] += 1
            self.accepted[k] += 1
        if accepted + 1 <= width - 1:
            self.tested[accepted + 1] += 1

    def rate(self, k: int) -> float:
        return (self.accepted[k] + PRIOR_ROUNDS * self.prior) / (self.tested[k] + PRIOR_ROUNDS)

    def expected(self, width: int, left: int | None = None) -> float:
        """Expected tokens committed by a round of ``width`` (at most ``left``)."""
        if self._curve is None:  # 1 + Σ_{k<w} Π_{j≤k} c_j for every w, once per record
            curve, total, p = [0.0, 1.0], 1.0, 1.0
            for k in range(1, len(self.tested)):
                p *= self.rate(k)
                total += p
                curve.append(total)
            self._curve = curve
        total = self._curve[min(width, len(self._curve) - 1)]
        return total if left is None else min(total, max(float(left), 1.0))


class Costs:
    """Seconds per round, per (geometry label, window width)."""

    def __init__(self):
        self.seconds: dict[tuple[str, int], float] = {}
        self.samples: collections.Counter = collections.Counter()

    def calibrate(self, label: str, rows: int, seconds: float) -> None:
        self.seconds[(label, rows)] = seconds

    def measured(self, label: str, rows: int, seconds: float) -> None:
        key = (label, rows)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - EMA) * old + EMA * min(seconds, OUTLIER * old)
        self.samples[key] += 1

    def get(self, label: str, rows: int) -> float:
        """The estimate; an unmeasured width is scaled from the nearest measured one."""
        if (label, rows) in self.seconds:
            return self.seconds[(label, rows)]
        known = sorted(r for (lab, r) in self.seconds if lab == label)
        if not known:
            return math.inf
        near = min(known, key=lambda r: abs(math.log(r / rows)))
        return self.seconds[(label, near)] * max(rows / near, 1.0) ** 0.5


@dataclasses.dataclass(frozen=True)
class Geometry:
    label: str  # "plain", "sync/8", "async/12x2"
    width: int  # tokens fed to the target per round


@dataclasses.dataclass
class Plan:
    """``groups``: ``(lo, hi, geometry)`` windows of the round; ``tokens`` the expected total."""

    groups: list
    tokens: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def key(self) -> tuple:
        return tuple(g.label for _, _, g in self.groups)


class Policy:
    """The choice of plan and of which requests run plain (see the module doc)."""

    def __init__(self, geometries: list[Geometry], buckets: tuple[int, ...]):
        self.geometries = geometries
        self.plain = next(g for g in geometries if g.width == 1)
        self.speculative = [g for g in geometries if g.width > 1]
        self.buckets = buckets
        self.costs = Costs()
        self.last: tuple = ()
        self.plain_run = 0  # plain rounds in a row: plain rounds teach nothing about acceptance

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def tokens(self, rows: list, g: Geometry) -> float:
        return sum(1.0 if g.width == 1 else acc.expected(g.width, left) for acc, left in rows)

    def _plan(self, parts: list[tuple[int, int, list, Geometry]]) -> Plan:
        tokens = sum(self.tokens(rows, g) for _, _, rows, g in parts)
        seconds = sum(self.costs.get(g.label, self.bucket(hi - lo)) for lo, hi, _, g in parts)
        return Plan([(lo, hi, g) for lo, hi, _, g in parts], tokens, seconds)

    def choose(self, rows: list, boundary: int) -> Plan:
        """The best plan for ``rows`` (per row: ``(Acceptance, tokens left)``, in row order, rows
        ``< boundary`` speculative-class, the rest plain-class)."""
        n = len(rows)
        plans = [self._plan([(0, n, rows, g)]) for g in self.geometries]
        if 0 < boundary < n:
            plans += [self._plan([(0, boundary, rows[:boundary], g),
                                  (boundary, n, rows[boundary:], self.plain)])
                      for g in self.speculative]
        unknown = [p for p in plans if not math.isfinite(p.seconds)]
        if unknown:  # never timed (no start-up calibration): try it, so it gets measured
            self.last = unknown[0].key
            return unknown[0]
        best = max(plans, key=lambda p: p.rate)
        current = next((p for p in plans if p.key == self.last), None)
        if current is not None and current.rate >= best.rate * (1 - SWITCH_MARGIN):
            best = current  # hysteresis: no switch for a gain within noise
        self.plain_run = self.plain_run + 1 if best.key == (self.plain.label,) else 0
        if self.plain_run > EXPLORE_EVERY and boundary > 0:  # a pessimistic prior must not stick
            spec = [p for p in plans[:len(self.geometries)] if p.key != (self.plain.label,)]
            best, self.plain_run = max(spec, key=lambda p: p.rate), 0
        self.last = best.key
        return best

    def prefers_plain(self, acc: Acceptance, n: int) -> bool:
        """Speculation on this request pays less than a plain round would, at this load."""
        if acc.rounds < MIN_ROUNDS_TO_SET_ASIDE:
            return False
        b = self.bucket(n)
        plain = 1.0 / self.costs.get(self.plain.label, b)
        spec = max(acc.expected(g.width) / self.costs.get(g.label, b) for g in self.speculative)
        return spec < plain * (1 - PLAIN_MARGIN)
