"""What the training stages share: one training-loop run under the work dir (resumed if
interrupted), its loss curve, the drafters' data, offline τ on the dev split and the bfloat16
copy that ships."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from d3d_jax import config as C
from d3d_jax.errors import D3DError
from d3d_jax.pipeline.common import DEV_BATCHES
from d3d_jax.pipeline.context import Context


class StageStopped(D3DError):
    """A training stage that SIGTERM / SIGINT stopped after saving its checkpoint; the command
    exits with 128 + the signal, as ``train/train_drafter.py`` does, and a rerun resumes it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def finished(trainer, name: str, steps: int, run_dir: Path) -> None:
    """Raise :class:`StageStopped` if a signal stopped ``trainer`` early: it saved a checkpoint
    but exported nothing, and the stage must not go on without an export."""
    if trainer.stop_signal is not None:
        raise StageStopped(f"training run {name!r} stopped by signal {trainer.stop_signal} at step "
                           f"{trainer.step} of {steps}, its checkpoint saved in {run_dir / 'checkpoints'}; "
                           "rerun the same command to resume", trainer.stop_signal)


def train_run(ctx: Context, name: str, model_cfg: C.ModelConfig, data: C.DataConfig, objective: C.ObjectiveConfig,
              optim: C.OptimConfig, steps: int, init_from: str = "", seed: int = 0,
              eval_every: int = 0) -> tuple[Path, list[float]]:
    """One training-loop run under ``work_dir/runs/name`` (resumed if interrupted): its HF
    export and the train losses."""
    from d3d_jax.training import loop

    run_dir = ctx.work / "runs" / name
    cfg = C.TrainRunConfig(
        model=model_cfg, mesh=C.MeshConfig(data=1, fsdp=1, tensor=1), data=data, objective=objective,
        optim=optim, num_devices=1,
        train=C.TrainConfig(steps=steps, init_from=init_from, seed=seed, out_dir=str(run_dir),
                            log_every=25, eval_every=eval_every, keep_checkpoints=1,
                            # an interrupted stage resumes from its last tenth
                            checkpoint_every=max(25, steps // 10),
                            async_checkpointing=False, resume=True, export_params=False,
                            export_hf=True, progress_bar=True, aot_compile=False))
    cfg.validate()
    trainer = loop.run(cfg, tokenizer=ctx.tokenizer())
    finished(trainer, name, steps, run_dir)
    losses = [r["loss"] for r in trainer.history if "loss" in r] if hasattr(trainer, "history") else []
    return run_dir / "export" / "hf", losses


def loss_curve(ctx: Context, run_name: str) -> list[dict]:
    """Per dev evaluation of a training run: step, dev loss, dev τ and the mean train loss
    since the previous evaluation (from its ``metrics.jsonl``; a resumed run's newest line wins)."""
    path = ctx.work / "runs" / run_name / "metrics.jsonl"
    if not path.exists():
        return []
    train: dict[int, float] = {}
    dev: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "eval/loss" in rec:
            dev[rec["step"]] = rec
        elif "loss" in rec:
            train[rec["step"]] = rec["loss"]
    curve, last = [], 0
    for step in sorted(dev):
        window = [x for k, x in train.items() if last < k <= step]
        curve.append({"step": step, "train_loss": float(np.mean(window)) if window else None,
                      "dev_loss": dev[step]["eval/loss"], "dev_tau": dev[step].get("eval/tau")})
        last = step
    return curve


def drafter_data(ctx: Context) -> C.DataConfig:
    c = ctx.cfg
    return C.DataConfig(mode="d3d", train_path=str(ctx.regen_split("train")),
                        dev_path=str(ctx.regen_split("dev")), tokenizer=str(ctx.tokenizer_dir),
                        packed_length=c.drafter_packed_length, num_anchors=c.drafter_num_anchors,
                        block_size=c.block_size, batch_size=c.drafter_batch_size, seed=c.seed,
                        dev_batches=2, mask_token_id=ctx.special_ids()["mask"],
                        pad_token_id=ctx.special_ids()["pad"])


def dev_batches(ctx: Context, **data_changes) -> list[dict]:
    """The dev split's first (up to) 8 batches, unshuffled: every offline τ in the report."""
    from d3d_jax.training import data as data_lib

    dc = dataclasses.replace(drafter_data(ctx), **data_changes)
    ds, _ = data_lib.build_dataset(dc, dc.dev_path, tokenizer=ctx.tokenizer(),
                                   mask_token_id=dc.mask_token_id, seed=dc.seed + 12345, shuffle=False)
    n = max(1, min(DEV_BATCHES, len(ds) if hasattr(ds, "__len__") else DEV_BATCHES))
    return data_lib.take_batches(ds, n)


def offline_tau(ctx: Context, model, batches: list[dict] | None = None) -> dict:
    """Offline τ (spec §3.1) on the dev split of target-greedy responses (or on ``batches``)."""
    import jax
    from flax import nnx

    from d3d_jax.training import objectives as obj
    from d3d_jax.training.data import batch_meta

    bs = ctx.cfg.block_size

    @nnx.jit
    def sums(m, batch):
        return obj.tau_from_logits(m(batch["tokens"], batch_meta(batch)), batch, bs)

    parts = [sums(model, {k: jax.numpy.asarray(v) for k, v in b.items()})
             for b in (dev_batches(ctx) if batches is None else batches)]
    return obj.summarize_tau(obj.pool_tau_sums(parts))


def store_compact(hf_dir: Path) -> None:
    """Re-save a trained model in bfloat16 (half the shipped size; every stage runs it in float32)."""
    from d3d_jax.io.checkpoint import load_model
    from d3d_jax.io.hf import save_qwen3

    model = load_model(str(hf_dir))
    extra = {k: getattr(model.config, k) for k in ("mask_token_id", "block_size")
             if getattr(model.config, k) is not None}
    save_qwen3(model, hf_dir, dtype="bfloat16", extra_config=extra)
