"""The per-user compile cache every command shares, so nothing is compiled twice by default.

``enable(path)`` points JAX's persistent compilation cache at ``path`` (each compiled program
is kept, keyed by its HLO, backend and flags) and returns ``path/programs`` for a decoder's
:class:`~d3d_jax.decoding.programs.ProgramStore` (executables keyed without tracing, so a warm
start neither traces nor lowers).  ``path`` defaults to ``$D3D_COMPILE_CACHE``, else
``$XDG_CACHE_HOME/d3d_jax/xla`` (``~/.cache/d3d_jax/xla``); ``off`` (or ``none``) disables both.
The server (``--compile-cache``), ``infer/generate.py``, ``infer/bench.py`` and training share it.

Safe under concurrent use and on a full or read-only disk: JAX's entries go through
:class:`HealingCache`, which writes each atomically (a temporary file renamed; a failed write
removes it) where JAX's own cache writes in place and leaves 0-byte or truncated entries that it
then warns about at every start without removing them.  A start removes empty entries and killed
writers' temporary files; an entry that cannot be read is removed when met (then compiled again);
write failures are one line per process.  Two processes compiling one program write the same
bytes.  JAX's size bound is left off: its eviction reads a side file of every entry on every write.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from d3d_jax.io.atomic import remove_stale_temps, write_atomic

OFF = ("off", "none", "")
SUFFIX = "-cache"  # JAX's name for an entry: <key>-cache
log = logging.getLogger("d3d_jax.compile_cache")


class HealingCache:
    """JAX's persistent compilation cache in ``path``, entry for entry in JAX's layout, written by
    our atomic rule.  ``get`` returns None for an entry it cannot read (and removes it)."""

    def __init__(self, path: str | os.PathLike):
        self.path = self._path = Path(path)
        self._lock = threading.Lock()
        self._said: set[str] = set()  # what was logged already (one line per kind and process)
        removed = remove_stale_temps(self.path) + self._remove_empty()
        if removed:
            log.warning("compile cache: removed %d empty or unfinished entries in %s", removed, self.path)

    def _remove_empty(self) -> int:
        n = 0
        for entry in self.path.glob(f"*{SUFFIX}"):
            try:
                if entry.is_file() and entry.stat().st_size == 0:
                    entry.unlink()
                    n += 1
            except OSError:
                continue
        return n

    def _once(self, kind: str, msg: str, *args) -> None:
        with self._lock:
            first = kind not in self._said
            self._said.add(kind)
        (log.warning if first else log.debug)(msg, *args)

    def get(self, key: str) -> bytes | None:
        from jax._src.compilation_cache import decompress_executable

        entry = self.path / f"{key}{SUFFIX}"
        try:
            data = entry.read_bytes()
            decompress_executable(data)  # a truncated entry fails here, not in JAX (who keeps it)
            return data
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - damaged in any way: a miss, and compiled again
            try:
                entry.unlink()
            except OSError:  # a read-only cache keeps it; this process compiles it
                self._once("unremovable", "compile cache: %s cannot be read (%s) nor removed",
                           entry.name, type(e).__name__)
            else:
                self._once(f"damaged {key}", "compile cache: %s could not be read (%s); removed, "
                           "compiling it again", entry.name, type(e).__name__)
            return None

    def put(self, key: str, value: bytes) -> None:
        entry = self.path / f"{key}{SUFFIX}"
        if entry.exists():
            return
        try:
            write_atomic(entry, value)
        except OSError as e:  # a full or read-only disk costs the next start, not this one
            self._once("write", "compile cache: could not write to %s (%s); programs not written are "
                       "compiled again at the next start", self.path, e.strerror or e)

    def clear(self) -> None:  # JAX's interface; never called by JAX itself
        pass


def _install(path: str) -> None:
    """Make JAX build :class:`HealingCache` for its persistent cache (a hook of the pinned jax:
    the cache factory it calls when the cache is first used)."""
    try:
        from jax._src import compilation_cache as cc
        from jax._src import config as jax_config
        from jax._src.compilation_cache_interface import CacheInterface

        cc.get_file_cache, cc.reset_cache, cc.VerificationCache  # noqa: B018  (the hook's names)
        jax_config.compilation_cache_check_contents  # noqa: B018
    except (ImportError, AttributeError) as e:  # another jax: its own cache, unhealed
        import jax

        log.warning("compile cache: this jax (%s) lacks the hook the healing cache needs (%s); "
                    "JAX's own cache is used", jax.__version__, e)
        return

    healing = type("HealingJaxCache", (HealingCache, CacheInterface), {})

    def factory(cache_path):
        cache = healing(cache_path)
        if jax_config.compilation_cache_check_contents.value:
            cache = cc.VerificationCache(cache)
        return cache, cache_path

    cc.get_file_cache = factory
    cc.reset_cache()  # a cache built before (another path, JAX's own) is built again by the factory


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
    _install(xla)
    return program_dir(path)
