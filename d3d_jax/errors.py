"""The project's own error types: bad input that a program reports in one line, not a traceback.

Every class derives from :class:`D3DError` and from ``ValueError`` (except the training guard's
``RuntimeError``), so callers that caught ``ValueError`` keep working.  ``exit_code`` is what a
command line returns for it (:func:`d3d_jax.cli.run_cli`): 2 for what the user asked for
(flags, config, paths, limits), 1 for what went wrong while running (file contents, training).
"""

from __future__ import annotations


class D3DError(Exception):
    """Base of every error the project reports to a user as one line."""

    exit_code = 1


class UsageError(D3DError, ValueError):
    """A flag, config value, path or limit the user gave cannot work."""

    exit_code = 2


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
    """The machine refused an operation on a named path: a full disk, a read-only or looping
    directory, a file where a directory belongs.  Nothing already written is lost."""
