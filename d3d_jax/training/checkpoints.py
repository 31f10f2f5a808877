"""Train-state checkpoints that survive damage: Orbax steps with checksum manifests,
fallback to the newest intact step, settings checks, save-and-stop on SIGTERM/SIGINT.

Layout: ``out_dir/checkpoints/<step>/`` is an Orbax ``CheckpointManager`` step holding the train
state (``state``), the grain iterator state (``data``) and the run config
(``config``), plus ``d3d_manifest.json``: size and sha256 of every file, the Orbax item handlers
and the run's *settings* (model shape, optimiser, data order; see :func:`run_settings`).

* Saving is asynchronous.  The manifest is hashed in Orbax's save thread after the last byte is
  written and before Orbax's commit rename, so a committed step always carries its manifest and
  a step without one never finished.  Only the two files Orbax rewrites at commit are not hashed:
  ``commit_success.txt`` and ``_CHECKPOINT_METADATA`` (parsed and checked against the manifest).
* Every manifest names its identity: the step, the hash of the run's settings and the data
  iterator's position.  A step whose manifest names another step (``cp -a ck/20 ck/30``) or whose
  iterator stands elsewhere than the step says is damaged like a truncated one.
* A resume verifies the newest step, skips damaged ones with one warning line (moving them to
  ``checkpoints_damaged/``), and raises one :class:`CheckpointError` sentence when no step is
  intact or the saved settings differ from this run's (naming every differing key: a changed
  setting is the user's intent, not damage, so nothing is moved for it).
* A failed asynchronous save surfaces at the next :meth:`TrainCheckpointer.raise_if_failed`
  (the loop calls it after every step) as one :class:`~d3d_jax.errors.ResourceError` line; Orbax's own
  tracebacks of that failure are kept out of the log.
* :class:`StopSignals` turns SIGTERM/SIGINT into a flag the loop reads between steps; with
  several processes it uses JAX's preemption sync point instead, so all hosts stop at one step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from d3d_jax.errors import ResourceError
from d3d_jax.io.manifest import CheckpointError, read_manifest, verify_manifest, write_manifest

STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax rewrites it at commit: parsed, not hashed
_UNHASHED = (STEP_METADATA, "commit_success.txt")
# The settings a resume must match: what fixes the state's shapes, the optimiser's trajectory
# and the data order.  Left free on purpose: compute dtype, remat, grad_accum_steps (memory
# knobs), file paths (data moves between machines), train.steps (extending a run).  A new config
# field that changes shapes or the data belongs here.
RESUME_KEYS = {
    "model": ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "param_dtype", "mask_token_id",
              "block_size"),
    "optim": ("name", "learning_rate", "final_learning_rate", "warmup_steps", "b1", "b2", "eps", "weight_decay",
              "clip_norm", "quant_block_size"),
    "data": ("mode", "packed_length", "num_anchors", "block_size", "batch_size", "seed", "shuffle",
             "mask_token_id", "pad_token_id"),
}


# --------------------------------------------------------------------------------------
# Settings a resume must match
# --------------------------------------------------------------------------------------
def run_settings(cfg: Any, model_config: Any) -> dict:
    """``{model, optim, data}`` of a run (the :data:`RESUME_KEYS`) as plain JSON values."""
    sections = {"model": dataclasses.asdict(model_config), "optim": dataclasses.asdict(cfg.optim),
                "data": dataclasses.asdict(cfg.data)}
    out = {name: {k: sec[k] for k in RESUME_KEYS[name] if k in sec} for name, sec in sections.items()}
    return json.loads(json.dumps(out))


def settings_sha256(settings: dict | None) -> str | None:
    """The config hash a manifest carries: sha256 of the settings' canonical JSON."""
    if settings is None:
        return None
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def identity_problem(step: int, manifest: dict) -> str | None:
    """What makes ``manifest`` not step ``step``'s (``None`` if nothing).  Manifests written before
    the identity fields existed lack the hash and the data position; those checks are skipped."""
    named = manifest.get("step")
    if named != step:
        return f"its manifest names step {named} (a step directory copied or renamed)"
    digest = manifest.get("settings_sha256")
    if digest is not None and digest != settings_sha256(manifest.get("settings")):
        return "its manifest's settings do not match their hash"
    position = (manifest.get("data_state") or {}).get("next_index") if isinstance(
        manifest.get("data_state"), dict) else None
    if position is not None and position != step:  # one global batch per step
        return f"its data iterator stands at batch {position}, not {step}"
    return None


def settings_diff(saved: dict, current: dict) -> list[str]:
    """``["model.num_layers (checkpoint 1, config 2)", ...]`` for every key that differs (keys
    only one side knows, from another code version, cannot be compared)."""
    out = []
    for section in sorted(set(saved) & set(current)):
        a, b = saved[section], current[section]
        out += [f"{section}.{k} (checkpoint {a[k]!r}, config {b[k]!r})"
                for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    return out


# --------------------------------------------------------------------------------------
# Flat state: Orbax stores a dict of dotted paths, whatever the tree's node types
# --------------------------------------------------------------------------------------
def _flat_key(path: Any) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def flatten_state(state: Any) -> dict[str, Any]:
    """``{dotted path: array}`` of a pytree (model + optimiser state, custom nodes included)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    out = {_flat_key(p): x for p, x in flat}
    if len(out) != len(flat):
        raise ValueError("flatten_state: two leaves share a path name")
    return out


def unflatten_state(flat: dict[str, Any], like: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[_flat_key(p)] for p, _ in leaves])


# --------------------------------------------------------------------------------------
# The checkpointer
# --------------------------------------------------------------------------------------
class TrainCheckpointer:
    """``save(step, state, data_state, config, settings)`` / ``restore_intact(abstract, settings)``.

    ``data_state`` is the grain iterator's ``get_state()`` taken *before* the async save starts
    (a prefetching iterator cannot move under it).  Orbax writes JSON items on the primary host
    only; that is enough, since every process's iterator stands at the same *global* batch
    (:func:`d3d_jax.training.data.batch_shard`), so a run on any number of processes resumes it.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).resolve()
        self._ocp = ocp
        self._async = async_save
        self._pending: tuple[int, dict | None, Any] | None = None  # step, settings, data state
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=True,  # a save killed mid-write leaves <step>.orbax-checkpoint-tmp
            async_options=ocp.AsyncOptions(post_finalization_callback=self._manifest_in_save_thread)
            if async_save else None)
        self._manager = None
        self._quiet = _SaveFailureFilter()

    @property
    def manager(self):
        # Created on first use, after restore_intact has moved damaged steps away: Orbax reads
        # every step's metadata when it starts and logs errors for the damaged ones.
        if self._manager is None:
            self._manager = self._ocp.CheckpointManager(self.directory, options=self._options)
            self._quiet.attach()
        return self._manager

    # ---- listing ----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Step directories present (committed or not), oldest first: damage hides nothing here."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.is_dir() and p.name.isdigit())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def require_no_steps(self) -> None:
        """``train.resume=false`` would collide with the steps already there; say so up front."""
        if self.steps():
            raise CheckpointError(f"train.resume=false but {self.directory} already holds checkpoint steps "
                                  f"{self.steps()}; use a new train.out_dir or delete that directory")

    # ---- saving -----------------------------------------------------------------------------
    def save(self, step: int, state: Any, data_state: Any, config: dict | None = None,
             settings: dict | None = None) -> None:
        ocp = self._ocp
        items = {"state": ocp.args.StandardSave(flatten_state(state)),
                 "data": ocp.args.JsonSave(data_state)}
        if config is not None:
            items["config"] = ocp.args.JsonSave(config)
        # The save thread reads _pending: the previous save must be done before it changes.
        self.wait()
        self._pending = (step, settings, data_state)
        with _naming_failure(self.directory, step):
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        if not self._async and jax.process_index() == 0:
            with _naming_failure(self.directory, step):
                self._write_step_manifest(self.directory / str(step))
        if not self._async:
            _barrier("d3d_manifest_sync_save")

    def _manifest_in_save_thread(self) -> None:
        # Orbax calls this on the primary host once every process's bytes are written and
        # finalised, before renaming <step>.orbax-checkpoint-tmp to <step>.
        final = self.directory / str(self._pending[0])
        tmp = final.with_name(final.name + self._ocp.path.atomicity_types.TMP_DIR_SUFFIX)
        self._write_step_manifest(tmp if tmp.is_dir() else final)

    def _write_step_manifest(self, step_dir: Path) -> None:
        step, settings, data_state = self._pending
        try:
            handlers = json.loads((step_dir / STEP_METADATA).read_text()).get("item_handlers")
        except (OSError, ValueError):
            handlers = None
        write_manifest(step_dir, {"step": step, "settings": settings, "settings_sha256": settings_sha256(settings),
                                  "data_state": _json_or_none(data_state), "orbax_item_handlers": handlers},
                       skip=_UNHASHED)

    # ---- verifying and restoring ----------------------------------------------------------------
    def verify(self, step: int) -> str | None:
        """``None`` when step ``step`` is intact, else a short phrase naming what is wrong."""
        step_dir = self.directory / str(step)
        manifest, problem = verify_manifest(step_dir)
        if problem:
            return problem
        problem = identity_problem(step, manifest)
        if problem:
            return problem
        try:
            meta = json.loads((step_dir / STEP_METADATA).read_text())
            handlers = meta.get("item_handlers")
        except (OSError, ValueError, AttributeError):
            return f"{STEP_METADATA} is not readable JSON"
        want = manifest.get("orbax_item_handlers")
        if want is not None and handlers != want:
            return f"{STEP_METADATA} lists other items than the manifest"
        return None

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
        """``(state, data_state)`` of ``step``; ``abstract_state`` leaves carry shape, dtype, sharding."""
        ocp = self._ocp
        target = flatten_state(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            abstract_state))
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        return unflatten_state(out["state"], abstract_state), out["data"]

    def restore_intact(self, abstract_state: Any, settings: dict | None = None,
                       warn: Callable[[str], None] = print) -> tuple[int, Any, Any] | None:
        """``(step, state, data_state)`` of the newest intact step, or ``None`` when there is none
        at all.  Damaged newer steps are moved aside with one ``warn`` line; no intact step, or
        settings that differ from ``settings``, raise :class:`CheckpointError`."""
        steps = self.steps()
        if not steps:
            return None
        chosen, damaged = self._choose(steps)
        if chosen is None:
            detail = "; ".join(f"step {s}: {p}" for s, p in damaged)
            raise CheckpointError(f"{self.directory}: no intact checkpoint to resume from ({detail}); "
                                  f"use a new train.out_dir, or delete that directory to start over")
        saved = (read_manifest(self.directory / str(chosen))[0] or {}).get("settings")
        diff = settings_diff(saved, settings) if saved is not None and settings is not None else []
        if diff:
            raise CheckpointError(f"{self.directory}/{chosen} was saved with other settings than this run: "
                                  f"{', '.join(diff)}; resume with the saved values or use a new train.out_dir")
        if damaged:
            moved = self._quarantine([s for s, _ in damaged])
            detail = "; ".join(f"step {s}: {p}" for s, p in damaged)
            warn(f"warning: skipped damaged checkpoint(s) ({detail}); resuming from step {chosen} "
                 f"(damaged steps moved to {moved})")
        try:
            state, data_state = self.restore(chosen, abstract_state)
        except CheckpointError:
            raise
        except Exception as e:  # a boundary: Orbax's own errors are pages of trace
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(f"{self.directory}/{chosen}: restore failed although its checksums match "
                                  f"({type(e).__name__}: {first})") from None
        return chosen, state, data_state

    def _choose(self, steps: list[int]) -> tuple[int | None, list[tuple[int, str]]]:
        """Process 0 hashes (one reader, not one per host) and broadcasts the pick."""
        damaged: list[tuple[int, str]] = []
        chosen = None
        if jax.process_index() == 0:
            for step in reversed(steps):
                problem = self.verify(step)
                if problem is None:
                    chosen = step
                    break
                damaged.append((step, problem))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            pick = int(multihost_utils.broadcast_one_to_all(np.int64(-1 if chosen is None else chosen)))
            if jax.process_index() != 0:
                chosen = None if pick < 0 else pick
                damaged = [(s, "damaged (process 0 logs why)") for s in steps if chosen is None or s > chosen]
        return chosen, damaged

    def _quarantine(self, steps: list[int]) -> Path:
        """Move damaged steps out of Orbax's directory (their step numbers will be saved again)."""
        dest = self.directory.parent / (self.directory.name + "_damaged")
        if jax.process_index() == 0:
            dest.mkdir(parents=True, exist_ok=True)
            for step in steps:
                target, n = dest / str(step), 1
                while target.exists():
                    target, n = dest / f"{step}.{n}", n + 1
                shutil.move(str(self.directory / str(step)), str(target))
        _barrier("d3d_checkpoint_quarantine")
        if self._manager is not None:
            self._manager.reload()
        return dest

    def raise_if_failed(self) -> None:
        """Without blocking: one :class:`ResourceError` line if the last asynchronous save failed
        (the loop calls this after every step, so a full disk stops the run at the next step)."""
        if self._manager is not None and self._pending is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is written; its failure is one ResourceError line."""
        if self._manager is not None:
            with _naming_failure(self.directory, self._pending[0] if self._pending else None):
                self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            try:
                self.wait()
            finally:
                self._quiet.detach()
                self._manager.close()
                self._manager = None




def _json_or_none(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


class _SaveFailureFilter(logging.Filter):
    """Drops Orbax's ERROR records (with their tracebacks) of a failed save: the checkpointer
    reports that failure itself, in one line.  Attached to the ``absl`` logger while a
    checkpointer is open; every other record passes."""

    PHRASES = ("background save thread", "Save Finalize thread", "wait_until_finished")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and any(p in str(record.msg) for p in self.PHRASES))

    def attach(self) -> None:
        logging.getLogger("absl").addFilter(self)  # adding twice is a no-op

    def detach(self) -> None:
        logging.getLogger("absl").removeFilter(self)


class _naming_failure:
    """Turns any exception of a save into one :class:`ResourceError` line naming the step and
    the cause (``OSError: [Errno 28] No space left on device``)."""

    def __init__(self, directory: Path, step: int | None):
        self.directory, self.step = directory, step

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or isinstance(error, (CheckpointError, ResourceError, KeyboardInterrupt)):
            return False
        from d3d_jax.cli import one_line

        where = f"{self.directory}/{self.step}" if self.step is not None else str(self.directory)
        raise ResourceError(f"{where}: saving the checkpoint failed ({type(error).__name__}: "
                              f"{one_line(error)[:300]}); the newest intact step is still there, "
                              f"free space or fix the directory and rerun to resume") from None


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# --------------------------------------------------------------------------------------
# metrics.jsonl after a resume
# --------------------------------------------------------------------------------------
def trim_metrics(path: str | os.PathLike, step: int) -> int:
    """Cut ``metrics.jsonl`` back to records of steps ``<= step`` (none when ``step`` is 0: the run
    starts over) and drop a torn last line, so no step appears twice; returns lines dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            rec_step = None
        if step > 0 and rec_step is not None and rec_step <= step:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        from d3d_jax.io.atomic import writing

        tmp = path.with_name(path.name + ".tmp")
        with writing(path):
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, path)
    return dropped


# --------------------------------------------------------------------------------------
# Save and stop on SIGTERM / SIGINT
# --------------------------------------------------------------------------------------
class StopSignals:
    """``with StopSignals() as stop: ... if stop.should_stop(step): save; break`` (or
    ``install()`` / ``uninstall()``).

    One process: SIGTERM and SIGINT set a flag (a second one acts as it would without us: SIGINT
    raises KeyboardInterrupt, SIGTERM kills).  Several processes: a signal reaches hosts at
    different steps, so JAX's preemption service (SIGTERM, started by
    ``jax.distributed.initialize``) agrees on one step where every host stops.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignals":
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self.uninstall()

    def __enter__(self) -> "StopSignals":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            try:
                if multihost_utils.reached_preemption_sync_point(step):
                    self.signum = signal.SIGTERM
            except RuntimeError:  # preemption service disabled (jax_enable_preemption_service)
                pass
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""
