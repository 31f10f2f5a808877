"""A real two-process run: train/launch_local.py starts 2 JAX processes × 4 CPU devices on a
localhost coordinator; the tiny drafter trains with fsdp over all 8 devices, each process reading
its own rows of every batch.  Reference: the same run in this (1-process, 8-device) pytest process.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from d3d_jax.config import TrainRunConfig, load_config
from d3d_jax.parallel.distributed import distributed_settings
from d3d_jax.training import data as D
from d3d_jax.training.loop import Trainer

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs/train/tiny.yaml"


def _overrides(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [f"data.train_path={corpus}", "data.dev_batches=0", "model.num_layers=1", "train.steps=4",
            "train.checkpoint_every=2", "train.keep_checkpoints=5", "train.log_every=1", "train.progress_bar=false",
            "train.export_params=false", "train.export_hf=false", f"train.out_dir={out}", *extra]


def _launch_two(overrides: list[str]) -> None:
    cmd = [sys.executable, "train/launch_local.py", "--num-processes", "2", "--devices-per-process", "4",
           "--timeout", "300", "--", "train/train_drafter.py", "--config", str(CONFIG), *overrides]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=360)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert "[p0] " in res.stdout and "[p1] " in res.stdout


def _losses(out: Path) -> dict[int, float]:
    """Per-step train loss from metrics.jsonl (a resumed run appends; the newest line wins)."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def _copy_checkpoint(src: Path, step: int, dst: Path) -> None:
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / str(step), dst / "checkpoints" / str(step))


def test_environment_decides_distributed_settings():
    env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert distributed_settings(env) == dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1)
    # inside a SLURM job but not asked to: a single-process run (a test under srun must not hang)
    assert distributed_settings({}) is None and distributed_settings({"SLURM_NTASKS": "4"}) is None
    assert distributed_settings({"D3D_DISTRIBUTED": "0"}) is None
    for auto in ({"D3D_DISTRIBUTED": "1"}, {"D3D_DISTRIBUTED": "1", "SLURM_NTASKS": "4"},
                 {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}):
        assert distributed_settings(auto) == {}, auto  # jax.distributed.initialize() detects the rest
    with pytest.raises(ValueError, match="JAX_PROCESS_ID=2 is not in"):
        distributed_settings({**env, "JAX_PROCESS_ID": "2"})


def test_launcher_environment_failure_and_timeout():
    """Each process gets its id, the process count, one coordinator and its own device count; one
    failing process stops the others (exit status kept), and --timeout stops a hung run (124)."""
    sys.path.insert(0, str(REPO / "train"))
    import io
    import time

    import launch_local

    report = ("import os; print(os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'], "
              "os.environ['JAX_COORDINATOR_ADDRESS'], os.environ['XLA_FLAGS'])")
    sink = io.StringIO()
    assert launch_local.launch(["-c", report], 3, 2, sink=sink) == 0
    lines = sorted(sink.getvalue().splitlines())
    assert [ln.split()[:3] for ln in lines] == [[f"[p{i}]", str(i), "3"] for i in range(3)]
    assert len({ln.split()[3] for ln in lines}) == 1 and lines[0].split()[3].startswith("127.0.0.1:")
    # the caller's other XLA flags (conftest's -O0) are kept; its device count is replaced
    kept = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith("--xla_force_host_platform_device_count")]
    assert all(ln.split()[4:] == kept + ["--xla_force_host_platform_device_count=2"] for ln in lines)
    t0 = time.time()
    fail = "import os, sys, time; sys.exit(3) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(120)"
    assert launch_local.launch(["-c", fail], 2, 1, sink=io.StringIO()) == 3
    assert launch_local.launch(["-c", "import time; time.sleep(120)"], 2, 1, timeout=2, sink=io.StringIO()) == 124
    assert time.time() - t0 < 60  # neither waited for the sleepers


@pytest.mark.slow
def test_two_processes_equal_one_and_checkpoints_cross_over(tmp_path):
    corpus = D.write_jsonl(tmp_path / "train.jsonl", D.synthetic_records(64, vocab_size=64, seed=0))

    # 1 process × 8 devices, in this process: steps 1-4; its step-2 checkpoint seeds a 2-process resume
    ref = Trainer(load_config(TrainRunConfig, [CONFIG], _overrides(corpus, tmp_path / "one")), log=lambda s: None)
    assert jax.process_count() == 1 and ref.mesh.devices.size == 8
    want = [r["loss"] for r in ref.fit(until=2)]
    ref.checkpointer.wait()
    _copy_checkpoint(tmp_path / "one", 2, tmp_path / "one_then_two")
    want += [r["loss"] for r in ref.fit()]
    ref.close()

    # 2 processes × 4 devices, steps 1-4 (also exporting HF weights gathered from both processes)
    _launch_two(_overrides(corpus, tmp_path / "two", "train.export_hf=true"))
    two = _losses(tmp_path / "two")
    np.testing.assert_allclose([two[s] for s in (1, 2, 3, 4)], want, rtol=1e-6)
    from flax import nnx

    from d3d_jax.io.checkpoint import load_model

    exported = nnx.to_pure_dict(nnx.state(load_model(tmp_path / "two/export/hf"), nnx.Param))
    final = nnx.to_pure_dict(nnx.state(ref.model(), nnx.Param))
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(final)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    # the 2-process checkpoint of step 2 resumes in 1 process ...
    _copy_checkpoint(tmp_path / "two", 2, tmp_path / "two_then_one")
    one = Trainer(load_config(TrainRunConfig, [CONFIG], _overrides(corpus, tmp_path / "two_then_one")),
                  log=lambda s: None)
    assert one.step == 2
    got = [r["loss"] for r in one.fit()]
    one.close()
    np.testing.assert_allclose(got, want[2:], rtol=1e-6)

    # ... and the 1-process checkpoint of step 2 resumes in 2 processes
    _launch_two(_overrides(corpus, tmp_path / "one_then_two"))
    resumed = _losses(tmp_path / "one_then_two")
    assert sorted(resumed) == [3, 4]
    np.testing.assert_allclose([resumed[3], resumed[4]], want[2:], rtol=1e-6)
