"""A decoder's config from the ``decoder:`` section a command read (:class:`~d3d_jax.config.decoding.DecoderConfig`).

The one step from "what the person asked for" to the config a decoder is built from, shared by the
server, ``infer/generate.py`` and the evaluation runner: derived defaults come from
:meth:`DecoderConfig.resolved`, auto's prior τ from the drafter's ``result.json``, and a paged
cache's pool size from ``kv_cache_tokens`` or the device's free memory (:func:`kv_pool_pages`).
"""

from __future__ import annotations

import dataclasses

from d3d_jax.config import ConfigError
from d3d_jax.config.decoding import DEFAULT_CACHE_LEN, DEFAULT_NUM_SLOTS, PROGRAM_ONLY, DecoderConfig
from d3d_jax.decoding.auto import offline_tau
from d3d_jax.model import paged_kv as pkv


def decoder_fields(config: DecoderConfig, drafter_path=None) -> dict:
    """The fields ``config`` (resolved) sets, ``mode`` included; auto's missing prior τ is the
    drafter's offline τ.  A field left None is left out (the config derives it), and so are the
    fields only a program sets (a section holds none)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(DecoderConfig)
              if f.name not in PROGRAM_ONLY}
    if config.mode == "auto" and fields["prior_tau"] is None and drafter_path is not None:
        fields["prior_tau"] = offline_tau(drafter_path)
    return {k: v for k, v in fields.items() if v is not None}


def decoder_config_for(config: DecoderConfig, *, drafter_path=None, target_config=None, drafter_config=None,
                       **extra) -> DecoderConfig:
    """The resolved config of a command's ``config`` (``extra``: fields only programs set, e.g. EOS
    ids); on an accelerator a paged pool that ``kv_cache_tokens`` leaves unsized is sized from
    free memory (:func:`kv_pool_pages`; ``target_config`` / ``drafter_config``: the models' configs)."""
    fields = decoder_fields(config, drafter_path)
    if fields.get("kv_page_size") and target_config is not None and "kv_pages" not in extra:
        extra["kv_pages"] = kv_pool_pages(config, target_config, drafter_config) or 0
    return DecoderConfig(**{**fields, **extra}).resolved(num_slots=DEFAULT_NUM_SLOTS, max_cache_len=DEFAULT_CACHE_LEN)


# The programs' temporaries, which the pool must leave room for: the longest prefill's logits
# (float32, one row) twice over, and a round's per-row logits a few times over.  An estimate: the
# pool is allocated before any program is compiled, so memory_analysis() cannot be asked yet.
def _temporaries_bytes(target_config, config: DecoderConfig) -> int:
    vocab = int(target_config.vocab_size)
    return 4 * vocab * (2 * int(config.max_cache_len) + 4 * int(config.num_slots))


def kv_pool_pages(config: DecoderConfig, target_config, drafter_config=None, device=None) -> int | None:
    """Pages a paged pool gets from an accelerator's memory: what ``memory_utilization`` of it
    leaves after what is in use (the weights, loaded by now) and the programs' temporaries; a page
    holds the target's K/V and, with a drafter, the drafter's (one table over both pools).  None
    where ``kv_cache_tokens`` is given or on a CPU (the config then takes ``kv_cache_tokens``, or
    ``num_slots`` whole ``max_cache_len`` rows)."""
    stats = None if config.kv_cache_tokens is not None else _memory_stats(device)
    if stats is None:
        return None
    room = (stats["bytes_limit"] * float(config.memory_utilization) - stats["bytes_in_use"]
            - _temporaries_bytes(target_config, config))
    per_token = sum(pkv.page_bytes(c, 1) for c in (target_config, drafter_config) if c is not None)
    tokens = max(int(room // per_token), 0)
    one_row = -(-int(config.max_cache_len) // int(config.kv_page_size))
    pages = tokens // int(config.kv_page_size)
    if pages < one_row:
        raise ConfigError(f"decoder.memory_utilization: {config.memory_utilization} of the device's "
                          f"memory leaves {tokens} tokens of KV cache after the weights, fewer than one "
                          f"sequence of max_model_len {config.max_cache_len}: raise it, lower "
                          f"--max-model-len or give --kv-cache-tokens")
    return pages


def _memory_stats(device=None) -> dict | None:
    """An accelerator's ``bytes_limit`` and ``bytes_in_use``; None on a CPU (or when unknown)."""
    import jax

    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    return stats if {"bytes_limit", "bytes_in_use"} <= stats.keys() else None
