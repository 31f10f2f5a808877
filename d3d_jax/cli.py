"""How every command line ends on bad input: one line on stderr and an exit status, no traceback.

    if __name__ == "__main__":
        sys.exit(run_cli(main))

``main(argv)`` runs with ``--debug`` taken out of ``argv``.  The project's own errors
(:mod:`d3d_jax.errors`, ``ConfigError`` included) and a missing or unreadable path print
``error: <message>`` and return the error's ``exit_code`` (2 usage, 1 runtime).  Anything else is
a bug and keeps its traceback; ``--debug`` keeps the traceback for every error.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from d3d_jax.errors import D3DError, UsageError

DEBUG_FLAG = "--debug"
# A path the user named that is not there (or not readable): a usage error, not a bug.
_PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def one_line(error: BaseException) -> str:
    """The error's message on one line (multi-line messages joined with '; ')."""
    if isinstance(error, OSError) and error.filename is not None:
        text = f"{error.filename}: {error.strerror or error}"
    else:
        text = str(error) or type(error).__name__
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def run_cli(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` and return its exit status (``None`` counts as 0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    try:
        status = main(argv)
    except (D3DError, *_PATH_ERRORS) as e:
        if debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return e.exit_code if isinstance(e, D3DError) else UsageError.exit_code
    return status if isinstance(status, int) else 0
