"""The embedded default's tokenizer: byte-level BPE trained on the demo corpus (:mod:`.corpus`).

No model hub is reachable, so the demo trains its own tokenizer.  The result is an ordinary
Hugging Face tokenizer directory (``AutoTokenizer.from_pretrained`` loads it) with Qwen3's chat
special tokens, ``<|MASK|>`` for the drafter, and a Qwen-style chat template that honours
``enable_thinking=False`` the way Qwen3's does (an empty think block).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|MASK|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK, THINK_OPEN, THINK_CLOSE)

# Qwen2/Qwen3's pre-tokenizer split: words with a leading space, single digits, punctuation runs,
# and whitespace runs kept whole (indentation in code becomes one token).
QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen3's template, reduced to what a tokenizer without tools needs: ChatML turns and, for a
# generation prompt with enable_thinking=False, the empty think block Qwen3 emits.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike,
                    min_frequency: int = 2) -> str:
    """Train a byte-level BPE on ``texts`` and save an HF tokenizer directory; returns ``out_dir``.

    ``vocab_size`` counts the 256 byte symbols and the special tokens; the special tokens get the
    first ids (``<|endoftext|>`` = 0, ..., ``<|MASK|>`` = 3) so every vocabulary size keeps them.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers, Regex
    from transformers import PreTrainedTokenizerFast

    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs >= {min_vocab} "
                         "(256 bytes + special tokens)")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = list(texts)
    if not texts:
        raise ValueError("train_tokenizer: no texts given")
    tok.train_from_iterator(texts, trainer=trainer)

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   unk_token=None, bos_token=None,
                                   additional_special_tokens=[IM_START, MASK])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 20
    out_dir = str(out_dir)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir
