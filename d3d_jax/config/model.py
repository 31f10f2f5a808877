"""Model and mesh configs."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from d3d_jax.config.base import (CONFIG_DIR, DTYPES, ConfigError, _HF_KEY_NAMES, _MISSING,  # noqa: F401
                                 _convert, _deep_merge, _require, build_dataclass, load_config,
                                 parse_overrides)
from d3d_jax.config.base import above, between, check_fields, checked, one_of
from d3d_jax.config.limits import INT32_MAX, MAX_BLOCK_SIZE
from d3d_jax.config.rope import RopeScaling, rope_to_hf


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------
# Attention backends (d3d_jax.model.attention) and the platforms each runs on.
ATTENTION_BACKENDS: dict[str, tuple[str, ...]] = {
    "xla": ("cpu", "gpu", "tpu"),  # the reference: dense scores, every platform
    "pallas_interpret": ("cpu", "gpu", "tpu"),  # the fused kernel run as plain JAX (tests; slow)
    "pallas": ("gpu", "tpu"),  # the fused kernel compiled by Triton (GPU) or Mosaic (TPU)
}
# Layer rematerialisation policies (names of jax.checkpoint_policies, see qwen3.remat_policy).
REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch", "save_attention")


def _platform() -> str:
    import jax  # deferred: only a non-default backend needs to know the platform

    return jax.default_backend()


def check_attention_backend(name: str, key: str = "model.attention_backend") -> None:
    """Refuse an unknown backend, or one this platform cannot run, naming those it can."""
    if name == "xla":  # runs everywhere; do not start a JAX backend just to say so
        return
    platform = _platform()
    here = [b for b, ps in ATTENTION_BACKENDS.items() if platform in ps]
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"{key}: unknown attention backend {name!r}; available on {platform}: "
                          f"{', '.join(here)}")
    if platform not in ATTENTION_BACKENDS[name]:
        raise ConfigError(f"{key}: {name!r} needs {' or '.join(ATTENTION_BACKENDS[name])}, this is "
                          f"{platform}; available on {platform}: {', '.join(here)}")


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
    # None: plain RoPE; else linear / dynamic / yarn / longrope / llama3 (d3d_jax.config.rope).
    rope_scaling: RopeScaling | None = None
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
    # Deprecated alias of remat_policy="full" (still honoured when remat_policy is "none").
    gradient_checkpointing: bool = False
    # Runtime choices, not part of an HF config.json: attention kernel and per-layer remat.
    attention_backend: str = "xla"
    remat_policy: str = "none"

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(vocab_size=between(1, 1 << 24), hidden_size=between(1, 1 << 17),
                  intermediate_size=between(1, 1 << 20), num_layers=between(1, 1024), num_heads=between(1, 4096),
                  num_kv_heads=between(1, 4096), head_dim=between(2, 4096), rope_theta=above(0, 1e12),
                  rms_norm_eps=above(0, 1), max_position_embeddings=between(1, 1 << 24),
                  param_dtype=one_of(*DTYPES), dtype=one_of(*DTYPES), mask_token_id=between(0, INT32_MAX),
                  block_size=between(2, MAX_BLOCK_SIZE), bos_token_id=between(0, INT32_MAX),
                  eos_token_id=between(0, INT32_MAX), pad_token_id=between(0, INT32_MAX),
                  attention_backend=one_of(*ATTENTION_BACKENDS), remat_policy=one_of(*REMAT_POLICIES))

    # How a run computes, not what the weights are: a saved checkpoint stores their defaults, so
    # one exported from a GPU run (attention_backend=pallas) loads on a CPU host.
    RUNTIME_ONLY = ("attention_backend", "remat_policy", "gradient_checkpointing")

    def portable(self) -> "ModelConfig":
        """This config with the runtime-only fields at their defaults (what checkpoints store)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in self.RUNTIME_ONLY}
        return dataclasses.replace(self, **defaults)

    def validate(self, prefix: str = "model") -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _require(getattr(self, name) > 0, f"{prefix}.{name}", f"must be > 0, got {getattr(self, name)}")
        _require(self.num_heads % self.num_kv_heads == 0, f"{prefix}.num_kv_heads",
                 f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        _require(self.head_dim % 2 == 0, f"{prefix}.head_dim", "must be even (RoPE rotates pairs)")
        _require(0 < self.rope_theta < float("inf"), f"{prefix}.rope_theta", f"must be > 0 and finite, got "
                 f"{self.rope_theta}")
        _require(0 < self.rms_norm_eps < 1, f"{prefix}.rms_norm_eps", f"must be > 0 and < 1, got {self.rms_norm_eps}")
        _require(self.param_dtype in DTYPES, f"{prefix}.param_dtype", f"must be one of {DTYPES}")
        _require(self.dtype in DTYPES, f"{prefix}.dtype", f"must be one of {DTYPES}")
        if self.rope_scaling is not None:
            self.rope_scaling.validate(f"{prefix}.rope_scaling", self.head_dim, self.max_position_embeddings,
                                      self.rope_theta)
        self._validate_token_ids(prefix)
        if self.block_size is not None:
            _require(self.block_size >= 2, f"{prefix}.block_size", "must be >= 2")
        _require(self.remat_policy in REMAT_POLICIES, f"{prefix}.remat_policy",
                 f"must be one of {', '.join(REMAT_POLICIES)}, got {self.remat_policy!r}")
        self._validate_attention(prefix)
        check_fields(self, prefix)  # the declared BOUNDS, after the named checks above

    def _validate_token_ids(self, prefix: str) -> None:
        """Every id the config names lies in the vocabulary: an EOS id outside it would never end
        a response (and used to be dropped without a word)."""
        eos = self.eos_token_id
        named = [("mask_token_id", self.mask_token_id), ("bos_token_id", self.bos_token_id),
                 ("pad_token_id", self.pad_token_id)]
        named += [("eos_token_id", t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])]
        for key, value in named:
            if value is not None:
                _require(0 <= value < self.vocab_size, f"{prefix}.{key}",
                         f"{value} is outside the vocabulary [0, {self.vocab_size})")

    def _validate_attention(self, prefix: str, key: str | None = None) -> None:
        key, h = key or f"{prefix}.attention_backend", self.head_dim
        check_attention_backend(self.attention_backend, key)
        if self.attention_backend != "pallas":
            return
        if _platform() == "tpu":  # one head is a column block of 128 lanes
            _require(h % 128 == 0, key, f"'pallas' on tpu needs head_dim a multiple of 128, got {h}")
        else:  # Triton tiles: power-of-two widths, dots >= 16
            _require(h >= 16 and h & (h - 1) == 0, key, f"'pallas' needs a power-of-two head_dim >= 16, "
                     f"got {h}")

    @property
    def layer_remat(self) -> str:
        """The remat policy in force: ``remat_policy``, or ``"full"`` for the old boolean."""
        if self.remat_policy == "none" and self.gradient_checkpointing:
            return "full"
        return self.remat_policy

    @property
    def context_length(self) -> int:
        """Positions the model is meant for: ``max_position_embeddings``, or what its RoPE scaling
        extends the pretraining length to (YaRN factor 4 on 32768: 131072, Qwen3's long context)."""
        s = self.rope_scaling
        if s is None:
            return self.max_position_embeddings
        orig = s.original_max_position_embeddings or self.max_position_embeddings
        return max(self.max_position_embeddings, int(s.effective_factor(self.max_position_embeddings) * orig))

    # ---- Hugging Face config.json ------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Build from a Qwen3 ``config.json``: every field that changes the maths is honoured as
        transformers reads it or refused naming it (:mod:`d3d_jax.config.hf_config`)."""
        from d3d_jax.config.hf_config import model_fields_from_hf

        kwargs = model_fields_from_hf(hf)
        kwargs.update(overrides)
        cfg = cls(**kwargs)
        try:
            cfg.validate("config.json")
        except ConfigError as e:  # name the key as config.json spells it
            msg = str(e)
            for ours, theirs in _HF_KEY_NAMES.items():
                msg = msg.replace(f"config.json.{ours}:", f"config.json.{theirs}:")
            used = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"  # the key the file used
            raise ConfigError(msg.replace("config.json.rope_scaling.", f"config.json.{used}.")) from None
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
            "rope_parameters": rope_to_hf(self.rope_theta, self.rope_scaling),
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


# What a decoding command's --attention chooses between; auto resolves by
# :func:`decoding_attention`.
ATTENTION_CHOICES = ("auto", "xla", "pallas")


def decoding_attention(choice: str, cfg: ModelConfig, key: str = "models.attention") -> str:
    """The attention backend a decoding command runs ``cfg``'s model on.  ``auto``: the fused
    kernels (``pallas``) on GPU and TPU where this model's head width suits them, else ``xla``
    (a CPU runs the reference faster than the kernels interpreted); another choice as given,
    refused by name where this platform or this model cannot run it."""
    _require(choice in ATTENTION_CHOICES, key, f"must be one of {'|'.join(ATTENTION_CHOICES)}, got {choice!r}")
    if choice != "auto":
        dataclasses.replace(cfg, attention_backend=choice)._validate_attention("", key)
        return choice
    if _platform() not in ATTENTION_BACKENDS["pallas"]:
        return "xla"
    try:
        dataclasses.replace(cfg, attention_backend="pallas")._validate_attention("", key)
    except ConfigError:  # e.g. a head width Triton cannot tile: the reference runs it
        return "xla"
    return "pallas"


# --------------------------------------------------------------------------------------
# Mesh
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh ``data × fsdp × tensor``.  ``-1`` on one axis takes the remaining devices.
    Decoding splits devices between target and drafter with ``decoder.target_devices`` and
    ``decoder.drafter_devices``, not here."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    # logical axis -> mesh axes; None means the defaults in d3d_jax.parallel.sharding
    rules: tuple[tuple[str, Any], ...] | None = None

    # keys a user may look for here, and where they live (config.base names them on refusal)
    ELSEWHERE = {k: f"decoder.{k} (--{k.replace('_', '-')}), read by generate, serve and eval"
                 for k in ("target_devices", "drafter_devices")}
    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(data=between(-1, 1 << 16), fsdp=between(-1, 1 << 16), tensor=between(-1, 1 << 16),
                  rules=checked("parallel.sharding: logical axis -> mesh axes"))

    def validate(self, prefix: str = "mesh") -> None:
        for name in ("data", "fsdp", "tensor"):
            v = getattr(self, name)
            _require(v == -1 or v >= 1, f"{prefix}.{name}", f"must be >= 1 or -1, got {v}")
        _require([self.data, self.fsdp, self.tensor].count(-1) <= 1, prefix,
                 "at most one of data/fsdp/tensor may be -1")

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

def load_model_config(path_or_name: str | os.PathLike, overrides: Sequence[str] = ()) -> ModelConfig:
    """A model config from a YAML file, a name in configs/models, or an HF directory/config.json."""
    p = Path(path_or_name)
    if p.is_dir():
        p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"{path_or_name}: no config.json in this directory")
    if p.suffix == ".json":
        from d3d_jax.io.files import read_json  # io/ stands on config/: imported here, not at the top

        hf = read_json(p, "a model config", ConfigError)
        if not isinstance(hf, dict):  # was: AttributeError on a list
            raise ConfigError(f"{p}: top level must be an object")
        cfg = ModelConfig.from_hf_dict(hf)
        if overrides:  # key=value on top of an HF config, converted and checked like YAML ones
            cfg = build_dataclass(ModelConfig, _deep_merge(dataclasses.asdict(cfg), parse_overrides(overrides)))
            cfg.validate()
        return cfg
    if not p.exists() and p.suffix not in (".yaml", ".yml"):  # a name; may contain dots ("qwen3-0.6b")
        p = CONFIG_DIR / "models" / f"{path_or_name}.yaml"
    cfg = load_config(ModelConfig, [p], overrides)
    return cfg
