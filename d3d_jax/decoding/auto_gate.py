"""Auto's check on its own choice by what the rounds deliver: a speculation gate measured in
tokens per wall second.

The policy (:mod:`~d3d_jax.decoding.auto_policy`) prices rounds.  What it cannot see is the time
around them: admissions, row swaps, the drafter's catch-up, the host's own work per round, and
in a server the streaming of every round's tokens.  On the mixed level of ``bench serve`` (16
clients, half of them random ids) its speculative rounds cost what it predicted, and made as many
tokens per timed millisecond as plain rounds, yet auto made 0.84x plain mode end to end: the rest
was outside the rounds.

The gate measures, per live-row bucket, what two kinds of round *delivered*: rounds with
speculation in them and all-plain rounds, each as tokens committed over wall time from one read
to the next (everything the host and the device did in between counts).  At a bucket where
speculative rounds delivered less than plain ones, rounds run all-plain without asking the policy
(and no request is moved between classes: set aside or not, it runs plain); it lets the policy
choose again for a short probe after a while (and runs a short plain probe now and then while
speculation leads), so a change of load or of the requests' quality turns it back.

* The first round after a change of kind is not a sample: it carries the change's own cost (the
  drafter's catch-up on what plain rounds committed), which a steady run does not pay.
* A probe lasts ``PROBE`` rounds.  The rounds between probes start at ``RECHECK[0]`` and double
  each time a probe leaves the verdict as it was, up to ``RECHECK[1]``; where the leader is ahead
  by ``CLEAR_LEAD`` or more they are ``RECHECK[1]`` at once (a plain probe at one client, where
  sync/16 makes 1.4x plain, costs about 1 % of the tokens at most).
* A verdict changes only when the other kind is ahead by ``MARGIN``: two kinds within noise of
  each other keep what runs.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

PROBE = 6  # rounds of the other kind per probe (the first is not a sample)
MIN_SAMPLES = 4  # of each kind at a bucket before it judges
WINDOW = 8  # a kind's latest rounds at a bucket whose median rate is its rate
RECHECK = (32, 256)  # rounds between probes: first, at most
CLEAR_LEAD = 1.15  # a lead this large rechecks at the longest interval
MARGIN = 0.03  # the other kind must lead by this much to change the verdict
FIRST_PLAIN_PROBE = 8  # speculative rounds at a new bucket before plain is first measured


@dataclasses.dataclass
class Rate:
    """One kind's tokens per wall second at one bucket: the median over its latest ``WINDOW``
    rounds.  On a shared host one round in a few stalls (another process's burst, a GC, a
    stream write); a running mean took a 20x stall as a 4x fall and flipped the verdict on it,
    where the median moves only once half the window has changed (a probe's rounds)."""

    rates: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=WINDOW))
    samples: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        self.rates.append(tokens / seconds)
        self.samples += 1

    @property
    def per_second(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0


@dataclasses.dataclass
class Bucket:
    """The gate's state at one live-row bucket."""

    rates: dict = dataclasses.field(default_factory=lambda: {True: Rate(), False: Rate()})
    speculate: bool = True  # the verdict: the policy's speculative choices run as chosen
    since: int = 0  # rounds of the verdict's kind since the other kind was last measured
    every: int = RECHECK[0]  # rounds between probes
    probe: int = 0  # rounds left in a probe of the other kind
    probing: bool = False  # a probe ran whose verdict is not yet taken

    def judged(self) -> bool:
        return all(r.samples >= MIN_SAMPLES for r in self.rates.values())

    def lead(self) -> float:
        """The verdict's kind's rate over the other's (inf while the other has none)."""
        mine, other = self.rates[self.speculate].per_second, self.rates[not self.speculate].per_second
        return mine / other if other > 0 else float("inf")


class Gate:
    """Whether the policy's speculative choice runs, per live-row bucket (see the module doc)."""

    def __init__(self):
        self.buckets: dict[int, Bucket] = collections.defaultdict(Bucket)
        self._last_kind: bool | None = None
        self.gated = 0  # rounds the gate ran all-plain

    def before(self, bucket: int) -> bool:
        """Before a round at this bucket: True, the policy chooses it (speculation allowed);
        False, it runs all-plain without asking the policy.  Counts it towards the next probe."""
        b = self.buckets[bucket]
        if b.probe > 0:
            b.probe -= 1
            ok = not b.speculate
        else:
            b.since += 1
            due = b.since > (FIRST_PLAIN_PROBE if b.speculate and not b.rates[False].samples else b.every)
            if due:
                b.probe, b.since, b.probing = PROBE - 1, 0, True
            ok = b.speculate != due
        self.gated += not ok
        return ok

    def speculates(self, bucket: int) -> bool:
        """The verdict at this bucket (nothing is counted)."""
        b = self.buckets.get(bucket)
        return b is None or b.speculate

    def observe(self, bucket: int, speculative: bool, tokens: float, seconds: float | None) -> None:
        """A round read: its kind, tokens committed, and wall seconds since the read before it
        (None: not a sample, e.g. it compiled)."""
        changed, self._last_kind = self._last_kind is not None and speculative != self._last_kind, speculative
        if seconds is None or seconds <= 0 or changed:
            return
        b = self.buckets[bucket]
        b.rates[speculative].add(tokens, seconds)
        probed = speculative != b.speculate
        if probed:
            b.since = 0  # the other kind was just measured (a probe, or the policy's own choice)
        if b.probe == 0 and b.judged():
            self._judge(b, probed)

    @staticmethod
    def _judge(b: Bucket, probed: bool) -> None:
        """After a sample: flip the verdict where the other kind leads by ``MARGIN`` (a sample of
        the verdict's own kind can flip it too: speculation that got worse is seen at once); after
        a sample of the other kind that left it, lengthen the interval to the next probe."""
        lead = b.lead()
        if lead < 1.0 - MARGIN:
            b.speculate, b.every, b.since = not b.speculate, RECHECK[0], 0
        elif probed and b.probing:
            b.every = RECHECK[1] if lead >= CLEAR_LEAD else min(2 * b.every, RECHECK[1])
        if probed:
            b.probing = False

    def state(self) -> dict:
        """Per bucket: the verdict and both kinds' measured tokens per second (for inspection and
        tests; /metrics counts the gated rounds from the decoder's tally)."""
        return {n: dict(speculate=b.speculate, spec_tps=b.rates[True].per_second,
                        plain_tps=b.rates[False].per_second)
                for n, b in sorted(self.buckets.items())}
