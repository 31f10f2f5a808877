"""A decoder's config from the settings a command read (:class:`~d3d_jax.config.decoding.DecoderSettings`).

The one step from "what the person asked for" to a :class:`~d3d_jax.decoding.decoder_config.DecoderConfig`,
shared by the server, ``infer/generate.py`` and the evaluation runner: derived defaults come from
:meth:`DecoderSettings.resolved`, and auto's prior τ from the drafter's ``result.json``.
"""

from __future__ import annotations

import dataclasses

from d3d_jax.config.decoding import DecoderSettings
from d3d_jax.decoding.auto import offline_tau
from d3d_jax.decoding.decoder_config import DecoderConfig


def decoder_fields(settings: DecoderSettings, drafter_path=None) -> dict:
    """The fields ``settings`` (resolved) set, ``mode`` included; auto's missing prior τ is the
    drafter's offline τ.  A field left None is left out (the config derives it)."""
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(DecoderSettings)}
    if settings.mode == "auto" and fields["prior_tau"] is None and drafter_path is not None:
        fields["prior_tau"] = offline_tau(drafter_path)
    return {k: v for k, v in fields.items() if v is not None}


def decoder_config_for(settings: DecoderSettings, *, drafter_path=None, **extra) -> DecoderConfig:
    """The DecoderConfig of resolved ``settings`` (``extra``: fields no setting carries, e.g. EOS ids)."""
    return DecoderConfig(**decoder_fields(settings, drafter_path), **extra)
