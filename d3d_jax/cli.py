"""How every command line ends on bad input: one line on stderr and an exit status, no traceback.

    if __name__ == "__main__":
        sys.exit(run_cli(main))

``main(argv)`` runs with ``--debug`` taken out of ``argv``.  The project's own errors
(:mod:`d3d_jax.errors`, ``ConfigError`` included), every ``OSError`` (a missing, unreadable or
read-only path, a symlink loop, a file where a directory belongs, a full disk, a port in use) and
the accelerator or the host running out (of memory; of stack, ``RecursionError``) print
``error: <message>`` naming the path where there is one, and return the error's ``exit_code``: 2
for what the user asked for (flags, paths), 1 for what ran out or went wrong while running (a
full disk, memory, file contents).  Anything else is
a bug and keeps its traceback; ``--debug`` keeps the traceback for every error.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from d3d_jax.errors import RESOURCE_ERRNOS, D3DError, UsageError

DEBUG_FLAG = "--debug"


def _out_of_device_memory(error: BaseException) -> bool:
    return type(error).__name__ in ("XlaRuntimeError", "JaxRuntimeError") and "RESOURCE_EXHAUSTED" in str(error)


def _exhausted(error: BaseException) -> bool:
    """The host ran out: memory, or the interpreter's stack (an input nested past any sense)."""
    return isinstance(error, (MemoryError, RecursionError))


def exit_code(error: BaseException) -> int:
    """The exit status a command line returns for ``error`` (one it reports in one line)."""
    if isinstance(error, D3DError):
        return error.exit_code
    if isinstance(error, OSError):
        return 1 if error.errno in RESOURCE_ERRNOS else UsageError.exit_code
    return 1


def one_line(error: BaseException) -> str:
    """The error's message on one line (multi-line messages joined with '; ')."""
    if isinstance(error, OSError) and error.filename is not None:
        also = f" -> {error.filename2}" if getattr(error, "filename2", None) else ""
        text = f"{error.filename}{also}: {error.strerror or error}"
    elif _out_of_device_memory(error):
        text = "out of accelerator memory (" + str(error).strip().splitlines()[0][:300] + ")"
    elif isinstance(error, MemoryError):
        text = "out of host memory" + (f" ({str(error)[:200]})" if str(error) else "") + \
            "; an input may be far larger than it should be (--debug shows where)"
    elif isinstance(error, RecursionError):
        text = "an input is nested too deeply to process (--debug shows where)"
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
    except KeyboardInterrupt:  # Ctrl-C (a server re-raises its SIGINT after a graceful shutdown)
        if debug:
            raise
        print("interrupted", file=sys.stderr, flush=True)
        return 130  # 128 + SIGINT, as a shell reports it
    except Exception as e:
        if debug or not (isinstance(e, (D3DError, OSError)) or _out_of_device_memory(e) or _exhausted(e)):
            raise
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return exit_code(e)
    return status if isinstance(status, int) else 0
