"""Auto's speculation gate: speculation is turned off at a load where its rounds
delivered fewer tokens per wall second than plain rounds, and back on when a probe finds it ahead.

References: a simulated device whose two kinds of round deliver known tokens per second (the gate
reads each round one round late, as the decoder does); for the decoder, greedy outputs against
each request decoded alone by plain decoding, and a sleep planted in the admission."""

from __future__ import annotations

import collections
import time

import pytest

from d3d_jax.decoding import auto_gate as G
from d3d_jax.decoding.auto_gate import Gate
from d3d_jax.decoding.decoder import Request
from d3d_jax.serving.mode_metrics import render
from tiny_models import serve
from test_auto import MAX_NEW, setup  # noqa: F401  (the module fixture: tiny target, replay drafter)


class Device:
    """Rounds at one bucket: a speculative one commits ``spec`` tokens, a plain one ``plain``, each
    in 10 ms; the first round after a change of kind takes ``switch`` times as long.  The gate is
    asked before each round and reads it one round later."""

    def __init__(self, gate: Gate, spec: float, plain: float, switch: float = 1.0, bucket: int = 16):
        self.gate, self.spec, self.plain, self.switch, self.bucket = gate, spec, plain, switch, bucket
        self.kinds: list[bool] = []
        self._in_flight: collections.deque = collections.deque()

    def run(self, rounds: int) -> list[bool]:
        """The kinds (True: speculative) of ``rounds`` rounds where the policy wants to speculate."""
        out = []
        for _ in range(rounds):
            kind = self.gate.before(self.bucket)
            seconds = 0.01 * (self.switch if self.kinds and kind != self.kinds[-1] else 1.0)
            self.kinds.append(kind)
            out.append(kind)
            self._in_flight.append((kind, self.spec if kind else self.plain, seconds))
            if len(self._in_flight) > 1:
                self.gate.observe(self.bucket, *self._in_flight.popleft())
        return out


def _probe_gaps(kinds: list[bool]) -> list[int]:
    starts = [i for i in range(1, len(kinds)) if kinds[i] and not kinds[i - 1]]
    return [b - a for a, b in zip(starts, starts[1:])]


def test_speculation_that_delivers_less_than_plain_is_gated_and_probed_ever_more_rarely():
    gate = Gate()
    kinds = Device(gate, spec=15.0, plain=16.0).run(800)  # plain leads by 7 %
    # it speculates first (nothing says otherwise), measures plain after FIRST_PLAIN_PROBE rounds
    assert all(kinds[:G.FIRST_PLAIN_PROBE])
    assert not any(kinds[G.FIRST_PLAIN_PROBE:G.FIRST_PLAIN_PROBE + G.PROBE])
    # and from there on runs plain but for probes of PROBE rounds, further and further apart
    tail = kinds[G.FIRST_PLAIN_PROBE + G.PROBE:]
    assert sum(tail) <= 6 * G.PROBE and gate.gated >= len(tail) - sum(tail)
    gaps = _probe_gaps(tail)
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] >= 3 * gaps[0]
    assert gate.state()[16]["speculate"] is False
    # a clear lead (CLEAR_LEAD) probes at the longest interval at once
    kinds = Device(Gate(), spec=12.0, plain=16.0).run(800)
    assert set(_probe_gaps(kinds[G.FIRST_PLAIN_PROBE + G.PROBE:])) == {G.RECHECK[1] + G.PROBE + 1}


def test_a_probe_turns_speculation_back_on_when_it_got_better():
    gate = Gate()
    dev = Device(gate, spec=12.0, plain=16.0)
    dev.run(100)
    assert not gate.buckets[16].speculate
    dev.spec = 30.0  # the batch changed: speculation now pays
    kinds = dev.run(2 * G.RECHECK[1])
    flip = next(i for i in range(len(kinds) - 10) if all(kinds[i:i + 10]))
    assert flip <= G.RECHECK[1] and gate.buckets[16].speculate
    # from there plain runs only in its probes: one after RECHECK[0] rounds, then at the longest
    assert len(kinds[flip:]) - sum(kinds[flip:]) <= 2 * G.PROBE


def test_speculation_that_leads_clearly_costs_few_plain_rounds():
    """One client: sync/16 makes 1.4x plain; after the first plain probe, plain is measured again
    only every RECHECK[1] rounds."""
    gate = Gate()
    kinds = Device(gate, spec=14.0, plain=10.0, bucket=1).run(1000)
    plain = len(kinds) - sum(kinds)
    assert gate.buckets[1].speculate and gate.buckets[1].every == G.RECHECK[1]
    assert plain <= G.PROBE * (1 + 1000 // G.RECHECK[1])  # about 2 % of the rounds


def test_the_first_round_after_a_change_of_kind_is_not_a_sample():
    """The first speculative round after plain ones pays the drafter's catch-up (here 3x a
    round): counted, speculation at 1.2x plain would look 0.9x and be gated."""
    gate = Gate()
    Device(gate, spec=19.2, plain=16.0, switch=3.0).run(300)
    assert gate.buckets[16].speculate
    assert gate.buckets[16].rates[True].per_second == pytest.approx(1920.0)


def test_a_lead_within_the_margin_keeps_what_runs():
    gate = Gate()
    dev = Device(gate, spec=16.0, plain=16.0 * (1 + G.MARGIN / 2))
    kinds = dev.run(300)
    assert gate.buckets[16].speculate and sum(kinds) > 0.9 * len(kinds)
    dev.plain = 16.0 * (1 + 2 * G.MARGIN)
    dev.run(300)
    assert not gate.buckets[16].speculate


def test_one_stalled_round_does_not_flip_the_verdict():
    """Plain leads (16 against 12 tokens a 10 ms round), then one plain round stalls 20x (another
    process on a shared host): the verdict stays plain; a fall that lasts half the window flips
    it."""
    gate = Gate()
    dev = Device(gate, spec=12.0, plain=16.0)
    dev.run(100)
    assert not gate.buckets[16].speculate
    gate.observe(16, False, 16.0, 0.01)  # a plain round after plain ones: a sample
    gate.observe(16, False, 16.0, 0.2)
    assert not gate.buckets[16].speculate
    for _ in range(G.WINDOW // 2):
        gate.observe(16, False, 16.0, 0.2)
    assert gate.buckets[16].speculate


def test_each_bucket_has_its_own_verdict():
    gate = Gate()
    Device(gate, spec=12.0, plain=16.0, bucket=16).run(100)
    Device(gate, spec=20.0, plain=16.0, bucket=4).run(100)
    assert not gate.buckets[16].speculate and gate.buckets[4].speculate


def test_gated_rounds_are_plain_lossless_and_counted(setup, monkeypatch):  # noqa: F811
    """Every speculative choice gated: every request runs plain rounds only, its output is still
    its solo plain decoding, and /metrics counts the rounds the gate turned plain."""
    s, dec = setup, setup["auto"]
    monkeypatch.setattr(dec.strategy.gate, "before", lambda bucket: False)
    before = dec.decisions().get("plain", {}).get("gated_rounds", 0)
    reqs = [Request(p, n, index=i) for i, (p, n) in enumerate(zip(s["prompts"], MAX_NEW))]
    metrics = {}
    tokens, _ = serve(dec, reqs, schedule=[0, 0, 1, 2, 2, 5], metrics=metrics, pick=0)
    assert all(tokens[i] == s["solo"][i][: MAX_NEW[i]] for i in range(6))
    assert all(set(metrics[i]["modes"]) == {"plain"} for i in range(6))
    # each row of each round counted with its reason: the gate's
    assert all(metrics[i]["reasons"] == {"gate": metrics[i]["modes"]["plain"]} for i in range(6))
    gated = dec.decisions()["plain"]["gated_rounds"] - before
    assert gated > 0
    assert any(line.startswith('d3d_mode_gated_rounds_total{mode="plain"') for line in render(dec.decisions()))


def test_the_gate_s_wall_time_holds_the_admissions_between_reads(setup, monkeypatch):  # noqa: F811
    """The gate's samples are all the time since the last read while requests ran: admissions
    that take 0.2 s each show in them (the policy's round times leave them out), and they add up
    to no more than the time the rounds took."""
    s, dec = setup, setup["auto"]
    seen, admitted, observe, admit = [], [], dec.strategy.observe, dec.strategy.admit

    def slow_admit(*a, **k):
        admitted.append(1)
        time.sleep(0.2)
        return admit(*a, **k)

    def spy(parts, host_outs, seconds, snapshot, wall=None):
        seen.append((seconds, wall))
        return observe(parts, host_outs, seconds, snapshot, wall=wall)

    monkeypatch.setattr(dec.strategy, "admit", slow_admit)
    monkeypatch.setattr(dec.strategy, "observe", spy)
    reqs = [Request(p, 12, index=i) for i, p in enumerate(s["prompts"][:2])]
    t0 = time.perf_counter()
    serve(dec, reqs, schedule=[0, 3])
    elapsed = time.perf_counter() - t0
    walls = [w for _, w in seen]
    assert len(admitted) == 2 and all(w is not None and w > 0 for w in walls)
    assert 0.2 * len(admitted) <= sum(walls) <= elapsed
    assert sum(sec for sec, _ in seen if sec is not None) < 0.2  # timed rounds: no admission in them
