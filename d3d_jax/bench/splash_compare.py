"""Splash attention with a dynamic mask, the maintained TPU alternative to the fused D3D kernel,
for compile-only comparisons (``infer/bench.py compile`` / kernel checks), never for training.

JAX's ``pallas/ops/tpu/splash_attention`` cannot evaluate the D3D rule from token metadata, so
the mask is materialised per row (``masks.attention_mask``, ``[T, S]`` bool, shared by the heads)
and ``make_splash_mha`` turns it into block-sparse mask info inside the program (a dynamic mask:
every partial block is kept, ``T·S`` bytes per row and per mask-info kind).  :func:`use_splash`
swaps it in for the ``pallas`` backend's kernel, so the same model program compiles either way.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from d3d_jax.model import attention
from d3d_jax.model.masks import attention_mask

SPLASH_BLOCK = 512


def _splash_rows(q, k, v, mask):
    """One row: ``q [N,T,H]``, ``k``/``v`` ``[K,S,H]``, ``mask [T,S]`` -> ``[N,T,H]``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    t, s = mask.shape
    bq, bk = min(SPLASH_BLOCK, t), min(SPLASH_BLOCK, s)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                          block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    kernel = sk.make_splash_mha(mask[None], block_sizes=sizes, head_shards=1, q_seq_shards=1)
    return kernel(q, k, v)


def splash_attend(q, q_meta, own, prefix, *, platform, tiles):
    """``attention._pallas``'s contract by splash attention (one segment: the training pack)."""
    del platform, tiles
    if prefix is not None:
        raise NotImplementedError("splash comparison: whole-sequence forwards only (no cache prefix)")
    k, v, k_meta = own
    dt = q.dtype
    q = q * jnp.asarray(q.shape[-1] ** -0.5, dt)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2).astype(dt)
    out = jax.vmap(_splash_rows)(heads_first(q), heads_first(k), heads_first(v), attention_mask(q_meta, k_meta))
    return jnp.swapaxes(out, 1, 2)


@contextlib.contextmanager
def use_splash():
    """Within the block, ``attention_backend: pallas`` traces splash attention instead of the D3D
    kernel (trace inside the block)."""
    original = attention._pallas
    attention._pallas = splash_attend
    try:
        yield
    finally:
        attention._pallas = original
