"""The program store (``decoding/programs.py``) against damaged and read-only directories: an
entry that is a directory, a symlink loop or wrong content is logged, removed and compiled again,
whether a call (a round, an admission) or the background preload meets it; a read-only store is
read; two starts at once share one store.  References: numpy (or the closed form) for the values,
the store's own counts for what it did."""

from __future__ import annotations

import os
import pickle
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from d3d_jax.decoding import programs as programs_module
from d3d_jax.decoding.programs import SUFFIX, ProgramStore

SALT = {"test": "damage"}


def _f(x):
    return x * 3 + 1


def _call(store: ProgramStore) -> None:
    out = store.jit(_f, name="f")(jnp.arange(4.0))
    np.testing.assert_array_equal(np.asarray(out), np.arange(4.0) * 3 + 1)


def _entry(tmp_path):
    first = ProgramStore(tmp_path, SALT)
    _call(first)
    (path,) = first.dir.glob(f"*{SUFFIX}")
    return path


def _directory(path):
    path.unlink()
    (path / "inner").mkdir(parents=True)


def _loop(path):
    path.unlink()
    path.symlink_to(path)  # reading it: ELOOP


def _garbage(path):
    path.write_bytes(os.urandom(300))


def _wrong_types(path):
    path.write_bytes(zlib.compress(pickle.dumps(dict(name=5, key_text=None, blob="x", in_tree=None,
                                                     out_tree=None, device_ids=7))))


DAMAGE = [_directory, _loop, _garbage, _wrong_types]


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__ for d in DAMAGE])
def test_a_damaged_entry_met_by_a_call_is_removed_and_compiled_again(tmp_path, damage, caplog):
    path = _entry(tmp_path)
    damage(path)
    store = ProgramStore(tmp_path, SALT)
    _call(store)  # was: IsADirectoryError / OSError out of every call of that program
    assert store.counts["damaged"] == 1 and store.counts["compiled"] == 1, store.counts
    assert path.is_file() and not path.is_symlink(), "the rebuilt program was not stored"
    assert "removed, compiling it again" in caplog.text
    again = ProgramStore(tmp_path, SALT)
    _call(again)
    assert again.counts["loaded"] == 1 and again.counts["compiled"] == 0, again.counts


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__ for d in DAMAGE])
def test_preload_skips_and_removes_a_damaged_entry(tmp_path, damage):
    path = _entry(tmp_path)
    damage(path)
    store = ProgramStore(tmp_path, SALT)
    assert store.preload() == 0  # was: the preload thread died with a traceback
    assert store.counts["damaged"] == 1 and not os.path.lexists(path)
    _call(store)
    assert store.counts["compiled"] == 1


def test_a_read_only_store_is_read_not_thrown_away(tmp_path, monkeypatch, caplog):
    """A pre-warmed image mounted read-only: its programs load; new ones stay in memory."""
    _entry(tmp_path)

    def refuse(*_a, **_k):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(programs_module.os, "utime", refuse)
    monkeypatch.setattr(ProgramStore, "_write", lambda self, path, entry: refuse())
    store = ProgramStore(tmp_path, SALT)
    assert store.enabled and "read-only" in caplog.text
    _call(store)
    assert store.counts["loaded"] == 1 and store.counts["compiled"] == 0, store.counts
    out = store.jit(lambda x: x - 2, name="g")(jnp.arange(3.0))  # a new program: compiled, not stored
    np.testing.assert_array_equal(np.asarray(out), np.arange(3.0) - 2)
    assert store.counts["compiled"] == 1 and store.counts["stored"] == 0


CONCURRENT = r"""
import json, sys
import jax.numpy as jnp
from d3d_jax.decoding.programs import ProgramStore
store = ProgramStore(sys.argv[1], {"test": "concurrent"})
outs = []
for k in range(4):
    prog = store.jit(lambda x, k=k: x * (k + 2), name=f"p{k}")
    outs.append(prog(jnp.arange(3.0)).tolist())
print(json.dumps(dict(outs=outs, counts=store.counts)))
"""


def test_two_starts_at_the_same_moment_share_one_store(tmp_path):
    """Two servers started together on one cache directory: both start, and a third reads every
    program they wrote (atomic writes, no torn entry)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    run = lambda: subprocess.Popen([sys.executable, "-c", CONCURRENT, str(tmp_path)],  # noqa: E731
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    expect = [[float(v) * (k + 2) for v in range(3)] for k in range(4)]
    procs = [run(), run()]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["outs"] == expect
    third = run()
    out, err = third.communicate(timeout=300)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["outs"] == expect and result["counts"]["compiled"] == 0 and result["counts"]["damaged"] == 0, result
