"""One attention entry point for every forward of the model, with interchangeable backends.

Every kind of forward is the same call: queries with their :class:`TokenMeta` attend to keys
with theirs, the mask being :func:`~d3d_jax.model.masks.attention_mask` of the two:

* prefill and the whole-sequence forward (causal);
* the cached verify (B queries over the used cache span) and the cached drafting forward
  ``[anchor, MASK…]`` – the cache span is a ``prefix`` segment in front of the new keys;
* the §5 branch pack (N_async queries over cache + pack) and the §2.3 training pack.

Backends (``ModelConfig.attention_backend``; validated in :mod:`d3d_jax.config.model`):

* ``"xla"`` – the reference and the default: dense ``[B, N, T, S]`` scores, mask, softmax;
* ``"pallas"`` / ``"pallas_interpret"`` – :mod:`~d3d_jax.model.flash_attention`, the fused
  kernel that builds the mask per tile and visits only live tiles, O(L) memory in the backward;
  segments (cache, new keys) run separately and merge by log-sum-exp.  A cache prefix runs as
  flash-decoding (:mod:`~d3d_jax.model.flash_decode`: GQA heads stacked into rows, keys split
  across CTAs) and, given as a :class:`CacheLayer`, is read in place (no copy of the span).
  On TPU the same tile math runs as Mosaic kernels (:mod:`~d3d_jax.model.flash_tpu`);

A fully masked query row (padding) returns 0 in every backend.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence, Union

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from d3d_jax.config import check_attention_backend
from d3d_jax.model.flash_attention import flash_attention, flash_decode_cache, reads_pages
from d3d_jax.model.masks import TokenMeta, attention_mask
from d3d_jax.parallel import sharding as shd

Segment = tuple[jax.Array, jax.Array, TokenMeta]  # keys [B,S,K,H], values [B,S,K,H], key metadata
_BIG_NEG = -1e30
# Query rows per kv head (T·N/K) up to which the xla backend multiplies and sums instead of
# calling a dot, on accelerators: a dot's batch dims must be major, so XLA would copy every
# layer's cache span into [b, k, s, h] first (a whole-cache copy per decode step: 288 MB at
# Qwen3-8B, cache 2048).  Below a tensor-core tile (16 rows) the products cost less than that copy.
# One row on CPU gets all pairs instead: XLA's CPU library fusion (YNNPACK) runs the
# multiply-and-sum 10-25x slower when the cache operand needs no broadcast (one query row per kv
# head: no GQA, T = 1), and a dot copies the span into [b, k, s, h] (K) and [b, k, h, s] (V) per
# layer and step.  Every query head against every kv head is one plain matmul of the span as it
# lies ([s·k, h] and [s, k·h]); the diagonal is kept.  K-fold products, yet 2-2.5x faster than the
# dot at 4 and 8 heads, 672 slots.
_IN_PLACE_ROWS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CacheLayer:
    """The first ``span`` slots of layer ``layer`` of a stacked KV cache, as an attention prefix.

    The fused kernel reads them in place from the whole ``[L, B, S_max, K, H]`` arrays; a slice
    (what the other backends take) would be a copy of the span per layer and call.  ``layer`` is
    data (an int32 scalar, the layer scan's step), so one program serves every layer.
    """

    k_lbskh: jax.Array
    v_lbskh: jax.Array
    meta: TokenMeta  # of the span's slots, [B, span]
    layer: jax.Array  # [] int32

    def segment(self) -> Segment:
        span = self.meta.shape[1]
        k = jax.lax.dynamic_index_in_dim(self.k_lbskh, self.layer, 0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(self.v_lbskh, self.layer, 0, keepdims=False)
        return k[:, :span], v[:, :span], self.meta


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadsFirstLayer:
    """One layer of a :class:`~d3d_jax.model.kv_cache.LayerKVCache` (``[B, K, S, H]``, the CPU
    layout) as an attention prefix: the reference backend's dots read it whole, in place (their
    batch dims, rows and heads, are major); other backends get it as a segment (a copy)."""

    k_bksh: jax.Array
    v_bksh: jax.Array
    meta: TokenMeta  # of the slots, [B, S]

    def segment(self) -> Segment:
        return jnp.swapaxes(self.k_bksh, 1, 2), jnp.swapaxes(self.v_bksh, 1, 2), self.meta


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CacheSpans:
    """A :class:`CacheLayer` at one of several static spans (one key metadata each), picked on the
    device by ``index``: :func:`attend` switches over the spans, and only the attention is in
    each branch (see :class:`~d3d_jax.model.kv_cache.SpanChoice`)."""

    k_lbskh: jax.Array
    v_lbskh: jax.Array
    metas: tuple[TokenMeta, ...]  # [B, span] per span, smallest first
    index: jax.Array  # [] int32
    layer: jax.Array  # [] int32

    def at(self, j: int) -> CacheLayer:
        return CacheLayer(self.k_lbskh, self.v_lbskh, self.metas[j], self.layer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedLayer:
    """The first ``span`` positions of layer ``layer`` of a paged KV cache
    (:mod:`~d3d_jax.model.paged_kv`), as an attention prefix: the fused decode kernel reads the
    pool through the rows' page tables in place (:func:`kernel_reads_pages`); other backends read
    the segment one gather through the tables makes (the span's pages, in row order)."""

    k_lpskh: jax.Array  # [L, num_pages, page_size, K, H]
    v_lpskh: jax.Array
    page_table: jax.Array  # [B, max_pages] int32; entries outside the pool are clipped (masked keys)
    meta: TokenMeta  # of the span's positions, [B, span]
    layer: jax.Array  # [] int32

    def segment(self) -> Segment:
        b, span = self.meta.shape
        num_pages, page_size = self.k_lpskh.shape[1:3]
        n = -(-span // page_size)
        pages = jnp.clip(self.page_table[:, :n], 0, num_pages - 1)

        def read(pool):  # one gather of the layer's pages: [B, n, page_size, K, H]
            rows = pool[self.layer, pages]
            return rows.reshape((b, n * page_size) + rows.shape[3:])[:, :span]

        return read(self.k_lpskh), read(self.v_lpskh), self.meta


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedSpans:
    """A :class:`PagedLayer` at one of several static spans, picked on the device by ``index``
    (as :class:`CacheSpans`)."""

    k_lpskh: jax.Array
    v_lpskh: jax.Array
    page_table: jax.Array
    metas: tuple[TokenMeta, ...]
    index: jax.Array
    layer: jax.Array

    def at(self, j: int) -> PagedLayer:
        return PagedLayer(self.k_lpskh, self.v_lpskh, self.page_table, self.metas[j], self.layer)


Prefix = Union[Segment, CacheLayer, CacheSpans, PagedLayer, PagedSpans, HeadsFirstLayer]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_meta: TokenMeta, k_meta: TokenMeta, *,
           backend: str = "xla", prefix: Prefix | None = None, tiles: tuple[int, int] = (64, 64)
           ) -> jax.Array:
    """Softmax attention ``[B, T, N, H]`` (``q``'s dtype) of ``q [B, T, N, H]`` over ``[prefix | k]``.

    ``q`` carries RoPE but no scaling (``H ** -0.5`` is applied here).  ``k``/``v`` are
    ``[B, S, K, H]`` with ``N`` a multiple of ``K`` (grouped-query attention); ``prefix`` is an
    optional earlier key segment (the KV cache span) with its own metadata, a
    ``(k, v, meta)`` tuple, a :class:`CacheLayer` or a paged cache's :class:`PagedLayer`.  ``tiles`` are the
    fused kernel's largest (query, key) tiles (powers of two >= 16; shorter inputs get smaller).
    """
    if isinstance(prefix, (CacheSpans, PagedSpans)):
        branches = [lambda q, k, v, j=j: attend(q, k, v, q_meta, k_meta, backend=backend, prefix=prefix.at(j),
                                                tiles=tiles) for j in range(len(prefix.metas))]
        return jax.lax.switch(prefix.index, branches, q, k, v)
    if isinstance(prefix, PagedLayer) and not kernel_reads_pages(backend, prefix.k_lpskh.shape[2]):
        prefix = prefix.segment()
    if isinstance(prefix, HeadsFirstLayer) and backend != "xla":
        prefix = prefix.segment()
    if backend in ("pallas", "pallas_interpret"):
        run = functools.partial(_pallas, platform=kernel_platform(backend), tiles=tiles)
        return _per_shard(run, q, q_meta, (k, v, k_meta), prefix)
    if isinstance(prefix, CacheLayer):
        prefix = prefix.segment()
    segments = ([prefix] if prefix is not None else []) + [(k, v, k_meta)]
    if backend == "xla":
        return _xla(q, q_meta, segments)
    check_attention_backend(backend, "attention backend")  # raises: unknown or unavailable
    raise AssertionError(backend)


def _xla(q: jax.Array, q_meta: TokenMeta, segments: Sequence[Segment]) -> jax.Array:
    """The reference: dense scores per segment, concatenated, one softmax.

    Few query rows per kv head read the cache span in place by products summed, except on CPU,
    where they take all head pairs (``_IN_PLACE_ROWS``); the platform is the one the program
    is lowered for (a compile-only GPU program built on a CPU host gets the GPU's choice)."""
    _, t, n, _ = q.shape
    rows = t * (n // segments[-1][0].shape[2])
    if rows > _IN_PLACE_ROWS:
        return _xla_dense(q, q_meta, segments, in_place=False)
    # on CPU a few rows per kv head (GQA decode) take all head pairs too: 2.3x the products' speed
    # at 48 rows x 640 slots (3.6 vs 8.2 ms a layer), no copy of the span
    return jax.lax.platform_dependent(
        q, q_meta, tuple(segments), cpu=functools.partial(_xla_dense, in_place=False, all_pairs=True),
        default=functools.partial(_xla_dense, in_place=True))


def _xla_dense(q: jax.Array, q_meta: TokenMeta, segments: Sequence[Segment], *, in_place: bool,
               all_pairs: bool = False) -> jax.Array:
    b, t, n, h = q.shape
    dt = q.dtype
    kh = segments[-1][0].shape[2]
    q = q.reshape(b, t, kh, n // kh, h) * jnp.asarray(h ** -0.5, dt)
    mode = "in_place" if in_place else "all_pairs" if all_pairs else "dot"
    big_neg = jnp.float32(_BIG_NEG)
    scores = []
    for seg in segments:
        s = _scores(q, seg, mode)
        scores.append(jnp.where(attention_mask(q_meta, _key_meta(seg))[:, None, None], s, big_neg))
    scores = scores[0] if len(scores) == 1 else jnp.concatenate(scores, axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    # A fully masked row (padding) gives a uniform distribution over garbage; zero it.
    probs = jnp.where(jnp.max(scores, axis=-1, keepdims=True) > big_neg / 2, probs, 0.0)
    # probabilities rounded to the compute dtype as the dot's inputs are (summed in f32 in place)
    rounded = (jnp.transpose(probs.astype(dt).astype(jnp.float32), (0, 3, 4, 1, 2))[..., None] if in_place
               else probs.astype(dt))
    out, start = None, 0
    for seg in segments:
        size = _key_meta(seg).shape[1]
        p = probs if isinstance(seg, HeadsFirstLayer) else rounded
        if len(segments) > 1:
            p = p[:, :, start:start + size] if p is rounded and in_place else p[..., start:start + size]
        part = _values(p, seg, mode, dt)
        out = part if out is None else out + part
        start += size
    return out.astype(dt).reshape(b, t, n, h)


def _key_meta(seg) -> TokenMeta:
    return seg.meta if isinstance(seg, HeadsFirstLayer) else seg[2]


def _scores(q: jax.Array, seg, mode: str) -> jax.Array:
    """Scores ``[b, k, g, t, s]`` (f32) of ``q [b, t, k, g, h]`` (scaled) against a segment's keys."""
    b, t, kh, g, _ = q.shape
    dt = q.dtype
    if isinstance(seg, HeadsFirstLayer):  # batch dims (b, k) major in the cache: read in place
        return jnp.einsum("btkgh,bksh->bkgts", q, seg.k_bksh.astype(dt), preferred_element_type=jnp.float32)
    k = seg[0]
    if mode == "in_place":  # products summed in f32 read the cache span where it lies
        s = jnp.sum(q.astype(jnp.float32)[:, :, None] * k.astype(jnp.float32)[:, None, :, :, None], -1)
        return jnp.transpose(s, (0, 3, 4, 1, 2))
    if mode == "all_pairs":  # [s·j, h] x [h, k·t·g] as the span lies; the pairs j == k are sliced out
        s = jnp.einsum("bsjh,btkgh->bsjtkg", k.astype(dt), q, preferred_element_type=jnp.float32)
        s = jnp.transpose(s, (0, 1, 2, 4, 3, 5)).reshape(b, -1, kh * kh, t, g)  # j, k adjacent
        return jnp.transpose(_diagonal(s, kh, axis=2), (0, 2, 4, 3, 1))
    # a dot: XLA first copies K into [b, k, s, h] (batch dims major)
    return jnp.einsum("btkgh,bskh->bkgts", q, k.astype(dt), preferred_element_type=jnp.float32)


def _values(p: jax.Array, seg, mode: str, dt) -> jax.Array:
    """``[b, t, k, g, h]``: probabilities times a segment's values; ``p`` is ``[b, k, g, t, s]``
    (f32 for a heads-first segment, else rounded to ``dt``) or, in place, ``[b, t, s, k, g, 1]``."""
    if isinstance(seg, HeadsFirstLayer):  # p the dot's lhs: as an einsum XLA made V the lhs, a copy of V^T
        b, kh, g, t, _ = p.shape
        out = jax.lax.dot_general(p.astype(dt).reshape(b, kh, g * t, -1), seg.v_bksh.astype(dt),
                                  (((3,), (2,)), ((0, 1), (0, 1))))
        return jnp.transpose(out.reshape(b, kh, g, t, -1), (0, 3, 1, 2, 4))
    v = seg[1]
    if mode == "in_place":
        return jnp.sum(p * v.astype(jnp.float32)[:, None, :, :, None], axis=2)
    if mode == "all_pairs":  # [g·t·k, s] x [s, j·h], the pairs j == k sliced out
        b, kh, g, t, _ = p.shape
        pv = jnp.einsum("bkgts,bsjh->bkgtjh", p, v.astype(dt))
        pv = jnp.transpose(pv, (0, 2, 3, 1, 4, 5)).reshape(b, g, t, kh * kh, -1)
        return jnp.transpose(_diagonal(pv, kh, axis=3), (0, 2, 3, 1, 4))
    return jnp.einsum("bkgts,bskh->btkgh", p, v.astype(dt))


def _diagonal(x: jax.Array, k: int, axis: int = -1) -> jax.Array:
    """The pairs ``(i, i)`` of an axis holding ``k × k`` pairs ``(i, j)``: a strided slice.  A
    masked sum over ``j`` selected an array as large as the products and reduced it (XLA:CPU gave
    the reduce to YNNPACK): 0.4 ms more per step at 8 / 8 heads and 576 slots."""
    return jax.lax.slice_in_dim(x, 0, k * k, k + 1, axis)


def kernel_reads_pages(backend: str, page_size: int) -> bool:
    """Whether ``backend``'s fused decode kernel reads a paged prefix through its page table
    (else every backend reads the gathered span, :meth:`PagedLayer.segment`)."""
    return backend in ("pallas", "pallas_interpret") and reads_pages(page_size, kernel_platform(backend))


def kernel_platform(backend: str) -> str:
    """The platform the fused kernel lowers for: the active mesh's devices (a compile-only
    topology on a CPU host included), else the default backend; ``interpret`` for the test path."""
    if backend == "pallas_interpret":
        return "interpret"
    mesh = shd.active_mesh()  # an AbstractMesh: its devices are described, not listed
    device = getattr(mesh, "abstract_device", None) if mesh is not None else None
    platform = device.platform if device is not None else jax.default_backend()
    return "tpu" if platform == "tpu" else "gpu"


def _pallas(q: jax.Array, q_meta: TokenMeta, own: Segment, prefix: Prefix | None, *, platform: str,
            tiles: tuple[int, int]) -> jax.Array:
    """The new keys by the flash kernel, a cache prefix by flash-decoding, merged by log-sum-exp."""
    dt = q.dtype
    q = q * jnp.asarray(q.shape[-1] ** -0.5, dt)
    kw = dict(platform=platform, block_q=tiles[0], block_k=tiles[1])
    k, v, k_meta = own
    if prefix is None:
        return flash_attention(q, k.astype(dt), v.astype(dt), q_meta, k_meta, **kw)[0]
    if isinstance(prefix, CacheLayer):
        cached = flash_decode_cache(q, prefix.k_lbskh.astype(dt), prefix.v_lbskh.astype(dt), prefix.layer,
                                    q_meta, prefix.meta, platform=platform, out_dtype=jnp.float32,
                                    block_k=tiles[1])
    elif isinstance(prefix, PagedLayer):  # read through the page table, as the dense cache in place
        cached = flash_decode_cache(q, prefix.k_lpskh.astype(dt), prefix.v_lpskh.astype(dt), prefix.layer,
                                    q_meta, prefix.meta, platform=platform, out_dtype=jnp.float32,
                                    block_k=tiles[1], page_table=prefix.page_table)
    else:
        pk, pv, p_meta = prefix
        cached = flash_attention(q, pk.astype(dt), pv.astype(dt), q_meta, p_meta, out_dtype=jnp.float32,
                                 decode=True, **kw)
    parts = [cached, flash_attention(q, k.astype(dt), v.astype(dt), q_meta, k_meta, out_dtype=jnp.float32, **kw)]
    return merge_partials(parts).astype(dt)


def merge_partials(parts: Sequence[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """Attention over the union of key segments from each one's ``(out [B,T,N,H], lse [B,N,T])``."""
    lse = jnp.stack([p[1] for p in parts])
    weights = jnp.exp(lse - jnp.max(lse, axis=0))  # a row masked in every part: all 1, outputs 0
    weights = jnp.transpose(weights, (0, 1, 3, 2))[..., None]  # [P, B, T, N, 1]
    total = sum(w * o.astype(jnp.float32) for w, (o, _) in zip(weights, parts))
    return total / jnp.sum(weights, axis=0)


def _per_shard(fn, q: jax.Array, q_meta: TokenMeta, own: Segment, prefix: Prefix | None) -> jax.Array:
    """Run ``fn`` per device under the active mesh: rows and heads are independent in attention.

    A kernel call is opaque to XLA's partitioner, so it gets ``shard_map`` with the batch on its
    logical mesh axes and heads on theirs (replicated when query and kv heads do not split alike,
    as GQA groups must stay together).  Lengths are never split.
    """
    mesh = shd.active_mesh()
    if mesh is None:
        return fn(q, q_meta, own, prefix)
    spec = lambda name, size: shd.logical_to_spec((name,), (size,), mesh)[0]
    rows = spec("batch", q.shape[0])
    heads, kv_heads = spec("act_heads", q.shape[2]), spec("act_kv_heads", own[0].shape[2])
    if heads != kv_heads:
        heads = kv_heads = None
    q_spec, kv_spec, meta_spec = P(rows, None, heads, None), P(rows, None, kv_heads, None), P(rows, None)
    seg_spec = (kv_spec, kv_spec, meta_spec)
    if isinstance(prefix, CacheLayer):
        cache_spec = P(None, rows, None, kv_heads, None)
        prefix_spec = CacheLayer(cache_spec, cache_spec, meta_spec, P())
    elif isinstance(prefix, PagedLayer):  # the pool is every row's: split by heads only
        pool_spec = P(None, None, None, kv_heads, None)
        prefix_spec = PagedLayer(pool_spec, pool_spec, P(rows, None), meta_spec, P())
    else:
        prefix_spec = None if prefix is None else seg_spec
        prefix = None if prefix is None else tuple(prefix)
    in_specs = (q_spec, meta_spec, seg_spec, prefix_spec)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
        q, q_meta, tuple(own), prefix)
