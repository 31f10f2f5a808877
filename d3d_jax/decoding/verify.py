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


MAX_LOGIT_BIAS = 64  # logit_bias entries per request (a fixed per-row table: one compile)
MAX_TOP_LOGPROBS = 20  # alternatives per emitted token a request may ask for (OpenAI's cap)
NO_LOGPROBS = -1  # SamplingParams.logprobs: the request wants none


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Target sampling: ``temperature == 0`` is greedy; top-k 0, top-p 1 and min-p 0 disable the
    filters; penalties 0 (repetition 1), min_tokens 0 and no logit bias leave the logits alone.

    One request's parameters are Python numbers (hashable, usable as a static argument).  Inside
    the decoder they are per-row DATA: :meth:`stack` makes arrays ``[b]`` (a pytree; the logit
    bias a ``[b, MAX_LOGIT_BIAS]`` table), so one compiled program serves every mix of requests.
    Every function below takes either form.  ``logprobs`` is an output option riding along as
    per-row data: -1 none, n >= 0 the emitted token's log-probability plus n alternatives.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI: minus this for every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # transformers/vLLM: divides (> 0) or multiplies (< 0) the
    #                                  logit of every token in the prompt or the output
    min_tokens: int = 0  # EOS and stop ids are impossible before this many output tokens
    bias_ids: tuple = ()  # logit_bias: token ids ...
    bias_values: tuple = ()  # ... and the value added to each one's logit
    logprobs: int = NO_LOGPROBS

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or not 0 <= self.top_k < 2 ** 31:
            raise ValueError(f"sampling.top_k must be an integer >= 0 and < 2**31, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling.min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"sampling.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"sampling.repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if int(self.min_tokens) != self.min_tokens or not 0 <= self.min_tokens < 2 ** 31:
            raise ValueError(f"sampling.min_tokens must be an integer in [0, 2**31), got {self.min_tokens}")
        if len(self.bias_ids) != len(self.bias_values) or len(self.bias_ids) > MAX_LOGIT_BIAS:
            raise ValueError(f"sampling.logit_bias: at most {MAX_LOGIT_BIAS} (id, value) pairs")
        if not all(-100.0 <= v <= 100.0 for v in self.bias_values):
            raise ValueError("sampling.logit_bias values must be in [-100, 100]")
        if not NO_LOGPROBS <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"sampling.logprobs must be in [-1, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    def vocab_problem(self, vocab: int) -> str | None:
        bad = [int(t) for t in self.bias_ids if not 0 <= int(t) < vocab]
        return f"logit_bias has token id {bad[0]} outside the vocabulary [0, {vocab})" if bad else None

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
        f32 = lambda name: np.asarray([getattr(p, name) for p in params], np.float32)  # noqa: E731
        i32 = lambda name: np.asarray([getattr(p, name) for p in params], np.int32)  # noqa: E731
        ids = np.full((len(params), MAX_LOGIT_BIAS), -1, np.int32)
        vals = np.zeros((len(params), MAX_LOGIT_BIAS), np.float32)
        for r, p in enumerate(params):
            ids[r, : len(p.bias_ids)] = p.bias_ids
            vals[r, : len(p.bias_values)] = p.bias_values
        return SamplingParams(f32("temperature"), f32("top_p"), i32("top_k"), f32("min_p"),
                              f32("presence_penalty"), f32("frequency_penalty"),
                              f32("repetition_penalty"), i32("min_tokens"), ids, vals, i32("logprobs"))

    @staticmethod
    def rows(num_rows: int) -> "SamplingParams":
        """Default (greedy, no transform) per-row device arrays: a fresh decoder state's."""
        z, o = jnp.zeros((num_rows,)), jnp.ones((num_rows,))
        zi = jnp.zeros((num_rows,), jnp.int32)
        return SamplingParams(z, o, zi, z, z, z, o, zi, jnp.full((num_rows, MAX_LOGIT_BIAS), -1, jnp.int32),
                              jnp.zeros((num_rows, MAX_LOGIT_BIAS)), zi - 1)


GREEDY = SamplingParams()


def _per_row(value, like: jax.Array) -> jax.Array:
    """A per-row value ``[b]`` (or a scalar) shaped to broadcast against ``like [b, ...]``."""
    v = jnp.asarray(value)
    return v.reshape(v.shape + (1,) * (like.ndim - v.ndim))


# --------------------------------------------------------------------------------------
# Distributions and keyed sampling
# --------------------------------------------------------------------------------------
def _filter_static(x: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Top-k, top-p, then min-p for one request's parameters (top-k by ``lax.top_k``: no full sort)."""
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
    if sampling.min_p > 0.0:
        x = _min_p(x, sampling.min_p)
    return x


def _min_p(x: jax.Array, min_p) -> jax.Array:
    """Drop tokens whose probability is below ``min_p`` times the most likely one's: in logit
    space ``x < max(x) + log(min_p)`` (no sort; min_p 0 keeps everything)."""
    floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(jnp.asarray(min_p, jnp.float32))
    return jnp.where(x < floor, jnp.float32(-jnp.inf), x)


def _top_p_threshold(x_desc: jax.Array, top_p) -> jax.Array:
    """Smallest kept logit: the shortest prefix whose mass reaches ``top_p`` (at least one token)."""
    p_desc = jax.nn.softmax(x_desc, axis=-1)
    mass_before = jnp.cumsum(p_desc, axis=-1) - p_desc
    keep_desc = mass_before < top_p
    return jnp.min(jnp.where(keep_desc, x_desc, jnp.inf), axis=-1, keepdims=True)


TOP_K_CAP = 64  # per-row top-k up to this many tokens is found by lax.top_k, not a sort


def _filter_rows(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p with per-row ``top_k``/``top_p`` (shaped like ``x[..., :1]``).

    Both filters need the kept values in descending order.  When every row that filters keeps at
    most ``TOP_K_CAP`` tokens by top-k, ``lax.top_k`` finds them (XLA:CPU sorted 48 rows of a
    2048-token vocabulary in 13 ms, ``top_k`` in 0.15 ms); otherwise the whole row is sorted.
    Only values are used, so both give the same result."""
    v = x.shape[-1]
    cap = min(TOP_K_CAP, v)
    k_on = (top_k > 0) & (top_k < v)
    bounded = jnp.all((k_on & (top_k <= cap)) | (~k_on & (top_p >= 1.0)))
    return jax.lax.cond(bounded, lambda x: _filter_sorted(x, jax.lax.top_k(x, cap)[0], top_k, top_p),
                        lambda x: _filter_sorted(x, -jnp.sort(-x, axis=-1), top_k, top_p), x)


def _filter_sorted(x: jax.Array, x_desc: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """:func:`_filter_rows` given each row's largest values ``x_desc`` in descending order (all of
    them, or at least ``top_k`` of every row that filters)."""
    v, w = x.shape[-1], x_desc.shape[-1]
    neg = jnp.float32(-jnp.inf)
    k_on = (top_k > 0) & (top_k < v)
    kth = jnp.take_along_axis(x_desc, jnp.broadcast_to(jnp.clip(top_k - 1, 0, w - 1),
                                                       x.shape[:-1] + (1,)), axis=-1)
    x = jnp.where(k_on & (x < kth), neg, x)
    x_desc = jnp.where(k_on & (jnp.arange(w) >= top_k), neg, x_desc)
    return jnp.where((top_p < 1.0) & (x < _top_p_threshold(x_desc, top_p)), neg, x)


def processed_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Logits after temperature → top-k → top-p → min-p (transformers' order; dropped tokens
    -inf), float32.  Greedy rows keep temperature 1 (their log-probabilities)."""
    x = logits.astype(jnp.float32)
    if sampling.is_static:
        x = x / jnp.float32(sampling.temperature if sampling.temperature > 0 else 1.0)
        return _filter_static(x, sampling)
    t = _per_row(sampling.temperature, x)
    x = x / jnp.where(t > 0, t, 1.0)
    top_k, top_p = _per_row(sampling.top_k, x), _per_row(sampling.top_p, x)
    # the sort only runs when some row filters: a batch of plain temperature sampling skips it
    filtering = jnp.any((top_k > 0) & (top_k < x.shape[-1])) | jnp.any(top_p < 1.0)
    x = jax.lax.cond(filtering, lambda x: _filter_rows(x, top_k, top_p), lambda x: x, x)
    min_p = _per_row(sampling.min_p, x)
    return jax.lax.cond(jnp.any(min_p > 0), lambda x: _min_p(x, min_p), lambda x: x, x)


def processed_probs(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Target distribution after temperature → top-k → top-p → min-p, float32."""
    return jax.nn.softmax(processed_logits(logits, sampling), axis=-1)


# --------------------------------------------------------------------------------------
# Logit processors that depend on the tokens so far (vLLM's order: logit bias, min_tokens,
# then repetition, frequency and presence penalties), applied at every slot of a block
# --------------------------------------------------------------------------------------
def adjusts_logits(sampling: SamplingParams) -> jax.Array:
    """Whether any row uses a logit bias, min_tokens or a penalty (per-row form)."""
    return (jnp.any(sampling.bias_ids >= 0) | jnp.any(sampling.min_tokens > 0)
            | jnp.any(sampling.presence_penalty != 0) | jnp.any(sampling.frequency_penalty != 0)
            | jnp.any(sampling.repetition_penalty != 1))


def adjust_logits(logits: jax.Array, sampling: SamplingParams, seq: jax.Array, prompt_len: jax.Array,
                  anchor_pos: jax.Array, n_out: jax.Array, stop_ids: jax.Array, fed: jax.Array
                  ) -> jax.Array:
    """``logits [b, W, V]`` of a block fed ``[anchor, fed...]`` after each row's logit bias,
    min_tokens and penalties, exactly as plain decoding applies them one step at a time.

    Slot k decides position ``s+k+1``; the tokens before it are the committed ones (``seq``
    through ``anchor_pos`` = s; output = positions ``prompt_len .. s``) plus ``fed[:, :k]``: the
    drafts a slot is reached through are accepted whenever it is reached.  Rows that use none of
    these pay nothing when no row does (``lax.cond``), and a program given :data:`GREEDY` itself
    (every row greedy, no processor) holds none of them."""
    if sampling is GREEDY:
        return logits.astype(jnp.float32)

    def adjust(x):
        b, w, v = x.shape
        rows = jnp.arange(b)[:, None]
        in_vocab = lambda ids: jnp.where(ids >= 0, ids, v)  # noqa: E731  (-1 padding: dropped)
        bias = jnp.zeros((b, v), jnp.float32).at[rows, in_vocab(sampling.bias_ids)].add(
            sampling.bias_values.astype(jnp.float32), mode="drop")
        x = x.astype(jnp.float32) + bias[:, None]
        before = n_out[:, None] + jnp.arange(w, dtype=jnp.int32)[None]  # output tokens before slot k
        is_stop = jnp.zeros((b, v), bool).at[rows, in_vocab(stop_ids)].set(True, mode="drop")
        x = jnp.where((before < sampling.min_tokens[:, None])[..., None] & is_stop[:, None],
                      -jnp.inf, x)
        pos = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]
        out = (pos >= prompt_len[:, None]) & (pos <= anchor_pos[:, None])
        counts = jnp.zeros((b, v), jnp.int32).at[rows, seq].add(out.astype(jnp.int32))
        in_prompt = jnp.zeros((b, v), jnp.int32).at[rows, seq].add(
            (pos < prompt_len[:, None]).astype(jnp.int32)) > 0
        drafted = jnp.cumsum(jax.nn.one_hot(fed[:, : w - 1], v, dtype=jnp.int32), axis=1)
        counts = counts[:, None] + jnp.concatenate([jnp.zeros((b, 1, v), jnp.int32), drafted], 1)
        rp = _per_row(sampling.repetition_penalty, x)
        seen = (counts > 0) | in_prompt[:, None]
        x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
        return (x - _per_row(sampling.frequency_penalty, x) * counts
                - _per_row(sampling.presence_penalty, x) * (counts > 0))

    return jax.lax.cond(adjusts_logits(sampling), adjust, lambda x: x.astype(jnp.float32), logits)


def emitted_logprobs(logits: jax.Array, emitted: jax.Array, sampling: SamplingParams,
                     num_top: int = MAX_TOP_LOGPROBS):
    """Per slot: the log-probability of ``emitted [b, W]`` under the request's processed
    distribution (what it was sampled from; greedy rows at temperature 1), and the ``num_top``
    most likely tokens with theirs.  Computed only when some row asked (``sampling.logprobs``;
    never in a program given :data:`GREEDY` itself)."""
    b, w, v = logits.shape
    k = min(num_top, v)

    def compute(x):
        lp = jax.nn.log_softmax(processed_logits(x, sampling), axis=-1)
        chosen = jnp.take_along_axis(lp, emitted[..., None], axis=-1)[..., 0]
        top_lp, top_ids = jax.lax.top_k(lp, k)
        return chosen, top_ids.astype(jnp.int32), top_lp

    def none(x):
        return (jnp.zeros((b, w), jnp.float32), jnp.zeros((b, w, k), jnp.int32),
                jnp.zeros((b, w, k), jnp.float32))

    if sampling is GREEDY:
        return none(logits)
    return jax.lax.cond(jnp.any(sampling.logprobs >= 0), compute, none, logits)


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
