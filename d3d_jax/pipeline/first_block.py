"""``infer/bench.py first-block``: does anchoring training blocks on the last prompt token help?

Decoding anchors every generation's first block on the last prompt token; training anchors
start inside the response unless ``data.first_block_anchor`` is set.  This fine-tunes a shipped
demo drafter (default ``artifacts/demo/drafters/small``) for ``--steps`` steps on the demo's
train split, once without and once with the option (same seed, data order and schedule as the
pipeline's drafter stage), and reports offline τ on the demo's dev split:

* **first blocks** – one block per dev response, anchored on its last prompt token (the block
  decoding drafts first), per-block τ paired across the two runs;
* **all anchors** – the pipeline's dev batches with anchors inside the response only.

Runs one training at a time (CPU-sized: the demo drafter is 2 layers of width 128).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from d3d_jax.pipeline import runs

REPO = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline-config", default=str(REPO / "configs/pipelines/demo.yaml"))
    p.add_argument("--drafter", default="small", help="a drafter under the pipeline's out_dir/drafters")
    p.add_argument("--steps", type=int, default=100, help="fine-tuning steps per run")
    p.add_argument("--seeds", default="0", help="comma-separated data seeds; each runs both settings")
    p.add_argument("--work-dir", default=str(REPO / "runs/bench_first_block"))
    p.add_argument("--json", default="", help="also write the results here")


def first_block_batches(pipe) -> list[dict]:
    """Every dev response's first block (anchor = last prompt token), one block per row."""
    from d3d_jax.training import data as D

    dc = runs.drafter_data(pipe)
    examples, _ = D.load_examples(dc.dev_path, pipe.tokenizer(), dc)
    rows = []
    for ex in examples:
        a = ex.response_start - 1
        if a < 0 or a + dc.block_size > len(ex.tokens):  # not a full block
            continue
        anchors = np.zeros(dc.num_anchors, np.int32)
        valid = np.zeros(dc.num_anchors, bool)
        anchors[0], valid[0] = a, True
        rows.append(D.pack_example(ex, anchors, valid, dc, dc.mask_token_id))
    return [{k: np.stack([r[k] for r in rows[i:i + dc.batch_size]]) for k in rows[0]}
            for i in range(0, len(rows), dc.batch_size)]


def per_block_tau(model, batches: list[dict], block_size: int) -> np.ndarray:
    """τ of each row's single block (rows of :func:`first_block_batches`)."""
    import jax
    from flax import nnx

    from d3d_jax.training import objectives as obj
    from d3d_jax.training.data import batch_meta

    @nnx.jit
    def rows(m, batch):
        logits = m(batch["tokens"], batch_meta(batch))
        one = lambda lg, b: obj.tau_from_logits(lg[None], jax.tree.map(lambda x: x[None], b), block_size)["tau_sum"]
        return jax.vmap(one)(logits, batch)

    return np.concatenate([np.asarray(rows(model, {k: jax.numpy.asarray(v) for k, v in b.items()}))
                           for b in batches])


def finetune(pipe, drafter_dir: Path, name: str, steps: int, seed: int, first_block_anchor: bool) -> Path:
    """The pipeline's drafter stage, from ``drafter_dir``, for ``steps`` steps; returns the HF export."""
    from d3d_jax import config as C

    c = pipe.cfg
    shutil.rmtree(pipe.work / "runs" / name, ignore_errors=True)
    mc = pipe.model_config(C.load_model_config(str(drafter_dir)), mask_token_id=pipe.special_ids()["mask"],
                            block_size=c.block_size)
    data = dataclasses.replace(runs.drafter_data(pipe), seed=seed, first_block_anchor=first_block_anchor)
    optim = C.OptimConfig(name="adamw", learning_rate=c.drafter_learning_rate,
                          final_learning_rate=c.drafter_learning_rate * 0.1, warmup_steps=20)
    objective = C.ObjectiveConfig(kind="d3d", gamma=c.drafter_gamma, ar_weight=1.0)
    hf_dir, _ = runs.train_run(pipe, name, mc, data, objective, optim, steps, init_from=str(drafter_dir), seed=seed)
    return hf_dir


def evaluate(pipe, model, first_batches: list[dict], dev_batches: list[dict]) -> dict:
    per_block = per_block_tau(model, first_batches, pipe.cfg.block_size)
    overall = runs.offline_tau(pipe, model, dev_batches)
    return {"tau_first_block": float(per_block.mean()), "tau_all_anchors": overall["tau"],
            "first_blocks": int(per_block.size), "anchors": overall["anchors"], "per_block": per_block.tolist()}


def main(args) -> dict:
    from d3d_jax import config as C
    from d3d_jax.io.checkpoint import load_model
    from d3d_jax.pipeline import Context

    cfg = C.load_config(C.PipelineConfig, [args.pipeline_config], [])
    pipe = Context(cfg, work_dir=args.work_dir)
    drafter_dir = pipe.drafter_dir(args.drafter)
    first = first_block_batches(pipe)
    dev = runs.dev_batches(pipe, first_block_anchor=False)  # anchors inside the response, as before the option
    results = {"shipped": evaluate(pipe, load_model(str(drafter_dir)), first, dev)}
    for seed in (int(s) for s in args.seeds.split(",")):
        for on in (False, True):
            name = f"{args.drafter}_ft{args.steps}_seed{seed}_{'first_block' if on else 'response_only'}"
            hf = finetune(pipe, drafter_dir, name, args.steps, seed, on)
            results[name] = {"first_block_anchor": on, "seed": seed, **evaluate(pipe, load_model(str(hf)), first, dev)}
    out = {"drafter": str(drafter_dir), "steps": args.steps, "runs": results, "paired": paired(results)}
    print_table(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def paired(runs: dict) -> dict:
    """Per-seed first-block τ difference (with − without), paired over the same blocks, ± s.e."""
    out = {}
    for name, r in runs.items():
        if r.get("first_block_anchor"):
            base = runs[name.replace("_first_block", "_response_only")]
            d = np.asarray(r["per_block"]) - np.asarray(base["per_block"])
            out[f"seed{r['seed']}"] = {"first_block_delta": float(d.mean()),
                                      "first_block_delta_se": float(d.std(ddof=1) / np.sqrt(d.size)),
                                      "all_anchors_delta": r["tau_all_anchors"] - base["tau_all_anchors"]}
    return out


def print_table(out: dict) -> None:
    print(f"offline τ on the demo dev split, {out['drafter']} fine-tuned {out['steps']} steps:")
    print(f"  {'run':<48} {'first blocks':>12} {'all anchors':>12}")
    for name, r in out["runs"].items():
        print(f"  {name:<48} {r['tau_first_block']:>12.3f} {r['tau_all_anchors']:>12.3f}")
    some = next(iter(out["runs"].values()))
    print(f"  ({some['first_blocks']} first blocks, {some['anchors']} dev anchors)")
    for seed, p in out["paired"].items():
        print(f"  {seed}: first-block τ with − without = {p['first_block_delta']:+.3f} ± "
              f"{p['first_block_delta_se']:.3f} (s.e., paired); all anchors {p['all_anchors_delta']:+.3f}")
