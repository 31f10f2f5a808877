"""The pruning program (``train/prune_drafter.py``) and its report: the run over a
:class:`~d3d_jax.config.PruneRunConfig`, the recovery curves, ``pruning_report.json`` and the
τ-against-depth plots.  The method itself is :mod:`d3d_jax.training.pruning`."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Callable

import jax

from d3d_jax.model.qwen3 import Qwen3
from d3d_jax.training import data as data_lib
from d3d_jax.training.pruning import OfflineTau, online_tau, prune_progressively, trainer_recovery


def recovery_curve(run_dir: Path, tau_start: float) -> list[dict]:
    """``[{"step", "tau"}]`` of one recovery run (step 0: τ of the cut model before recovery),
    from its ``metrics.jsonl`` (a resumed run's newest line per step wins)."""
    path = Path(run_dir) / "metrics.jsonl"
    by_step = {0: tau_start}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "eval/tau" in rec:
                by_step[int(rec["step"])] = float(rec["eval/tau"])
    return [{"step": s, "tau": by_step[s]} for s in sorted(by_step)]


def attach_exports_and_curves(report: dict, out: Path, exported: bool) -> None:
    """Per round and rule: where its recovered drafter was exported and its recovery curve."""
    for r in report["rounds"]:
        name = f"round_{r['round']:02d}"
        r["recovery_curve"] = recovery_curve(out / name, r["tau_pruned"])
        if exported:
            r["export"] = str(out / name / "export")
        o = r["other_rule"]
        if "tau_recovered" in o:
            own = out / f"{name}_{o['rule']}"
            src = out / name if o.get("shared") else own
            o["recovery_curve"] = recovery_curve(src, o["tau_pruned"])
            if exported:
                o["export"] = str(src / "export")


def plot_tau_vs_depth(report: dict, path: str | Path) -> None:
    """PNG: τ against depth, before and after recovery, for the pruning rule and (where it pruned
    its own line) the comparison rule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = report["rounds"]
    after = [r["depth_after"] for r in rounds]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([report["initial_depth"]] + after, [report["initial_tau"]] + [r["tau_recovered"] for r in rounds],
            "o-", label=f"{report['criterion']}: recovered")
    ax.plot(after, [r["tau_pruned"] for r in rounds], "x--", label=f"{report['criterion']}: before recovery")
    other = [r["other_rule"] for r in rounds]
    if other:
        ax.plot(after, [o["tau_pruned"] for o in other], "+:", label=f"{other[0]['rule']}: before recovery")
        if all("tau_recovered" in o for o in other):
            ax.plot([report["initial_depth"]] + after, [report["initial_tau"]] + [o["tau_recovered"] for o in other],
                    "s:", label=f"{other[0]['rule']}: recovered")
    ax.set_xlabel("drafter depth (layers)")
    ax.set_ylabel(f"{report.get('tau_measure', 'offline')} τ")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_recovery_curves(report: dict, path: str | Path) -> bool:
    """PNG: offline τ against recovery step, one line per round and rule; False if no curve."""
    lines = []
    for r in report["rounds"]:
        for rule, rec in ((report["criterion"], r), (r["other_rule"]["rule"], r["other_rule"])):
            curve = rec.get("recovery_curve") or []
            if len(curve) > 1 and not (rec is r["other_rule"] and rec.get("shared")):
                lines.append((f"{rule} → {r['depth_after']} layers", curve))
    if not lines:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in lines:
        ax.plot([c["step"] for c in curve], [c["tau"] for c in curve], "o-", ms=3, label=label)
    ax.axhline(report["initial_tau"], color="k", lw=0.8, ls="--", label="unpruned")
    ax.set_xlabel("recovery step")
    ax.set_ylabel("offline τ (dev)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(report: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pruning_report.json"
    path.write_text(json.dumps(report, indent=2))
    plot_tau_vs_depth(report, out / "tau_vs_depth.png")
    plot_recovery_curves(report, out / "recovery_curves.png")
    return path


# --------------------------------------------------------------------------------------
# The run (train/prune_drafter.py)
# --------------------------------------------------------------------------------------


def _online_prompts(cfg: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    examples, _ = data_lib.load_examples(cfg.data.dev_path or cfg.data.train_path, tokenizer, cfg.data,
                                         vocab_size)
    return [list(ex.tokens[:ex.response_start]) for ex in examples[:cfg.prune.online_prompts]]


def _tau_measure(cfg: Any, tokenizer: Any, vocab: int, mask_id: int) -> tuple[Callable[[Qwen3], float], list]:
    """The importance measure (offline τ on the dev split, or online τ with the target) and the
    dev batches ShortGPT's similarities (and the offline recovery curve) are taken on."""
    from d3d_jax.io.checkpoint import load_model

    pc, dc = cfg.prune, cfg.data
    if pc.tau_measure == "offline":
        dev_ds, _ = data_lib.build_dataset(dc, dc.dev_path, tokenizer=tokenizer, mask_token_id=mask_id,
                                           seed=dc.seed + 12345, shuffle=False, vocab_size=vocab)
        dev = data_lib.take_batches(dev_ds, dc.dev_batches)
        return OfflineTau(dev, dc.block_size), dev
    target = load_model(pc.target, stacked=False)  # only decoded here: the layout decoders run
    prompts = _online_prompts(cfg, tokenizer, vocab)
    eos = target.config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    tau_fn = functools.partial(online_tau, target=target, prompts=prompts,
                               max_new_tokens=pc.online_max_new_tokens, block_size=dc.block_size,
                               mask_token_id=mask_id, eos_token_ids=eos_ids)
    sim_ds, _ = data_lib.build_dataset(dc, dc.dev_path or dc.train_path, tokenizer=tokenizer,
                                       mask_token_id=mask_id, seed=dc.seed + 12345, shuffle=False,
                                       vocab_size=vocab)
    return tau_fn, data_lib.take_batches(sim_ds, max(dc.dev_batches, 1))


def run_pruning(cfg: Any, *, drafter: Qwen3 | None = None, tokenizer: Any = None,
                log: Callable[[str], None] | None = None) -> dict:
    """Prune per a :class:`~d3d_jax.config.PruneRunConfig`; writes ``pruning_report.json``,
    ``tau_vs_depth.png`` and per round ``round_XX/`` (Orbax train state, ``export/params``,
    ``export/hf``) under ``prune.out_dir``.  Returns the report."""
    from d3d_jax.config import TrainRunConfig, to_dict
    from d3d_jax.io.checkpoint import load_model

    from d3d_jax.parallel.sharding import make_mesh

    pc, dc = cfg.prune, cfg.data
    log = log or (lambda s: print(s, flush=True))
    out = Path(pc.out_dir)
    if drafter is None:  # the teacher (and every candidate cut from it) lives on the run's mesh
        n_dev = cfg.num_devices or jax.device_count()
        mesh = make_mesh(cfg.mesh, jax.devices()[:n_dev])
        drafter = load_model(pc.drafter, mesh=mesh, rules=cfg.mesh.rules)
    if drafter.config.block_size not in (None, dc.block_size):
        raise ValueError(f"data.block_size={dc.block_size} differs from the drafter's block_size "
                         f"{drafter.config.block_size}")
    vocab = drafter.config.vocab_size  # records with ids outside it are skipped
    if tokenizer is None and dc.tokenizer:
        tokenizer = data_lib.load_tokenizer_for(dc, vocab)
    mask_id = data_lib.resolve_mask_token_id(dc, drafter.config.mask_token_id, tokenizer)
    drafter.config = dataclasses.replace(drafter.config, mask_token_id=mask_id, block_size=dc.block_size)

    tau_fn, dev = _tau_measure(cfg, tokenizer, vocab, mask_id)
    train_ds, _ = data_lib.build_dataset(dc, dc.train_path, tokenizer=tokenizer, mask_token_id=mask_id,
                                         vocab_size=vocab)
    run_cfg = TrainRunConfig(model=drafter.config, mesh=cfg.mesh, data=dataclasses.replace(dc, mask_token_id=mask_id),
                             objective=cfg.objective, optim=cfg.optim,
                             train=dataclasses.replace(cfg.train, progress_bar=pc.progress_bar),
                             num_devices=cfg.num_devices)
    curve_batches = dev if pc.tau_measure == "offline" and cfg.train.eval_every else ()
    recover = trainer_recovery(run_cfg, drafter, train_ds, out, margin=pc.margin,
                               export=pc.export_rounds, log=log, dev_batches=curve_batches)

    def on_round(i: int, model: Qwen3, rec: dict) -> None:
        log(f"round {i}: removed layer {rec['removed_original_layer']} (depth {rec['depth_after']}); "
            f"τ pruned {rec['tau_pruned']:.4f} -> recovered {rec['tau_recovered']:.4f} "
            f"({100 * rec['retention']:.2f}% of τ₀); {rec['other_rule']['rule']} removes "
            f"{rec['other_rule']['original_layer']}"
            + (f" -> τ {rec['other_rule']['tau_recovered']:.4f}" if "tau_recovered" in rec["other_rule"] else ""))
        (out / "pruning_progress.json").write_text(json.dumps(rec, indent=2))

    best, report = prune_progressively(
        drafter, tau_fn=tau_fn, similarity_batches=dev, recover=recover, target_layers=pc.target_layers,
        retention_floor=pc.retention_floor, criterion=pc.criterion, compare_shortgpt=pc.compare_shortgpt,
        on_round=on_round, progress=pc.progress_bar)
    report["tau_measure"] = pc.tau_measure
    report["config"] = to_dict(cfg)
    attach_exports_and_curves(report, out, pc.export_rounds)
    done = [r for r in report["rounds"] if r["depth_after"] == best.config.num_layers]
    if done and pc.export_rounds:
        report["final_export"] = done[0]["export"]
    path = write_report(report, out)
    log(f"pruning report: {path}")
    return report
