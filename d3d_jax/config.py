"""Typed configuration: dataclasses built from YAML files plus ``key=value`` overrides.

Every section is a frozen dataclass.  ``load_config`` merges YAML files (later files win, a
YAML may ``include:`` others), applies dotted ``key=value`` overrides, converts each value to
the declared field type and runs each section's ``validate``.  Any problem raises
``ConfigError`` naming the offending key, before anything is built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration value or combination is invalid; the message names the key."""


_MISSING = object()
# ModelConfig field -> HF config.json key, where they differ
_HF_KEY_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads"}


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every field of a Qwen3 decoder (HF ``Qwen3Config``) plus our dtypes and D3D tokens."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype
    # D3D drafter fields (written into an exported drafter's config.json).
    mask_token_id: int | None = None
    block_size: int | None = None
    # Token ids the HF config carries, kept for a faithful export.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    gradient_checkpointing: bool = False

    def validate(self, prefix: str = "model") -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _require(getattr(self, name) > 0, f"{prefix}.{name}", f"must be > 0, got {getattr(self, name)}")
        _require(self.num_heads % self.num_kv_heads == 0, f"{prefix}.num_kv_heads",
                 f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        _require(self.head_dim % 2 == 0, f"{prefix}.head_dim", "must be even (RoPE rotates pairs)")
        _require(self.rope_theta > 0, f"{prefix}.rope_theta", "must be > 0")
        _require(self.rms_norm_eps > 0, f"{prefix}.rms_norm_eps", "must be > 0")
        _require(self.param_dtype in DTYPES, f"{prefix}.param_dtype", f"must be one of {DTYPES}")
        _require(self.dtype in DTYPES, f"{prefix}.dtype", f"must be one of {DTYPES}")
        if self.mask_token_id is not None:
            _require(0 <= self.mask_token_id < self.vocab_size, f"{prefix}.mask_token_id",
                     f"{self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.block_size is not None:
            _require(self.block_size >= 2, f"{prefix}.block_size", "must be >= 2")

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---- Hugging Face config.json ------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Build from a Qwen3 ``config.json`` (old top-level ``rope_theta`` or new ``rope_parameters``)."""
        if hf.get("model_type") != "qwen3":
            raise ConfigError(f"model_type: expected 'qwen3', got {hf.get('model_type')!r}")
        # Variants our Qwen3 does not implement: refuse them rather than load them wrongly.
        for key in ("attention_bias", "use_sliding_window"):
            if hf.get(key):
                raise ConfigError(f"config.json.{key}: {hf[key]!r} is not supported (Qwen3 uses false)")
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters") or hf.get("rope_scaling")
        if isinstance(rope_params, Mapping):
            rtype = rope_params.get("rope_type", rope_params.get("type", "default"))
            if rtype not in (None, "default"):
                raise ConfigError(f"rope_parameters.rope_type: only 'default' RoPE is supported, got {rtype!r}")
            rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_theta is None:  # transformers' Qwen3Config default, so both read a file alike
            rope_theta = 10_000.0
        def num(key: str, tp: type, default: Any = _MISSING) -> Any:
            # A wrong value in config.json fails here, naming the key, not deep inside the model.
            if key not in hf or hf[key] is None:
                if default is _MISSING:
                    raise ConfigError(f"config.json.{key}: missing from config.json")
                return default
            return _convert(hf[key], tp, f"config.json.{key}")

        hidden = num("hidden_size", int)
        heads = num("num_attention_heads", int)
        _require(heads > 0, "config.json.num_attention_heads", f"must be > 0, got {heads}")
        kwargs = dict(
            vocab_size=num("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=num("intermediate_size", int),
            num_layers=num("num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=num("num_key_value_heads", int, heads),
            head_dim=num("head_dim", int, hidden // heads),
            rope_theta=_convert(rope_theta, float, "config.json.rope_theta"),
            rms_norm_eps=num("rms_norm_eps", float, 1e-6),
            tie_word_embeddings=num("tie_word_embeddings", bool, False),
            max_position_embeddings=num("max_position_embeddings", int, 40960),
            mask_token_id=num("mask_token_id", int, None),
            block_size=num("block_size", int, None),
            bos_token_id=num("bos_token_id", int, None),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=num("pad_token_id", int, None),
        )
        kwargs.update(overrides)
        cfg = cls(**kwargs)
        try:
            cfg.validate("config.json")
        except ConfigError as e:  # name the key as config.json spells it
            msg = str(e)
            for ours, theirs in _HF_KEY_NAMES.items():
                msg = msg.replace(f"config.json.{ours}:", f"config.json.{theirs}:")
            raise ConfigError(msg) from None
        return cfg

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": torch_dtype or self.param_dtype,
            "dtype": torch_dtype or self.param_dtype,
        }
        for k in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id", "block_size"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


# --------------------------------------------------------------------------------------
# Mesh
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh ``data × fsdp × tensor``.  ``-1`` on one axis takes the remaining devices.

    ``target_devices`` / ``drafter_devices`` split the devices for serving (spec §5): the
    first ``target_devices`` go to the target, the next ``drafter_devices`` to the drafter;
    0 means "share all devices" (one device: both share it).
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    target_devices: int = 0
    drafter_devices: int = 0
    # logical axis -> mesh axes; None means the defaults in d3d_jax.parallel.sharding
    rules: tuple[tuple[str, Any], ...] | None = None

    def validate(self, prefix: str = "mesh") -> None:
        for name in ("data", "fsdp", "tensor"):
            v = getattr(self, name)
            _require(v == -1 or v >= 1, f"{prefix}.{name}", f"must be >= 1 or -1, got {v}")
        _require([self.data, self.fsdp, self.tensor].count(-1) <= 1, prefix,
                 "at most one of data/fsdp/tensor may be -1")
        _require(self.target_devices >= 0, f"{prefix}.target_devices", "must be >= 0")
        _require(self.drafter_devices >= 0, f"{prefix}.drafter_devices", "must be >= 0")

    def axis_sizes(self, num_devices: int) -> tuple[int, int, int]:
        """Resolve -1 and check the product equals ``num_devices``."""
        sizes = [self.data, self.fsdp, self.tensor]
        fixed = 1
        for s in sizes:
            if s != -1:
                fixed *= s
        if -1 in sizes:
            if num_devices % fixed:
                raise ConfigError(f"mesh: data×fsdp×tensor fixed part {fixed} does not divide "
                                  f"the {num_devices} devices")
            sizes[sizes.index(-1)] = num_devices // fixed
        if sizes[0] * sizes[1] * sizes[2] != num_devices:
            raise ConfigError(f"mesh: data×fsdp×tensor = {sizes[0]}×{sizes[1]}×{sizes[2]} "
                              f"= {sizes[0] * sizes[1] * sizes[2]} but {num_devices} devices are used")
        return sizes[0], sizes[1], sizes[2]


# --------------------------------------------------------------------------------------
# Generic YAML + overrides loader
# --------------------------------------------------------------------------------------
def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the declared field type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: cannot interpret {value!r} as {tp}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return build_dataclass(tp, value, key)
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if args and not (len(args) == 2 and args[1] is Ellipsis) and origin is tuple:
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(v, a, key) for v, a in zip(value, args))
        elem = args[0] if args else Any
        out = [_convert(v, elem, key) for v in value]
        return tuple(out) if (origin is tuple or tp is tuple) else out
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key}: expected a boolean, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def build_dataclass(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build (nested) dataclass ``cls`` from a mapping, converting and checking every key."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in fields:
            raise ConfigError(f"{key}: unknown key (known: {', '.join(sorted(fields))})")
        kwargs[k] = _convert(v, hints[k], key)
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None
    return obj


def _parse_scalar(text: str) -> Any:
    """Parse the right-hand side of ``key=value`` with YAML rules (numbers, bools, lists)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    node[parts[-1]] = value


def _deep_merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | os.PathLike) -> dict:
    """Read a YAML config, resolving ``include:`` (paths relative to the file or configs/)."""
    path = Path(path)
    if not path.exists() and (CONFIG_DIR / path).exists():
        path = CONFIG_DIR / path
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        inc_path = path.parent / inc
        if not inc_path.exists():
            inc_path = CONFIG_DIR / inc
        merged = _deep_merge(merged, read_yaml(inc_path))
    return _deep_merge(merged, data)


def parse_overrides(overrides: Sequence[str]) -> dict:
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item}: overrides must look like key=value")
        k, v = item.split("=", 1)
        _set_dotted(tree, k.strip(), _parse_scalar(v))
    return tree


def load_config(cls: type, paths: Sequence[str | os.PathLike] = (), overrides: Sequence[str] = ()) -> Any:
    """Load dataclass ``cls`` from YAML ``paths`` merged in order, then ``key=value`` overrides.

    A ``model: path/to/model.yaml`` string value of a section is read as a YAML file too.
    Validation runs ``cls.validate()`` when it exists.
    """
    tree: dict = {}
    for p in paths:
        tree = _deep_merge(tree, read_yaml(p))
    tree = _deep_merge(tree, parse_overrides(overrides))
    hints = typing.get_type_hints(cls)
    for k, v in list(tree.items()):
        if isinstance(v, str) and k in hints and dataclasses.is_dataclass(hints[k]) and (
                v.endswith(".yaml") or v.endswith(".yml")):
            tree[k] = read_yaml(v)
    cfg = build_dataclass(cls, tree)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def parse_config_cli(cls: type, argv: Sequence[str] | None, description: str | None = None,
                     add_arguments: Any = None) -> tuple[Any, Any]:
    """The shared shape of our config-driven programs: ``--config A.yaml [--config B.yaml] key=value …``.

    Returns ``(config, args)``; a bad config prints ``config error: …`` naming the key and
    returns ``(None, args)`` so the program can exit with status 2.
    """
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[], help=f"YAML with {cls.__name__} fields")
    if add_arguments is not None:
        add_arguments(ap)
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100")
    args = ap.parse_args(argv)
    try:
        return load_config(cls, args.config, args.overrides), args
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return None, args


def load_model_config(path_or_name: str | os.PathLike, overrides: Sequence[str] = ()) -> ModelConfig:
    """A model config from a YAML file, a name in configs/models, or an HF directory/config.json."""
    p = Path(path_or_name)
    if p.is_dir():
        p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"{path_or_name}: no config.json in this directory")
    if p.suffix == ".json":
        with open(p) as f:
            cfg = ModelConfig.from_hf_dict(json.load(f))
        if overrides:  # key=value on top of an HF config, converted and checked like YAML ones
            cfg = build_dataclass(ModelConfig, _deep_merge(dataclasses.asdict(cfg), parse_overrides(overrides)))
            cfg.validate()
        return cfg
    if not p.exists() and p.suffix not in (".yaml", ".yml"):  # a name; may contain dots ("qwen3-0.6b")
        p = CONFIG_DIR / "models" / f"{path_or_name}.yaml"
    cfg = load_config(ModelConfig, [p], overrides)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` that re-validates."""
    new = dataclasses.replace(cfg, **changes)
    if hasattr(new, "validate"):
        new.validate()
    return new


# --------------------------------------------------------------------------------------
# Training (issue 4): data, objective, optimiser, loop, and the run that combines them
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Packed block-diffusion rows (spec §2.1-2.3) or plain LM token streams.

    A packed row is ``[clean (packed_length - num_anchors·block_size) | num_anchors blocks]``.
    """

    mode: str = "d3d"  # "d3d": regenerated-response JSONL -> packed rows; "lm": text -> AR only
    train_path: str = ""  # JSONL (d3d: id/messages/response_token_ids...; lm: {"text"} or plain text)
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

    def validate(self, prefix: str = "data") -> None:
        _require(self.mode in ("d3d", "lm"), f"{prefix}.mode", f"must be 'd3d' or 'lm', got {self.mode!r}")
        _require(self.block_size >= 2, f"{prefix}.block_size", "must be >= 2")
        _require(self.num_anchors >= 1, f"{prefix}.num_anchors", "must be >= 1")
        _require(self.batch_size >= 1, f"{prefix}.batch_size", "must be >= 1")
        _require(self.dev_batches >= 0, f"{prefix}.dev_batches", "must be >= 0")
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
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # 0 disables clipping
    grad_accum_steps: int = 1
    quant_block_size: int = 256  # 8-bit moments: one float32 scale per this many entries

    def validate(self, prefix: str = "optim") -> None:
        _require(self.name in ("adamw", "adamw8bit"), f"{prefix}.name",
                 f"must be 'adamw' or 'adamw8bit', got {self.name!r}")
        _require(self.learning_rate > 0, f"{prefix}.learning_rate", "must be > 0")
        _require(0 <= self.final_learning_rate <= self.learning_rate, f"{prefix}.final_learning_rate",
                 "must be in [0, learning_rate]")
        _require(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
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
    gradient_checkpointing: bool | None = None

    def validate(self, prefix: str = "train") -> None:
        _require(self.steps >= 1, f"{prefix}.steps", "must be >= 1")
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
        micro, rem = divmod(self.data.batch_size, self.optim.grad_accum_steps)
        _require(rem == 0, f"{p}data.batch_size", f"{self.data.batch_size} is not a multiple of "
                 f"optim.grad_accum_steps={self.optim.grad_accum_steps}")
        _require(micro % (data_par * fsdp) == 0, f"{p}data.batch_size",
                 f"micro-batch {micro} (batch_size / grad_accum_steps) is not divisible by "
                 f"mesh data×fsdp = {data_par}×{fsdp}")
        _require(self.data.packed_length <= self.model.max_position_embeddings, f"{p}data.packed_length",
                 f"{self.data.packed_length} exceeds model.max_position_embeddings="
                 f"{self.model.max_position_embeddings}")


# --------------------------------------------------------------------------------------
# Regeneration (issue 5): the target rewrites every response (spec §2.1)
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    """Sampling and batching of ``train/regenerate_data.py`` (defaults: Qwen3 non-thinking)."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20  # 0 = off
    greedy: bool = False  # overrides temperature/top_p/top_k with argmax decoding
    max_new_tokens: int = 512
    seed: int = 0
    batch_size: int = 8
    max_records: int | None = None  # stop after this many new records (rerun resumes)
    max_prompt_tokens: int | None = None  # None: max_position_embeddings - max_new_tokens
    cache_multiple: int = 64  # KV cache lengths are rounded up to this (bounded recompiles)
    process_index: int | None = None  # None: jax.process_index()
    process_count: int | None = None  # None: jax.process_count()
    dtype: str | None = None  # cast the target after loading (None: as stored)
    # Each process loads the target onto a mesh over its own devices (prompts, not tensors, are
    # split across processes); num_devices 0 = all of this process's devices.
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    num_devices: int = 0

    def validate(self, prefix: str = "regenerate") -> None:
        self.mesh.validate(f"{prefix}.mesh")
        _require(self.num_devices >= 0, f"{prefix}.num_devices", "must be >= 0")
        _require(self.temperature >= 0, f"{prefix}.temperature", f"must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"{prefix}.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, f"{prefix}.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        _require(self.max_new_tokens >= 1, f"{prefix}.max_new_tokens", "must be >= 1")
        _require(self.batch_size >= 1, f"{prefix}.batch_size", "must be >= 1")
        _require(self.cache_multiple >= 1, f"{prefix}.cache_multiple", "must be >= 1")
        if self.max_records is not None:
            _require(self.max_records >= 0, f"{prefix}.max_records", "must be >= 0")
        if self.max_prompt_tokens is not None:
            _require(self.max_prompt_tokens >= 1, f"{prefix}.max_prompt_tokens", "must be >= 1")
        if self.process_count is not None:
            _require(self.process_count >= 1, f"{prefix}.process_count", "must be >= 1")
        if self.process_index is not None:
            _require(self.process_index >= 0, f"{prefix}.process_index", "must be >= 0")
            if self.process_count is not None:
                _require(self.process_index < self.process_count, f"{prefix}.process_index",
                         f"must be < process_count={self.process_count}, got {self.process_index}")
        if self.dtype is not None:
            _require(self.dtype in DTYPES, f"{prefix}.dtype", f"must be one of {DTYPES}")


# --------------------------------------------------------------------------------------
# Pipeline (issue 8): the embedded default end to end (train/pipeline.py)
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

    def validate(self, prefix: str = "drafter") -> None:
        _require(self.init in ("small", "target", "random"), f"{prefix}.init",
                 f"must be 'small', 'target' or 'random', got {self.init!r}")
        _require(self.ar_weight >= 0, f"{prefix}.ar_weight", "must be >= 0")
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
    prune_recover_steps: int = 50
    prune_margin: float = 0.1
    # (7) benchmark
    eval_benchmarks: tuple[str, ...] = ("humaneval", "shakespeare")
    eval_samples: int = 8
    eval_max_new_tokens: int = 128
    eval_drafters: tuple[str, ...] = ("small",)
    async_positions: int = 12
    async_fanout: int = 2
    async_sweep: tuple[tuple[int, int], ...] = ()
    hf_peer: bool = True

    def validate(self, prefix: str = "") -> None:
        p = f"{prefix}." if prefix else ""
        _require(self.vocab_size >= 300, f"{p}vocab_size", "must be >= 300")
        self.target.validate(f"{p}target")
        self.small.validate(f"{p}small")
        for k in ("regen_prompts", "regen_max_new_tokens", "drafter_steps", "eval_samples",
                  "eval_max_new_tokens", "passage_chars"):
            _require(getattr(self, k) >= 1, f"{p}{k}", "must be >= 1")
        _require(self.block_size >= 3, f"{p}block_size", "must be >= 3")
        _require(self.drafter_packed_length > self.drafter_num_anchors * self.block_size + self.block_size,
                 f"{p}drafter_packed_length", "leaves no room for the clean stream")
        names = [d.name for d in self.drafters]
        _require(len(set(names)) == len(names), f"{p}drafters", f"names must be unique, got {names}")
        for i, d in enumerate(self.drafters):
            d.validate(f"{p}drafters[{i}]")
        for n in self.eval_drafters:
            _require(n in names or n == f"{self.prune_drafter}_pruned", f"{p}eval_drafters",
                     f"{n!r} is not a drafter name ({names}) nor '<prune_drafter>_pruned'")
        if self.prune_drafter:
            _require(self.prune_drafter in names, f"{p}prune_drafter", f"{self.prune_drafter!r} not in {names}")


# --------------------------------------------------------------------------------------
# Pruning (issue 7): acceptance-guided progressive layer pruning (spec §3)
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
