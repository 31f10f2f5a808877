"""Simulated acceptance, for benchmarks only (SGLang's ``SGLANG_SIMULATE_ACC_LEN``, vLLM's
``rejection_sample_method='synthetic'``).

Random weights make real acceptance meaningless, and a replay drafter does not hold τ in bf16 (1-
and 16-token forwards round differently, so greedy output drifts from the reference it replays).
:class:`SimulatedAcceptance` instead runs the FULL real verify and then overwrites its outcome:

* ``accept``: the acceptance length by a seeded schedule with mean τ (SGLang's ``match-expected``:
  ``floor`` or ``ceil`` of ``τ - 1`` accepted drafts, weighted to hit the mean), drawn per row and
  round, keyed by (simulation seed, row key, anchor position): runs are reproducible and a row's
  schedule does not depend on its batch.  Token values are ignored; the committed tokens are the
  drafts and the real target token.
* ``hit`` (async): the branch hit flag by a seeded coin with rate ``hit_rate``, and the branch
  consistent with the simulated length (the first alternative at rejection slot ``a + 1``).

The result is tied to the real one (``where(real < 0, real, simulated)``, never true), so XLA
cannot drop the real computation: the verify costs what it costs without the override
(:func:`verify_cost_comparison` shows it from the compiled cost analysis).

It is reachable only through ``infer/bench.py gpu|engine|async --simulate-tau/--simulate-hit-rate``,
which pass it as the decoder's ``acceptance_override`` (``DecoderConfig``, or the
``acceptance_override=`` option of ``engine.generate``); it carries ``benchmark_only = True``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from d3d_jax.decoding import verify as V

SALT_SIM_ACCEPT = 6  # verify.py uses salts 0..4, drafting.SALT_HIT 5
SALT_SIM_HIT = 7
SCHEDULE = "match-expected"


class SimulationError(ValueError):
    """Bad simulated-acceptance settings (named in the message)."""


@dataclasses.dataclass(frozen=True)
class SimulatedAcceptance:
    """A benchmark-only ``acceptance_override`` (a DecoderConfig field): mean acceptance length
    ``tau`` (τ = accepted drafts + 1, in [1, block size]) and async ``hit_rate`` in [0, 1]
    (None: the benchmark has no async rounds)."""

    tau: float
    hit_rate: float | None = None
    seed: int = 0
    benchmark_only: ClassVar[bool] = True  # the decoder refuses overrides without this marker

    def __post_init__(self):
        if not (isinstance(self.tau, (int, float)) and math.isfinite(self.tau) and self.tau >= 1.0):
            raise SimulationError(f"--simulate-tau must be a number >= 1 (τ = accepted + 1), got {self.tau!r}")
        if self.hit_rate is not None and not (isinstance(self.hit_rate, (int, float))
                                              and 0.0 <= self.hit_rate <= 1.0):
            raise SimulationError(f"--simulate-hit-rate must be in [0, 1], got {self.hit_rate!r}")
        if int(self.seed) != self.seed or self.seed < 0:
            raise SimulationError(f"simulation seed must be an integer >= 0, got {self.seed!r}")
        object.__setattr__(self, "tau", float(self.tau))
        object.__setattr__(self, "hit_rate", None if self.hit_rate is None else float(self.hit_rate))
        object.__setattr__(self, "seed", int(self.seed))

    def check_block(self, block_size: int, asynchronous: bool = False) -> None:
        """τ must fit the block: ≤ B (sync), ≤ B - 2 (async: a shortened block after an
        all-accept hit has B - 2 real drafts, and every simulated outcome must be reachable)."""
        if asynchronous and self.hit_rate is None:
            raise SimulationError("async rounds need --simulate-hit-rate with --simulate-tau")
        top = block_size - 2 if asynchronous else block_size
        if self.tau > top:
            mode = "async rounds" if asynchronous else "a block"
            raise SimulationError(f"--simulate-tau {self.tau} is above {top}, the largest mean "
                                  f"acceptance length of {mode} of size {block_size}")

    def record(self) -> dict:
        """What every benchmark result records about the simulation."""
        return {"tau": self.tau, "hit_rate": self.hit_rate, "seed": self.seed, "schedule": SCHEDULE}

    def describe(self) -> str:
        return header(self.record())

    # -- device side -------------------------------------------------------------------
    def _uniform(self, row_keys: jax.Array, anchor_pos: jax.Array, salt: int) -> jax.Array:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, self.seed))(row_keys)
        return V.uniform_keyed(V.position_keys(keys, anchor_pos[:, None], salt))[:, 0]

    def lengths(self, anchor_pos: jax.Array, row_keys: jax.Array, width: int) -> jax.Array:
        """Simulated accepted drafts ``[b]``: ``floor(τ-1)`` or ``+1`` with the fractional part's
        probability, clipped to ``[0, width-1]``."""
        mean = min(self.tau - 1.0, width - 1.0)
        lo = math.floor(mean)
        up = self._uniform(row_keys, anchor_pos, SALT_SIM_ACCEPT) < jnp.float32(mean - lo)
        return jnp.minimum(lo + up.astype(jnp.int32), width - 1).astype(jnp.int32)

    def accept(self, accepted, next_token, anchor_pos, row_keys, width):
        """After the real rule: the simulated acceptance length; the target token is kept."""
        sim = self.lengths(anchor_pos, row_keys, width)
        return jnp.where(accepted < 0, accepted, sim).astype(jnp.int32), next_token

    def hit(self, hit, branch, accepted, next_token, anchor_pos, row_keys, layout):
        """After the real branch matching: hit by a coin, branch at rejection slot ``a + 1``
        (its first alternative).  Past the last branch position no branch exists: a miss."""
        del next_token
        if self.hit_rate is None:
            raise SimulationError("async rounds need --simulate-hit-rate with --simulate-tau")
        coin = self._uniform(row_keys, anchor_pos, SALT_SIM_HIT) < jnp.float32(self.hit_rate)
        has_branch = accepted + 1 <= layout.positions - 1
        sim_branch = jnp.clip(accepted, 0, max(layout.positions - 2, 0)) * layout.fanout
        sim_hit = coin & has_branch
        sim_hit = jnp.where(branch < 0, hit, sim_hit)  # tie: keeps the real matching alive
        return sim_hit, jnp.where(sim_hit, sim_branch, branch).astype(jnp.int32)


# --------------------------------------------------------------------------------------
# Benchmark flags
# --------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser, tau: float | None = None,
                  hit_rate: float | None = None) -> None:
    g = p.add_argument_group("simulated acceptance (benchmarks only; recorded in every result)")
    g.add_argument("--simulate-tau", type=float, default=tau, metavar="TAU",
                   help="run the real verify, then accept by a seeded schedule with mean τ"
                        + (f" (default {tau})" if tau is not None else " (default: off)"))
    g.add_argument("--simulate-hit-rate", type=float, default=hit_rate, metavar="H",
                   help="async: branch hits by a seeded coin with this rate"
                        + (f" (default {hit_rate})" if hit_rate is not None else ""))
    g.add_argument("--simulate-seed", type=int, default=0)


def from_args(args: argparse.Namespace, *, hits: bool = True) -> SimulatedAcceptance | None:
    """The override the flags ask for, or None; ``hits=False``: the benchmark has no async rounds."""
    tau, h = args.simulate_tau, args.simulate_hit_rate
    if tau is None:
        if h is not None:
            raise SimulationError("--simulate-hit-rate needs --simulate-tau")
        return None
    if h is not None and not hits:
        raise SimulationError("--simulate-hit-rate: this benchmark runs no async rounds "
                              "(use infer/bench.py async or gpu)")
    return SimulatedAcceptance(tau, h, args.simulate_seed)


def record(sim: SimulatedAcceptance | None) -> dict | None:
    return None if sim is None else sim.record()


def header(rec: dict | SimulatedAcceptance | None) -> str:
    """A table's header line from a result's ``simulated_acceptance`` record (or the object)."""
    if isinstance(rec, SimulatedAcceptance):
        rec = rec.record()
    if rec is None:
        return "real acceptance (no simulation)"
    hits = "unused" if rec["hit_rate"] is None else f"{rec['hit_rate']:g}"
    return (f"SIMULATED acceptance ({rec['schedule']}): tau {rec['tau']:g}, hit rate {hits}, "
            f"seed {rec['seed']}; the real verify runs, token values are ignored")


# --------------------------------------------------------------------------------------
# Cost of the verify with and without the override
# --------------------------------------------------------------------------------------
def cost_summary(compiled) -> dict:
    """flops and bytes accessed of a compiled executable (a dict, or a list of one per module
    in older jax versions)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {"flops": float(ca.get("flops", float("nan"))),
            "bytes_accessed": float(ca.get("bytes accessed", float("nan")))}


def _interleaved_median_ms(fns: dict, repeats: int) -> dict:
    """Median ms of each blocking callable, timed in alternation (load drifts hit all alike)."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def verify_cost_comparison(target, sim: SimulatedAcceptance, *, block_size: int = 16,
                           context: int = 64, cache_len: int | None = None,
                           repeats: int = 5) -> dict:
    """Compile the decode core's verify (target forward over a block after ``context`` cached
    tokens, the rule, the override) with and without ``sim`` on one state; compare the compiled
    cost analysis and the median time (the two timed in alternation)."""
    import dataclasses as dc

    from flax import nnx

    from d3d_jax.decoding.core import DecodeCore

    from d3d_jax.model.qwen3 import unstacked

    graphdef, t_params = nnx.split(unstacked(target))  # as a decoder runs it
    cache_len = cache_len or -(-(context + 2 * block_size) // 16) * 16
    drafts = jnp.asarray(np.random.default_rng(0).integers(0, target.config.vocab_size,
                                                           (1, block_size - 1)), jnp.int32)
    out, calls, state = {}, {}, None
    for name, override in (("real", None), ("simulated", sim)):
        core = DecodeCore(graphdef, target.config, None, width=block_size, cache_len=cache_len,
                          override=override)
        if state is None:  # one active row whose anchor sits after `context` cached tokens
            state = jax.jit(core.init_state, static_argnums=0)(1)
            ctx = jnp.full((1,), context, jnp.int32)
            state = dc.replace(state, done=jnp.zeros((1,), bool), anchor_pos=ctx,
                               target_cache=state.target_cache.with_lengths(ctx))
        verify = jax.jit(lambda tp, st, d, core=core: core.verify(tp, st, d, d, None))
        compiled = verify.lower(t_params, state, drafts).compile()
        out[name] = cost_summary(compiled)
        calls[name] = lambda c=compiled: c(t_params, state, drafts)
        calls[name]()  # warm-up
    for name, ms in _interleaved_median_ms(calls, repeats).items():
        out[name]["ms"] = ms
    out["flops_ratio"] = out["simulated"]["flops"] / out["real"]["flops"]
    out["bytes_ratio"] = out["simulated"]["bytes_accessed"] / out["real"]["bytes_accessed"]
    out["time_ratio"] = out["simulated"]["ms"] / out["real"]["ms"]
    return out
