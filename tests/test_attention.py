"""The fused attention backends against the XLA reference, for every kind of forward.

The Pallas kernel runs in interpret mode (``pallas_interpret``): the same kernel code the GPU
compiles with Triton, executed as plain JAX on CPU.  Each mask kind is built by the project's own
helpers (``masks``, ``decoding.branches``, ``training.data``), with ragged rows, padding and fully
masked query rows; the reference is backend ``xla`` (the dense-score path every other test checks
against transformers).
"""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d3d_jax.config import ConfigError, DataConfig, ModelConfig, ObjectiveConfig, TrainRunConfig, load_config
from d3d_jax.decoding.branches import BranchLayout, correction_alternatives, pack_branches
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model.attention import CacheLayer, attend
from d3d_jax.model.flash_attention import flash_attention, live_tiles, tile_visibility
from d3d_jax.model.masks import (TokenMeta, attention_mask, block_meta, cache_key_meta, causal_meta,
                                 concat_meta, packed_training_meta)
from d3d_jax.model.qwen3 import init_model, remat_policy
from d3d_jax.parallel import sharding as shd
from d3d_jax.training import objectives as obj
from d3d_jax.training.data import Example, batch_meta, pack_example, sample_anchors

PALLAS = "pallas_interpret"
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
N_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
TILES = (16, 16)  # the smallest tiles: several per row, so the online softmax and skipping run


@functools.lru_cache(maxsize=None)
def _jitted(backend: str, tiles=(64, 64)):
    """One jit per backend: interpret-mode kernels compile once per shape instead of per op."""
    return jax.jit(lambda *a, prefix=None: attend(*a, backend=backend, prefix=prefix, tiles=tiles))


def _meta(rows: list[dict]) -> TokenMeta:
    return TokenMeta(*(jnp.asarray(np.stack([r[k] for r in rows]))
                       for k in ("positions", "block_ids", "context_end", "valid")))


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)


def _cache(rng, lengths, span, dtype):
    """A cache span whose slots past each row's length hold garbage (never to be read)."""
    b = len(lengths)
    k = _normal(rng, (b, span, KV_HEADS, HEAD_DIM), dtype)
    v = _normal(rng, (b, span, KV_HEADS, HEAD_DIM), dtype)
    return k, v, cache_key_meta(jnp.asarray(lengths, jnp.int32), span)


# --------------------------------------------------------------------------------------
# Mask kinds: (queries' metadata, optional cache prefix)
# --------------------------------------------------------------------------------------
def prefill_case(rng, dtype):
    """Causal prefill, right-padded to 24: rows of 24, 7 and 0 real tokens (all rows masked)."""
    lengths = np.array([24, 7, 0])
    pos = np.broadcast_to(np.arange(24), (3, 24))
    return causal_meta(jnp.asarray(pos), jnp.asarray(pos < lengths[:, None])), None


def verify_case(rng, dtype):
    """Cached verify: 6 block tokens per row over a 40-slot span, cache lengths 33, 6 and 17;
    the last row's block is only 2 tokens long (padding queries are fully masked)."""
    lengths = np.array([33, 6, 17])
    pos = lengths[:, None] + np.arange(6)[None]
    valid = np.ones((3, 6), bool)
    valid[2, 2:] = False
    return causal_meta(jnp.asarray(pos), jnp.asarray(valid)), _cache(rng, lengths, 40, dtype)


def drafting_case(rng, dtype):
    """Cached drafting forward as ``drafting.propose`` builds it: the uncached committed tokens
    (padded to 3, ragged) then ``[anchor, MASK×5]`` anchored after them."""
    lengths = np.array([20, 3, 11])
    n_real = np.array([3, 1, 0])
    pos_u = lengths[:, None] + np.arange(3)[None]
    anchor = lengths + n_real
    meta = concat_meta([causal_meta(jnp.asarray(pos_u), jnp.asarray(np.arange(3)[None] < n_real[:, None])),
                        block_meta(jnp.asarray(anchor[:, None]), 6)])
    return meta, _cache(rng, lengths, 32, dtype)


def branch_pack_case(rng, dtype):
    """The §5 branch pack from ``branches.pack_branches`` (B=4, C=3, F=2: 6 blocks, 24 queries),
    one row with a padded shared-prefix slot (draft_len = B-2)."""
    layout = BranchLayout(block_size=4, positions=3, fanout=2)
    anchor_pos = jnp.asarray([9, 2], jnp.int32)
    draft_len = jnp.asarray([3, 2], jnp.int32)
    block = jnp.asarray(rng.integers(0, 50, (2, 4)), jnp.int32)
    alts = jnp.asarray(rng.integers(0, 50, (2, 4, 2)), jnp.int32)
    corr = correction_alternatives(alts, draft_len, layout)
    _, meta, _ = pack_branches(block, corr, anchor_pos, draft_len, layout, mask_token_id=63)
    return meta, _cache(rng, np.asarray(anchor_pos), 16, dtype)


def training_case(rng, dtype):
    """§2.3 packed training rows from ``packed_training_meta``: overlapping anchors, an invalid
    anchor, a short clean stream and tail padding (fully masked)."""
    rows = [packed_training_meta(24, np.array([2, 5, 9, 13]), 4, 44, 20, np.array([1, 1, 0, 1], bool)),
            packed_training_meta(24, np.array([0, 7]), 4, 44, 11)]
    return _meta(rows), None


CASES = {"prefill": prefill_case, "verify": verify_case, "drafting": drafting_case,
         "branch_pack": branch_pack_case, "training": training_case}


def _run_case(name, dtype, seed=0):
    rng = np.random.default_rng(seed)
    meta, prefix = CASES[name](rng, dtype)
    b, t = meta.shape
    q = _normal(rng, (b, t, N_HEADS, HEAD_DIM), dtype)
    k = _normal(rng, (b, t, KV_HEADS, HEAD_DIM), dtype)
    v = _normal(rng, (b, t, KV_HEADS, HEAD_DIM), dtype)
    return (q, k, v, meta, meta), dict(prefix=prefix)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", list(CASES))
def test_pallas_equals_xla_for_every_mask_kind(kind, dtype):
    args, kw = _run_case(kind, dtype)
    want = _jitted("xla")(*args, **kw)
    got = _jitted(PALLAS, TILES)(*args, **kw)
    assert got.dtype == want.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    q_meta, prefix = args[3], kw["prefix"]
    seen = attention_mask(q_meta, q_meta).any(-1)
    if prefix is not None:
        seen |= attention_mask(q_meta, prefix[2]).any(-1)
    assert not bool(seen.all())  # every case has fully masked rows, and they are exactly 0
    assert float(jnp.abs(got.astype(jnp.float32)).max(axis=(2, 3))[~seen].max()) == 0.0


@pytest.mark.parametrize("kind", ["training", "verify"])
def test_pallas_gradients_equal_xla(kind):
    """Gradients of the kernel (several tiles, skipped ones included) and, for the cached verify,
    through the log-sum-exp merge of cache and new keys (the lse cotangent path)."""
    (q, k, v, q_meta, k_meta), kw = _run_case(kind, "float32")
    weights = _normal(np.random.default_rng(7), q.shape, jnp.float32)
    cache_kv, cache_meta = (kw["prefix"][:2], kw["prefix"][2]) if kw["prefix"] else ((), None)

    def loss(backend, tiles, q, k, v, cache_kv):
        prefix = (*cache_kv, cache_meta) if cache_kv else None
        out = attend(q, k, v, q_meta, k_meta, backend=backend, prefix=prefix, tiles=tiles)
        return jnp.sum(jnp.sin(out) * weights)

    grad = lambda backend, tiles: jax.jit(jax.grad(functools.partial(loss, backend, tiles), argnums=(0, 1, 2, 3)))
    got = grad(PALLAS, TILES)(q, k, v, cache_kv)
    want = grad("xla", (64, 64))(q, k, v, cache_kv)
    _assert_grads_close(got, want)


# --------------------------------------------------------------------------------------
# Tile skipping
# --------------------------------------------------------------------------------------
def test_tile_test_is_sound_and_skips_the_masked_tiles_of_a_training_pack():
    """No tile with a visible pair is skipped; most fully masked tiles are."""
    rows = [packed_training_meta(64, np.array([3, 20, 41, 45]), 16, 128, 60, np.array([1, 1, 1, 0], bool))]
    meta = _meta(rows)
    vis = np.asarray(tile_visibility(meta, meta, 16, 16))[0]
    mask = np.asarray(attention_mask(meta, meta))[0]
    nonempty = mask.reshape(8, 16, 8, 16).any(axis=(1, 3))
    assert not (nonempty & ~vis).any()
    # the causal clean stream's upper triangle, blocks' other blocks and the invalid block: skipped
    assert vis.sum() < 0.5 * vis.size
    assert (vis & ~nonempty).sum() <= 4  # conservative only where a tile's ranges straddle


def test_skipped_cache_tiles_are_never_read():
    """NaN in whole key tiles past every row's cache length cannot reach the output."""
    args, kw = _run_case("verify", "float32")
    k_c, v_c, _ = kw["prefix"]  # a 40-slot span, lengths 33, 6, 17: padded to 64 slots
    k_pad = jnp.pad(k_c, ((0, 0), (0, 24), (0, 0), (0, 0)))
    v_pad = jnp.pad(v_c, ((0, 0), (0, 24), (0, 0), (0, 0)))
    m_pad = cache_key_meta(jnp.asarray([33, 6, 17]), 64)
    poisoned = jnp.arange(64)[None, :, None, None] >= 48  # the last 16-slot tile
    prefix = (jnp.where(poisoned, jnp.nan, k_pad), jnp.where(poisoned, jnp.nan, v_pad), m_pad)
    got = _jitted(PALLAS, TILES)(*args, prefix=prefix)
    want = _jitted("xla")(*args, prefix=(k_pad, v_pad, m_pad))
    assert bool(jnp.isfinite(got).all())
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_live_tile_lists_walk_exactly_the_visible_tiles_in_order():
    """The kernels' loop bounds: per query tile the live key tiles ascending, then repeats of the
    last one (a TPU grid re-requests the same block); per key tile likewise for dK/dV."""
    rows = [packed_training_meta(64, np.array([3, 20, 41, 45]), 16, 128, 60, np.array([1, 1, 1, 0], bool)),
            packed_training_meta(64, np.array([0, 9]), 16, 128, 5)]
    vis = np.asarray(tile_visibility(_meta(rows), _meta(rows), 16, 16))
    for v in (vis, vis.transpose(0, 2, 1)):
        tiles, count = map(np.asarray, live_tiles(jnp.asarray(v)))
        for b, m in np.ndindex(v.shape[:2]):
            live = np.flatnonzero(v[b, m])
            assert count[b, m] == len(live)
            assert list(tiles[b, m, :len(live)]) == list(live)
            assert (tiles[b, m, len(live):] == (live[-1] if len(live) else 0)).all()
    assert 0 < vis.mean() < 0.6  # the causal triangle and the other blocks are not visited


def test_cache_layer_is_read_in_place_within_its_span():
    """A CacheLayer prefix: the decode kernel gets the whole stacked cache (no slice copy) and
    reads only its layer's first ``span`` slots (NaN elsewhere cannot reach the output)."""
    args, kw = _run_case("verify", "float32")
    k_c, v_c, meta_c = kw["prefix"]  # 40-slot span
    stack = lambda x: jnp.stack([jnp.full((3, 56) + x.shape[2:], jnp.nan), jnp.pad(
        x, ((0, 0), (0, 16), (0, 0), (0, 0)), constant_values=jnp.nan)])  # layer 1 = the cache
    prefix = CacheLayer(stack(k_c), stack(v_c), meta_c, 1)
    run = jax.jit(lambda *a, prefix: attend(*a, backend=PALLAS, prefix=prefix, tiles=TILES))
    got = run(*args, prefix=prefix)
    np.testing.assert_allclose(got, _jitted("xla")(*args, prefix=kw["prefix"]), atol=1e-5, rtol=1e-5)
    jaxpr = jax.make_jaxpr(lambda *a: attend(*a, backend=PALLAS, prefix=prefix, tiles=TILES))(*args).jaxpr
    calls = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call" and e.params["name"] == "d3d_flash_decode"]
    assert len(calls) == 1 and (2, 3, 56, KV_HEADS, HEAD_DIM) in [v.aval.shape for v in calls[0].invars]


def _one_step_case(kv_heads: int, lengths=(9, 23, 0)):
    """One decode token per row (a GQA or an equal-heads model) over a 32-slot cache span; the
    last row is padding (its query fully masked)."""
    rng = np.random.default_rng(4)
    b, span = len(lengths), 32
    q, k, v = (_normal(rng, (b, 1, n, HEAD_DIM), jnp.float32) for n in (N_HEADS, kv_heads, kv_heads))
    ck, cv = (_normal(rng, (b, span, kv_heads, HEAD_DIM), jnp.float32) for _ in range(2))
    pos = jnp.asarray(lengths, jnp.int32)[:, None]
    q_meta = causal_meta(pos, pos > 0)
    return (q, k, v, q_meta, q_meta), (ck, cv, cache_key_meta(jnp.asarray(lengths, jnp.int32), span))


def _brute_force(q, k, v, q_meta, prefix):
    """Softmax over each row's valid cache slots and its own key, head by head, in NumPy."""
    ck, cv, meta = np.asarray(prefix[0], np.float64), np.asarray(prefix[1], np.float64), prefix[2]
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(q.shape)
    group = q.shape[2] // k.shape[2]
    for b, n in np.ndindex(q.shape[0], q.shape[2]):
        if not bool(q_meta.valid[b, 0]):
            continue
        keys = np.concatenate([ck[b, np.asarray(meta.valid[b]), n // group], k[b, :, n // group]])
        values = np.concatenate([cv[b, np.asarray(meta.valid[b]), n // group], v[b, :, n // group]])
        scores = keys @ q[b, 0, n] / np.sqrt(q.shape[-1])
        w = np.exp(scores - scores.max())
        out[b, 0, n] = w @ values / w.sum()
    return out


@pytest.mark.parametrize("kv_heads", [KV_HEADS, N_HEADS])
def test_xla_decode_step_both_formulations_equal_brute_force(kv_heads):
    """The xla backend's ways to attend with few query rows per kv head (products summed in
    place, the accelerators' choice; every head pair by a matmul, CPU's; a dot) all give
    brute-force attention."""
    from d3d_jax.model.attention import _xla_dense

    (q, k, v, q_meta, _), prefix = _one_step_case(kv_heads)
    want = _brute_force(q, k, v, q_meta, prefix)
    for kw in (dict(in_place=True), dict(in_place=False, all_pairs=True), dict(in_place=False)):
        got = jax.jit(functools.partial(_xla_dense, **kw))(q, q_meta, (prefix, (k, v, q_meta)))
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5, err_msg=str(kw))


def test_xla_decode_step_lowers_to_dots_on_cpu_and_reads_in_place_elsewhere():
    """One query row per kv head (no GQA, one token): XLA:CPU's library fusion runs the
    multiply-and-sum 10-20x slower than a dot there, so the CPU program holds dots; a GPU program
    (lowered here without one) keeps the products summed that read the cache span in place."""
    args, prefix = _one_step_case(N_HEADS)
    fn = jax.jit(lambda *a: attend(*a, backend="xla", prefix=prefix))
    dots = {p: fn.trace(*args).lower(lowering_platforms=(p,)).as_text().count("stablehlo.dot_general")
            for p in ("cpu", "cuda")}
    assert dots["cpu"] >= 2 and dots["cuda"] == 0, dots


def test_tpu_kernels_equal_xla_in_the_tpu_interpreter():
    """The Mosaic kernels (keys on the grid, scalar-prefetched tile lists, 128-lane heads), run by
    the TPU interpreter on CPU: forward and dq/dk/dv on a training pack with a GQA pair."""
    rows = [packed_training_meta(128, np.array([3, 40, 70, 100]), 32, 256, 120, np.array([1, 1, 0, 1], bool))]
    meta = _meta(rows)
    rng = np.random.default_rng(3)
    q, k, v = (_normal(rng, (1, 256, n, 128), jnp.float32) for n in (2, 1, 1))
    weights = _normal(rng, q.shape, jnp.float32)

    def loss(tpu, q, k, v):
        if tpu:
            out = flash_attention(q * 128 ** -0.5, k, v, meta, meta, platform="tpu_interpret", block_q=128,
                                  block_k=128)[0]
        else:
            out = attend(q, k, v, meta, meta, backend="xla")
        return jnp.sum(jnp.sin(out) * weights)

    got = jax.jit(jax.value_and_grad(functools.partial(loss, True), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, False), argnums=(0, 1, 2)))(q, k, v)
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
    _assert_grads_close(got[1], want[1])


# --------------------------------------------------------------------------------------
# Whole model: logits, loss and gradients
# --------------------------------------------------------------------------------------
def _tiny(backend: str, **kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=N_HEADS,
                num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, tie_word_embeddings=False)
    return ModelConfig(**{**base, **kw, "attention_backend": backend})


def _packed_batch(length=44, n_anchors=4, block=4, seed=0):
    cfg = DataConfig(packed_length=length, num_anchors=n_anchors, block_size=block)
    rng = np.random.default_rng(seed)
    rows = []
    for n in (cfg.clean_length, cfg.clean_length - 9):  # unequal rows: the second is padded
        ex = Example(rng.integers(0, 63, n).astype(np.int32), 4)
        anchors, valid = sample_anchors(rng, ex.response_start, n, n_anchors, block)
        rows.append(pack_example(ex, anchors, valid, cfg, 63))
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


@functools.lru_cache(maxsize=None)
def _loss_and_grads(backend: str, remat: str = "none"):
    """Loss and gradients of the D3D objective on one tiny packed batch (computed once per pair)."""
    batch = _packed_batch()
    cfg = _tiny(backend, remat_policy=remat, num_layers=1)
    graphdef, params, rest = nnx.split(init_model(cfg, seed=3), nnx.Param, ...)
    loss_fn = obj.make_loss_fn(ObjectiveConfig())
    f = lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch)[0]
    return jax.jit(jax.value_and_grad(f))(params)


def _assert_grads_close(got, want, tol=1e-5):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
        scale = float(jnp.max(jnp.abs(w)))
        assert float(jnp.max(jnp.abs(g - w))) <= tol * scale + 1e-12, jax.tree_util.keystr(path)


def test_training_loss_and_gradients_equal_xla():
    loss_x, grads_x = _loss_and_grads("xla")
    loss_p, grads_p = _loss_and_grads(PALLAS)
    assert abs(float(loss_p) - float(loss_x)) <= 1e-5 * abs(float(loss_x))
    _assert_grads_close(grads_p, grads_x)


def _count_forward_kernels(fn, *args) -> int:
    from jax._src.interpreters import partial_eval as pe

    closed = jax.make_jaxpr(fn)(*args)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))

    def count(j):
        n = 0
        for e in j.eqns:
            n += e.primitive.name == "pallas_call" and e.params.get("name") == "d3d_flash_fwd"
            for p in e.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    inner = getattr(sub, "jaxpr", sub)
                    n += count(inner) if hasattr(inner, "eqns") else 0
        return n
    return count(jaxpr)


def test_save_attention_remat_keeps_gradients_and_skips_the_second_forward():
    """``save_attention`` keeps the kernel's O(L) outputs: the backward reruns no forward kernel."""
    loss_ref, grads_ref = _loss_and_grads(PALLAS)
    loss, grads = _loss_and_grads(PALLAS, "save_attention")
    assert abs(float(loss) - float(loss_ref)) <= 1e-6 * abs(float(loss_ref))
    _assert_grads_close(grads, grads_ref, 1e-6)
    q = jnp.ones((1, 32, 2, 16))
    meta = causal_meta(jnp.arange(32)[None])
    layer = lambda x: jnp.sin(attend(x, 2 * x[:, :, :1], x[:, :, 1:], meta, meta, backend=PALLAS))
    kernels = {p: _count_forward_kernels(jax.value_and_grad(
        lambda x, p=p: jnp.sum(jax.checkpoint(layer, policy=remat_policy(p))(x))), q)
        for p in ("full", "save_attention")}
    assert kernels == {"full": 2, "save_attention": 1}


def _model_outputs(model, batch, tokens, lengths):
    """Logits of a packed training batch, and of 5 cached tokens per row after a ragged prefill."""
    b = tokens.shape[0]
    full = model(batch["tokens"], batch_meta(batch))
    cache = kvc.init_cache(model.config, b, 32)
    pre = causal_meta(jnp.broadcast_to(jnp.arange(7), (b, 7)), jnp.arange(7)[None] < lengths[:, None])
    _, cache = model(tokens[:, :7], pre, cache=cache)
    step_pos = lengths[:, None] + jnp.arange(5)[None]
    step = jnp.take_along_axis(tokens, step_pos, axis=1)
    return full, model(step, causal_meta(step_pos), cache=cache.with_lengths(lengths), cache_span=16)[0]


def test_model_logits_equal_xla_whole_sequence_and_cached():
    """The tiny Qwen3 whole-sequence (training pack) and cached (prefill, then a verify-like
    step over a 16-slot span with cache lengths 7 and 3)."""
    batch = _packed_batch()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 63, (2, 12)), jnp.int32)
    lengths = jnp.asarray([7, 3], jnp.int32)
    out = {b: nnx.jit(_model_outputs)(init_model(_tiny(b), seed=5), batch, tokens, lengths)
           for b in ("xla", PALLAS)}
    for got, want in zip(out[PALLAS], out["xla"]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_pallas_under_a_mesh_equals_xla():
    """Rows on data×fsdp and heads on tensor: the kernel runs per shard (shard_map)."""
    mesh = shd.make_mesh(dataclasses.replace(load_config(TrainRunConfig).mesh, data=2, fsdp=1, tensor=2),
                         jax.devices()[:4])
    args, kw = _run_case("training", "float32")
    with shd.use_mesh(mesh):
        got = jax.jit(lambda *a: attend(*a, backend=PALLAS, tiles=TILES))(*args)
    np.testing.assert_allclose(got, _jitted("xla")(*args), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# Memory, decoding identity, configuration
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_temp_memory_grows_linearly_with_pallas_quadratically_with_xla():
    """XLA's compiled memory analysis of loss + gradients at packed lengths 256 and 512."""
    temp = {}
    for backend in ("xla", PALLAS):
        cfg = dataclasses.replace(_tiny(backend), num_layers=1, remat_policy="full")
        graphdef, params, rest = nnx.split(init_model(cfg), nnx.Param, ...)
        loss_fn = obj.make_loss_fn(ObjectiveConfig())
        for length in (256, 512):
            batch = _packed_batch(length=length)
            f = jax.value_and_grad(lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b)[0])
            temp[backend, length] = jax.jit(f).lower(params, batch).compile().memory_analysis().temp_size_in_bytes
    print("temp bytes", temp)
    assert temp[PALLAS, 512] / temp[PALLAS, 256] < 2.2
    assert temp["xla", 512] / temp["xla", 256] > 3.0
    assert temp[PALLAS, 512] < temp["xla", 512] / 2


@pytest.mark.slow
def test_sync_greedy_decoding_with_pallas_equals_xla():
    from d3d_jax.bench.generator import Generator

    generate = Generator()

    prompts = [[5, 9, 2, 7, 1], [3, 3], [8, 1, 4, 4, 6, 2, 9]]
    outs = {}
    for backend in ("xla", PALLAS):
        target = init_model(_tiny(backend), seed=11)
        drafter = init_model(dataclasses.replace(_tiny(backend), num_layers=1, mask_token_id=63), seed=12)
        outs[backend] = [o.token_ids for o in generate(target, prompts, mode="sync", drafter=drafter,
                                                       max_new_tokens=10, block_size=4)]
    assert outs[PALLAS] == outs["xla"]
    assert all(len(t) == 10 for t in outs["xla"])


def test_backend_config_is_validated_and_not_an_hf_key():
    with pytest.raises(ConfigError, match=r"unknown attention backend 'flash'.*available on cpu: xla, "
                                          r"pallas_interpret"):
        ModelConfig(attention_backend="flash").validate()
    with pytest.raises(ConfigError, match=r"'pallas' needs gpu or tpu, this is cpu; available on cpu"):
        load_config(TrainRunConfig, [], ["model.attention_backend=pallas"])
    with pytest.raises(ConfigError, match="remat_policy"):
        load_config(TrainRunConfig, [], ["train.remat_policy=sometimes"])
    cfg = load_config(TrainRunConfig, [], ["model.attention_backend=pallas_interpret",
                                           "train.remat_policy=save_attention"])
    model_cfg = cfg.effective_model()
    assert (model_cfg.attention_backend, model_cfg.layer_remat) == ("pallas_interpret", "save_attention")
    hf = model_cfg.to_hf_dict()
    assert "attention_backend" not in hf and "remat_policy" not in hf
    assert ModelConfig.from_hf_dict(hf) == dataclasses.replace(model_cfg, attention_backend="xla",
                                                               remat_policy="none", vocab_size=hf["vocab_size"])
    assert ModelConfig(gradient_checkpointing=True).layer_remat == "full"  # the deprecated alias


def test_memory_plan_counts_the_backends_attention():
    """D3D-8B plan: XLA's attention holds the [L, L] scores, the fused kernel only O(L) arrays."""
    from d3d_jax.bench.train import memory_plan

    cfg = str(Path(__file__).resolve().parent.parent / "configs/train/d3d-8b.yaml")
    plans = {b: memory_plan(cfg, attention_backend=b) for b in ("xla", "pallas")}
    # the YAML's own mesh and batch: 16 rows over fsdp 16, the 32 heads over tensor 4
    assert plans["xla"]["mesh"] == "data 1 × fsdp 16 × tensor 4" and plans["xla"]["global_batch"] == 16
    L, heads = plans["xla"]["packed_length"], 32 // 4
    gib = {b: p["per_device_GiB"] for b, p in plans.items()}
    assert gib["xla"]["activations_detail"]["attention_per_layer"] >= heads * L * L * (4 + 2) / 2**30
    assert gib["pallas"]["activations_detail"]["attention_per_layer"] < 0.5  # q, k, v, out, lse, grads
    assert gib["pallas"]["total"] < gib["xla"]["total"] - 3  # the ~3.4 GiB of one layer's scores
    with pytest.raises(ConfigError, match="--plan-attention: unknown backend 'flash'"):
        memory_plan(cfg, 64, attention_backend="flash")
