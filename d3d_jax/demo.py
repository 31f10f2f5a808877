"""Building blocks of the embedded-default pipeline (``train/pipeline.py``): real text in, chat rows out.

The demo target is a tiny Qwen3 pretrained here on Shakespeare and stdlib source.  So that the
benchmark's chat-formatted prompts (HumanEval, held-out plays) mean something to it, pretraining
rows are *continuation dialogues*: the user turn holds the first lines of a passage, the
assistant turn (after Qwen3's empty non-thinking block) continues it.  The target therefore
behaves like a small instruct model whose task is "continue this text".
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from d3d_jax.io import tokenizer as corpus

HEAD_FRACTION = 0.35  # share of a passage's lines that goes into the user turn


def continuation_pairs(split: str, passage_chars: int = 700, max_pairs: int | None = None,
                       sources: Sequence[str] = ("shakespeare", "python"), seed: int = 0,
                       max_chars: int | None = None) -> list[dict]:
    """``{"source", "prompt", "response"}`` pairs cut from the corpus split, shuffled with ``seed``."""
    pairs = []
    for src in sources:
        for doc in corpus.load_corpus(split, sources=(src,), max_chars=max_chars):
            for passage in corpus.split_passages(doc, passage_chars):
                lines = passage.splitlines(keepends=True)
                if len(lines) < 3:
                    continue
                cut = max(1, int(len(lines) * HEAD_FRACTION))
                head, tail = "".join(lines[:cut]), "".join(lines[cut:])
                if head.strip() and tail.strip():
                    pairs.append({"source": src, "prompt": head, "response": tail})
    random.Random(seed).shuffle(pairs)
    return pairs[:max_pairs] if max_pairs else pairs


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` + the assistant header in non-thinking mode (Qwen3's template)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        enable_thinking=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def pretraining_rows(tokenizer, pairs: Sequence[dict], seq_len: int) -> np.ndarray:
    """Chat-rendered pairs concatenated into one stream and cut into ``[N, seq_len + 1]`` rows."""
    eos = tokenizer.convert_tokens_to_ids(corpus.IM_END)
    stream: list[int] = []
    for p in pairs:
        stream += chat_prompt_ids(tokenizer, [{"role": "user", "content": p["prompt"]}])
        stream += tokenizer(p["response"])["input_ids"] + [eos]
    n = len(stream) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"pretraining_rows: corpus of {len(stream)} tokens is shorter than one row")
    return np.asarray(stream[: n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)


# --------------------------------------------------------------------------------------------
# Plain LM pretraining (AR objective only).
# --------------------------------------------------------------------------------------------
def _lm_loss(model, rows):
    logits = model(rows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()


@nnx.jit(donate_argnums=(0, 1))
def _lm_step(model, optimizer, rows):
    loss, grads = nnx.value_and_grad(_lm_loss)(model, rows)
    optimizer.update(model, grads)
    return loss


def pretrain_lm(model, rows: np.ndarray, *, steps: int, batch_size: int, lr: float,
                warmup: int = 20, seed: int = 0, log_every: int = 25, time_budget_s: float | None = None,
                log_path: str | None = None) -> list[float]:
    """Next-token pretraining of ``model`` in place (AdamW, warm-up + cosine); returns the losses."""
    from tqdm import tqdm

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    losses = []
    t0 = time.time()
    log = open(log_path, "a") if log_path else None
    bar = tqdm(range(steps), desc="pretrain", mininterval=5)
    for step in bar:
        idx = rng.integers(0, len(rows), batch_size)
        loss = float(_lm_step(model, optimizer, jnp.asarray(rows[idx])))
        losses.append(loss)
        if step % log_every == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{loss:.3f}")
            if log:
                log.write(json.dumps({"step": step, "loss": loss, "elapsed_s": time.time() - t0}) + "\n")
                log.flush()
        if time_budget_s and time.time() - t0 > time_budget_s:
            break
    if log:
        log.close()
    return losses


def mean_ce(model, rows: np.ndarray, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy over ``rows`` (held-out perplexity = exp of it)."""
    fn = nnx.jit(_lm_loss)
    vals = [float(fn(model, jnp.asarray(rows[i:i + batch_size])))
            for i in range(0, len(rows) - batch_size + 1, batch_size)]
    return float(np.mean(vals)) if vals else math.nan
