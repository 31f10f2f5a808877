"""Training records read by index, not whole: file lists and globs, a cached index, random access.

A corpus of 1.4 M regenerated responses must not be read, tokenised and held by every training
process before its first step.  Instead each file gets an **index** built once and cached beside
it (``FILE.d3d-index.npz``; where that directory is not writable, under
``$XDG_CACHE_HOME/d3d_jax/data-index``): per non-blank line its byte offset and length, its line
number, and what a check of its fields found (tokenizer-free: lengths, the largest id, whether a
field is missing or broken).  From the index every process decides, without reading a record,
which records an epoch holds (:func:`select`), and then reads only the records its rows of each
global batch need (:class:`RecordReader`), lazily, in the data pipeline.

``.jsonl.gz`` cannot be read at an offset: DEFLATE has no random access, and Python's ``zlib``
cannot restore a decoder at a bit position (``zran``'s trick).  Building its index also writes
the decompressed lines, one record each, to an ArrayRecord file (``FILE.d3d-index.arrayrecord``,
zstd per record; grain's own random-access format), read by record number.  Why ArrayRecord and
not a decompressed copy: docs/results/data.md (size and read time measured side by side).

Index files are written to a temporary name and renamed, under a lock on the data file, so processes that
start together build each file once (each begins with a different file) and never read half an
index.  An index whose source file changed size or modification time is rebuilt.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from d3d_jax.errors import DataError, RecordError
from d3d_jax.io import records
from d3d_jax.io.files import check_regular

INDEX_VERSION = 1
SUFFIX = ".d3d-index"
# per-record check results stored in the index (independent of tokenizer and vocabulary)
OK, BROKEN = 0, 1  # BROKEN: the exact reason is found again by re-reading the record


def expand_paths(spec: str) -> list[Path]:
    """Files named by ``spec``: paths and globs separated by commas, each glob sorted.

    Every pattern must match a ``.jsonl`` or ``.jsonl.gz`` file; anything else is one error naming it."""
    files: list[Path] = []
    for part in [p.strip() for p in str(spec).split(",") if p.strip()]:
        matched = sorted(glob.glob(part, recursive=True)) if glob.has_magic(part) else [part]
        matched = [m for m in matched if not m.endswith((SUFFIX + ".npz", SUFFIX + ".arrayrecord"))]
        if not matched:
            raise DataError(f"{part}: no file matches")
        for m in matched:
            if str(m).endswith(".parquet"):
                raise DataError(f"{m}: parquet is not read (pyarrow is not a dependency); convert it to "
                                f".jsonl.gz with one record a line")
            if not records.is_jsonl(m):
                raise DataError(f"{m}: training records must be .jsonl or .jsonl.gz files")
            # a missing path is the command's usage error; a FIFO or directory is refused by name
            files.append(check_regular(m, "a data file", DataError))
    if not files:
        raise DataError(f"{spec!r}: names no file")
    return files


# --------------------------------------------------------------------------------------
# One file's index
# --------------------------------------------------------------------------------------
def _cache_base(path: Path) -> Path:
    """Where ``path``'s index lives: beside it, or in the user's cache when that is read-only."""
    if os.access(path.parent, os.W_OK):
        return path.parent / (path.name + SUFFIX)
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "d3d_jax" / "data-index"
    root.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    return root / f"{digest}-{path.name}{SUFFIX}"


def _stamp(path: Path) -> np.ndarray:
    st = path.stat()
    return np.asarray([INDEX_VERSION, st.st_size, st.st_mtime_ns], np.int64)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the data file itself (read-only data can be locked; no lock file is left)."""
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _summary(raw: bytes) -> tuple[int, int, int, int]:
    """``(status, largest id, prompt length or -1, response length)`` of one line, no tokenizer."""
    try:
        rec = records.training_record(records.decode_line(raw), None, need_messages=False)
        if rec.messages is not None:
            records.chat_messages(rec.messages)
    except RecordError:
        return BROKEN, -1, -1, -1
    ids = [a for a in (rec.prompt, rec.response) if a is not None and len(a)]
    largest = max(int(a.max()) for a in ids) if ids else -1
    return OK, largest, -1 if rec.prompt is None else len(rec.prompt), len(rec.response)


def _plain_lines(path: Path) -> Iterator[tuple[int, int, int, bytes]]:
    """``(offset, length, line, raw)`` of each non-blank line (a leading BOM is not part of line 1)."""
    offset = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if line_no == 1 and raw.startswith(records.UTF8_BOM):
                raw, start = raw[len(records.UTF8_BOM):], start + len(records.UTF8_BOM)
            if raw.strip():
                yield start, len(raw), line_no, raw


def _build(path: Path, base: Path) -> None:
    rows = []
    if str(path).endswith(".gz"):
        from array_record.python.array_record_module import ArrayRecordWriter

        tmp_ar = str(base) + f".arrayrecord.tmp{os.getpid()}"
        writer = ArrayRecordWriter(tmp_ar, "group_size:1")
        for k, (line_no, raw) in enumerate(records.jsonl_lines(path)):
            writer.write(raw)
            rows.append((k, len(raw), line_no, *_summary(raw)))
        writer.close()
        os.replace(tmp_ar, str(base) + ".arrayrecord")
    else:
        rows = [(off, n, line, *_summary(raw)) for off, n, line, raw in _plain_lines(path)]
    cols = np.asarray(rows, np.int64).reshape(-1, 7).T
    tmp = str(base) + f".tmp{os.getpid()}.npz"
    np.savez(tmp, stamp=_stamp(path), offset=cols[0], nbytes=cols[1].astype(np.int32),
             line=cols[2].astype(np.int32), status=cols[3].astype(np.int8), max_id=cols[4],
             prompt_len=cols[5].astype(np.int32), response_len=cols[6].astype(np.int32))
    os.replace(tmp, str(base) + ".npz")


def _fresh(path: Path, base: Path) -> dict | None:
    try:
        with np.load(str(base) + ".npz") as z:
            if not np.array_equal(z["stamp"], _stamp(path)):
                return None
            if str(path).endswith(".gz") and not Path(str(base) + ".arrayrecord").is_file():
                return None
            return {k: z[k] for k in z.files if k != "stamp"}
    except (OSError, ValueError, KeyError):
        return None


def file_index(path: Path) -> dict:
    """``path``'s index arrays, built (once, under a lock) when missing or stale."""
    base = _cache_base(path)
    index = _fresh(path, base)
    if index is None:
        with _locked(path):
            index = _fresh(path, base)  # another process may have built it while this one waited
            if index is None:
                _build(path, base)
                index = _fresh(path, base)
    return index


# --------------------------------------------------------------------------------------
# The corpus: every file's index joined, and random access to its records
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class CorpusIndex:
    files: list[Path]
    file: np.ndarray  # int16 [records]: which file
    offset: np.ndarray  # int64: byte offset (.jsonl) or record number in the ArrayRecord (.jsonl.gz)
    nbytes: np.ndarray  # int32
    line: np.ndarray  # int32: the line in its file
    status: np.ndarray  # int8: OK or BROKEN
    max_id: np.ndarray  # int64: -1 when the record has no ids
    prompt_len: np.ndarray  # int32: -1 when the prompt is rendered from messages
    response_len: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.line)


def corpus_index(spec: str, start: int = 0) -> CorpusIndex:
    """The joined index of ``spec``'s files; ``start`` (the process index) rotates the order in
    which missing indexes are built, so processes starting together build different files."""
    files = expand_paths(spec)
    order = [(start + j) % len(files) for j in range(len(files))]
    built = {i: file_index(files[i]) for i in order}
    parts = [built[i] for i in range(len(files))]
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    which = np.concatenate([np.full(len(p["line"]), i, np.int16) for i, p in enumerate(parts)])
    return CorpusIndex(files, which, **cat)


class RecordReader:
    """The raw bytes of chosen records, by the index; picklable (a grain worker opens its own files)."""

    def __init__(self, index: CorpusIndex, chosen: np.ndarray):
        self.files = [str(f) for f in index.files]
        self.bases = [str(_cache_base(f)) for f in index.files]
        self.file = index.file[chosen]
        self.offset = index.offset[chosen]
        self.nbytes = index.nbytes[chosen]
        self.line = index.line[chosen]
        self._open: dict = {}

    def __len__(self) -> int:
        return len(self.line)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}

    def where(self, k: int) -> str:
        return f"{self.files[self.file[k]]}:{self.line[k]}"

    def read(self, k: int) -> bytes:
        f = int(self.file[k])
        handle = self._open.get(f)
        if handle is None:
            if self.files[f].endswith(".gz"):
                from array_record.python.array_record_module import ArrayRecordReader

                handle = ArrayRecordReader(self.bases[f] + ".arrayrecord", "readahead_buffer_size:0")
            else:
                handle = os.open(self.files[f], os.O_RDONLY)
            self._open[f] = handle
        if isinstance(handle, int):
            return os.pread(handle, int(self.nbytes[k]), int(self.offset[k]))
        return handle.read([int(self.offset[k])])[0]


# --------------------------------------------------------------------------------------
# Which records an epoch holds, and their examples read on demand
# --------------------------------------------------------------------------------------
def select(index: CorpusIndex, cfg, vocab_size: int | None, has_tokenizer: bool, stats, example_of, name: str):
    """Record numbers an epoch holds, as reading every line decides them, from the index: only
    the records it cannot clear (broken, an id outside ``vocab_size``, empty, a prompt of
    ``clean_length`` or more, messages without a tokenizer) are read again, through
    ``example_of(raw, line)`` (the loader's own check: an example, ``None`` or
    :class:`RecordError`), for their exact counts and reasons in ``stats`` (a ``DataStats``).
    Prompts rendered from ``messages`` are measured when their rows are read."""
    stats.lines = len(index)
    limit = records.INT32_LIMIT if vocab_size is None else min(int(vocab_size), records.INT32_LIMIT)
    p, r, clean = index.prompt_len.astype(np.int64), index.response_len.astype(np.int64), cfg.clean_length
    suspect = ((index.status != OK) | (index.max_id >= limit) | (r == 0) | (p >= clean)
               | ((p < 0) & (not has_tokenizer)))
    clear = ~suspect
    counted = clear & (p >= 0)
    stats.truncated = int(np.sum(counted & (p + r > clean)))
    length = np.minimum(p + r, clean)
    first = np.maximum(p - 1, 0) if cfg.first_block_anchor else p  # data.first_anchor, vectorised
    stats.without_anchor = int(np.sum(counted & (length - cfg.block_size < first)))
    again = np.flatnonzero(suspect)
    reader = RecordReader(index, again)
    for j, k in enumerate(again):
        try:
            ex = example_of(reader.read(j), int(index.line[k]))
        except RecordError as e:
            stats.skip(reader.where(j), e)
            continue
        if ex is not None:
            clear[k] = True
            lo = max(ex.response_start - 1, 0) if cfg.first_block_anchor else ex.response_start
            stats.without_anchor += int(len(ex.tokens) - cfg.block_size < lo)
    chosen = np.flatnonzero(clear)
    stats.kept = len(chosen)
    stats.log(name)
    stats.check(name, cfg.max_skipped_fraction)
    if not len(chosen):
        raise DataError(f"{name}: no usable records ({stats.lines} lines, {stats.invalid} invalid, "
                        f"{stats.empty_response} with an empty response)")
    return chosen
