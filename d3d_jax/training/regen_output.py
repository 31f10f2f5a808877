"""The regeneration output file: resume, whole-record appends, damaged records set aside, and
the merge of per-process shard files (:mod:`d3d_jax.training.regenerate` writes it).

Resuming trusts only records that could have been written by a run: a line whose
``response_token_ids`` is ``"oops"`` or ``[1.5, ...]`` (an edit, a bad disk, another tool) is not
done.  :func:`set_aside` moves such lines out of the file, into ``<out>.invalid`` for a
post-mortem, so the prompt is regenerated and its id still occurs once.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from d3d_jax.errors import DataError, RecordError, UsageError
from d3d_jax.io import records as rec_lib
from d3d_jax.io.chat import read_prompts

RESUME_FIELDS = ("id", "generation", "target")
INVALID_SUFFIX = ".invalid"



def shard_output_path(out: str | os.PathLike, process_index: int, process_count: int) -> Path:
    out = Path(out)
    if process_count == 1:
        return out
    return out.with_name(f"{out.stem}-{process_index:05d}-of-{process_count:05d}{out.suffix}")


def _end_of_last_line(f, size: int, chunk: int = 1 << 20) -> int:
    """Offset just past the file's last newline (0 if none), reading backwards from the end."""
    pos = size
    while pos > 0:
        start = max(0, pos - chunk)
        f.seek(start)
        i = f.read(pos - start).rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def record_problem(rec: dict, vocab_size: int | None) -> str | None:
    """Why a record with an id cannot count as done (``None``: it can)."""
    try:
        rec_lib.token_ids(rec.get("response_token_ids"), "response_token_ids", vocab_size)
        if not len(rec_lib.token_ids(rec.get("prompt_token_ids"), "prompt_token_ids", vocab_size)):
            return "'prompt_token_ids' is empty"
    except RecordError as e:
        return str(e)
    for key in ("generation", "target"):
        if not isinstance(rec.get(key), dict):
            return f"'{key}' must be an object, got {type(rec.get(key)).__name__}"
    if not isinstance(rec.get("finish_reason"), str):
        return f"'finish_reason' must be a string, got {rec.get('finish_reason')!r}"
    return None


def recover_output(path: str | os.PathLike, vocab_size: int | None = None) -> list[dict]:
    """``id``/``generation``/``target`` of every record already in ``path``, plus its ``line`` and
    its ``problem`` (:func:`record_problem`, ``None`` for a usable one).  Streamed: the file may hold
    millions.  A trailing partial line (a crash mid-write) is truncated away; any other line that
    is not a JSON object with an id is an error, not something to delete silently."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        end = _end_of_last_line(f, size)
        if end != size:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    records = []
    for line_no, raw in rec_lib.jsonl_lines(path):
        try:
            rec = rec_lib.decode_line(raw)
        except RecordError as e:
            raise DataError(f"{path}:{line_no}: not a JSON record ({e}); fix or move the file") from None
        if not isinstance(rec, dict) or "id" not in rec:
            raise DataError(f"{path}:{line_no}: not a regeneration record (no 'id')")
        records.append({**{k: rec.get(k) for k in RESUME_FIELDS}, "line": line_no,
                        "problem": record_problem(rec, vocab_size)})
    return records


def set_aside(path: str | os.PathLike, lines: Iterable[int]) -> Path:
    """Rewrite ``path`` without ``lines`` (renamed into place: a crash leaves the old file); the
    removed lines are appended to ``<path>.invalid``.  Returns that file."""
    path, drop = Path(path), set(lines)
    aside = path.with_name(path.name + INVALID_SUFFIX)
    with _replacing(path, ".rewrite") as tmp, open(path, "rb") as src, open(tmp, "wb") as keep, \
            open(aside, "ab") as bad:
        for line_no, raw in enumerate(src, 1):
            (bad if line_no in drop else keep).write(raw)
        for f in (keep, bad):
            f.flush()
            os.fsync(f.fileno())
    return aside


@contextlib.contextmanager
def _replacing(path: Path, suffix: str) -> Iterator[Path]:
    """A file beside ``path`` to write; renamed over ``path`` on success, removed on failure."""
    tmp = path.with_name(path.name + suffix)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def check_compatible(records: Iterable[dict], generation: dict, target: dict, path: Path) -> None:
    """Refuse to append to a file written with other sampling settings or another target."""
    for rec in records:
        if rec.get("generation") != generation:
            raise UsageError(f"{path}: record {rec['id']!r} was generated with {rec.get('generation')}, "
                             f"this run uses {generation}; use another --out")
        keys = ("config_sha256", "weights_sha256")
        old = {k: (rec.get("target") or {}).get(k) for k in keys}
        if old != {k: target.get(k) for k in keys}:
            raise UsageError(f"{path}: record {rec['id']!r} came from target {rec.get('target')}, "
                             f"this run uses {target}; use another --out")


def append_records(f, records: Sequence[dict]) -> None:
    """Append whole lines, then flush and fsync: after a crash each record is there or not."""
    if not records:
        return
    f.write(b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in records))
    f.flush()
    os.fsync(f.fileno())


def merge_shards(out_path: str | os.PathLike, process_count: int,
                 prompts_path: str | os.PathLike | None = None) -> dict:
    """Concatenate the per-process files into ``out_path`` (the one file training reads).

    Shard files are only read (a torn last line is left out, not cut); every id must occur once
    across them.  The merged file is written beside the target and renamed into place.  With
    ``prompts_path``, ``missing`` lists the usable prompt ids that have no record (not generated
    yet, or skipped as too long).
    """
    if process_count < 2:
        raise UsageError(f"process_count must be >= 2 to merge shard files, got {process_count}")
    out = Path(out_path)
    seen: dict[str, Path] = {}
    with _replacing(out, ".merging") as tmp, open(tmp, "wb") as f:
        for i in range(process_count):
            part = shard_output_path(out, i, process_count)
            if not part.exists():
                raise DataError(f"{part}: missing (process {i} of {process_count} wrote nothing)")
            with open(part, "rb") as src:  # streamed: a shard may hold millions of records
                for line_no, raw in enumerate(src, 1):
                    if not raw.endswith(b"\n"):
                        break  # torn tail of a still-running or crashed process: not a record
                    if not raw.strip():
                        continue
                    try:
                        pid = rec_lib.decode_line(raw)["id"]
                    except (RecordError, KeyError, TypeError) as e:
                        raise DataError(f"{part}:{line_no}: not a regeneration record ({e})") from None
                    if pid in seen:
                        raise DataError(f"{part}:{line_no}: id {pid!r} is also in {seen[pid]}")
                    seen[pid] = part
                    f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    missing = []
    if prompts_path is not None:
        missing = [p.id for p in read_prompts(prompts_path)[0] if p.id not in seen]
    return {"output": str(out), "records": len(seen), "missing": missing}
