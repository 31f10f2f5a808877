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


def test_min_p_after_top_k_and_top_p_matches_transformers():
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = np.random.default_rng(5).normal(0, 2, (6, 40)).astype(np.float32)
    sampling = SamplingParams(0.8, top_p=0.9, top_k=25, min_p=0.1)
    x = torch.tensor(logits)
    for warper in (TemperatureLogitsWarper(0.8), TopKLogitsWarper(25), TopPLogitsWarper(0.9), MinPLogitsWarper(0.1)):
        x = warper(None, x)
    ref = torch.softmax(x, -1).numpy()
    for form in (sampling, SamplingParams.stack([sampling] * 6)):  # one request's numbers, per-row arrays
        ours = np.asarray(V.processed_probs(jnp.asarray(logits), form))
        np.testing.assert_array_equal(ours > 0, ref > 0)
        np.testing.assert_allclose(ours, ref, atol=1e-6)


def _brute_adjust(logits, p: SamplingParams, seq, plen, anchor, n_out, stop_ids, fed):
    """One row, slot by slot: the committed output plus the drafts before the slot, by formula."""
    out = np.array(logits, np.float64)
    for k in range(out.shape[0]):
        x = out[k]
        for t, b in zip(p.bias_ids, p.bias_values):
            x[t] += b
        if n_out + k < p.min_tokens:
            x[[t for t in stop_ids if t >= 0]] = -np.inf
        output = list(seq[plen:anchor + 1]) + list(fed[:k])
        seen = set(seq[:plen]) | set(output)
        for t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        counts = np.bincount(output, minlength=len(x)) if output else np.zeros(len(x))
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


def test_adjust_logits_counts_the_drafts_before_each_slot():
    rng = np.random.default_rng(6)
    b, w, v, s = 4, 5, 16, 24
    logits = rng.normal(0, 2, (b, w, v)).astype(np.float32)
    rows = [SamplingParams(1.0, presence_penalty=0.7, frequency_penalty=0.4),
            SamplingParams(0.0, repetition_penalty=1.6, min_tokens=3, bias_ids=(3, 9), bias_values=(2.0, -50.0)),
            SamplingParams(),  # no transform: its logits stay as they are
            SamplingParams(0.5, frequency_penalty=-1.0, repetition_penalty=0.7)]
    seq = rng.integers(0, v, (b, s)).astype(np.int32)
    plen, anchor, n_out = np.array([3, 5, 2, 4]), np.array([6, 5, 9, 7]), np.array([3, 0, 7, 3])
    stop = np.full((b, 16), -1, np.int32)
    stop[:, :2] = [[1, 4]] * b
    fed = rng.integers(0, v, (b, w - 1)).astype(np.int32)
    fed[:, 1] = fed[:, 0]  # a repeated draft: counts of 2 inside the block
    got = np.asarray(V.adjust_logits(jnp.asarray(logits), SamplingParams.stack(rows), jnp.asarray(seq),
                                     jnp.asarray(plen), jnp.asarray(anchor), jnp.asarray(n_out),
                                     jnp.asarray(stop), jnp.asarray(fed)))
    for r in range(b):
        ref = _brute_adjust(logits[r], rows[r], seq[r], plen[r], anchor[r], n_out[r], stop[r], fed[r])
        np.testing.assert_allclose(got[r], ref, rtol=1e-5, atol=1e-5, err_msg=str(r))
    np.testing.assert_array_equal(got[2], logits[2])
    assert np.isneginf(got[1, :3, [1, 4]]).all() and np.isfinite(got[1, 3:, [1, 4]]).all()  # min_tokens 3


def test_emitted_logprobs_are_the_processed_distributions():
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2, (3, 4, 30)).astype(np.float32)
    rows = [SamplingParams(0.0, logprobs=3), SamplingParams(0.7, top_k=5, logprobs=0), SamplingParams()]
    emitted = rng.integers(0, 30, (3, 4)).astype(np.int32)
    emitted[1] = np.argsort(-logits[1], -1)[:, 0]  # inside top-k
    chosen, top_ids, top_lp = map(np.asarray, V.emitted_logprobs(jnp.asarray(logits), jnp.asarray(emitted),
                                                                 SamplingParams.stack(rows)))
    ref0 = torch.log_softmax(torch.tensor(logits[0]), -1).numpy()  # greedy: temperature 1
    np.testing.assert_allclose(chosen[0], ref0[np.arange(4), emitted[0]], atol=1e-5)
    np.testing.assert_array_equal(top_ids[0, :, :3], np.argsort(-ref0, -1)[:, :3])
    x = TopKLogitsWarper(5)(None, TemperatureLogitsWarper(0.7)(None, torch.tensor(logits[1])))
    np.testing.assert_allclose(chosen[1], torch.log_softmax(x, -1).numpy()[np.arange(4), emitted[1]], atol=1e-5)
    assert np.isneginf(top_lp[1, :, 5:]).all()  # filtered tokens: -inf


@pytest.mark.parametrize("rows", [
    # every filtering row keeps at most TOP_K_CAP tokens by top-k: lax.top_k's path
    [SamplingParams(0.7, top_p=0.8, top_k=20), SamplingParams(1.0, top_k=3), SamplingParams(0.0),
     SamplingParams(0.9, top_p=0.5, top_k=V.TOP_K_CAP)],
    # a row with top-p alone (or top-k over the cap) needs every value sorted
    [SamplingParams(0.7, top_p=0.8, top_k=20), SamplingParams(1.3, top_p=0.6),
     SamplingParams(1.0, top_k=V.TOP_K_CAP + 1)]])
def test_per_row_filters_match_transformers_warpers(rows):
    """Per-row top-k / top-p (one program for any mix of requests) against transformers' warpers
    applied row by row, over a vocabulary wider than the top-k cap."""
    v = 3 * V.TOP_K_CAP
    logits = np.random.default_rng(8).normal(0, 3, (len(rows), 2, v)).astype(np.float32)
    ours = np.asarray(V.processed_probs(jnp.asarray(logits), SamplingParams.stack(rows)))
    for r, sp in enumerate(rows):
        x = TemperatureLogitsWarper(sp.temperature or 1.0)(None, torch.tensor(logits[r]))
        if sp.top_k:
            x = TopKLogitsWarper(sp.top_k)(None, x)
        if sp.top_p < 1:
            x = TopPLogitsWarper(sp.top_p)(None, x)
        ref = torch.softmax(x, -1).numpy()
        np.testing.assert_array_equal(ours[r] > 0, ref > 0)
        np.testing.assert_allclose(ours[r], ref, atol=1e-6)
