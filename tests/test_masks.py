"""The packed block-diffusion training mask (spec §2.3) against a brute-force reference, and the
property that makes it right: a block token's logits depend only on clean tokens before its
anchor and on its own block."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d3d_jax.config import ModelConfig
from d3d_jax.model.masks import (TokenMeta, attention_mask, block_meta, cache_key_meta, causal_meta,
                                 concat_meta, packed_training_meta)
from d3d_jax.model.qwen3 import init_model


def reference_training_mask(clean_len, clean_valid, anchors, anchor_valid, block_size, packed_len):
    """Spec §2.3 read literally, one (query, key) pair at a time.

    Row layout: clean tokens 0..clean_len-1, then block b's slot s at clean_len + b*B + s, then
    padding.  Clean i sees clean j <= i; block b sees clean j < anchor_b and all of block b;
    blocks never see other blocks; clean tokens never see blocks; padding sees / is seen by nothing.
    """
    def describe(index):
        if index < clean_len:
            return ("clean", index, index < clean_valid)
        b, slot = divmod(index - clean_len, block_size)
        if b < len(anchors):
            return ("block", b, bool(anchor_valid[b]))
        return ("pad", None, False)

    mask = [[False] * packed_len for _ in range(packed_len)]
    for q in range(packed_len):
        q_kind, q_id, q_ok = describe(q)
        for k in range(packed_len):
            k_kind, k_id, k_ok = describe(k)
            if not (q_ok and k_ok):
                continue
            if q_kind == "clean" and k_kind == "clean":
                mask[q][k] = k_id <= q_id
            elif q_kind == "block" and k_kind == "clean":
                mask[q][k] = k_id < anchors[q_id]
            elif q_kind == "block" and k_kind == "block":
                mask[q][k] = k_id == q_id
    return np.array(mask)


def as_meta(d) -> TokenMeta:
    return TokenMeta(*(jnp.asarray(d[k])[None] for k in ("positions", "block_ids", "context_end", "valid")))


@pytest.mark.parametrize("seed", range(6))
def test_training_mask_equals_bruteforce_reference(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([2, 4, 5]))
    clean_len = int(rng.integers(block_size + 2, 24))
    clean_valid = int(rng.integers(block_size + 1, clean_len + 1))
    candidates = np.arange(clean_valid - block_size + 1)  # full blocks only (spec §2.2)
    n = int(rng.integers(1, min(5, len(candidates)) + 1))
    anchors = np.sort(rng.choice(candidates, n, replace=False))  # may overlap one another
    anchor_valid = rng.random(n) < 0.8
    packed_len = clean_len + n * block_size + int(rng.integers(0, 5))
    meta = packed_training_meta(clean_len, anchors, block_size, packed_len, clean_valid, anchor_valid)
    got = np.asarray(attention_mask(as_meta(meta), as_meta(meta)))[0]
    want = reference_training_mask(clean_len, clean_valid, anchors, anchor_valid, block_size, packed_len)
    assert got.shape == want.shape
    assert np.array_equal(got, want), np.argwhere(got != want)[:5]
    # block slot s sits at RoPE position anchor + s (same-position prediction, spec §0)
    for b, a in enumerate(anchors):
        start = clean_len + b * block_size
        assert list(meta["positions"][start:start + block_size]) == list(range(a, a + block_size))


def test_packed_meta_rejects_a_row_too_short():
    with pytest.raises(ValueError, match="packed length"):
        packed_training_meta(10, np.array([1, 2]), 4, 17)


def test_drafting_forward_mask_sees_cache_before_anchor_only():
    """Spec §4: [uncached committed tokens (causal) | block at s..s+B-1] over a cache of length c."""
    cache_len, c, s, block = 12, 4, 7, 3
    new = concat_meta([causal_meta(jnp.arange(c, s)[None]), block_meta(jnp.asarray([[s]]), block)])
    cache = cache_key_meta(jnp.asarray([c]), cache_len)
    m_cache = np.asarray(attention_mask(new, cache))[0]
    m_new = np.asarray(attention_mask(new, new))[0]
    for qi in range(s - c + block):
        pos_q = c + qi if qi < s - c else None
        for j in range(cache_len):
            # committed-but-uncached causal token at pos p sees cache j <= p (and j < c);
            # block tokens see cache j < s (and j < c)
            limit = (pos_q + 1) if pos_q is not None else s
            assert m_cache[qi, j] == (j < c and j < limit)
    n_causal = s - c
    assert np.array_equal(m_new[:n_causal, :n_causal], np.tril(np.ones((n_causal, n_causal), bool)))
    assert not m_new[:n_causal, n_causal:].any()
    assert m_new[n_causal:, :].all()  # the block sees every uncached token (positions < s) and itself


# ---- property: what a block token's logits may depend on ----------------------------------------
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
CLEAN, BLOCK = 14, 4
ANCHORS = np.array([6, 3, 9])  # block 1 overlaps block 0's range; block 2 starts after it
PACKED = CLEAN + len(ANCHORS) * BLOCK + 2


@nnx.jit
def forward(model, tokens, meta):
    return model(tokens, meta)


def test_block_logits_depend_only_on_clean_prefix_and_own_block():
    model = init_model(CFG, seed=11)
    rng = np.random.default_rng(0)
    base = rng.integers(0, CFG.vocab_size, PACKED)
    mask_id = CFG.vocab_size - 1
    for b, a in enumerate(ANCHORS):  # blocks are [x[a], MASK, ...]
        start = CLEAN + b * BLOCK
        base[start] = base[a]
        base[start + 1:start + BLOCK] = mask_id

    def changed(idx):
        row = base.copy()
        row[idx] = (row[idx] + 1 + rng.integers(0, CFG.vocab_size - 2, np.size(idx))) % CFG.vocab_size
        return row

    block_slices = [slice(CLEAN + b * BLOCK, CLEAN + (b + 1) * BLOCK) for b in range(len(ANCHORS))]
    rows, checks = [base], []
    for b, a in enumerate(ANCHORS):
        others = np.concatenate([np.arange(PACKED)[s] for o, s in enumerate(block_slices) if o != b])
        rows.append(changed(others)); checks.append((b, "other blocks", True))
        rows.append(changed(np.arange(a, CLEAN))); checks.append((b, "clean at/after anchor", True))
        rows.append(changed(np.arange(CLEAN + len(ANCHORS) * BLOCK, PACKED))); checks.append((b, "padding", True))
        rows.append(changed(np.array([a - 1]))); checks.append((b, "clean before anchor", False))
    meta_np = packed_training_meta(CLEAN, ANCHORS, BLOCK, PACKED)
    meta = TokenMeta(*(jnp.broadcast_to(jnp.asarray(meta_np[k])[None], (len(rows), PACKED))
                       for k in ("positions", "block_ids", "context_end", "valid")))
    logits = np.asarray(forward(model, jnp.asarray(np.stack(rows)), meta))
    for row, (b, what, same) in enumerate(checks, start=1):
        diff = np.abs(logits[row, block_slices[b]] - logits[0, block_slices[b]]).max()
        if same:
            assert diff <= 1e-6, f"block {b} changed when {what} changed ({diff})"
        else:
            assert diff > 1e-4, f"block {b} did not react to {what}"
    # and the clean stream never sees blocks: changing all block tokens leaves it untouched
    every_block = np.concatenate([np.arange(PACKED)[s] for s in block_slices])
    clean_only = np.asarray(forward(model, jnp.asarray(changed(every_block)[None]), TokenMeta(
        *(jnp.asarray(meta_np[k])[None] for k in ("positions", "block_ids", "context_end", "valid")))))
    assert np.abs(clean_only[0, :CLEAN] - logits[0, :CLEAN]).max() <= 1e-6
