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
import numbers
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Salts that separate the independent uniforms used at one position.
SALT_TARGET = 0  # y ~ p (plain sampling, point-mass verification, bonus)
SALT_ACCEPT = 1  # u < p/q for sampled drafts
SALT_RESIDUAL = 2  # correction ~ norm(max(0, p - q))
SALT_DRAFT = 3  # d ~ q (drafter side)
SALT_REPLAY = 4  # replay drafter's error coin


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Target sampling: ``temperature == 0`` is greedy; top-k 0 and top-p 1 disable the filters.

    One request's parameters are Python numbers (hashable, usable as a static argument).  Inside
    the decoder they are per-row DATA: :meth:`stack` makes arrays ``[b]`` (a pytree), so one
    compiled program serves every mix of requests.  Every function below takes either form.
    """

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
    def greedy(self):
        """A bool for one request's parameters, a ``[b]`` bool array for per-row ones."""
        return self.temperature == 0.0

    @property
    def is_static(self) -> bool:
        return all(isinstance(v, numbers.Number) for v in (self.temperature, self.top_p, self.top_k))

    @staticmethod
    def stack(params: Sequence["SamplingParams"]) -> "SamplingParams":
        """Per-row arrays ``[b]`` (host numpy) from one :class:`SamplingParams` per row."""
        return SamplingParams(np.asarray([p.temperature for p in params], np.float32),
                              np.asarray([p.top_p for p in params], np.float32),
                              np.asarray([p.top_k for p in params], np.int32))


GREEDY = SamplingParams()


def _per_row(value, like: jax.Array) -> jax.Array:
    """A per-row value ``[b]`` (or a scalar) shaped to broadcast against ``like [b, ...]``."""
    v = jnp.asarray(value)
    return v.reshape(v.shape + (1,) * (like.ndim - v.ndim))


# --------------------------------------------------------------------------------------
# Distributions and keyed sampling
# --------------------------------------------------------------------------------------
def _filter_static(x: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Top-k then top-p for one request's parameters (top-k by ``lax.top_k``: no full sort)."""
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
        x = jnp.where(x < _top_p_threshold(x_desc, sampling.top_p), neg, x)
    return x


def _top_p_threshold(x_desc: jax.Array, top_p) -> jax.Array:
    """Smallest kept logit: the shortest prefix whose mass reaches ``top_p`` (at least one token)."""
    p_desc = jax.nn.softmax(x_desc, axis=-1)
    mass_before = jnp.cumsum(p_desc, axis=-1) - p_desc
    keep_desc = mass_before < top_p
    return jnp.min(jnp.where(keep_desc, x_desc, jnp.inf), axis=-1, keepdims=True)


def _filter_rows(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p with per-row ``top_k``/``top_p`` (shaped like ``x[..., :1]``): one sort."""
    v = x.shape[-1]
    neg = jnp.float32(-jnp.inf)
    x_desc = -jnp.sort(-x, axis=-1)
    k_on = (top_k > 0) & (top_k < v)
    kth = jnp.take_along_axis(x_desc, jnp.broadcast_to(jnp.clip(top_k - 1, 0, v - 1),
                                                       x.shape[:-1] + (1,)), axis=-1)
    x = jnp.where(k_on & (x < kth), neg, x)
    x_desc = jnp.where(k_on & (jnp.arange(v) >= top_k), neg, x_desc)
    return jnp.where((top_p < 1.0) & (x < _top_p_threshold(x_desc, top_p)), neg, x)


def processed_probs(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Target distribution after temperature → top-k → top-p (transformers' order), float32."""
    x = logits.astype(jnp.float32)
    if sampling.is_static:
        x = x / jnp.float32(sampling.temperature if sampling.temperature > 0 else 1.0)
        return jax.nn.softmax(_filter_static(x, sampling), axis=-1)
    t = _per_row(sampling.temperature, x)
    x = x / jnp.where(t > 0, t, 1.0)
    top_k, top_p = _per_row(sampling.top_k, x), _per_row(sampling.top_p, x)
    # the sort only runs when some row filters: a batch of plain temperature sampling skips it
    filtering = jnp.any((top_k > 0) & (top_k < x.shape[-1])) | jnp.any(top_p < 1.0)
    x = jax.lax.cond(filtering, lambda x: _filter_rows(x, top_k, top_p), lambda x: x, x)
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
    """The target's own token per slot: argmax (greedy rows) or ``y ~ p`` keyed by ``positions``."""
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        probs = processed_probs(logits, sampling)
        y = sample_keyed(position_keys(row_keys, positions, SALT_TARGET), probs)
        return jnp.where(_per_row(sampling.greedy, y), argmax, y)

    if sampling.is_static:
        return argmax if sampling.greedy else sampled()
    # an all-greedy batch pays for no sampling at all
    return jax.lax.cond(jnp.any(sampling.temperature > 0), sampled, lambda: argmax)


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
    """Drafts sampled from q: accept d_k with min(1, p(d_k)/q(d_k)); correction ~ residual.
    Greedy rows (whose drafts are the drafter's argmax) use the point-mass rule."""
    if sampling.is_static and sampling.greedy:
        return verify_point_mass(logits, drafts, None, anchor_pos, row_keys, sampling)

    def sampled():
        return _speculative_sample(logits, drafts, draft_probs, anchor_pos, row_keys, sampling,
                                   residual_fn)

    if sampling.is_static:
        return sampled()
    greedy = verify_point_mass(logits, drafts, None, anchor_pos, row_keys, GREEDY)
    mixed = jax.lax.cond(jnp.any(sampling.temperature > 0), sampled, lambda: greedy)
    return tuple(jnp.where(sampling.greedy, g, m) for g, m in zip(greedy, mixed))


def _speculative_sample(logits, drafts, draft_probs, anchor_pos, row_keys, sampling, residual_fn):
    b, w, _ = logits.shape
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
