"""Opening the files a user names: only regular files, and JSON with its numbers bounded.

Every model, tokenizer, config and data file is opened through :func:`open_regular`.  A FIFO in
place of ``model.safetensors`` used to block the first read forever (nothing writes to it), a
device such as ``/dev/zero`` never ends, and a directory or socket fails deep inside a parser.
The file is opened without blocking (``O_NONBLOCK``: opening a FIFO returns at once), the opened
descriptor is checked to be a regular file (no window between a check and the open), and only
then is anything read.  :func:`check_regular` does the same for a path another library opens
(the tokenizer files transformers reads, the Orbax directory's files).
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from d3d_jax.config.limits import dotted, json_loads, long_number
from d3d_jax.errors import D3DError, ModelFileError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refusal(path, mode: int, what: str) -> str:
    return f"{path}: is {_kind(mode)}, not a regular file; {what} must be a regular file"


def open_regular(path: str | os.PathLike, what: str = "this file",
                 error: type[D3DError] = ModelFileError) -> BinaryIO:
    """``path`` opened for binary reading, or ``error`` naming it when it is not a regular file
    (a missing or unreadable path raises the usual ``OSError``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # a socket cannot be opened at all (ENXIO): say what it is
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise error(_refusal(path, mode, what)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(_refusal(path, mode, what))
        os.set_blocking(fd, True)
        return io.open(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str | os.PathLike, what: str = "this file",
                  error: type[D3DError] = ModelFileError) -> Path:
    """``path`` when it is a regular file (symlinks followed); ``error`` naming it otherwise.
    For files another library opens by name; a missing one raises ``FileNotFoundError``."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise error(_refusal(path, mode, what))
    return Path(path)


def read_bytes(path: str | os.PathLike, what: str = "this file", error: type[D3DError] = ModelFileError) -> bytes:
    with open_regular(path, what, error) as f:
        return f.read()


def read_json(path: str | os.PathLike, what: str = "this file", error: type[D3DError] = ModelFileError) -> Any:
    """A JSON file's value, numbers bounded before they are converted
    (:data:`~d3d_jax.config.limits.MAX_NUMBER_CHARS`).  Bad bytes, bad JSON or a number too long
    raise ``error`` naming the file (and the key of the number)."""
    raw = read_bytes(path, what, error)
    try:
        value = json_loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{path}: not valid JSON ({str(e)[:200]})") from None
    found = long_number(value)
    if found is not None:
        where, number = found
        raise error(f"{path}: {dotted(where) or 'the value'}: {number.problem()}")
    return value
