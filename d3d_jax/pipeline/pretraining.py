"""Stages 1-3: the tokenizer, then the target and the small model pretrained with the training
loop's LM objective on *continuation dialogues* of the demo corpus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from d3d_jax.io.chat import chat_prompt_ids
from d3d_jax import config as C
from d3d_jax import demo
from d3d_jax.demo import corpus
from d3d_jax.demo import tokenizer as tok_lib
from d3d_jax.pipeline import runs
from d3d_jax.pipeline.common import log, write_json
from d3d_jax.pipeline.context import Context


def train_tokenizer(p: Context) -> None:
    docs = corpus.load_corpus("pretrain", max_chars=p.cfg.tokenizer_chars)
    tok_lib.train_tokenizer(docs, p.cfg.vocab_size, p.tokenizer_dir)


def pretrain_pairs(cfg: C.PipelineConfig) -> list[dict]:
    """The pretraining dialogues (``{"source", "prompt", "response"}``) of the pretrain split."""
    return demo.continuation_pairs("pretrain", passage_chars=cfg.passage_chars, seed=cfg.seed,
                                   max_chars=cfg.pretrain_chars)


def pretrain_data(p: Context) -> Path:
    """The tokenised pretraining corpus (``work_dir/data/pretrain.jsonl``), written once."""
    path = p.work / "data" / "pretrain.jsonl"
    if path.exists():
        return path
    pairs = pretrain_pairs(p.cfg)
    tok = p.tokenizer()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for pair in pairs:
            ids = chat_prompt_ids(tok, [{"role": "user", "content": pair["prompt"]}])
            ids += tok(pair["response"])["input_ids"]  # the LM loader appends <|im_end|>
            f.write(json.dumps({"token_ids": ids}) + "\n")
    tmp.replace(path)
    log(f"pretraining corpus: {len(pairs)} continuation dialogues -> {path}")
    return path


def pretrain(p: Context, name: str, stage: C.PretrainStageConfig) -> None:
    data = C.DataConfig(mode="lm", train_path=str(pretrain_data(p)), packed_length=stage.seq_len,
                        batch_size=stage.batch_size, seed=stage.seed, dev_batches=0,
                        pad_token_id=p.special_ids()["pad"])
    optim = C.OptimConfig(name="adamw", learning_rate=stage.learning_rate,
                          final_learning_rate=stage.learning_rate * 0.1, warmup_steps=stage.warmup_steps,
                          weight_decay=0.01)
    hf_dir, losses = runs.train_run(p, f"pretrain_{name}", p.model_config(stage.model), data,
                                    C.ObjectiveConfig(kind="lm"), optim, stage.steps, seed=stage.seed)
    dest = p.model_dir(name)
    shutil.copytree(hf_dir, dest, dirs_exist_ok=True)
    if name == "target":
        runs.store_compact(dest)  # shipped in bfloat16, run in float32 (Context.load)
        for f in p.tokenizer_dir.iterdir():  # beside the weights: every command takes the model dir alone
            if f.is_file():
                shutil.copy2(f, dest / f.name)
    write_json({"steps": stage.steps, "final_loss": losses[-1] if losses else None,
                "loss_every_25": losses[::25]}, dest / "pretrain_log.json")
