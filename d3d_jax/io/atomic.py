"""Directories that are replaced whole, files written whole, and writes whose failure names the
path: an export is written beside its destination and renamed into place, so a kill at any moment
leaves either the old export or the new one, never a mix.  Cache files (compiled programs) are
written the same way by :func:`write_atomic`; a write that fails removes its temporary file, and
:func:`remove_stale_temps` removes those of writers that were killed.

    with staged_directory(out_dir) as tmp:
        write everything into tmp
    # now out_dir is the new export; files of the old out_dir the new one lacks were carried over

Layout while writing: ``.<name>.partial`` (the new export) beside ``<name>``.  The swap is two
renames (``<name>`` -> ``.<name>.previous``, ``.<name>.partial`` -> ``<name>``); a kill between them
leaves the old export whole under ``.<name>.previous``, and the next export or
:func:`recover_directory` puts it back before doing anything else.  A failure while writing
removes the partial directory and leaves ``<name>`` untouched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from d3d_jax.errors import ResourceError, os_error

STALE_TEMP_S = 3600.0  # a temporary file this old is stale even if its pid is alive (reused pids)
_TEMP = re.compile(r"^\..+\.(\d+)\.\d+\.tmp$")  # .<name>.<pid>.<thread>.tmp (write_atomic's)


def staging_paths(final: Path) -> tuple[Path, Path]:
    """``(partial, previous)`` sibling paths of ``final``."""
    return final.with_name(f".{final.name}.partial"), final.with_name(f".{final.name}.previous")


def recover_directory(final: str | os.PathLike) -> None:
    """Finish or undo a swap that a kill interrupted (see the module docstring)."""
    final = Path(final)
    _, previous = staging_paths(final)
    if not previous.exists():
        return
    if final.exists():  # the new export landed; the old one was not yet deleted
        shutil.rmtree(previous, ignore_errors=True)
    else:  # killed between the two renames: the old export is still whole
        os.rename(previous, final)


def _carry_over(old: Path, new: Path, keep: Callable[[str], bool]) -> None:
    """Copy entries of ``old`` that ``new`` lacks (a tokenizer, a result.json) into ``new``."""
    for entry in old.iterdir():
        if (new / entry.name).exists() or not keep(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, new / entry.name, follow_symlinks=False)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike, *, keep: Callable[[str], bool] = lambda name: True,
                     primary: bool = True, barrier: Callable[[str], None] = lambda name: None) -> Iterator[Path]:
    """Yield an empty directory to write the new contents of ``final`` into; on a clean exit it
    replaces ``final``.  Entries of the old ``final`` that the new one lacks are carried over
    when ``keep(name)``.  ``primary``: this process prepares and swaps (several processes write
    one Orbax checkpoint; all of them get the same path); ``barrier(name)`` syncs them."""
    final = Path(final).resolve()
    partial, previous = staging_paths(final)
    if primary:
        if final.exists() and not final.is_dir():
            raise ResourceError(f"{final}: is a file, not a directory; choose another output path")
        final.parent.mkdir(parents=True, exist_ok=True)
        recover_directory(final)
        if partial.exists():  # left by a killed export
            shutil.rmtree(partial)
        partial.mkdir()
    barrier("d3d_staged_directory_ready")
    try:
        with writing(final):  # a full disk names the export, not a temporary file
            yield partial
        barrier("d3d_staged_directory_written")
    except BaseException:
        if primary:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if primary:
        if final.exists():
            _carry_over(final, partial, keep)
            os.rename(final, previous)
        os.rename(partial, final)
        _fsync_dir(final.parent)
        shutil.rmtree(previous, ignore_errors=True)
    barrier("d3d_staged_directory_swapped")


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turns an ``OSError`` while writing ``path`` into one line naming the path (a write's
    ``OSError`` often names none): :class:`ResourceError` for a full disk or a file-size limit,
    :class:`~d3d_jax.errors.PathError` for a read-only file system or a file in the way."""
    try:
        yield
    except OSError as e:
        raise os_error(path, e) from None


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole: a temporary file of this process and thread in the same
    directory, renamed over ``path`` (a reader sees the old file or the new one, never part of
    one).  A write that fails (a full disk) removes its temporary file and raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _writer_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


def remove_stale_temps(directory: str | os.PathLike) -> int:
    """Remove the temporary files of :func:`write_atomic` in ``directory`` whose writer is gone
    (killed mid-write) or that are older than ``STALE_TEMP_S``; how many.  A read-only directory
    removes none."""
    n, now = 0, time.time()
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _TEMP.match(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        try:
            old = now - os.lstat(path).st_mtime > STALE_TEMP_S
            if old or _writer_gone(int(m.group(1))):
                os.unlink(path)
                n += 1
        except OSError:
            continue
    return n
