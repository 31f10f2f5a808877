"""RoPE scaling settings (transformers 5's ``rope_parameters`` / legacy ``rope_scaling``): what a
``config.json`` may ask for, read the way transformers reads it, or refused in one line.

Every scaling form of transformers 5 that a Qwen3 can use is honoured (the frequencies are in
:mod:`d3d_jax.model.rope`): ``default``, ``linear``, ``dynamic`` (NTK), ``yarn`` (Qwen3's
long-context mode), ``longrope`` and ``llama3``.  What transformers would read differently from
what the file seems to say (``rope_scaling`` next to a ``rope_parameters`` whose ``rope_theta``
transformers then drops), per-layer RoPE, ``partial_rotary_factor`` and keys no form knows are
refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from d3d_jax.config.base import ConfigError, _require, above, between, one_of

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Keys each form reads (beside rope_type/type and rope_theta), as transformers 5 validates them.
_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
# Keys the file must have (transformers raises KeyError without them), and fields that may not be
# null (yarn's factor may: it is then max_position_embeddings / original_max_position_embeddings).
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "longrope": ("short_factor", "long_factor"), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
_NOT_NULL = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (),
             "longrope": ("short_factor", "long_factor"), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
# Forms whose pretraining length defaults to max_position_embeddings (transformers' standardisation).
_NEEDS_ORIGINAL = ("yarn", "longrope", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A non-default RoPE form (``None`` on :class:`~d3d_jax.config.ModelConfig` is plain RoPE).

    Field meanings are transformers' (``modeling_rope_utils``): ``factor`` the context extension,
    ``original_max_position_embeddings`` the pretraining length; YaRN's ``attention_factor``
    (None: ``0.1·ln(factor) + 1``, or the ``mscale``/``mscale_all_dim`` ratio), ``beta_fast`` /
    ``beta_slow`` (None: 32 / 1) and ``truncate``; llama3's ``low_freq_factor`` /
    ``high_freq_factor``; longrope's per-frequency ``short_factor`` / ``long_factor``.
    """

    rope_type: str = "linear"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(rope_type=one_of(*ROPE_TYPES), factor=above(0, 1e6),
                  original_max_position_embeddings=between(1, 1 << 24), attention_factor=above(0, 1e3),
                  beta_fast=above(0, 1e6), beta_slow=above(0, 1e6), mscale=above(0, 1e3),
                  mscale_all_dim=between(0, 1e3), low_freq_factor=above(0, 1e6), high_freq_factor=above(0, 1e6),
                  short_factor=above(0, 1e6), long_factor=above(0, 1e6))

    def validate(self, prefix: str, head_dim: int, max_position_embeddings: int, theta: float) -> None:
        t = self.rope_type
        _require(t in ROPE_TYPES and t != "default", f"{prefix}.rope_type",
                 f"must be one of {', '.join(ROPE_TYPES[1:])}, got {t!r}")
        for name in _NOT_NULL[t]:
            _require(getattr(self, name) is not None, f"{prefix}.{name}", f"rope_type {t!r} needs it")
        if self.factor is not None:
            _require(math.isfinite(self.factor) and self.factor >= 1, f"{prefix}.factor",
                     f"must be a finite number >= 1, got {self.factor}")
        if t in _NEEDS_ORIGINAL:
            orig = self.original_max_position_embeddings
            _require(orig is not None and orig >= 1, f"{prefix}.original_max_position_embeddings",
                     f"must be >= 1, got {orig}")
            if self.factor is None:  # transformers derives it
                _require(max_position_embeddings >= orig, f"{prefix}.factor",
                         "missing, and max_position_embeddings / original_max_position_embeddings < 1")
        for name in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                     "low_freq_factor", "high_freq_factor"):
            v = getattr(self, name)
            _require(v is None or math.isfinite(v), f"{prefix}.{name}", f"must be finite, got {v}")
        if self.attention_factor is not None:
            _require(self.attention_factor > 0, f"{prefix}.attention_factor", "must be > 0")
        if t == "llama3":
            _require(self.high_freq_factor > self.low_freq_factor > 0, f"{prefix}.high_freq_factor",
                     f"must be > low_freq_factor > 0, got {self.high_freq_factor} and {self.low_freq_factor}")
        if t == "longrope":
            for name in ("short_factor", "long_factor"):
                v = getattr(self, name)
                _require(len(v) == head_dim // 2 and all(math.isfinite(x) and x > 0 for x in v),
                         f"{prefix}.{name}", f"must be {head_dim // 2} positive numbers (head_dim / 2), got {len(v)}")
        if t == "dynamic":  # NTK's exponent dim / (dim - 2)
            _require(head_dim > 2, f"{prefix}.rope_type", f"'dynamic' needs head_dim > 2, got {head_dim}")
        if t == "yarn":  # its correction range divides by log(rope_theta)
            _require(theta > 1, f"{prefix}.rope_type", f"'yarn' needs rope_theta > 1, got {theta}")
            _require((self.beta_fast or 32) > (self.beta_slow or 1), f"{prefix}.beta_fast",
                     "must be greater than beta_slow")

    def effective_factor(self, max_position_embeddings: int) -> float:
        """``factor``, or (yarn, longrope) max_position_embeddings / original_max_position_embeddings."""
        if self.factor is not None:
            return float(self.factor)
        return max_position_embeddings / self.original_max_position_embeddings


def _number(value: Any, key: str, integer: bool = False) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ConfigError(f"{key}: expected {'an integer' if integer else 'a number'}, got {value!r}")
    return value


def _factors(value: Any, key: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list of numbers, got {value!r}")
    return tuple(float(_number(v, key)) for v in value)


def _rope_dict(hf: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``(key, dict)`` of the RoPE settings transformers uses: ``rope_scaling`` replaces
    ``rope_parameters`` whenever it is non-empty."""
    scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    key, rope = ("rope_scaling", scaling) if scaling else ("rope_parameters", params)
    if not rope:
        return key, {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"config.json.{key}: expected an object, got {rope!r}")
    if scaling and isinstance(params, Mapping) and "rope_theta" in params and "rope_theta" not in scaling:
        used = hf.get("rope_theta", 10_000.0)
        if params["rope_theta"] != used:
            raise ConfigError(
                f"config.json.rope_scaling: replaces rope_parameters (as transformers reads the file), so "
                f"rope_parameters.rope_theta={params['rope_theta']} would be dropped for rope_theta={used}; add "
                f"\"rope_theta\": {params['rope_theta']} to rope_scaling, or move its fields into rope_parameters")
    layer_types = hf.get("layer_types") if isinstance(hf.get("layer_types"), list) else []
    nested = [k for k in rope if k in layer_types or k in ("full_attention", "sliding_attention")]
    if nested:
        raise ConfigError(f"config.json.{key}.{nested[0]}: per-layer RoPE is not supported (Qwen3 uses one)")
    return key, rope


def rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of a ``config.json``, read with transformers 5's priorities:
    ``rope_scaling`` over ``rope_parameters``; ``rope_theta`` inside them over the top-level one
    over 10000; a pretraining length from the top-level ``original_max_position_embeddings``,
    then the dict's, then ``max_position_embeddings``."""
    key, rope = _rope_dict(hf)
    where = f"config.json.{key}"
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise ConfigError(f"{where}.rope_type: {rtype!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    theta = 10_000.0 if theta is None else _number(theta, f"{where}.rope_theta")
    for k, v in (("partial_rotary_factor", rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))),):
        if v not in (None, 1, 1.0):
            raise ConfigError(f"config.json.{k}: {v!r} is not supported (Qwen3 rotates the whole head)")
    unknown = sorted(set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", *_KEYS[rtype]})
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: not a field of rope_type {rtype!r} "
                          f"(its fields: {', '.join(_KEYS[rtype]) or 'rope_theta only'})")
    missing = [k for k in _REQUIRED.get(rtype, ()) if k not in rope]
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: missing (rope_type {rtype!r} needs it)")
    if rtype == "default":
        return float(theta), None
    fields: dict[str, Any] = {"rope_type": rtype}
    for k in _KEYS[rtype]:
        if k in ("short_factor", "long_factor"):
            fields[k] = _factors(rope.get(k), f"{where}.{k}")
        elif k == "truncate":
            v = rope.get(k, True)
            if not isinstance(v, bool):
                raise ConfigError(f"{where}.truncate: expected a boolean, got {v!r}")
            fields[k] = v
        elif k != "original_max_position_embeddings":
            fields[k] = _number(rope.get(k), f"{where}.{k}")
    if rtype in _NEEDS_ORIGINAL:
        top = hf.get("original_max_position_embeddings")
        orig = top if top is not None else rope.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        fields["original_max_position_embeddings"] = _number(
            orig, "config.json.original_max_position_embeddings" if top is not None else
            f"{where}.original_max_position_embeddings", integer=True)
    return float(theta), RopeScaling(**fields)


def rope_to_hf(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """The ``rope_parameters`` entry transformers reads back as the same RoPE."""
    out: dict[str, Any] = {"rope_type": "default" if scaling is None else scaling.rope_type, "rope_theta": theta}
    if scaling is not None:
        for k in _KEYS[scaling.rope_type]:
            v = getattr(scaling, k)
            if v is not None:
                out[k] = list(v) if isinstance(v, tuple) else v
    return out
