"""The branch pack (spec §5) against independent references.

Reference for a branch: the model run from scratch (no cache) on the row's committed context plus
the accepted prefix (causal) followed by the branch block ``[c, MASK…]`` with its own metadata —
the separate synchronous draft the branch stands in for.  Hit matching is checked against a
brute-force Python loop over the spec's rule.
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from d3d_jax.config import ConfigError, ModelConfig
from d3d_jax.decoding import branches as br
from d3d_jax.decoding.drafting import ModelDrafter
from d3d_jax.model.kv_cache import init_cache
from d3d_jax.model.masks import block_meta, causal_meta, concat_meta
from d3d_jax.model.qwen3 import init_model

MASK = 127
CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, mask_token_id=MASK)
B = 8


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=3)


def _committed_cache(model, ctx_rows, max_len=64):
    """Drafter cache holding each row's committed context (positions < s)."""
    s = np.array([len(c) for c in ctx_rows], np.int32)
    t = int(s.max())
    toks = np.zeros((len(ctx_rows), t), np.int32)
    for i, c in enumerate(ctx_rows):
        toks[i, :len(c)] = c
    valid = np.arange(t)[None] < s[:, None]
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), toks.shape)
    cache = init_cache(CFG, len(ctx_rows), max_len)
    _, cache = model(jnp.asarray(toks), causal_meta(pos, valid), cache=cache)
    return cache.with_lengths(s), s


REF_LEN = 32  # every reference padded to one length: one compile


@nnx.jit
def _whole_sequence(model, toks, meta):
    return model(toks, meta)


def _reference_block(model, causal_tokens, block_anchor_token):
    """Logits [B, V] of the block [anchor, MASK…] placed right after ``causal_tokens``
    (whole-sequence forward, no cache; trailing padding is invalid and seen by nobody)."""
    n = len(causal_tokens)
    pad = REF_LEN - n - B
    toks = np.array(list(causal_tokens) + [block_anchor_token] + [MASK] * (B - 1) + [0] * pad,
                    np.int32)[None]
    causal_pos = jnp.concatenate([jnp.arange(n), jnp.arange(n + B, REF_LEN)]).astype(jnp.int32)[None]
    causal = causal_meta(causal_pos, jnp.arange(REF_LEN - B)[None] < n)
    head = jax.tree.map(lambda x: x[:, :n], causal)
    tail = jax.tree.map(lambda x: x[:, n:], causal)
    meta = concat_meta([head, block_meta(jnp.array([[n]]), B), tail])
    return np.asarray(_whole_sequence(model, jnp.asarray(toks), meta))[0, n:n + B]


@pytest.mark.parametrize("c,f", [(4, 2), (B, 1)])
def test_every_branch_equals_its_own_sync_draft(model, c, f):
    layout = br.BranchLayout(B, c, f)
    rng = np.random.default_rng(c * 10 + f)
    ctx_rows = [list(rng.integers(0, MASK, 5)), list(rng.integers(0, MASK, 9))]
    cache, s = _committed_cache(model, ctx_rows)
    block = rng.integers(0, MASK, (2, B)).astype(np.int32)
    draft_len = np.array([B - 1, B - 2], np.int32)  # row 1: the shortened block after an all-accept hit
    block_alts = np.asarray(br.slot_alternatives(jnp.asarray(rng.normal(size=(2, B, CFG.vocab_size))),
                                                 jnp.asarray(block), f))
    # the production path: the model drafter's branch pack, jitted as the decoder jits it
    d = ModelDrafter(model, MASK)
    run = jax.jit(lambda *a: d.branch_pack(*a, layout, with_logits=True), donate_argnums=(1,))
    drafts, new_cache = run(d.params, cache, jnp.asarray(block), jnp.asarray(block_alts),
                            jnp.asarray(s), jnp.asarray(draft_len))
    print(layout.describe())
    assert layout.budget == B * ((c - 1) * f + 2)
    logits = np.asarray(drafts.logits)
    tokens = np.asarray(drafts.tokens)
    alts = np.asarray(drafts.alts)
    checked = 0
    for row in range(2):
        L = int(draft_len[row])
        for r in range(1, c):
            for j in range(f):
                k = (r - 1) * f + j
                if r > L:
                    continue  # can never be the outcome; its content is irrelevant
                alt = int(block_alts[row, r, j])
                assert alt != block[row, r]
                ref = _reference_block(model, ctx_rows[row] + list(block[row, :r]), alt)
                np.testing.assert_allclose(logits[row, k], ref, atol=1e-4)
                assert tokens[row, k, 0] == alt
                np.testing.assert_array_equal(tokens[row, k, 1:], ref[1:].argmax(-1))
                checked += 1
        ref = _reference_block(model, ctx_rows[row] + list(block[row, :L]), int(block[row, L]))
        np.testing.assert_allclose(logits[row, layout.all_accept_index], ref, atol=1e-4)
        np.testing.assert_array_equal(tokens[row, -1, 1:], ref[1:].argmax(-1))
        # alternatives: top-F excluding the draft, by a plain sort
        for slot in range(1, B):
            order = [v for v in np.argsort(-ref[slot], kind="stable") if v != tokens[row, -1, slot]]
            assert set(alts[row, -1, slot]) == set(order[:f])
    assert checked > 0
    # The shared prefix's K/V now sit in the cache at s … s+L, exactly as a causal prefill writes them.
    full = [ctx_rows[r] + list(block[r, :draft_len[r] + 1]) for r in range(2)]
    ref_cache, ref_len = _committed_cache(model, full)
    for row in range(2):
        n = int(ref_len[row])
        np.testing.assert_allclose(np.asarray(new_cache.k_lbskh)[:, row, :n],
                                   np.asarray(ref_cache.k_lbskh)[:, row, :n], atol=1e-5)
        np.testing.assert_allclose(np.asarray(new_cache.v_lbskh)[:, row, :n],
                                   np.asarray(ref_cache.v_lbskh)[:, row, :n], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_cache.lengths), s)  # the caller commits


@pytest.mark.parametrize("c,f", [(4, 2), (B, 1), (1, 3), (B, 3)])
def test_n_async_counted_from_what_the_packed_forward_is_fed(model, c, f, monkeypatch):
    """N_async counted from the metadata the drafter model actually receives (valid tokens per
    row), not from ``layout.budget``: the closed form B·((C-1)·F + 2), one less for a shortened
    block (its padded last slot is fed but not valid), and only the shared prefix is kept."""
    from d3d_jax.model.qwen3 import Qwen3

    fed = []
    real_call = Qwen3.__call__

    def recording(self, tokens, meta=None, cache=None, keep=None, **kw):
        fed.append((np.asarray(tokens).shape, np.asarray(meta.valid).sum(axis=1),
                    np.asarray(keep).sum(axis=1)))
        return real_call(self, tokens, meta, cache=cache, keep=keep, **kw)

    layout = br.BranchLayout(B, c, f)
    rng = np.random.default_rng(c * 10 + f)
    cache, s = _committed_cache(model, [list(rng.integers(0, MASK, 5)), list(rng.integers(0, MASK, 9))])
    block = rng.integers(0, MASK, (2, B)).astype(np.int32)
    draft_len = np.array([B - 1, B - 2], np.int32)
    alts = np.asarray(br.slot_alternatives(jnp.asarray(rng.normal(size=(2, B, CFG.vocab_size))),
                                           jnp.asarray(block), f))
    d = ModelDrafter(model, MASK)  # its params: the model's own
    monkeypatch.setattr(Qwen3, "__call__", recording)
    d.branch_pack(  # eager: the metadata are concrete arrays
        d.params, cache, jnp.asarray(block), jnp.asarray(alts), jnp.asarray(s),
        jnp.asarray(draft_len), layout)
    assert len(fed) == 1  # one forward for the whole pack
    shape, valid, kept = fed[0]
    closed_form = B * ((c - 1) * f + 2)
    assert shape == (2, closed_form) and layout.budget == closed_form
    assert valid.tolist() == [closed_form, closed_form - 1]
    assert kept.tolist() == (draft_len + 1).tolist()


def _brute_match(alts, draft_len, guess, a, corr, c, f):
    if a == draft_len and corr == guess:
        return True, (c - 1) * f
    r = a + 1
    if a < draft_len and r <= c - 1:
        for j in range(f):
            if alts[r, j] == corr:
                return True, (r - 1) * f + j
    return False, None


@pytest.mark.parametrize("c,f", [(4, 2), (1, 3), (B, 1)])
def test_match_branch_brute_force(c, f):
    layout = br.BranchLayout(B, c, f)
    rng = np.random.default_rng(7)
    n = 400
    alts = rng.integers(0, 6, (n, B, f)).astype(np.int32)  # small vocab: many coincidences
    draft_len = rng.choice([B - 1, B - 2], n).astype(np.int32)
    guess = rng.integers(0, 6, n).astype(np.int32)
    acc = np.minimum(rng.integers(0, B, n), draft_len).astype(np.int32)
    corr = rng.integers(0, 6, n).astype(np.int32)
    hit, branch = br.match_branch(*map(jnp.asarray, (alts, draft_len, guess, acc, corr)), layout)
    hit, branch = np.asarray(hit), np.asarray(branch)
    for i in range(n):
        h, k = _brute_match(alts[i], draft_len[i], guess[i], acc[i], corr[i], c, f)
        assert hit[i] == h, i
        if h:
            assert branch[i] == k, i
    assert 0 < hit.sum() < n


def test_next_block_after_hits():
    layout = br.BranchLayout(B, 3, 2)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 100, (2, layout.num_branches, B)).astype(np.int32)
    alts = rng.integers(0, 100, (2, layout.num_branches, B, 2)).astype(np.int32)
    drafts = br.BranchDrafts(jnp.asarray(tokens), jnp.asarray(alts), None)
    branch = np.array([3, layout.all_accept_index], np.int32)
    corr = np.array([tokens[0, 3, 0], 55], np.int32)
    blk, blk_alts, dl = map(np.asarray, br.next_block_from_branch(
        drafts, jnp.asarray(branch), jnp.asarray(corr), layout, MASK))
    np.testing.assert_array_equal(blk[0], tokens[0, 3])
    np.testing.assert_array_equal(blk_alts[0], alts[0, 3])
    assert list(dl) == [B - 1, B - 2]
    np.testing.assert_array_equal(blk[1, :B - 1], [55] + list(tokens[1, -1, 2:]))
    np.testing.assert_array_equal(blk_alts[1, 1:B - 1], alts[1, -1, 2:])
    assert (blk_alts[1, B - 1] == br.NO_TOKEN).all()


@pytest.mark.parametrize("c,f,msg", [(B + 1, 1, "branch_positions"), (0, 1, "branch_positions"),
                                     (4, 0, "branch_fanout")])
def test_layout_rejects_bad_values(c, f, msg):
    with pytest.raises(ConfigError, match=msg):
        br.BranchLayout(B, c, f).validate()


def test_layout_refuses_an_oversized_pack_with_its_budget():
    # N_async = B·((C-1)·F + 2): --branch-fanout 5000 would pack 880032 tokens
    with pytest.raises(ConfigError, match=r"N_async = .* = 880032 tokens, more than the maximum 4096"):
        br.BranchLayout(16, 12, 5000).validate()
    for c, f in ((16, 16), (16, 17), (12, 2), (2, 127), (2, 128)):
        lay = br.BranchLayout(16, c, f)
        assert lay.budget == 16 * ((c - 1) * f + 2)
        if lay.budget <= br.MAX_ASYNC_BUDGET:
            lay.validate()
        else:
            with pytest.raises(ConfigError, match=f"= {lay.budget} tokens"):
                lay.validate()
