"""The paged KV cache and chunked prefill against transformers' Qwen3 and a dense whole-prompt forward.

Pages are handed out in a shuffled order, so a read or write that ignored the page table (or
mixed up page and offset) would pick another row's or another position's K/V.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d3d_jax.io.hf import load_qwen3
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model import paged_kv as pkv
from d3d_jax.model.masks import causal_meta
from d3d_jax.model.qwen3 import unstacked
from test_qwen3 import CONFIGS, TOL, hf_logits, make_hf_model

PAGE = 4
MAX_PAGES = 48  # 192 positions: span buckets 128 and 192, so the span switch is exercised
NUM_PAGES = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF model, ours stacked) of the tied GQA shape."""
    kw = dict(CONFIGS["tied_gqa_wide_heads"])
    hf = make_hf_model(0, **kw)
    path = tmp_path_factory.mktemp("paged")
    hf.save_pretrained(path)
    return hf, load_qwen3(path)


chunk_step = nnx.jit(pkv.prefill_chunk)


def shuffled_tables(rows_pages: list[int], seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """A page table giving row ``r`` ``rows_pages[r]`` distinct pages in shuffled order."""
    perm = np.random.default_rng(seed).permutation(NUM_PAGES)
    table = np.full((len(rows_pages), MAX_PAGES), pkv.UNMAPPED, np.int32)
    owned, at = [], 0
    for r, n in enumerate(rows_pages):
        table[r, :n] = perm[at:at + n]
        owned.append(perm[at:at + n])
        at += n
    return table, owned


def prefill_in_chunks(model, cache, tokens, totals, chunk):
    """Feed every row its tokens from its length up to ``totals`` in chunks; logits by position."""
    b = tokens.shape[0]
    got = np.full(tokens.shape + (model.config.vocab_size,), np.nan, np.float32)
    lengths = np.asarray(cache.lengths)
    while (lengths < totals).any():
        count = np.minimum(chunk, totals - lengths)
        pos = np.minimum(lengths[:, None] + np.arange(chunk)[None], tokens.shape[1] - 1)
        toks = np.take_along_axis(tokens, pos, 1)
        logits, cache = chunk_step(model, cache, jnp.asarray(toks), jnp.asarray(count))
        for r in range(b):
            got[r, lengths[r]:lengths[r] + count[r]] = np.asarray(logits[r, :count[r]])
        lengths = lengths + count
        assert (np.asarray(cache.lengths) == lengths).all()
    return got, cache


def test_chunked_prefill_equals_transformers_and_a_whole_prompt_forward(models):
    hf, model = models
    cfg = model.config
    totals = np.array([137, 40])  # row 0 crosses the 128 span bucket
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, int(totals.max())))
    table, _ = shuffled_tables([-(-int(n) // PAGE) for n in totals], seed=0)
    cache = pkv.init_paged_cache(cfg, NUM_PAGES, PAGE, 2, MAX_PAGES).with_page_table(jnp.asarray(table))
    got, cache = prefill_in_chunks(model, cache, tokens, totals, chunk=32)
    for r, n in enumerate(totals):
        ref = hf_logits(hf, tokens[r:r + 1, :n])[0]
        assert np.abs(ref).max() > 100 * TOL
        assert np.abs(got[r, :n] - ref).max() <= TOL, f"row {r}"
    # the K/V the pages hold are those one whole-prompt forward writes to a dense cache
    s = int(totals.max())
    pos = np.broadcast_to(np.arange(s), (2, s))
    _, dense = nnx.jit(lambda m, t, mt, c: m(t, mt, cache=c))(
        model, jnp.asarray(tokens), causal_meta(jnp.asarray(pos), jnp.asarray(pos < totals[:, None])),
        kvc.init_cache(cfg, 2, s))
    k, v = pkv.row_positions(cache, s)
    for r, n in enumerate(totals):
        assert np.abs(np.asarray(k[:, r, :n]) - np.asarray(dense.k_lbskh[:, r, :n])).max() <= 1e-5
        assert np.abs(np.asarray(v[:, r, :n]) - np.asarray(dense.v_lbskh[:, r, :n])).max() <= 1e-5


def test_a_prefix_shared_from_another_row_gives_transformers_logits(models):
    """Row 1 maps row 0's first full pages and prefills only its own rest (the unstacked model,
    as decoders run it); row 0's pages are read, never written."""
    hf, model = models
    model = unstacked(model)
    cfg = model.config
    rng = np.random.default_rng(4)
    shared = 5 * PAGE
    row0 = rng.integers(0, cfg.vocab_size, 27)
    row1 = np.concatenate([row0[:shared], rng.integers(0, cfg.vocab_size, 13)])
    tokens = np.zeros((2, 33), np.int64)
    tokens[0, :27], tokens[1] = row0, row1
    table, owned = shuffled_tables([7, 4], seed=1)
    cache = pkv.init_paged_cache(cfg, NUM_PAGES, PAGE, 2, MAX_PAGES).with_page_table(jnp.asarray(table))
    _, cache = prefill_in_chunks(model, cache, tokens, np.array([27, 0]), chunk=8)
    before = np.asarray(cache.k_lpskh).copy()
    table[1, :5], table[1, 5:9] = owned[0][:5], owned[1]  # the shared pages, then its own
    cache = cache.with_page_table(jnp.asarray(table)).with_lengths(jnp.asarray([27, shared]))
    got, cache = prefill_in_chunks(model, cache, tokens, np.array([27, 33]), chunk=8)
    ref = hf_logits(hf, row1[None])[0]
    assert np.abs(got[1, shared:] - ref[shared:]).max() <= TOL
    after = np.asarray(cache.k_lpskh)
    np.testing.assert_array_equal(after[:, owned[0]], before[:, owned[0]])
    assert np.abs(after[:, owned[1]]).sum() > 0


def test_writes_to_unmapped_pages_or_past_the_table_are_dropped(models):
    _, model = models
    cfg = model.config
    table = np.full((2, 2), pkv.UNMAPPED, np.int32)
    table[0, 0] = 3  # row 0 holds one page (positions 0-3); row 1 none
    cache = pkv.init_paged_cache(cfg, 8, PAGE, 2, 2).with_page_table(jnp.asarray(table))
    cache = cache.with_lengths(jnp.asarray([2, 5]))
    # row 0 writes positions 2-5 (4, 5: its second page is unmapped); row 1 positions 5-8 (8 is
    # past its table)
    _, cache = chunk_step(model, cache, jnp.ones((2, 4), jnp.int32), jnp.asarray([4, 4]))
    written = np.abs(np.asarray(cache.k_lpskh)).sum(axis=(0, 3, 4))  # [page, offset]
    assert (written[3, 2:] > 0).all() and (written[3, :2] == 0).all()
    assert (np.delete(written, 3, axis=0) == 0).all()


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_attention_through_a_page_table_equals_the_positions_laid_out_by_a_loop(backend):
    """A :class:`PagedLayer` prefix against the same keys copied position by position into a
    dense segment (a Python loop over the table), for the reference and the fused backend."""
    from d3d_jax.model.attention import PagedLayer, attend
    from d3d_jax.model.masks import cache_key_meta

    rng = np.random.default_rng(5)
    layers, pages, kh, h, b, t, span = 2, 12, 2, 16, 2, 3, 24
    k_pool, v_pool = (rng.standard_normal((layers, pages, PAGE, kh, h)).astype(np.float32) for _ in range(2))
    table = rng.permutation(pages)[:b * 6].reshape(b, 6).astype(np.int32)
    lengths = np.array([21, 9])
    dense_k, dense_v = np.zeros((b, span, kh, h), np.float32), np.zeros((b, span, kh, h), np.float32)
    for r in range(b):
        for p in range(span):
            dense_k[r, p] = k_pool[1, table[r, p // PAGE], p % PAGE]
            dense_v[r, p] = v_pool[1, table[r, p // PAGE], p % PAGE]
    q = jnp.asarray(rng.standard_normal((b, t, 4, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32) for _ in range(2))
    meta = causal_meta(jnp.asarray(lengths[:, None] + np.arange(t)[None]))
    key_meta = cache_key_meta(jnp.asarray(lengths), span)
    ref = attend(q, k, v, meta, meta, prefix=(jnp.asarray(dense_k), jnp.asarray(dense_v), key_meta))
    paged = PagedLayer(jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(table), key_meta, jnp.int32(1))
    got = attend(q, k, v, meta, meta, backend=backend, prefix=paged)
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() <= 1e-5


# --------------------------------------------------------------------------------------
# The fused decode kernels read the pool through the page table
# --------------------------------------------------------------------------------------
def _paged_case(page: int, t: int, heads: int, kv_heads: int, head_dim: int, seed: int = 7):
    """A pool whose rows map shuffled pages, the first two sharing their first prefix pages, a
    ragged last page each, unmapped entries past their lengths; every page no row reads holds
    NaN.  Returns the case and the span laid out position by position (a Python loop)."""
    rng = np.random.default_rng(seed)
    layers, pages, max_pages = 2, 24, 6
    span, lengths = max_pages * page, np.array([3 * page + 5, 4 * page + 1, 2 * page - 3])
    table = np.full((3, max_pages), pkv.UNMAPPED, np.int32)
    order = rng.permutation(pages)
    table[0, :4], table[1, :2], table[1, 2:5], table[2, :2] = order[:4], order[:2], order[4:7], order[7:9]
    k_pool, v_pool = (rng.standard_normal((layers, pages, page, kv_heads, head_dim)).astype(np.float32)
                      for _ in range(2))
    read = np.zeros(pages, bool)
    dense = np.zeros((2, 3, span, kv_heads, head_dim), np.float32)
    for r, p in np.ndindex(3, span):
        if p < lengths[r]:
            read[table[r, p // page]] = True
            dense[:, r, p] = k_pool[1, table[r, p // page], p % page], v_pool[1, table[r, p // page], p % page]
    k_pool[:, ~read], v_pool[:, ~read] = np.nan, np.nan
    q = jnp.asarray(rng.standard_normal((3, t, heads, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((3, t, kv_heads, head_dim)), jnp.float32) for _ in range(2))
    return (q, k, v, jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(table), lengths), dense


def _query_meta(kind: str, lengths, t: int):
    from d3d_jax.model.masks import block_meta

    if kind == "block":  # a drafting forward [anchor, MASK...]: the block sees itself and the cache
        return block_meta(jnp.asarray(lengths)[:, None], t)
    return causal_meta(jnp.asarray(lengths[:, None] + np.arange(t)[None]))  # decode (t = 1), verify


@pytest.mark.parametrize("kind,t,page", [("causal", 1, 16), ("causal", 5, 32), ("block", 16, 16)])
def test_decode_kernel_reads_pages_through_random_tables_as_the_reference(kind, t, page):
    """The decode kernel over the pool with the page table (plain decode, a verify of 5, a
    drafting block; pages of one key tile and of two) against the xla reference over the span
    laid out by a loop: equal, and no NaN from a page no row reads.  The kernel's operand is the
    pool itself, never a gathered span."""
    import jax

    from d3d_jax.model.attention import PagedLayer, attend
    from d3d_jax.model.masks import cache_key_meta

    (q, k, v, k_pool, v_pool, table, lengths), dense = _paged_case(page, t, 4, 2, 16)
    meta = _query_meta(kind, lengths, t)
    key_meta = cache_key_meta(jnp.asarray(lengths), dense.shape[2])
    want = attend(q, k, v, meta, meta, prefix=(jnp.asarray(dense[0]), jnp.asarray(dense[1]), key_meta))
    paged = PagedLayer(k_pool, v_pool, table, key_meta, jnp.int32(1))
    run = lambda q: attend(q, k, v, meta, meta, backend="pallas_interpret", prefix=paged, tiles=(16, 16))  # noqa: E731
    got = jax.jit(run)(q)
    assert bool(jnp.isfinite(got).all())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    calls = [e for e in jax.make_jaxpr(run)(q).jaxpr.eqns
             if e.primitive.name == "pallas_call" and e.params["name"] == "d3d_flash_decode"]
    assert len(calls) == 1 and k_pool.shape in [x.aval.shape for x in calls[0].invars]


def test_tpu_decode_kernel_reads_pages_in_the_tpu_interpreter():
    """The Mosaic cache kernel with the page table as scalar prefetch (a key tile = a page), run
    by the TPU interpreter, against softmax over each row's valid positions laid out by a loop
    (NumPy, head by head)."""
    from d3d_jax.model.flash_attention import flash_decode_cache
    from d3d_jax.model.masks import cache_key_meta

    (q, _, _, k_pool, v_pool, table, lengths), dense = _paged_case(16, 1, 2, 1, 128)
    key_meta = cache_key_meta(jnp.asarray(lengths), dense.shape[2])
    q = q * 128 ** -0.5
    out, lse = flash_decode_cache(q, k_pool, v_pool, jnp.int32(1), _query_meta("causal", lengths, 1), key_meta,
                                  platform="tpu_interpret", out_dtype=jnp.float32, page_table=table)
    qn = np.asarray(q, np.float64)
    for r, n in np.ndindex(3, 2):
        scores = dense[0, r, :lengths[r], 0].astype(np.float64) @ qn[r, 0, n]
        w = np.exp(scores - scores.max())
        np.testing.assert_allclose(np.asarray(out)[r, 0, n], w @ dense[1, r, :lengths[r], 0] / w.sum(),
                                   atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(float(lse[r, n, 0]), scores.max() + np.log(w.sum()), rtol=1e-5)


def test_chunked_prefill_with_the_fused_kernel_reading_pages_equals_transformers(models):
    """The model over pages the decode kernel reads itself (16-token pages, shuffled; the whole
    table's span, no span buckets): chunked prefill logits equal transformers'."""
    import copy
    import dataclasses

    from d3d_jax.model.qwen3 import set_config

    hf, model = models
    model = set_config(copy.deepcopy(model), dataclasses.replace(model.config, attention_backend="pallas_interpret"))
    totals, page = np.array([70, 23]), 16
    tokens = np.random.default_rng(4).integers(0, model.config.vocab_size, (2, int(totals.max())))
    table, perm = np.full((2, 8), pkv.UNMAPPED, np.int32), np.random.default_rng(1).permutation(12)
    table[0, :5], table[1, :2] = perm[:5], perm[5:7]
    cache = pkv.init_paged_cache(model.config, 12, page, 2, 8).with_page_table(jnp.asarray(table))
    got, _ = prefill_in_chunks(model, cache, tokens, totals, chunk=32)
    for r, n in enumerate(totals):
        assert np.abs(got[r, :n] - hf_logits(hf, tokens[r:r + 1, :n])[0]).max() <= TOL, f"row {r}"
