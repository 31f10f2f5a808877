"""Auto mode and what it rests on: row placement, windows, batched admission.

References: each request decoded alone by plain decoding (test_engine checks plain against
transformers) for "lossless in every mix of modes"; a fresh drafter prefill of the committed
tokens for "the drafter's cache stays exact across plain rounds"; closed forms for the policy's
expected tokens; a brute-force list model for the placement's swaps; counted dispatches for
"8 arrivals, one prefill per prompt bucket".
"""

from __future__ import annotations

import collections
import itertools
import math
import random

import jax
import numpy as np
import pytest

from d3d_jax.bench.generator import Generator
from d3d_jax.decoding.async_replay import CostedReplayDrafter
from d3d_jax.decoding.auto_gate import Gate
from d3d_jax.decoding.auto_policy import Acceptance, Geometry, Plan, Policy, Pool, geometric_rate
from d3d_jax.decoding.decoder import DecoderConfig, Request, SpecDecoder, load_weights, slots_in_use
from d3d_jax.decoding.drafting import ModelDrafter
from d3d_jax.decoding.window import RowPlacement
from tiny_models import serve, tiny_pair

VOCAB, MASK, BLOCK, CACHE, SLOTS = 32, 31, 4, 96, 3
LENGTHS = (1, 9, 4, 7, 2, 21)  # two prompt buckets (16, 32)
MAX_NEW = (30, 14, 26, 12, 20, 28)


@pytest.fixture(scope="module")
def setup():
    target, drafter_model = tiny_pair(VOCAB, MASK)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, MASK, n).tolist() for n in LENGTHS]
    solo = [o.token_ids for o in Generator()(target, prompts, max_new_tokens=max(MAX_NEW),
                                             batch_size=1, block_size=BLOCK, max_cache_len=CACHE)]
    assert all(len(set(s)) > 4 for s in solo)
    # real drafter compute and cache, acceptance from a replay of the solo outputs (τ > 1)
    drafter = CostedReplayDrafter(solo, VOCAB, drafter_model, error_rate=0.25, hit_rate=0.6,
                                  seed=1, mask_token_id=MASK)
    # rounds over the whole batch only: each (geometry, width) compiles its own round program.
    # Auto's narrower windows run in test_paged_decoding's auto decoder (widths 1 and 3)
    cfg = DecoderConfig(mode="auto", num_slots=SLOTS, max_cache_len=CACHE, block_size=BLOCK, row_buckets=(SLOTS,))
    return dict(target=target, drafter_model=drafter_model, prompts=prompts, solo=solo,
                drafter=drafter, auto=SpecDecoder(target, drafter, cfg))


_FORWARDS: dict = {}


def full_logits(model, ids) -> np.ndarray:
    """``model``'s logits at every position of ``ids``: one uncached causal forward, right-padded
    to ``CACHE`` tokens (causal: the pad never reaches a real position), so that every length
    runs one compiled program rather than each length compiling every op again."""
    from flax import nnx

    if id(model) not in _FORWARDS:
        graphdef, params = nnx.split(model)
        _FORWARDS[id(model)] = (model, params, jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)))
    _, params, forward = _FORWARDS[id(model)]
    row = np.zeros((1, CACHE), np.int32)
    row[0, :len(ids)] = ids
    return np.asarray(forward(params, row))[0, :len(ids)]


def ungate(dec, monkeypatch) -> None:
    """The policy's own choice runs (the gate judges by wall time, which tests that set the
    costs or the choice do not control)."""
    monkeypatch.setattr(dec.strategy.gate, "before", lambda bucket: True)
    monkeypatch.setattr(dec.strategy.gate, "speculates", lambda bucket: True)


class Cycle:
    """A stand-in for the policy's choice: every plan in turn (whole batch in each geometry,
    and the split into a speculative and a plain group), so every mix of modes happens."""

    def __init__(self, policy: Policy):
        self.policy, self.i = policy, 0

    def __call__(self, rows, boundary):
        n, geoms = len(rows), self.policy.geometries
        plans = [[(0, n, g)] for g in geoms]
        if n > 1:
            plans += [[(0, n // 2 + 1, g), (n // 2 + 1, n, self.policy.plain)]
                      for g in self.policy.speculative]
        self.i += 1
        return Plan(plans[self.i % len(plans)], 0.0, 1.0)


def test_auto_greedy_equals_plain_in_every_mix_of_modes(setup, monkeypatch):
    """Plain, sync, async and split rounds in turn, requests joining, leaving and cancelled:
    every completed request gets exactly its solo plain output, and its rounds are counted
    per geometry."""
    s, dec = setup, setup["auto"]
    monkeypatch.setattr(dec.strategy.policy, "choose", Cycle(dec.strategy.policy))
    ungate(dec, monkeypatch)
    reqs = [Request(p, n, index=i) for i, (p, n) in enumerate(zip(s["prompts"], MAX_NEW))]
    metrics, before = {}, dec.decisions()
    # the reference tally: every round as the strategy observed it
    want = collections.defaultdict(collections.Counter)
    observe = dec.strategy.observe

    def watched(parts, host_outs, seconds, snapshot, wall=None):
        for p in parts:
            timed = seconds is not None and len(parts) == 1 and math.isfinite(p.predicted_s)
            want[p.label].update(rounds=1, timed_rounds=int(timed))
        return observe(parts, host_outs, seconds, snapshot, wall=wall)

    monkeypatch.setattr(dec.strategy, "observe", watched)
    tokens, reasons = serve(dec, reqs, schedule=[0, 0, 1, 2, 2, 5], cancel={1: 4}, metrics=metrics,
                            pick=0)
    # round time per geometry: only one-part rounds are timed (a split round's time is shared),
    # each with the seconds auto's estimate gave it (none before a geometry's first timing: no
    # warm-up here).  Which rounds are clean depends on the outputs (admissions and run-ahead
    # flushes), so the counts are checked against the observed rounds, not a fixed number.
    delta = {g: {k: v - before.get(g, {}).get(k, 0) for k, v in c.items()} for g, c in dec.decisions().items()}
    assert set(delta) == set(want) == {"plain", "sync/4", "async/4x2"}
    for g, d in delta.items():
        timed = d.get("timed_rounds", 0)
        assert (d["rounds"], timed) == (want[g]["rounds"], want[g]["timed_rounds"]), g
        assert timed < d["rounds"], g  # a geometry's first round compiles: never timed
        if timed:
            assert d["seconds"] > 0 and 0 < d["predicted_seconds"] < float("inf"), g
    assert sum(d.get("timed_rounds", 0) for d in delta.values()) > 0
    assert reasons[1] == "cancelled" and tokens[1] == s["solo"][1][: len(tokens[1])]
    for i in (0, 2, 3, 4, 5):
        assert tokens[i] == s["solo"][i][: MAX_NEW[i]], i
    mixed = [m["modes"] for m in metrics.values()]
    assert all(sum(m.values()) == r for m, r in zip(mixed, (mm["rounds"] for mm in metrics.values())))
    seen = set().union(*mixed)
    assert seen == {"plain", "sync/4", "async/4x2"}, seen
    assert max(m.get("async/4x2", 0) for m in mixed) > 0 and slots_in_use(dec) == []
    assert sum(m["accept_hist"][1:] != [0] * (BLOCK - 1) for m in metrics.values()) >= 3  # drafts accepted


def test_the_drafter_cache_stays_exact_across_plain_rounds(setup, monkeypatch):
    """After plain rounds (no drafter) and a sync round, the drafter's cache holds exactly the
    K/V a fresh prefill of the committed tokens writes, position by position."""
    s, dec = setup, setup["auto"]
    policy = dec.strategy.policy
    plain = next(g for g in policy.geometries if g.label == "plain")
    sync = next(g for g in policy.geometries if g.label == "sync/4")
    order = itertools.chain([plain] * 9 + [sync] + [plain] * 21 + [sync], itertools.repeat(plain))
    monkeypatch.setattr(policy, "choose", lambda rows, b: Plan([(0, len(rows), next(order))], 0, 1))
    ungate(dec, monkeypatch)
    for slot, i in enumerate((1, 3)):
        dec.insert(dec.prefill(Request(s["prompts"][i], 60, index=i)), slot)
    for steps in (10, 22):
        for _ in range(steps):
            dec.step()
        dec._drain()
        assert_cache_equals_prefill(dec, s["drafter_model"])
    dec.free(slots_in_use(dec))


def assert_cache_equals_prefill(dec, drafter_model):
    st = jax.device_get(dec.carry.state)
    cache = st.drafter_state["cache"]  # the costed replay drafter's real model cache
    md = ModelDrafter(drafter_model)
    for slot in slots_in_use(dec):
        row = dec.placement.row_of[slot]
        n = int(cache.lengths[row])
        assert n >= int(st.prompt_len[row]) + 8  # the plain rounds' tokens were caught up
        ref = md.prefill(md.params, None, np.asarray(st.seq[row: row + 1, :n]), np.asarray([n]))
        for got, want in ((cache.k_lbskh, ref.k_lbskh), (cache.v_lbskh, ref.v_lbskh)):
            np.testing.assert_allclose(np.asarray(got[:, row, :n]), np.asarray(want[:, 0, :n]),
                                       atol=2e-5)


def test_mixed_quality_useless_requests_get_plain_rounds(setup, monkeypatch):
    """A drafter that knows half the requests (replay of their output) and not the other half
    (a replay of something else): auto's own choice gives the useless half plain rounds and the
    others speculative ones, and every output is still the plain one."""
    s, dec = setup, setup["auto"]
    good = [0, 2, 4]
    cont = [s["solo"][i] if i in good else s["solo"][(i + 3) % 6][::-1] for i in range(6)]
    # the same drafter structure as the fixture's: the decoder is rebound, nothing recompiles
    load_weights(dec, s["target"], CostedReplayDrafter(cont, VOCAB, s["drafter_model"], error_rate=0.25,
                                              hit_rate=0.6, seed=1, mask_token_id=MASK))
    policy = dec.strategy.policy
    ungate(dec, monkeypatch)  # the device's costs are set below: the wall clock is not that device
    # the pool of finished requests starts empty, from a τ = 6 prior (the first 3 requests' prior;
    # the good ones that finish join it, and are the prior of the 3 admitted after them)
    monkeypatch.setattr(dec.strategy, "pool", Pool(BLOCK, geometric_rate(6.0, 16)))
    # a device where a sync/4 round costs 2.5 plain rounds (async/4x2: 5) per row: 3 rounds that
    # accept nothing bring a useless request's expected tokens in sync/4 from the τ = 6 prior's
    # 3.2 to 2.08 (closed form: 1 + c/2·(1 + c + c²), c = 0.844), under 0.85 × 2.5 of a plain
    # round's, so it is set aside after the minimum 3 speculative rounds; a good one (≈ 2.7) is
    # not.  Set aside, it is judged again after 8 plain rounds (then 16): one more round of
    # nothing accepted puts it back in plain rounds
    costs = policy.costs
    for rows in dec.config.buckets:
        monkeypatch.setitem(costs.seconds, ("plain", rows), 0.01 * rows)
        monkeypatch.setitem(costs.seconds, ("sync/4", rows), 0.025 * rows)
        monkeypatch.setitem(costs.seconds, ("async/4x2", rows), 0.05 * rows)
    monkeypatch.setattr(costs, "measured", lambda *a: None)
    reqs = [Request(p, n, index=i) for i, (p, n) in enumerate(zip(s["prompts"], MAX_NEW))]
    metrics = {}
    tokens, _ = serve(dec, reqs, schedule=[0] * 6, metrics=metrics, pick=0)
    load_weights(dec, s["target"], s["drafter"])
    for i in range(6):
        assert tokens[i] == s["solo"][i][: MAX_NEW[i]], i
        modes = metrics[i]["modes"]
        plain_share = modes.get("plain", 0) / sum(modes.values())
        assert (plain_share < 0.2) if i in good else (plain_share > 0.6), (i, modes)


def test_policy_expected_tokens_and_choice():
    """Expected tokens per round are 1 + Σ_k Π_{j≤k} c_j (closed form), from the prior before any
    round and from the request's own counts after; the choice maximizes tokens per second."""
    c = geometric_rate(4.0, 16)
    assert abs(1 + sum(c ** k for k in range(1, 16)) - 4.0) < 1e-6
    acc = Acceptance(16, 0.5)
    assert acc.expected(4) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    for _ in range(30):
        acc.record(8, 7)  # every draft of every 8-wide round accepted
    rate = (30 + 3 * 0.5) / (30 + 3)
    assert acc.expected(8) == pytest.approx(1 + sum(rate ** k for k in range(1, 8)))
    assert acc.expected(8, left=3) == 3.0  # never more than the request has left
    assert acc.rate(9) == 0.5  # slot 9 was never judged: the prior
    geoms = [Geometry("plain", 1), Geometry("sync/8", 8)]
    pol = Policy(geoms, (1, 2, 4))
    pol.costs.calibrate("plain", 2, 1.0)
    pol.costs.calibrate("sync/8", 2, 3.0)
    sure, useless = Acceptance(16, 0.99), Acceptance(16, 0.01)
    assert pol.choose([(sure, 100)] * 2, 2).key == ("sync/8",)
    assert pol.choose([(useless, 100)] * 2, 2).key == ("plain",)
    assert pol.costs.get("plain", 4) == pytest.approx(2 ** 0.5)  # scaled from the nearest width


def test_a_split_round_is_priced_by_the_split_rounds_that_ran_not_by_its_parts():
    """Two windows in one round cost more than their parts alone.  Priced as the sum of its
    parts' one-part costs, a split looked best where plain rounds over the whole batch made more
    (the mixed level); a timed split round now prices splits of its shape, and scales the
    estimate of splits never run, while leaving the one-part costs to one-part rounds."""
    pol = Policy([Geometry("plain", 1), Geometry("sync/4", 4)], (1, 2, 4))
    for rows, plain, sync in ((1, 0.5, 1.0), (2, 1.0, 1.5), (4, 2.0, 6.0)):
        pol.costs.calibrate("plain", rows, plain)
        pol.costs.calibrate("sync/4", rows, sync)
    good, useless = Acceptance(16, 0.99), Acceptance(16, 0.0)
    batch = [(good, 100)] * 2 + [(useless, 100)] * 2  # rows 0-1 speculate, 2-3 set aside
    # by its parts' sum (sync/4 over 2 rows beside plain over 2: 2.5 s) the split is best:
    # 9.9 tokens in 2.5 s against plain's 4 in 2 s and all-sync/4's 9.9 in 6 s
    split = pol.choose(batch, 2)
    assert [g.label for _, _, g in split.groups] == ["sync/4", "plain"]
    assert split.seconds == pytest.approx(2.5)
    # it took 8 s: the first sample counts at most twice the estimate (5 s), the second is
    # averaged in by half (6.5 s)
    pol.measured([("sync/4", 2), ("plain", 2)], 8.0)
    assert pol.seconds([("sync/4", 2), ("plain", 2)]) == pytest.approx(5.0)
    pol.measured([("sync/4", 2), ("plain", 2)], 8.0)
    assert pol.seconds([("sync/4", 2), ("plain", 2)]) == pytest.approx(6.5)
    assert pol.costs.get("sync/4", 2) == 1.5 and pol.costs.get("plain", 2) == 1.0  # parts untouched
    assert pol.choose(batch, 2).key == ("plain",)  # 9.9 tokens in 6.5 s against 4 in 2
    # a split of another shape, never run: its parts (6.0 + 0.5) times the ratio seen (6.5 / 2.5)
    assert pol.seconds([("sync/4", 4), ("plain", 1)]) == pytest.approx(6.5 * 6.5 / 2.5)
    # later samples weigh 1/3, 1/4 … down to EMA, each at most twice the estimate
    pol.measured([("sync/4", 2), ("plain", 2)], 100.0)
    assert pol.seconds([("sync/4", 2), ("plain", 2)]) == pytest.approx(6.5 * 2 / 3 + 13.0 / 3)


def test_a_request_set_aside_is_judged_again_after_8_then_16_plain_rounds():
    """Set aside for plain rounds, a request speculates again after REJUDGE_AFTER = 8 of them,
    with its counts halved and one round short of judged, so its next round decides; set aside
    again, it waits twice as long."""
    import collections
    import types

    from d3d_jax.decoding.auto import AutoStrategy

    judge = types.SimpleNamespace(prefers_plain=lambda acc, n: acc.rounds >= 3 and acc.rate(1) < 0.5,
                                  bucket=lambda n: n)
    stub = types.SimpleNamespace(policy=judge, pool=0.8, gate=Gate(),
                                 ctx=types.SimpleNamespace(config=types.SimpleNamespace(block_size=16), drafter=None))
    stub._acceptance = lambda info: AutoStrategy._acceptance(stub, info)
    stub._new_acceptance = lambda request: AutoStrategy._new_acceptance(stub, request)
    stub._prefers_plain = lambda acc, n, constrained: judge.prefers_plain(acc, n)
    info = types.SimpleNamespace(stats={}, modes=collections.Counter(), request=Request([1], 1))
    reclassify = lambda: AutoStrategy.reclassify(stub, {5: info})  # noqa: E731
    acc = stub._acceptance(info)
    for _ in range(3):
        acc.record(4, 0)
    assert reclassify() == {5: 1}
    info.stats["class"] = 1  # what the decoder does with the answer
    info.modes["plain"] += 7
    assert reclassify() == {}
    info.modes["plain"] += 1
    assert reclassify() == {5: 0}
    assert acc.rounds == 2 and acc.tested[1] == 1.5 and acc.accepted[1] == 0
    info.stats["class"] = 0
    assert reclassify() == {}  # not judged before its next speculative round
    acc.record(4, 0)
    assert reclassify() == {5: 1}
    info.stats["class"] = 1
    info.modes["plain"] += 15
    assert reclassify() == {}
    info.modes["plain"] += 1
    assert reclassify() == {5: 0}


def test_a_server_warm_up_request_never_joins_the_pool():
    """The pool of finished requests is every new request's prior.  A server's warm-up requests
    (prompts of n ones, run at start-up) joined it, and the first real requests started from
    their τ of 3.5 instead of the drafter's 6.7; marked ``warmup``, they are left out."""
    import collections
    import types

    from d3d_jax.decoding.auto import AutoStrategy
    from d3d_jax.serving import server

    stub = types.SimpleNamespace(pool=0.8, ctx=types.SimpleNamespace(config=types.SimpleNamespace(block_size=16), drafter=None))
    stub._acceptance = lambda info: AutoStrategy._acceptance(stub, info)
    stub._new_acceptance = lambda request: AutoStrategy._new_acceptance(stub, request)
    judged = {}
    for warmup in (False, True):
        info = types.SimpleNamespace(stats={}, modes=collections.Counter(),
                                     request=Request([1] * 16, 33, warmup=warmup))
        for _ in range(3):
            stub._acceptance(info).record(16, 2)
        judged[warmup] = AutoStrategy._pools(stub, info)
    assert judged == {False: True, True: False}
    svc = types.SimpleNamespace(scheduler=types.SimpleNamespace(decoder=types.SimpleNamespace(
        config=types.SimpleNamespace(block_size=16))),
        build=lambda params, ids, seed: Request(ids, params.max_tokens, seed=seed))
    assert server._warmup_request(svc, 32, None).warmup


def test_one_stalled_round_does_not_price_a_geometry_out():
    """A round-time sample counts at most OUTLIER x the estimate: a 5 s stall (a GC, another
    program's compile) on a 10 ms plain round leaves plain the choice; without the bound the
    estimate becomes 2.5 s and plain is never run (so never re-measured) again."""

    pol = Policy([Geometry("plain", 1), Geometry("sync/4", 4)], (1,))
    pol.costs.calibrate("plain", 1, 0.010)
    pol.costs.calibrate("sync/4", 1, 0.030)
    row = [(Acceptance(16, 0.3), 100)]  # sync/4 expects 1.39 tokens: 46 tok/s against plain's 100
    assert pol.choose(row, 1).key == ("plain",)
    pol.costs.measured("plain", 1, 5.0)
    # the first served sample is averaged with start-up's 10 ms (weight 1/2), capped at 2 x 10 ms
    assert pol.costs.get("plain", 1) == pytest.approx((0.010 + 0.020) / 2)
    assert pol.choose(row, 1).key == ("plain",)
    for _ in range(12):  # a real, lasting rise is still followed
        pol.costs.measured("plain", 1, 0.050)
    assert pol.costs.get("plain", 1) > 0.04 and pol.choose(row, 1).key == ("sync/4",)


def test_exploring_rounds_back_off_while_plain_keeps_winning_and_start_over_when_speculation_wins():
    """Where plain rounds win for good, each exploring round (speculation tried after plain rounds
    in a row) doubles the wait for the next, up to EXPLORE_MAX; a speculative plan that wins on
    its prices starts the wait over.  With a fixed wait of 32 the first 1000 rounds held 30
    exploring rounds, each costing 3x a plain round for 1.4x its tokens here."""
    from d3d_jax.decoding import auto_policy as ap
    from d3d_jax.decoding.auto_reasons import row_reason

    pol = Policy([Geometry("plain", 1), Geometry("sync/4", 4)], (2,))
    pol.costs.calibrate("plain", 2, 0.010)
    pol.costs.calibrate("sync/4", 2, 0.030)
    poor = Acceptance(16, 0.3)
    for _ in range(ap.MIN_ROUNDS_TO_SET_ASIDE):
        poor.record(4, 0)  # judged: it explores only by the interval
    rows = [(poor, 10_000)] * 2

    def explored(n):
        out = []
        for i in range(1, n + 1):
            plan = pol.choose(rows, 2)
            assert plan.explore == (plan.key != ("plain",)), (i, plan)
            out += [i] if plan.explore else []
        return out

    waits = [ap.EXPLORE_EVERY << k for k in range(5)]  # 32, 64, ... 512 plain rounds
    assert waits[-1] == ap.EXPLORE_MAX
    expected = list(itertools.accumulate(w + 1 for w in waits))
    assert explored(expected[-1] + 600) == expected + [expected[-1] + ap.EXPLORE_MAX + 1]
    good = Acceptance(16, 0.99)
    assert not pol.choose([(good, 10_000)] * 2, 2).explore  # speculation wins on its prices
    assert explored(ap.EXPLORE_EVERY + 1) == [ap.EXPLORE_EVERY + 1]  # the wait starts over
    info = collections.namedtuple("Info", "stats request")({}, None)
    assert row_reason(info, True, False, 3, explore=True) == "explore"
    assert row_reason(info, True, False, 3) == "gain"


def test_placement_keeps_live_rows_packed_in_class_order():
    """Random joins, leaves and class changes: the swaps, replayed on a plain list (the device's
    view), put every slot where the placement says, live rows at [0, n), class 0 first."""
    rng = random.Random(0)
    pl, rows = RowPlacement(8), [None] * 8
    for _ in range(400):
        live = list(pl.row_of)
        op = rng.random()
        if op < 0.4 and pl.size < 8:
            slot = next(s for s in range(8) if s not in pl.row_of)
            rows[pl.size] = slot  # admitted into the next row, then moved
            ops = pl.place(slot, rng.randrange(2))
        elif op < 0.7 and live:
            ops = pl.remove(rng.choice(live))
        elif live:
            slot = rng.choice(live)
            ops = pl.set_class(slot, 1 - pl.cls[slot])
        else:
            continue
        for a, b in ops:
            rows[a], rows[b] = rows[b], rows[a]
        for slot, row in pl.row_of.items():
            assert rows[row] == slot
        assert sorted(pl.row_of.values()) == list(range(pl.size))
        classes = [pl.cls[rows[r]] for r in range(pl.size)]
        assert classes == sorted(classes) and classes.count(0) == pl.boundary


def test_one_admission_dispatch_for_eight_arrivals(setup, monkeypatch):
    """8 requests arriving together are prefilled in one dispatch per prompt-length bucket
    among them (not one per request), and each then decodes exactly its solo output; a round
    over 1 live row in 8 slots runs the 1-row program."""
    from d3d_jax.decoding.decoder_config import prompt_bucket
    from d3d_jax.serving.scheduler import Scheduler

    s = setup
    dec = SpecDecoder(s["target"], None, DecoderConfig(mode="plain", num_slots=8,
                                                       max_cache_len=CACHE, block_size=BLOCK))
    calls = []
    real = dec.strategy._admit
    monkeypatch.setattr(dec.strategy, "_admit", lambda *a: calls.append(int(a[-1])) or real(*a))
    sched = Scheduler(dec)
    got = {i: [] for i in range(8)}
    for i in range(8):
        k = i % 6
        sched.submit(Request(s["prompts"][k], 6 + i, index=i), lambda ev, i=i: got[i].extend(ev.token_ids))
    sched.run_until_idle(timeout_s=300)
    per_bucket = collections.Counter(prompt_bucket(len(s["prompts"][i % 6]), CACHE) for i in range(8))
    assert len(per_bucket) > 1  # the prompts span buckets: the grouping is exercised
    assert calls == [per_bucket[b] for b in sorted(per_bucket)]
    for i in range(8):
        assert got[i] == s["solo"][i % 6][: 6 + i], i
    assert ("plain", 8) in dec.strategy.compiled
    dec.insert(dec.prefill(Request(s["prompts"][0], 3)), 5)
    while slots_in_use(dec):
        for slot, out in dec.step().items():
            if out.finished:
                dec.free(slot)
    assert calls[-1] == 1 and len(calls) == len(per_bucket) + 1 and dec.strategy.compiled >= {("plain", 1)}


def test_costs_of_widths_not_yet_served_follow_the_served_ones():
    """Served rounds at one (geometry, width) re-price the geometry's widths not yet served by the
    same served / start-up ratio (never another geometry's); a key's first served rounds are
    averaged with its start-up time (weights 1/2, 1/3, ... down to EMA)."""
    from d3d_jax.decoding.auto_policy import Costs

    c = Costs()
    for label, times in (("plain", (0.010, 0.012, 0.016)), ("sync/4", (0.020, 0.030, 0.050))):
        for rows, t in zip((1, 2, 4), times):
            c.calibrate(label, rows, t)
    c.measured("plain", 2, 0.024)  # twice start-up's: the cap (2 x 12 ms) does not bite
    assert c.get("plain", 2) == pytest.approx(0.018)  # (12 + 24) / 2 ms
    assert c.get("plain", 1) == pytest.approx(0.015)  # 10 ms x 1.5
    assert c.get("plain", 4) == pytest.approx(0.024)  # 16 ms x 1.5
    assert c.get("sync/4", 4) == pytest.approx(0.050)  # no sync/4 round served: start-up's
    c.measured("sync/4", 4, 0.075)
    assert c.get("sync/4", 4) == pytest.approx(0.0625)  # (50 + 75) / 2 ms
    assert c.get("sync/4", 1) == pytest.approx(0.025)  # its own ratio: 62.5 / 50 = 1.25
    assert c.get("plain", 1) == pytest.approx(0.015)  # plain's stays its own
    c.measured("sync/4", 4, 0.050)
    assert c.get("sync/4", 4) == pytest.approx(0.0625 * 2 / 3 + 0.050 / 3)


def test_pooled_prior_from_finished_requests():
    """A request's prior is the drafter's acceptance pooled over finished requests (with the
    offline rate as the pool's prior, worth PRIOR_ROUNDS = 3 rounds), and every live request's
    expected tokens follow the pool as soon as one joins it."""
    from d3d_jax.decoding.auto_policy import Pool

    pool = Pool(16, 0.5)
    live, done = Acceptance(16, pool), Acceptance(16, pool)
    assert live.expected(2) == pytest.approx(1.5)  # the offline rate alone
    for accepted in (3, 3, 0):
        done.record(4, accepted)
    pool.add(done)
    # slot 1 judged in 3 rounds, accepted in 2: (2 + 3 x 0.5) / (3 + 3); slots 2, 3: (2 + 1.5) / 5
    assert live.expected(2) == pytest.approx(1 + 3.5 / 6)
    assert live.expected(4) == pytest.approx(1 + 3.5 / 6 * (1 + 0.7 + 0.7 ** 2))
    # the finished request's own rounds count on top of the pooled prior: slot 1 (2 + 3 x 3.5 / 6) / 6
    assert done.expected(2) == pytest.approx(1 + (2 + 1.75) / 6)


def test_pooled_slots_no_round_tested_are_no_better_than_the_slot_before():
    """The offline rate is each slot's prior, capped by the pooled rate of the slot before: a
    pool of sync/4 rounds accepting half its drafts prices slots 4-15 at about that half, not at
    the offline τ's 0.85, and a sync/8 round's expected tokens with them."""
    from d3d_jax.decoding.auto_policy import Pool

    c0 = geometric_rate(6.7, 16)  # `small`'s offline τ
    assert 0.84 < c0 < 0.87
    pool, done = Pool(16, c0), Acceptance(16, c0)
    for accepted in [0, 1, 0, 2, 1, 0, 3, 0] * 8:  # 64 sync/4 rounds, slots 1-3 tested
        done.record(4, accepted)
    pool.add(done)
    tested = [pool.rate(k) for k in (1, 2, 3)]
    assert all(0.45 < r < 0.55 for r in tested), tested
    for k in range(4, 16):  # never tested: the slot before's rate, not the offline one
        assert pool.rate(k) == pytest.approx(min(c0, pool.rate(k - 1)))
        assert pool.rate(k) == pytest.approx(pool.rate(3))
    live = Acceptance(16, pool)
    capped = 1 + sum(math.prod(tested[: min(k, 3)]) * tested[2] ** max(0, k - 3) for k in range(1, 8))
    uncapped = 1 + sum(math.prod(tested[: min(k, 3)]) * c0 ** max(0, k - 3) for k in range(1, 8))
    assert live.expected(8) == pytest.approx(capped)
    assert live.expected(8) < 0.9 * uncapped  # 2.03 against 2.27 tokens a sync/8 round
    # with no rounds yet every slot keeps the offline rate
    assert Pool(16, c0).rate(9) == pytest.approx(c0)


def test_plain_rounds_keep_the_next_round_in_flight_near_a_request_end(setup, monkeypatch):
    """A round is dispatched ahead of the read while some request is sure to outlive the rounds
    in flight. That bound is what each of them can commit (a plain round: one token a row), not
    auto's widest geometry: priced at 16 a round, a request 16 tokens from its end stopped the
    run-ahead, and its last plain rounds waited on the host between reads."""
    s, dec = setup, setup["auto"]
    plain = next(g for g in dec.strategy.policy.geometries if g.width == 1)
    monkeypatch.setattr(dec.strategy.policy, "choose",
                        lambda rows, boundary: Plan([(0, len(rows), plain)], float(len(rows)), 1.0))
    ungate(dec, monkeypatch)
    depth, dispatch = [], dec._dispatch

    def spy():
        ran = dispatch()
        depth.append(len(dec._pending))
        return ran

    monkeypatch.setattr(dec, "_dispatch", spy)
    tokens, _ = serve(dec, [Request(s["prompts"][0], 12, index=0)], schedule=[0])
    assert tokens[0] == s["solo"][0][:12]
    # one round a token; from the second dispatch on, the next is always in flight (before: not
    # in the last 3, where a request had under BLOCK = 4 tokens left)
    assert depth == [1] + [2] * 11, depth


def test_a_round_right_after_row_ops_is_not_timed(setup, monkeypatch):
    """A cancelled request's free and the swap that keeps the rows packed run on the device just
    before the next round, so that round's time would hold theirs: it is not timed (as after an
    admission), and the rounds after it are again."""
    s, dec = setup, setup["auto"]
    plain = next(g for g in dec.strategy.policy.geometries if g.width == 1)
    monkeypatch.setattr(dec.strategy.policy, "choose",
                        lambda rows, boundary: Plan([(0, len(rows), plain)], float(len(rows)), 1.0))
    ungate(dec, monkeypatch)
    seen, observe = [], dec.strategy.observe

    def spy(parts, host_outs, seconds, snapshot, wall=None):
        seen.append((sum(info is not None for _, info in snapshot), seconds))
        return observe(parts, host_outs, seconds, snapshot, wall=wall)

    monkeypatch.setattr(dec.strategy, "observe", spy)
    reqs = [Request(p, 30, index=i) for i, p in enumerate(s["prompts"][:3])]
    tokens, reasons = serve(dec, reqs, schedule=[0, 0, 0], cancel={0: 8})
    assert reasons[0] == "cancelled" and all(tokens[i] == s["solo"][i][:30] for i in (1, 2))
    live = [n for n, _ in seen]
    first_two = live.index(2)  # the first round dispatched after the free and the swap
    assert all(n == 3 for n in live[:first_two]) and seen[first_two][1] is None
    assert any(t is not None for n, t in seen[first_two + 1:] if n == 2)


def test_start_up_times_each_program_after_a_lead_in_round(setup, monkeypatch):
    """A program's first round after another program's runs slower (its data is cold); start-up
    times each program's rounds after one untimed lead-in round of it, so it prices what a run of
    its rounds costs (priced on the first round after a switch, plain came out 1.5x too dear)."""
    import time as clock

    dec = setup["auto"]
    st, last = dec.strategy, [None]

    def run(carry, params, label, start, lo, hi, rows):  # 30 ms after a switch, else 5 ms
        clock.sleep(0.030 if label != last[0] else 0.005)
        last[0] = label
        return carry, {}

    monkeypatch.setattr(st, "_run", run)
    monkeypatch.setattr(st, "policy", Policy(st.policy.geometries, st.policy.buckets))
    dec._ensure_state()
    dec.carry = st.warm_up(dec.carry, dec._params, (1,))
    assert len(st.policy.geometries) >= 3
    for g in st.policy.geometries:
        assert st.policy.costs.get(g.label, 1) == pytest.approx(0.005, abs=0.003), g.label


def test_start_up_times_are_kept_with_the_programs_and_read_by_the_next_start(setup, monkeypatch, tmp_path):
    """A start times every (geometry, width) once and keeps the times in the program store; the
    next start of the same decoder reads them and times nothing; one asking for a width never
    timed, or finding the note damaged, times again."""
    import time as clock

    from d3d_jax.decoding.auto import COSTS_NOTE

    cfg = DecoderConfig(mode="auto", num_slots=2, max_cache_len=CACHE, block_size=BLOCK)
    runs: list[str] = []

    def start(widths):
        dec = SpecDecoder(setup["target"], setup["drafter_model"], cfg, program_dir=tmp_path)
        st = dec.strategy

        def run(carry, params, label, start, lo, hi, rows):  # each geometry its own time
            if getattr(st._typed, "on", False):  # the compile-ahead pass: nothing runs
                return carry, {}
            clock.sleep(0.001 * len(label) * rows)
            runs.append(label)
            return carry, {}

        monkeypatch.setattr(st, "_run", run)
        dec._ensure_state()
        runs.clear()
        dec.carry = st.warm_up(dec.carry, dec._params, widths)
        return dec, dict(st.policy.costs.calibrated), len(runs)

    first, costs, n_first = start((1,))
    keys = len(first.strategy.geometry)
    assert keys >= 3 and set(costs) == {(g, 1) for g in first.strategy.geometry}
    assert n_first > keys  # compiled, then timed
    _, again, n_again = start((1,))
    assert again == costs and n_again == keys  # compiled (or read) only: no timed round
    _, wider, n_wider = start((1, 2))
    assert n_wider > 2 * keys and set(wider) == {(g, w) for g in first.strategy.geometry for w in (1, 2)}
    (first.programs.dir / f"{COSTS_NOTE}.json").write_text("{not json")
    _, _, n_damaged = start((1,))
    assert n_damaged > keys


def test_a_prompt_the_drafter_cannot_predict_judges_its_request_at_admission():
    """The prompt score scales a request's prior by score / (0.5 x the pooled requests' mean),
    at most 1: a request whose prompt the drafter predicts as well as the pooled ones keeps the
    pooled prior and is judged by its own rounds; one with score 0 expects 1 token a round in
    every geometry, is judged at once (no speculative round) and set aside.  Re-judging takes
    the scale's square root each time; with no pooled score yet the prompt counts for nothing."""
    pool = Pool(16, 0.8)
    ref = Acceptance(16, pool)
    for _ in range(5):
        ref.record(4, 3)
    ref.set_prompt(0.4)
    pool.add(ref)
    assert pool.prompt_ref() == pytest.approx(0.4)
    known, noise, half, none = (Acceptance(16, pool) for _ in range(4))
    known.set_prompt(0.35)  # above half the mean: the full prior
    noise.set_prompt(0.0)
    half.set_prompt(0.05)  # a quarter of the mean's half
    none.set_prompt(float("nan"))  # the drafter gives no score (a replay)
    assert known.prompt_scale() == 1.0 and none.prompt_scale() == 1.0
    assert known.expected(4) == pytest.approx(Acceptance(16, pool).expected(4))
    assert noise.expected(4) == 1.0 and half.prompt_scale() == pytest.approx(0.25)
    c = [half.prior.rate(k) * 0.25 for k in range(4)]
    assert half.expected(4) == pytest.approx(1 + c[1] + c[1] * c[2] + c[1] * c[2] * c[3])
    assert [a.judged for a in (known, noise, half, none)] == [False, True, True, False]
    pol = Policy([Geometry("plain", 1), Geometry("sync/4", 4)], (1, 2))
    pol.costs.calibrate("plain", 2, 1.0)
    pol.costs.calibrate("sync/4", 2, 1.5)
    assert pol.prefers_plain(noise, 2) and not pol.prefers_plain(known, 2)
    # a request not yet judged speculates while that costs the batch under PLAIN_MARGIN (15 %),
    # so that its rounds can judge it; one judged by its prompt does not
    pol.costs.calibrate("sync/4", 1, 1.1)
    pol.costs.calibrate("plain", 1, 1.0)
    assert pol.choose([(Acceptance(16, 0.01), 100)], 1).key == ("sync/4",)
    assert pol.choose([(noise, 100)], 1).key == ("plain",)
    half.fade()
    assert half.prompt_scale() == pytest.approx(0.5) and not half.judged
    fresh = Acceptance(16, Pool(16, 0.8))
    fresh.set_prompt(0.0)
    assert fresh.prompt_scale() == 1.0 and not fresh.judged  # nothing pooled to compare with


def test_the_prompt_score_is_the_share_of_prompt_tokens_the_drafter_predicts(setup):
    """``ModelDrafter.prefill_scored`` against the drafter's uncached forward: per prompt, the
    share of tokens 1 … n-1 equal to the argmax one position before; NaN for a 1-token prompt.
    Auto reads it with the request's first round (``stats['prompt']``)."""
    s = setup
    md = ModelDrafter(s["drafter_model"], MASK)
    prompts = [p for p in s["prompts"] if len(p) > 1] + [[3]]
    want = []
    for p in prompts:
        logits = full_logits(s["drafter_model"], p)
        hits = [int(np.argmax(logits[t])) == p[t + 1] for t in range(len(p) - 1)]
        want.append(np.mean(hits) if hits else np.nan)
    width = max(len(p) for p in prompts)
    bt = np.asarray([p + [0] * (width - len(p)) for p in prompts], np.int32)
    _, got = md.prefill_scored(md.params, None, bt, np.asarray([len(p) - 1 for p in prompts]))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
    assert 0 < np.nanmax(want) and np.isnan(np.asarray(got)[-1])
    # predictable prompts: the drafter's own greedy continuation scores 1
    own = [s["prompts"][1][:3]]
    for _ in range(8):
        own[0].append(int(np.argmax(full_logits(s["drafter_model"], own[0])[-1])))
    _, one = md.prefill_scored(md.params, None, np.asarray(own, np.int32), np.asarray([10]))
    assert float(one[0]) >= 0.8 - 1e-6  # of tokens 1..10, 3..10 are its own argmaxes


def test_auto_reads_each_request_s_prompt_score_with_its_first_round(setup, monkeypatch):
    """With a model drafter, admission keeps each row's prompt score on the device (through the
    row swaps of placement) and the first round brings it to the request's Acceptance."""
    s = setup
    cfg = DecoderConfig(mode="auto", num_slots=2, max_cache_len=CACHE, block_size=BLOCK)
    dec = SpecDecoder(s["target"], s["drafter_model"], cfg)
    plain = dec.strategy.policy.plain
    monkeypatch.setattr(dec.strategy.policy, "choose", lambda rows, b: Plan([(0, len(rows), plain)], 0, 1))
    ungate(dec, monkeypatch)
    md = ModelDrafter(s["drafter_model"], MASK)
    prompts = [s["prompts"][1], s["prompts"][3]]
    for slot, p in zip((1, 0), prompts):
        dec.insert(dec.prefill(Request(p, 4, index=slot)), slot)
    dec.step()
    for slot, p in zip((1, 0), prompts):
        _, want = md.prefill_scored(md.params, None, np.asarray([p], np.int32), np.asarray([len(p) - 1]))
        info = dec._slots[slot]
        assert info.stats["prompt"] == pytest.approx(float(want[0]), abs=1e-6)
        assert info.stats["acceptance"].prompt == pytest.approx(float(want[0]), abs=1e-6)
    dec.free(slots_in_use(dec))


def _pool_with_prompt_ref(ref: float) -> Pool:
    pool = Pool(16, 0.8)
    done = Acceptance(16, pool)
    for _ in range(5):
        done.record(4, 3)
    done.set_prompt(ref)
    pool.add(done)
    return pool


def test_a_request_is_speculated_on_to_judge_it_only_once_its_prompt_says_it_is_unlike_the_pool():
    """Exploration (a speculative plan up to PLAIN_MARGIN dearer than all-plain, to judge a
    request) waits for the prompt score (read one round behind) and skips a request whose prompt
    scored like the pooled requests': their prior stands for it.  A prompt scored lower, none
    (NaN), no pooled score to compare with, or a request being judged again still explores."""
    pool = _pool_with_prompt_ref(0.4)
    like = Acceptance(16, pool, scored=True)
    assert like.pending and not like.explores  # the score is on its way
    like.set_prompt(0.3)  # at least half the pooled mean: the full prior, vouched for
    assert not like.pending and like.prompt_scale() == 1.0 and not like.explores
    lower, none, alone = (Acceptance(16, p, scored=True) for p in (pool, pool, Pool(16, 0.8)))
    lower.set_prompt(0.19)  # scale 0.95: not judged by it, not vouched for either
    none.set_prompt(float("nan"))
    alone.set_prompt(0.4)
    assert lower.explores and none.explores and alone.explores
    assert Acceptance(16, pool).explores  # a drafter that scores nothing (a replay)
    pol = Policy([Geometry("plain", 1), Geometry("sync/4", 4)], (1, 2))
    pol.costs.calibrate("plain", 1, 1.0)
    pol.costs.calibrate("sync/4", 1, like.expected(4) / 0.92)  # 8 % fewer tokens a second
    assert none.expected(4) == pytest.approx(like.expected(4))
    assert pol.choose([(like, 100)], 1).key == ("plain",)
    assert pol.choose([(none, 100)], 1).key == ("sync/4",)
    assert pol.choose([(like, 100), (lower, 100)], 2).key == ("sync/4",)
    like.fade()  # judged again: its own rounds decide, not its prompt
    assert like.explores and pol.choose([(like, 100)], 1).key == ("sync/4",)


def test_a_request_judged_by_its_prompt_stays_aside_when_judged_again():
    """A request set aside on its prompt score alone is not swapped back to speculate when its
    re-judging comes and its faded score still sets it aside (each swap is a row operation of
    5-8 ms; with prompt score 0 it came back and went aside every 8, 16, 32 plain rounds); it
    waits twice as long for the next one.  A score the fading lifts goes back as before."""
    import collections
    import types

    from d3d_jax.decoding.auto import AutoStrategy

    pool = _pool_with_prompt_ref(0.4)
    judge = types.SimpleNamespace(prefers_plain=lambda acc, n: acc.judged, bucket=lambda n: n)
    stub = types.SimpleNamespace(policy=judge, pool=pool, gate=Gate(), ctx=types.SimpleNamespace(
        config=types.SimpleNamespace(block_size=16), drafter=None))
    stub._acceptance = lambda info: AutoStrategy._acceptance(stub, info)
    stub._new_acceptance = lambda request: AutoStrategy._new_acceptance(stub, request)
    stub._prefers_plain = lambda acc, n, constrained: judge.prefers_plain(acc, n)
    infos = {s: types.SimpleNamespace(stats={}, modes=collections.Counter(), request=Request([1], 1))
             for s in (3, 5)}
    stub._acceptance(infos[3]).set_prompt(0.0)
    stub._acceptance(infos[5]).set_prompt(0.05)  # scale 0.25, then 0.5 once faded
    assert AutoStrategy.reclassify(stub, infos) == {3: 1, 5: 1}
    for info in infos.values():
        info.stats["class"] = 1
        info.modes["plain"] += 8
    assert AutoStrategy.reclassify(stub, infos) == {5: 0}
    assert infos[3].stats["asides"] == 2 and infos[3].stats["aside_at"] == 8
    infos[3].modes["plain"] += 15
    assert AutoStrategy.reclassify(stub, {3: infos[3]}) == {}
    infos[3].modes["plain"] += 1
    assert AutoStrategy.reclassify(stub, {3: infos[3]}) == {}  # still 0: aside, no swap
    assert infos[3].stats["asides"] == 3 and infos[3].stats["aside_at"] == 24


class AllowedSet:
    """A grammar stand-in with a matcher's interface: the same allowed tokens at every position."""

    def __init__(self, allowed):
        from d3d_jax.decoding.grammar import WORD, words

        bits = np.zeros(words(VOCAB), np.uint32)
        for t in allowed:
            bits[t // WORD] |= np.uint32(1 << (t % WORD))
        self.bits = bits.view(np.int32)

    def mask_into(self, out):
        out[:] = self.bits

    def block(self, drafts, width, candidates=None, first=None):
        from d3d_jax.decoding.grammar import allowed_choice

        drafts = np.array(drafts, np.int32)
        for k in range(width - 1 if candidates is not None else 0):
            drafts[k] = allowed_choice(self.bits, candidates[k], drafts[k])
        return drafts, np.tile(self.bits, (width, 1))

    def advance(self, tokens):
        return True


def masked_greedy(target, prompt, n, allowed) -> list[int]:
    """Brute force: a full forward over the whole sequence per token, argmax over ``allowed``."""
    ids = list(prompt)
    for _ in range(n):
        logits = full_logits(target, ids)[-1]
        ids.append(max(allowed, key=lambda t: logits[t]))
    return ids[len(prompt):]


def test_constrained_requests_run_plain_beside_requests_that_speculate(setup, monkeypatch):
    """A batch where two requests are constrained (their drafts, replays of unconstrained
    outputs, are mostly rejected) and four are not: the constrained ones run plain rounds in
    every round, counted with the reason "grammar", while the others speculate in the same
    rounds; every output is greedy decoding's (brute force under the mask for the constrained)."""
    from d3d_jax.decoding.auto import GRAMMAR_PRIOR_TAU
    from d3d_jax.decoding.auto_policy import Pool, geometric_rate

    s, dec = setup, setup["auto"]
    ungate(dec, monkeypatch)
    # the grammar pool as a fresh decoder starts it: the module's earlier constrained requests,
    # which speculated, taught this shared decoder that constrained drafts pay (as they should)
    fresh = Pool(dec.config.block_size, geometric_rate(GRAMMAR_PRIOR_TAU, max(16, dec.config.block_size)))
    monkeypatch.setattr(dec.strategy, "grammar_pool", fresh)
    # a device where a speculative round costs 2.5 plain rounds or more: the constrained rows,
    # judged again after 8 plain rounds on the grammar prior, stay plain whatever this machine's
    # wall clock says of its rounds (timed, a loaded machine made sync/4 look cheap enough)
    costs = dec.strategy.policy.costs
    for geom in dec.strategy.policy.geometries:
        scale = 1.0 if geom.width == 1 else 2.5 * max(1.0, geom.width / 4) * (2 if geom.label.startswith("async") else 1)
        for rows in dec.config.buckets:
            monkeypatch.setitem(costs.seconds, (geom.label, rows), 0.01 * rows * scale)
    monkeypatch.setattr(costs, "measured", lambda *a: None)
    allowed = [t for t in range(VOCAB) if t % 3 and t != MASK]
    constrained = (1, 4)
    reqs = [Request(p, n, index=i, grammar=AllowedSet(allowed) if i in constrained else None)
            for i, (p, n) in enumerate(zip(s["prompts"], MAX_NEW))]
    metrics, before = {}, dec.decisions()
    tokens, _ = serve(dec, reqs, schedule=[0] * 6, metrics=metrics, pick=0)
    spoke = set()
    for i in range(6):
        modes, reasons = metrics[i]["modes"], metrics[i]["reasons"]
        if i in constrained:
            assert tokens[i] == masked_greedy(s["target"], s["prompts"][i], MAX_NEW[i], allowed), i
            assert set(modes) == {"plain"} and reasons == {"grammar": modes["plain"]}, (i, modes, reasons)
        else:
            assert tokens[i] == s["solo"][i][: MAX_NEW[i]], i
            assert reasons.get("gain", 0) > 0 and sum(reasons.values()) == sum(modes.values()), (i, reasons)
            spoke |= {g for g in modes if g != "plain"}
    assert spoke  # the unconstrained requests speculated
    grammar_rows = sum(c.get("rows:grammar", 0) - before.get(g, {}).get("rows:grammar", 0)
                       for g, c in dec.decisions().items())
    assert grammar_rows == sum(metrics[i]["modes"]["plain"] for i in constrained)
    from d3d_jax.serving.mode_metrics import render

    line = next(x for x in render(dec.decisions()) if x.startswith(
        'd3d_mode_row_rounds_total{mode="plain",geometry="-",reason="grammar"}'))
    assert float(line.split()[-1]) == dec.decisions()["plain"]["rows:grammar"]
