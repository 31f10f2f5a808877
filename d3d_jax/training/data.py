"""Training data: packed block-diffusion rows (spec §2.1-2.3) and plain LM rows, with grain.

**Records** (the JSONL that ``train/regenerate_data.py`` writes, one object a line)::

    {"id", "messages": [{"role", "content"}...], "response", "response_token_ids",
     "finish_reason", "generation": {...}, "target": ...}

The prompt is rendered with the tokenizer's chat template (``add_generation_prompt=True``,
``enable_thinking=False``) unless the record already carries ``prompt_token_ids``; the response
ids are appended as they are.  Every record is checked once, here on the host, before packing
(:mod:`~d3d_jax.io.records`: UTF-8, JSON, field types, ``0 <= id < vocab_size``): a bad
one is skipped and counted with ``file:line`` and the reason; over-long ones are truncated and
counted (:class:`DataStats`).  More bad records than ``DataConfig.max_skipped_fraction`` stop the
run before its first step.  Each row carries ``record_line`` (the record's line in its file), so a
failing step can name the records of its batch.

**Packed row** (fixed length ``L = S + n·B``; ``S`` = ``DataConfig.clean_length``)::

    [ clean prompt+response tokens, padded to S | block_1 | ... | block_n ]

block ``b`` is ``[x[a_b], MASK×(B-1)]`` at positions ``a_b + 0..B-1``; anchors are drawn
without replacement from response positions ``p`` with ``p + B - 1 < len`` (full blocks only),
sorted (``DataConfig.first_block_anchor`` adds the last prompt token: :func:`first_anchor`).
A row is a dict of arrays (batched: a leading batch axis):

* ``tokens, positions, block_ids, context_end, valid`` – the model input and its
  :class:`~d3d_jax.model.masks.TokenMeta` (``batch_meta`` builds it);
* ``labels``  – the token each row position's logits should predict: ``x[i+1]`` for clean token
  ``i``, ``x[a_b + k]`` for slot ``k`` of block ``b``;
* ``ar_mask`` – clean positions whose label is a response token (the AR loss's support);
* ``slot``    – block slot index ``k`` (``-1`` for clean tokens, padding and unused anchors);
  the objective turns it into the weights ``w_k`` (slot 0 gets none);
* ``anchors, anchor_valid`` – ``[n]`` anchor positions and which are real;
* ``record_line`` – scalar: the record's line in its JSONL file (LM rows: the document's where
  the window starts); ``record_file`` (d3d rows): which of the data files.  Host-side
  bookkeeping; the train step never sees them.

LM rows (``mode="lm"``) are windows of one token stream, all causal: ``slot`` is all ``-1`` and
``ar_mask`` marks every real next token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import grain
import jax.numpy as jnp
import numpy as np

from d3d_jax.config import ConfigError, DataConfig
from d3d_jax.errors import DataError, RecordError
from d3d_jax.model.masks import CAUSAL, TokenMeta, packed_training_meta
from d3d_jax.io import records
from d3d_jax.io.files import read_bytes
from d3d_jax.training import data_index
from d3d_jax.io.chat import render_prompt  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

REQUIRED_FIELDS = ("response_token_ids",)
RECORD_LINE = "record_line"  # batch key: each row's source line (popped before the device step)
RECORD_FILE = "record_file"  # batch key: which data file that line is in (popped likewise)
RECORD_KEYS = (RECORD_LINE, RECORD_FILE)
MAX_LISTED = 20  # skipped records listed by file:line (all of them are counted)


@dataclasses.dataclass
class DataStats:
    """What happened to each input line (logged, and written into the run's metrics)."""

    lines: int = 0
    kept: int = 0
    broken_lines: int = 0  # not UTF-8, not JSON, not an object
    missing_fields: int = 0  # a field missing or of the wrong type
    bad_token_ids: int = 0  # an id that is not an int in [0, vocab_size)
    truncated: int = 0
    empty_response: int = 0
    without_anchor: int = 0  # kept (AR loss only) but too short for one full block
    skipped: list[str] = dataclasses.field(default_factory=list)  # "file:line: reason", first MAX_LISTED

    @property
    def invalid(self) -> int:
        """Records skipped as bad (what ``max_skipped_fraction`` bounds; empty ones are not bad)."""
        return self.broken_lines + self.missing_fields + self.bad_token_ids

    def skip(self, where: str, error: RecordError) -> None:
        setattr(self, error.kind, getattr(self, error.kind) + 1)
        if len(self.skipped) < MAX_LISTED:
            self.skipped.append(f"{where}: {error}")

    def check(self, source: str, limit: float) -> None:
        """Stop before training when more than ``limit`` of the records are invalid."""
        records.check_skipped_fraction(self.invalid, self.lines, limit, source, "data.max_skipped_fraction",
                                       self.skipped[0] if self.skipped else None)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "invalid": self.invalid}

    def log(self, name: str) -> None:
        log.info("data %s: %s", name, self.as_dict())


@dataclasses.dataclass
class Example:
    tokens: np.ndarray  # int32 [len], prompt then response
    response_start: int
    line: int = 0  # the record's line in its file
    file: int = 0  # which of the data files (data.train_path may name several)


# --------------------------------------------------------------------------------------
# Records -> token sequences
# --------------------------------------------------------------------------------------
def record_to_example(record: Any, tokenizer: Any, clean_length: int, stats: DataStats,
                      vocab_size: int | None = None, line: int = 0) -> Example | None:
    """The example of one record; :class:`RecordError` when it is invalid, ``None`` (counted in
    ``stats``) when it is valid but leaves nothing to train on."""
    rec = records.training_record(record, vocab_size, need_messages=tokenizer is None)
    prompt = rec.prompt
    if prompt is None:
        try:
            rendered = render_prompt(tokenizer, rec.messages)
        except Exception as e:  # a template may reject a message list: a bad record, not a crash
            raise RecordError(f"chat template failed: {str(e)[:120]}") from None
        prompt = records.token_ids(rendered, "prompt rendered by the tokenizer", vocab_size)
    response = rec.response
    if not len(response):
        stats.empty_response += 1
        return None
    tokens = np.concatenate([prompt, response]).astype(np.int32)
    if len(tokens) > clean_length:
        stats.truncated += 1
        tokens = tokens[:clean_length]
        if len(prompt) >= clean_length:  # nothing of the response survives
            stats.empty_response += 1
            return None
    return Example(tokens, len(prompt), line)


def load_examples(path: str | Path, tokenizer: Any, cfg: DataConfig,
                  vocab_size: int | None = None) -> tuple[list[Example], DataStats]:
    """Every usable record of a regenerated-response JSONL, checked, tokenised and truncated.

    Bad records are skipped and listed; more than ``cfg.max_skipped_fraction`` of them, or none
    usable, raise :class:`DataError`.
    """
    stats = DataStats()
    out = []
    for line_no, raw in records.jsonl_lines(path):
        stats.lines += 1
        try:
            ex = record_to_example(records.decode_line(raw), tokenizer, cfg.clean_length, stats, vocab_size,
                                   line_no)
        except RecordError as e:
            stats.skip(f"{path}:{line_no}", e)
            continue
        if ex is None:
            continue
        if len(ex.tokens) - cfg.block_size < first_anchor(ex, cfg):
            stats.without_anchor += 1
        out.append(ex)
    stats.kept = len(out)
    stats.log(str(path))
    stats.check(str(path), cfg.max_skipped_fraction)
    if not out:
        raise DataError(f"{path}: no usable records ({stats.lines} lines, {stats.invalid} invalid, "
                        f"{stats.empty_response} with an empty response)")
    return out, stats


class LazyExamples:
    """A grain source of the chosen records' examples (:mod:`~d3d_jax.training.data_index`), each
    read and tokenised when a row needs it.  A record whose rendered prompt fails or leaves no
    response (found only now) becomes a row with no loss, so that the global batches stay the same
    on any number of processes; it is logged."""

    def __init__(self, reader: data_index.RecordReader, tokenizer: Any, cfg: DataConfig, vocab_size: int | None):
        self.reader, self.tokenizer, self.cfg, self.vocab_size = reader, tokenizer, cfg, vocab_size

    def __len__(self) -> int:
        return len(self.reader)

    def example_of(self, raw: bytes, line: int, stats: DataStats | None = None) -> Example | None:
        return record_to_example(records.decode_line(raw), self.tokenizer, self.cfg.clean_length,
                                 stats or DataStats(), self.vocab_size, line)

    def __getitem__(self, k: int) -> Example:
        k, reader = int(k), self.reader
        try:
            ex = self.example_of(reader.read(k), int(reader.line[k]))
        except RecordError as e:
            log.warning("%s: %s; its row carries no loss", reader.where(k), e)
            ex = None
        if ex is None:
            ex = Example(np.asarray([self.cfg.pad_token_id], np.int32), 1, int(reader.line[k]))
        ex.file = int(reader.file[k])
        return ex


def indexed_examples(spec: str, tokenizer: Any, cfg: DataConfig, vocab_size: int | None = None,
                     start: int = 0) -> tuple[LazyExamples, DataStats]:
    """The records of the files ``spec`` names (:func:`~d3d_jax.training.data_index.expand_paths`)
    that reading every line would keep, with the same :class:`DataStats`; read on demand."""
    index = data_index.corpus_index(spec, start)
    stats, probe = DataStats(), LazyExamples(None, tokenizer, cfg, vocab_size)
    chosen = data_index.select(index, cfg, vocab_size, tokenizer is not None, stats,
                               lambda raw, line: probe.example_of(raw, line, stats), spec)
    return LazyExamples(data_index.RecordReader(index, chosen), tokenizer, cfg, vocab_size), stats


# --------------------------------------------------------------------------------------
# Anchors and packing
# --------------------------------------------------------------------------------------
def first_anchor(ex: Example, cfg: DataConfig) -> int:
    """The lowest anchor position: the first response token, or with ``cfg.first_block_anchor``
    the last prompt token (inference's first block: its slots are the response's first B-1 tokens)."""
    return max(ex.response_start - 1, 0) if cfg.first_block_anchor else ex.response_start


def sample_anchors(rng: np.random.Generator, response_start: int, length: int, num_anchors: int,
                   block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted anchors without replacement from ``response_start <= p <= length - block_size``.

    Returns ``(anchors [n], valid [n])``; when fewer positions are eligible the tail is unused.
    """
    hi = length - block_size  # last p with p + B - 1 < length
    eligible = max(0, hi - response_start + 1)
    k = min(num_anchors, eligible)
    anchors = np.zeros(num_anchors, np.int32)
    valid = np.zeros(num_anchors, bool)
    if k:
        anchors[:k] = np.sort(rng.choice(eligible, size=k, replace=False)) + response_start
        valid[:k] = True
    return anchors, valid


def pack_example(ex: Example, anchors: np.ndarray, anchor_valid: np.ndarray, cfg: DataConfig,
                 mask_token_id: int) -> dict[str, np.ndarray]:
    """One packed row ``[clean | blocks]`` with metadata, labels and loss supports."""
    S, B, n = cfg.clean_length, cfg.block_size, cfg.num_anchors
    L = cfg.packed_length
    x = ex.tokens
    length = len(x)
    meta = packed_training_meta(S, anchors, B, L, clean_valid_len=length, anchor_valid=anchor_valid)
    tokens = np.full(L, cfg.pad_token_id, np.int32)
    labels = np.full(L, cfg.pad_token_id, np.int32)
    ar_mask = np.zeros(L, bool)
    slot = np.full(L, -1, np.int32)
    tokens[:length] = x
    labels[:length - 1] = x[1:]
    ar_mask[max(ex.response_start - 1, 0):length - 1] = True
    k = np.arange(B)
    for b in np.flatnonzero(anchor_valid):
        a = int(anchors[b])
        sl = slice(S + b * B, S + (b + 1) * B)
        tokens[sl] = mask_token_id
        tokens[S + b * B] = x[a]
        labels[sl] = x[a + k]
        slot[sl] = k
    return dict(tokens=tokens, labels=labels, ar_mask=ar_mask, slot=slot,
                anchors=np.asarray(anchors, np.int32), anchor_valid=np.asarray(anchor_valid, bool), **meta)


def lm_row(window: np.ndarray, length: int, cfg: DataConfig) -> dict[str, np.ndarray]:
    """A causal row from ``window`` (``length`` real tokens, the last one only a label)."""
    L = cfg.packed_length
    tokens = np.full(L, cfg.pad_token_id, np.int32)
    labels = np.full(L, cfg.pad_token_id, np.int32)
    n = min(length, L + 1)
    tokens[:min(n, L)] = window[:min(n, L)]
    labels[:n - 1] = window[1:n]
    pos = np.arange(L, dtype=np.int32)
    valid = pos < min(n, L)
    return dict(tokens=tokens, labels=labels, ar_mask=pos < n - 1, slot=np.full(L, -1, np.int32),
                positions=pos, block_ids=np.full(L, CAUSAL, np.int32), context_end=pos + 1, valid=valid)


def batch_meta(batch: dict) -> TokenMeta:
    """The model's :class:`TokenMeta` from a (device) batch."""
    return TokenMeta(jnp.asarray(batch["positions"], jnp.int32), jnp.asarray(batch["block_ids"], jnp.int32),
                     jnp.asarray(batch["context_end"], jnp.int32), jnp.asarray(batch["valid"], bool))


# --------------------------------------------------------------------------------------
# LM token streams
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class LMStream:
    """Documents joined into one token stream; ``doc_starts``/``doc_lines`` map offsets to lines."""

    tokens: np.ndarray  # int32 [n]
    doc_starts: np.ndarray  # int64 [docs], ascending offsets into tokens
    doc_lines: np.ndarray  # int32 [docs], each document's line in its file

    def line_at(self, offset: int) -> int:
        return int(self.doc_lines[max(0, np.searchsorted(self.doc_starts, offset, side="right") - 1)])


def _lm_document(obj: Any, tokenizer: Any, vocab_size: int | None) -> np.ndarray:
    if not isinstance(obj, dict):
        raise RecordError(f"a document must be a JSON object, got {type(obj).__name__}", "broken_lines")
    if "token_ids" in obj:
        return records.token_ids(obj["token_ids"], "token_ids", vocab_size)
    if not isinstance(obj.get("text"), str):
        raise RecordError("needs 'token_ids' (a list of ids) or 'text' (a string)")
    if tokenizer is None:
        raise RecordError("'text' needs a tokenizer (set data.tokenizer)")
    return records.token_ids(list(tokenizer(obj["text"], add_special_tokens=False)["input_ids"]),
                             "text tokenised", vocab_size)


def load_lm_stream(path: str | Path, tokenizer: Any, eos_token_id: int | None, *, vocab_size: int | None = None,
                   max_skipped_fraction: float = 1.0) -> tuple[LMStream, DataStats]:
    """One token stream from a text file or a JSONL of ``{"text"}`` / ``{"token_ids"}`` documents."""
    stats = DataStats()
    path = Path(path)
    docs: list[np.ndarray] = []
    lines: list[int] = []
    if records.is_jsonl(path):
        for line_no, raw in records.jsonl_lines(path):
            stats.lines += 1
            try:
                docs.append(_lm_document(records.decode_line(raw), tokenizer, vocab_size))
                lines.append(line_no)
            except RecordError as e:
                stats.skip(f"{path}:{line_no}", e)
    else:
        if tokenizer is None:
            raise DataError(f"{path}: a tokenizer is needed to read plain text (set data.tokenizer)")
        stats.lines = 1
        try:
            text = read_bytes(path, "a data file", DataError).decode("utf-8-sig")  # a BOM is no text
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02X} at offset {e.start})") from None
        docs.append(np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32))
        lines.append(1)
    eos = [] if eos_token_id is None else [int(eos_token_id)]
    docs = [np.concatenate([d, np.asarray(eos, np.int32)]) for d in docs]
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]], dtype=np.int64)
    stream = LMStream(np.concatenate(docs).astype(np.int32) if docs else np.zeros(0, np.int32), starts,
                      np.asarray(lines, np.int32))
    stats.kept = len(docs)
    stats.log(str(path))
    stats.check(str(path), max_skipped_fraction)
    if len(stream.tokens) < 2:
        raise DataError(f"{path}: fewer than 2 tokens of LM data ({stats.lines} lines, {stats.invalid} invalid)")
    return stream, stats


class _LMWindows:
    """Random-access windows of ``L + 1`` tokens (stride ``L``) over a stream: a grain source."""

    def __init__(self, stream: LMStream, packed_length: int):
        self.stream, self.L = stream, packed_length
        self.n = max(1, (len(stream.tokens) - 1) // packed_length)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int, int]:
        w = self.stream.tokens[i * self.L: i * self.L + self.L + 1]
        return w, len(w), self.stream.line_at(i * self.L)


# --------------------------------------------------------------------------------------
# grain pipelines
# --------------------------------------------------------------------------------------
def batch_shard(rows: grain.MapDataset, batch_size: int, shard: tuple[int, int]) -> grain.MapDataset:
    """Process ``i`` of ``n``'s rows ``[i·b, (i+1)·b)`` (``b = batch_size / n``) of every global
    batch of ``batch_size`` consecutive rows.  Lazy: a process packs only its own rows.  The
    global batches, and the iterator state (the batch index), do not depend on ``n``, so a run
    on any number of processes sees the same data and resumes another's checkpoint."""
    i, n = shard
    if batch_size % n:
        raise ValueError(f"data.batch_size={batch_size} is not divisible by the {n} processes")
    return rows.batch(batch_size // n, drop_remainder=True)[i::n]


def d3d_dataset(examples: Sequence[Example], cfg: DataConfig, mask_token_id: int, *, seed: int | None = None,
                shuffle: bool | None = None, shard: tuple[int, int] = (0, 1)) -> grain.MapDataset:
    """Infinite (reshuffled each epoch), batched packed rows; anchors fixed by (seed, index)."""
    seed = cfg.seed if seed is None else seed
    ds = grain.MapDataset.source(examples if hasattr(examples, "__getitem__") else list(examples))
    if cfg.shuffle if shuffle is None else shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat()

    def pack(ex: Example, rng: np.random.Generator) -> dict:
        anchors, valid = sample_anchors(rng, first_anchor(ex, cfg), len(ex.tokens), cfg.num_anchors, cfg.block_size)
        return {**pack_example(ex, anchors, valid, cfg, mask_token_id), RECORD_LINE: np.int32(ex.line),
                RECORD_FILE: np.int32(ex.file)}

    return batch_shard(ds.random_map(pack, seed=seed + 1), cfg.batch_size, shard)


def lm_dataset(stream: LMStream | np.ndarray, cfg: DataConfig, *, seed: int | None = None,
               shuffle: bool | None = None, shard: tuple[int, int] = (0, 1)) -> grain.MapDataset:
    seed = cfg.seed if seed is None else seed
    if not isinstance(stream, LMStream):
        stream = LMStream(np.asarray(stream, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int32))
    ds = grain.MapDataset.source(_LMWindows(stream, cfg.packed_length))
    if cfg.shuffle if shuffle is None else shuffle:
        ds = ds.shuffle(seed=seed)
    rows = ds.repeat().map(lambda w: {**lm_row(w[0], w[1], cfg), RECORD_LINE: np.int32(w[2])})
    return batch_shard(rows, cfg.batch_size, shard)


def load_tokenizer_for(cfg: DataConfig, vocab_size: int | None = None) -> Any:
    """``data.tokenizer`` (None when unset), checked to exist and to fit ``vocab_size``."""
    if not cfg.tokenizer:
        return None
    from d3d_jax.io.hf import open_tokenizer

    return open_tokenizer(cfg.tokenizer, vocab_size=vocab_size, hint=" (data.tokenizer)")


def resolve_mask_token_id(cfg: DataConfig, model_mask_id: int | None, tokenizer: Any) -> int:
    for cand in (cfg.mask_token_id, model_mask_id):
        if cand is not None:
            return int(cand)
    if tokenizer is not None:
        mid = tokenizer.convert_tokens_to_ids("<|MASK|>")
        if mid is not None and mid != tokenizer.unk_token_id:
            return int(mid)
    raise ConfigError("data.mask_token_id: not set, and neither the model config nor the tokenizer "
                      "defines <|MASK|>")


def build_dataset(cfg: DataConfig, path: str, *, tokenizer: Any = None, mask_token_id: int | None = None,
                  eos_token_id: int | None = None, seed: int | None = None, shuffle: bool | None = None,
                  shard: tuple[int, int] = (0, 1), vocab_size: int | None = None
                  ) -> tuple[grain.MapDataset, DataStats]:
    """The batched dataset for ``path`` in ``cfg.mode``; ``shard=(i, n)``: process ``i`` of ``n``'s
    rows of every global batch of ``cfg.batch_size`` rows (:func:`batch_shard`).  ``d3d`` records
    are read by a cached index (``path``: files and globs, :mod:`~d3d_jax.training.data_index`),
    each process reading and tokenising only its rows' records, when they are packed.
    ``vocab_size``: the model's; a record with an id outside it is skipped (None: int32 range)."""
    if not path:
        raise ConfigError("data path is empty (set data.train_path / data.dev_path)")
    if cfg.mode == "lm":
        stream, stats = load_lm_stream(path, tokenizer, eos_token_id, vocab_size=vocab_size,
                                       max_skipped_fraction=cfg.max_skipped_fraction)
        return lm_dataset(stream, cfg, seed=seed, shuffle=shuffle, shard=shard), stats
    if mask_token_id is None:
        raise ConfigError("data.mask_token_id: required for mode 'd3d'")
    examples, stats = indexed_examples(path, tokenizer, cfg, vocab_size, start=shard[0])
    return d3d_dataset(examples, cfg, mask_token_id, seed=seed, shuffle=shuffle, shard=shard), stats


def iterate(ds: grain.MapDataset, worker_count: int = 0) -> grain.DatasetIterator:
    """The training iterator (its state is the checkpointed data position); ``worker_count``
    processes read, tokenise and pack the rows (a resume needs the same count)."""
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
    if worker_count:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags, parsed only under absl.app
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return it.__iter__()


def take_batches(ds: grain.MapDataset, n: int) -> list[dict]:
    """The first ``n`` batches (a fixed dev set)."""
    return [ds[i] for i in range(n)]


def synthetic_records(num: int, *, vocab_size: int, prompt_len: int = 4, response_len: int = 48,
                      first_token: int = 4, seed: int = 0) -> list[dict]:
    """A deterministic toy corpus in the regenerated-response format, for tests and benchmarks.

    Each response counts upwards modulo the usable vocabulary from a start the prompt names
    (``x[i+1] = x[i] + 1``), so the token ``k`` places after an anchor is a fixed function of the
    anchor: a drafter can learn all 15 slots, an untrained one gets none.
    """
    rng = np.random.default_rng(seed)
    span = vocab_size - first_token
    out = []
    for i in range(num):
        start = int(rng.integers(span))
        prompt = [first_token + int(t) for t in rng.integers(span, size=prompt_len - 1)] + [first_token + start]
        resp = [first_token + (start + 1 + j) % span for j in range(response_len)]
        out.append({"id": f"synthetic-{i}", "messages": [{"role": "user", "content": "count"}],
                    "prompt_token_ids": prompt, "response_token_ids": resp, "response": "",
                    "finish_reason": "length"})
    return out


def write_jsonl(path: str | Path, records: Sequence[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path
