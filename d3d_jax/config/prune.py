"""Pruning configs: acceptance-guided progressive layer pruning and its run."""

from __future__ import annotations

import dataclasses

from d3d_jax.config.base import TEXT, _require, between, one_of
from d3d_jax.config.limits import INT32_MAX, MAX_CACHE_LEN
from d3d_jax.config.model import MeshConfig, ModelConfig
from d3d_jax.config.training import DataConfig, ObjectiveConfig, OptimConfig, TrainConfig, TrainRunConfig


# --------------------------------------------------------------------------------------
# Pruning: acceptance-guided progressive layer pruning (spec §3)
# --------------------------------------------------------------------------------------
PRUNE_CRITERIA = ("acceptance", "shortgpt")


@dataclasses.dataclass(frozen=True)
class PruneConfig:
    """What to prune and how; the recovery loop itself is the run's data/optim/train sections."""

    drafter: str = ""  # HF dir or param checkpoint of the trained drafter (also the fixed teacher)
    out_dir: str = "runs/prune"
    target_layers: int = 1  # stop at this depth (paper: 36 -> 31)
    retention_floor: float = 0.0  # ... or once recovered τ < floor·τ₀ (0 = never)
    criterion: str = "acceptance"  # "acceptance" (τ without the layer) | "shortgpt" (cosine)
    compare_shortgpt: bool = True  # also recover the other rule's pick each round (report only)
    margin: float = 0.1  # m: q̃_y ≥ max_{v≠y} q̃_v + m  [our choice; the paper gives no value]
    tau_measure: str = "offline"  # "offline" (dev responses, no target) | "online" (engine, sync)
    target: str = ""  # the target for online τ
    online_prompts: int = 16
    online_max_new_tokens: int = 128
    export_rounds: bool = True  # Orbax params + HF export of every round's recovered drafter
    progress_bar: bool = True

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(drafter=TEXT, out_dir=TEXT, target_layers=between(1, 1024), retention_floor=between(0, 1),
                  criterion=one_of(*PRUNE_CRITERIA), margin=between(0, 1e6), tau_measure=one_of("offline", "online"),
                  target=TEXT, online_prompts=between(1, INT32_MAX), online_max_new_tokens=between(1, MAX_CACHE_LEN))

    def check_depth(self, num_layers: int, prefix: str = "prune") -> None:
        """Against the drafter's depth, once its config is read (before any work)."""
        _require(1 <= self.target_layers <= num_layers, f"{prefix}.target_layers",
                 f"must be in [1, {num_layers}] (the drafter {self.drafter} has {num_layers} layers), "
                 f"got {self.target_layers}")

    def validate(self, prefix: str = "prune") -> None:
        _require(bool(self.drafter), f"{prefix}.drafter", "must name the trained drafter (HF dir or params)")
        _require(self.target_layers >= 1, f"{prefix}.target_layers", "must be >= 1")
        _require(0.0 <= self.retention_floor <= 1.0, f"{prefix}.retention_floor", "must be in [0, 1]")
        _require(self.criterion in PRUNE_CRITERIA, f"{prefix}.criterion",
                 f"must be one of {PRUNE_CRITERIA}, got {self.criterion!r}")
        _require(0.0 <= self.margin <= 1.0, f"{prefix}.margin",
                 f"must be in [0, 1] (a probability gap), got {self.margin}")
        _require(self.tau_measure in ("offline", "online"), f"{prefix}.tau_measure",
                 f"must be 'offline' or 'online', got {self.tau_measure!r}")
        if self.tau_measure == "online":
            _require(bool(self.target), f"{prefix}.target", "online τ needs the target model")
            _require(self.online_prompts >= 1, f"{prefix}.online_prompts", "must be >= 1")
            _require(self.online_max_new_tokens >= 1, f"{prefix}.online_max_new_tokens", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class PruneRunConfig:
    """``train/prune_drafter.py``: ``data.train_path`` feeds recovery, ``data.dev_path`` ×
    ``data.dev_batches`` is the dev set (paper: 512 samples); ``train.steps`` is the recovery
    length per round (paper: 10k); ``objective`` gives γ and λ."""

    prune: PruneConfig = dataclasses.field(default_factory=PruneConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    num_devices: int = 0

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(num_devices=between(0, 1 << 16))

    def validate(self, prefix: str = "") -> None:
        p = f"{prefix}." if prefix else ""
        self.prune.validate(f"{p}prune")
        _require(self.data.mode == "d3d", f"{p}data.mode", "pruning needs packed d3d rows ('d3d')")
        _require(self.objective.kind == "d3d", f"{p}objective.kind", "pruning distils the d3d objective")
        _require(bool(self.data.train_path), f"{p}data.train_path", "recovery needs training data")
        if self.prune.tau_measure == "offline":
            _require(bool(self.data.dev_path), f"{p}data.dev_path", "offline τ needs dev responses")
            _require(self.data.dev_batches >= 1, f"{p}data.dev_batches", "must be >= 1 for offline τ")
        # The recovery runs are TrainRunConfigs: check mesh / batch / device arithmetic now.
        TrainRunConfig(mesh=self.mesh, data=self.data, objective=self.objective, optim=self.optim,
                       train=self.train, num_devices=self.num_devices,
                       model=ModelConfig(max_position_embeddings=self.data.packed_length)).validate(prefix)
