"""Decoding metrics against hand-computed values, and the engine's per-request metrics against the
tokens it produced (every round commits τ tokens; only a request's last round can be cut)."""

import time

import numpy as np
import pytest

from d3d_jax.config import ModelConfig
from d3d_jax.decoding import metrics as M
from d3d_jax.decoding.engine import ReplayDrafter, summarize_outputs
from d3d_jax.bench.generator import Generator

generate = Generator()
from d3d_jax.model.qwen3 import init_model


def test_closed_forms():
    hist = [2, 0, 1, 1]  # rounds with τ = 1, 2, 3, 4
    assert M.tau_from_hist(hist) == pytest.approx((2 * 1 + 1 * 3 + 1 * 4) / 4)
    # slot k accepted in the rounds with τ > k: slot 1 in 2 of 4 rounds, slot 2 in 2, slot 3 in 1
    assert M.slot_accept_rate(hist) == pytest.approx([0.5, 0.5, 0.25])
    r1 = M.request_metrics(hist, 9, 0.5, mode="sync", batch_index=0)
    r2 = M.request_metrics([1, 1, 0, 0], 3, 0.5, mode="sync", batch_index=0)
    r3 = M.request_metrics([0, 0, 0, 2], 8, 0.25, mode="sync", batch_index=1)
    assert r1["tokens_per_s"] == pytest.approx(18.0)
    s = M.summarize([r1, r2, r3])
    assert s["accept_hist"] == [3, 1, 1, 3] and s["rounds"] == 8
    assert s["tau"] == pytest.approx((3 + 2 + 3 + 12) / 8)
    assert s["wall_s"] == pytest.approx(0.75)  # two batches, each counted once
    assert s["tokens_per_s"] == pytest.approx(20 / 0.75)


def test_engine_metrics_agree_with_its_tokens():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=False)
    target = init_model(cfg, 0)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    plain = generate(target, prompts, max_new_tokens=21)
    block = 5
    drafter = ReplayDrafter([o.token_ids for o in plain], 64, error_rate=0.4, seed=2)
    outs = generate(target, prompts, mode="sync", drafter=drafter, max_new_tokens=21, block_size=block)
    for o, p in zip(outs, plain):
        m = o.metrics
        assert o.token_ids == p.token_ids
        hist = np.asarray(m["accept_hist"])
        committed = int((hist * np.arange(1, block + 1)).sum())  # Σ τ over rounds
        assert 0 <= committed - len(o.token_ids) < block  # only the last round is cut
        assert m["rounds"] == hist.sum() and m["num_tokens"] == len(o.token_ids)
        assert np.all(np.diff(m["slot_accept_rate"]) <= 0)  # slot k+1 needs slot k
    s = summarize_outputs(outs)
    assert s["num_tokens"] == 63 and 1.0 < s["tau"] < block
    assert all(p.metrics["tau"] == 1.0 for p in plain)


def test_a_batch_that_compiled_has_no_cpu_time_and_one_that_did_not_has_its_own(monkeypatch):
    """Compile time comes in wall seconds; a compile that waits (a busy host, the disk) takes
    less CPU than that, and CPU minus compile wall time went negative (-0.069 s)."""
    from d3d_jax.bench.clock import CompileClock
    from d3d_jax.decoding import engine

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=False)
    target = init_model(cfg, 3)
    cpu_now = [0.0]

    class StalledCpu:  # the engine's clocks, with a CPU clock that stands still: the batch waited
        perf_counter = staticmethod(time.perf_counter)

        def process_time(self):
            return cpu_now[0]

    monkeypatch.setattr(engine, "time", StalledCpu())
    cold = generate(target, [[1, 2, 3]], max_new_tokens=4, max_cache_len=32, clock=CompileClock)[0].metrics
    assert cold["compile_s"] > 0 and cold["batch_cpu_s"] is None  # was: 0 - compile_s < 0

    def advancing():  # each read 0.125 s later: the batch's start and end reads
        cpu_now[0] += 0.125
        return cpu_now[0]

    monkeypatch.setattr(StalledCpu, "process_time", lambda self: advancing())
    warm = generate(target, [[1, 2, 3]], max_new_tokens=4, max_cache_len=32, clock=CompileClock)[0].metrics
    assert warm["compile_s"] == 0 and warm["batch_cpu_s"] == pytest.approx(0.125)  # two reads, 0.125 apart
