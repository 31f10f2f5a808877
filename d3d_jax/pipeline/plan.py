"""The stage list: each stage a name, a check that its output is there, and the function of the
:class:`~d3d_jax.pipeline.context.Context` that builds it, run in order and skipped when built.
The top of the package: it imports the stages, none of them imports it."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

from d3d_jax.pipeline import benchmark, drafters, online, pretraining, prune, regeneration
from d3d_jax.pipeline.common import log
from d3d_jax.pipeline.context import Context


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    done: Callable[[Context], bool]  # read when the stage's turn comes: an earlier stage changes it
    build: Callable[[Context], None]


def _exists(path_of: Callable[[Context], object]) -> Callable[[Context], bool]:
    return lambda ctx: path_of(ctx).exists()


def stages(ctx: Context) -> list[Stage]:
    """Stages 1-7 in order (the benchmark, 8, is :func:`run`'s last step)."""
    c = ctx.cfg
    out = [Stage("1-tokenizer", _exists(lambda x: x.tokenizer_dir / "tokenizer.json"), pretraining.train_tokenizer),
           Stage("2-pretrain-target", _exists(lambda x: x.model_dir("target") / "config.json"),
                 functools.partial(pretraining.pretrain, name="target", stage=c.target)),
           # The small model only seeds drafters; once they exist it is not needed (nor shipped).
           Stage("3-pretrain-small", lambda x: (x.model_dir("small") / "config.json").exists()
                 or not drafters.small_needed(x), functools.partial(pretraining.pretrain, name="small", stage=c.small)),
           # The training split ships (a drafter retrains without regenerating); once every
           # drafter exists only dev is needed, so a checkout without it runs nothing here.
           Stage("4-regenerate", lambda x: x.regen_split("dev").exists()
                 and (x.regen_split("train").exists() or drafters.all_trained(x)), regeneration.regenerate)]
    out += [Stage(f"5-drafter-{v.name}", _exists(lambda x, v=v: x.drafter_dir(v.name) / "result.json"),
                  functools.partial(drafters.train_drafter, v=v)) for v in c.drafters]
    if c.prune_drafter:
        out.append(Stage("6-prune", _exists(lambda x: x.prune_dir / "result.json"), prune.prune))
    out.append(Stage("7-online-tau", online.measured, online.measure_online))
    return out


def missing(ctx: Context) -> list[str]:
    """The stages whose output is not under out_dir now (none, for the shipped artifacts and
    their config: ``make demo`` then runs only the benchmark)."""
    return [s.name for s in stages(ctx) if not s.done(ctx)]


def _run_stage(ctx: Context, stage: Stage) -> None:
    if stage.done(ctx):
        log(f"stage {stage.name}: output exists, skipped")
        return
    log(f"stage {stage.name}: running")
    t0 = time.time()
    stage.build(ctx)
    ctx.timings[stage.name] = time.time() - t0
    log(f"stage {stage.name}: done in {ctx.timings[stage.name]:.0f}s")


def run(ctx: Context, evaluate: bool = True) -> dict | None:
    """Every stage in order, then the benchmark (its report; None without ``evaluate``)."""
    for stage in stages(ctx):
        _run_stage(ctx, stage)
    drafters.unship_weights(ctx)
    return benchmark.benchmark(ctx) if evaluate else None
