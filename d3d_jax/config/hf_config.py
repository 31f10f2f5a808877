"""A Qwen3 ``config.json`` read field by field: every field that changes the maths is honoured as
transformers 5's ``Qwen3Config`` reads it, or refused in one line naming the field.

Types are JSON's and as strict as transformers' (``"vocab_size": 2048.0`` is not an integer, a
string is never a number); absent fields take ``Qwen3Config``'s defaults (``head_dim`` 128,
``max_position_embeddings`` 32768, ``hidden_act`` silu).  Refused, because our Qwen3 does not
compute them: attention biases, sliding-window layers, another activation, dropout, quantized
weights (and the RoPE forms :mod:`d3d_jax.config.rope` refuses).  Fields that change nothing
(``initializer_range``, ``use_cache``, ``architectures`` ...) are ignored, as transformers does.
"""

from __future__ import annotations

from typing import Any, Mapping

from d3d_jax.config.base import ConfigError, _require
from d3d_jax.config.rope import rope_from_hf

_MISSING = object()
# Qwen3Config field -> (JSON type, default; _MISSING: the file must give it)
_FIELDS: dict[str, tuple[type, Any]] = {
    "vocab_size": (int, _MISSING), "hidden_size": (int, _MISSING), "intermediate_size": (int, _MISSING),
    "num_hidden_layers": (int, _MISSING), "num_attention_heads": (int, _MISSING),
    "head_dim": (int, 128), "max_position_embeddings": (int, 32768), "rms_norm_eps": (float, 1e-6),
    "tie_word_embeddings": (bool, False), "attention_bias": (bool, False), "use_sliding_window": (bool, False),
    "max_window_layers": (int, 28), "hidden_act": (str, "silu"),
}
# May be null in transformers too (absent: the default after the colon; null: None).
_NULLABLE: dict[str, tuple[type, Any]] = {
    "num_key_value_heads": (int, None), "sliding_window": (int, 4096), "bos_token_id": (int, None),
    "pad_token_id": (int, None), "eos_token_id": (int, None), "mask_token_id": (int, None), "block_size": (int, None),
}
_WANT = {int: "an integer", float: "a number with a fraction or exponent (e.g. 1e-06)", bool: "a boolean",
         str: "a string"}


def _typed(value: Any, tp: type, key: str) -> Any:
    ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"config.json.{key}: expected {_WANT[tp]}, got {value!r}")
    return value


def field(hf: Mapping[str, Any], key: str) -> Any:
    """``hf[key]`` checked against its type, or its default (a refusal when the file must give it)."""
    if key in _NULLABLE:
        tp, default = _NULLABLE[key]
        value = hf.get(key)
        if value is None:  # absent: the default; null: none (no window, no kv-head count ...)
            return None if key in hf else default
        if key == "eos_token_id":  # one id or a list of them, as transformers reads it
            if isinstance(value, list):
                return [_typed(v, int, f"{key}[{i}]") for i, v in enumerate(value)]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"config.json.{key}: expected int | list[int], got {value!r}")
        return _typed(value, tp, key)
    tp, default = _FIELDS[key]
    if key not in hf:
        if default is _MISSING:
            raise ConfigError(f"config.json.{key}: missing from config.json")
        return default
    if hf[key] is None:
        raise ConfigError(f"config.json.{key}: null is not allowed (transformers refuses it too)")
    return _typed(hf[key], tp, key)


def _refuse_unsupported(hf: Mapping[str, Any], num_layers: int) -> None:
    """One line naming the first field our Qwen3 cannot compute as transformers would."""
    if field(hf, "attention_bias"):
        raise ConfigError("config.json.attention_bias: true is not supported (Qwen3's projections have no bias)")
    act = field(hf, "hidden_act")
    _require(act == "silu", "config.json.hidden_act", f"{act!r} is not supported (Qwen3's MLP uses silu)")
    dropout = hf.get("attention_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or dropout != 0:
        raise ConfigError(f"config.json.attention_dropout: {dropout!r} is not supported (no dropout is "
                          f"implemented; Qwen3 uses 0.0)")
    if hf.get("quantization_config") is not None:
        raise ConfigError("config.json.quantization_config: quantized weights are not supported; use a "
                          "bfloat16 or float32 checkpoint")
    for layer, kind in enumerate(_layer_types(hf, num_layers)):
        if kind == "sliding_attention":
            raise ConfigError(f"config.json.use_sliding_window: layer {layer} would use sliding-window "
                              f"attention, which is not supported (Qwen3 uses full attention: "
                              f"use_sliding_window false)")


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> list[str]:
    """Each layer's attention as transformers derives it (sliding only with use_sliding_window)."""
    window, first_sliding = field(hf, "sliding_window"), field(hf, "max_window_layers")  # typed either way
    window = window if field(hf, "use_sliding_window") else None
    given = hf.get("layer_types")
    if given is None:
        return ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                for i in range(num_layers)]
    if not isinstance(given, list) or len(given) != num_layers or any(
            t not in ("full_attention", "sliding_attention") for t in given):
        raise ConfigError(f"config.json.layer_types: expected {num_layers} entries of 'full_attention' or "
                          f"'sliding_attention', got {given!r}")
    return list(given)  # a sliding layer without a window: transformers cannot build it either


def model_fields_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`~d3d_jax.config.ModelConfig` keyword arguments of a Qwen3 ``config.json``."""
    if hf.get("model_type") != "qwen3":
        raise ConfigError(f"model_type: expected 'qwen3', got {hf.get('model_type')!r}")
    heads = field(hf, "num_attention_heads")
    _require(heads > 0, "config.json.num_attention_heads", f"must be > 0, got {heads}")
    layers = field(hf, "num_hidden_layers")
    _require(layers > 0, "config.json.num_hidden_layers", f"must be > 0, got {layers}")
    _refuse_unsupported(hf, layers)
    theta, scaling = rope_from_hf(hf)
    kv = field(hf, "num_key_value_heads")
    return dict(
        vocab_size=field(hf, "vocab_size"), hidden_size=field(hf, "hidden_size"),
        intermediate_size=field(hf, "intermediate_size"), num_layers=layers, num_heads=heads,
        num_kv_heads=heads if kv is None else kv, head_dim=field(hf, "head_dim"), rope_theta=float(theta),
        rope_scaling=scaling, rms_norm_eps=field(hf, "rms_norm_eps"),
        tie_word_embeddings=field(hf, "tie_word_embeddings"),
        max_position_embeddings=field(hf, "max_position_embeddings"),
        **{k: field(hf, k) for k in ("mask_token_id", "block_size", "bos_token_id", "eos_token_id", "pad_token_id")})
