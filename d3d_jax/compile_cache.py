"""The per-user compile cache every command shares, so nothing is compiled twice by default.

``enable(path)`` points JAX's persistent compilation cache at ``path`` (each compiled program
is kept, keyed by its HLO, backend and flags) and returns ``path/programs`` for a decoder's
:class:`~d3d_jax.decoding.programs.ProgramStore` (executables keyed without tracing, so a warm
start neither traces nor lowers).  ``path`` defaults to ``$D3D_COMPILE_CACHE``, else
``$XDG_CACHE_HOME/d3d_jax/xla`` (``~/.cache/d3d_jax/xla``); ``off`` (or ``none``) disables both.
The server (``--compile-cache``), ``infer/generate.py``, ``infer/bench.py`` and training share it.

Safe under concurrent use: the program store writes atomically (a temporary file renamed), and
JAX reads an entry that another process is still writing as a miss (a warning, then it compiles);
two processes compiling one program write the same bytes.  JAX's size bound is left off: its
eviction reads a side file of every entry on every write and fails on entries written without one.
"""

from __future__ import annotations

import os

OFF = ("off", "none", "")


def default_dir() -> str:
    """``$D3D_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/d3d_jax/xla`` (default ``~/.cache/d3d_jax/xla``)."""
    if os.environ.get("D3D_COMPILE_CACHE"):
        return os.environ["D3D_COMPILE_CACHE"]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "d3d_jax", "xla")


def is_off(path: str | None) -> bool:
    """``off`` / ``none`` / empty; None is the default directory, not off."""
    return path is not None and str(path).strip().lower() in OFF


def program_dir(path: str | None) -> str | None:
    """The program store's directory in the cache ``path`` (None: the default), or None when off."""
    path = default_dir() if path is None else str(path)
    return None if is_off(path) else os.path.join(os.path.abspath(os.path.expanduser(path)), "programs")


def add_flag(parser, default: str | None = None) -> None:
    """``--compile-cache DIR|off`` on a command's parser."""
    parser.add_argument("--compile-cache", default=default, metavar="DIR|off",
                        help="keep compiled programs across runs here (default: $D3D_COMPILE_CACHE, else "
                             "$XDG_CACHE_HOME/d3d_jax/xla, i.e. ~/.cache/d3d_jax/xla); 'off' disables")


def enable(path: str | None = None) -> str | None:
    """Turn the persistent cache on at ``path`` (None: :func:`default_dir`); returns the program
    store's directory, or None when ``path`` is ``off``.  Call it before anything compiles."""
    path = default_dir() if path is None else path
    if is_off(path):
        return None
    import jax

    from d3d_jax.errors import UsageError

    xla = os.path.abspath(os.path.expanduser(path))
    if os.path.lexists(xla) and not os.path.isdir(xla):
        why = "a symlink loop or a broken link" if os.path.islink(xla) else "a file, not a directory"
        raise UsageError(f"--compile-cache {path}: {xla} is {why}; give a directory (or 'off')")
    try:
        os.makedirs(xla, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--compile-cache {path}: cannot create it ({e.strerror or e})") from None
    jax.config.update("jax_compilation_cache_dir", xla)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return program_dir(path)
