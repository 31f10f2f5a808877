#!/usr/bin/env python
"""Run a program as N JAX processes on this machine, each with its own simulated CPU devices.

    python train/launch_local.py --num-processes 2 --devices-per-process 4 -- \\
        train/train_drafter.py --config configs/train/tiny.yaml train.out_dir=runs/tiny-2proc

Each process gets ``JAX_COORDINATOR_ADDRESS`` (a free localhost port; process 0 hosts the
coordinator), ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` and, before JAX starts in it,
``--xla_force_host_platform_device_count``; the program calls
:func:`d3d_jax.parallel.distributed.maybe_initialize_distributed` first (``train_drafter.py``
and ``prune_drafter.py`` do), which selects gloo CPU collectives and runs
``jax.distributed.initialize``.  Output lines are prefixed ``[pI]``.  The launcher exits with
the first non-zero exit status; when one process fails or ``--timeout`` passes, it stops the
others (a process that waits for a dead peer would otherwise hang until JAX's own timeouts).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(i: int, n: int, devices: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i),
               JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return env


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(f"{prefix}{line}")
        sink.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(program: list[str], num_processes: int = 2, devices_per_process: int = 4, port: int = 0,
           timeout: float | None = None, sink=None) -> int:
    """Start ``python program...`` ``num_processes`` times and wait; the first failing exit status
    (124 on timeout), else 0."""
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError("num_processes and devices_per_process must be >= 1")
    if not program:
        raise ValueError("no program to launch (put it after --)")
    sink = sink or sys.stdout
    port = port or free_port()
    procs, pumps = [], []
    for i in range(num_processes):
        p = subprocess.Popen([sys.executable, *program], cwd=REPO, env=process_env(i, num_processes,
                             devices_per_process, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1)
        procs.append(p)
        pumps.append(threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", sink), daemon=True))
        pumps[-1].start()
    deadline = None if timeout is None else time.time() + timeout
    status = 0
    try:
        while None in (codes := [p.poll() for p in procs]):  # poll every process, every time
            failed = [c for c in codes if c not in (None, 0)]
            if failed or (deadline is not None and time.time() > deadline):
                status = failed[0] if failed else 124
                sink.write(f"[launch] {'a process exited with ' + str(status) if failed else 'timed out'}; "
                           f"stopping the others\n")
                break
            time.sleep(0.2)
    finally:
        _stop(procs)
        for t in pumps:
            t.join(timeout=5)
    return status or next((p.returncode for p in procs if p.returncode), 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-processes", "-n", type=int, default=2)
    ap.add_argument("--devices-per-process", type=int, default=4, help="simulated CPU devices per process")
    ap.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before every process is stopped")
    ap.add_argument("program", nargs=argparse.REMAINDER, help="-- script.py [its arguments]")
    args = ap.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        ap.error("name the program to run after --, e.g. -- train/train_drafter.py --config ...")
    return launch(program, args.num_processes, args.devices_per_process, args.port, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
