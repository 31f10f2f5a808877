"""Regeneration throughput: tokens/s of the full regeneration path at several batch sizes.

Each batch size runs :func:`d3d_jax.training.regenerate.regenerate` twice on the same prompts
into fresh files: the first run compiles every shape, the second is timed (generation plus
record writing; prompt reading and rendering happen before the clock starts).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Sequence

from d3d_jax.training import regenerate as rg


def tiny_setup(workdir: str | Path, num_prompts: int = 32, model: str = "tiny", seed: int = 0):
    """A random-weight target from ``configs/models/<model>.yaml``, a tokenizer trained on the
    Shakespeare pretraining split, and ``num_prompts`` prompts from the held-out prompt plays."""
    import dataclasses

    from transformers import AutoTokenizer

    from d3d_jax.config import load_model_config
    from d3d_jax.io import tokenizer as tk
    from d3d_jax.model.qwen3 import init_model

    workdir = Path(workdir)
    cfg = load_model_config(model)
    tok_dir = tk.train_tokenizer(tk.load_corpus("pretrain", ("shakespeare",), max_chars=400_000),
                                 cfg.vocab_size, workdir / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    cfg = dataclasses.replace(cfg, eos_token_id=tokenizer.convert_tokens_to_ids(tk.IM_END))
    passages = [p for doc in tk.load_corpus("prompts", ("shakespeare",)) for p in tk.split_passages(doc, 200)]
    texts = [f"Continue this scene:\n{p}" for p in passages[:num_prompts]]
    if len(texts) < num_prompts:
        raise ValueError(f"only {len(texts)} prompt passages available, {num_prompts} requested")
    return init_model(cfg, seed), tokenizer, write_prompts(workdir / "prompts.jsonl", texts)


def write_prompts(path: str | Path, texts: Sequence[str]) -> Path:
    path = Path(path)
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": f"bench-{i}", "prompt": t}) + "\n")
    return path


def benchmark_regeneration(target, tokenizer, prompts_path: str | Path, *, batch_sizes: Sequence[int] = (1, 8),
                           settings: rg.GenerationSettings = rg.GenerationSettings(max_new_tokens=32),
                           workdir: str | Path | None = None) -> list[dict]:
    """``[{"batch_size", "records", "generated_tokens", "seconds", "tokens_per_s"}, ...]``."""
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for bs in batch_sizes:
            for attempt in ("warmup", "timed"):
                summary = rg.regenerate(target, tokenizer, prompts_path, Path(tmp) / f"b{bs}-{attempt}.jsonl",
                                        settings=settings, batch_size=bs, process_index=0, process_count=1,
                                        progress=False)
            rows.append({"batch_size": bs, "records": summary.written,
                         "generated_tokens": summary.generated_tokens, "seconds": summary.seconds,
                         "tokens_per_s": summary.tokens_per_s})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_first"] = r["tokens_per_s"] / base if base else float("nan")
    return rows


def format_table(rows: Sequence[dict]) -> str:
    head = f"{'batch':>5} {'records':>7} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'× batch ' + str(rows[0]['batch_size']):>10}"
    lines = [head] + [f"{r['batch_size']:>5} {r['records']:>7} {r['generated_tokens']:>7} {r['seconds']:>8.2f} "
                      f"{r['tokens_per_s']:>9.1f} {r['speedup_vs_first']:>10.2f}" for r in rows]
    return "\n".join(lines)
