"""Lossless verification of a drafted block (spec §4), plus the sampling maths it shares with
plain decoding.

The target sees ``[anchor, d_1 … d_{W-1}]`` at positions ``s … s+W-1``; its logits at slot ``k``
decide the token at position ``s+k+1``.  Every rule below returns ``(accepted, next_token)``:
``accepted`` = number of leading drafts kept (``a``, so τ = a + 1) and ``next_token`` = the target's
own token at position ``s+a+1`` (the correction, or the bonus when all drafts were kept).

Randomness is keyed by *(row, position of the token being decided)*.  With point-mass drafts the
token at each position is then exactly the one plain decoding with the same seed would sample
(``y ~ p`` with the same key), so plain, sync and async sampling agree token for token — a
stronger property than equality in distribution, and it is what makes the rule lossless: the
uniforms of position ``j`` never influence the prefix they are conditioned on.
All maths is float32.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

# Salts that separate the independent uniforms used at one position.
SALT_TARGET = 0  # y ~ p (plain sampling, point-mass verification, bonus)
SALT_ACCEPT = 1  # u < p/q for sampled drafts
SALT_RESIDUAL = 2  # correction ~ norm(max(0, p - q))
SALT_DRAFT = 3  # d ~ q (drafter side)
SALT_REPLAY = 4  # replay drafter's error coin


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Target sampling: ``temperature == 0`` is greedy; top-k 0 and top-p 1 disable the filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"sampling.top_k must be an integer >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# --------------------------------------------------------------------------------------
# Distributions and keyed sampling
# --------------------------------------------------------------------------------------
def processed_probs(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Target distribution after temperature → top-k → top-p (transformers' order), float32."""
    x = logits.astype(jnp.float32) / jnp.float32(sampling.temperature if sampling.temperature > 0 else 1.0)
    v = x.shape[-1]
    neg = jnp.float32(-jnp.inf)
    x_desc = None
    if 0 < sampling.top_k < v:
        x_desc = jax.lax.top_k(x, sampling.top_k)[0]  # sorted, descending
        x = jnp.where(x < x_desc[..., -1:], neg, x)
    if sampling.top_p < 1.0:
        if x_desc is None:
            x_desc = -jnp.sort(-x, axis=-1)
        # after top-k only the k kept values matter: top-p sorts those, not the whole vocabulary
        p_desc = jax.nn.softmax(x_desc, axis=-1)
        mass_before = jnp.cumsum(p_desc, axis=-1) - p_desc
        # keep the smallest prefix whose mass reaches top_p (at least the top token)
        keep_desc = mass_before < jnp.float32(sampling.top_p)
        threshold = jnp.min(jnp.where(keep_desc, x_desc, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < threshold, neg, x)
    return jax.nn.softmax(x, axis=-1)


def position_keys(row_keys: jax.Array, positions: jax.Array, salt: int) -> jax.Array:
    """Keys ``[b, k]`` for (row, position, salt); ``row_keys`` is a typed key array ``[b]``."""

    def one_row(key, pos_k):
        key = jax.random.fold_in(key, salt)
        return jax.vmap(lambda p: jax.random.fold_in(key, p))(pos_k)

    return jax.vmap(one_row)(row_keys, positions.astype(jnp.uint32))


def sample_keyed(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One categorical draw per key from ``probs [..., V]`` (keys shaped like ``probs[..., 0]``)."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    flat_k = keys.reshape(-1)
    flat_p = logp.reshape(-1, logp.shape[-1])
    out = jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(flat_k, flat_p)
    return out.reshape(probs.shape[:-1]).astype(jnp.int32)


def uniform_keyed(keys: jax.Array) -> jax.Array:
    flat = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys.reshape(-1))
    return flat.reshape(keys.shape)


def target_tokens(logits: jax.Array, sampling: SamplingParams, row_keys: jax.Array,
                  positions: jax.Array) -> jax.Array:
    """The target's own token per slot: argmax (greedy) or ``y ~ p`` keyed by ``positions`` [b, W]."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = processed_probs(logits, sampling)
    return sample_keyed(position_keys(row_keys, positions, SALT_TARGET), probs)


def leading_true(flags: jax.Array) -> jax.Array:
    """Number of leading True entries along the last axis."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------------------
# Acceptance rules.  Shapes: logits [b, W, V]; drafts [b, W-1]; draft_probs [b, W-1, V] or None;
# anchor_pos [b] (= s); row_keys [b].  Return (accepted [b], next_token [b]).
# --------------------------------------------------------------------------------------
def verify_point_mass(logits, drafts, draft_probs, anchor_pos, row_keys, sampling: SamplingParams):
    """Greedy, or sampling with point-mass drafts: ``y_k`` = target's token; accept while y == d."""
    del draft_probs
    w = logits.shape[1]
    positions = anchor_pos[:, None] + 1 + jnp.arange(w, dtype=jnp.int32)[None]
    y = target_tokens(logits, sampling, row_keys, positions)
    accepted = leading_true(drafts == y[:, : w - 1])
    next_token = jnp.take_along_axis(y, accepted[:, None], axis=1)[:, 0]
    return accepted, next_token


def residual_probs(p: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(0, p - q)); falls back to p where the residual is empty (then rejection had prob 0)."""
    r = jnp.maximum(p - q, 0.0)
    z = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(z > 0, r / jnp.where(z > 0, z, 1.0), p)


def verify_sampled(logits, drafts, draft_probs, anchor_pos, row_keys, sampling: SamplingParams,
                   residual_fn: Callable = residual_probs):
    """Drafts sampled from q: accept d_k with min(1, p(d_k)/q(d_k)); correction ~ residual."""
    b, w, _ = logits.shape
    if sampling.greedy:
        return verify_point_mass(logits, drafts, None, anchor_pos, row_keys, sampling)
    p = processed_probs(logits, sampling)  # [b, W, V]
    q = draft_probs.astype(jnp.float32)  # [b, W-1, V]
    positions = anchor_pos[:, None] + 1 + jnp.arange(w, dtype=jnp.int32)[None]  # decided by slot k
    p_d = jnp.take_along_axis(p[:, : w - 1], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = uniform_keyed(position_keys(row_keys, positions[:, : w - 1], SALT_ACCEPT))
    accepted = leading_true(u * q_d < p_d)  # u < p/q without dividing by a tiny q
    resid = sample_keyed(position_keys(row_keys, positions[:, : w - 1], SALT_RESIDUAL),
                         residual_fn(p[:, : w - 1], q))
    bonus = sample_keyed(position_keys(row_keys, positions[:, w - 1:], SALT_TARGET), p[:, w - 1:])
    candidates = jnp.concatenate([resid, bonus], axis=1)  # [b, W]
    next_token = jnp.take_along_axis(candidates, accepted[:, None], axis=1)[:, 0]
    return accepted, next_token


def default_rule(sample_drafts: bool) -> Callable:
    return verify_sampled if sample_drafts else verify_point_mass
