"""Multi-process start-up: ``jax.distributed.initialize`` before anything else touches JAX.

``jax.distributed.initialize`` must run before the first call that starts a backend (even
``jax.device_count()``, which building a config with ``num_devices: 0`` does), so the programs
in ``train/`` call :func:`maybe_initialize_distributed` first thing.  It reads its settings from
the environment, in this order:

* ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``: explicit, as
  ``train/launch_local.py`` sets them, or a cluster you wire by hand (e.g. a GPU cluster without
  SLURM: the same three variables on every host, the address being host 0's);
* ``D3D_DISTRIBUTED=1`` (or ``JAX_COORDINATOR_ADDRESS`` alone): ``jax.distributed.initialize()``
  with no arguments, and JAX detects the rest (a Cloud TPU pod slice from the TPU metadata
  server, a SLURM job step, Open MPI, Kubernetes);
* otherwise nothing: a single-process run.  Being inside a SLURM or MPI job is not enough: a
  single-process program (or a test run) there must not try to join a cluster.

This module imports nothing but JAX itself, so importing it starts no backend.
"""

from __future__ import annotations

import os
from typing import Mapping

import jax

EXPLICIT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def distributed_settings(environ: Mapping[str, str] = os.environ) -> dict | None:
    """The ``jax.distributed.initialize`` keyword arguments this environment asks for, or None
    when it describes a single-process run (see the module docstring)."""
    if all(environ.get(k) for k in EXPLICIT):
        try:
            n, pid = int(environ["JAX_NUM_PROCESSES"]), int(environ["JAX_PROCESS_ID"])
        except ValueError:
            raise ValueError(f"JAX_NUM_PROCESSES={environ['JAX_NUM_PROCESSES']!r} / JAX_PROCESS_ID="
                             f"{environ['JAX_PROCESS_ID']!r}: both must be integers") from None
        if not 0 <= pid < n:
            raise ValueError(f"JAX_PROCESS_ID={pid} is not in [0, JAX_NUM_PROCESSES={n})")
        return dict(coordinator_address=environ["JAX_COORDINATOR_ADDRESS"], num_processes=n, process_id=pid)
    if environ.get("D3D_DISTRIBUTED", "") not in ("", "0") or environ.get("JAX_COORDINATOR_ADDRESS"):
        return {}
    return None


def maybe_initialize_distributed(environ: Mapping[str, str] = os.environ) -> bool:
    """Join the multi-process run the environment describes; True when running distributed.
    Call before any other JAX call (a started backend cannot join a cluster any more)."""
    if jax.distributed.is_initialized():
        return True
    settings = distributed_settings(environ)
    if settings is None:
        return False
    # CPU processes exchange collectives over gloo (TCP); the setting only concerns CPU clients.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**settings)
    return True
