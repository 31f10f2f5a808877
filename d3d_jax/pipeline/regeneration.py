"""Stage 4: the target's greedy responses to the regeneration prompts, split into train and dev."""

from __future__ import annotations

import json

import numpy as np

from d3d_jax import config as C
from d3d_jax import demo
from d3d_jax.io.records import write_jsonl
from d3d_jax.pipeline.common import log
from d3d_jax.pipeline.context import Context


def regen_prompt_pairs(cfg: C.PipelineConfig) -> list[dict]:
    """Every regeneration prompt: continuation passages of the held-out *prompt* split topped up
    from the pretraining split, then signature-and-docstring stubs of stdlib functions (never the
    evaluation split: ``tests/test_demo.py`` checks that no evaluation prompt leaks in)."""
    pairs = demo.continuation_pairs("prompts", passage_chars=cfg.passage_chars, seed=cfg.seed,
                                    max_pairs=cfg.regen_prompts)
    if len(pairs) < cfg.regen_prompts:
        pairs += demo.continuation_pairs("pretrain", passage_chars=cfg.passage_chars, seed=cfg.seed,
                                         max_pairs=cfg.regen_prompts - len(pairs), max_chars=cfg.pretrain_chars)
    if cfg.regen_docstring_prompts:
        pairs += demo.docstring_prompts(max_pairs=cfg.regen_docstring_prompts, seed=cfg.seed)
    return pairs


def regenerate(p: Context) -> None:
    from d3d_jax.training import regenerate as regen

    c = p.cfg
    prompts_path = p.out / "data" / "regen_prompts.jsonl"
    prompts_path.parent.mkdir(parents=True, exist_ok=True)
    with open(prompts_path, "w") as f:
        for i, pair in enumerate(regen_prompt_pairs(c)):
            f.write(json.dumps({"id": f"{pair['source']}-{i}",
                                "messages": [{"role": "user", "content": pair["prompt"]}]}) + "\n")
    from d3d_jax.decoding.engine import decoding_layout

    # per layer, the layout the decoder runs fast; the stacked load is dropped (one copy)
    target = decoding_layout(p.load(p.model_dir("target")))
    settings = (regen.GenerationSettings.greedy(c.regen_max_new_tokens, c.seed) if c.regen_greedy
                else regen.GenerationSettings(max_new_tokens=c.regen_max_new_tokens, seed=c.seed))
    summary = regen.regenerate(target, p.tokenizer(), prompts_path, p.regen_path, settings=settings,
                               batch_size=c.regen_batch_size, target_path=str(p.model_dir("target")),
                               max_prompt_tokens=min(512, target.config.max_position_embeddings
                                                     - c.regen_max_new_tokens))
    log(f"regeneration: {summary}")
    records = [json.loads(x) for x in p.regen_path.read_text().splitlines() if x.strip()]
    records.sort(key=lambda r: r["id"])
    order = np.random.default_rng(c.seed).permutation(len(records))
    n_dev = max(8, len(records) // 10)
    for split, idx in (("train", order[n_dev:]), ("dev", order[:n_dev])):
        write_jsonl(p.regen_split(split), (records[i] for i in sorted(idx)))
