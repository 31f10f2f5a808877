"""The shared compile cache (d3d_jax/compile_cache.py) and the program store beside it
(d3d_jax/decoding/programs.py) on a disk that fills up: no entry is left empty or cut short, no
temporary file is left behind, a failed write is one line per process, and the next start removes
the damage an older writer left (then compiles and writes it whole).  The full disk is a real one
for the process: ``RLIMIT_FSIZE`` makes every write past its size fail, as ENOSPC does."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from d3d_jax.io import atomic

ROOT = Path(__file__).resolve().parent.parent
DEAD_PID = 2**22 + 1  # above any pid_max: no such process

COMPILE = r"""
import sys
import jax, jax.numpy as jnp
from d3d_jax import compile_cache
from d3d_jax.decoding.programs import ProgramStore
store = ProgramStore(compile_cache.enable(sys.argv[1]), {"test": "cache"})
for k in range(3):  # a small program (fits the limit) and a large one (does not), each kind
    x = jnp.arange(8.0 + k)
    jax.jit(lambda x, k=k: x * k)(x).block_until_ready()
    jax.jit(lambda x, k=k: jnp.sort(jnp.sin(x) ** (k + 2)) @ jnp.cumsum(jnp.cos(x)))(x).block_until_ready()
    store.jit(lambda x, k=k: jnp.sort(x) * (k + 2), name=f"p{k}")(x).block_until_ready()
print("OK", store.counts)
"""


def _run(cache: Path, fsize: int | None = None) -> str:
    """COMPILE in a fresh process (a start), its file writes limited to ``fsize`` bytes; stderr."""
    def limit():
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", COMPILE, str(cache)], capture_output=True, text=True,
                         env=env, timeout=300, preexec_fn=limit)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
    return out.stderr


def _jax_entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*-cache"))


def _whole(entry: Path) -> bool:
    try:
        zlib.decompress(entry.read_bytes())  # the pinned jax without zstandard compresses with zlib
    except zlib.error:
        return False
    return True


def _leftovers(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*.tmp"))


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="no file size limit here")
def test_a_full_disk_leaves_no_damage_and_a_later_start_heals_an_older_writers(tmp_path):
    cache = tmp_path / "xla"
    err = _run(cache, fsize=3000)
    assert _jax_entries(cache), "nothing fitted: the limit is too small to tell anything"
    assert all(_whole(e) for e in _jax_entries(cache)), "an entry was cut short"  # was: 0 and 3000 bytes
    assert _leftovers(cache) == []  # was: the store's .xprog.*.tmp of every program
    lines = [ln for ln in err.splitlines() if "could not write" in ln or "persistent compilation" in ln]
    assert len(lines) == 2, err[-3000:]  # one for JAX's cache, one for the store; was one per entry

    # what an older writer left: a cut entry, an empty one, unfinished temporary files
    cut = _jax_entries(cache)[0]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    (cache / "jit_gone-0123-cache").write_bytes(b"")
    salt_dir = next((cache / "programs").iterdir())
    temps = [cache / f".jit_x-cache.{DEAD_PID}.1.tmp", salt_dir / f".p9-ab.xprog.{DEAD_PID}.1.tmp"]
    for t in temps:
        t.write_bytes(b"part")
    err = _run(cache)
    assert "Error reading persistent compilation cache" not in err, err[-3000:]  # was: every start
    assert all(_whole(e) for e in _jax_entries(cache)) and cut.exists()  # removed, compiled, whole
    assert not (cache / "jit_gone-0123-cache").exists() and _leftovers(cache) == []
    assert "removed 2 empty or unfinished entries" in err and "removed 1 temporary files" in err, err[-3000:]


def test_write_atomic_removes_its_temporary_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "entry"
    target.write_bytes(b"old")

    class Full:
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:5])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "open", Full, raising=False)
    with pytest.raises(OSError, match="No space"):
        atomic.write_atomic(target, b"new contents")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"] and target.read_bytes() == b"old"


def test_stale_temporary_files_are_told_from_live_ones(tmp_path):
    live = tmp_path / f".a.{os.getpid()}.1.tmp"  # this process: still writing
    dead = tmp_path / f".b.{DEAD_PID}.1.tmp"
    old = tmp_path / f".c.{os.getpid()}.2.tmp"  # a reused pid: stale by age
    other = tmp_path / "d.tmp"  # not write_atomic's: not ours to remove
    for p in (live, dead, old, other):
        p.write_bytes(b"x")
    os.utime(old, (1, 1))
    assert atomic.remove_stale_temps(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def test_a_jax_without_the_cache_hook_keeps_its_own_cache_with_one_warning(tmp_path, monkeypatch, caplog):
    """The healing cache replaces a private factory of the pinned jax; a jax that lacks it (the GPU
    image's newer one, say) must still start, on JAX's own cache, saying so once."""
    from jax._src import compilation_cache as cc

    from d3d_jax import compile_cache

    before = cc.get_file_cache
    monkeypatch.delattr(cc, "VerificationCache")
    with caplog.at_level("WARNING", logger="d3d_jax.compile_cache"):
        compile_cache._install(str(tmp_path))
    assert cc.get_file_cache is before  # JAX's own factory, untouched
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "lacks the hook" in lines[0], lines
