"""Optimisers: AdamW and 8-bit AdamW, warm-up + cosine schedule, clipping (spec §2.5).

8-bit AdamW (the paper's optimiser) is an optax ``GradientTransformation`` whose two moments are
*stored* block-wise quantised and *used* in float32: each step dequantises, applies the exact
AdamW update in float32, and re-quantises.  Blocks run along a parameter's last axis (so a
moment keeps its parameter's shape and sharding), each with one float32 absmax scale:

* first moment ``m`` (signed): int8 codes of ``sign(u)·sqrt(|u|)``, ``u = m / absmax`` – the
  square-root companding spends the 255 levels where Adam's moments live (near zero), like the
  dynamic maps of bitsandbytes;
* second moment ``v`` (non-negative): uint8 codes of ``(v / absmax)^(1/4)``, i.e. ``sqrt(v)``
  (the quantity the update divides by) with square-root companding again.

State per parameter entry: 2 bytes + 8 bytes per block, against 8 bytes for float32 AdamW.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from d3d_jax.config import OptimConfig


# --------------------------------------------------------------------------------------
# Block-wise quantisation along the last axis
# --------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedArray:
    codes: jax.Array  # int8 (signed) or uint8 (unsigned), the parameter's shape
    scales: jax.Array  # float32 [..., num_blocks]: absmax of each block of the last axis

    @property
    def shape(self):
        return self.codes.shape

    def nbytes(self) -> int:
        return int(self.codes.size * self.codes.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize)


def _blocks(x: jax.Array, block: int) -> tuple[jax.Array, int]:
    """``x [..., n]`` -> ``[..., nb, block]`` (zero-padded) and ``n``."""
    x = x.reshape((1,) if x.ndim == 0 else x.shape)
    n = x.shape[-1]
    block = min(block, n)
    nb = -(-n // block)
    pad = nb * block - n
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], nb, block), n


def _unblocks(xb: jax.Array, n: int, shape) -> jax.Array:
    return xb.reshape(*xb.shape[:-2], -1)[..., :n].reshape(shape)


def quantize_signed(x: jax.Array, block: int) -> QuantizedArray:
    xb, n = _blocks(x.astype(jnp.float32), block)
    scale = jnp.max(jnp.abs(xb), axis=-1)
    u = xb / jnp.where(scale > 0, scale, 1.0)[..., None]
    codes = jnp.round(jnp.sign(u) * jnp.sqrt(jnp.abs(u)) * 127.0).astype(jnp.int8)
    return QuantizedArray(_unblocks(codes, n, x.shape), scale)


def dequantize_signed(q: QuantizedArray, block: int) -> jax.Array:
    cb, n = _blocks(q.codes.astype(jnp.float32) / 127.0, block)
    return _unblocks(jnp.sign(cb) * cb * cb * q.scales[..., None], n, q.codes.shape)


def quantize_unsigned(x: jax.Array, block: int) -> QuantizedArray:
    xb, n = _blocks(x.astype(jnp.float32), block)
    scale = jnp.max(xb, axis=-1)
    u = xb / jnp.where(scale > 0, scale, 1.0)[..., None]
    codes = jnp.round(jnp.sqrt(jnp.sqrt(jnp.maximum(u, 0.0))) * 255.0).astype(jnp.uint8)
    return QuantizedArray(_unblocks(codes, n, x.shape), scale)


def dequantize_unsigned(q: QuantizedArray, block: int) -> jax.Array:
    cb, n = _blocks(q.codes.astype(jnp.float32) / 255.0, block)
    c2 = cb * cb
    return _unblocks(c2 * c2 * q.scales[..., None], n, q.codes.shape)


# --------------------------------------------------------------------------------------
# 8-bit Adam (scale_by_adam with quantised moments)
# --------------------------------------------------------------------------------------
class ScaleByAdam8bitState(NamedTuple):
    count: jax.Array
    mu: Any  # pytree of QuantizedArray (int8)
    nu: Any  # pytree of QuantizedArray (uint8)


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                       block_size: int = 256) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` whose moments are stored block-wise 8-bit between steps."""

    def init_fn(params):
        zeros = lambda p: jnp.zeros(p.shape, jnp.float32)
        mu = jax.tree.map(lambda p: quantize_signed(zeros(p), block_size), params)
        nu = jax.tree.map(lambda p: quantize_unsigned(zeros(p), block_size), params)
        return ScaleByAdam8bitState(jnp.zeros([], jnp.int32), mu, nu)

    def update_fn(updates, state, params=None):
        del params
        is_q = lambda x: isinstance(x, QuantizedArray)
        mu = jax.tree.map(lambda q: dequantize_signed(q, block_size), state.mu, is_leaf=is_q)
        nu = jax.tree.map(lambda q: dequantize_unsigned(q, block_size), state.nu, is_leaf=is_q)
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, g32)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, g32)
        count = optax.safe_increment(state.count)
        c = count.astype(jnp.float32)
        mu_hat_scale, nu_hat_scale = 1 / (1 - b1 ** c), 1 / (1 - b2 ** c)
        new_updates = jax.tree.map(
            lambda m, v, g: (m * mu_hat_scale / (jnp.sqrt(v * nu_hat_scale) + eps)).astype(g.dtype),
            mu, nu, updates)
        new_state = ScaleByAdam8bitState(
            count,
            jax.tree.map(lambda m: quantize_signed(m, block_size), mu),
            jax.tree.map(lambda v: quantize_unsigned(v, block_size), nu))
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def adamw_8bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0, block_size: int = 256) -> optax.GradientTransformation:
    """AdamW with 8-bit moments (decoupled weight decay, as ``optax.adamw``)."""
    return optax.chain(scale_by_adam_8bit(b1, b2, eps, block_size),
                       optax.add_decayed_weights(weight_decay),
                       optax.scale_by_learning_rate(learning_rate))


# --------------------------------------------------------------------------------------
# Schedule and the configured optimiser
# --------------------------------------------------------------------------------------
def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to ``learning_rate``, then cosine to ``final_learning_rate`` at ``decay_steps``
    (``total_steps`` when 0), held from there to the end."""
    warm = cfg.warmup_for(total_steps)
    decay = cfg.decay_steps or total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warm else cfg.learning_rate, peak_value=cfg.learning_rate,
        warmup_steps=warm, decay_steps=max(decay, warm + 1), end_value=cfg.final_learning_rate)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Clipping + (8-bit) AdamW on the schedule.  Gradient accumulation lives in the train step."""
    sched = lr_schedule(cfg, total_steps)
    if cfg.name == "adamw8bit":
        opt = adamw_8bit(sched, cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay, cfg.quant_block_size)
    else:
        opt = optax.adamw(sched, cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.clip_norm > 0:
        opt = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)
    return opt


def tree_nbytes(tree: Any) -> int:
    """Bytes of every array leaf (works on ShapeDtypeStructs too)."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype")))
