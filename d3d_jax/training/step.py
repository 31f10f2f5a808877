"""The pure functions the training loop jits: one train step, one evaluation step, and the
shardings of their inputs.

``train_step(graphdef, tx, loss_fn, schedule, totals_fn, state, batch, extra) -> (state, metrics)``
takes the train state ``{params, rest, opt_state, step}`` (pure arrays, donated by the caller);
gradient accumulation over ``[accum, micro, ...]`` batches is exact (:func:`accumulate_grads`), and
a step whose loss or gradient norm is not finite changes nothing (:func:`keep_if_finite`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from d3d_jax.parallel import sharding as shd
from d3d_jax.training import data as data_lib
from d3d_jax.training import objectives as obj

LossFn = Callable[..., tuple[jax.Array, dict]]


def batch_shardings(batch: dict, mesh: Mesh, rules=None) -> dict:
    """Accumulation-major batches ``[accum, micro, ...]``: the micro-batch dim on data×fsdp."""
    rd = shd.rules_dict(rules)
    return {k: NamedSharding(mesh, shd.logical_to_spec((None, "batch") + (None,) * (v.ndim - 2), v.shape,
                                                       mesh, rd)) for k, v in batch.items()}


def accumulate_grads(loss_of: Callable, totals_fn: Callable[[dict], dict], params, batch: dict):
    """``(grads, metrics)`` of an accumulation-major batch ``[accum, micro, ...]``.

    Every micro-batch is normalised by the *whole* batch's token weights (``totals_fn(batch)``,
    see :data:`objectives.LOSS_TOTALS`), so summing the micro-batches' losses, metrics and
    gradients gives exactly the whole batch's ``Σw·CE/Σw``, also when micro-batches carry
    unequal weights (averaging their ratios would not).
    """
    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    totals = totals_fn(batch)
    with_totals = lambda mb: {**mb, obj.LOSS_TOTALS: totals}
    if jax.tree.leaves(batch)[0].shape[0] == 1:
        (_, metrics), grads = grad_fn(params, with_totals(jax.tree.map(lambda x: x[0], batch)))
        return grads, metrics

    def body(carry, mb):
        (_, m), g = grad_fn(params, with_totals(mb))
        return jax.tree.map(jnp.add, carry, (g, m)), None

    (_, m0), g0 = jax.eval_shape(grad_fn, params, with_totals(jax.tree.map(lambda x: x[0], batch)))
    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (g0, m0))
    return jax.lax.scan(body, zero, batch)[0]


def train_step(graphdef, tx: optax.GradientTransformation, loss_fn: LossFn, schedule, totals_fn,
               state, batch, extra):
    params, rest = state["params"], state["rest"]

    def loss_of(p, mb):
        m = nnx.merge(graphdef, p, rest)
        return loss_fn(m, mb) if extra is None else loss_fn(m, mb, extra)

    grads, metrics = accumulate_grads(loss_of, totals_fn, params, batch)
    metrics = dict(metrics)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["learning_rate"] = schedule(state["step"])
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    params = optax.apply_updates(params, updates)
    return keep_if_finite(state, dict(params=params, rest=rest, opt_state=opt_state, step=state["step"] + 1),
                          metrics)


def keep_if_finite(old: dict, new: dict, metrics: dict) -> tuple[dict, dict]:
    """``new`` only if the step's loss and gradient norm are finite, else ``old`` — and ``old`` from
    then on: a negative ``step`` marks the halt, so no batch after the bad one trains either while
    the host has not looked yet.  ``metrics["finite"]`` tells the host (:meth:`Trainer.check_finite`)."""
    finite = jnp.isfinite(metrics["grad_norm"])
    if "loss" in metrics:
        finite &= jnp.isfinite(metrics["loss"])
    running = old["step"] >= 0
    ok = finite & running
    state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    state["step"] = jnp.where(ok, new["step"], jnp.where(running, -old["step"] - 1, old["step"]))
    return state, {**metrics, "finite": ok}


def eval_step(graphdef, mode: str, gamma: float, ar_weight: float, block_size: int, state, batch):
    model = nnx.merge(graphdef, state["params"], state["rest"])
    logits = model(batch["tokens"], data_lib.batch_meta(batch))
    if mode == "lm":
        _, m = obj.lm_loss_from_logits(logits, batch)
        return m
    _, m = obj.d3d_loss_from_logits(logits, batch, gamma, ar_weight)
    return {**m, **obj.tau_from_logits(logits, batch, block_size)}
