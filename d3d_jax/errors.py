"""The project's own error types: bad input that a program reports in one line, not a traceback.

Every class derives from :class:`D3DError` and from ``ValueError`` (except the training guard's
``RuntimeError``), so callers that caught ``ValueError`` keep working.  ``exit_code`` is what a
command line returns for it (:func:`d3d_jax.cli.run_cli`): 2 for what the user asked for
(flags, config, paths, limits), 1 for what went wrong while running (file contents, training).
"""

from __future__ import annotations

import errno
from typing import Any

# OSErrors of something that ran out (exit 1); any other OSError names a path that cannot work
# as given (read-only, a file where a directory belongs, a symlink loop: exit 2).
RESOURCE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.ENOMEM, errno.EMFILE,
                             errno.ENFILE, errno.EADDRINUSE})


def short_value(value: Any) -> str:
    """A value for an error message, cut short (a YAML alias can expand to gigabytes)."""
    if isinstance(value, (str, bytes)):
        text = repr(value[:60])
        return text if len(value) <= 60 else f"{text[:-1]}...' ({len(value)} characters)"
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


class D3DError(Exception):
    """Base of every error the project reports to a user as one line."""

    exit_code = 1


class UsageError(D3DError, ValueError):
    """A flag, config value, path or limit the user gave cannot work."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration value or combination is invalid; the message names the key (and is cut
    short: a value quoted in it may be megabytes long)."""

    def __init__(self, message: str = ""):
        message = str(message)
        if len(message) > 640:  # the head names the key, the tail says what to do: keep both
            message = f"{message[:380]} ... ({len(message)} characters) ... {message[-200:]}"
        super().__init__(message)


class DataError(D3DError, ValueError):
    """Training / regeneration input that cannot be used (too many bad records, none usable)."""


class RecordError(DataError):
    """One bad record; the reason goes into the skip log (the record is skipped, not fatal).

    ``kind`` names the counter it is counted in (``broken_lines``, ``missing_fields``,
    ``bad_token_ids``: the fields of :class:`d3d_jax.training.data.DataStats`).
    """

    def __init__(self, message: str, kind: str = "missing_fields"):
        super().__init__(message)
        self.kind = kind


class ModelFileError(D3DError, ValueError):
    """A model, checkpoint or tokenizer file that is missing, truncated or inconsistent."""


class NonFiniteError(D3DError, RuntimeError):
    """A NaN / inf loss, gradient or weight: training stopped, or an export was refused."""


class ResourceError(D3DError, RuntimeError):
    """The machine ran out while writing a named path (a full disk, a file-size limit).  Nothing
    already written is lost."""


class PathError(UsageError):
    """A path that cannot work as given: read-only, a file where a directory belongs, a loop."""


def os_error(path, error: OSError) -> D3DError:
    """``error`` (raised while working on ``path``) as one line naming ``path``."""
    if error.errno in (errno.EEXIST, errno.ENOTDIR) and error.filename is not None:
        return PathError(f"{path}: {error.filename} is a file where a directory is needed")
    where = f", at {error.filename}" if error.filename not in (None, str(path)) else ""
    cls = ResourceError if error.errno in RESOURCE_ERRNOS else PathError
    return cls(f"{path}: {error.strerror or error} (errno {error.errno}{where}); what was written before is kept")
