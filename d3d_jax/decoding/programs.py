"""A decoder's compiled programs, kept on disk as executables so a restart neither traces nor
lowers them (the server's warm start).

JAX's persistent compilation cache saves the *compile* of a program, but finding an entry in it
needs the program's HLO, so every start still traces and lowers every round program: for the
demo server that was ~28 s of tracing and ~9 s of lowering before ~8 s of reading executables.
A :class:`ProgramStore` keys each program by what determines it *without* tracing it — the
decoder's static description (``salt``: the package's source, jax/jaxlib versions, XLA flags,
devices, decoder config, target config and graph, drafter signature), the program's name, its
static arguments and its arguments' types — and keeps ``jax.experimental.serialize_executable``'s
bytes under that key.  A warm start deserializes and runs them.

* ``directory=None``: :meth:`ProgramStore.jit` is ``jax.jit`` itself (nothing changes).
* A program is serialized only from a fresh compile.  Re-serializing an executable that XLA:CPU
  read back from JAX's persistent cache loses functions (``NOT_FOUND: Function wrapped_iota not
  found`` when another process runs it; test_programs reproduces it), so each program's function is renamed with
  the salt (JAX's cache key includes the module name, so it never matches a plain ``jax.jit``
  compile of the same code), and a compile that JAX's cache answered anyway (this store's entry
  was removed, JAX's was not; counted in ``cache_answered``) is compiled again under a fresh
  name before it is stored.
* Entries are written atomically; a start removes killed writers' temporary files; an entry that
  cannot be read (damaged, another jaxlib) is logged, removed and compiled again; failed writes
  are one line per start.  Each holds its full key, compared on load.
* :meth:`ProgramStore.preload` reads every entry of this salt that was not used yet (the server
  does it in a background thread after ``READY``: deserializing releases the GIL); a program
  asked for while its entry is being read waits for that read instead of reading it twice.
* :meth:`ProgramStore.ahead` runs a warm-up with nothing executed: each program it would compile
  is lowered on the calling thread and compiled by a few threads at once (XLA releases the GIL),
  its outputs returned as types for the next program's lowering.  A cold start's compiles then
  overlap instead of queueing one behind the other.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np

from d3d_jax.io.atomic import remove_stale_temps, write_atomic

log = logging.getLogger("d3d_jax.programs")

FORMAT = 1  # bump when an entry's layout changes
SUFFIX = ".xprog"
LOAD_EVENT = "/d3d_jax/programs/load"
KEEP_SALTS = 8  # salt directories kept (the most recently used); older ones are removed


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of every ``.py`` file of the installed ``d3d_jax`` package (paths and contents)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def environment() -> dict[str, Any]:
    """What changes compiled code without changing our arguments."""
    import jaxlib

    devs = jax.devices()
    return dict(format=FORMAT, source=source_digest(), jax=jax.__version__,
                jaxlib=jaxlib.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                x64=bool(jax.config.jax_enable_x64),
                matmul_precision=str(jax.config.jax_default_matmul_precision),
                platform=devs[0].platform, devices=[(d.id, d.device_kind) for d in devs])


def decoder_salt(config, target_graphdef, target_config, drafter) -> dict | None:
    """What a decoder's programs close over, as text; None when something has no stable text (an
    acceptance override or rule, a drafter that is not a model), so nothing is kept on disk."""
    from d3d_jax.decoding.drafting import ModelDrafter

    if config.acceptance_override is not None or config.acceptance_rule is not None:
        return None
    if drafter is not None and not isinstance(drafter, ModelDrafter):
        return None
    return dict(decoder=repr(config), target=repr(target_config), target_graph=repr(target_graphdef),
                drafter=None if drafter is None else repr(drafter.signature))


def _leaf_type(x) -> tuple:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):  # an array, or its type (ProgramStore.ahead)
        return ("a", x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)), x.sharding)
    if isinstance(x, (bool, int, float, complex)):
        return ("py", type(x).__name__)
    x = np.asarray(x)
    return ("np", x.shape, str(x.dtype))


def device_ids(compiled) -> list[int]:
    """The ids of the devices ``compiled`` runs on, in its device assignment's order: what
    ``deserialize_and_load(execution_devices=...)`` needs to load it on the same devices."""
    return [d.id for d in compiled.runtime_executable().local_devices()]


def _safe(name: str) -> str:
    """``name`` with every character that is not a letter or digit replaced by ``_``."""
    return "".join(c if c.isalnum() else "_" for c in name)


def _short(key_text: str) -> str:
    return hashlib.sha256(key_text.encode()).hexdigest()[:32]


@dataclasses.dataclass
class _Entry:
    name: str
    key_text: str  # the full key: salt, program name, static values, tree, leaf types
    blob: bytes  # serialize_executable's bytes
    in_tree: Any
    out_tree: Any
    device_ids: list  # the devices it runs on, in its order


class ProgramStore:
    """Compiled programs of one decoder (see the module doc).  ``salt``: everything besides a
    program's name and arguments that determines it; ``None`` disables the disk (the caller's
    programs close over something that cannot be keyed)."""

    def __init__(self, directory: str | os.PathLike | None, salt: Mapping[str, Any] | None = None):
        self.enabled = directory is not None and salt is not None
        salt_text = repr(sorted(dict(salt or {}, **environment()).items())) if self.enabled else ""
        self.salt_hash = _short(salt_text)
        self.dir = Path(directory) / self.salt_hash if self.enabled else None
        self._salt_text = salt_text
        self._lock = threading.Lock()
        self._memory: dict[tuple, Any] = {}  # (program, in-memory key) -> Compiled
        self._by_text: dict[str, Any] = {}  # full key -> Compiled (what preload reads)
        self._reading: dict[str, threading.Event] = {}  # full key -> read in progress
        self._ahead = threading.local()  # .jobs: full key -> (future, output types) in an ahead pass
        self.counts = dict(loaded=0, compiled=0, stored=0, cache_answered=0, damaged=0)
        self.write_failed = False  # a failed write is logged once per start
        if self.enabled:
            try:
                self._prune(Path(directory))
            except OSError as e:  # a read-only store (a pre-warmed image) is read, never written
                if os.access(self.dir, os.R_OK | os.X_OK) and self.dir.is_dir():
                    log.warning("program store: %s is read-only (%s); programs are read from it, new "
                                "ones kept in memory only", self.dir, e.strerror or e)
                    self.write_failed = True  # said once: each write that fails is not said again
                else:  # none there to read: this start compiles, as without a store
                    log.warning("program store: %s is not usable (%s); programs are kept in memory only",
                                directory, e)
                    self.enabled = False

    def _prune(self, root: Path) -> None:
        """Mark this salt used and remove all but the ``KEEP_SALTS`` most recently used salt
        directories (each change of the source or a version makes a new one: without this the
        store grows with every edit).  A removed entry costs a compile, never a wrong program."""
        import shutil

        self.dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        os.utime(self.dir, (now, now))
        salts = [p for p in root.iterdir() if p.is_dir() and len(p.name) == 32 and p != self.dir]
        salts.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        if stale := sum(remove_stale_temps(d) for d in [self.dir] + salts[:KEEP_SALTS - 1]):
            log.warning("program store: removed %d temporary files of writes that never finished", stale)
        for old in salts[KEEP_SALTS - 1:]:
            log.warning("program store: removing %s, not used since %s", old,
                        time.strftime("%Y-%m-%d %H:%M", time.localtime(old.stat().st_mtime)))
            shutil.rmtree(old, ignore_errors=True)

    def jit(self, fn: Callable, *, name: str | None = None, static_argnames=(), static_argnums=(),
            donate_argnums=()):
        """``jax.jit(fn, ...)``, or with a directory, a :class:`Program` kept in the store."""
        if not self.enabled:
            return jax.jit(fn, static_argnames=static_argnames, static_argnums=static_argnums,
                           donate_argnums=donate_argnums)
        name = name or getattr(fn, "__qualname__", getattr(fn, "__name__", "program"))
        return Program(self, fn, name, _tuple(static_argnames), _tuple(static_argnums),
                       donate_argnums)

    # ------------------------------------------------------------ disk
    def _path(self, name: str, key_text: str) -> Path:
        return self.dir / f"{_safe(name)[:60]}-{_short(key_text)}{SUFFIX}"

    def _write(self, path: Path, entry: _Entry) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, zlib.compress(pickle.dumps(dataclasses.asdict(entry), protocol=5), 1))

    def _read(self, path: Path) -> _Entry | None:
        """The entry in ``path`` (None: absent); a damaged one is logged and removed."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:  # a directory, a symlink loop, a bad sector: damage like any other
            self._discard(path, f"unreadable ({type(e).__name__}: {e.strerror or e})")
            return None
        try:
            entry = _Entry(**pickle.loads(zlib.decompress(data)))
            if not (isinstance(entry.name, str) and isinstance(entry.key_text, str)
                    and isinstance(entry.blob, bytes) and isinstance(entry.device_ids, list)):
                raise TypeError("fields of the wrong types")
        except Exception as e:  # noqa: BLE001 - any damage: compile it again
            self._discard(path, f"unreadable ({type(e).__name__}: {str(e)[:200]})")
            return None
        return entry

    def _discard(self, path: Path, why: str) -> None:
        import shutil

        self.counts["damaged"] += 1
        log.warning("program store: %s is %s; removed, compiling it again", path.name, why)
        try:
            path.unlink()  # a file or a symlink (never followed)
        except IsADirectoryError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # a read-only store: the entry stays, this process compiles it
            pass

    def _load(self, path: Path, entry: _Entry):
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in entry.device_ids]
            compiled = deserialize_and_load(entry.blob, entry.in_tree, entry.out_tree,
                                            execution_devices=devices)
        except Exception as e:  # noqa: BLE001 - another jaxlib, damaged bytes: compile again
            self._discard(path, f"not loadable ({type(e).__name__}: {e})")
            return None
        self.counts["loaded"] += 1
        return compiled

    def _fetch(self, name: str, key_text: str, entry: _Entry | None = None):
        """The program read from disk (or waiting for a background read of it), or None;
        ``entry``: its file's content when the caller read it already."""
        with self._lock:
            if key_text in self._by_text:
                return self._by_text[key_text]
            done = self._reading.get(key_text)
            owner = done is None
            if owner:
                self._reading[key_text] = done = threading.Event()
        if not owner:
            done.wait()
            return self._by_text.get(key_text)
        start = time.time()
        try:
            path = self._path(name, key_text)
            entry = entry or self._read(path)
            if entry is None:
                return None
            if entry.key_text != key_text:
                self._discard(path, "another program's (key mismatch)")
                return None
            compiled = self._load(path, entry)
            if compiled is not None:
                self._by_text[key_text] = compiled
            return compiled
        finally:
            with self._lock:
                self._reading.pop(key_text, None)
            done.set()
            # as JAX reports a compile: a caller's CompileClock keeps it out of decode time
            jax.monitoring.record_event_time_span(LOAD_EVENT, start, time.time(), fun_name=name)

    def _keep(self, key_text: str, compiled) -> None:
        with self._lock:
            self._by_text[key_text] = compiled

    def preload(self) -> int:
        """Read every stored program of this salt not read yet (the server's background thread
        after ``READY``); how many were read."""
        if not self.enabled or not self.dir.is_dir():
            return 0
        n = 0
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            entry = self._read(path)
            if entry is None or not entry.key_text.startswith(self._salt_text + "\0"):
                continue
            if entry.key_text not in self._by_text and self._fetch(entry.name, entry.key_text, entry) is not None:
                n += 1
        return n

    def ahead(self, warm: Callable[[], Any], workers: int | None = None) -> int:
        """Call ``warm`` (a warm-up: a sequence of program calls) with nothing run: every program
        it calls that is neither in memory nor on disk is compiled by ``workers`` threads at once
        (:func:`~d3d_jax.decoding.ahead.compile_ahead`); how many were compiled.  Without a
        directory: nothing (the calls compile as they run)."""
        from d3d_jax.decoding.ahead import compile_ahead

        return compile_ahead(self, warm, workers) if self.enabled else 0

    def read_note(self, name: str) -> dict | None:
        """A JSON note kept beside this salt's programs (None: absent, unreadable or no store).
        What a decoder measured on this machine with these very programs (auto's round costs)."""
        if not self.enabled:
            return None
        try:
            data = json.loads((self.dir / f"{name}.json").read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # damaged: measured again, like a damaged program
            log.warning("program store: note %s unreadable (%s); measuring again", name, e)
            return None
        return data if isinstance(data, dict) else None

    def write_note(self, name: str, data: dict) -> None:
        """Keep ``data`` as note ``name`` (atomically; a read-only store logs and keeps none)."""
        if not self.enabled:
            return
        try:
            write_atomic(self.dir / f"{name}.json", json.dumps(data, indent=1, sort_keys=True).encode())
        except OSError as e:
            log.warning("program store: note %s not kept (%s)", name, e.strerror or e)

    def stored(self) -> int:
        """Entries on disk for this salt."""
        return len(list(self.dir.glob(f"*{SUFFIX}"))) if self.enabled and self.dir.is_dir() else 0


def _tuple(x) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, (str, int)) else tuple(x)


class _CacheHits(threading.local):
    watching = False
    hits = 0


_HITS = _CacheHits()
_LISTENING = False


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits" and _HITS.watching:
        _HITS.hits += 1


def _listen() -> None:
    global _LISTENING
    if not _LISTENING:
        jax.monitoring.register_event_listener(_on_event)
        _LISTENING = True


class Program:
    """A jitted function whose executables live in a :class:`ProgramStore`: called like the
    ``jax.jit`` of it (static arguments by keyword, or by position for ``static_argnums``)."""

    def __init__(self, store: ProgramStore, fn: Callable, name: str, static_argnames: tuple,
                 static_argnums: tuple, donate_argnums):
        self.store, self.name = store, name
        self.static_argnames, self.static_argnums = static_argnames, static_argnums

        self._fn = fn
        self._last: dict = {}  # (static values, tree) -> the last program called with them
        self._options = dict(static_argnames=static_argnames, static_argnums=static_argnums,
                             donate_argnums=donate_argnums)
        # JAX's cache key holds the module name: never the key of a plain jit of the same code
        self._jit = self._rename(store.salt_hash[:12])

    def _rename(self, suffix: str):
        """``jax.jit`` of the function under the module name ``<name>_<suffix>``."""
        fn = self._fn

        @functools.wraps(fn)
        def program(*args, **kwargs):
            return fn(*args, **kwargs)

        program.__name__ = program.__qualname__ = f"{_safe(self.name)}_{suffix}"
        return jax.jit(program, **self._options)

    @staticmethod
    def _compile(jitted, args: tuple, kwargs: dict):
        """(Compiled, whether JAX's persistent cache answered instead of XLA)."""
        return Program._watched(jitted.lower(*args, **kwargs))

    @staticmethod
    def _watched(lowered):
        """``lowered`` compiled, and whether JAX's persistent cache answered instead of XLA."""
        _listen()
        _HITS.watching, _HITS.hits = True, 0
        try:
            return lowered.compile(), _HITS.hits > 0
        finally:
            _HITS.watching = False

    def _split(self, args: tuple, kwargs: dict):
        static = tuple(args[i] for i in self.static_argnums)
        static += tuple(sorted((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
        dynamic = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        rest = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return static, dynamic, rest

    def __call__(self, *args, **kwargs):
        """The program for these static values and argument types.  Fast path: the last program
        of this (static values, tree); a ``Compiled`` checks its arguments' types itself and
        refuses others with a TypeError, and only then are the types looked at (the full key:
        ~1.7 ms for a round's 145 leaves, against ~15 µs for the tree)."""
        static, dynamic, rest = self._split(args, kwargs)
        leaves, tree = jax.tree.flatten((dynamic, rest))
        jobs = getattr(self.store._ahead, "jobs", None)
        if jobs is not None:  # in ProgramStore.ahead: compile, run nothing
            return self._ahead(jobs, (static, tree, tuple(_leaf_type(x) for x in leaves)), leaves, args, kwargs)
        last = self._last.get((static, tree))
        if last is not None:
            try:
                return last(*dynamic, **rest)
            except TypeError as e:
                if "Argument types differ" not in str(e):
                    raise
        key = (static, tree, tuple(_leaf_type(x) for x in leaves))
        compiled = self.store._memory.get((self.name, key))
        if compiled is None:
            compiled = self._get(key, args, kwargs)
        self._last[(static, tree)] = compiled
        return compiled(*dynamic, **rest)

    def _key_text(self, key: tuple) -> str:
        return f"{self.store._salt_text}\0{self.name}\0{key!r}"

    def _get(self, key: tuple, args: tuple, kwargs: dict):
        store = self.store
        key_text = self._key_text(key)
        compiled = store._fetch(self.name, key_text)
        if compiled is not None:
            store._memory[(self.name, key)] = compiled
            return compiled
        compiled, hit = self._compile(self._jit, args, kwargs)
        if hit:  # read back from JAX's cache (this store's entry was removed, JAX's was not):
            # serializing it would lose functions, so compile it afresh under a new module name
            store.counts["cache_answered"] += 1
            log.warning("program store: %s was missing but in JAX's cache; compiling it afresh", self.name)
            compiled, _ = self._compile(self._rename(os.urandom(6).hex()), args, kwargs)
        self._keep(key, key_text, compiled)
        return compiled

    def _keep(self, key: tuple, key_text: str, compiled) -> None:
        """A fresh compile: in memory, and on disk for the next start."""
        store = self.store
        with store._lock:
            store.counts["compiled"] += 1
        store._memory[(self.name, key)] = compiled
        store._keep(key_text, compiled)
        from jax.experimental.serialize_executable import serialize

        blob, in_tree, out_tree = serialize(compiled)
        devices = device_ids(compiled)
        path = store._path(self.name, key_text)
        try:
            store._write(path, _Entry(self.name, key_text, blob, in_tree, out_tree, devices))
            with store._lock:
                store.counts["stored"] += 1
        except OSError as e:  # a full or read-only disk costs the next start, not this one
            first, store.write_failed = not store.write_failed, True
            (log.warning if first else log.debug)(
                "program store: could not write %s (%s); programs not written are compiled again at "
                "the next start%s", path.name, e.strerror or e, "" if first else " (again)")

    def _ahead(self, jobs: dict, key: tuple, leaves: list, args: tuple, kwargs: dict):
        """One call in :meth:`ProgramStore.ahead`: the outputs' types, the compile queued."""
        from d3d_jax.decoding.ahead import one_device, output_types

        store, key_text = self.store, self._key_text(key)
        if key_text in jobs:
            return jobs[key_text][1]
        compiled = store._memory.get((self.name, key)) or store._fetch(self.name, key_text)
        if compiled is not None:
            store._memory[(self.name, key)] = compiled
            return output_types(compiled.out_info)
        lowered = self._jit.lower(*args, **kwargs)
        out = output_types(lowered.out_info, one_device(leaves))
        if out is None:  # where the outputs live is the compile's to say
            return output_types(self._get(key, args, kwargs).out_info)
        jobs[key_text] = (store._ahead.pool.submit(self._compile_lowered, key, key_text, lowered, args, kwargs),
                          out)
        return out

    def _compile_lowered(self, key: tuple, key_text: str, lowered, args: tuple, kwargs: dict) -> bool:
        """A worker of :meth:`ProgramStore.ahead`: compile and keep (True).  A program JAX's
        cache answered is compiled afresh under a new name, as :meth:`_get` does (nothing has
        run yet, so ``args`` are all still there)."""
        compiled, hit = self._watched(lowered)
        if hit:
            with self.store._lock:
                self.store.counts["cache_answered"] += 1
            compiled, _ = self._compile(self._rename(os.urandom(6).hex()), args, kwargs)
        self._keep(key, key_text, compiled)
        return True
