"""``infer/bench.py eval``'s config: the models, the decoder, and which benchmarks to run how.

Every flag sets one field (``--samples`` is ``eval.samples``, ``--block-size`` is
``decoder.block_size`` …; the flag declarations in :mod:`d3d_jax.bench.evaluation.cli` are the table).
The run decodes in every mode of ``eval.modes``, so ``decoder.mode`` stays unset; the other
decoder fields and their derived defaults are the ones the server and ``infer/generate.py`` use.
"""

from __future__ import annotations

import dataclasses

from d3d_jax.config.base import TEXT, _require, between, checked, one_of
from d3d_jax.config.limits import INT32_MAX, MAX_BLOCK_SIZE, MAX_CACHE_LEN, MAX_SLOTS
from d3d_jax.config.decoding import (ASYNC_ONLY, AUTO_ONLY, DEFAULT_BLOCK_SIZE, MODES, DecoderConfig, ModelPaths,
                                     check_section)

TEMPLATES = ("standard", "plain")
ASYNC_OPTIONS, AUTO_OPTIONS = ASYNC_ONLY, AUTO_ONLY  # the fields only that mode reads


@dataclasses.dataclass
class EvalSettings:
    """What the runner (:mod:`~d3d_jax.bench.evaluation.runner`) decodes with: one decoder per mode."""

    max_new_tokens: int = 128
    block_size: int = DEFAULT_BLOCK_SIZE
    max_cache_len: int = 1024
    modes: tuple[str, ...] = ("plain", "sync", "async")
    async_options: dict = dataclasses.field(default_factory=dict)  # mode async: ASYNC_OPTIONS fields
    auto_options: dict = dataclasses.field(default_factory=dict)  # mode auto: AUTO_OPTIONS fields
    concurrency: int = 1  # > 1: requests in flight in one long-lived decoder per mode
    async_timeline: bool = True  # time async rounds' parts (overlap fraction, drafter share)
    drafter_share_samples: int = 1  # sync: samples re-run with the host loop to split draft/verify

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(max_new_tokens=between(1, MAX_CACHE_LEN), block_size=between(2, MAX_BLOCK_SIZE),
                  max_cache_len=between(2, MAX_CACHE_LEN), modes=one_of(*MODES),
                  async_options=checked("validate: ASYNC_OPTIONS"), auto_options=checked("validate: AUTO_OPTIONS"),
                  concurrency=between(1, MAX_SLOTS), drafter_share_samples=between(0, INT32_MAX))

    def validate(self, prefix: str = "eval") -> None:
        for key in ("max_new_tokens", "block_size", "max_cache_len", "concurrency"):
            _require(getattr(self, key) >= 1, f"{prefix}.{key}", f"must be >= 1, got {getattr(self, key)}")
        bad = [m for m in self.modes if m not in MODES]
        _require(not bad, f"{prefix}.modes", f"each of {'|'.join(MODES)}, got {bad[0] if bad else ''!r}")
        for key, allowed in (("async_options", ASYNC_OPTIONS), ("auto_options", AUTO_OPTIONS)):
            unknown = sorted(set(getattr(self, key)) - set(allowed))
            _require(not unknown, f"{prefix}.{key}", f"unknown fields {unknown} (known: {', '.join(allowed)})")


@dataclasses.dataclass(frozen=True)
class EvalRunSettings:
    """What Table 1 measures (the ``eval:`` section)."""

    # NAME or NAME=PATH (gsm8k, math500, aime25, humaneval, mbpp, livecodebench, mtbench,
    # shakespeare, stdlib)
    benchmarks: tuple[str, ...] = ("humaneval",)
    samples: int = 16  # per benchmark (fewest prompt-length buckets)
    max_new_tokens: int = 256
    allow_beyond_context: bool = False  # let prompt + max_new_tokens run past max_position_embeddings
    modes: tuple[str, ...] = ("plain", "sync", "async")  # plain must be one: speedups are against it
    template: str = "standard"  # standard: the benchmark's prompt suffix; plain: without it
    async_sweep: tuple[tuple[int, int], ...] = ()  # async (C, F) points of the budget sweep
    hf_peer: bool = False  # also transformers assisted generation
    concurrency: int = 1  # requests in flight in one long-lived decoder per mode (1: batch 1)
    out: str = "runs/eval"

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(benchmarks=TEXT, samples=between(1, INT32_MAX), max_new_tokens=between(1, MAX_CACHE_LEN),
                  modes=one_of(*MODES), template=one_of(*TEMPLATES), async_sweep=between(1, MAX_BLOCK_SIZE),
                  concurrency=between(1, MAX_SLOTS), out=TEXT)

    def validate(self, prefix: str = "eval") -> None:
        _require(bool(self.benchmarks), f"{prefix}.benchmarks", "needs at least one benchmark")
        # --benchmarks takes every word after it, so an override written there lands here
        stray = [b for b in self.benchmarks if b.split("=", 1)[0].startswith(("eval.", "decoder.", "models."))]
        _require(not stray, f"{prefix}.benchmarks", f"{stray[0] if stray else ''!r} is a key=value override: "
                                                    "put overrides before --benchmarks")
        _require(self.samples >= 1, f"{prefix}.samples", f"must be >= 1, got {self.samples}")
        _require(self.max_new_tokens >= 1, f"{prefix}.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        bad = [m for m in self.modes if m not in MODES]
        _require(not bad, f"{prefix}.modes", f"each of {'|'.join(MODES)}, got {bad[0] if bad else ''!r}")
        _require("plain" in self.modes, f"{prefix}.modes",
                 "must include plain (speedups and the equality check are against it)")
        _require(self.template in TEMPLATES, f"{prefix}.template",
                 f"must be one of {'|'.join(TEMPLATES)}, got {self.template!r}")
        _require(self.concurrency >= 1, f"{prefix}.concurrency", f"must be >= 1, got {self.concurrency}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    models: ModelPaths = dataclasses.field(default_factory=ModelPaths)
    decoder: DecoderConfig = dataclasses.field(default_factory=DecoderConfig)
    eval: EvalRunSettings = dataclasses.field(default_factory=EvalRunSettings)

    def validate(self) -> None:
        self.models.validate()
        _require(self.models.drafter is not None, "models.drafter", "is required (--drafter PATH)")
        _require(self.decoder.mode is None, "decoder.mode", "is not used by eval: set eval.modes")
        check_section(self.decoder, has_drafter=None)  # each mode is resolved on its own
        self.eval.validate()

    def mode_settings(self, mode: str, drafter_block_size: int | None) -> DecoderConfig:
        """The decoder settings of one mode of the run, derived defaults filled in."""
        keep = {"async": ASYNC_ONLY, "auto": AUTO_ONLY}.get(mode, ())
        only = {k: None for k in ASYNC_ONLY + AUTO_ONLY if k not in keep}
        if mode != "sync":
            only["sample_drafts"] = False
        return dataclasses.replace(self.decoder, mode=mode, **only).resolved(
            has_drafter=mode != "plain", drafter_block_size=drafter_block_size)
