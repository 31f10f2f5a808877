"""Stage 6: acceptance-guided progressive pruning (spec §3) of ``cfg.prune_drafter`` down to
``cfg.prune_to_layers``, with ShortGPT's choice of layers pruned beside it at every depth with
the same recovery budget (:mod:`d3d_jax.training.prune_run`).  The pruned weights stay under the
work dir; ``out_dir/pruning/`` ships the report, the recovery curves and the plots."""

from __future__ import annotations

import dataclasses
import shutil

from d3d_jax import config as C
from d3d_jax.pipeline import runs
from d3d_jax.pipeline.common import DEV_BATCHES, write_json
from d3d_jax.pipeline.context import Context
from d3d_jax.pipeline.drafters import float32_export

RULES = ("acceptance", "shortgpt")


def prune_run_config(p: Context) -> C.PruneRunConfig:
    c = p.cfg
    src = float32_export(p, c.prune_drafter) or p.weights_dir(c.prune_drafter)
    if src is None:
        raise FileNotFoundError(f"pruning needs drafter {c.prune_drafter!r}'s weights: neither its training "
                                f"export nor {p.drafter_dir(c.prune_drafter)} has them (train/pipeline.py --rebuild)")
    work = p.work / "prune"
    return C.PruneRunConfig(
        prune=C.PruneConfig(drafter=str(src), out_dir=str(work), target_layers=c.prune_to_layers,
                            criterion="acceptance", compare_shortgpt=True, margin=c.prune_margin,
                            tau_measure="offline", export_rounds=True),
        mesh=C.MeshConfig(data=1, fsdp=1, tensor=1), num_devices=1,
        # every τ of the report on the same 1024 dev anchors as the drafters' result.json
        data=dataclasses.replace(runs.drafter_data(p), dev_batches=DEV_BATCHES),
        objective=C.ObjectiveConfig(kind="d3d", gamma=c.drafter_gamma, ar_weight=1.0),
        optim=C.OptimConfig(name="adamw", learning_rate=c.drafter_learning_rate * 0.3,
                            final_learning_rate=c.drafter_learning_rate * 0.03, warmup_steps=5),
        train=C.TrainConfig(steps=c.prune_recover_steps, log_every=10, eval_every=c.prune_eval_every,
                            async_checkpointing=False, keep_checkpoints=1, aot_compile=False,
                            out_dir=str(work / "train")))


def prune(p: Context) -> None:
    from d3d_jax.training import prune_run

    run_cfg = prune_run_config(p)
    run_cfg.validate()
    report = prune_run.run_pruning(run_cfg, tokenizer=p.tokenizer())
    work = p.work / "prune"
    p.prune_dir.mkdir(parents=True, exist_ok=True)
    for f in ("pruning_report.json", "tau_vs_depth.png", "recovery_curves.png"):
        if (work / f).exists():
            shutil.copy(work / f, p.prune_dir / f)
    write_json(summarize(report, p.cfg), p.prune_dir / "result.json")


def _line(rec: dict, main: bool, tau0: float) -> dict:
    """One rule's drafter at one depth, in the same field names for both rules."""
    curve = rec.get("recovery_curve") or []
    half = [c for c in curve if c["step"] <= curve[-1]["step"] / 2] if curve else []
    return {"removed_layer": rec["removed_original_layer" if main else "original_layer"],
            "layers": rec["remaining_original_layers"], "offline_tau_pruned": rec["tau_pruned"],
            "offline_tau": rec["tau_recovered"], "retention": rec["tau_recovered"] / tau0,
            "recovery_curve": curve, "shared": bool(rec.get("shared", False)) and not main,
            # τ gained over the second half of recovery: near 0 once the budget is long enough
            "rise_second_half": curve[-1]["tau"] - half[-1]["tau"] if len(half) > 1 else None,
            "export": rec.get("export")}


def summarize(report: dict, c: C.PipelineConfig) -> dict:
    tau0 = report["initial_tau"]
    depths = [{"depth": r["depth_after"], "acceptance": _line(r, True, tau0),
               "shortgpt": _line(r["other_rule"], False, tau0)} for r in report["rounds"]]
    return {"source": c.prune_drafter, "initial_depth": report["initial_depth"], "initial_offline_tau": tau0,
            "recover_steps_per_round": c.prune_recover_steps, "margin": c.prune_margin,
            "stopped": report["stopped"], "depths": depths, "wall_s": report["wall_s"]}


def pruned_names(p: Context) -> dict[str, str | None]:
    """``{"<source>_<rule>_<depth>": export dir or None}`` for stage 7 and the report."""
    import json

    path = p.prune_dir / "result.json"
    if not p.cfg.prune_drafter or not path.exists():
        return {}
    res = json.loads(path.read_text())
    return {f"{res['source']}_{rule}_{row['depth']}": row[rule]["export"]
            for row in res["depths"] for rule in RULES}
