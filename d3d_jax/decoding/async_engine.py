"""Asynchronous speculative decoding (spec §5): ``engine.generate(mode="async")`` and
``SpecDecoder(..., DecoderConfig(mode="async"))``.

The pieces live where they belong: the device-side steps in :mod:`~d3d_jax.decoding.async_core`,
the dispatch-only round loop in :mod:`~d3d_jax.decoding.async_loop`, device slices in
:mod:`~d3d_jax.decoding.placement`, replay drafters with a hit rate in
:mod:`~d3d_jax.decoding.async_replay`.  This module keeps the names callers import.
"""

from d3d_jax.decoding.async_replay import AsyncReplayDrafter, CostedReplayDrafter
from d3d_jax.decoding.decoder_config import DEFAULT_BRANCH_FANOUT, DEFAULT_BRANCH_POSITIONS
from d3d_jax.decoding.placement import resolve_slices

__all__ = ["AsyncReplayDrafter", "CostedReplayDrafter", "resolve_slices", "DEFAULT_BRANCH_FANOUT",
           "DEFAULT_BRANCH_POSITIONS"]
