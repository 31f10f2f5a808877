"""Simulated acceptance (benchmarks only): the schedule's mean τ and hit rate against their closed
forms, reproducibility, the real verify's cost kept (compiled cost analysis), refusal outside
the benchmark."""
import argparse
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d3d_jax.bench import simulate as S
from d3d_jax.decoding.branches import BranchLayout

ROOT = Path(__file__).resolve().parents[1]


def _keys(n, seed=0):
    base = jax.random.key(seed)
    return jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.arange(n, dtype=jnp.uint32))


def _bound(p, n):
    """5 standard errors of a mean of n Bernoulli(p) draws (+ float slack)."""
    return 5 * math.sqrt(p * (1 - p) / n) + 1e-6


def test_schedule_is_match_expected_with_mean_tau_and_reproducible():
    n, width = 20000, 16
    keys, pos = _keys(n), jnp.asarray(np.random.default_rng(0).integers(0, 4000, n), jnp.int32)
    sim = S.SimulatedAcceptance(7.9, seed=3)
    real = jnp.zeros((n,), jnp.int32)
    a, tok = sim.accept(real, jnp.full((n,), 11, jnp.int32), pos, keys, width)
    a = np.asarray(a)
    assert set(np.unique(a)) == {6, 7}  # floor and ceil of τ - 1 only
    assert abs((a + 1).mean() - 7.9) <= _bound(0.9, n)
    np.testing.assert_array_equal(np.asarray(tok), 11)  # the target token is kept
    again = np.asarray(sim.accept(real, tok, pos, keys, width)[0])
    np.testing.assert_array_equal(a, again)  # reproducible
    perm = np.random.default_rng(1).permutation(n)  # a row's draw does not depend on its batch slot
    np.testing.assert_array_equal(np.asarray(sim.accept(real, tok, pos[perm], keys[perm], width)[0]),
                                  a[perm])
    other = np.asarray(S.SimulatedAcceptance(7.9, seed=4).accept(real, tok, pos, keys, width)[0])
    assert (other != a).mean() > 0.05  # the seed matters
    # integral τ is exact; τ above the block is clipped to the block
    assert set(np.unique(np.asarray(S.SimulatedAcceptance(4.0).lengths(pos, keys, width)))) == {3}
    assert set(np.unique(np.asarray(S.SimulatedAcceptance(16.0).lengths(pos, keys, 4)))) == {3}


def test_hit_coin_has_the_rate_and_picks_the_branch_of_the_simulated_length():
    n = 20000
    lay = BranchLayout(16, 12, 2)
    keys, pos = _keys(n, 5), jnp.arange(n, dtype=jnp.int32) % 3000
    sim = S.SimulatedAcceptance(7.9, hit_rate=0.7, seed=1)
    accepted = jnp.asarray(np.random.default_rng(2).integers(0, 15, n), jnp.int32)
    real_hit, real_branch = jnp.zeros((n,), bool), jnp.full((n,), 5, jnp.int32)
    hit, branch = map(np.asarray, sim.hit(real_hit, real_branch, accepted, accepted, pos, keys, lay))
    a = np.asarray(accepted)
    reachable = a + 1 <= lay.positions - 1
    assert not hit[~reachable].any()  # no branch past C-1: always a miss
    assert abs(hit[reachable].mean() - 0.7) <= _bound(0.7, int(reachable.sum()))
    np.testing.assert_array_equal(branch[hit], a[hit] * lay.fanout)  # first alternative at a+1
    np.testing.assert_array_equal(branch[~hit], 5)  # a miss keeps the real branch index
    for h in (0.0, 1.0):
        hh = np.asarray(S.SimulatedAcceptance(7.9, hit_rate=h).hit(real_hit, real_branch, accepted,
                                                                   accepted, pos, keys, lay)[0])
        np.testing.assert_array_equal(hh, reachable & (h == 1.0))


@pytest.fixture(scope="module")
def models():
    from d3d_jax.config import load_model_config
    from d3d_jax.model.qwen3 import init_model

    return (init_model(load_model_config("tiny"), 0),
            init_model(load_model_config("tiny-drafter", ["mask_token_id=4095"]), 1))


def test_engine_measures_the_simulated_tau_with_a_real_drafter(models):
    from d3d_jax.decoding.engine import summarize_outputs
    from d3d_jax.bench.generator import Generator

    generate = Generator()

    target, drafter = models
    prompts = np.random.default_rng(0).integers(0, 4000, (4, 12)).tolist()
    sim = S.SimulatedAcceptance(7.9, seed=2)

    def run():
        return generate(target, prompts, mode="sync", drafter=drafter, max_new_tokens=96,
                        acceptance_override=sim)

    outs = run()
    s = summarize_outputs(outs)
    hist = np.asarray(s["accept_hist"])
    assert hist.sum() == s["rounds"] >= 4 * 12
    assert set(np.nonzero(hist)[0] + 1) <= {7, 8}  # τ = floor or ceil of 7.9
    assert abs(s["tau"] - 7.9) <= _bound(0.9, int(hist.sum()))
    assert all(len(o.token_ids) == 96 for o in outs)
    assert [o.metrics["accept_hist"] for o in run()] == [o.metrics["accept_hist"] for o in outs]


@pytest.mark.slow
def test_async_decoding_measures_the_simulated_tau_and_hit_rate(models):
    from d3d_jax.decoding.engine import summarize_outputs
    from d3d_jax.bench.generator import Generator

    generate = Generator()

    target, drafter = models
    prompts = np.random.default_rng(1).integers(0, 4000, (8, 12)).tolist()

    # 96 tokens: ~11 judged rounds a row, ~90 in all; 5 standard errors of the hit rate are then
    # 0.24, so a coin that always hits (or never) still fails
    outs = generate(target, prompts, mode="async", drafter=drafter, max_new_tokens=96,
                    acceptance_override=S.SimulatedAcceptance(7.9, 0.7, seed=3))
    hist = np.asarray(summarize_outputs(outs)["accept_hist"])
    hits, misses = (sum(o.metrics[k] for o in outs) for k in ("hits", "misses"))
    assert set(np.nonzero(hist)[0] + 1) <= {7, 8}
    assert abs((hist * np.arange(1, 17)).sum() / hist.sum() - 7.9) <= _bound(0.9, int(hist.sum()))
    assert hits + misses >= 8 * 10  # every round but a row's last is judged
    assert abs(hits / (hits + misses) - 0.7) <= _bound(0.7, hits + misses)
    assert all(len(o.token_ids) == 96 for o in outs)


def test_simulated_verify_costs_the_same_as_the_real_one(models):
    target, _ = models
    r = S.verify_cost_comparison(target, S.SimulatedAcceptance(7.9, 0.7), context=16, repeats=3)
    # the override adds a few PRNG ops per row to a full target forward: well under 0.1 %
    assert r["real"]["flops"] > 1e7
    assert abs(r["flops_ratio"] - 1) < 1e-3, r
    assert abs(r["bytes_ratio"] - 1) < 1e-3, r
    assert r["real"]["ms"] > 0 and r["simulated"]["ms"] > 0


@pytest.mark.parametrize("kw, match", [
    (dict(tau=0.5), "simulate-tau must be a number >= 1"),
    (dict(tau=float("nan")), "simulate-tau"),
    (dict(tau=8.0, hit_rate=1.5), "simulate-hit-rate must be in"),
    (dict(tau=8.0, seed=-1), "seed"),
])
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(S.SimulationError, match=match):
        S.SimulatedAcceptance(**kw)


def test_block_and_flag_checks():
    S.SimulatedAcceptance(16.0).check_block(16)
    with pytest.raises(S.SimulationError, match="above 14"):
        S.SimulatedAcceptance(14.5, 0.5).check_block(16, asynchronous=True)
    p = argparse.ArgumentParser()
    S.add_arguments(p)
    assert S.from_args(p.parse_args([])) is None
    with pytest.raises(S.SimulationError, match="needs --simulate-tau"):
        S.from_args(p.parse_args(["--simulate-hit-rate", "0.5"]))
    with pytest.raises(S.SimulationError, match="no async rounds"):
        S.from_args(p.parse_args(["--simulate-tau", "4", "--simulate-hit-rate", "0.5"]), hits=False)
    sim = S.from_args(p.parse_args(["--simulate-tau", "4", "--simulate-seed", "2"]))
    assert sim == S.SimulatedAcceptance(4.0, None, 2) and sim.benchmark_only
    assert S.record(sim) == {"tau": 4.0, "hit_rate": None, "seed": 2, "schedule": "match-expected"}
    assert "hit rate unused" in S.header(sim) and "real acceptance" in S.header(None)
    with pytest.raises(S.SimulationError, match="need --simulate-hit-rate"):
        sim.check_block(16, asynchronous=True)
    assert "hit rate 0.5" in S.header(S.SimulatedAcceptance(4.0, 0.5).record())


def test_generate_cli_refuses_simulation_and_points_at_the_benchmark():
    r = subprocess.run([sys.executable, str(ROOT / "infer" / "generate.py"), "--target", "x",
                        "--prompt-ids", "1,2", "--simulate-tau", "8"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert "infer/bench.py" in r.stderr and "--simulate-tau" in r.stderr


@pytest.mark.slow
def test_bench_engine_records_the_simulation_in_json_and_table():
    from d3d_jax.bench import engine as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "2",
                         "--kv-heads", "1", "--head-dim", "32", "--vocab", "256", "--prompt-len", "8",
                         "--max-new-tokens", "32", "--repeats", "1", "--skip-transformers",
                         "--simulate-tau", "4"])
    res = bench.run(args)
    assert res["simulated_acceptance"] == {"tau": 4.0, "hit_rate": None, "seed": 0,
                                           "schedule": "match-expected"}
    assert res["sync_efficiency"]["tau"] == 4.0  # integral τ: every round accepts exactly 3
    assert res["sync_efficiency"]["same_tokens_as_plain"] is None
    table = bench.format_table(res)
    assert "SIMULATED acceptance (match-expected): tau 4" in table
    assert "n/a (simulated acceptance)" in table


@pytest.mark.slow
def test_bench_engine_streams_decode_together_as_each_decodes_alone():
    """``--streams 3``: three prompts in one batch give each prompt's tokens from a decoder of its
    own, equal to transformers' greedy; sync (replaying them) equals plain, paged as dense."""
    from d3d_jax.bench import engine as bench
    from d3d_jax.bench.generator import Generator

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "2",
                         "--kv-heads", "1", "--head-dim", "32", "--vocab", "256", "--prompt-len", "8",
                         "--max-new-tokens", "12", "--block-size", "4", "--streams", "3",
                         "--kv-page-size", "8"])
    hf, target = bench._build_models(args)
    prompts = np.random.default_rng(0).integers(0, 256, (3, 8)).tolist()
    _, plain, sync, hf_tokens = bench._measures(args, hf, target, prompts, {})
    alone = [Generator()(target, [q], max_new_tokens=12, block_size=4)[0].token_ids for q in prompts]
    assert [o.token_ids for o in plain] == alone == hf_tokens
    assert [o.token_ids for o in sync] == alone
    assert len({tuple(t) for t in alone}) == 3  # distinct streams: a row mix-up would show


def test_the_decoder_config_takes_the_simulation():
    from d3d_jax.decoding.decoder import DecoderConfig

    from d3d_jax.config import ConfigError

    for mode in ("sync", "async"):
        cfg = DecoderConfig(mode=mode, acceptance_override=S.SimulatedAcceptance(7.9, 0.7))
        cfg.validate()  # marked benchmark_only: taken
        assert cfg.acceptance_override.benchmark_only is True
    with pytest.raises(ConfigError, match="plain decoding"):  # nothing to accept without drafts
        DecoderConfig(mode="plain", acceptance_override=S.SimulatedAcceptance(7.9, 0.7)).validate()


def test_the_decoder_config_refuses_an_override_without_the_benchmark_marker():
    from d3d_jax.config import ConfigError
    from d3d_jax.decoding.decoder import DecoderConfig

    @dataclasses.dataclass(frozen=True)
    class Unmarked:  # a working override, but not declared benchmark-only
        def accept(self, accepted, next_token, anchor_pos, row_keys, width):
            return accepted, next_token

    with pytest.raises(ConfigError, match="benchmark"):
        DecoderConfig(mode="sync", acceptance_override=Unmarked()).validate()
