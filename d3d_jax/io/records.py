"""What comes in is checked once, on the host, before any work: records, prompt lines, limits.

One place decides whether an input line is usable, for training data (:mod:`~d3d_jax.training.data`),
regeneration (:mod:`~d3d_jax.training.regenerate`, :mod:`~d3d_jax.io.chat`), evaluation and
``infer/generate.py`` prompt files.  It lives in ``io/``, not ``training/``, so that serving and
the decoding commands can stand on it without standing on training:

* :func:`jsonl_lines` / :func:`decode_line` – a JSONL file as ``(line number, object)``; a line
  that is not UTF-8 or not JSON is a :class:`RecordError`, never an exception from the decoder;
* :func:`token_ids` – a list of Python ints (not bools, floats or strings) with
  ``0 <= id < vocab_size`` (int32 range when the vocabulary is unknown);
* :func:`training_record` – the fields of one regenerated-response record, types and ids checked;
* :func:`check_skipped_fraction` – a run whose bad records exceed its threshold stops before the
  first step, in one sentence naming the first bad record;
* :func:`check_context` – prompt + ``max_new_tokens`` must fit ``max_position_embeddings``.

A bad record raises :class:`RecordError`, whose ``kind`` (``broken_lines``, ``missing_fields`` or
``bad_token_ids``) is the :class:`~d3d_jax.training.data.DataStats` counter it is counted in; the
caller skips it and logs ``file:line: reason``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from typing import Any, Iterator, Sequence

import numpy as np

from d3d_jax.config.limits import dotted, json_loads, long_number
from d3d_jax.errors import DataError, RecordError, UsageError
from d3d_jax.io.files import open_regular

INT32_LIMIT = 2 ** 31  # ids travel as int32: without a known vocabulary this is the bound


# --------------------------------------------------------------------------------------
# Lines
# --------------------------------------------------------------------------------------
def decode_line(raw: bytes) -> Any:
    """One JSONL line as a Python object; bytes that are not UTF-8 JSON raise :class:`RecordError`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(f"not valid JSON (byte 0x{raw[e.start]:02X} at column {e.start + 1} is not UTF-8)",
                          "broken_lines") from None
    try:
        value = json_loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise RecordError(f"not valid JSON ({e.msg} at column {e.colno})", "broken_lines") from None
    except (ValueError, RecursionError) as e:  # nesting too deep
        raise RecordError(f"not valid JSON ({type(e).__name__}: {str(e)[:80]})", "broken_lines") from None
    found = long_number(value)
    if found is not None:  # never converted: Python refuses past 4,300 digits, slowly before that
        raise RecordError(f"'{dotted(found[0])}' is {found[1].problem()}", "broken_lines")
    return value


UTF8_BOM = b"\xef\xbb\xbf"


def is_jsonl(path: str | os.PathLike) -> bool:
    """A JSONL file, plain (``.jsonl``) or gzip-compressed (``.jsonl.gz``)."""
    return str(path).endswith((".jsonl", ".jsonl.gz"))


def jsonl_lines(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, raw bytes)`` of every non-blank line, streamed; a ``.gz`` file is
    read through gzip.  A UTF-8 byte-order mark at the start of the file (Windows editors write
    one) is not part of the first record."""
    with open_regular(path, "a data file", DataError) as raw_file, (
            gzip.open(raw_file, "rb") if str(path).endswith(".gz") else raw_file) as f:
        for line_no, raw in enumerate(f, 1):
            if line_no == 1 and raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM):]
            if raw.strip():
                yield line_no, raw


# --------------------------------------------------------------------------------------
# Fields
# --------------------------------------------------------------------------------------
def token_ids(value: Any, field: str, vocab_size: int | None = None) -> np.ndarray:
    """``value`` as int32 ids, or :class:`RecordError` naming the field and the first bad entry."""
    if not isinstance(value, list):
        raise RecordError(f"'{field}' must be a list of token ids, got {type(value).__name__}")
    limit = INT32_LIMIT if vocab_size is None else min(int(vocab_size), INT32_LIMIT)
    if not value:
        return np.zeros(0, np.int32)
    if set(map(type, value)) == {int}:  # the common case, checked without a Python loop
        arr = np.asarray(value)  # object dtype when an id exceeds int64
        if arr.dtype.kind == "i" and arr.min() >= 0 and arr.max() < limit:
            return arr.astype(np.int32)
    for i, t in enumerate(value):
        if type(t) is not int:
            raise RecordError(f"'{field}'[{i}] is {_short(t)}, not an integer token id", "bad_token_ids")
        if not 0 <= t < limit:
            what = "the vocabulary" if vocab_size is not None else "the int32 range"
            raise RecordError(f"'{field}'[{i}] = {_short(t)} is outside {what} [0, {limit})", "bad_token_ids")
    raise AssertionError("unreachable: the fast path accepts every valid list")


def _short(value: Any, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "…"


def chat_messages(value: Any, field: str = "messages") -> list[dict]:
    """A non-empty list of ``{"role": str, "content": str}`` (what a chat template renders)."""
    if not isinstance(value, list) or not value:
        raise RecordError(f"'{field}' must be a non-empty list of messages")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise RecordError(f"'{field}'[{i}] must be an object with string 'role' and 'content'")
    return value


@dataclasses.dataclass
class TrainingRecord:
    """The checked fields of one regenerated-response record (``prompt`` None: render ``messages``)."""

    response: np.ndarray
    prompt: np.ndarray | None
    messages: list[dict] | None


def training_record(obj: Any, vocab_size: int | None, *, need_messages: bool) -> TrainingRecord:
    """Check one record: an object with ``response_token_ids`` and ``prompt_token_ids`` or ``messages``.

    ``need_messages``: no tokenizer is there to render messages, so ``prompt_token_ids`` is required.
    """
    if not isinstance(obj, dict):
        raise RecordError(f"a record must be a JSON object, got {type(obj).__name__}", "broken_lines")
    if "response_token_ids" not in obj:
        raise RecordError("no 'response_token_ids'")
    response = token_ids(obj["response_token_ids"], "response_token_ids", vocab_size)
    if obj.get("prompt_token_ids") is not None:
        return TrainingRecord(response, token_ids(obj["prompt_token_ids"], "prompt_token_ids", vocab_size), None)
    if "messages" not in obj:
        raise RecordError("neither 'prompt_token_ids' nor 'messages'")
    if need_messages:
        raise RecordError("no 'prompt_token_ids', and no tokenizer to render 'messages' "
                                    "(set data.tokenizer)")
    return TrainingRecord(response, None, chat_messages(obj["messages"]))


def record_id(obj: Any) -> str | None:
    """The record's ``id`` as text, when it has a scalar one."""
    rid = obj.get("id") if isinstance(obj, dict) else None
    return None if rid is None or isinstance(rid, (dict, list)) else str(rid)


def record_ids_at(path: str | os.PathLike, lines: Sequence[int]) -> dict[int, str | None]:
    """``{line: id}`` for the given line numbers of a JSONL file (one pass; for error messages)."""
    want, out = set(int(n) for n in lines), {}
    for line_no, raw in jsonl_lines(path):
        if line_no in want:
            try:
                out[line_no] = record_id(decode_line(raw))
            except RecordError:
                out[line_no] = None
            if len(out) == len(want):
                break
    return out


def describe_lines(path: str | os.PathLike, lines: Any, most: int = 16) -> str:
    """``records FILE:3 (id 'a'), FILE:17 (id 'b')`` for a batch's ``record_line`` values."""
    if lines is None:
        return "records unknown"
    lines = sorted({int(n) for n in np.ravel(lines) if int(n) > 0})
    ids = record_ids_at(path, lines) if path and lines else {}
    named = [f"{path}:{n}" + (f" (id {ids[n]!r})" if ids.get(n) else "") for n in lines[:most]]
    return "records " + ", ".join(named) + (" …" if len(lines) > most else "")


# --------------------------------------------------------------------------------------
# Run-level limits
# --------------------------------------------------------------------------------------
def check_skipped_fraction(skipped: int, total: int, limit: float, source: str, key: str,
                           first: str | None = None) -> None:
    """Stop (:class:`DataError`) when more than ``limit`` of ``total`` records were skipped as bad."""
    if total and skipped / total > limit:
        raise DataError(f"{source}: {skipped} of {total} records ({100 * skipped / total:.1f}%) are invalid, "
                        f"more than {key}={limit:g} allows (first: {first})")


def check_context(prompt_tokens: int, max_new_tokens: int, max_positions: int, *, model: str = "the target",
                  allow_beyond: bool = False, hint: str = "") -> None:
    """Prompt + ``max_new_tokens`` must fit ``max_positions`` (unless ``allow_beyond``): a model's
    ``ModelConfig.context_length``, ``max_position_embeddings`` or what its RoPE scaling extends."""
    need = int(prompt_tokens) + int(max_new_tokens)
    if need > max_positions and not allow_beyond:
        raise UsageError(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                         f"max_position_embeddings {max_positions} of {model}; lower max_new_tokens"
                         + (f" or pass {hint}" if hint else ""))


def write_jsonl(path: str | os.PathLike, rows: Iterator[dict] | Sequence[dict]) -> None:
    """One JSON object per line; a ``.gz`` path is gzip-compressed with no name or time in its
    header, so the same rows always give the same bytes."""
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if str(path).endswith(".gz"):
        with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
            f.write(text)
    else:
        with open(path, "wb") as f:
            f.write(text)
