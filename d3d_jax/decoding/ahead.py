"""Compile-ahead: a warm-up's programs compiled several at once with nothing run
(:meth:`~d3d_jax.decoding.programs.ProgramStore.ahead`).

Inside :func:`compile_ahead`, a :class:`~d3d_jax.decoding.programs.Program` call lowers its
program on the calling thread (tracing holds the GIL), hands the compile to a worker (XLA
releases it) and returns its outputs' *types*, which the next call of the warm-up lowers with.
A cold start's compiles then overlap instead of queueing one behind the other.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax

log = logging.getLogger("d3d_jax.programs")

# compiles run at once: one per core, at most 4 (each holds its HLO and LLVM's state in memory;
# a GPU compile's own ptxas runs are threaded already)
AHEAD_WORKERS = max(1, min(4, os.cpu_count() or 1))


def compile_ahead(store, warm: Callable[[], Any], workers: int | None = None) -> int:
    """Run ``warm`` in ``store``'s compile-ahead mode on this thread: each program it would
    compile is compiled by a worker, each call returns its outputs' types (arrays on one device:
    the inputs' device; otherwise the compile happens on this thread, to learn where they go).
    Returns when every compile has finished, each kept as a call keeps it; how many were
    compiled.  Host code in ``warm`` that reads a value stops the pass (logged): what it did not
    reach compiles when it is run."""
    store._ahead.jobs = jobs = {}
    pool = ThreadPoolExecutor(max(1, int(workers or AHEAD_WORKERS)), thread_name_prefix="d3d-compile")
    try:
        store._ahead.pool = pool
        warm()
    except Exception as e:  # noqa: BLE001 - a host read of a type: the run compiles the rest
        log.warning("program store: compile-ahead stopped (%s: %s); the rest compiles when run",
                    type(e).__name__, e)
    finally:
        store._ahead.jobs = store._ahead.pool = None
        pool.shutdown(wait=True)
    done = 0
    for future, _ in jobs.values():
        try:
            done += bool(future.result())
        except Exception as e:  # noqa: BLE001 - the run compiles it again and raises there
            log.warning("program store: a compile-ahead failed (%s: %s)", type(e).__name__, e)
    return done


def one_device(leaves: list):
    """The one single-device sharding of the array arguments (None: none, or several)."""
    shardings = {x.sharding for x in leaves if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
                 and x.sharding is not None}
    if len(shardings) != 1:
        return None
    (sharding,) = shardings
    return sharding if isinstance(sharding, jax.sharding.SingleDeviceSharding) else None


def output_types(out_info, sharding=None):
    """Output types to lower the next program with: each with its sharding (the compile's, or
    ``sharding`` for a lowering's, which has none); None if neither says."""
    leaves, tree = jax.tree.flatten(out_info)
    if any(getattr(o, "sharding", None) is None for o in leaves) and sharding is None:
        return None
    return jax.tree.unflatten(tree, [
        jax.ShapeDtypeStruct(o.shape, o.dtype, weak_type=bool(getattr(o, "weak_type", False)),
                             sharding=getattr(o, "sharding", None) or sharding) for o in leaves])
