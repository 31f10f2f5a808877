#!/usr/bin/env python
"""Benchmarks, one subcommand each: ``infer/bench.py engine [options]`` (``--help`` per command).

Each entry of ``COMMANDS`` names a module exposing ``add_arguments(parser)`` and ``main(args)``;
modules are imported only when their command runs.  To add a benchmark, add one line here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("d3d_jax.bench.engine",
               "plain decoding vs transformers; sync efficiency with a replay drafter"),
    "train": ("d3d_jax.bench.train",
              "train-step tokens/s (tiny config) and a per-device memory plan (D3D-8B, 64-device fsdp)"),
    "async": ("d3d_jax.bench.async_decoding",
              "async vs sync vs plain (tokens/s, τ, hit rate); C×F sweep, speedup/hit rate vs budget PNG"),
    "regenerate": ("d3d_jax.bench.regenerate",
                   "regeneration tokens/s at batch 1 vs 8 (tiny target), the data-regeneration path"),
    "first-block": ("d3d_jax.pipeline.first_block",
                    "offline τ on first blocks: a demo drafter fine-tuned with / without data.first_block_anchor"),
    "serve": ("d3d_jax.bench.serve",
              "concurrent clients against the real server: tokens/s, TTFT, TPOT, mode mix per mode (Table 2)"),
    "start": ("d3d_jax.bench.start",
              "infer/serve.py's cold and warm starts side by side: READY, first requests, files compiled"),
    "windows": ("d3d_jax.bench.windows",
                "a round's cost with few requests in many slots against as many slots as requests"),
    "gpu": ("d3d_jax.bench.gpu",
            "every GPU measure on the present accelerator: roofline, sync/async, parts, drafter sizes"),
    "compile": ("d3d_jax.bench.compile",
                "every hot program compiled for an H200 / TPU pod without one: memory, flops, bytes, PTX facts"),
    "shapes": ("d3d_jax.bench.shapes",
               "plain ms/token over a grid of small shapes against what their arithmetic predicts"),
    "programs": ("d3d_jax.bench.programs",
                 "every program a decoder compiles (CPU): trace / lower / compile seconds, HLO size, kernels"),
    "eval": ("d3d_jax.bench.evaluation.cli",
             "Table 1 for a target + drafter: τ, speedup, tokens/s, hit rate per benchmark, plots"),
}


def _limit_cpu_threads(n: int) -> None:
    """Pin XLA (and torch, via OMP) to ``n`` threads: on a shared CPU, timings stop depending on
    how many other processes compete for the cores.  Must run before jax/torch are imported."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                               + ("false intra_op_parallelism_threads=1" if n == 1 else "true")).strip()
    os.environ["OMP_NUM_THREADS"] = str(n)


def _cpu_devices(n: int) -> None:
    """``n`` host (CPU) devices, so on a CPU-only machine target and drafter can take disjoint
    devices (spec §5).  Must run before jax is imported; an explicit XLA_FLAGS count wins."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


# commands whose async rounds should see two devices on a CPU-only host unless told otherwise
TWO_DEVICE_COMMANDS = ("eval",)


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="threads for XLA-CPU and torch (1 = steadier timings on a busy machine)")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="host devices on a CPU backend (default: 2 for eval, so async target and "
                             "drafter take disjoint devices; 1 elsewhere)")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--cpu-threads", type=int, default=None)
    pre.add_argument("--cpu-devices", type=int, default=None)
    early, _ = pre.parse_known_args(argv)
    if early.cpu_threads:
        _limit_cpu_threads(early.cpu_threads)
    if early.cpu_devices is not None and early.cpu_devices < 1:
        parser.error(f"--cpu-devices must be >= 1, got {early.cpu_devices}")
    command = next((a for a in argv if a in COMMANDS), None)
    cpu_devices = early.cpu_devices or (2 if command in TWO_DEVICE_COMMANDS else None)
    if cpu_devices:
        _cpu_devices(cpu_devices)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    # build only the requested command's parser, so one command's imports never slow another
    name = command
    for cmd, (module, helptext) in COMMANDS.items():
        p = sub.add_parser(cmd, help=helptext)
        if cmd == name:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.main)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    from d3d_jax.cli import run_cli

    sys.exit(run_cli(main))
