"""Training configs: data, objective, optimiser, loop, and the run that combines them."""

from __future__ import annotations

import dataclasses
from typing import Any

from d3d_jax.config.base import DTYPES, TEXT, _require, above, between, one_of
from d3d_jax.config.limits import INT32_MAX, MAX_BLOCK_SIZE, MAX_CACHE_LEN, require_int
from d3d_jax.config.model import REMAT_POLICIES, MeshConfig, ModelConfig


# --------------------------------------------------------------------------------------
# Training: data, objective, optimiser, loop, and the run that combines them
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Packed block-diffusion rows (spec §2.1-2.3) or plain LM token streams.

    A packed row is ``[clean (packed_length - num_anchors·block_size) | num_anchors blocks]``.
    """

    mode: str = "d3d"  # "d3d": regenerated-response JSONL -> packed rows; "lm": text -> AR only
    # d3d: .jsonl / .jsonl.gz files and globs, comma-separated (id/messages/response_token_ids...),
    # read by a cached index, each process only its rows' records; lm: one JSONL of {"text"} or plain text
    train_path: str = ""
    dev_path: str = ""
    tokenizer: str = ""  # HF tokenizer dir, needed when records carry no prompt_token_ids
    packed_length: int = 4096
    num_anchors: int = 128
    block_size: int = 16
    batch_size: int = 16  # global batch (rows per optimiser step, all micro-batches together)
    seed: int = 0
    shuffle: bool = True
    dev_batches: int = 4
    mask_token_id: int | None = None  # None: the model's (or the tokenizer's <|MASK|>)
    pad_token_id: int = 0
    # Records failing validation (not UTF-8 / JSON, wrong types, ids outside the vocabulary) are
    # skipped and listed; more than this fraction of them stops the run before its first step.
    max_skipped_fraction: float = 0.01
    # Also draw anchors at response_start - 1 (the last prompt token), where decoding anchors every
    # generation's first block; the block's slots are then the first B-1 response tokens.  On by
    # default: it lengthens first blocks at unchanged overall τ (docs/results/demo.md, first-block anchors).
    first_block_anchor: bool = True
    # grain worker processes that read, tokenise and pack the training rows (0: in the training
    # process).  A checkpoint's data position resumes only with the same count.
    worker_count: int = 0

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(mode=one_of("d3d", "lm"), train_path=TEXT, dev_path=TEXT, tokenizer=TEXT,
                  packed_length=between(2, MAX_CACHE_LEN), num_anchors=between(1, MAX_CACHE_LEN),
                  block_size=between(2, MAX_BLOCK_SIZE), batch_size=between(1, 1 << 20), seed=between(0, INT32_MAX),
                  dev_batches=between(0, INT32_MAX), mask_token_id=between(0, INT32_MAX),
                  pad_token_id=between(0, INT32_MAX), max_skipped_fraction=between(0, 1),
                  worker_count=between(0, 1024))

    def validate(self, prefix: str = "data") -> None:
        _require(self.mode in ("d3d", "lm"), f"{prefix}.mode", f"must be 'd3d' or 'lm', got {self.mode!r}")
        _require(self.block_size >= 2, f"{prefix}.block_size", "must be >= 2")
        _require(self.num_anchors >= 1, f"{prefix}.num_anchors", "must be >= 1")
        _require(self.batch_size >= 1, f"{prefix}.batch_size", "must be >= 1")
        _require(self.dev_batches >= 0, f"{prefix}.dev_batches", "must be >= 0")
        _require(0 <= self.max_skipped_fraction <= 1, f"{prefix}.max_skipped_fraction",
                 f"must be in [0, 1], got {self.max_skipped_fraction}")
        _require(self.pad_token_id >= 0, f"{prefix}.pad_token_id", "must be >= 0")
        require_int(self.seed, f"{prefix}.seed", 0, INT32_MAX)
        if self.mode == "d3d":
            blocks = self.num_anchors * self.block_size
            _require(self.packed_length > blocks + self.block_size, f"{prefix}.packed_length",
                     f"{self.packed_length} leaves no room for the clean stream: num_anchors × block_size = "
                     f"{self.num_anchors} × {self.block_size} = {blocks} (need packed_length > "
                     f"{blocks + self.block_size})")
        else:
            _require(self.packed_length >= 2, f"{prefix}.packed_length", "must be >= 2")

    @property
    def clean_length(self) -> int:
        return self.packed_length - (self.num_anchors * self.block_size if self.mode == "d3d" else 0)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """``L = L_diff + λ·L_AR`` (spec §2.4); ``kind="lm"`` is AR only (pretraining a target)."""

    kind: str = "d3d"  # "d3d" | "lm"
    gamma: float = 7.0  # slot weights w_k = exp(-(k-1)/γ)
    ar_weight: float = 1.0  # λ

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(kind=one_of("d3d", "lm"), gamma=above(0, 1e6), ar_weight=between(0, 1e6))

    def validate(self, prefix: str = "objective") -> None:
        _require(self.kind in ("d3d", "lm"), f"{prefix}.kind", f"must be 'd3d' or 'lm', got {self.kind!r}")
        _require(self.gamma > 0, f"{prefix}.gamma", f"must be > 0, got {self.gamma}")
        _require(self.ar_weight >= 0, f"{prefix}.ar_weight", f"must be >= 0, got {self.ar_weight}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW (or 8-bit AdamW) with linear warm-up then cosine decay (paper: 1e-5 -> 1e-6)."""

    name: str = "adamw8bit"  # "adamw" | "adamw8bit"
    learning_rate: float = 1e-5
    final_learning_rate: float = 1e-6
    warmup_steps: int = 0
    decay_steps: int = 0  # the cosine reaches final_learning_rate here and holds it (0: at train.steps)
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # 0 disables clipping
    grad_accum_steps: int = 1
    quant_block_size: int = 256  # 8-bit moments: one float32 scale per this many entries

    # each field's valid values, checked by config.base.check_fields for every loader; a rate must
    # be finite (inf/NaN are refused), a huge one is a run the non-finite guard stops
    BOUNDS = dict(name=one_of("adamw", "adamw8bit"), learning_rate=above(0, 1e30),
                  final_learning_rate=between(0, 1e30),
                  warmup_steps=between(0, INT32_MAX), decay_steps=between(0, INT32_MAX), b1=between(0, 1),
                  b2=between(0, 1), eps=above(0, 1), weight_decay=between(0, 1e3), clip_norm=between(0, 1e9),
                  grad_accum_steps=between(1, 1 << 20), quant_block_size=between(1, 1 << 24))

    def warmup_for(self, total_steps: int) -> int:
        """The warm-up a run of ``total_steps`` gets: ``warmup_steps``, at most every step but one."""
        return min(self.warmup_steps, max(total_steps - 1, 0))

    def validate(self, prefix: str = "optim") -> None:
        _require(self.name in ("adamw", "adamw8bit"), f"{prefix}.name",
                 f"must be 'adamw' or 'adamw8bit', got {self.name!r}")
        _require(self.learning_rate > 0, f"{prefix}.learning_rate", "must be > 0")
        _require(0 <= self.final_learning_rate <= self.learning_rate, f"{prefix}.final_learning_rate",
                 "must be in [0, learning_rate]")
        _require(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
        _require(self.decay_steps >= 0, f"{prefix}.decay_steps", "must be >= 0 (0: decay until train.steps)")
        _require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, f"{prefix}.b1/b2", "must be in [0, 1)")
        _require(self.eps > 0, f"{prefix}.eps", "must be > 0")
        _require(self.clip_norm >= 0, f"{prefix}.clip_norm", "must be >= 0")
        _require(self.grad_accum_steps >= 1, f"{prefix}.grad_accum_steps", "must be >= 1")
        _require(self.quant_block_size >= 2, f"{prefix}.quant_block_size", "must be >= 2")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    init_from: str = ""  # "" = random init; else an HF Qwen3 dir or an exported param checkpoint
    seed: int = 0
    out_dir: str = "runs/train"
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 3
    async_checkpointing: bool = True
    resume: bool = True  # continue from the latest checkpoint in out_dir/checkpoints
    export_params: bool = True
    export_hf: bool = True
    progress_bar: bool = True
    aot_compile: bool = True  # lower().compile() and print memory_analysis before step 1
    # Precision / memory knobs over the model's own (e.g. float32 master weights, bf16 compute);
    # "" / None keep the model config's value (also for a model loaded from init_from).
    param_dtype: str = ""
    compute_dtype: str = ""
    gradient_checkpointing: bool | None = None  # deprecated: remat_policy "full" / "none"
    remat_policy: str = ""  # "" keeps model.remat_policy; else one of REMAT_POLICIES

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(steps=between(1, INT32_MAX), init_from=TEXT, seed=between(0, INT32_MAX), out_dir=TEXT,
                  log_every=between(0, INT32_MAX), eval_every=between(0, INT32_MAX),
                  checkpoint_every=between(0, INT32_MAX), keep_checkpoints=between(1, 1 << 20),
                  param_dtype=one_of("", *DTYPES), compute_dtype=one_of("", *DTYPES),
                  remat_policy=one_of("", *REMAT_POLICIES))

    def validate(self, prefix: str = "train") -> None:
        _require(self.steps >= 1, f"{prefix}.steps", "must be >= 1")
        require_int(self.seed, f"{prefix}.seed", 0, INT32_MAX)
        _require(self.remat_policy == "" or self.remat_policy in REMAT_POLICIES, f"{prefix}.remat_policy",
                 f"must be '' or one of {', '.join(REMAT_POLICIES)}, got {self.remat_policy!r}")
        for name in ("param_dtype", "compute_dtype"):
            v = getattr(self, name)
            _require(v == "" or v in DTYPES, f"{prefix}.{name}", f"must be '' or one of {DTYPES}, got {v!r}")
        for name in ("log_every", "eval_every", "checkpoint_every"):
            _require(getattr(self, name) >= 0, f"{prefix}.{name}", "must be >= 0")
        _require(self.keep_checkpoints >= 1, f"{prefix}.keep_checkpoints", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class TrainRunConfig:
    """One training run.  ``num_devices`` 0 = every visible device."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    num_devices: int = 0

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(num_devices=between(0, 1 << 16))

    def effective_model(self) -> ModelConfig:
        """The model config with the train section's precision / remat knobs applied."""
        t = self.train
        changes: dict[str, Any] = {}
        if t.param_dtype:
            changes["param_dtype"] = t.param_dtype
        if t.compute_dtype:
            changes["dtype"] = t.compute_dtype
        if t.gradient_checkpointing is not None:
            changes["gradient_checkpointing"] = t.gradient_checkpointing
        if t.remat_policy:
            changes["remat_policy"] = t.remat_policy
        return dataclasses.replace(self.model, **changes)

    def resolved_num_devices(self) -> int:
        if self.num_devices:
            return self.num_devices
        import jax  # deferred: building configs must not start a backend unless needed

        return jax.device_count()

    def validate(self, prefix: str = "") -> None:
        p = f"{prefix}." if prefix else ""
        self.model.validate(f"{p}model")
        self.mesh.validate(f"{p}mesh")
        self.data.validate(f"{p}data")
        self.objective.validate(f"{p}objective")
        self.optim.validate(f"{p}optim")
        self.train.validate(f"{p}train")
        _require(self.num_devices >= 0, f"{p}num_devices", "must be >= 0")
        data_par, fsdp, _ = self.mesh.axis_sizes(self.resolved_num_devices())
        _require(self.objective.kind == self.data.mode, f"{p}objective.kind",
                 f"{self.objective.kind!r} does not match data.mode={self.data.mode!r}")
        if self.model.block_size is not None and self.data.mode == "d3d":
            _require(self.model.block_size == self.data.block_size, f"{p}data.block_size",
                     f"{self.data.block_size} differs from model.block_size={self.model.block_size}")
        warm = self.optim.warmup_for(self.train.steps)  # what the schedule runs
        _require(self.optim.decay_steps == 0 or self.optim.decay_steps > warm, f"{p}optim.decay_steps",
                 f"must be 0 (decay until train.steps) or > the warm-up ({warm} steps), got {self.optim.decay_steps}")
        _require(self.optim.decay_steps <= self.train.steps, f"{p}optim.decay_steps",
                 f"{self.optim.decay_steps} is past train.steps={self.train.steps}: the run would end "
                 "before its learning rate reached final_learning_rate")
        micro, rem = divmod(self.data.batch_size, self.optim.grad_accum_steps)
        _require(rem == 0, f"{p}data.batch_size", f"{self.data.batch_size} is not a multiple of "
                 f"optim.grad_accum_steps={self.optim.grad_accum_steps}")
        _require(micro % (data_par * fsdp) == 0, f"{p}data.batch_size",
                 f"micro-batch {micro} (batch_size / grad_accum_steps) is not divisible by "
                 f"mesh data×fsdp = {data_par}×{fsdp}")
        _require(self.data.packed_length <= self.model.max_position_embeddings, f"{p}data.packed_length",
                 f"{self.data.packed_length} exceeds model.max_position_embeddings="
                 f"{self.model.max_position_embeddings}")
        if not self.train.init_from:  # else the vocabulary is the loaded model's, checked there
            vocab = self.model.vocab_size
            for key in ("pad_token_id", "mask_token_id"):
                v = getattr(self.data, key)
                _require(v is None or v < vocab, f"{p}data.{key}",
                         f"{v} is outside the model's vocabulary [0, {vocab})")


