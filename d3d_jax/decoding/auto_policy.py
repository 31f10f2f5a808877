"""Auto mode's choice (host side, plain Python): before every round, the plan with the most
expected tokens per second for the current batch.

* **Expected tokens per round** of a request in a geometry of width ``w`` (plain: 1; sync
  ``b``; async ``B``): ``1 + Σ_{k<w} P(a ≥ k)``, with ``P(a ≥ k) = Π_{j≤k} c_j`` and ``c_j`` the
  request's own rate of accepting draft slot ``j`` once slots ``< j`` were accepted
  (:class:`Acceptance`), counted from its rounds, starting from a prior worth a few rounds: the
  drafter's acceptance pooled over finished requests that speculated (:class:`Pool`), starting
  from the offline τ.  Never more than the tokens the request has left.
* **Round cost** of a geometry at a window width (:class:`Costs`): measured at start-up
  (calibration), then a running mean of the rounds that ran, per (geometry, width); a width not
  yet served follows how far served rounds ran from their start-up times.
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
# plain rounds in a row after which one speculative round is tried; doubled after every such
# round, up to EXPLORE_MAX, until speculation wins a round on its own (docs/design/auto.md, exploring)
EXPLORE_EVERY = 32
EXPLORE_MAX = 512
# plain rounds before a set-aside request is judged again, doubling each time (docs/design/auto.md, re-judging)
REJUDGE_AFTER = 8
# a round-time sample counts at most this many times the estimate (docs/design/auto.md, round costs)
OUTLIER = 2.0
SPLIT_PLAIN = "plain"  # the label of a split round's plain part
POOL_ROUNDS = 256  # the drafter's pooled acceptance halves its counts past this many rounds
# a prompt score scales the prior, min(1, score / (PROMPT_FULL x the pool's mean)); below PROMPT_JUDGED
# the request is judged at once (docs/design/auto.md, prompt scores)
PROMPT_FULL = 0.5
PROMPT_JUDGED = 0.5


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


class Pool:
    """The drafter's acceptance by draft slot, pooled over finished requests that speculated to
    their end: every request's prior (:class:`Acceptance`), itself starting from the offline τ's
    rate (worth ``PRIOR_ROUNDS``).  Only finished requests join, and never one set aside for
    plain rounds: live requests are judged against the pool, and a useless one counted before it
    was set aside would make the good ones beside it (or admitted after it) look useless too,
    and stick in plain rounds, never earning evidence of their own.  Older rounds fade (halved
    past ``POOL_ROUNDS``)."""

    def __init__(self, width: int, prior_rate: float):
        self.tested = [0.0] * width
        self.accepted = [0.0] * width
        self.prior = prior_rate
        self.prompt_total = self.prompt_count = 0.0  # the pooled requests' prompt scores
        self.version = 0  # bumped on every change: requests' cached curves follow it
        self._rates: list[float] | None = None

    def add(self, acc: "Acceptance") -> None:
        """A finished request's own rounds."""
        self.tested = [t + a for t, a in zip(self.tested, acc.tested)]
        self.accepted = [t + a for t, a in zip(self.accepted, acc.accepted)]
        if acc.prompt is not None:
            self.prompt_total += acc.prompt
            self.prompt_count += 1
        while self.tested[1] > POOL_ROUNDS:
            self.tested = [t / 2 for t in self.tested]
            self.accepted = [a / 2 for a in self.accepted]
            self.prompt_total, self.prompt_count = self.prompt_total / 2, self.prompt_count / 2
        self.version += 1
        self._rates = None

    def rate(self, k: int) -> float:
        """Slot ``k``'s pooled rate.  Its prior is the offline rate, but never above the slot
        before's pooled rate: a drafter's slots accept less the further out they are, and slots
        beyond the widths that ran (sync/4 tests 3) would otherwise keep the offline τ's rate
        for good (the demo's `small`: 0.85 offline), and price a wider geometry by it."""
        if self._rates is None:  # every slot's, until the pool changes
            rates, prior = [self.prior], self.prior
            for j in range(1, len(self.tested)):
                rates.append((self.accepted[j] + PRIOR_ROUNDS * prior) / (self.tested[j] + PRIOR_ROUNDS))
                prior = min(self.prior, rates[-1])
            self._rates = rates
        return self._rates[k]

    def prompt_ref(self) -> float | None:
        """The pooled requests' mean prompt score (None before a scored one joined)."""
        return self.prompt_total / self.prompt_count if self.prompt_count > 0 else None


class Acceptance:
    """One request's acceptance by draft slot (censored by the width of each round).  ``prior``:
    a per-slot rate (a float) or a :class:`Pool` whose rates it follows."""

    def __init__(self, width: int, prior: "float | Pool", scored: bool = False,
                 prior_judges: bool = False):
        self.prior_judges = prior_judges  # the prior alone judges it (a constrained request)
        self.tested = [0] * width  # index k: rounds in which draft slot k was judged
        self.accepted = [0] * width
        self.prior = prior
        self.rounds = 0
        self.pending = scored  # a prompt score is coming (the drafter scores prompts)
        self.prompt: float | None = None  # the prompt score (None: not known, or none)
        self.prompt_weight = 1.0  # halved at each re-judging
        self._curve: list[float] | None = None  # expected tokens by width (until a change)
        self._version = -1  # the pool's version the curve was computed with

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

    def set_prompt(self, score: float) -> None:
        """The request's prompt score, once it is read (NaN: the drafter gives none)."""
        self.prompt = None if not math.isfinite(score) else float(score)
        self.pending = False
        self._curve = None

    def _prompt_ref(self) -> float | None:
        return self.prior.prompt_ref() if isinstance(self.prior, Pool) else None

    def prompt_scale(self) -> float:
        """The prior's scale from the prompt score (see :data:`PROMPT_FULL`; 1 without one)."""
        ref = self._prompt_ref()
        if self.prompt is None or not ref:
            return 1.0
        return min(1.0, self.prompt / (PROMPT_FULL * ref)) ** self.prompt_weight

    @property
    def judged(self) -> bool:
        """Enough speculative rounds of its own, or a prompt score that already says enough."""
        return (self.prior_judges or self.rounds >= MIN_ROUNDS_TO_SET_ASIDE
                or self.prompt_scale() < PROMPT_JUDGED)

    @property
    def explores(self) -> bool:
        """Worth speculative rounds to judge it (see :data:`PROMPT_JUDGED`'s comment)."""
        if self.judged or self.pending:
            return False
        vouched = self.prompt is not None and self._prompt_ref() and self.prompt_weight == 1.0
        return not (vouched and self.prompt_scale() == 1.0)

    def fade(self) -> None:
        """Half the weight on the rounds so far, and one round short of judged: a request put
        back to speculate after plain rounds is judged again on its next round, its new rounds
        counting as much as all its old ones."""
        self.tested = [t / 2 for t in self.tested]
        self.accepted = [a / 2 for a in self.accepted]
        self.rounds = min(self.rounds, MIN_ROUNDS_TO_SET_ASIDE - 1)
        self.prompt_weight /= 2
        self._curve = None

    def prior_rate(self, k: int) -> float:
        return (self.prior.rate(k) if isinstance(self.prior, Pool) else self.prior) * self.prompt_scale()

    def rate(self, k: int) -> float:
        return (self.accepted[k] + PRIOR_ROUNDS * self.prior_rate(k)) / (self.tested[k] + PRIOR_ROUNDS)

    def expected(self, width: int, left: int | None = None) -> float:
        """Expected tokens committed by a round of ``width`` (at most ``left``)."""
        version = self.prior.version if isinstance(self.prior, Pool) else 0
        if self._curve is None or version != self._version:
            curve, total, p = [0.0, 1.0], 1.0, 1.0  # 1 + Σ_{k<w} Π_{j≤k} c_j for every w
            for k in range(1, len(self.tested)):
                p *= self.rate(k)
                total += p
                curve.append(total)
            self._curve, self._version = curve, version
        total = self._curve[min(width, len(self._curve) - 1)]
        return total if left is None else min(total, max(float(left), 1.0))


class Costs:
    """Seconds per round, per (geometry label, window width).

    Start-up times each (geometry, width) with no-op rounds; served rounds cost more (longer
    contexts, the server's own host work per round).  A key's first served rounds are averaged
    with its start-up time (weights 1/2, 1/3, … down to ``EMA``), and a width not yet served is
    its start-up time scaled by how far the geometry's served widths ran from theirs: one plain
    round at 4 rows re-prices plain at every width at once, instead of each of 6 geometries x 6
    widths being explored before its estimate is right.  Another geometry's ratio is not
    borrowed: one that looked too dear would never be served, so never priced right."""

    def __init__(self):
        self.seconds: dict[tuple[str, int], float] = {}
        self.calibrated: dict[tuple[str, int], float] = {}
        self.samples: collections.Counter = collections.Counter()
        self.splits: dict[tuple[str, int, int], float] = {}  # (label, rows, plain rows) -> seconds
        self.split_samples: collections.Counter = collections.Counter()

    def calibrate(self, label: str, rows: int, seconds: float) -> None:
        self.seconds[(label, rows)] = self.calibrated[(label, rows)] = seconds

    def measured(self, label: str, rows: int, seconds: float) -> None:
        key = (label, rows)
        # start-up's time counts as one sample
        self.seconds[key] = _averaged(self.get(label, rows), seconds, self.samples[key] + 2)
        self.samples[key] += 1

    def split(self, label: str, rows: int, plain_rows: int) -> float:
        """A split round's estimate: ``label`` over ``rows`` then plain over ``plain_rows``.
        Priced by the split rounds that ran (their own key), not by the sum of the parts'
        one-part estimates: two windows cost more than their parts did alone (on the mixed
        level, sync/4 over the text rows beside plain over the rest took 51.9 ms where the parts
        predicted 44.9, and sync/8 78.1 against 60.0, so auto split the batch where plain rounds
        over it all made more).  A split never run is the parts' sum times the served splits'
        mean ratio to their parts (1 before any ran)."""
        key = (label, rows, plain_rows)
        if key in self.splits:
            return self.splits[key]
        return self._parts(key) * self.split_ratio()

    def _parts(self, key: tuple) -> float:
        label, rows, plain_rows = key
        return self.get(label, rows) + self.get(SPLIT_PLAIN, plain_rows)

    def split_measured(self, label: str, rows: int, plain_rows: int, seconds: float) -> None:
        """A timed split round: its first time replaces the parts' estimate, later ones are
        averaged in (1/2, 1/3, … down to ``EMA``), each at most ``OUTLIER`` times the estimate."""
        key = (label, rows, plain_rows)
        self.splits[key] = _averaged(self.split(label, rows, plain_rows), seconds,
                                     self.split_samples[key] + 1)
        self.split_samples[key] += 1

    def split_ratio(self) -> float:
        """Geometric mean, over the splits that ran, of their estimate ÷ their parts'."""
        parts = {k: self._parts(k) for k in self.splits}  # each split's parts priced once
        ratios = [self.splits[k] / p for k, p in parts.items() if 0 < p < math.inf]
        if not ratios:
            return 1.0
        return math.exp(sum(math.log(max(r, 1e-9)) for r in ratios) / len(ratios))

    def served_ratio(self, label: str) -> float:
        """Geometric mean of served / start-up time over the geometry's served widths (1 if none:
        a geometry never served keeps its start-up times, so it is tried and then priced)."""
        keys = [k for k in self.samples if k[0] == label and k in self.calibrated]
        if not keys:
            return 1.0
        return math.exp(sum(math.log(self.seconds[k] / self.calibrated[k]) for k in keys) / len(keys))

    def get(self, label: str, rows: int) -> float:
        """The estimate (see the class doc); a width never timed is scaled from the nearest one."""
        key = (label, rows)
        if self.samples[key] or (key not in self.calibrated and key in self.seconds):
            return self.seconds[key]
        if key in self.calibrated:
            return self.calibrated[key] * self.served_ratio(label)
        known = sorted(r for (lab, r) in self.seconds if lab == label)
        if not known:
            return math.inf
        near = min(known, key=lambda r: abs(math.log(r / rows)))
        return self.get(label, near) * max(rows / near, 1.0) ** 0.5


def _averaged(old: float, seconds: float, n: int) -> float:
    """An estimate after one more timed sample: the sample itself when there was none, else
    averaged in with weight ``1/n`` (at least ``EMA``), counting at most ``OUTLIER`` × the estimate."""
    if not math.isfinite(old):
        return seconds
    w = max(EMA, 1.0 / n)
    return (1 - w) * old + w * min(seconds, OUTLIER * old)


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
    explore: bool = False  # an exploring round: speculation tried against the plan's prices

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
        self.explore_every = EXPLORE_EVERY  # plain rounds in a row before the next exploring round

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def tokens(self, rows: list, g: Geometry) -> float:
        return sum(1.0 if g.width == 1 else acc.expected(g.width, left) for acc, left in rows)

    def _plan(self, parts: list[tuple[int, int, list, Geometry]]) -> Plan:
        tokens = sum(self.tokens(rows, g) for _, _, rows, g in parts)
        return Plan([(lo, hi, g) for lo, hi, _, g in parts], tokens, self.seconds(
            [(g.label, self.bucket(hi - lo)) for lo, hi, _, g in parts]))

    def seconds(self, parts: list[tuple[str, int]]) -> float:
        """A round's estimate from its parts' ``(label, window width)``: one part's own, or a
        split's (:meth:`Costs.split`)."""
        if len(parts) == 1:
            return self.costs.get(*parts[0])
        (label, rows), (_, plain_rows) = parts
        return self.costs.split(label, rows, plain_rows)

    def measured(self, parts: list[tuple[str, int]], seconds: float) -> None:
        """A timed round of ``parts`` (as :meth:`seconds`) took ``seconds``."""
        if len(parts) == 1:
            self.costs.measured(*parts[0], seconds)
        else:
            (label, rows), (_, plain_rows) = parts
            self.costs.split_measured(label, rows, plain_rows, seconds)

    def all_plain(self, rows: list) -> Plan:
        """Every row in a plain round (a round the gate runs without asking :meth:`choose`)."""
        return self._plan([(0, len(rows), rows, self.plain)])

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
        if best.key == (self.plain.label,):
            best = self._unjudged(plans, rows[:boundary], best)
        else:
            self.explore_every = EXPLORE_EVERY  # speculation pays again: explore soon if it stops
        self.plain_run = self.plain_run + 1 if best.key == (self.plain.label,) else 0
        if self.plain_run > self.explore_every and boundary > 0:  # a pessimistic prior must not stick
            spec = [p for p in plans[:len(self.geometries)] if p.key != (self.plain.label,)]
            best = dataclasses.replace(max(spec, key=lambda p: p.rate), explore=True)
            self.plain_run, self.explore_every = 0, min(2 * self.explore_every, EXPLORE_MAX)
        self.last = best.key
        return best

    def _unjudged(self, plans: list, speculative_rows: list, plain: Plan) -> Plan:
        """A speculative plan instead of all-plain while a request has not had the speculative
        rounds that judge it and speculating costs at most ``PLAIN_MARGIN``: a prior is only a
        guess, and a request that never speculates never shows what its drafts are worth."""
        if not any(acc.explores for acc, _ in speculative_rows):
            return plain
        spec = [p for p in plans if p.key != (self.plain.label,)]
        near = [p for p in spec if p.rate >= plain.rate * (1 - PLAIN_MARGIN)]
        return max(near, key=lambda p: p.rate) if near else plain

    def prefers_plain(self, acc: Acceptance, n: int) -> bool:
        """Speculation on this request pays less than a plain round would, at this load."""
        if not acc.judged:
            return False
        b = self.bucket(n)
        plain = 1.0 / self.costs.get(self.plain.label, b)
        spec = max(acc.expected(g.width) / self.costs.get(g.label, b) for g in self.speculative)
        return spec < plain * (1 - PLAIN_MARGIN)
