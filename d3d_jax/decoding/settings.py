"""A decoder's config from the settings a command read (:class:`~d3d_jax.config.decoding.DecoderSettings`).

The one step from "what the person asked for" to a :class:`~d3d_jax.decoding.decoder_config.DecoderConfig`,
shared by the server, ``infer/generate.py`` and the evaluation runner: derived defaults come from
:meth:`DecoderSettings.resolved`, and auto's prior τ from the drafter's ``result.json``.
"""

from __future__ import annotations

import dataclasses

from d3d_jax.config.decoding import DecoderSettings
from d3d_jax.decoding.auto import offline_tau
from d3d_jax.decoding.decoder_config import DecoderConfig, decoder_config

# DecoderSettings fields that are not DecoderConfig fields, or that only one mode reads
_ASYNC_ONLY = ("branch_positions", "branch_fanout", "target_devices", "drafter_devices")
_AUTO_ONLY = ("auto_sync_blocks", "auto_async", "prior_tau")


def decoder_fields(settings: DecoderSettings, drafter_path=None) -> dict:
    """DecoderConfig fields (``mode`` included) of resolved ``settings``; auto's missing prior τ is
    the drafter's offline τ.  Fields another mode reads are left out (None: the config's default)."""
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    if settings.mode != "async":
        fields.update({k: None for k in _ASYNC_ONLY})
    if settings.mode != "auto":
        fields.update({k: None for k in _AUTO_ONLY})
    elif fields["prior_tau"] is None and drafter_path is not None:
        fields["prior_tau"] = offline_tau(drafter_path)
    if not fields["sample_drafts"]:
        fields["sample_drafts"] = None
    if not fields["row_buckets"]:
        fields["row_buckets"] = None  # () is the config's own default; auto_async () means no async
    return {k: v for k, v in fields.items() if v is not None}


def decoder_config_for(settings: DecoderSettings, *, drafter_path=None, **extra) -> DecoderConfig:
    """The DecoderConfig of resolved ``settings`` (``extra``: fields no setting carries, e.g. EOS ids)."""
    fields = decoder_fields(settings, drafter_path)
    return decoder_config(fields.pop("mode"), **fields, **extra)
