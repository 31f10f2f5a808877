#!/usr/bin/env python
"""Write the synthetic counting corpus that ``configs/train/tiny.yaml`` and
``configs/prune/tiny.yaml`` read (``d3d_jax.training.data.synthetic_records``):

    python train/synthetic_data.py runs/tiny-data [--train 512] [--dev 32] [--vocab-size 64]

Each response counts upwards from a start its prompt names, so a drafter can learn every slot of
a block; CPU-sized runs of the training, pruning and multi-process paths need no model or text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="writes train.jsonl and dev.jsonl here")
    ap.add_argument("--train", type=int, default=512, help="training records")
    ap.add_argument("--dev", type=int, default=32, help="dev records")
    ap.add_argument("--vocab-size", type=int, default=64, help="the model's vocabulary (tiny.yaml: 64)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from d3d_jax.errors import UsageError
    from d3d_jax.training import data as D

    if args.train < 1 or args.dev < 1:
        raise UsageError(f"--train and --dev must be >= 1, got {args.train} and {args.dev}")
    if args.vocab_size < 8:
        raise UsageError(f"--vocab-size must be >= 8 (4 special ids + a count), got {args.vocab_size}")
    out = Path(args.out_dir)
    for name, n, seed in (("train", args.train, args.seed), ("dev", args.dev, args.seed + 1)):
        path = D.write_jsonl(out / f"{name}.jsonl", D.synthetic_records(n, vocab_size=args.vocab_size, seed=seed))
        print(f"{path}: {n} records")
    return 0


if __name__ == "__main__":
    from d3d_jax.cli import run_cli

    sys.exit(run_cli(main))
