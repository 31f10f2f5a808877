"""Objectives vs brute-force loops written from spec §2.4 / §3.1 (not from the code under test)."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from d3d_jax.config import DataConfig
from d3d_jax.training import objectives as obj
from d3d_jax.training.data import Example, pack_example, sample_anchors

B, N_ANCH, S = 4, 3, 12
CFG = DataConfig(packed_length=S + N_ANCH * B, num_anchors=N_ANCH, block_size=B, pad_token_id=0)
MASK, V = 9, 11


def _log_softmax(row):
    m = max(row)
    lse = m + math.log(sum(math.exp(v - m) for v in row))
    return [v - lse for v in row]


def _hand_made_batch(seed=0):
    # Two rows: prompt 3 tokens + response 7; prompt 5 + response 5 (only 2 anchors fit).
    exs = [Example(np.array([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], np.int32), 3),
           Example(np.array([3, 3, 3, 3, 3, 5, 6, 7, 8, 4], np.int32), 5)]
    rng = np.random.default_rng(seed)
    rows, anchor_lists = [], []
    for ex in exs:
        a, v = sample_anchors(rng, ex.response_start, len(ex.tokens), N_ANCH, B)
        rows.append(pack_example(ex, a, v, CFG, MASK))
        anchor_lists.append([int(x) for x, ok in zip(a, v) if ok])
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    return exs, anchor_lists, batch


def _brute_force(logits, exs, anchor_lists, gamma, lam):
    num = den = 0.0
    for r, (ex, anchors) in enumerate(zip(exs, anchor_lists)):
        for b, a in enumerate(anchors):
            for k in range(1, B):  # slot 0 excluded
                w = math.exp(-(k - 1) / gamma)
                ce = -_log_softmax(list(logits[r, S + b * B + k]))[ex.tokens[a + k]]
                num += w * ce
                den += w
    ar_num, ar_den = 0.0, 0
    for r, ex in enumerate(exs):
        for i in range(len(ex.tokens) - 1):
            if i + 1 >= ex.response_start:  # the predicted token is a response token
                ar_num += -_log_softmax(list(logits[r, i]))[ex.tokens[i + 1]]
                ar_den += 1
    return num / den + lam * ar_num / ar_den, num / den, ar_num / ar_den


@pytest.mark.parametrize("gamma,lam", [(7.0, 1.0), (2.0, 0.0), (0.5, 0.3)])
def test_d3d_loss_equals_brute_force(gamma, lam):
    exs, anchors, batch = _hand_made_batch()
    assert [len(a) for a in anchors] == [3, 2]
    logits = np.random.default_rng(1).normal(size=batch["tokens"].shape + (V,)).astype(np.float32) * 3
    loss, m = obj.d3d_loss_from_logits(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in batch.items()},
                                       gamma, lam)
    ref, ref_diff, ref_ar = _brute_force(logits.astype(np.float64), exs, anchors, gamma, lam)
    np.testing.assert_allclose(float(m["loss_diff"]), ref_diff, rtol=1e-5)
    np.testing.assert_allclose(float(m["loss_ar"]), ref_ar, rtol=1e-5)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)


def test_slot_weights_closed_form():
    w = np.asarray(obj.slot_weights(jnp.arange(-1, 16), 7.0))
    assert w[0] == 0 and w[1] == 0  # non-block, slot 0
    np.testing.assert_allclose(w[2:], [math.exp(-(k - 1) / 7.0) for k in range(1, 16)], rtol=1e-6)


def test_lm_loss_is_shifted_ce():
    logits = np.random.default_rng(2).normal(size=(1, 5, V)).astype(np.float32)
    toks = np.array([[1, 4, 2, 7, 3]])
    batch = dict(labels=jnp.asarray(np.concatenate([toks[:, 1:], [[0]]], 1)),
                 ar_mask=jnp.asarray([[True, True, True, True, False]]))
    loss, _ = obj.lm_loss_from_logits(jnp.asarray(logits), batch)
    ref = np.mean([-_log_softmax(list(logits[0, i]))[toks[0, i + 1]] for i in range(4)])
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)


def test_offline_tau_equals_brute_force():
    exs, anchors, batch = _hand_made_batch(seed=3)
    rng = np.random.default_rng(4)
    # A fake drafter: predicts the right token with prob. 0.8 per position, else a wrong one.
    right = batch["labels"]
    wrong = (right + 1 + rng.integers(0, V - 1, right.shape)) % V
    pred = np.where(rng.random(right.shape) < 0.8, right, wrong)
    logits = np.eye(V, dtype=np.float32)[pred] * 5.0
    out = obj.offline_tau(lambda tokens, meta: jnp.asarray(logits), batch, B)
    taus, slot_hits = [], np.zeros(B - 1)
    for r, (ex, anch) in enumerate(zip(exs, anchors)):
        for b, a in enumerate(anch):
            accepted = 0
            for k in range(1, B):
                if pred[r, S + b * B + k] == ex.tokens[a + k]:
                    accepted += 1
                else:
                    break
            taus.append(1 + accepted)
            slot_hits += [pred[r, S + b * B + k] == ex.tokens[a + k] for k in range(1, B)]
    np.testing.assert_allclose(out["tau"], np.mean(taus), rtol=1e-6)
    np.testing.assert_allclose(out["slot_accuracy"], slot_hits / len(taus), rtol=1e-6)
    assert out["anchors"] == len(taus) and sum(out["tau_hist"]) == len(taus)
