"""Acceptance-guided progressive layer pruning of a trained drafter (spec §3).

    python train/prune_drafter.py --config configs/prune/tiny.yaml [key=value ...]

e.g. ``prune.drafter=runs/drafter/export/hf data.train_path=train.jsonl data.dev_path=dev.jsonl
prune.target_layers=31 train.steps=10000``.  Settings are ``d3d_jax.config.PruneRunConfig``
fields.  Per round: importance of every layer (offline τ without it, or online τ with
``prune.tau_measure=online prune.target=...``), delete the least important, recover by
η-adjusted distillation from the unpruned drafter with the training loop, export
(``<out_dir>/round_XX/export/{params,hf}``).  Writes ``pruning_report.json`` and
``tau_vs_depth.png`` to ``prune.out_dir``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from d3d_jax.config import PruneRunConfig, parse_config_cli  # noqa: E402
from d3d_jax.parallel.distributed import maybe_initialize_distributed  # noqa: E402


def main(argv=None) -> int:
    maybe_initialize_distributed()  # before the config: validating it may count devices (starts JAX)
    cfg, _ = parse_config_cli(PruneRunConfig, argv, __doc__)

    from d3d_jax.io.checkpoint import stored_model_config
    from d3d_jax.training.prune_run import run_pruning

    cfg.prune.check_depth(stored_model_config(cfg.prune.drafter).num_layers)  # before loading anything

    report = run_pruning(cfg)
    rounds = report["rounds"]
    print(f"τ₀ = {report['initial_tau']:.4f} at depth {report['initial_depth']}; "
          f"final depth {report['final_depth']} ({report['stopped']})")
    for r in rounds:
        other = r["other_rule"]
        print(f"  depth {r['depth_after']}: τ {r['tau_recovered']:.4f} ({100 * r['retention']:.2f}%)"
              + (f"; {other['rule']}: τ {other['tau_recovered']:.4f}" if "tau_recovered" in other else ""))
    return 0


if __name__ == "__main__":
    from d3d_jax.cli import run_cli

    sys.exit(run_cli(main))
