"""Building blocks of the embedded-default pipeline (``train/pipeline.py``): real text in, chat rows out.

The demo target is a tiny Qwen3 pretrained here on Shakespeare and stdlib source.  So that the
benchmark's chat-formatted prompts (HumanEval, held-out plays) mean something to it, pretraining
rows are *continuation dialogues*: the user turn holds the first lines of a passage, the
assistant turn (after Qwen3's empty non-thinking block) continues it.  The target therefore
behaves like a small instruct model whose task is "continue this text".
"""

from __future__ import annotations

import random
from typing import Sequence

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
