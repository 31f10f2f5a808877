"""Regeneration throughput at several batch sizes, side by side (issue 5's benchmark).

    python infer/bench_regenerate.py [--target DIR --prompts FILE] [--batch-sizes 1,8]
        [--max-new-tokens 32] [--num-prompts 32] [--json out.json]

Without ``--target`` it uses a random-weight ``configs/models/tiny.yaml`` target, a tokenizer
trained on Shakespeare and prompts from held-out plays.  Each batch size is run once to compile
and once timed; tokens/s counts generated tokens over generation plus record writing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF Qwen3 dir or d3d_jax checkpoint (default: random tiny target)")
    ap.add_argument("--tokenizer", help="tokenizer dir (default: --target)")
    ap.add_argument("--prompts", help="prompt JSONL (required with --target)")
    ap.add_argument("--model", default="tiny", help="config name of the random target without --target")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--json", help="write the rows here as JSON")
    args = ap.parse_args(argv)

    from d3d_jax.training import regenerate as rg
    from d3d_jax.training import regenerate_bench as bench

    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    settings = (rg.GenerationSettings.greedy(args.max_new_tokens) if args.greedy
                else rg.GenerationSettings(max_new_tokens=args.max_new_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        if args.target:
            if not args.prompts:
                ap.error("--prompts is required with --target")
            from transformers import AutoTokenizer

            from d3d_jax.io.checkpoint import load_model

            target = load_model(args.target)
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target, local_files_only=True)
            prompts = args.prompts
        else:
            target, tokenizer, prompts = bench.tiny_setup(tmp, args.num_prompts, args.model)
        rows = bench.benchmark_regeneration(target, tokenizer, prompts, batch_sizes=batch_sizes,
                                            settings=settings, workdir=tmp)
    print(bench.format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
