"""RoPE frequencies of every scaling form transformers 5 gives a Qwen3 (``modeling_rope_utils``),
as the inverse frequencies ``[h/2]`` and the factor that scales cos and sin.

``default``, ``linear``, ``yarn`` and ``llama3`` are fixed per model (computed once, in float64,
then rounded to float32).  ``dynamic`` (NTK) and ``longrope`` depend on the sequence length:
transformers recomputes them from ``max(position_ids) + 1`` of each forward (``dynamic`` only once
it exceeds ``max_position_embeddings``, ``longrope`` switching to ``long_factor`` past
``original_max_position_embeddings``).  Here that length is each row's own (its largest position
+ 1), so a row's tokens never depend on the other rows; for one row, or rows of one length, it is
transformers' rule.  Inside the pretraining context both equal plain RoPE / ``short_factor``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from d3d_jax.config.rope import RopeScaling


def _plain(dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _yarn(dim: int, theta: float, s: RopeScaling, max_pos: int) -> tuple[np.ndarray, float]:
    factor = s.effective_factor(max_pos)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim) if (
            s.mscale and s.mscale_all_dim) else mscale(factor)
    orig = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast or 32), correction_dim(s.beta_slow or 1)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate (slow dims)
    base = _plain(dim, theta)
    return base / factor * (1 - extrapolate) + base * extrapolate, float(attention)


def _llama3(dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    base = _plain(dim, theta)
    orig, lo, hi, factor = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor, s.factor
    wavelen = 2 * math.pi / base
    scaled = np.where(wavelen > orig / lo, base / factor, base)
    smooth = (orig / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / hi) & ~(wavelen > orig / lo)
    return np.where(medium, smoothed, scaled)


def static_frequencies(dim: int, theta: float, s: RopeScaling | None, max_pos: int) -> tuple[np.ndarray, float]:
    """``(inv_freq [dim/2] float32, attention factor)`` of the forms fixed per model."""
    if s is None or s.rope_type == "dynamic":  # dynamic: plain until the context is exceeded
        inv, attention = _plain(dim, theta), 1.0
    elif s.rope_type == "linear":
        inv, attention = _plain(dim, theta) / s.factor, 1.0
    elif s.rope_type == "yarn":
        inv, attention = _yarn(dim, theta, s, max_pos)
    elif s.rope_type == "llama3":
        inv, attention = _llama3(dim, theta, s), 1.0
    elif s.rope_type == "longrope":
        inv, attention = _plain(dim, theta) / np.asarray(s.short_factor, np.float64), _longrope_attention(s, max_pos)
    else:
        raise ValueError(f"unknown rope_type {s.rope_type!r}")
    return inv.astype(np.float32), attention


def _longrope_attention(s: RopeScaling, max_pos: int) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)
    factor = s.effective_factor(max_pos)
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(s.original_max_position_embeddings))


def frequencies(positions_bt: jax.Array, dim: int, theta: float, s: RopeScaling | None,
                max_pos: int) -> tuple[jax.Array, float]:
    """``(inv_freq, attention factor)``: ``[dim/2]`` for the fixed forms, ``[b, 1, dim/2]`` for the
    length-dependent ones (each row's length = its largest position + 1)."""
    inv, attention = static_frequencies(dim, theta, s, max_pos)
    if s is None or s.rope_type not in ("dynamic", "longrope"):
        return jnp.asarray(inv), attention
    seq_len = jnp.max(positions_bt, axis=-1).astype(jnp.float32) + 1.0  # [b]
    if s.rope_type == "longrope":
        long = (_plain(dim, theta) / np.asarray(s.long_factor, np.float64)).astype(np.float32)
        use_long = (seq_len > s.original_max_position_embeddings)[:, None, None]
        return jnp.where(use_long, jnp.asarray(long), jnp.asarray(inv)), attention
    # dynamic NTK, in float32 as transformers computes it
    seq_len = jnp.maximum(seq_len, float(max_pos))
    factor = float(s.factor)
    grown = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))  # [b]
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    return (1.0 / (grown[:, None, None] ** exponents)).astype(jnp.float32), attention
