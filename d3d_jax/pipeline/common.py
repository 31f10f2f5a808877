"""What every stage module and :class:`~d3d_jax.pipeline.context.Context` share: the log line,
whole-or-nothing JSON writes and the dev split's size."""

from __future__ import annotations

import json
import time
from pathlib import Path

DEV_BATCHES = 8  # × drafter_batch_size rows × drafter_num_anchors: 1024 dev anchors in the demo


def log(msg: str) -> None:
    print(f"[pipeline {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=float))
    tmp.replace(path)  # whole or not at all: a crashed stage is redone, never half-skipped
