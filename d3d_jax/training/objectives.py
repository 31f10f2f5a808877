"""The D3D training objective (spec §2.4) and the offline acceptance length τ (spec §3.1).

``L = L_diff + λ·L_AR`` on a packed batch (:mod:`d3d_jax.training.data`):

* ``L_diff = Σ w_k·CE_k / Σ w_k`` over every valid block slot ``k = 1..B-1`` of the batch,
  ``w_k = exp(-(k-1)/γ)``; slot 0 (the anchor) gets no loss;
* ``L_AR`` – next-token CE on the clean stream (logit ``i`` predicts ``x[i+1]``), averaged over
  the positions whose label is a response token (``ar_mask``).

Every loss function has the signature ``loss_fn(model, batch) -> (loss, metrics)`` so the loop
(:mod:`d3d_jax.training.loop`) can train with any of them; ``weighted_block_loss`` is the hook for
a different per-slot loss (pruning's distillation against an adjusted teacher reuses the same
``w_k`` weighting and normalisation).

**Gradient accumulation.** A micro-batch's ratio ``Σw·CE/Σw`` is not its share of the batch's
ratio when micro-batches carry different token weights.  So the loop puts the *whole* batch's
denominators (:func:`loss_totals`) into every micro-batch under ``LOSS_TOTALS``; the losses then
divide by those, each micro-batch's loss and metrics are its exact contribution, and their sum
over the micro-batches is the whole-batch loss (and gradient).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from d3d_jax.config import ObjectiveConfig
from d3d_jax.training.data import batch_meta

LossFn = Callable[..., tuple[jax.Array, dict]]

# Batch key of the whole-batch denominators (``{"diff_weight", "ar_tokens"}``), set under
# gradient accumulation; without it every loss normalises by its own batch.
LOSS_TOTALS = "loss_totals"


def slot_weights(slot: jax.Array, gamma: float) -> jax.Array:
    """``w_k = exp(-(k-1)/γ)`` for block slots ``k >= 1``; 0 for slot 0 and non-block tokens."""
    k = slot.astype(jnp.float32)
    return jnp.where(slot >= 1, jnp.exp(-(k - 1.0) / gamma), 0.0)


def token_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token CE ``[...]`` in float32 from logits ``[..., V]``."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse - picked


def loss_totals(batch: dict, gamma: float) -> dict:
    """The denominators of the whole (e.g. ``[accum, micro, ...]``) batch: ``Σ w_k`` and the count
    of AR-loss tokens (data only, so the loop computes them before any forward pass)."""
    return {"diff_weight": jnp.sum(slot_weights(batch["slot"], gamma)),
            "ar_tokens": jnp.sum(batch["ar_mask"].astype(jnp.float32))}


def _total(batch: dict, key: str) -> jax.Array | None:
    return batch[LOSS_TOTALS][key] if LOSS_TOTALS in batch else None


def weighted_block_loss(per_token_loss: jax.Array, batch: dict, gamma: float) -> tuple[jax.Array, jax.Array]:
    """``Σ w·loss / Σ w`` over the batch's block slots (``Σ w`` of the whole batch when
    ``batch[LOSS_TOTALS]`` is set); returns ``(loss, this batch's Σ w)``."""
    w = slot_weights(batch["slot"], gamma)
    own = jnp.sum(w)
    total = _total(batch, "diff_weight")
    return jnp.sum(w * per_token_loss) / jnp.maximum(own if total is None else total, 1e-9), own


def masked_mean(per_token_loss: jax.Array, mask: jax.Array, total: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """``Σ mask·loss / total`` (``total`` defaults to ``Σ mask``); returns ``(mean, Σ mask)``."""
    m = mask.astype(jnp.float32)
    count = jnp.sum(m)
    return jnp.sum(m * per_token_loss) / jnp.maximum(count if total is None else total, 1.0), count


def ar_loss(per_token_loss: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Mean next-token CE over ``ar_mask`` (over the whole batch's AR tokens under accumulation)."""
    return masked_mean(per_token_loss, batch["ar_mask"], _total(batch, "ar_tokens"))


def d3d_loss_from_logits(logits: jax.Array, batch: dict, gamma: float, ar_weight: float) -> tuple[jax.Array, dict]:
    ce = token_cross_entropy(logits, batch["labels"])
    l_diff, wsum = weighted_block_loss(ce, batch, gamma)
    l_ar, n_ar = ar_loss(ce, batch)
    loss = l_diff + ar_weight * l_ar
    return loss, {"loss": loss, "loss_diff": l_diff, "loss_ar": l_ar, "diff_weight_sum": wsum,
                  "ar_tokens": n_ar}


def lm_loss_from_logits(logits: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
    loss, n = ar_loss(token_cross_entropy(logits, batch["labels"]), batch)
    return loss, {"loss": loss, "loss_ar": loss, "ar_tokens": n}


def make_loss_fn(cfg: ObjectiveConfig) -> LossFn:
    """``loss_fn(model, batch) -> (loss, metrics)`` for the configured objective."""
    if cfg.kind == "lm":
        def lm_loss(model, batch):
            return lm_loss_from_logits(model(batch["tokens"], batch_meta(batch)), batch)
        return lm_loss

    def d3d_loss(model, batch):
        return d3d_loss_from_logits(model(batch["tokens"], batch_meta(batch)), batch, cfg.gamma, cfg.ar_weight)
    return d3d_loss


# --------------------------------------------------------------------------------------
# Offline acceptance length (spec §3.1)
# --------------------------------------------------------------------------------------
def block_view(x: jax.Array, num_anchors: int, block_size: int) -> jax.Array:
    """The block region (the last ``n·B`` positions) of ``[b, L, ...]`` as ``[b, n, B, ...]``."""
    b = x.shape[0]
    return x[:, x.shape[1] - num_anchors * block_size:].reshape(b, num_anchors, block_size, *x.shape[2:])


def tau_from_logits(logits: jax.Array, batch: dict, block_size: int) -> dict:
    """τ = 1 + leading block slots whose argmax equals the response token, per valid anchor.

    Returns sums (so dev batches can be pooled exactly): ``tau_sum``, ``anchors``,
    ``slot_correct [B-1]`` (anchors whose slot k is right) and ``tau_hist [B]`` (count per τ-1).
    """
    n = batch["anchor_valid"].shape[-1]
    pred = block_view(jnp.argmax(logits, axis=-1), n, block_size)
    labels = block_view(batch["labels"], n, block_size)
    valid = batch["anchor_valid"].astype(jnp.float32)
    correct = (pred == labels)[..., 1:]  # [b, n, B-1]
    leading = jnp.sum(jnp.cumprod(correct.astype(jnp.int32), axis=-1), axis=-1)  # accepted drafts a
    tau_sum = jnp.sum((1.0 + leading) * valid)
    hist = jnp.sum(jax.nn.one_hot(leading, block_size) * valid[..., None], axis=(0, 1))
    slot_correct = jnp.sum(correct.astype(jnp.float32) * valid[..., None], axis=(0, 1))
    return {"tau_sum": tau_sum, "anchors": jnp.sum(valid), "slot_correct": slot_correct, "tau_hist": hist}


def summarize_tau(sums: dict) -> dict:
    """Means from (pooled) :func:`tau_from_logits` sums: ``tau``, ``slot_accuracy [B-1]``."""
    count = max(float(sums["anchors"]), 1.0)
    return {"tau": float(sums["tau_sum"]) / count,
            "slot_accuracy": [float(v) / count for v in jax.device_get(sums["slot_correct"])],
            "tau_hist": [int(v) for v in jax.device_get(sums["tau_hist"])],
            "anchors": int(sums["anchors"])}


def offline_tau(model, batch: dict, block_size: int) -> dict:
    """Offline τ of ``model`` on one packed batch: ``{"tau", "slot_accuracy", "tau_hist", "anchors"}``.

    Use a batch built from target-greedy responses; ``block_size`` must match the batch's.
    """
    logits = model(jnp.asarray(batch["tokens"]), batch_meta(batch))
    return summarize_tau(tau_from_logits(logits, {k: jnp.asarray(v) for k, v in batch.items()}, block_size))


def pool_tau_sums(parts: list[dict]) -> dict:
    out = dict(parts[0])
    for p in parts[1:]:
        out = {k: out[k] + p[k] for k in out}
    return out
