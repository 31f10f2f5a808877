"""The training loop: one jitted, sharded train step over the mesh, with a thin Python shell.

``Trainer(cfg)`` builds (or receives) the model, the optimiser and the data, places the train
state on the ``data × fsdp × tensor`` mesh, compiles the step ahead of time (printing XLA's
memory analysis), resumes from the latest checkpoint, and ``fit()`` runs to ``train.steps`` with
periodic dev evaluation (loss, per-slot accuracy, offline τ), checkpoints, metrics JSONL and a
progress bar.  The train state is a pytree ``{params, rest, opt_state, step}``; the step is
the pure function ``(state, batch[, extra]) -> (state, metrics)`` with the state donated.

Reuse with another objective: pass ``loss_fn(model, batch) -> (loss, metrics)`` (or
``loss_fn(model, batch, extra)`` together with ``loss_extra=``, a pytree such as a frozen
teacher's state that travels as a jit argument instead of being baked in as constants).
Gradient accumulation is exact: each micro-batch's loss divides by the whole batch's token
weights (``batch[objectives.LOSS_TOTALS]``, which a custom loss must honour, as the objectives'
helpers do) and the micro-batches' gradients and metrics are summed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from d3d_jax.config import TrainRunConfig, to_dict
from d3d_jax.errors import NonFiniteError
from d3d_jax.io.checkpoint import stored_model_config
from d3d_jax.model.qwen3 import Qwen3, abstract_model, set_config
from d3d_jax.parallel import sharding as shd
from d3d_jax.parallel.distributed import maybe_initialize_distributed
from d3d_jax.training import data as data_lib
from d3d_jax.training import objectives as obj
from d3d_jax.training import schedule
from d3d_jax.io import records
from d3d_jax.training import step as step_lib
from d3d_jax.training.checkpoints import StopSignals, TrainCheckpointer, run_settings, trim_metrics
from d3d_jax.training.optim import make_optimizer, lr_schedule, tree_nbytes
from d3d_jax.training.step import LossFn


# --------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: TrainRunConfig, *, model: Qwen3 | None = None, loss_fn: LossFn | None = None,
                 loss_extra: Any = None, train_data: grain.MapDataset | None = None,
                 dev_batches: list[dict] | None = None, devices=None, tokenizer: Any = None,
                 log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.log = log or (lambda s: print(s, flush=True))
        self.out_dir = Path(cfg.train.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        devices = list(jax.devices() if devices is None else devices)[:cfg.resolved_num_devices()]
        self.mesh = shd.make_mesh(cfg.mesh, devices)
        self.rules = cfg.mesh.rules
        self.accum = cfg.optim.grad_accum_steps
        self._unchecked: list[tuple[int, Any, Any]] = []  # (step, finite flag, record lines) not yet read
        self._build_data(model, train_data, dev_batches, tokenizer)

        # ---- model + optimiser, created directly in their shardings --------------------------
        with shd.use_mesh(self.mesh, self.rules):
            model = model if model is not None else self._init_model()
        self.model_config = model.config
        self.schedule = lr_schedule(cfg.optim, cfg.train.steps)
        self.tx = make_optimizer(cfg.optim, cfg.train.steps)
        self.graphdef, self.state, self.state_sharding = self._create_state(model)
        self.loss_fn = loss_fn or obj.make_loss_fn(cfg.objective)
        self.totals_fn = partial(obj.loss_totals, gamma=cfg.objective.gamma)
        self.loss_extra = loss_extra
        self.step = 0
        self.stop_signal: int | None = None  # set when SIGTERM/SIGINT stopped fit() early
        self.history: list[dict] = []
        self._compiled = None  # this trainer's train step and evaluation, compiled on first use
        self._eval_fn = None
        self.checkpointer = None
        self._metrics_file = None
        self.settings = run_settings(cfg, self.model_config)  # what a resume must match

        self.checkpointer = TrainCheckpointer(self.out_dir / "checkpoints", keep=cfg.train.keep_checkpoints,
                                              async_save=cfg.train.async_checkpointing)
        if cfg.train.resume:
            self._resume()
        else:
            self.checkpointer.require_no_steps()

    def _build_data(self, model: Qwen3 | None, train_data: grain.MapDataset | None,
                    dev_batches: list[dict] | None, tokenizer: Any) -> None:
        """The tokenizer, MASK id, training iterator and dev batches (built unless given)."""
        cfg, dc = self.cfg, self.cfg.data
        # records with ids outside the vocabulary the trained model will have are skipped
        vocab = (model.config.vocab_size if model is not None else cfg.model.vocab_size if not cfg.train.init_from
                 else stored_model_config(cfg.train.init_from).vocab_size)
        self.tokenizer = tokenizer
        if (train_data is None or (dev_batches is None and dc.dev_path)) and tokenizer is None:
            self.tokenizer = data_lib.load_tokenizer_for(dc, vocab)
        self.mask_token_id = None
        if dc.mode == "d3d":
            self.mask_token_id = data_lib.resolve_mask_token_id(dc, cfg.model.mask_token_id, self.tokenizer)
        self.data_stats: dict = {}
        if train_data is None:
            # Multi-host: each process builds only its rows of every global batch, and the global
            # batches are the same whatever the process count (so are losses and the data state).
            pc = jax.process_count()
            train_data, stats = data_lib.build_dataset(dc, dc.train_path, tokenizer=self.tokenizer,
                                                       mask_token_id=self.mask_token_id,
                                                       eos_token_id=_first(cfg.model.eos_token_id),
                                                       shard=(jax.process_index(), pc), vocab_size=vocab)
            self.data_stats["train"] = stats.as_dict()
        if dev_batches is None and dc.dev_path and dc.dev_batches:
            dev_ds, stats = data_lib.build_dataset(dc, dc.dev_path, tokenizer=self.tokenizer,
                                                   mask_token_id=self.mask_token_id,
                                                   eos_token_id=_first(cfg.model.eos_token_id),
                                                   seed=dc.seed + 12345, shuffle=False, vocab_size=vocab)
            self.data_stats["dev"] = stats.as_dict()
            dev_batches = data_lib.take_batches(dev_ds, dc.dev_batches)
        self.dev_batches = dev_batches or []
        for name, st in self.data_stats.items():
            self.log(f"data {name}: {st}")
        self.train_iter = data_lib.iterate(train_data, dc.worker_count)

    # ---- construction ---------------------------------------------------------------------
    def _model_overrides(self) -> dict:
        mc, dc = self.cfg.effective_model(), self.cfg.data
        out = dict(gradient_checkpointing=mc.gradient_checkpointing, remat_policy=mc.remat_policy,
                   attention_backend=mc.attention_backend, dtype=mc.dtype)
        if dc.mode == "d3d":
            out.update(mask_token_id=self.mask_token_id, block_size=dc.block_size)
        return out

    def _init_model(self) -> Qwen3:
        tc = self.cfg.train
        if tc.init_from:
            from d3d_jax.io.checkpoint import load_model

            model = load_model(tc.init_from, mesh=self.mesh, dtype=self.cfg.effective_model().param_dtype,
                               rules=self.rules)
            cfg = dataclasses.replace(model.config, **self._model_overrides())
            cfg.validate()
            return set_config(model, cfg)  # the layers too: they hold the attention backend
        mcfg = dataclasses.replace(self.cfg.effective_model(), **self._model_overrides())
        gdef, abstract = nnx.split(abstract_model(mcfg))
        sh = shd.state_shardings(abstract, self.mesh, self.rules)
        seed = tc.seed
        state = jax.jit(lambda: nnx.state(Qwen3(mcfg, rngs=nnx.Rngs(params=seed))), out_shardings=sh)()
        return nnx.merge(gdef, state)

    def _create_state(self, model: Qwen3):
        """Train state ``{params, rest, opt_state, step}`` (pure arrays), created in its shardings.

        The optimiser state is a plain optax pytree rather than an ``nnx.Optimizer``: NNX would
        rewrite the 8-bit moments' custom nodes into ``State`` mappings on update, changing the
        state's tree structure between steps (and so its shardings and checkpoint layout).
        """
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params, rest = nnx.as_pure(params), nnx.as_pure(rest)
        tx = self.tx

        def make(p, r):
            return dict(params=p, rest=r, opt_state=tx.init(p), step=jnp.zeros([], jnp.int32))

        abstract = jax.eval_shape(make, params, rest)
        # params, gradients and moments by the model's annotations (params/opt_state paths end in
        # a parameter's); the step counters are scalars, replicated
        sh = shd.tree_shardings(abstract, shd.logical_axes(model), self.mesh, self.rules)
        state = jax.jit(make, out_shardings=sh)(params, rest)
        return graphdef, state, sh

    def _resume(self) -> None:
        restored = self.checkpointer.restore_intact(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state, self.state_sharding),
            self.settings, warn=self.log)
        if jax.process_index() == 0:  # steps after the restored one will be logged again
            trim_metrics(self.out_dir / "metrics.jsonl", restored[0] if restored else 0)
        if restored is None:
            return
        step, state, data_state = restored
        self.state, self.step = state, int(step)
        self.train_iter.set_state(data_state)
        self.log(f"resumed from step {self.step} ({self.checkpointer.directory})")

    # ---- batches ----------------------------------------------------------------------------
    def device_batch(self, host_batch: dict) -> dict:
        """``[global_b, ...]`` host arrays -> ``[accum, micro, ...]`` arrays on the mesh."""
        b = {k: np.asarray(v).reshape(self.accum, -1, *np.shape(v)[1:]) for k, v in host_batch.items()}
        pc = jax.process_count()
        if pc == 1:
            return jax.device_put(b, step_lib.batch_shardings(b, self.mesh, self.rules))
        # each process holds 1/pc of every micro-batch: shard by the *global* shape (the local one
        # may not divide over the mesh, which would silently make the batch replicated)
        glob = {k: jax.ShapeDtypeStruct((v.shape[0], v.shape[1] * pc, *v.shape[2:]), v.dtype) for k, v in b.items()}
        sh = step_lib.batch_shardings(glob, self.mesh, self.rules)
        return {k: jax.make_array_from_process_local_data(sh[k], v, glob[k].shape) for k, v in b.items()}

    def _eval_batch(self, host_batch: dict) -> dict:
        rd = shd.rules_dict(self.rules)
        return {k: jax.device_put(np.asarray(v), NamedSharding(self.mesh, shd.logical_to_spec(
            ("batch",) + (None,) * (np.ndim(v) - 1), np.shape(v), self.mesh, rd))) for k, v in host_batch.items()}

    # ---- compile ------------------------------------------------------------------------
    def compile(self, example_batch: dict):
        """AOT ``lower().compile()`` of the train step; prints XLA's memory analysis."""
        fn = partial(step_lib.train_step, self.graphdef, self.tx, self.loss_fn, self.schedule, self.totals_fn)
        b_sh = step_lib.batch_shardings(example_batch, self.mesh, self.rules)
        jitted = jax.jit(fn, in_shardings=(self.state_sharding, b_sh, None),
                         out_shardings=(self.state_sharding, None), donate_argnums=(0,))
        abstract = lambda tree, shs: jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shs)
        t0 = time.time()
        with shd.use_mesh(self.mesh, self.rules):
            lowered = jitted.lower(abstract(self.state, self.state_sharding), abstract(example_batch, b_sh),
                                   self.loss_extra)
            self._compiled = lowered.compile()
        self.log(f"compiled train step in {time.time() - t0:.1f}s; state {tree_nbytes(self.state) / 2**20:.1f} MiB "
                 f"over {self.mesh.devices.size} devices")
        mem = self._compiled.memory_analysis()
        if mem is not None:
            self.log("memory analysis (per device): " + ", ".join(
                f"{k}={getattr(mem, k) / 2**20:.1f}MiB" for k in (
                    "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                    "generated_code_size_in_bytes") if hasattr(mem, k)))
        return self._compiled

    # ---- one step / evaluation ----------------------------------------------------------------
    def train_step(self, host_batch: dict) -> dict:
        lines = host_batch.get(data_lib.RECORD_LINE), host_batch.get(data_lib.RECORD_FILE)
        batch = self.device_batch({k: v for k, v in host_batch.items() if k not in data_lib.RECORD_KEYS})
        if self._compiled is None:
            if self.cfg.train.aot_compile:
                self.compile(batch)
            else:
                fn = partial(step_lib.train_step, self.graphdef, self.tx, self.loss_fn, self.schedule, self.totals_fn)
                self._compiled = jax.jit(fn, out_shardings=(self.state_sharding, None), donate_argnums=(0,))
        with shd.use_mesh(self.mesh, self.rules):
            self.state, metrics = self._compiled(self.state, batch, self.loss_extra)
        self.step += 1
        metrics = dict(metrics)
        self._unchecked.append((self.step, metrics.pop("finite"), lines))
        return metrics

    def check_finite(self) -> None:
        """:class:`NonFiniteError` naming the step and its batch's records if a step since the last
        check had a non-finite loss or gradient norm.  Its update was not applied (nor any later
        one), so the state, and every checkpoint, is the last good step's."""
        pending, self._unchecked = self._unchecked, []
        for (step, _, lines), ok in zip(pending, jax.device_get([f for _, f, _ in pending])):
            if not ok:
                self.step = step - 1
                self.state = {**self.state,
                              "step": jax.device_put(np.int32(self.step), self.state_sharding["step"])}
                msg = nonfinite_message(step, lines, self.cfg.data.train_path, self.checkpointer)
                self.write_metrics({"step": step, "stopped": msg})
                raise NonFiniteError(msg)

    def evaluate(self, batches: Iterable[dict] | None = None) -> dict:
        """Dev loss, per-slot accuracy and offline τ (d3d) or loss (lm), pooled over batches."""
        batches = list(self.dev_batches if batches is None else batches)
        if not batches:
            return {}
        dc, oc = self.cfg.data, self.cfg.objective
        parts = []
        weights = {"params": self.state["params"], "rest": self.state["rest"]}
        with shd.use_mesh(self.mesh, self.rules):
            for hb in batches:
                batch = self._eval_batch(hb)
                if self._eval_fn is None:
                    fn = jax.jit(partial(step_lib.eval_step, self.graphdef, dc.mode, oc.gamma, oc.ar_weight,
                                         dc.block_size))
                    self._eval_fn = fn.lower(weights, batch).compile()
                parts.append(jax.device_get(self._eval_fn(weights, batch)))
        out = {f"eval/{k}": float(np.mean([p[k] for p in parts]))
               for k in ("loss", "loss_diff", "loss_ar") if k in parts[0]}
        if dc.mode == "d3d":
            s = obj.summarize_tau(obj.pool_tau_sums([{k: p[k] for k in ("tau_sum", "anchors", "slot_correct",
                                                                        "tau_hist")} for p in parts]))
            out.update({"eval/tau": s["tau"], "eval/slot_accuracy": s["slot_accuracy"],
                        "eval/tau_hist": s["tau_hist"], "eval/anchors": s["anchors"]})
        return out

    # ---- the loop ------------------------------------------------------------------------------
    def write_metrics(self, record: dict) -> None:
        if jax.process_index() != 0:
            return
        from d3d_jax.io.atomic import writing

        with writing(self.out_dir / "metrics.jsonl"):  # a full disk names the file
            if self._metrics_file is None:
                self._metrics_file = open(self.out_dir / "metrics.jsonl", "a")
            self._metrics_file.write(json.dumps(record) + "\n")
            self._metrics_file.flush()

    def last_logged(self) -> dict:
        """The newest step's metrics: this process's, else (nothing trained since the start: a
        finished run rerun) the newest training record of ``metrics.jsonl``."""
        if self.history:
            return self.history[-1]
        last: dict = {}
        try:
            lines = (self.out_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return last
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            last = rec if isinstance(rec, dict) and "loss" in rec else last
        return last

    def sync_metrics(self) -> None:
        """The metrics lines written so far, on the disk (not only in the OS's cache)."""
        if self._metrics_file is not None:
            from d3d_jax.io.atomic import writing

            with writing(self.out_dir / "metrics.jsonl"):
                os.fsync(self._metrics_file.fileno())

    def save_checkpoint(self) -> None:
        self.check_finite()  # never save a halted state
        self.checkpointer.save(self.step, self.state, self.train_iter.get_state(),
                               {"run": to_dict(self.cfg), "data_stats": self.data_stats}, settings=self.settings)

    def fit(self, until: int | None = None) -> list[dict]:
        """Train to step ``until`` (default ``train.steps``); returns this call's per-step metrics.
        After each step the events it triggers run (:mod:`~d3d_jax.training.schedule`).

        SIGTERM / SIGINT (a preempted VM, Ctrl-C) end the current step, save it and return early
        with ``self.stop_signal`` set."""
        tc = self.cfg.train
        until = tc.steps if until is None else min(until, tc.steps)
        if self.step >= tc.steps:  # a finished run rerun: its checkpoint is the last step
            last = self.last_logged().get("loss")
            self.log(f"the run is already complete: step {self.step} of train.steps={tc.steps}"
                     + (f", last loss {last:.4f}" if isinstance(last, float) else "")
                     + "; raise train.steps to train further")
            return []
        if self.step == 0 and self.data_stats:
            self.write_metrics({"step": 0, "data_stats": self.data_stats})
        bar = None
        if tc.progress_bar and jax.process_index() == 0:
            from tqdm import tqdm
            bar = tqdm(total=until, initial=self.step, desc="train", file=sys.stderr, dynamic_ncols=True)
        run = schedule.FitRun(until, self.cfg.data.batch_size * self.cfg.data.packed_length,
                              StopSignals().install(), bar)
        try:
            while self.step < until:
                metrics = self.train_step(next(self.train_iter))
                self.checkpointer.raise_if_failed()  # a failed async save stops the run here, in one line
                run.pending.append((self.step, metrics))
                run.steps_since += 1
                events = schedule.due(self, run)
                if events:
                    self.check_finite()  # before anything is logged, evaluated or saved
                if bar is not None:
                    bar.update(1)
                for name in events:
                    schedule.EVENTS[name](self, run)
                if "stop" in events:
                    break
        finally:
            run.stop.uninstall()
            if bar is not None:
                bar.close()
        self.history.extend(run.records)
        return run.records

    # ---- outputs -------------------------------------------------------------------------------
    def model(self) -> Qwen3:
        """The current model (shares the train state's arrays)."""
        return nnx.merge(self.graphdef, self.state["params"], self.state["rest"])

    def export(self, out_dir: str | os.PathLike | None = None) -> dict[str, str]:
        """Param-only checkpoint (``params/``) and an HF directory (``hf/``, with mask_token_id and
        block_size in config.json) of the current model."""
        from d3d_jax.io.checkpoint import save_params

        self.check_finite()
        out = Path(out_dir or self.out_dir / "export")
        model = self.model()
        paths = {}
        self.checkpointer.wait()
        if self.cfg.train.export_params:
            paths["params"] = str(save_params(model, out / "params"))
        if self.cfg.train.export_hf:
            from d3d_jax.io.hf import save_qwen3

            extra = {k: getattr(model.config, k) for k in ("mask_token_id", "block_size")
                     if getattr(model.config, k) is not None}
            if jax.process_count() > 1:
                # every process takes part in gathering the shards; one writes the files
                from jax.experimental import multihost_utils

                model = nnx.merge(self.graphdef, *(jax.tree.map(
                    lambda x: multihost_utils.process_allgather(x, tiled=True), self.state[k])
                    for k in ("params", "rest")))
            if jax.process_index() == 0:
                save_qwen3(model, out / "hf", extra_config=extra, tokenizer=self.tokenizer)
            paths["hf"] = str(out / "hf")
        return paths

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None


def nonfinite_message(step: int, lines: Any, data_path: str, checkpointer: Any) -> str:
    """One sentence: the step, what was kept, and the batch's records (``lines``: the batch's
    ``(record_line, record_file)``)."""
    last = checkpointer.latest_step() if checkpointer is not None else None
    kept = f"the last good checkpoint is step {last}" if last is not None else "no checkpoint was saved"
    return (f"step {step}: the loss or gradient norm is not finite (NaN/inf), so its update was not applied "
            f"and training stopped; {kept}; the batch held {_describe_records(data_path, *lines)}")


def _describe_records(data_path: str, lines: Any, files: Any) -> str:
    """The batch's records, by file when ``data_path`` names several."""
    if files is None or lines is None or ("," not in data_path and not any(c in data_path for c in "*?[")):
        return records.describe_lines(data_path, lines)
    from d3d_jax.training.data_index import expand_paths

    paths, lines, files = expand_paths(data_path), np.ravel(lines), np.ravel(files)
    return "; ".join(records.describe_lines(paths[f], lines[files == f]) for f in np.unique(files))


def _first(x):
    if isinstance(x, (list, tuple)):
        return x[0] if x else None
    return x


def run(cfg: TrainRunConfig, **trainer_kwargs) -> Trainer:
    """Train per ``cfg`` end to end: resume, fit, export.  Returns the (closed) trainer."""
    maybe_initialize_distributed()
    trainer = Trainer(cfg, **trainer_kwargs)
    try:
        trainer.fit()
        if trainer.stop_signal is None and (cfg.train.export_params or cfg.train.export_hf):
            paths = trainer.export()
            trainer.log(f"exported {paths}")
    finally:
        trainer.close()
    return trainer
