"""Train-state checkpoints that survive damage (d3d_jax/training/checkpoints.py).

One tiny run saves steps 2 and 4 (the template); each case copies it, damages it the way a
crash, a bad disk or a user would, and resumes.  A damaged newest step must end in a fallback to
step 2 with one warning line, and the resumed run must equal an uninterrupted one; anything
unresumable must end in one short CheckpointError sentence.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from d3d_jax.config import TrainRunConfig, load_config
from d3d_jax.io.manifest import MANIFEST_FILE, CheckpointError
from d3d_jax.training.checkpoints import TrainCheckpointer, settings_diff, trim_metrics
from d3d_jax.training.loop import Trainer
from test_loop import _args, corpus  # noqa: F401  (corpus is a fixture)

REPO = Path(__file__).resolve().parent.parent
RUN = ["train.steps=6", "model.num_layers=1", "train.checkpoint_every=2", "data.dev_batches=0"]


def _cfg(corpus, out, *extra):
    return load_config(TrainRunConfig, [], _args(corpus, out, *RUN, *extra))


@pytest.fixture(scope="module")
def template(corpus, tmp_path_factory):
    """``(run dir holding steps 2 and 4, losses of an uninterrupted 6-step run)``."""
    root = tmp_path_factory.mktemp("ckpt")
    ref = Trainer(_cfg(corpus, root / "ref"))
    want = [r["loss"] for r in ref.fit()]
    ref.close()
    tr = Trainer(_cfg(corpus, root / "template"))
    tr.fit(until=4)
    tr.close()
    assert sorted(os.listdir(root / "template/checkpoints")) == ["2", "4"]
    return root / "template", want


def _copy(template, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(template[0], out)
    return out


def _biggest(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate_half(step_dir):
    f = _biggest(step_dir)
    os.truncate(f, f.stat().st_size // 2)


def _empty(step_dir):
    for p in list(step_dir.iterdir()):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _garbage(name):
    def damage(step_dir):  # same length: only the checksum can tell
        f = step_dir / name
        f.write_bytes(np.random.default_rng(0).integers(0, 256, f.stat().st_size, np.uint8).tobytes())
    return damage


def _flip_64_bytes(step_dir):
    f = _biggest(step_dir)
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 64] = bytes(x ^ 0xFF for x in b[mid:mid + 64])
    f.write_bytes(bytes(b))


def _steps_logged(run_dir: Path) -> list[int]:
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [l["step"] for l in lines if "loss" in l]


def _short_one_line(msg: str) -> None:
    assert "\n" not in msg and "Traceback" not in msg and len(msg) < 700, msg


DAMAGE = {
    "half_truncated": (_truncate_half, "bytes, expected"),
    "emptied": (_empty, "no checksum manifest"),
    "garbage_item_metadata": (_garbage("state/_METADATA"), "state/_METADATA fails its sha256 check"),
    "garbage_orbax_step_metadata": (_garbage("_CHECKPOINT_METADATA"), "_CHECKPOINT_METADATA is not readable"),
    "garbage_manifest": (_garbage(MANIFEST_FILE), f"{MANIFEST_FILE} is not a readable manifest"),
    "flipped_64_bytes": (_flip_64_bytes, "fails its sha256 check"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_newest_step_falls_back_to_intact_one(corpus, template, tmp_path, case):
    damage, phrase = DAMAGE[case]
    run_dir = _copy(template, tmp_path)
    damage(run_dir / "checkpoints/4")
    logs = []
    tr = Trainer(_cfg(corpus, run_dir), log=logs.append)
    warnings = [l for l in logs if "warning" in l]
    assert tr.step == 2 and len(warnings) == 1, logs
    _short_one_line(warnings[0])
    assert "step 4" in warnings[0] and phrase in warnings[0] and "resuming from step 2" in warnings[0]
    assert (run_dir / "checkpoints_damaged/4").is_dir()  # kept for a post-mortem, out of Orbax's way
    got = [r["loss"] for r in tr.fit()]
    tr.close()
    np.testing.assert_allclose(got, template[1][2:], rtol=1e-6)  # = resuming from step 2
    assert _steps_logged(run_dir) == [1, 2, 3, 4, 5, 6]  # steps 3-4 of the lost run are not repeated
    ck = TrainCheckpointer(run_dir / "checkpoints")
    assert ck.steps() == [2, 4, 6] and all(ck.verify(s) is None for s in ck.steps())


def test_no_intact_step_is_one_clear_error(corpus, template, tmp_path):
    run_dir = _copy(template, tmp_path)
    _flip_64_bytes(run_dir / "checkpoints/4")
    _truncate_half(run_dir / "checkpoints/2")
    with pytest.raises(CheckpointError) as e:
        Trainer(_cfg(corpus, run_dir))
    msg = str(e.value)
    _short_one_line(msg)
    assert "no intact checkpoint" in msg and "step 4: " in msg and "step 2: " in msg and "new train.out_dir" in msg
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]  # nothing moved on a refusal


@pytest.mark.parametrize("overrides, keys", [
    (["model.num_layers=2", "model.intermediate_size=96"],
     ["model.intermediate_size (checkpoint 128, config 96)", "model.num_layers (checkpoint 1, config 2)"]),
    (["optim.name=adamw8bit"], ["optim.name (checkpoint 'adamw', config 'adamw8bit')"]),
    (["data.seed=1"], ["data.seed (checkpoint 0, config 1)"]),
])
def test_changed_settings_are_refused_naming_the_keys(corpus, template, tmp_path, overrides, keys):
    run_dir = _copy(template, tmp_path)
    with pytest.raises(CheckpointError) as e:
        Trainer(_cfg(corpus, run_dir, *overrides))
    msg = str(e.value)
    _short_one_line(msg)
    assert ", ".join(keys) in msg and "other settings" in msg


def test_knobs_that_keep_shapes_and_trajectory_still_resume(corpus, template, tmp_path):
    run_dir = _copy(template, tmp_path)
    tr = Trainer(_cfg(corpus, run_dir, "optim.grad_accum_steps=2", "train.gradient_checkpointing=true",
                      "data.dev_batches=1"))
    assert tr.step == 4
    tr.close()


def test_cli_prints_one_line_and_exits_2(corpus, template, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "train"))
    import train_drafter

    run_dir = _copy(template, tmp_path)
    from d3d_jax.cli import run_cli

    assert run_cli(train_drafter.main, _args(corpus, run_dir, *RUN, "model.num_layers=2")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "model.num_layers (checkpoint 1, config 2)" in err
    _short_one_line(err)


def test_resume_false_over_existing_steps_is_refused(corpus, template, tmp_path):
    run_dir = _copy(template, tmp_path)
    with pytest.raises(CheckpointError, match=r"train.resume=false but .* already holds checkpoint steps \[2, 4\]"):
        Trainer(_cfg(corpus, run_dir, "train.resume=false"))


def test_killed_save_and_torn_metrics_line_resume_without_repeats(corpus, template, tmp_path):
    run_dir = _copy(template, tmp_path)
    # killed while step 4 was being written (Orbax's temp dir) and while logging step 5
    (run_dir / "checkpoints/4").rename(run_dir / "checkpoints/4.orbax-checkpoint-tmp")
    assert _steps_logged(run_dir) == [1, 2, 3, 4]
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.2')
    logs = []
    tr = Trainer(_cfg(corpus, run_dir), log=logs.append)
    assert tr.step == 2 and not [l for l in logs if "warning" in l]  # an unfinished save is no damage
    got = [r["loss"] for r in tr.fit()]
    tr.close()
    np.testing.assert_allclose(got, template[1][2:], rtol=1e-6)
    assert _steps_logged(run_dir) == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4", "6"]


def test_steps_logged_less_often_than_saved_survive_a_kill(corpus, template, tmp_path):
    """log_every 5, checkpoint_every 2, killed during step 5: the resume from step 4 must still
    find steps 1-4 logged (they were in memory only, waiting for step 5's log)."""
    run_dir = tmp_path / "run"
    tr = Trainer(_cfg(corpus, run_dir, "train.log_every=5"))
    real = tr.train_step

    def killed_at_step_5(batch):
        if tr.step == 4:
            raise KeyboardInterrupt("killed")  # nothing more is written, as with SIGKILL
        return real(batch)

    tr.train_step = killed_at_step_5
    with pytest.raises(KeyboardInterrupt):
        tr.fit()
    tr.close()
    resumed = Trainer(_cfg(corpus, run_dir, "train.log_every=5"))
    assert resumed.step == 4
    resumed.fit()
    resumed.close()
    assert _steps_logged(run_dir) == [1, 2, 3, 4, 5, 6]  # was [5, 6]
    losses = [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(l)]
    np.testing.assert_allclose(losses, template[1], rtol=1e-6)  # the uninterrupted run's


def test_trim_metrics_keeps_records_through_the_restored_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"step": 0, "data_stats": {}}, {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0},
            {"step": 2, "eval/loss": 2.5}, {"step": 3, "loss": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "lo')
    assert trim_metrics(path, 2) == 2
    assert [json.loads(l) for l in path.read_text().splitlines()] == recs[:4]
    assert trim_metrics(path, 0) == 4 and path.read_text() == ""  # no checkpoint: the run starts over


def _reference_losses(corpus, out, n, *extra):
    tr = Trainer(_cfg(corpus, out, *extra))
    losses = [r["loss"] for r in tr.fit(until=n)]
    tr.close()
    return losses


def test_sigint_saves_the_current_step_and_resumes_to_the_same_result(corpus, tmp_path):
    long_run = ["train.steps=1000", "train.checkpoint_every=0"]
    handler = signal.getsignal(signal.SIGINT)  # SIG_IGN in a process started in the background
    tr = Trainer(_cfg(corpus, tmp_path / "run", *long_run))

    def interrupt():
        while tr.step < 2:
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    before = [r["loss"] for r in tr.fit()]
    tr.close()
    n = tr.step
    assert tr.stop_signal == signal.SIGINT and 2 <= n < 1000 and len(before) == n
    assert signal.getsignal(signal.SIGINT) is handler  # the run's handler removed again
    resumed = Trainer(_cfg(corpus, tmp_path / "run", *long_run))
    assert resumed.step == n
    after = [r["loss"] for r in resumed.fit(until=n + 2)]
    resumed.close()
    want = _reference_losses(corpus, tmp_path / "ref", n + 2, *long_run)
    np.testing.assert_allclose(before + after, want, rtol=1e-6)


@pytest.mark.slow
def test_sigterm_to_the_cli_saves_exits_143_and_resumes_to_the_same_result(corpus, tmp_path):
    long_run = ["train.steps=1000", "train.checkpoint_every=0"]
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest")
    proc = subprocess.Popen([sys.executable, str(REPO / "train/train_drafter.py"),
                             *_args(corpus, run_dir, *RUN, *long_run)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not ((run_dir / "metrics.jsonl").exists() and max(_steps_logged(run_dir), default=0) >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    n = json.loads(out.strip().splitlines()[-1])["step"]
    assert f"SIGTERM: saved a checkpoint at step {n} and stopped" in out and "Traceback" not in err
    ck = TrainCheckpointer(run_dir / "checkpoints")
    assert ck.steps() == [n] and ck.verify(n) is None  # the in-flight async save finished with its manifest
    before = [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(l)]
    resumed = Trainer(_cfg(corpus, run_dir, *long_run))
    assert resumed.step == n
    after = [r["loss"] for r in resumed.fit(until=n + 2)]
    resumed.close()
    want = _reference_losses(corpus, tmp_path / "ref", n + 2, *long_run)
    np.testing.assert_allclose(before + after, want, rtol=1e-6)


def test_manifest_covers_every_file_of_a_committed_step(template):
    from d3d_jax.io.manifest import read_manifest

    step_dir = template[0] / "checkpoints/4"
    manifest, problem = read_manifest(step_dir)
    assert problem is None and manifest["step"] == 4
    on_disk = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()}
    # written in Orbax's save thread after the last data byte; only Orbax's commit files come later
    assert set(manifest["files"]) == on_disk - {MANIFEST_FILE, "_CHECKPOINT_METADATA", "commit_success.txt"}
    assert any(f.startswith("state/ocdbt.process_0/d/") for f in manifest["files"])
    assert manifest["settings"]["model"]["num_layers"] == 1 and manifest["settings"]["optim"]["name"] == "adamw"


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpointer_round_trip_sync_and_async(tmp_path, async_save):
    import jax
    import jax.numpy as jnp

    state = {"params": {"w": jnp.arange(12.0).reshape(3, 4)}, "step": jnp.int32(7)}
    ck = TrainCheckpointer(tmp_path / "ck", keep=2, async_save=async_save)
    for step in (1, 2, 3):
        ck.save(step, jax.tree.map(lambda x: x * step, state), {"next_index": step}, settings={"model": {"a": 1}})
    ck.close()  # waits for the save in flight: its manifest is written before close returns
    ck = TrainCheckpointer(tmp_path / "ck")
    assert ck.steps() == [2, 3] and ck.verify(2) is None and ck.verify(3) is None
    step, got, data = ck.restore_intact(state, {"model": {"a": 1}})
    ck.close()
    assert step == 3 and data == {"next_index": 3}
    np.testing.assert_array_equal(got["params"]["w"], 3 * np.arange(12.0).reshape(3, 4))


def test_settings_diff_compares_only_keys_both_sides_know():
    saved = {"model": {"num_layers": 1, "removed_field": 0}, "optim": {"name": "adamw"}}
    current = {"model": {"num_layers": 2, "new_field": 5}, "optim": {"name": "adamw"}, "data": {"seed": 0}}
    assert settings_diff(saved, current) == ["model.num_layers (checkpoint 1, config 2)"]
    assert settings_diff(current, current) == []


# ---- identity ------------------------------------------------------------------------------
def test_a_step_copied_over_the_newest_one_is_damage_not_that_step(corpus, template, tmp_path):
    run_dir = _copy(template, tmp_path)
    shutil.rmtree(run_dir / "checkpoints/4")
    shutil.copytree(run_dir / "checkpoints/2", run_dir / "checkpoints/4")  # rm -rf ck/4; cp -a ck/2 ck/4
    logs = []
    tr = Trainer(_cfg(corpus, run_dir), log=logs.append)
    warnings = [l for l in logs if "warning" in l]
    assert tr.step == 2 and len(warnings) == 1, logs  # not "resumed from step 4"
    assert "step 4: its manifest names step 2" in warnings[0] and "resuming from step 2" in warnings[0]
    assert (run_dir / "checkpoints_damaged/4").is_dir()
    got = [r["loss"] for r in tr.fit()]
    tr.close()
    np.testing.assert_allclose(got, template[1][2:], rtol=1e-6)  # steps 3-6 are steps 3-6, not 1-4 again


def test_manifest_names_step_settings_hash_and_data_position(template):
    from d3d_jax.io.manifest import read_manifest
    from d3d_jax.training.checkpoints import identity_problem, settings_sha256

    manifest, _ = read_manifest(template[0] / "checkpoints/4")
    assert manifest["step"] == 4 and manifest["data_state"] == {"next_index": 4}
    assert manifest["settings_sha256"] == settings_sha256(manifest["settings"])
    assert identity_problem(4, manifest) is None
    assert "data iterator stands at batch 3" in identity_problem(4, {**manifest, "data_state": {"next_index": 3}})
    assert "do not match their hash" in identity_problem(4, {**manifest, "settings_sha256": "0" * 64})
    legacy = {k: v for k, v in manifest.items() if k not in ("settings_sha256", "data_state")}
    assert identity_problem(4, legacy) is None  # a manifest from before these fields still resumes


def test_a_failed_async_save_stops_the_run_at_the_next_step_in_one_line(corpus, tmp_path, monkeypatch, capfd):
    import errno

    from d3d_jax.errors import ResourceError

    real_manifest, real_step = TrainCheckpointer._write_step_manifest, Trainer.train_step

    def full_disk_at_step_3(self, step_dir):
        if self._pending[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_manifest(self, step_dir)

    def step_4_takes_a_second(self, batch):  # long enough for the save thread to have failed
        out = real_step(self, batch)
        if self.step == 4:
            time.sleep(1.0)
        return out

    monkeypatch.setattr(TrainCheckpointer, "_write_step_manifest", full_disk_at_step_3)
    monkeypatch.setattr(Trainer, "train_step", step_4_takes_a_second)
    tr = Trainer(_cfg(corpus, tmp_path / "run", "train.checkpoint_every=3"))
    with pytest.raises(ResourceError) as e:
        tr.fit()
    tr.close()
    msg = str(e.value)
    _short_one_line(msg)
    assert tr.step == 4, tr.step  # the step after the save, not at the next save (step 6)
    assert msg.startswith(f"{tmp_path / 'run' / 'checkpoints'}/3: saving the checkpoint failed") and "Errno 28" in msg
    assert "Traceback" not in capfd.readouterr().err  # Orbax's own tracebacks of it are not printed
