"""The continuous-batching scheduler (d3d_jax/serving/scheduler.py): the queue bound.

``max_queue`` bounds the requests that wait for another request to finish; a request that
arrives while a slot is free only waits for the next round and is never refused for the queue.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from serve_fake import TOKENIZER, FakeConfig, FakeDecoder, FakeServer, Request, reference


def _submit(sched, n, prompt_len=3, max_tokens=5):
    """Submit ``n`` requests; (handles accepted, how many were refused, their events)."""
    from d3d_jax.serving.scheduler import QueueFull

    got, refused, events = [], 0, {}
    for i in range(n):
        req = Request(list(range(10 + i, 10 + i + prompt_len)), max_tokens)
        try:
            h = sched.submit(req, lambda ev, i=i: events.setdefault(i, []).append(ev))
        except QueueFull as e:
            assert "already waiting for a slot" in str(e)
            refused += 1
        else:
            got.append((i, h))
    return got, refused, events


def test_free_slots_are_not_counted_as_waiting():
    from d3d_jax.serving.scheduler import Scheduler

    sched = Scheduler(FakeDecoder(FakeConfig(mode="plain", num_slots=8)), max_queue=4)
    got, refused, events = _submit(sched, 16)
    assert (len(got), refused) == (12, 4)  # 8 take the free slots, 4 wait, the rest are refused
    sched.run_round()  # 8 admitted: their slots are held, the 4 queued wait for one
    assert sched.num_active == 8 and sched.num_queued == 4
    assert _submit(sched, 1)[1] == 1
    sched.run_until_idle(timeout_s=10)
    for i, h in got:  # every accepted request ran to its solo reference
        tokens = [t for ev in events[i] for t in ev.token_ids]
        assert events[i][-1].finished and tokens == reference(h.request)[0]
    assert (len(_submit(sched, 12)[0]), _submit(sched, 1)[1]) == (12, 1)  # idle again: the same bound


def test_a_failed_prefill_gives_its_slot_back():
    from d3d_jax.serving.scheduler import Scheduler

    sched = Scheduler(FakeDecoder(FakeConfig(mode="plain", num_slots=2)), max_queue=1)
    bad = sched.submit(Request([], 4), lambda ev: None)  # an empty prompt fails in prefill
    sched.run_round()
    assert bad.done and sched.num_active == 0
    assert _submit(sched, 4)[1] == 1  # 2 free slots + 1 waiting, as before the failure


def test_a_burst_on_an_idle_server_gets_slots_plus_queue():
    """16 simultaneous HTTP requests, 8 slots, max_queue 4: exactly 12 answered, 4 refused (503)."""
    pytest.importorskip("openai")
    from d3d_jax.io.hf import load_tokenizer

    s = FakeServer(load_tokenizer(TOKENIZER)[0], mode="plain", num_slots=8, step_delay_s=0.05,
                   max_queue=4)  # 20 tokens take >= 1 s: no request ends before the burst is in
    try:
        body = {"model": "toy", "prompt": "hello", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        with cf.ThreadPoolExecutor(16) as pool:
            statuses = sorted(st for st, _ in pool.map(lambda _: s.raw("POST", "/v1/completions", body),
                                                       range(16)))
        assert statuses == [200] * 12 + [503] * 4
    finally:
        s.close()
