"""Verification rules against independent references: transformers' logits warpers, brute-force
accept loops, and the closed forms of speculative sampling (output law = p, acceptance = Σ min(p, q))."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from d3d_jax.decoding import verify as V
from d3d_jax.decoding.verify import SamplingParams


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.8, top_k=20),
                                      SamplingParams(1.3, top_p=0.5), SamplingParams(0.5, top_k=3)])
def test_processed_probs_match_transformers_warpers(sampling):
    logits = np.random.default_rng(0).normal(0, 2, (4, 3, 50)).astype(np.float32)
    x = torch.tensor(logits.reshape(-1, 50))
    x = TemperatureLogitsWarper(sampling.temperature)(None, x)
    if sampling.top_k:
        x = TopKLogitsWarper(sampling.top_k)(None, x)
    if sampling.top_p < 1:
        x = TopPLogitsWarper(sampling.top_p)(None, x)
    ref = torch.softmax(x, -1).numpy().reshape(logits.shape)
    ours = np.asarray(V.processed_probs(jnp.asarray(logits), sampling))
    np.testing.assert_array_equal(ours > 0, ref > 0)
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def _brute_accept(drafts, y):
    a = 0
    while a < len(drafts) and drafts[a] == y[a]:
        a += 1
    return a


def test_greedy_accept_length_and_next_token_brute_force():
    rng = np.random.default_rng(1)
    b, w, v = 64, 6, 7
    logits = rng.normal(size=(b, w, v)).astype(np.float32)
    argmax = logits.argmax(-1)
    # drafts right for a random number of leading slots, then random
    drafts = argmax[:, : w - 1].copy()
    for r in range(b):
        k = rng.integers(0, w)
        drafts[r, k:] = rng.integers(0, v, w - 1 - k)
    keys = jax.random.split(jax.random.key(0), b)
    a, nxt = V.verify_point_mass(jnp.asarray(logits), jnp.asarray(drafts), None,
                                 jnp.zeros(b, jnp.int32), keys, SamplingParams())
    for r in range(b):
        ar = _brute_accept(list(drafts[r]), list(argmax[r]))
        assert int(a[r]) == ar and int(nxt[r]) == argmax[r, ar]
    assert len(set(np.asarray(a).tolist())) > 3  # every kind of outcome was exercised


def test_sampling_is_keyed_by_position_not_slot():
    """The token decided at position j is the same whether j is a plain step or slot k of a block."""
    rng = np.random.default_rng(2)
    b, w, v = 8, 5, 11
    logits = jnp.asarray(rng.normal(size=(b, w, v)).astype(np.float32))
    keys = jax.random.split(jax.random.key(3), b)
    sp = SamplingParams(0.8, top_p=0.9)
    s = jnp.asarray(rng.integers(0, 40, b), jnp.int32)
    tokens = jax.jit(V.target_tokens, static_argnums=1)
    block = tokens(logits, sp, keys, s[:, None] + 1 + jnp.arange(w)[None])
    for k in range(w):
        one = tokens(logits[:, k:k + 1], sp, keys, s[:, None] + 1 + k)
        np.testing.assert_array_equal(np.asarray(block[:, k]), np.asarray(one[:, 0]))


N_DRAWS = 60_000


def _one_slot_draws(rule, p_logits, q, draft_tokens):
    """N independent single-draft rounds (W=2) with fixed p and q: (accepted, committed token)."""
    n, v = len(draft_tokens), p_logits.shape[-1]
    logits = jnp.broadcast_to(jnp.asarray(p_logits, jnp.float32), (n, 2, v))
    qb = None if q is None else jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, 1, v))
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(5), i))(jnp.arange(n, dtype=jnp.uint32))
    a, nxt = jax.jit(rule, static_argnums=5)(logits, jnp.asarray(draft_tokens)[:, None], qb,
                                             jnp.zeros(n, jnp.int32), keys, SamplingParams(1.0))
    a = np.asarray(a)
    first = np.where(a == 1, np.asarray(draft_tokens), np.asarray(nxt))  # token at position s+1
    return a, first


def _pvalue(tokens, p):
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0
    keep = p > 0
    return stats.chisquare(counts[keep], p[keep] * len(tokens)).pvalue


P = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])  # token 5 impossible under the target
with np.errstate(divide="ignore"):
    P_LOGITS = np.log(np.stack([P, P]))
Q = np.array([0.1, 0.1, 0.5, 0.05, 0.05, 0.2])


def test_sampled_drafts_output_law_and_acceptance_rate_closed_form():
    rng = np.random.default_rng(6)
    drafts = rng.choice(len(Q), N_DRAWS, p=Q)
    a, first = _one_slot_draws(V.verify_sampled, P_LOGITS, Q, drafts)
    assert _pvalue(first, P) > 0.01
    expected_accept = np.minimum(P, Q).sum()
    assert abs(a.mean() - expected_accept) < 4 * np.sqrt(expected_accept * (1 - expected_accept) / N_DRAWS)
    # power: the residual replaced by p is detected
    _, wrong = _one_slot_draws(lambda *args: V.verify_sampled(*args, residual_fn=lambda p, q: p),
                               P_LOGITS, Q, drafts)
    assert _pvalue(wrong, P) < 1e-6


def test_point_mass_drafts_output_law_and_acceptance_rate():
    drafts = np.full(N_DRAWS, 1)  # the drafter's argmax, always token 1
    a, first = _one_slot_draws(V.verify_point_mass, P_LOGITS, None, drafts)
    assert _pvalue(first, P) > 0.01
    assert abs(a.mean() - P[1]) < 4 * np.sqrt(P[1] * (1 - P[1]) / N_DRAWS)
    # a one-hot q through the sampled-draft rule is the same rule (min(1, p/1) = p(d))
    a2, first2 = _one_slot_draws(V.verify_sampled, P_LOGITS, np.eye(len(Q))[1], drafts)
    assert _pvalue(first2, P) > 0.01 and abs(a2.mean() - P[1]) < 0.01


def test_residual_probs():
    p = jnp.asarray([[0.5, 0.3, 0.2]])
    np.testing.assert_allclose(V.residual_probs(p, jnp.asarray([[0.2, 0.5, 0.3]])), [[1.0, 0.0, 0.0]],
                               atol=1e-7)
    np.testing.assert_allclose(V.residual_probs(p, p), p)  # empty residual: fall back to p


def test_sampling_params_validation():
    for bad, msg in [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                     (dict(top_p=1.01), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad).validate()
    SamplingParams(0.0, 1.0, 0).validate()
