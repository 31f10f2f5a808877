#!/usr/bin/env python
"""Run the embedded-default pipeline: tokenizer → target → small model → regeneration → D3D
drafters (+ ablations) → pruning (τ-guided and ShortGPT) → online τ of every drafter →
benchmark (Table 1, ablations, pruning, latency by depth; plots, JSON).

    python train/pipeline.py --config configs/pipelines/demo.yaml [key=value ...]
    python train/pipeline.py --config configs/pipelines/demo.yaml --rebuild   # from nothing
    python train/pipeline.py --config configs/pipelines/demo.yaml --rebuild --quick   # every stage, shortened
    python train/pipeline.py --config configs/pipelines/demo.yaml --config my-changes.yaml
        # later files merge over earlier ones

Stages whose output exists under ``out_dir`` are skipped, so with the shipped checkpoints only
the benchmark runs.  Exit status 3 if any sync/async output differs from plain greedy decoding.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two host devices, so async drafting can put target and drafter on disjoint devices (spec §5);
# training and plain/sync decoding use the first one.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, action="append",
                    help="pipeline YAML (configs/pipelines/demo.yaml); repeated, later files merge over earlier ones")
    ap.add_argument("--rebuild", action="store_true", help="delete out_dir and work dir, rebuild everything")
    ap.add_argument("--work-dir", default=None,
                    help="scratch: training checkpoints, corpus (default runs/pipeline/<out_dir>)")
    ap.add_argument("--quick", action="store_true",
                    help="every stage at ~1/8 of the steps, under runs/quick/ (with --rebuild: ~41 min for the demo on 2 cores)")
    ap.add_argument("--no-eval", action="store_true", help="build the artifacts, skip the benchmark")
    ap.add_argument("--update-artifacts", action="store_true",
                    help="also replace the shipped reference results in <out_dir>/eval (default: the "
                         "benchmark writes only under the work dir, runs/, so the checkout stays clean)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_intermixed_args(argv)  # key=value before and after each --config

    from d3d_jax.config import PipelineConfig, load_config
    from d3d_jax import pipeline

    cfg = load_config(PipelineConfig, args.config, args.overrides)
    if args.quick:
        cfg = cfg.quick()
        cfg.validate()
        print(f"[pipeline] --quick: every stage shortened, artifacts under {cfg.out_dir}", flush=True)
    t0 = time.time()
    work_dir = args.work_dir or os.path.join("runs", "pipeline", cfg.out_dir.strip("/").replace("/", "_"))
    ctx = pipeline.Context(cfg, work_dir=work_dir, rebuild=args.rebuild, update_artifacts=args.update_artifacts)
    report = pipeline.run(ctx, evaluate=not args.no_eval)
    print(f"[pipeline] total {time.time() - t0:.0f}s", flush=True)
    if report is not None and not report["all_outputs_equal_plain"]:
        print("[pipeline] ERROR: some speculative output differs from plain greedy decoding", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    from d3d_jax.cli import run_cli

    sys.exit(run_cli(main))
