"""Drafting against brute force: the cached block forward (uncached committed tokens + the block)
equals a whole-sequence forward over every committed token plus the block, round after round with
a different number of new tokens per row; the replay drafter's error rate and keying."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d3d_jax.config import ModelConfig
from d3d_jax.decoding import verify as V
from d3d_jax.decoding.decoder import Request
from d3d_jax.decoding.drafting import ModelDrafter, ReplayDrafter
from d3d_jax.model.masks import block_meta, causal_meta, concat_meta
from d3d_jax.model.qwen3 import init_model

VOCAB, MASK, BLOCK, S = 96, 95, 5, 48


@pytest.fixture(scope="module")
def drafter():
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=False, mask_token_id=MASK)
    return init_model(cfg, 3)


@functools.partial(jax.jit, static_argnums=0)
def _reference_forward(graphdef, params, seq_bs, s_b):
    """Whole-sequence forward, no cache: every committed token 0..s-1 (causal; padding past s is
    invalid) + [seq[s], MASK×(B-1)] anchored at s.  Returns the logits of block slots 1..B-1."""
    model = nnx.merge(graphdef, params)
    b, n = seq_bs.shape
    pos = jnp.broadcast_to(jnp.arange(n), (b, n))
    anchor = jnp.take_along_axis(seq_bs, s_b[:, None], axis=1)
    toks = jnp.concatenate([seq_bs, anchor, jnp.full((b, BLOCK - 1), MASK)], axis=1)
    meta = concat_meta([causal_meta(pos, pos < s_b[:, None]), block_meta(s_b[:, None], BLOCK)])
    return model(toks, meta)[:, n + 1:]


@pytest.mark.parametrize("sample_drafts", [False, True])
def test_cached_block_drafting_equals_whole_sequence_forward(drafter, sample_drafts):
    rng = np.random.default_rng(0)
    b = 3
    d = ModelDrafter(drafter)
    seq = jnp.asarray(rng.integers(0, MASK, (b, S)), jnp.int32)
    prompt_len = np.array([1, 4, 7])
    prompt = np.asarray(seq)[:, :8]
    prefill = jax.jit(d.prefill)
    propose = jax.jit(d.propose, static_argnums=(5, 6, 7))
    # the production path: prefill a prompt-length cache, insert it into the slots' cache
    rows = prefill(d.params, None, jnp.asarray(prompt), jnp.asarray(prompt_len - 1))
    state = d.insert(d.init_state(b, S), rows, jnp.arange(b))
    s = prompt_len - 1  # anchors: the last prompt token
    keys = jax.random.split(jax.random.key(1), b)
    sp = V.SamplingParams(1.0) if sample_drafts else V.SamplingParams()
    for _ in range(4):
        out, state = propose(d.params, state, seq, jnp.asarray(s, jnp.int32), keys, sp, BLOCK,
                             sample_drafts)
        assert np.asarray(state.lengths).tolist() == s.tolist()  # block K/V not kept
        refs = np.asarray(_reference_forward(d.graphdef, d.params, seq, jnp.asarray(s, jnp.int32)))
        for r in range(b):
            ref = refs[r]
            np.testing.assert_allclose(np.asarray(out.logits[r]), ref, atol=1e-4)
            if not sample_drafts:
                np.testing.assert_array_equal(np.asarray(out.drafts[r]), ref.argmax(-1))
            else:  # drafts come from q, which is softmax of the slot logits
                q = np.asarray(out.probs[r])
                np.testing.assert_allclose(q, np.asarray(jax.nn.softmax(ref, -1)), atol=1e-5)
                assert np.all(q[np.arange(BLOCK - 1), np.asarray(out.drafts[r])] > 0)
        s = s + rng.integers(1, BLOCK + 1, b)  # a round commits a + 1 in 1..B tokens per row


def test_replay_drafter_error_rate_and_keying():
    rng = np.random.default_rng(2)
    n, length, plen = 64, 40, 3
    conts = rng.integers(0, VOCAB, (n, length)).tolist()
    anchors = rng.integers(plen - 1, 20, n)
    keys = jax.random.split(jax.random.key(0), n)

    def propose(rate, rows):
        rd = ReplayDrafter(conts, VOCAB, error_rate=rate, seed=9)
        st = rd.prefill(None, rd.request_data([Request([0] * plen, index=int(r)) for r in rows], 64),
                        None, None)
        out, _ = jax.jit(rd.propose, static_argnums=(5, 6, 7))(
            rd.params, st, None, jnp.asarray(anchors[rows], jnp.int32), keys[: len(rows)],
            V.SamplingParams(), BLOCK, False)
        return np.asarray(out.drafts)

    rows = np.arange(n)
    # continuation token j sits at position plen + j; slot k proposes position anchor + k
    ref = np.stack([np.asarray(conts[r])[anchors[r] + 1 - plen + np.arange(BLOCK - 1)] for r in rows])
    np.testing.assert_array_equal(propose(0.0, rows), ref)
    noisy = propose(0.3, rows)
    wrong = noisy != ref
    assert abs(wrong.mean() - 0.3) < 4 * np.sqrt(0.21 / wrong.size), wrong.mean()
    assert np.all((noisy >= 0) & (noisy < VOCAB))
    # errors are keyed by prompt index and position, not by the batch slot
    np.testing.assert_array_equal(propose(0.3, np.array([17, 5])), noisy[[17, 5]])


def test_bad_drafters():
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="mask_token_id is unknown"):
        ModelDrafter(init_model(cfg, 0))
    with pytest.raises(ValueError, match="outside its vocabulary"):
        ModelDrafter(init_model(cfg, 0), mask_token_id=VOCAB)
    with pytest.raises(ValueError, match="error_rate"):
        ReplayDrafter([[1]], VOCAB, error_rate=1.5)


def test_a_prefill_without_its_score_compiles_no_vocabulary_wide_op():
    """``prefill`` is ``prefill_scored`` with the prompt score dropped: under jit XLA removes the
    LM head with it, so a drafter's prefill costs what a cache-only prefill costs."""
    import re

    vocab = 97  # a prime: no other dimension of the model has this size
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=False, mask_token_id=vocab - 1)
    d = ModelDrafter(init_model(cfg, 0))
    prompt, plen = jnp.ones((2, 16), jnp.int32), jnp.array([5, 9], jnp.int32)

    def vocab_wide_ops(fn) -> int:
        hlo = jax.jit(lambda p, x, n: fn(p, None, x, n)).lower(d.params, prompt, plen).compile().as_text()
        return sum(1 for line in hlo.splitlines()
                   if re.search(rf"= \w+\[[\d,]*\b{vocab}\]", line) and "parameter(" not in line)

    assert vocab_wide_ops(d.prefill_scored) > 0  # the head is there when the score is used
    assert vocab_wide_ops(d.prefill) == 0
