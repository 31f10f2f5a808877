"""``infer/bench.py eval``: on a CPU-only host it gives itself two host devices, runs
async with target and drafter on disjoint ones by default, and every async row carries the measured
overlap fraction; the table shows 1/τ and the drafter's share of round time beside the speedup."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TARGET, DRAFTER = REPO / "artifacts/demo/models/target", REPO / "artifacts/demo/drafters/small"


def _eval(out: Path, *extra: str, pre: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # the CLI sets its own device count; the session's other flags (conftest's -O0) stay
    env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    cmd = [sys.executable, "infer/bench.py", *pre, "eval", "--target", str(TARGET), "--drafter", str(DRAFTER),
           "--benchmarks", "shakespeare", "--template", "plain", "--samples", "1", "--max-new-tokens", "24",
           "--branch-positions", "4", "--dtype", "float32", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_eval_puts_async_on_two_devices_and_reports_overlap(tmp_path):
    r = _eval(tmp_path / "two")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "target on 1 device(s), drafter on 1 (2 cpu devices)" in r.stdout
    res = json.loads((tmp_path / "two/results.json").read_text())
    assert res["async_devices"] == {"target_devices": 1, "drafter_devices": 1}
    asy, sync = res["results"]["shakespeare"]["async"], res["results"]["shakespeare"]["sync"]
    assert asy["equals_plain"] and sync["equals_plain"]
    assert len(asy["verify_devices"]) == len(asy["packed_devices"]) == 1
    assert asy["verify_devices"] != asy["packed_devices"]
    assert 0.0 < asy["overlap_fraction"] <= 1.0 and 0.0 < asy["drafter_share"]
    assert 0.0 < sync["drafter_share"] < 1.0
    assert sync["target_forwards_per_token"] == pytest.approx(sync["rounds"] / sync["new_tokens"])
    head, _, plain_row, sync_row, async_row = r.stdout[r.stdout.index("| Method"):].splitlines()[:5]
    assert head.endswith("| target fwd/token | drafter share | overlap |")
    assert plain_row.startswith("| plain |") and async_row.startswith("| async |")
    assert async_row.endswith(f"| {asy['overlap_fraction']:.0%} |")
    # one device: async shares it, and none of its packed forward overlaps the verify
    r1 = _eval(tmp_path / "one", "--modes", "plain,async", pre=("--cpu-devices", "1"))
    assert r1.returncode == 0, r1.stdout[-2000:] + r1.stderr[-2000:]
    assert "drafter on the same one (1 cpu devices)" in r1.stdout
    one = json.loads((tmp_path / "one/results.json").read_text())["results"]["shakespeare"]["async"]
    assert one["equals_plain"] and one["overlap_fraction"] == 0.0
    assert one["verify_devices"] == one["packed_devices"] and len(one["verify_devices"]) == 1
