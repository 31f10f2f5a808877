"""Pipeline config: the embedded default end to end."""

from __future__ import annotations

import dataclasses

from d3d_jax.config.base import TEXT, _require, above, between, one_of
from d3d_jax.config.limits import INT32_MAX, MAX_BLOCK_SIZE, MAX_CACHE_LEN, MAX_SLOTS
from d3d_jax.config.model import ModelConfig


# --------------------------------------------------------------------------------------
# Pipeline: the embedded default end to end (train/pipeline.py)
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PretrainStageConfig:
    """Plain LM pretraining of one model on the chat-formatted corpus."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(steps=between(1, INT32_MAX), batch_size=between(1, MAX_SLOTS), seq_len=between(2, MAX_CACHE_LEN),
                  learning_rate=above(0, 10), warmup_steps=between(0, INT32_MAX), seed=between(0, INT32_MAX))

    def validate(self, prefix: str = "pretrain") -> None:
        self.model.validate(f"{prefix}.model")
        for k in ("steps", "batch_size", "seq_len"):
            _require(getattr(self, k) >= 1, f"{prefix}.{k}", "must be >= 1")
        _require(self.learning_rate > 0, f"{prefix}.learning_rate", "must be > 0")
        _require(self.seq_len <= self.model.max_position_embeddings, f"{prefix}.seq_len",
                 f"exceeds model.max_position_embeddings={self.model.max_position_embeddings}")


@dataclasses.dataclass(frozen=True)
class DrafterVariantConfig:
    """One D3D drafter: where its weights start and its AR weight λ."""

    name: str = "small"
    init: str = "small"  # "small" (pretrained small model) | "target" (target's weights) | "random"
    ar_weight: float = 1.0
    steps: int | None = None  # None: the stage's steps
    decay_steps: int | None = None  # the cosine ends here, then the LR holds (None: at its steps)
    seed: int | None = None  # of the init, the data order and the anchors (None: the pipeline's)

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(name=TEXT, init=one_of("small", "target", "random"), ar_weight=between(0, 1e6),
                  steps=between(1, INT32_MAX), decay_steps=between(1, INT32_MAX), seed=between(0, INT32_MAX))

    def validate(self, prefix: str = "drafter") -> None:
        _require(self.init in ("small", "target", "random"), f"{prefix}.init",
                 f"must be 'small', 'target' or 'random', got {self.init!r}")
        _require(self.ar_weight >= 0, f"{prefix}.ar_weight", "must be >= 0")
        _require(self.decay_steps is None or (self.decay_steps >= 1 and self.steps is not None
                                              and self.decay_steps <= self.steps), f"{prefix}.decay_steps",
                 f"must be within the variant's own steps (1..{self.steps}), got {self.decay_steps}")
        _require(bool(self.name) and "/" not in self.name, f"{prefix}.name", "must be a plain non-empty name")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Stages of the embedded default; each is skipped when its output exists under ``out_dir``."""

    out_dir: str = "artifacts/demo"
    seed: int = 0
    # (1) tokenizer + corpus
    vocab_size: int = 2048
    tokenizer_chars: int = 4_000_000
    passage_chars: int = 700
    pretrain_chars: int = 3_000_000
    # (2), (3)
    target: PretrainStageConfig = dataclasses.field(default_factory=PretrainStageConfig)
    small: PretrainStageConfig = dataclasses.field(default_factory=PretrainStageConfig)
    # (4) regeneration
    regen_prompts: int = 400
    regen_max_new_tokens: int = 128
    regen_greedy: bool = True
    regen_batch_size: int = 16
    # signature-and-docstring stubs of stdlib functions (HumanEval's prompt shape, none of its
    # problems) added to the regeneration prompts
    regen_docstring_prompts: int = 0
    # (5) drafters
    block_size: int = 16
    drafter_steps: int = 300
    drafter_batch_size: int = 8
    drafter_packed_length: int = 512
    drafter_num_anchors: int = 16
    drafter_learning_rate: float = 1e-3
    drafter_gamma: float = 7.0
    drafters: tuple[DrafterVariantConfig, ...] = (DrafterVariantConfig(),)
    # (6) pruning
    prune_drafter: str = ""  # "" skips pruning
    prune_to_layers: int = 2
    prune_recover_steps: int = 50  # per round, the same for both rules
    prune_eval_every: int = 0  # offline τ every this many recovery steps: the recovery curve (0: none)
    prune_margin: float = 0.1
    # (7) benchmark
    eval_benchmarks: tuple[str, ...] = ("humaneval", "shakespeare")
    eval_samples: int = 8
    eval_max_new_tokens: int = 128
    eval_drafters: tuple[str, ...] = ("small",)
    # Block size of the benchmark's drafts and verify (None: block_size, as trained).  A drafter
    # trained on B-blocks drafts a shorter block in one forward as well ([last, MASK × (b-1)]);
    # where a verify costs compute per token (a CPU), a shorter one can pay more.
    eval_block_size: int | None = None
    eval_compare_blocks: tuple[int, ...] = ()  # the first drafter's sync rows at these too
    async_positions: int = 12
    async_fanout: int = 2
    async_sweep: tuple[tuple[int, int], ...] = ()
    hf_peer: bool = True

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(out_dir=TEXT, seed=between(0, INT32_MAX), vocab_size=between(1, 1 << 24),
                  tokenizer_chars=between(1, 1 << 40), passage_chars=between(1, 1 << 30),
                  pretrain_chars=between(1, 1 << 40), regen_prompts=between(0, INT32_MAX),
                  regen_max_new_tokens=between(1, MAX_CACHE_LEN), regen_batch_size=between(1, MAX_SLOTS),
                  regen_docstring_prompts=between(0, INT32_MAX), block_size=between(2, MAX_BLOCK_SIZE),
                  drafter_steps=between(1, INT32_MAX), drafter_batch_size=between(1, MAX_SLOTS),
                  drafter_packed_length=between(2, MAX_CACHE_LEN), drafter_num_anchors=between(1, MAX_CACHE_LEN),
                  drafter_learning_rate=above(0, 10), drafter_gamma=above(0, 1e6), prune_drafter=TEXT,
                  prune_to_layers=between(1, 1024), prune_recover_steps=between(0, INT32_MAX),
                  prune_eval_every=between(0, INT32_MAX), prune_margin=between(0, 1e6), eval_benchmarks=TEXT,
                  eval_samples=between(1, INT32_MAX), eval_max_new_tokens=between(1, MAX_CACHE_LEN),
                  eval_drafters=TEXT, eval_block_size=between(2, MAX_BLOCK_SIZE),
                  eval_compare_blocks=between(2, MAX_BLOCK_SIZE), async_positions=between(1, MAX_BLOCK_SIZE),
                  async_fanout=between(1, 64), async_sweep=between(1, MAX_BLOCK_SIZE))

    @property
    def eval_block(self) -> int:
        return self.block_size if self.eval_block_size is None else self.eval_block_size

    def quick(self, factor: int = 8) -> "PipelineConfig":
        """``train/pipeline.py --quick``: every stage at about 1/``factor`` of the steps, a tenth of
        the regenerated prompts and half the benchmark, written under ``runs/quick/`` so the shipped
        artifacts stay as they are (the demo with ``--rebuild``: 41 min on the 2-core machine of
        2026-12-02, with the target-initialised drafter at 40 of its then 320 steps, its pruning
        and the second seeds; its 150 of 1200 steps now add about 8 min, not re-measured)."""
        def steps(n: int) -> int:
            return max(4, n // factor)

        return dataclasses.replace(
            self, out_dir="runs/quick/" + self.out_dir.strip("/").replace("/", "_"),
            target=dataclasses.replace(self.target, steps=steps(self.target.steps),
                                       warmup_steps=min(self.target.warmup_steps, steps(self.target.steps) // 4)),
            small=dataclasses.replace(self.small, steps=steps(self.small.steps),
                                      warmup_steps=min(self.small.warmup_steps, steps(self.small.steps) // 4)),
            regen_prompts=max(16, self.regen_prompts // 10),
            regen_docstring_prompts=self.regen_docstring_prompts // 10, drafter_steps=steps(self.drafter_steps),
            drafters=tuple(dataclasses.replace(d, steps=None if d.steps is None else steps(d.steps),
                                               decay_steps=None if d.decay_steps is None else steps(d.decay_steps))
                           for d in self.drafters),
            prune_recover_steps=max(2, self.prune_recover_steps // 4),
            prune_eval_every=max(1, self.prune_eval_every // 4) if self.prune_eval_every else 0,
            eval_samples=max(2, self.eval_samples // 2), async_sweep=self.async_sweep[:2], hf_peer=False)

    def validate(self, prefix: str = "") -> None:
        p = f"{prefix}." if prefix else ""
        _require(self.vocab_size >= 300, f"{p}vocab_size", "must be >= 300")
        self.target.validate(f"{p}target")
        self.small.validate(f"{p}small")
        _require(self.regen_docstring_prompts >= 0, f"{p}regen_docstring_prompts", "must be >= 0")
        for k in ("regen_prompts", "regen_max_new_tokens", "drafter_steps", "eval_samples",
                  "eval_max_new_tokens", "passage_chars"):
            _require(getattr(self, k) >= 1, f"{p}{k}", "must be >= 1")
        _require(self.block_size >= 3, f"{p}block_size", "must be >= 3")
        for b in (self.eval_block, *self.eval_compare_blocks):
            _require(3 <= b <= self.block_size, f"{p}eval_block_size/eval_compare_blocks",
                     f"{b} must be in [3, block_size={self.block_size}]")
        _require(self.drafter_packed_length > self.drafter_num_anchors * self.block_size + self.block_size,
                 f"{p}drafter_packed_length", "leaves no room for the clean stream")
        names = [d.name for d in self.drafters]
        _require(len(set(names)) == len(names), f"{p}drafters", f"names must be unique, got {names}")
        for i, d in enumerate(self.drafters):
            d.validate(f"{p}drafters[{i}]")
        for n in self.eval_drafters:
            _require(n in names, f"{p}eval_drafters", f"{n!r} is not a drafter name ({names})")
        _require(self.prune_eval_every >= 0, f"{p}prune_eval_every", "must be >= 0")
        if self.prune_drafter:
            _require(self.prune_drafter in names, f"{p}prune_drafter", f"{self.prune_drafter!r} not in {names}")


