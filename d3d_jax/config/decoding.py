"""Decoder settings: the ``decoder:`` section that every command that decodes reads.

``infer/serve.py``, ``infer/generate.py`` and ``infer/bench.py eval`` take these fields from YAML
(``configs/serve/*.yaml``), ``key=value`` overrides and their flags (``--mode`` is ``decoder.mode``,
``--block-size`` is ``decoder.block_size`` …).  A field left ``None`` is derived by
:meth:`DecoderSettings.derived`, the one place the derived defaults are written, and the rule tying
a mode to a drafter is :func:`check_drafter`.  The decoder's own config
(:class:`~d3d_jax.decoding.decoder_config.DecoderConfig`) is these settings plus what only a
program passes (EOS ids, benchmark hooks): it inherits the fields, their checks and their defaults.
"""

from __future__ import annotations

import dataclasses
import numbers

from d3d_jax.config.base import DTYPES, TEXT, _require, between, one_of
from d3d_jax.config.model import ATTENTION_CHOICES
from d3d_jax.config.limits import MAX_BLOCK_SIZE, MAX_CACHE_LEN, MAX_SLOTS, require_int

MODES = ("plain", "sync", "async", "auto")
DEFAULT_BLOCK_SIZE = 16  # B when neither the settings nor the drafter's config give one (the paper's)
DEFAULT_BRANCH_POSITIONS = 12  # C (spec §5: the paper's optimum with F = 2), capped at B
DEFAULT_BRANCH_FANOUT = 2  # F
MAX_BRANCH_FANOUT = 64
MAX_DEVICES = 1 << 16
DEFAULT_NUM_SLOTS = 8  # rows of a decoder built without a command's own number (a library user's)
DEFAULT_CACHE_LEN = 1024  # KV slots per row of such a decoder
AUTO_SYNC_BLOCKS = (4, 8, 16)  # auto: sync block sizes b (<= block_size; the drafter trains at 16)
AUTO_ASYNC_GEOMETRIES = ((4, 2), (12, 2))  # auto: async (C, F) menu
ASYNC_ONLY = ("branch_positions", "branch_fanout")
AUTO_ONLY = ("auto_sync_blocks", "auto_async", "prior_tau")


def check_drafter(mode: str, has_drafter: bool, key: str = "decoder.mode") -> None:
    """The one rule tying a mode to a drafter: every mode but plain drafts, plain takes none."""
    _require(mode == "plain" or has_drafter, key,
             f"{mode} needs --drafter (models.drafter): every mode but plain needs a drafter")
    _require(mode != "plain" or not has_drafter, key, "plain takes no drafter: --drafter given with --mode plain")


@dataclasses.dataclass(frozen=True)
class ModelPaths:
    """The checkpoints a decoding command loads (the ``models:`` section)."""

    target: str | None = None  # HF Qwen3 directory or d3d_jax parameter checkpoint (required)
    drafter: str | None = None  # drafter checkpoint (every mode but plain)
    tokenizer: str | None = None  # tokenizer directory; None: the target's, else the drafter's
    dtype: str | None = None  # parameter/compute dtype of both models; None: each checkpoint's
    # attention backend of both models: auto (the fused kernels on GPU and TPU, xla on a CPU),
    # xla or pallas (d3d_jax.config.model.decoding_attention)
    attention: str = "auto"

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(target=TEXT, drafter=TEXT, tokenizer=TEXT, dtype=one_of(*DTYPES),
                  attention=one_of(*ATTENTION_CHOICES))

    def validate(self, prefix: str = "models") -> None:
        _require(self.target is not None, f"{prefix}.target", "is required (--target PATH)")
        _require(self.dtype is None or self.dtype in DTYPES, f"{prefix}.dtype",
                 f"must be one of {'|'.join(DTYPES)}, got {self.dtype!r}")
        _require(self.attention in ATTENTION_CHOICES, f"{prefix}.attention",
                 f"must be one of {'|'.join(ATTENTION_CHOICES)}, got {self.attention!r}")


def _given(value, default):
    return default if value is None else value


def _int(value) -> int:
    """``value`` if an int, else 0: deriving never raises, so :meth:`DecoderSettings.validate` names a bad B."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else 0


@dataclasses.dataclass(frozen=True)
class DecoderSettings:
    """What a person chooses about a decoder.  ``None``: derived (see each field)."""

    # plain | sync | async | auto (auto picks one of the others per round); None: auto with a
    # drafter, plain without
    mode: str | None = None
    # B, tokens verified per round; None: the drafter's trained block size, else 16
    block_size: int | None = None
    # rows decoded together; None: the command's (server 8, generate: its batch, eval: its
    # concurrency)
    num_slots: int | None = None
    # KV slots per row (prompt + max_new_tokens + B must fit); None: the command's (server:
    # min(2048, max_position_embeddings); generate and eval: what their prompts need)
    max_cache_len: int | None = None
    branch_positions: int | None = None  # async C: rejection slots 1..C-1 branch; None: min(12, B)
    branch_fanout: int | None = None  # async F: alternatives per rejection slot; None: 2
    # devices of the target's slice, tensor-parallel over them (None: one device); every mode
    target_devices: int | None = None
    # devices of the drafter's own slice after the target's (async overlaps the two there; the
    # other modes run the drafter inside the target's programs, on the target's slice); None:
    # the target's slice (parallel.sharding.resolve_slices)
    drafter_devices: int | None = None
    sample_drafts: bool = False  # sync: sample drafts from q (sampling rows) instead of argmax
    # window widths (rows) a round may run over; () = powers of two up to num_slots
    row_buckets: tuple[int, ...] = ()
    # auto's menu: sync block sizes b and async (C, F); None: the decoder's defaults that fit B
    auto_sync_blocks: tuple[int, ...] | None = None
    auto_async: tuple[tuple[int, int], ...] | None = None
    # auto: the drafter's offline τ, the prior of every request's acceptance; None: read from
    # the drafter's result.json
    prior_tau: float | None = None

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(mode=one_of(*MODES), block_size=between(2, MAX_BLOCK_SIZE), num_slots=between(1, MAX_SLOTS),
                  max_cache_len=between(2, MAX_CACHE_LEN), branch_positions=between(1, MAX_BLOCK_SIZE),
                  branch_fanout=between(1, MAX_BRANCH_FANOUT), target_devices=between(1, MAX_DEVICES),
                  drafter_devices=between(1, MAX_DEVICES), row_buckets=between(1, MAX_SLOTS),
                  auto_sync_blocks=between(1, MAX_BLOCK_SIZE), auto_async=between(1, MAX_BLOCK_SIZE),
                  prior_tau=between(1, MAX_BLOCK_SIZE))
    _RANGES = (("block_size", 2, MAX_BLOCK_SIZE), ("num_slots", 1, MAX_SLOTS), ("max_cache_len", 2, MAX_CACHE_LEN),
               ("branch_positions", 1, MAX_BLOCK_SIZE), ("branch_fanout", 1, MAX_BRANCH_FANOUT),
               ("target_devices", 1, MAX_DEVICES), ("drafter_devices", 1, MAX_DEVICES))

    def validate(self, prefix: str = "decoder") -> None:
        _require(self.mode is None or self.mode in MODES, f"{prefix}.mode",
                 f"must be one of {'|'.join(MODES)}, got {self.mode!r}")
        for key, lo, hi in self._RANGES:
            value = getattr(self, key)
            if value is not None and not (key.endswith("_devices") and isinstance(value, tuple)):  # a program's device list
                require_int(value, f"{prefix}.{key}", lo, hi)
        if self.block_size is not None and self.branch_positions is not None:
            _require(self.branch_positions <= self.block_size, f"{prefix}.branch_positions",
                     f"C = {self.branch_positions} exceeds block_size {self.block_size}")
        for only, keys in (("async", ASYNC_ONLY), ("auto", AUTO_ONLY)):
            if self.mode is not None and self.mode != only:
                for key in keys:
                    _require(getattr(self, key) is None, f"{prefix}.{key}",
                             f"is for mode {only} only: it needs --mode {only} (mode is {self.mode})")
        _require(not (self.sample_drafts and self.mode in ("plain", "async", "auto")), f"{prefix}.sample_drafts",
                 f"is for mode sync only: async and auto draft the drafter's argmax (mode is {self.mode})")
        _require(all(b >= 1 for b in self.row_buckets), f"{prefix}.row_buckets",
                 f"widths must be >= 1, got {self.row_buckets}")

    def derived(self, *, has_drafter: bool, drafter_block_size: int | None = None,
                num_slots: int | None = None, max_cache_len: int | None = None) -> dict:
        """The fields these settings leave to be derived, filled in: the one place the derived
        defaults are written (``prior_tau`` excepted: it is read from the drafter's files,
        :func:`~d3d_jax.decoding.settings.decoder_config_for`).  Fields another mode reads stay None.

        ``num_slots`` / ``max_cache_len``: the command's own value where the settings give none."""
        mode = _given(self.mode, "auto" if has_drafter else "plain")
        b = _given(self.block_size, _given(drafter_block_size, DEFAULT_BLOCK_SIZE))
        out = dict(mode=mode, block_size=b, num_slots=_given(self.num_slots, num_slots),
                   max_cache_len=_given(self.max_cache_len, max_cache_len))
        if mode == "async":
            out.update(branch_positions=_given(self.branch_positions, min(DEFAULT_BRANCH_POSITIONS, _int(b))),
                       branch_fanout=_given(self.branch_fanout, DEFAULT_BRANCH_FANOUT))
        if mode == "auto":
            sync = self.auto_sync_blocks
            if sync is None:
                sync = sorted({x for x in AUTO_SYNC_BLOCKS if x < _int(b)} | {_int(b)})
            geoms = self.auto_async
            if geoms is None:
                geoms = sorted({(min(c, _int(b)), f) for c, f in AUTO_ASYNC_GEOMETRIES}) if _int(b) >= 3 else ()
            out.update(auto_sync_blocks=tuple(int(x) for x in sync),
                       auto_async=tuple((int(c), int(f)) for c, f in geoms))
        return out

    def resolved(self, *, has_drafter: bool, drafter_block_size: int | None = None,
                 num_slots: int | None = None, max_cache_len: int | None = None) -> "DecoderSettings":
        """These settings with every derived default filled in (:meth:`derived`), checked, the
        mode against the drafter too."""
        fields = self.derived(has_drafter=has_drafter, drafter_block_size=drafter_block_size,
                              num_slots=num_slots, max_cache_len=max_cache_len)
        check_drafter(fields["mode"], has_drafter)
        out = dataclasses.replace(self, **fields)
        out.validate()
        return out
