"""``infer/bench.py gpu`` on its CPU fallback (tiny target + tiny drafters): every field of the
result exists, ratios are finite and positive, the projections follow from the measured parts,
the simulation is recorded in the JSON and the table."""
import argparse
import json
import math

import pytest

from d3d_jax.bench import gpu

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu")
    # 64 tokens, median of 3: sync's decode phase is ~7 rounds (~45 ms), well above the noise of a
    # loaded machine (16 tokens, one run: one round of ~7 ms, measured at -1.8 ms once in CI).
    # Async branches at 4 positions, not 12: a third of the packed forward to compile and run
    args = gpu.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--max-new", "64", "--prompt-len", "16", "--repeats", "3", "--loop-iters", "1",
         "--branch-positions", "4", "--out", str(out)])
    res = gpu.main(args)
    return res, json.loads((out / "bench_gpu.json").read_text()), (out / "bench_gpu.md").read_text()


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_result_records_the_simulation_and_the_fallback(result):
    res, saved, md = result
    assert saved["simulated_acceptance"] == {"tau": 7.9, "hit_rate": 0.7, "seed": 0,
                                             "schedule": "match-expected"}
    assert "SIMULATED acceptance (match-expected): tau 7.9, hit rate 0.7" in md
    assert saved["shapes"] == "tiny CPU fallback" and saved["skipped"] == []
    assert [t["label"] for t in saved["targets"]] == ["tiny"]
    assert _positive(saved["copy_bandwidth_GBps"]) and saved["nominal_bandwidth_GBps"] is None
    assert saved["environment"]["platform"] == "cpu" and saved["elapsed_s"] > 0


def test_modes_roofline_and_parts_are_finite_and_positive(result):
    t = result[1]["targets"][0]
    for mode in ("plain", "sync", "async"):
        for k in ("s", "round_ms", "speedup", "decode_speedup", "tau"):
            assert _positive(t[mode][k]), (mode, k, t[mode][k])
        assert t[mode]["tokens"] == 64
    assert t["plain"]["tau"] == 1.0 and t["plain"]["speedup"] == 1.0
    assert 7.0 <= t["sync"]["tau"] <= 8.0 and 7.0 <= t["async"]["tau"] <= 8.0  # simulated, not real
    assert 0.0 <= t["async"]["hit_rate"] <= 1.0 and _positive(t["async"]["ratio_to_sync"])
    assert t["sync"]["speedup"] == pytest.approx(t["plain"]["s"] / t["sync"]["s"])
    assert t["weights_bytes"] == 4 * (4096 * 256 + 4 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 768
                                                         + 2 * 256 + 2 * 64) + 256)  # tiny, f32
    roof = t["roofline"]
    assert roof["ratio_measured_bw"] == pytest.approx(roof["ms_per_token_measured_bw"] / t["plain"]["round_ms"])
    for k in ("verify", "packed", "draft", "draft_miss", "host"):
        assert _positive(t["parts_ms"][k]), k
    assert t["parts_ratios"]["packed_over_verify"] == pytest.approx(t["parts_ms"]["packed"] / t["parts_ms"]["verify"])


def _recompute(parts, tau, plain_ms, hit):
    v, p, d, miss, host = (parts[k] for k in ("verify", "packed", "draft", "draft_miss", "host"))
    two = max(v, p) + (1 - hit) * miss + host
    return {"two_device_async_round_ms": two, "one_device_async_round_ms": v + p + (1 - hit) * miss + host,
            "sync_round_ms": d + v, "two_device_async_speedup": tau * plain_ms / two,
            "sync_speedup": tau * plain_ms / (d + v)}


def test_projection_is_computed_from_the_measured_parts(result):
    t = result[1]["targets"][0]
    pr = t["projected"]
    assert pr["hit_rate"] == 0.7 and pr["tau"] == t["sync"]["tau"]
    assert pr["plain_ms_per_token"] == t["plain"]["round_ms"]
    want = _recompute(t["parts_ms"], t["sync"]["tau"], t["plain"]["round_ms"], 0.7)
    for k, v in want.items():
        assert pr[k] == pytest.approx(v, rel=1e-12), k
    assert "**projected two-device async round**" in result[2]


def test_drafter_table_rows_share_verify_and_follow_the_formula(result):
    t = result[1]["targets"][0]
    rows = t["drafter_table"]
    assert [r["drafter"] for r in rows] == ["tiny-drafter", "tiny, 3 layers"]
    assert rows[0]["draft_ms"] == t["parts_ms"]["draft"]  # the main drafter's own measurement
    assert rows[1]["params_bytes"] > rows[0]["params_bytes"] > 0
    for r in rows:
        assert r["verify_ms"] == t["parts_ms"]["verify"] and r["host_ms"] == t["parts_ms"]["host"]
        parts = {k: r[f"{k}_ms"] for k in ("verify", "packed", "draft", "draft_miss", "host")}
        want = _recompute(parts, t["sync"]["tau"], t["plain"]["round_ms"], 0.7)
        assert r["projected_two_device_async_speedup"] == pytest.approx(want["two_device_async_speedup"])
        assert r["projected_sync_speedup"] == pytest.approx(want["sync_speedup"])
        assert all(_positive(r[k]) for k in ("draft_ms", "packed_ms", "two_device_async_over_sync"))
    assert "## Drafter size, target tiny" in result[2] and "| tiny, 3 layers |" in result[2]


def test_verify_cost_is_unchanged_by_the_simulation(result):
    vc = result[1]["targets"][0]["verify_cost"]
    assert abs(vc["flops_ratio"] - 1) < 1e-3 and abs(vc["bytes_ratio"] - 1) < 1e-3
    assert _positive(vc["real"]["ms"]) and _positive(vc["simulated"]["ms"])
    assert "flops ×1.0000" in result[2]


def test_greedy_identity_with_real_acceptance_holds_in_f32(result):
    ident = result[1]["targets"][0]["identity"]
    # the CPU fallback is f32: every mode reproduces plain exactly (the engine's guarantee)
    assert ident["prompts"] == 2
    assert ident["sync"]["same_as_plain"] == 2 and ident["async"]["same_as_plain"] == 2
    assert ident["sync"]["tau"] > 8 and ident["async"]["tau"] > 8  # the replay is accepted
    assert "sync 2/2 prompts" in result[2] and "async 2/2 prompts" in result[2]
