"""What a training step triggers besides its update: one schedule of events (log, eval, save,
stop), each a small function of the trainer and the fit's running state (:class:`FitRun`).

The last step and a stop signal (SIGTERM / SIGINT) trigger a log and a save; ``log_every``,
``eval_every`` and ``checkpoint_every`` steps trigger theirs; eval runs only with dev data.  A
save logs first, and its metrics lines are on disk before the checkpoint is written: a resume
from it, after a kill, finds every step it holds logged once.  The events of one step run in
:data:`EVENTS` order (the run's export is :func:`loop.run`'s)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax


@dataclasses.dataclass
class FitRun:
    """One ``fit`` call's state between steps."""

    until: int  # the step it trains to
    tokens_per_step: int
    stop: Any  # the installed StopSignals
    bar: Any = None  # a tqdm progress bar, or None
    pending: list = dataclasses.field(default_factory=list)  # (step, device metrics) not yet logged
    records: list = dataclasses.field(default_factory=list)  # what this call logged
    t_last: float = dataclasses.field(default_factory=time.time)  # when the last log was written
    steps_since: int = 0  # steps since then


def due(trainer, run: FitRun) -> list[str]:
    """The events the step just taken triggers, in the order they run (asks the stop signals
    once: call it once per step)."""
    tc, step = trainer.cfg.train, trainer.step
    done, stopping = step == run.until, run.stop.should_stop(step)

    def every(n: int) -> bool:
        return bool(n) and step % n == 0

    save = done or stopping or every(tc.checkpoint_every)
    wanted = {"log": save or every(tc.log_every),  # steps not logged before a save were lost to a kill
              "eval": bool(trainer.dev_batches) and (done or every(tc.eval_every)),
              "save": save,
              "stop": stopping}
    return [name for name in EVENTS if wanted[name]]


def log(trainer, run: FitRun) -> None:
    """Every step's metrics since the last log (one device read), tokens/s on the newest."""
    fetched = jax.device_get(run.pending)
    new = [{"step": s, **{k: float(v) for k, v in m.items()}} for s, m in fetched]
    new[-1]["tokens_per_s"] = run.tokens_per_step * run.steps_since / max(time.time() - run.t_last, 1e-9)
    for r in new:
        trainer.write_metrics(r)
    run.records.extend(new)
    if run.bar is not None:
        run.bar.set_postfix(loss=f"{new[-1]['loss']:.4f}", tok_s=f"{new[-1]['tokens_per_s']:.0f}")
    run.pending, run.t_last, run.steps_since = [], time.time(), 0


def evaluate(trainer, run: FitRun) -> None:
    ev = trainer.evaluate()
    trainer.write_metrics({"step": trainer.step, **ev})
    trainer.log(f"step {trainer.step}: " + ", ".join(f"{k}={v:.4f}" for k, v in ev.items() if isinstance(v, float)))


def save(trainer, run: FitRun) -> None:
    trainer.sync_metrics()  # the lines of the steps it holds, on disk before the checkpoint is
    trainer.save_checkpoint()


def stop(trainer, run: FitRun) -> None:
    """A signal asked to stop: the step is saved (``save`` ran first); ``fit`` returns."""
    trainer.stop_signal = run.stop.signum
    trainer.log(f"{run.stop.name}: saved a checkpoint at step {trainer.step} and stopped; "
                f"rerun the same command to resume")


EVENTS: dict[str, Callable] = {"log": log, "eval": evaluate, "save": save, "stop": stop}
