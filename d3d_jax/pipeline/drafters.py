"""Stage 5: the D3D drafters (the paper's recipe, its ablations, the target-initialised one), and
which of their weights ship."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from d3d_jax import config as C
from d3d_jax.pipeline import runs
from d3d_jax.pipeline.common import log, write_json
from d3d_jax.pipeline.context import Context


def small_needed(p: Context) -> bool:
    return any(v.init in ("small", "random") and not (p.drafter_dir(v.name) / "result.json").exists()
               for v in p.cfg.drafters)


def all_trained(p: Context) -> bool:
    """Every drafter and the pruning stage are done: the training split is no longer needed."""
    return all((p.drafter_dir(v.name) / "result.json").exists() for v in p.cfg.drafters) and (
        not p.cfg.prune_drafter or (p.prune_dir / "result.json").exists())


def train_drafter(p: Context, v: C.DrafterVariantConfig) -> None:
    from d3d_jax.config import load_model_config

    c = p.cfg
    init_dir = {"small": p.model_dir("small"), "target": p.model_dir("target")}.get(v.init)
    base = load_model_config(str(init_dir or p.model_dir("small")))
    mc = p.model_config(base, mask_token_id=p.special_ids()["mask"], block_size=c.block_size)
    optim = C.OptimConfig(name="adamw", learning_rate=c.drafter_learning_rate,
                          final_learning_rate=c.drafter_learning_rate * 0.1, warmup_steps=20,
                          decay_steps=v.decay_steps or 0)
    objective = C.ObjectiveConfig(kind="d3d", gamma=c.drafter_gamma, ar_weight=v.ar_weight)
    steps = v.steps or c.drafter_steps
    seed = c.seed if v.seed is None else v.seed
    data = dataclasses.replace(runs.drafter_data(p), seed=seed)
    hf_dir, losses = runs.train_run(p, f"drafter_{v.name}", mc, data, objective, optim, steps,
                                    init_from=str(init_dir) if init_dir else "", seed=seed,
                                    eval_every=max(25, steps // 30))  # the dev-loss curve
    dest = p.drafter_dir(v.name)
    shutil.copytree(hf_dir, dest, dirs_exist_ok=True)
    runs.store_compact(dest)  # pruning starts from the run's float32 export (float32_export)
    tau = runs.offline_tau(p, p.load(dest))  # of the weights as stored
    write_json({"variant": dataclasses.asdict(v), "steps": steps, "seed": seed,
                "init_from": str(init_dir or "random"), "final_loss": losses[-1] if losses else None,
                "offline_tau_dev": tau, "curve": runs.loss_curve(p, f"drafter_{v.name}")}, dest / "result.json")
    log(f"drafter {v.name}: offline τ on dev = {tau['tau']:.3f}")


def float32_export(p: Context, name: str) -> Path | None:
    """Drafter ``name``'s float32 weights as its training run exported them (None if gone)."""
    hf = p.work / "runs" / f"drafter_{name}" / "export" / "hf"
    return hf if (hf / "model.safetensors").exists() else None


def unship_weights(p: Context) -> None:
    """Only the benchmark's drafters and the one pruning starts from ship their weights (so the
    pruning stage reruns without retraining): every other drafter's move to the work dir (its
    config, result and curves stay in out_dir), once stage 7 has measured it online."""
    shipped = set(p.cfg.eval_drafters) | ({p.cfg.prune_drafter} if p.cfg.prune_drafter else set())
    for v in p.cfg.drafters:
        src = p.drafter_dir(v.name)
        if v.name in shipped or not (src / "model.safetensors").exists():
            continue
        keep = p.work / "drafters" / v.name
        keep.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src / "model.safetensors"), str(keep / "model.safetensors"))
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, keep / f.name)
        log(f"{v.name}: weights moved to {keep} (not shipped; its results are)")
