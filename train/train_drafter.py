"""Train a D3D drafter (spec §2) — or, with ``data.mode=lm objective.kind=lm``, pretrain a small LM.

    python train/train_drafter.py --config configs/train/tiny.yaml [--config more.yaml] [key=value ...]

Settings are ``d3d_jax.config.TrainRunConfig`` sections (model, mesh, data, objective, optim,
train); e.g. ``train.steps=200 optim.name=adamw data.train_path=data.jsonl``.  Rerunning the same
command resumes from the newest intact checkpoint in ``train.out_dir/checkpoints``; SIGTERM or
SIGINT saves the current step and exits with status 128 + signal.  Writes
``train.out_dir/metrics.jsonl`` and, at the end, ``train.out_dir/export/{params,hf}``.
Multi-process: ``jax.distributed.initialize`` runs first, before anything (config validation
included) touches JAX, when the environment describes several processes
(:mod:`d3d_jax.parallel.distributed`; ``train/launch_local.py`` starts N processes on one machine).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from d3d_jax.config import TrainRunConfig, parse_config_cli, to_dict  # noqa: E402
from d3d_jax.parallel.distributed import maybe_initialize_distributed  # noqa: E402


def main(argv=None) -> int:
    # before the config: validating it counts devices, which starts a JAX backend
    maybe_initialize_distributed()
    cfg, args = parse_config_cli(
        TrainRunConfig, argv, __doc__,
        lambda ap: ap.add_argument("--print-config", action="store_true",
                                   help="print the resolved config and exit"))
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=2))
        return 0

    from d3d_jax.training.loop import run

    trainer = run(cfg)  # a damaged or mismatched checkpoint: a ConfigError, one line via run_cli
    last = trainer.last_logged()  # a finished run rerun trains nothing: its last logged step
    skipped = {k: v["invalid"] for k, v in trainer.data_stats.items()}
    print(json.dumps({"step": trainer.step, "loss": last.get("loss"), "out_dir": str(trainer.out_dir),
                      "skipped_records": skipped}))
    # Stopped by a signal: a non-zero status (128 + signal, as a shell reports) tells a scheduler
    # the run is unfinished and should be restarted.
    return 0 if trainer.stop_signal is None else 128 + trainer.stop_signal


if __name__ == "__main__":
    from d3d_jax.cli import run_cli

    sys.exit(run_cli(main))
