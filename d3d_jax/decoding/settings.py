"""A decoder's config from the ``decoder:`` section a command read (:class:`~d3d_jax.config.decoding.DecoderConfig`).

The one step from "what the person asked for" to the config a decoder is built from, shared by the
server, ``infer/generate.py`` and the evaluation runner: derived defaults come from
:meth:`DecoderConfig.resolved`, and auto's prior τ from the drafter's ``result.json``.
"""

from __future__ import annotations

import dataclasses

from d3d_jax.config.decoding import DEFAULT_CACHE_LEN, DEFAULT_NUM_SLOTS, PROGRAM_ONLY, DecoderConfig
from d3d_jax.decoding.auto import offline_tau


def decoder_fields(config: DecoderConfig, drafter_path=None) -> dict:
    """The fields ``config`` (resolved) sets, ``mode`` included; auto's missing prior τ is the
    drafter's offline τ.  A field left None is left out (the config derives it), and so are the
    fields only a program sets (a section holds none)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(DecoderConfig)
              if f.name not in PROGRAM_ONLY}
    if config.mode == "auto" and fields["prior_tau"] is None and drafter_path is not None:
        fields["prior_tau"] = offline_tau(drafter_path)
    return {k: v for k, v in fields.items() if v is not None}


def decoder_config_for(config: DecoderConfig, *, drafter_path=None, **extra) -> DecoderConfig:
    """The resolved config of a command's ``config`` (``extra``: fields only programs set, e.g. EOS ids)."""
    return DecoderConfig(**{**decoder_fields(config, drafter_path), **extra}).resolved(
        num_slots=DEFAULT_NUM_SLOTS, max_cache_len=DEFAULT_CACHE_LEN)
